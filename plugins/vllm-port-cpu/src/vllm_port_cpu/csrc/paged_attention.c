/*
 * Paged attention for the CPU plugin: decode and prefill, reading the paged K/V caches in place, and the
 * cache write (reshape_and_cache) at the end of the file.
 *
 * Built at first use by vllm_port_cpu.native (cc -O3 -march=native -fopenmp -shared -fPIC) and
 * called through ctypes with raw pointers and strides; no Python or torch headers, so it compiles
 * in about a second. The semantics are those of vllm_port.ops.attention (paged_attention_reference,
 * prefill_attention_reference): cache [num_blocks, block_size, kv_heads, head_size], token t of a
 * sequence in block block_tables[seq, t / block_size] at offset t % block_size, query head h reads
 * KV head h / (num_heads / kv_heads).
 *
 * One work item (an OpenMP iteration) is (sequence, KV head) at decode and (sequence, KV head, tile
 * of 16 query tokens) at prefill: it handles every query head of the KV head's group, so each K/V
 * row is read once for all of them (widened to float32, or at a bfloat16 decode with AVX-512 BF16
 * used as stored), with software prefetch into L2 ahead of the scattered rows. Keys are visited in chunks of 64 with an online softmax in float32: scores of a
 * chunk for all query rows, the chunk's maximum, one rescale of the partial sums, then the
 * probability-weighted V rows. Decode's few rows take their scores 16 keys to a vector; a prefill
 * tile lays its rows across vector lanes (the query transposed), so scores need no horizontal sums.
 * Only the slots a query may see are read: a padded sequence (seq_len 0) reads nothing, not even
 * its block-table row, and its rows are written as exact zeros.
 *
 * Portable C with `omp simd` loops gcc vectorises for the target (-march=native), and AVX-512
 * intrinsics for the hot loops where the compiler's own code is slow (register-blocked products,
 * tree reductions, float16 conversions), each with the portable loop beside it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "native.h"

/* Keys per chunk of the online softmax: scores for a chunk stay in L1 for every query row. */
#define KEY_CHUNK 64
/* Query tokens per prefill work item: their rows share every K/V row the tile reads. */
#define QUERY_TILE 16
/* How far ahead K and V rows are prefetched, in bytes of K rows: about a memory latency's worth of
 * work at the kernel's pace (measured on Zen 4: 8 bfloat16 rows of 64 leave it waiting, 24 do not). */
#define PREFETCH_BYTES 3072

/* AVX-512 BF16 (vdpbf16ps: float32 sums of exact bfloat16 products): one bfloat16 query token (decode, or
 * a prefill tile of one token) with head_size a multiple of 32 reads its K and V rows as stored: scores by
 * vdpbf16ps on K, V widened in registers inside the weighted sum, no float32 copy of either in scratch.
 * (vdpbf16ps flushes denormal inputs to zero: values under 1.2e-38, nothing a model's keys hold.) */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif

int vp_has_float16(void) { return HAVE_F16; }

/* ---------------------------------------------------------------------------------------------
 * dtype conversion: a row of head_size elements to float32 and back
 * ------------------------------------------------------------------------------------------- */

static inline __attribute__((always_inline)) const float *widen(const void *src, float *buf, int64_t n, int dtype) {
    if (dtype == DT_F32) return (const float *)src;
    if (dtype == DT_BF16) {
        const uint16_t *s = (const uint16_t *)src;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            uint32_t bits = (uint32_t)s[i] << 16; /* bfloat16 is the top half of a float32 */
            float f;
            memcpy(&f, &bits, sizeof f);
            buf[i] = f;
        }
        return buf;
    }
#ifdef __AVX512F__
    if ((n & 15) == 0) { /* gcc 12 does not vectorise _Float16 conversions; vcvtph2ps does 16 at once */
        for (int64_t i = 0; i < n; i += 16)
            _mm512_storeu_ps(buf + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)src + i))));
        return buf;
    }
#endif
#if HAVE_F16
    const f16_t *s = (const f16_t *)src;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) buf[i] = (float)s[i];
#endif
    return buf;
}

static inline uint16_t to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN stays a quiet NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);                                             /* round to nearest even */
    return (uint16_t)(bits >> 16);
}

static inline __attribute__((always_inline)) void narrow(void *dst, const float *src, float mul, int64_t n, int dtype) {
    if (dtype == DT_F32) {
        float *d = (float *)dst;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) d[i] = src[i] * mul;
    } else if (dtype == DT_BF16) {
        uint16_t *d = (uint16_t *)dst;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) d[i] = to_bf16(src[i] * mul);
    } else {
#ifdef __AVX512F__
        if ((n & 15) == 0) {
            const __m512 scale = _mm512_set1_ps(mul);
            for (int64_t i = 0; i < n; i += 16)
                _mm256_storeu_si256((__m256i *)((uint16_t *)dst + i),
                                    _mm512_cvtps_ph(_mm512_mul_ps(_mm512_loadu_ps(src + i), scale),
                                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            return;
        }
#endif
#if HAVE_F16
        f16_t *d = (f16_t *)dst;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) d[i] = (f16_t)(src[i] * mul);
#endif
    }
}

static inline __attribute__((always_inline)) void zero_row(void *dst, int64_t n, int dtype) {
    memset(dst, 0, (size_t)n * (dtype == DT_F32 ? 4 : 2));
}

/* a . b over n floats. With AVX-512 and n a multiple of 16, one vector accumulator and a tree
 * reduction: gcc's own reduction of an `omp simd` loop ends in 16 scalar adds, which costs as much
 * as the products at head_size 64. */
static inline float dot(const float *a, const float *b, int64_t n) {
#ifdef __AVX512F__
    if ((n & 15) == 0) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
        return _mm512_reduce_add_ps(acc);
    }
#endif
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += a[i] * b[i];
    return sum;
}

#ifdef __AVX512F__
/* q . keys[j] for the 16 keys j < 16, in the lanes of one vector (n a multiple of 16). Each key's
 * products sum into a vector of its own; a transposing tree then adds the 16 vectors lane-wise in
 * 45 shuffles and adds, where a reduction per key (dot above) costs 16 dependent chains. With 12
 * query heads over 4 KV heads a decode call took a quarter to a third less CPU time (issue 30). */
static inline __m512 sum16(const __m512 *acc) {
    /* keys 2m, 2m+1 (a, b): [a0+a2, b0+b2, a1+a3, b1+b3] in each 128-bit lane */
    __m512 pairs[8];
    for (int m = 0; m < 8; m++)
        pairs[m] = _mm512_add_ps(_mm512_unpacklo_ps(acc[2 * m], acc[2 * m + 1]),
                                 _mm512_unpackhi_ps(acc[2 * m], acc[2 * m + 1]));
    /* keys 4m..4m+3: each 128-bit lane holds the sums of its four elements, one a key */
    __m512 quads[4];
    for (int m = 0; m < 4; m++) {
        const __m512d lo = _mm512_castps_pd(pairs[2 * m]), hi = _mm512_castps_pd(pairs[2 * m + 1]);
        quads[m] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)), _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
    }
    /* the four 128-bit lanes added: 0x88 takes lanes 0 and 2 of each operand, 0xdd lanes 1 and 3 */
    const __m512 first = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                       _mm512_shuffle_f32x4(quads[0], quads[1], 0xdd));
    const __m512 second = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                        _mm512_shuffle_f32x4(quads[2], quads[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(first, second, 0x88), _mm512_shuffle_f32x4(first, second, 0xdd));
}

static inline __m512 dot16(const float *q, const float *const *keys, int64_t n) {
    __m512 acc[16];
    for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __m512 qi = _mm512_loadu_ps(q + i);
        for (int j = 0; j < 16; j++) acc[j] = _mm512_fmadd_ps(qi, _mm512_loadu_ps(keys[j] + i), acc[j]);
    }
    return sum16(acc);
}

/* 16 bfloat16 elements widened to float32 in a register (bfloat16 is the top half of a float32). */
static inline __m512 widen16(const uint16_t *src) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src)), 16));
}
#endif

#if HAVE_DPBF16
/* dot16 on bfloat16 rows as stored (n a multiple of 32): each vdpbf16ps adds two exact products a lane. */
static inline __m512 dot16_bf16(const uint16_t *q, const uint16_t *const *keys, int64_t n) {
    __m512 acc[16];
    for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 32) {
        const __m512bh qi = (__m512bh)_mm512_loadu_si512(q + i);
        for (int j = 0; j < 16; j++) acc[j] = _mm512_dpbf16_ps(acc[j], qi, (__m512bh)_mm512_loadu_si512(keys[j] + i));
    }
    return sum16(acc);
}

static inline float dot_bf16(const uint16_t *q, const uint16_t *k, int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + i), (__m512bh)_mm512_loadu_si512(k + i));
    return _mm512_reduce_add_ps(acc);
}
#endif

/* ---------------------------------------------------------------------------------------------
 * exp and tanh for x <= 0, vectorisable: exp(x) = 2^n * exp(r), r = x - n ln2, |r| <= ln2 / 2.
 * Relative error about 2e-7 (a degree-6 Taylor polynomial of exp(r)); NaN stays NaN; exp(-inf) = 0.
 * ------------------------------------------------------------------------------------------- */

static inline float exp_nonpositive(float x) {
    const float lowest = -87.0f; /* 2^-125.5: below it the result is flushed to 0 below */
    float xc = x < lowest ? lowest : x;
    const float round_magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    float n = (xc * 1.44269504f + round_magic) - round_magic;
    float r = xc - n * 0.693145752f; /* ln2 split in two: the high part times n is exact */
    r = r - n * 1.42860677e-6f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    float y = p * scale;
    return x < lowest ? 0.0f : y;
}

/* cap * tanh(x / cap). With a = |x| / cap, tanh(a) is (1 - e) / (1 + e), e = exp(-2a), where a >= 1/4;
 * below, 1 - e cancels (a cap of 1e6 put scores 0.03 off), so there it is tanh's odd series to a^9,
 * whose next term is under 1e-8 of the value. */
static inline float soft_capped(float x, float cap) {
    float a = fabsf(x) / cap;
    float e = exp_nonpositive(-2.0f * a);
    float wide = (1.0f - e) / (1.0f + e);
    float a2 = a * a;
    float near = a * (1.0f + a2 * (-1.0f / 3 + a2 * (2.0f / 15 + a2 * (-17.0f / 315 + a2 * (62.0f / 2835)))));
    float t = a < 0.25f ? near : wide;
    return copysignf(cap * t, x);
}

/* ---------------------------------------------------------------------------------------------
 * One work item: `rows` query rows (query token qi of the tile, head g of the group: row qi * group
 * + g) of one sequence and KV head, attending to that sequence's keys with online softmax.
 * ------------------------------------------------------------------------------------------- */

typedef struct {
    const void *key_cache, *value_cache;
    int64_t k_block_stride, k_token_stride, k_head_stride;
    int64_t v_block_stride, v_token_stride, v_head_stride;
    int64_t num_blocks, block_size, head_size, group;
    const void *block_tables;
    int64_t table_stride, table_width;
    int tables_64;
    int dtype;
    float scale, soft_cap;
    int64_t sliding_window;
} cache_t;

typedef struct { /* per-thread scratch, sized for the largest tile (rows padded to a multiple of 16) */
    float *q, *acc, *scores, *m, *l, *chunk_max, *sums, *keys, *values;
    int32_t *positions;
    const float **key_rows, **value_rows;
    const uint16_t **raw_q, **raw_keys, **raw_values; /* a bfloat16 decode's rows as stored (HAVE_DPBF16) */
} scratch_t;

static int scratch_alloc(scratch_t *s, int64_t max_rows, int64_t head_size) {
    max_rows = (max_rows + 15) & ~(int64_t)15;
    size_t floats = (size_t)max_rows * (2 * head_size + KEY_CHUNK + 5) + 2 * (size_t)KEY_CHUNK * head_size;
    float *all = (float *)malloc(floats * sizeof(float) + (4 * KEY_CHUNK + max_rows) * sizeof(float *));
    if (!all) return 0;
    s->q = all;
    s->acc = s->q + max_rows * head_size;
    s->scores = s->acc + max_rows * head_size;
    s->m = s->scores + max_rows * KEY_CHUNK;
    s->l = s->m + max_rows;
    s->chunk_max = s->l + max_rows;
    s->sums = s->chunk_max + max_rows;
    s->positions = (int32_t *)(s->sums + max_rows);
    s->keys = (float *)(s->positions + max_rows);
    s->values = s->keys + KEY_CHUNK * head_size;
    s->key_rows = (const float **)(s->values + KEY_CHUNK * head_size);
    s->value_rows = s->key_rows + KEY_CHUNK;
    s->raw_keys = (const uint16_t **)(s->value_rows + KEY_CHUNK);
    s->raw_values = s->raw_keys + KEY_CHUNK;
    s->raw_q = s->raw_values + KEY_CHUNK;
    return 1;
}

static inline int64_t table_entry(const cache_t *c, int64_t seq, int64_t index) {
    if (c->tables_64) return ((const int64_t *)c->block_tables)[seq * c->table_stride + index];
    return ((const int32_t *)c->block_tables)[seq * c->table_stride + index];
}

/* Walks one KV head's K and V rows of a sequence position by position, without a division per row. */
typedef struct {
    int64_t index, offset; /* position = index * block_size + offset */
    const char *key, *value;
    int valid; /* the current block is inside the cache */
} cursor_t;

static inline void cursor_block(const cache_t *c, int64_t seq, int64_t kv_head, int64_t elem, cursor_t *at) {
    if (at->index >= c->table_width) { /* the prefetch cursor one past a full row: read nothing there */
        at->valid = 0;
        return;
    }
    int64_t block = table_entry(c, seq, at->index);
    at->valid = block >= 0 && block < c->num_blocks;
    at->key = (const char *)c->key_cache +
              (block * c->k_block_stride + at->offset * c->k_token_stride + kv_head * c->k_head_stride) * elem;
    at->value = (const char *)c->value_cache +
                (block * c->v_block_stride + at->offset * c->v_token_stride + kv_head * c->v_head_stride) * elem;
}

static inline void cursor_start(const cache_t *c, int64_t seq, int64_t kv_head, int64_t elem, int64_t pos,
                                cursor_t *at) {
    at->index = pos / c->block_size;
    at->offset = pos % c->block_size;
    cursor_block(c, seq, kv_head, elem, at);
}

static inline void cursor_next(const cache_t *c, int64_t seq, int64_t kv_head, int64_t elem, cursor_t *at) {
    if (++at->offset == c->block_size) {
        at->offset = 0;
        at->index++;
        cursor_block(c, seq, kv_head, elem, at);
    } else {
        at->key += c->k_token_stride * elem;
        at->value += c->v_token_stride * elem;
    }
}

/* Rows of one KV head are a few cache lines scattered over blocks (a stride of kv_heads * head_size
 * within a block, a jump between blocks): the hardware prefetcher does not see them coming, and
 * without this the kernel waits on memory latency for every row. Into L2 (prefetcht1), not L1: a core
 * has few L1 fill buffers, and prefetches into L1 queue behind them. Reading 2 KB runs in random order,
 * one Zen 4 core takes 6-9 GB/s prefetching into L1 and 13-18 GB/s into L2
 * (dev/experiments/probe_scattered_reads.c). */
static inline void prefetch_row(const char *row, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(row + off, 0, 2);
}

/*
 * For ROWS rows j: acc[j * d + i] += sum over t < n of p[t * pt + j * pr] * v[t][i]. With AVX-512 the
 * partial sums of a 64-column slab of every row stay in registers across the keys, and each V load
 * serves all the rows (the query heads of a group share their keys). v[t] is a float32 row, or with RAW
 * a bfloat16 row as stored, widened in registers.
 */
#ifdef __AVX512F__
static inline __attribute__((always_inline)) void weighted_slab(float *acc, const float *p, int64_t pt, int64_t pr,
                                                                const void *const *v, int64_t n, int64_t d,
                                                                int64_t i, const int ROWS, const int COLS,
                                                                const int RAW) {
    __m512 a[4][4];
    for (int j = 0; j < ROWS; j++)
        for (int k = 0; k < COLS; k++) a[j][k] = _mm512_loadu_ps(acc + j * d + i + 16 * k);
    for (int64_t t = 0; t < n; t++) {
        __m512 vt[4];
        for (int k = 0; k < COLS; k++)
            vt[k] = RAW ? widen16((const uint16_t *)v[t] + i + 16 * k) : _mm512_loadu_ps((const float *)v[t] + i + 16 * k);
        for (int j = 0; j < ROWS; j++) {
            const __m512 pj = _mm512_set1_ps(p[t * pt + j * pr]);
            for (int k = 0; k < COLS; k++) a[j][k] = _mm512_fmadd_ps(pj, vt[k], a[j][k]);
        }
    }
    for (int j = 0; j < ROWS; j++)
        for (int k = 0; k < COLS; k++) _mm512_storeu_ps(acc + j * d + i + 16 * k, a[j][k]);
}
#endif

static inline __attribute__((always_inline)) void weighted_block(float *acc, const float *p, int64_t pt, int64_t pr,
                                                                 const void *const *v, int64_t n, int64_t d,
                                                                 const int ROWS, const int RAW) {
#ifdef __AVX512F__
    if ((d & 15) == 0) {
        int64_t i = 0;
        for (; i + 64 <= d; i += 64) weighted_slab(acc, p, pt, pr, v, n, d, i, ROWS, 4, RAW);
        for (; i < d; i += 16) weighted_slab(acc, p, pt, pr, v, n, d, i, ROWS, 1, RAW);
        return;
    }
#endif
    for (int j = 0; j < ROWS; j++) /* RAW is never asked for without AVX-512 BF16 and head_size % 32 == 0 */
        for (int64_t t = 0; t < n; t++) {
            const float pj = p[t * pt + j * pr], *vt = (const float *)v[t];
            float *aj = acc + j * d;
#pragma omp simd
            for (int64_t i = 0; i < d; i++) aj[i] += pj * vt[i];
        }
}

/* weighted_block over any number of rows that see the same keys, four at a time, then three, two or one:
 * a group of three query heads reads each V row once. */
static inline __attribute__((always_inline)) void weighted_rows_of(float *acc, const float *p, int64_t pt, int64_t pr,
                                                                   const void *const *v, int64_t n, int64_t d,
                                                                   int64_t rows, const int RAW) {
    int64_t j = 0;
    for (; j + 4 <= rows; j += 4) weighted_block(acc + j * d, p + j * pr, pt, pr, v, n, d, 4, RAW);
    if (rows - j == 3)
        weighted_block(acc + j * d, p + j * pr, pt, pr, v, n, d, 3, RAW);
    else if (rows - j == 2)
        weighted_block(acc + j * d, p + j * pr, pt, pr, v, n, d, 2, RAW);
    else if (rows - j == 1)
        weighted_block(acc + j * d, p + j * pr, pt, pr, v, n, d, 1, RAW);
}

static void weighted_rows(float *acc, const float *p, int64_t pt, int64_t pr, const float *const *v, int64_t n,
                          int64_t d, int64_t rows) {
    weighted_rows_of(acc, p, pt, pr, (const void *const *)v, n, d, rows, 0);
}

#if HAVE_DPBF16
static void weighted_rows_bf16(float *acc, const float *p, int64_t pt, int64_t pr, const uint16_t *const *v,
                               int64_t n, int64_t d, int64_t rows) {
    weighted_rows_of(acc, p, pt, pr, (const void *const *)v, n, d, rows, 1);
}
#endif

/* The keys of a chunk starting at position c0 (n of them) that the query at qpos sees: [*lo, *hi). */
static inline void visible_range(int64_t qpos, int64_t window, int64_t c0, int64_t n, int64_t *lo, int64_t *hi) {
    int64_t a = window > 0 ? qpos - window + 1 - c0 : 0, b = qpos + 1 - c0;
    *lo = a < 0 ? 0 : a;
    *hi = b > n ? n : b;
}

/*
 * Scores of one chunk for rows stored one after another (decode: the group's heads of one query):
 * a dot product per (row, key), then the online-softmax update and the weighted V rows per row.
 * RAW: the rows are bfloat16 as stored (s->raw_q, raw_keys, raw_values), the scores scaled after the products.
 */
static inline __attribute__((always_inline)) void chunk_by_rows(const cache_t *c, const scratch_t *s, int64_t tokens,
                                                                int64_t first_pos, int64_t c0, int64_t n,
                                                                const int RAW) {
    const int64_t d = c->head_size, group = c->group;
    for (int64_t qi = 0; qi < tokens; qi++) {
        int64_t lo, hi;
        visible_range(first_pos + qi, c->sliding_window, c0, n, &lo, &hi);
        if (lo >= hi) continue;
        for (int64_t g = 0; g < group; g++) {
            const int64_t r = qi * group + g;
            float *sc = s->scores + r * KEY_CHUNK, chunk_max = -INFINITY;
            const float *q = s->q + r * d;
            int64_t t = lo;
#if HAVE_DPBF16
            if (RAW) {
                const __m512 scale = _mm512_set1_ps(c->scale);
                for (; t + 16 <= hi; t += 16)
                    _mm512_storeu_ps(sc + t, _mm512_mul_ps(dot16_bf16(s->raw_q[r], s->raw_keys + t, d), scale));
                for (; t < hi; t++) sc[t] = dot_bf16(s->raw_q[r], s->raw_keys[t], d) * c->scale;
            }
#endif
#ifdef __AVX512F__
            if (!RAW && (d & 15) == 0)
                for (; t + 16 <= hi; t += 16) _mm512_storeu_ps(sc + t, dot16(q, s->key_rows + t, d));
#endif
            if (!RAW)
                for (; t < hi; t++) sc[t] = dot(q, s->key_rows[t], d);
            for (t = lo; t < hi; t++) {
                float score = sc[t];
                if (c->soft_cap > 0.0f) score = soft_capped(score, c->soft_cap);
                sc[t] = score;
                chunk_max = score > chunk_max ? score : chunk_max;
            }
            /* online softmax: rescale the partial sums to the new running maximum, then exponentiate */
            const float old = s->m[r], now = chunk_max > old ? chunk_max : old;
            if (now == -INFINITY) { /* every score NaN or -inf (non-finite K): NaN, as the reference */
                s->l[r] = NAN;
                for (int64_t t = lo; t < hi; t++) sc[t] = 0.0f;
                continue;
            }
            if (old != now) {
                const float alpha = old == -INFINITY ? 0.0f : exp_nonpositive(old - now);
                float *acc = s->acc + r * d;
#pragma omp simd
                for (int64_t i = 0; i < d; i++) acc[i] *= alpha;
                s->l[r] *= alpha;
                s->m[r] = now;
            }
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = lo; t < hi; t++) {
                float p = exp_nonpositive(sc[t] - now);
                sc[t] = p;
                sum += p;
            }
            s->l[r] += sum;
        }
        const int64_t r0 = qi * group; /* the group's rows see the same keys */
#if HAVE_DPBF16
        if (RAW) {
            weighted_rows_bf16(s->acc + r0 * d, s->scores + r0 * KEY_CHUNK + lo, 1, KEY_CHUNK, s->raw_values + lo,
                               hi - lo, d, group);
            continue;
        }
#endif
        weighted_rows(s->acc + r0 * d, s->scores + r0 * KEY_CHUNK + lo, 1, KEY_CHUNK, s->value_rows + lo, hi - lo, d,
                      group);
    }
}

#ifdef __AVX512F__
/* Scores of `KEYS` keys from t0 for the 16 * REGS rows from r0: KEYS * REGS independent accumulators,
 * enough to cover the FMA latency (two would leave the units idle half the time). */
static inline __attribute__((always_inline)) void score_block(const float *qt, const float *const *keys,
                                                              float *scores, int64_t d, int64_t lanes, int64_t t0,
                                                              int64_t r0, const int KEYS, const int REGS) {
    __m512 acc[8][4];
    for (int kk = 0; kk < KEYS; kk++)
        for (int j = 0; j < REGS; j++) acc[kk][j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i++) {
        __m512 q[4];
        for (int j = 0; j < REGS; j++) q[j] = _mm512_loadu_ps(qt + i * lanes + r0 + 16 * j);
        for (int kk = 0; kk < KEYS; kk++) {
            const __m512 k = _mm512_set1_ps(keys[t0 + kk][i]);
            for (int j = 0; j < REGS; j++) acc[kk][j] = _mm512_fmadd_ps(q[j], k, acc[kk][j]);
        }
    }
    for (int kk = 0; kk < KEYS; kk++)
        for (int j = 0; j < REGS; j++) _mm512_storeu_ps(scores + (t0 + kk) * lanes + r0 + 16 * j, acc[kk][j]);
}

/* Every key's scores for the 16 * REGS rows from r0: KEYS keys at a time, then the chunk's last few one by one. */
static inline __attribute__((always_inline)) void score_slab(const float *qt, const float *const *keys, float *scores,
                                                             int64_t n, int64_t d, int64_t lanes, int64_t r0,
                                                             const int KEYS, const int REGS) {
    int64_t t = 0;
    for (; t + KEYS <= n; t += KEYS) score_block(qt, keys, scores, d, lanes, t, r0, KEYS, REGS);
    for (; t < n; t++) score_block(qt, keys, scores, d, lanes, t, r0, 1, REGS);
}
#endif

/*
 * scores[t * lanes + r] = sum_i qt[i * lanes + r] * k_t[i] for every key of the chunk: rows across vector lanes.
 * The lanes (a multiple of 16) go in slabs of 64, then one of 32 and one of 16, each with as many keys at a
 * time as keep 8 accumulators busy: a tile of 48 rows (16 tokens of a group of 3 query heads) is a slab of
 * 32 and one of 16, not 48 lanes one key at a time. Every score sums over i in order, whatever the slab.
 */
static void scores_by_lanes(const float *qt, const float *const *keys, float *scores, int64_t n, int64_t d,
                            int64_t lanes) {
#ifdef __AVX512F__
    if ((lanes & 15) == 0) {
        int64_t r0 = 0;
        for (; r0 + 64 <= lanes; r0 += 64) score_slab(qt, keys, scores, n, d, lanes, r0, 2, 4);
        if (r0 + 32 <= lanes) {
            score_slab(qt, keys, scores, n, d, lanes, r0, 4, 2);
            r0 += 32;
        }
        if (r0 < lanes) score_slab(qt, keys, scores, n, d, lanes, r0, 8, 1);
        return;
    }
#endif
    for (int64_t t = 0; t < n; t++) {
        const float *k = keys[t];
        float *st = scores + t * lanes;
        for (int64_t r = 0; r < lanes; r++) st[r] = 0.0f;
        for (int64_t i = 0; i < d; i++) {
            const float ki = k[i], *q = qt + i * lanes;
#pragma omp simd
            for (int64_t r = 0; r < lanes; r++) st[r] += q[r] * ki;
        }
    }
}

/*
 * Scores of one chunk for a prefill tile, rows across vector lanes (q stored transposed, [head_size][lanes]):
 * no horizontal sums, and the mask, soft cap, maximum and exp run over 16 rows at once.
 */
static void chunk_by_lanes(const cache_t *c, const scratch_t *s, int64_t rows, int64_t lanes, int64_t c0,
                           int64_t n) {
    const int64_t d = c->head_size, window = c->sliding_window;
    const float cap = c->soft_cap;
    float *scores = s->scores, *chunk_max = s->chunk_max, *shift = s->sums;
    const int32_t *qpos = s->positions;
    scores_by_lanes(s->q, s->key_rows, scores, n, d, lanes);
    for (int64_t r = 0; r < lanes; r++) chunk_max[r] = -INFINITY;
    for (int64_t t = 0; t < n; t++) {
        const int32_t pos = (int32_t)(c0 + t);
        float *st = scores + t * lanes;
#pragma omp simd
        for (int64_t r = 0; r < lanes; r++) {
            float v = cap > 0.0f ? soft_capped(st[r], cap) : st[r];
            const int visible = pos <= qpos[r] && (window <= 0 || pos > qpos[r] - window);
            v = visible ? v : -INFINITY;
            st[r] = v;
            chunk_max[r] = v > chunk_max[r] ? v : chunk_max[r];
        }
    }
    /* online softmax: per row, the shift its scores are exponentiated against (0 when it sees no key here) */
    for (int64_t r = 0; r < rows; r++) {
        int64_t lo, hi;
        visible_range(qpos[r], window, c0, n, &lo, &hi);
        shift[r] = 0.0f;
        if (lo >= hi) continue;
        const float old = s->m[r], now = chunk_max[r] > old ? chunk_max[r] : old;
        if (now == -INFINITY) { /* every score NaN or -inf (non-finite K): NaN, as the reference */
            s->l[r] = NAN;
            continue;
        }
        if (old != now) {
            const float alpha = old == -INFINITY ? 0.0f : exp_nonpositive(old - now);
            float *acc = s->acc + r * d;
#pragma omp simd
            for (int64_t i = 0; i < d; i++) acc[i] *= alpha;
            s->l[r] *= alpha;
            s->m[r] = now;
        }
        shift[r] = now;
    }
    for (int64_t r = rows; r < lanes; r++) shift[r] = 0.0f;
    float *sums = s->chunk_max; /* the maxima are spent: reuse them for the sums */
    for (int64_t r = 0; r < lanes; r++) sums[r] = 0.0f;
    for (int64_t t = 0; t < n; t++) {
        float *st = scores + t * lanes;
#pragma omp simd
        for (int64_t r = 0; r < lanes; r++) {
            const float p = exp_nonpositive(st[r] - shift[r]); /* a hidden key: exp(-inf) = 0 */
            st[r] = p;
            sums[r] += p;
        }
    }
    for (int64_t r = 0; r < rows; r++) s->l[r] += sums[r];
    for (int64_t r0 = 0; r0 < rows; r0 += c->group) { /* a query token's rows (the group) see the same keys */
        int64_t lo, hi;
        visible_range(qpos[r0], window, c0, n, &lo, &hi);
        if (lo < hi)
            weighted_rows(s->acc + r0 * d, scores + lo * lanes + r0, lanes, 1, s->value_rows + lo, hi - lo, d,
                          c->group);
    }
}

/*
 * Query token qi (0 <= qi < tokens) sits at position first_pos + qi and sees keys
 * (pos - window, pos] (all keys up to pos without a window). Returns OK or ERR_BLOCK.
 */
static inline __attribute__((always_inline)) int attend(
    const cache_t *c, int dtype, int64_t seq, int64_t kv_head, const char *query, int64_t q_token_stride,
    int64_t q_head_stride, int64_t tokens, int64_t first_pos, char *out, int64_t out_token_stride,
    int64_t out_head_stride, const scratch_t *s) {
    const int64_t d = c->head_size, group = c->group, rows = tokens * group, elem = dtype == DT_F32 ? 4 : 2;
    const int64_t window = c->sliding_window, row_bytes = d * elem;
    const int64_t prefetch_rows = PREFETCH_BYTES / row_bytes > 4 ? PREFETCH_BYTES / row_bytes : 4;
    /* a prefill tile puts its rows across vector lanes; decode's few rows (one query token) go one by one */
    const int by_lanes = tokens > 1, lanes = (rows + 15) & ~(int64_t)15;
    /* one query token in bfloat16: rows read as stored (HAVE_DPBF16 above); the chunk loop then only gathers
     * row pointers, so rows are prefetched a chunk's gather ahead of their use rather than a latency ahead */
    const int raw = HAVE_DPBF16 && dtype == DT_BF16 && !by_lanes && (d & 31) == 0;
    for (int64_t r = 0; r < lanes; r++) {
        const int64_t qi = r / group, g = r % group;
        s->positions[r] = r < rows ? (int32_t)(first_pos + qi) : -1; /* a padding lane sees nothing */
        if (r >= rows) {
            if (by_lanes)
                for (int64_t i = 0; i < d; i++) s->q[i * lanes + r] = 0.0f;
            continue;
        }
        const char *q_row = query + (qi * q_token_stride + (kv_head * group + g) * q_head_stride) * elem;
        if (raw) {
            s->raw_q[r] = (const uint16_t *)q_row;
            memset(s->acc + r * d, 0, (size_t)d * sizeof(float));
            s->m[r] = -INFINITY;
            s->l[r] = 0.0f;
            continue;
        }
        const float *q = widen(q_row, s->keys, d, dtype);
        if (by_lanes)
            for (int64_t i = 0; i < d; i++) s->q[i * lanes + r] = q[i] * c->scale;
        else {
            float *qs = s->q + r * d;
#pragma omp simd
            for (int64_t i = 0; i < d; i++) qs[i] = q[i] * c->scale;
        }
        memset(s->acc + r * d, 0, (size_t)d * sizeof(float));
        s->m[r] = -INFINITY;
        s->l[r] = 0.0f;
    }
    const int64_t last_pos = first_pos + tokens - 1;
    int64_t begin = window > 0 ? first_pos - window + 1 : 0;
    if (begin < 0) begin = 0;
    if (begin > last_pos) begin = last_pos + 1; /* every query before the sequence: no key to read */
    cursor_t at, ahead;
    if (begin <= last_pos) {
        cursor_start(c, seq, kv_head, elem, begin, &at);
        ahead = at;
        for (int64_t t = 0; t < prefetch_rows && begin + t <= last_pos; t++) {
            if (ahead.valid) {
                prefetch_row(ahead.key, row_bytes);
                prefetch_row(ahead.value, row_bytes);
            }
            cursor_next(c, seq, kv_head, elem, &ahead);
        }
    }
    for (int64_t c0 = begin; c0 <= last_pos; c0 += KEY_CHUNK) {
        const int64_t n = c0 + KEY_CHUNK <= last_pos + 1 ? KEY_CHUNK : last_pos + 1 - c0;
        /* K and V rows of the chunk, widened to float32 (float32 rows, and bfloat16 ones with raw, read in place) */
        for (int64_t t = 0; t < n; t++) {
            if (!at.valid) return ERR_BLOCK;
            if (c0 + t + prefetch_rows <= last_pos) {
                if (ahead.valid) {
                    prefetch_row(ahead.key, row_bytes);
                    prefetch_row(ahead.value, row_bytes);
                }
                cursor_next(c, seq, kv_head, elem, &ahead);
            }
            if (raw) {
                s->raw_keys[t] = (const uint16_t *)at.key;
                s->raw_values[t] = (const uint16_t *)at.value;
            } else {
                s->key_rows[t] = widen(at.key, s->keys + t * d, d, dtype);
                s->value_rows[t] = widen(at.value, s->values + t * d, d, dtype);
            }
            if (t + 1 < n) cursor_next(c, seq, kv_head, elem, &at);
        }
        if (c0 + n <= last_pos) cursor_next(c, seq, kv_head, elem, &at);
        if (by_lanes)
            chunk_by_lanes(c, s, rows, lanes, c0, n);
        else if (raw)
            chunk_by_rows(c, s, tokens, first_pos, c0, n, 1);
        else
            chunk_by_rows(c, s, tokens, first_pos, c0, n, 0);
    }
    for (int64_t r = 0; r < rows; r++) {
        int64_t qi = r / group, g = r % group;
        char *dst = out + (qi * out_token_stride + (kv_head * group + g) * out_head_stride) * elem;
        float l = s->l[r];
        if (l == 0.0f)
            zero_row(dst, d, dtype); /* no key seen (a position before the sequence): 0, as the reference */
        else
            narrow(dst, s->acc + r * d, 1.0f / l, d, dtype);
    }
    return OK;
}

static int dispatch_attend(const cache_t *c, int64_t seq, int64_t kv_head, const char *query, int64_t q_token_stride,
                           int64_t q_head_stride, int64_t tokens, int64_t first_pos, char *out,
                           int64_t out_token_stride, int64_t out_head_stride, const scratch_t *s) {
    /* one specialised copy per dtype: the conversions inline into the inner loops */
    switch (c->dtype) {
    case DT_F32:
        return attend(c, DT_F32, seq, kv_head, query, q_token_stride, q_head_stride, tokens, first_pos, out,
                      out_token_stride, out_head_stride, s);
    case DT_BF16:
        return attend(c, DT_BF16, seq, kv_head, query, q_token_stride, q_head_stride, tokens, first_pos, out,
                      out_token_stride, out_head_stride, s);
    default:
        return attend(c, DT_F16, seq, kv_head, query, q_token_stride, q_head_stride, tokens, first_pos, out,
                      out_token_stride, out_head_stride, s);
    }
}

static inline int64_t read_len(const void *lens, int lens_64, int64_t i) {
    return lens_64 ? ((const int64_t *)lens)[i] : ((const int32_t *)lens)[i];
}

static void fill_cache(cache_t *c, const void *key_cache, const void *value_cache, const int64_t *k_strides,
                       const int64_t *v_strides, int64_t num_blocks, int64_t block_size, int64_t head_size,
                       int64_t group, const void *block_tables, int64_t table_stride, int64_t table_width,
                       int tables_64, int dtype, float scale, int64_t sliding_window, float soft_cap) {
    c->key_cache = key_cache;
    c->value_cache = value_cache;
    c->k_block_stride = k_strides[0];
    c->k_token_stride = k_strides[1];
    c->k_head_stride = k_strides[2];
    c->v_block_stride = v_strides[0];
    c->v_token_stride = v_strides[1];
    c->v_head_stride = v_strides[2];
    c->num_blocks = num_blocks;
    c->block_size = block_size;
    c->head_size = head_size;
    c->group = group;
    c->block_tables = block_tables;
    c->table_stride = table_stride;
    c->table_width = table_width;
    c->tables_64 = tables_64;
    c->dtype = dtype;
    c->scale = scale;
    c->soft_cap = soft_cap;
    c->sliding_window = sliding_window;
}

/*
 * Decode: out[seq, head, :] for one query token per sequence, the sequence's last (position
 * seq_lens[seq] - 1). Strides are in elements: query (seq, head), caches (block, token, kv head);
 * the last dimension of every tensor is contiguous. out is contiguous [num_seqs, num_heads, head_size].
 */
int vp_paged_attention(void *out, const void *query, int64_t q_seq_stride, int64_t q_head_stride,
                       const void *key_cache, const int64_t *k_strides, const void *value_cache,
                       const int64_t *v_strides, int64_t num_blocks, int64_t block_size, int64_t num_kv_heads,
                       int64_t head_size, int64_t num_heads, const void *block_tables, int64_t table_stride,
                       int64_t table_width, int tables_64, const void *seq_lens, int lens_64, int64_t num_seqs,
                       int dtype, float scale, int64_t sliding_window, float soft_cap, int num_threads) {
    if (dtype == DT_F16 && !HAVE_F16) return ERR_DTYPE;
    const int64_t group = num_heads / num_kv_heads, elem = dtype == DT_F32 ? 4 : 2;
    for (int64_t i = 0; i < num_seqs; i++) { /* every length first: a bad one reads nothing */
        int64_t len = read_len(seq_lens, lens_64, i);
        if (len < 0 || len > table_width * block_size) return ERR_SEQ_LEN;
    }
    cache_t c;
    fill_cache(&c, key_cache, value_cache, k_strides, v_strides, num_blocks, block_size, head_size, group,
               block_tables, table_stride, table_width, tables_64, dtype, scale, sliding_window, soft_cap);
    int status = OK;
#pragma omp parallel num_threads(num_threads)
    {
        scratch_t s;
        int ok = scratch_alloc(&s, group, head_size);
        if (!ok) {
#pragma omp atomic write
            status = ERR_MEMORY;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_seqs * num_kv_heads; item++) {
            int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
            int64_t len = read_len(seq_lens, lens_64, seq);
            char *dst = (char *)out + seq * num_heads * head_size * elem; /* attend adds the head offset */
            if (!ok || len == 0) { /* a padded sequence: exact zeros, nothing read */
                zero_row(dst + kv_head * group * head_size * elem, group * head_size, dtype);
                continue;
            }
            const char *q = (const char *)query + (seq * q_seq_stride) * elem;
            int err = dispatch_attend(&c, seq, kv_head, q, 0, q_head_stride, 1, len - 1, dst, 0, head_size, &s);
            if (err) {
#pragma omp atomic write
                status = err;
            }
        }
        if (ok) free(s.q);
    }
    return status;
}

/*
 * Prefill: the query tokens of sequence i are query[cu_seqlens_q[i] : cu_seqlens_q[i + 1]], the last
 * q_len of its seq_lens[i] tokens; token j sits at position seq_lens[i] - q_len + j and sees keys up
 * to it. A padded sequence (seq_len 0) reads nothing and its rows are zero. Rows past
 * cu_seqlens_q[num_seqs] are not written (the caller zeroes them). out is contiguous [tokens, num_heads, head_size].
 */
int vp_prefill_attention(void *out, const void *query, int64_t q_token_stride, int64_t q_head_stride,
                         int64_t num_tokens, const void *key_cache, const int64_t *k_strides,
                         const void *value_cache, const int64_t *v_strides, int64_t num_blocks, int64_t block_size,
                         int64_t num_kv_heads, int64_t head_size, int64_t num_heads, const void *block_tables,
                         int64_t table_stride, int64_t table_width, int tables_64, const void *cu_seqlens_q,
                         int cu_64, const void *seq_lens, int lens_64, int64_t num_seqs, int dtype, float scale,
                         int64_t sliding_window, float soft_cap, int num_threads) {
    if (dtype == DT_F16 && !HAVE_F16) return ERR_DTYPE;
    const int64_t group = num_heads / num_kv_heads, elem = dtype == DT_F32 ? 4 : 2;
    int64_t *first_tile = (int64_t *)malloc((size_t)(num_seqs + 1) * sizeof(int64_t));
    if (!first_tile) return ERR_MEMORY;
    first_tile[0] = 0;
    if (read_len(cu_seqlens_q, cu_64, 0) != 0) {
        free(first_tile);
        return ERR_QUERY_LENS;
    }
    for (int64_t i = 0; i < num_seqs; i++) {
        int64_t start = read_len(cu_seqlens_q, cu_64, i), end = read_len(cu_seqlens_q, cu_64, i + 1);
        int64_t len = read_len(seq_lens, lens_64, i);
        if (end < start || end > num_tokens) {
            free(first_tile);
            return ERR_QUERY_LENS;
        }
        if (len < 0 || len > table_width * block_size) {
            free(first_tile);
            return ERR_SEQ_LEN;
        }
        first_tile[i + 1] = first_tile[i] + (end - start + QUERY_TILE - 1) / QUERY_TILE;
    }
    cache_t c;
    fill_cache(&c, key_cache, value_cache, k_strides, v_strides, num_blocks, block_size, head_size, group,
               block_tables, table_stride, table_width, tables_64, dtype, scale, sliding_window, soft_cap);
    int status = OK;
    const int64_t tiles = first_tile[num_seqs];
#pragma omp parallel num_threads(num_threads)
    {
        scratch_t s;
        int ok = scratch_alloc(&s, QUERY_TILE * group, head_size);
        if (!ok) {
#pragma omp atomic write
            status = ERR_MEMORY;
        }
        /* backwards: a sequence's last tiles see the most keys, so the short items fill the end of the schedule */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = tiles * num_kv_heads - 1; item >= 0; item--) {
            int64_t tile = item / num_kv_heads, kv_head = item % num_kv_heads;
            int64_t lo = 0, hi = num_seqs; /* the sequence holding this tile: first_tile[seq] <= tile < first_tile[seq + 1] */
            while (hi - lo > 1) {
                int64_t mid = (lo + hi) / 2;
                if (first_tile[mid] <= tile) lo = mid; else hi = mid;
            }
            int64_t seq = lo, len = read_len(seq_lens, lens_64, seq);
            int64_t start = read_len(cu_seqlens_q, cu_64, seq), q_len = read_len(cu_seqlens_q, cu_64, seq + 1) - start;
            int64_t j0 = (tile - first_tile[seq]) * QUERY_TILE, n = q_len - j0 < QUERY_TILE ? q_len - j0 : QUERY_TILE;
            char *dst = (char *)out + (start + j0) * num_heads * head_size * elem; /* attend adds the head offset */
            if (!ok || len == 0) {
                for (int64_t j = 0; j < n; j++)
                    zero_row(dst + (j * num_heads + kv_head * group) * head_size * elem, group * head_size, dtype);
                continue;
            }
            const char *q = (const char *)query + (start + j0) * q_token_stride * elem;
            int err = dispatch_attend(&c, seq, kv_head, q, q_token_stride, q_head_stride, n, len - q_len + j0, dst,
                                      num_heads * head_size, head_size, &s);
            if (err) {
#pragma omp atomic write
                status = err;
            }
        }
        if (ok) free(s.q);
    }
    free(first_tile);
    return status;
}

/*
 * reshape_and_cache: token t's key and value rows ([heads, head_size] each) into slot slot_mapping[t] of
 * the caches, block slot / block_size at offset slot % block_size; a slot of -1 is a padded token,
 * not written. Every slot is checked before anything is written: one outside [-1, num_blocks *
 * block_size) returns ERR_SLOT with the caches untouched. The cache has the key's dtype (the op's
 * checks), so rows are copied as bytes: no conversion, any dtype. Strides are in elements: key and
 * value (token, head), caches (block, offset, head); the last dimension of every tensor is contiguous.
 * Tokens are shared out among threads when the copy is large (a prefill); two tokens given one slot
 * leave either's row, which the contract leaves undefined.
 */
int vp_reshape_and_cache(const void *key, int64_t k_token_stride, int64_t k_head_stride, const void *value,
                         int64_t v_token_stride, int64_t v_head_stride, void *key_cache, const int64_t *kc_strides,
                         void *value_cache, const int64_t *vc_strides, int64_t num_blocks, int64_t block_size,
                         int64_t heads, int64_t head_size, const void *slot_mapping, int64_t slot_stride,
                         int slots_64, int64_t tokens, int64_t element_size, int num_threads) {
    const int64_t capacity = num_blocks * block_size;
    for (int64_t t = 0; t < tokens; t++) {
        int64_t slot = read_len(slot_mapping, slots_64, t * slot_stride);
        if (slot < -1 || slot >= capacity) return ERR_SLOT;
    }
    const size_t row = (size_t)(head_size * element_size);
    const char *k = (const char *)key, *v = (const char *)value;
    char *kc = (char *)key_cache, *vc = (char *)value_cache;
    const int parallel = tokens * heads * (int64_t)row >= (1 << 18); /* 256 KiB: a team costs more below */
#pragma omp parallel for num_threads(num_threads) if (parallel) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        int64_t slot = read_len(slot_mapping, slots_64, t * slot_stride);
        if (slot < 0) continue;
        int64_t block = slot / block_size, offset = slot % block_size;
        for (int64_t h = 0; h < heads; h++) {
            memcpy(kc + (block * kc_strides[0] + offset * kc_strides[1] + h * kc_strides[2]) * element_size,
                   k + (t * k_token_stride + h * k_head_stride) * element_size, row);
            memcpy(vc + (block * vc_strides[0] + offset * vc_strides[1] + h * vc_strides[2]) * element_size,
                   v + (t * v_token_stride + h * v_head_stride) * element_size, row);
        }
    }
    return OK;
}

/*
 * Paged attention for the CPU plugin: decode and prefill, reading the paged K/V caches in place.
 *
 * Built at first use by vllm_port_cpu.native (cc -O3 -march=native -fopenmp -shared -fPIC) and
 * called through ctypes with raw pointers and strides; no Python or torch headers, so it compiles
 * in about a second. The semantics are those of vllm_port.ops.attention (paged_attention_reference,
 * prefill_attention_reference): cache [num_blocks, block_size, kv_heads, head_size], token t of a
 * sequence in block block_tables[seq, t / block_size] at offset t % block_size, query head h reads
 * KV head h / (num_heads / kv_heads).
 *
 * One work item is (sequence, KV head, tile of query tokens): it handles every query head of the
 * KV head's group, so each K/V row is read and widened to float32 once for all of them. Keys are
 * visited in chunks with an online softmax in float32: scores of a chunk for all query rows, the
 * chunk's maximum, one rescale of the partial sums, then the probability-weighted V rows. Only the
 * slots a query may see are read: a padded sequence (seq_len 0) reads nothing, not even its
 * block-table row, and its rows are written as exact zeros.
 *
 * The inner loops run over head_size with plain C and `omp simd`, which gcc vectorises for the
 * target (AVX-512 with -march=native); exp is a polynomial the compiler can vectorise too.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

/* Error codes, mapped to messages by vllm_port_cpu.native. */
enum {
    OK = 0,
    ERR_DTYPE = 1,       /* dtype not built in (float16 without compiler support) */
    ERR_SEQ_LEN = 2,     /* seq_len < 0 or more tokens than its block-table row holds */
    ERR_BLOCK = 3,       /* a block-table entry the sequence uses is outside [0, num_blocks) */
    ERR_QUERY_LENS = 4,  /* cu_seqlens_q not non-decreasing from 0, or past the query's tokens */
    ERR_MEMORY = 5,      /* scratch allocation failed */
};

#if defined(__FLT16_MAX__)
#define HAVE_F16 1
typedef _Float16 f16_t;
#else
#define HAVE_F16 0
#endif

/* Keys per chunk of the online softmax: scores for a chunk stay in L1 for every query row. */
#define KEY_CHUNK 64
/* Query tokens per prefill work item: their rows share every K/V row the tile reads. */
#define QUERY_TILE 16
/* How far ahead K and V rows are prefetched, in bytes of K rows: about a memory latency's worth of
 * work at the kernel's pace (measured on Zen 4: 8 bfloat16 rows of 64 leave it waiting, 24 do not). */
#define PREFETCH_BYTES 3072

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

/* cap * tanh(x / cap), computed as cap * sign * (1 - e) / (1 + e) with e = exp(-2 |x| / cap). */
static inline float soft_capped(float x, float cap) {
    float a = fabsf(x) / cap;
    float e = exp_nonpositive(-2.0f * a);
    float t = (1.0f - e) / (1.0f + e);
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

typedef struct { /* per-thread scratch, sized for the largest tile */
    float *q, *acc, *scores, *m, *l, *keys, *values;
    const float **key_rows, **value_rows;
} scratch_t;

static int scratch_alloc(scratch_t *s, int64_t max_rows, int64_t head_size) {
    size_t floats = (size_t)max_rows * (2 * head_size + KEY_CHUNK + 2) + 2 * (size_t)KEY_CHUNK * head_size;
    float *all = (float *)malloc(floats * sizeof(float) + 2 * KEY_CHUNK * sizeof(float *));
    if (!all) return 0;
    s->q = all;
    s->acc = s->q + max_rows * head_size;
    s->scores = s->acc + max_rows * head_size;
    s->m = s->scores + max_rows * KEY_CHUNK;
    s->l = s->m + max_rows;
    s->keys = s->l + max_rows;
    s->values = s->keys + KEY_CHUNK * head_size;
    s->key_rows = (const float **)(s->values + KEY_CHUNK * head_size);
    s->value_rows = s->key_rows + KEY_CHUNK;
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
 * without this the kernel waits on memory latency for every row. */
static inline void prefetch_row(const char *row, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(row + off, 0, 3);
}

/* acc[0:d] += sum over t < n of p[t] * v[t][0:d]. With AVX-512, the partial sums of 64 columns stay
 * in registers across the rows instead of a load and a store of acc per row. */
static inline void weighted_sum(float *acc, const float *p, const float *const *v, int64_t n, int64_t d) {
#ifdef __AVX512F__
    if ((d & 15) == 0) {
        int64_t i = 0;
        for (; i + 64 <= d; i += 64) {
            __m512 a0 = _mm512_loadu_ps(acc + i), a1 = _mm512_loadu_ps(acc + i + 16);
            __m512 a2 = _mm512_loadu_ps(acc + i + 32), a3 = _mm512_loadu_ps(acc + i + 48);
            for (int64_t t = 0; t < n; t++) {
                __m512 pt = _mm512_set1_ps(p[t]);
                const float *vt = v[t] + i;
                a0 = _mm512_fmadd_ps(pt, _mm512_loadu_ps(vt), a0);
                a1 = _mm512_fmadd_ps(pt, _mm512_loadu_ps(vt + 16), a1);
                a2 = _mm512_fmadd_ps(pt, _mm512_loadu_ps(vt + 32), a2);
                a3 = _mm512_fmadd_ps(pt, _mm512_loadu_ps(vt + 48), a3);
            }
            _mm512_storeu_ps(acc + i, a0);
            _mm512_storeu_ps(acc + i + 16, a1);
            _mm512_storeu_ps(acc + i + 32, a2);
            _mm512_storeu_ps(acc + i + 48, a3);
        }
        for (; i < d; i += 16) {
            __m512 a = _mm512_loadu_ps(acc + i);
            for (int64_t t = 0; t < n; t++) a = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), _mm512_loadu_ps(v[t] + i), a);
            _mm512_storeu_ps(acc + i, a);
        }
        return;
    }
#endif
    for (int64_t t = 0; t < n; t++) {
        const float pt = p[t], *vt = v[t];
#pragma omp simd
        for (int64_t i = 0; i < d; i++) acc[i] += pt * vt[i];
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
    for (int64_t qi = 0; qi < tokens; qi++)
        for (int64_t g = 0; g < group; g++) {
            int64_t r = qi * group + g;
            float *qs = s->q + r * d;
            const float *q = widen(query + (qi * q_token_stride + (kv_head * group + g) * q_head_stride) * elem,
                                   qs, d, dtype);
#pragma omp simd
            for (int64_t i = 0; i < d; i++) qs[i] = q[i] * c->scale;
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
        /* K and V rows of the chunk, widened to float32 (float32 rows are read in place) */
        for (int64_t t = 0; t < n; t++) {
            if (!at.valid) return ERR_BLOCK;
            if (c0 + t + prefetch_rows <= last_pos) {
                if (ahead.valid) {
                    prefetch_row(ahead.key, row_bytes);
                    prefetch_row(ahead.value, row_bytes);
                }
                cursor_next(c, seq, kv_head, elem, &ahead);
            }
            s->key_rows[t] = widen(at.key, s->keys + t * d, d, dtype);
            s->value_rows[t] = widen(at.value, s->values + t * d, d, dtype);
            if (t + 1 < n) cursor_next(c, seq, kv_head, elem, &at);
        }
        if (c0 + n <= last_pos) cursor_next(c, seq, kv_head, elem, &at);
        for (int64_t qi = 0; qi < tokens; qi++) {
            /* the keys of this chunk query qi sees: [lo, hi) */
            const int64_t qpos = first_pos + qi;
            int64_t lo = window > 0 ? qpos - window + 1 - c0 : 0, hi = qpos + 1 - c0;
            lo = lo < 0 ? 0 : lo;
            hi = hi > n ? n : hi;
            for (int64_t g = 0; g < group; g++) {
                const int64_t r = qi * group + g;
                float *sc = s->scores + r * KEY_CHUNK, chunk_max = -INFINITY;
                const float *q = s->q + r * d;
                for (int64_t t = lo; t < hi; t++) {
                    float score = dot(q, s->key_rows[t], d);
                    if (c->soft_cap > 0.0f) score = soft_capped(score, c->soft_cap);
                    sc[t] = score;
                    chunk_max = score > chunk_max ? score : chunk_max;
                }
                if (lo >= hi) continue;
                /* online softmax: rescale the partial sums to the new running maximum, then exponentiate */
                const float old = s->m[r], now = chunk_max > old ? chunk_max : old;
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
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int64_t t = lo; t < hi; t++) {
                    float p = exp_nonpositive(sc[t] - now);
                    sc[t] = p;
                    sum += p;
                }
                s->l[r] += sum;
                weighted_sum(s->acc + r * d, sc + lo, s->value_rows + lo, hi - lo, d);
            }
        }
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
        /* last tiles first: they see the most keys, so the shortest items fill the end of the schedule */
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

/*
 * Fused element-wise kernels for the CPU plugin: rms_norm (with or without the residual add),
 * silu_and_mul and rotary_embedding, each one pass over its rows.
 *
 * Built into the same library as paged_attention.c by vllm_port_cpu.native and called through
 * ctypes with raw pointers and strides in elements. The semantics are those of the references in
 * vllm_port.ops (norm.py, activation.py, rotary.py), rounding where they round:
 *   rms_norm            out = round(round(x * rsqrt(mean(x^2) + eps)) * w)
 *   fused_add_rms_norm  residual = round(residual + x); then rms_norm of that rounded residual
 *   silu_and_mul        out = round(round(silu(gate)) * up)
 *   rotary_embedding    each rotated pair computed in float32 and rounded once, in place
 * where round() is to the tensor's dtype (nothing for float32), round to nearest even, and
 * everything else is float32.
 *
 * A row is addressed by two strides, so a [tokens, heads, head_size] view of a fused projection
 * (Qwen3's per-head norms) needs no copy: row r starts at (r / inner) * outer_stride + (r % inner)
 * * inner_stride. The loops are `omp simd` loops gcc vectorises for the target (-march=native;
 * AVX2 is the floor measured). float32 rows, and bfloat16 rows of the norms and rotary, are read
 * and written in place by single loops (bfloat16 is the top half of a float32: its conversions are
 * shifts and integer rounding). float16 rows, and silu's bfloat16 ones, go through float32 buffers
 * of CHUNK features in L1, converted by F16C where the target has it (gcc 12 leaves _Float16
 * conversions scalar), with each intermediate rounding a pass of its own (round_buf); which way
 * each dtype goes is what measured faster (docs/results/cpu-elementwise.md).
 * Sums of squares are kept in LANES partial sums in a fixed order, so every target adds alike.
 * Rows are split across the caller's OpenMP threads (torch's count) only when a call has at least
 * PARALLEL_MIN_ELEMENTS elements: below it a team's start costs about what it saves.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "native.h"

/* Features per float32 buffer: a few of them stay in L1. */
#define CHUNK 512
/* Partial sums of a row's squares. */
#define LANES 32
/* Calls with fewer elements run on the calling thread: on a quiet 16-core Xeon a team of two gains
 * 1.4x at 8192 elements of rms_norm and 1.8x from 32768 (docs/results/cpu-elementwise.md). */
#ifndef PARALLEL_MIN_ELEMENTS
#define PARALLEL_MIN_ELEMENTS 32768
#endif
/* Largest rotary_dim / 2 the kernel's per-token buffers hold (vllm_port_cpu.native_elementwise checks it). */
#define MAX_HALF_ROT 1024

/* ---------------------------------------------------------------------------------------------
 * Element access: loads, stores and rounding in a storage dtype, float32 or bfloat16 (float16 rows
 * are widened into float32 buffers first); buffers of any dtype to float32 and back.
 * ------------------------------------------------------------------------------------------- */

static inline __attribute__((always_inline)) float as_float(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline __attribute__((always_inline)) uint32_t as_bits(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return bits;
}

static inline __attribute__((always_inline)) float ld(const void *p, int64_t i, int sdt) {
    if (sdt == DT_BF16) return as_float((uint32_t)((const uint16_t *)p)[i] << 16);
    return ((const float *)p)[i];
}

/* cond ? a : b as a bitwise select. gcc threads a `?:` with a constant arm into branches (the arm's
 * value propagated into what follows), which then no longer vectorise; masks it leaves alone. */
static inline __attribute__((always_inline)) uint32_t select_bits(int cond, uint32_t a, uint32_t b) {
    uint32_t mask = -(uint32_t)(cond != 0);
    return (a & mask) | (b & ~mask);
}

static inline __attribute__((always_inline)) float select_f(int cond, float a, float b) {
    return as_float(select_bits(cond, as_bits(a), as_bits(b)));
}

/* f rounded to bfloat16, round to nearest even, as the float32 whose low half is zero; NaN stays a quiet NaN. */
static inline __attribute__((always_inline)) uint32_t bf16_bits(float f) {
    uint32_t bits = as_bits(f);
    uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    return select_bits((bits & 0x7fffffffu) > 0x7f800000u, (bits | 0x400000u) & 0xffff0000u, rounded);
}

/* f rounded to the storage dtype and back (float32: f). */
static inline __attribute__((always_inline)) float rnd(float f, int sdt) {
    return sdt == DT_BF16 ? as_float(bf16_bits(f)) : f;
}

/* Store f, rounding it to bfloat16 where that is the storage. */
static inline __attribute__((always_inline)) void st(void *p, int64_t i, float f, int sdt) {
    if (sdt == DT_BF16) ((uint16_t *)p)[i] = (uint16_t)(bf16_bits(f) >> 16);
    else ((float *)p)[i] = f;
}

/* Store f, a value already of the storage dtype (rnd's result). */
static inline __attribute__((always_inline)) void st_exact(void *p, int64_t i, float f, int sdt) {
    if (sdt == DT_BF16) ((uint16_t *)p)[i] = (uint16_t)(as_bits(f) >> 16);
    else ((float *)p)[i] = f;
}

/* float16 rows: n elements to float32 and back (narrow rounds to nearest even). */
static inline void widen_f16(const void *src, float *dst, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + i))));
#endif
#if HAVE_F16
    for (; i < n; i++) dst[i] = (float)((const f16_t *)src)[i];
#endif
}

static inline void narrow_f16(void *dst, const float *src, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)((uint16_t *)dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
#if HAVE_F16
    for (; i < n; i++) ((f16_t *)dst)[i] = (f16_t)src[i];
#endif
}

/* n elements of dtype from src as float32: src itself for float32, else converted into buf. */
static inline __attribute__((always_inline)) const float *widen(const void *src, float *buf, int64_t n, int dtype) {
    if (dtype == DT_F32) return (const float *)src;
    if (dtype == DT_F16) {
        widen_f16(src, buf, n);
        return buf;
    }
#pragma omp simd
    for (int64_t i = 0; i < n; i++) buf[i] = ld(src, i, DT_BF16);
    return buf;
}

/* n float32 values rounded to dtype (bfloat16 or float16, to nearest even) and stored as it. */
static inline __attribute__((always_inline)) void narrow(void *dst, const float *src, int64_t n, int dtype) {
    if (dtype == DT_F16) {
        narrow_f16(dst, src, n);
        return;
    }
#pragma omp simd
    for (int64_t i = 0; i < n; i++) st(dst, i, src[i], DT_BF16);
}

/* buf's n float32 values rounded to dtype (to nearest even) and back, in place: a reference's
 * intermediate rounding, as a pass of its own (in the arithmetic's loop it costs more). */
static inline __attribute__((always_inline)) void round_buf(float *buf, int64_t n, int dtype) {
    if (dtype == DT_BF16) {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) buf[i] = rnd(buf[i], DT_BF16);
        return;
    }
    if (dtype != DT_F16) return;
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8) {
        __m128i half = _mm256_cvtps_ph(_mm256_loadu_ps(buf + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(half));
    }
#endif
#if HAVE_F16
    for (; i < n; i++) buf[i] = (float)(f16_t)buf[i];
#endif
}

static inline int64_t elem_size(int dtype) { return dtype == DT_F32 ? 4 : 2; }

/* float16 needs the compiler's _Float16 (F16C, where there, only speeds up whole groups of 8). */
static inline int dtype_ok(int dtype) { return dtype == DT_F32 || dtype == DT_BF16 || (dtype == DT_F16 && HAVE_F16); }

/* Offset in elements of row r of a tensor whose rows are [outer, inner] with these strides. */
static inline int64_t row_offset(int64_t r, int64_t inner, int64_t outer_stride, int64_t inner_stride) {
    return (r / inner) * outer_stride + (r % inner) * inner_stride;
}

static inline __attribute__((always_inline)) int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* ---------------------------------------------------------------------------------------------
 * exp of a float32, vectorisable: exp(x) = 2^n * exp(r), r = x - n ln2, |r| <= ln2 / 2, with
 * Cephes' expf polynomial (relative error under 1e-7). Past 88.73 the result overflows to inf, as
 * expf's does, so silu(g) is -0 below g = -88.73 and NaN at -inf, as torch's; below -86.5 (and for
 * NaN, which silu carries in g) it is exp(-86.5), not a subnormal: silu's 1 + exp(-g) is 1 either way.
 * ------------------------------------------------------------------------------------------- */

static inline __attribute__((always_inline)) float exp_f(float x) {
    float xc = select_f(!(x >= -86.5f), -86.5f, x); /* NaN too */
    xc = select_f(xc > 89.0f, 89.0f, xc);
    const float round_magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    float n = (xc * 1.44269504f + round_magic) - round_magic; /* in [-125, 128] */
    float r = xc - n * 0.693359375f; /* ln2 split in two: the high part times n is exact */
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    return p * as_float((uint32_t)((int32_t)n + 126) << 23) * 2.0f; /* 2^(n - 1) is normal for every n */
}

/* ---------------------------------------------------------------------------------------------
 * rms_norm and fused_add_rms_norm
 * ------------------------------------------------------------------------------------------- */

/* The sum of squares of x's n values (storage sdt: float32 or bfloat16); with add, residual =
 * rnd(residual + x) is written first and squared instead. LANES partial sums, added pairwise. */
static inline __attribute__((always_inline)) float squares(void *residual, const void *x, int64_t n, int sdt,
                                                           int add) {
    float acc[LANES] = {0}, tail = 0.0f;
    const int64_t full = n - n % LANES;
    for (int64_t i = 0; i < full; i += LANES) {
#pragma omp simd
        for (int j = 0; j < LANES; j++) {
            float v = ld(x, i + j, sdt);
            if (add) {
                v = rnd(ld(residual, i + j, sdt) + v, sdt);
                st_exact(residual, i + j, v, sdt);
            }
            acc[j] += v * v;
        }
    }
    for (int64_t i = full; i < n; i++) {
        float v = ld(x, i, sdt);
        if (add) {
            v = rnd(ld(residual, i, sdt) + v, sdt);
            st_exact(residual, i, v, sdt);
        }
        tail += v * v;
    }
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int j = 0; j < width; j++) acc[j] += acc[j + width];
    return acc[0] + tail;
}

/* squares() with the residual add decided outside its loops (residual NULL: none). */
static inline __attribute__((always_inline)) float sum_squares(void *residual, const void *x, int64_t n, int sdt) {
    return residual ? squares(residual, x, n, sdt, 1) : squares(NULL, x, n, sdt, 0);
}

/* One row of float32 or bfloat16, in place: two passes, the first summing squares (and adding the residual). */
static inline __attribute__((always_inline)) void norm_row_direct(void *out, const void *x, void *residual,
                                                                  const void *w, int64_t width, float eps, int sdt) {
    const float inv = 1.0f / sqrtf(sum_squares(residual, x, width, sdt) / (float)width + eps);
    const void *src = residual ? residual : x;
#pragma omp simd
    for (int64_t i = 0; i < width; i++) st(out, i, rnd(ld(src, i, sdt) * inv, sdt) * ld(w, i, sdt), sdt);
}

/* One row of float16 (or bfloat16: measured slower than norm_row_direct), through float32 buffers of
 * CHUNK features. */
static inline __attribute__((always_inline)) void norm_row_half(void *out, const void *x, void *residual,
                                                                const void *weight, int64_t width, float eps,
                                                                int dtype) {
    float xb[CHUNK], rb[CHUNK], wb[CHUNK];
    float sum = 0.0f;
    for (int64_t c = 0; c < width; c += CHUNK) {
        const int64_t n = min64(width - c, CHUNK);
        const float *xs = widen((const uint16_t *)x + c, xb, n, dtype);
        if (residual) {
            widen((uint16_t *)residual + c, rb, n, dtype);
#pragma omp simd
            for (int64_t i = 0; i < n; i++) rb[i] += xs[i];
            round_buf(rb, n, dtype);
            narrow((uint16_t *)residual + c, rb, n, dtype); /* exact: rb holds values of dtype */
            xs = rb;
        }
        sum += sum_squares(NULL, xs, n, DT_F32);
    }
    const float inv = 1.0f / sqrtf(sum / (float)width + eps);
    const void *src = residual ? residual : x;
    for (int64_t c = 0; c < width; c += CHUNK) {
        const int64_t n = min64(width - c, CHUNK);
        const float *xs = widen((const uint16_t *)src + c, xb, n, dtype);
        const float *ws = widen((const uint16_t *)weight + c, wb, n, dtype);
#pragma omp simd
        for (int64_t i = 0; i < n; i++) rb[i] = xs[i] * inv;
        round_buf(rb, n, dtype); /* the normalised value is rounded to x's dtype before the weight */
#pragma omp simd
        for (int64_t i = 0; i < n; i++) rb[i] *= ws[i];
        narrow((uint16_t *)out + c, rb, n, dtype);
    }
}

static void norm_rows(void *out, const void *x, int64_t x_outer_stride, int64_t x_inner_stride, void *residual,
                      int64_t r_outer_stride, int64_t r_inner_stride, const void *weight, int64_t inner,
                      int64_t width, float eps, int dtype, int64_t lo, int64_t hi) {
    const int64_t es = elem_size(dtype);
    for (int64_t r = lo; r < hi; r++) {
        const char *xr = (const char *)x + row_offset(r, inner, x_outer_stride, x_inner_stride) * es;
        char *rr = residual ? (char *)residual + row_offset(r, inner, r_outer_stride, r_inner_stride) * es : NULL;
        char *o = (char *)out + r * width * es;
        if (dtype == DT_F32) norm_row_direct(o, xr, rr, weight, width, eps, DT_F32);
        else if (dtype == DT_BF16) norm_row_direct(o, xr, rr, weight, width, eps, DT_BF16);
        else norm_row_half(o, xr, rr, weight, width, eps, DT_F16);
    }
}

/*
 * rms_norm of x's rows into out (contiguous [rows, width]); with residual non-NULL, residual += x
 * first (in place, rounded to its dtype) and the norm is of the sum. x and residual are [outer,
 * inner, width] with the given outer and inner strides (elements); weight is contiguous.
 */
int vp_rms_norm(void *out, const void *x, int64_t x_outer_stride, int64_t x_inner_stride, void *residual,
                int64_t r_outer_stride, int64_t r_inner_stride, const void *weight, int64_t outer, int64_t inner,
                int64_t width, float eps, int dtype, int num_threads) {
    if (!dtype_ok(dtype)) return ERR_DTYPE;
    const int64_t rows = outer * inner;
    if (rows == 0) return OK;
    if (num_threads > 1 && rows > 1 && rows * width >= PARALLEL_MIN_ELEMENTS) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t r = 0; r < rows; r++)
            norm_rows(out, x, x_outer_stride, x_inner_stride, residual, r_outer_stride, r_inner_stride, weight, inner,
                      width, eps, dtype, r, r + 1);
    } else {
        norm_rows(out, x, x_outer_stride, x_inner_stride, residual, r_outer_stride, r_inner_stride, weight, inner,
                  width, eps, dtype, 0, rows);
    }
    return OK;
}

/* ---------------------------------------------------------------------------------------------
 * silu_and_mul
 * ------------------------------------------------------------------------------------------- */

static inline __attribute__((always_inline)) float silu(float g) { return g / (1.0f + exp_f(-g)); }

static inline __attribute__((always_inline)) void silu_row(void *out, const void *x, int64_t d, int dtype) {
    if (dtype == DT_F32) {
        const float *gate = (const float *)x, *up = gate + d;
        float *o = (float *)out;
#pragma omp simd
        for (int64_t i = 0; i < d; i++) o[i] = silu(gate[i]) * up[i];
        return;
    }
    /* bfloat16 and float16 through float32 buffers: silu, its rounding and the product each a pass
     * in L1, which costs less than one loop of them all (gcc's 16 lanes of 16-bit elements run out
     * of AVX2's registers around exp) */
    float gb[CHUNK], ub[CHUNK], ob[CHUNK];
    for (int64_t c = 0; c < d; c += CHUNK) {
        const int64_t n = min64(d - c, CHUNK);
        const float *g = widen((const uint16_t *)x + c, gb, n, dtype);
        const float *u = widen((const uint16_t *)x + d + c, ub, n, dtype);
#pragma omp simd
        for (int64_t i = 0; i < n; i++) ob[i] = silu(g[i]);
        round_buf(ob, n, dtype); /* silu is rounded to x's dtype before the product, as the reference */
#pragma omp simd
        for (int64_t i = 0; i < n; i++) ob[i] *= u[i];
        narrow((uint16_t *)out + c, ob, n, dtype);
    }
}

static void silu_rows(void *out, const void *x, int64_t outer_stride, int64_t inner_stride, int64_t inner, int64_t d,
                      int dtype, int64_t lo, int64_t hi) {
    const int64_t es = elem_size(dtype);
    for (int64_t r = lo; r < hi; r++) {
        const char *xr = (const char *)x + row_offset(r, inner, outer_stride, inner_stride) * es;
        char *o = (char *)out + r * d * es;
        if (dtype == DT_F32) silu_row(o, xr, d, DT_F32);
        else if (dtype == DT_BF16) silu_row(o, xr, d, DT_BF16);
        else silu_row(o, xr, d, DT_F16);
    }
}

/* silu(x[..., :d]) * x[..., d:] into out (contiguous [rows, d]); x's rows as in vp_rms_norm. */
int vp_silu_and_mul(void *out, const void *x, int64_t x_outer_stride, int64_t x_inner_stride, int64_t outer,
                    int64_t inner, int64_t d, int dtype, int num_threads) {
    if (!dtype_ok(dtype)) return ERR_DTYPE;
    const int64_t rows = outer * inner;
    if (rows == 0) return OK;
    /* an output of silu costs about twice an element of a norm */
    if (num_threads > 1 && rows > 1 && rows * d >= PARALLEL_MIN_ELEMENTS / 2) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t r = 0; r < rows; r++) silu_rows(out, x, x_outer_stride, x_inner_stride, inner, d, dtype, r, r + 1);
    } else {
        silu_rows(out, x, x_outer_stride, x_inner_stride, inner, d, dtype, 0, rows);
    }
    return OK;
}

/* ---------------------------------------------------------------------------------------------
 * rotary_embedding
 * ------------------------------------------------------------------------------------------- */

typedef struct {
    char *base;
    int64_t token_stride, head_stride, heads; /* elements */
} rotated_t;

/* Rotate the first 2 * half features of a head in storage sdt, in place (cos, sin: half float32 each). */
static inline __attribute__((always_inline)) void rotate(void *head, const float *cos, const float *sin, int64_t half,
                                                         int is_neox, int sdt) {
    if (is_neox) { /* feature i pairs with i + half */
        char *second = (char *)head + half * elem_size(sdt);
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            float x1 = ld(head, i, sdt), x2 = ld(second, i, sdt);
            st(head, i, x1 * cos[i] - x2 * sin[i], sdt);
            st(second, i, x2 * cos[i] + x1 * sin[i], sdt);
        }
    } else { /* GPT-J: feature 2i pairs with 2i + 1 */
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            float x1 = ld(head, 2 * i, sdt), x2 = ld(head, 2 * i + 1, sdt);
            st(head, 2 * i, x1 * cos[i] - x2 * sin[i], sdt);
            st(head, 2 * i + 1, x2 * cos[i] + x1 * sin[i], sdt);
        }
    }
}

static inline __attribute__((always_inline)) void rotate_head(char *head, const float *cos, const float *sin,
                                                              int64_t half, int is_neox, int dtype) {
    if (dtype != DT_F16) {
        rotate(head, cos, sin, half, is_neox, dtype);
        return;
    }
    float buf[2 * MAX_HALF_ROT];
    widen_f16(head, buf, 2 * half);
    rotate(buf, cos, sin, half, is_neox, DT_F32);
    narrow_f16(head, buf, 2 * half); /* the one rounding */
}

static inline int64_t read_index(const void *p, int64_t i, int is_64) {
    return is_64 ? ((const int64_t *)p)[i] : ((const int32_t *)p)[i];
}

static void rotary_tokens(const void *positions, int64_t pos_stride, int pos_64, const rotated_t *t, int64_t n_t,
                          const void *cos_sin, int64_t cs_stride, int cs_dtype, int64_t half, int is_neox, int dtype,
                          int64_t lo, int64_t hi) {
    float cb[MAX_HALF_ROT], sb[MAX_HALF_ROT];
    const int64_t es = elem_size(dtype), cs_es = elem_size(cs_dtype);
    for (int64_t tok = lo; tok < hi; tok++) {
        const char *row = (const char *)cos_sin + read_index(positions, tok * pos_stride, pos_64) * cs_stride * cs_es;
        const float *cos = widen(row, cb, half, cs_dtype), *sin = widen(row + half * cs_es, sb, half, cs_dtype);
        for (int64_t k = 0; k < n_t; k++) {
            char *token = t[k].base + tok * t[k].token_stride * es;
            for (int64_t h = 0; h < t[k].heads; h++) {
                char *head = token + h * t[k].head_stride * es;
                if (dtype == DT_F32) rotate_head(head, cos, sin, half, is_neox, DT_F32);
                else if (dtype == DT_BF16) rotate_head(head, cos, sin, half, is_neox, DT_BF16);
                else rotate_head(head, cos, sin, half, is_neox, DT_F16);
            }
        }
    }
}

/*
 * Rotate the first rot features of every head of query and key in place. query and key are
 * [tokens, heads, head_size] with the given token and head strides (elements); cos_sin is
 * [max_position, rot] with row stride cs_stride, cosines then sines, of dtype cs_dtype (any of the
 * three, widened to float32). Every position is checked against [0, max_position) before anything
 * is written.
 */
int vp_rotary_embedding(const void *positions, int64_t pos_stride, int pos_64, int64_t tokens, void *query,
                        int64_t q_token_stride, int64_t q_head_stride, int64_t q_heads, void *key,
                        int64_t k_token_stride, int64_t k_head_stride, int64_t k_heads, const void *cos_sin,
                        int64_t cs_stride, int64_t max_position, int64_t rot, int cs_dtype, int is_neox, int dtype,
                        int num_threads) {
    if (!dtype_ok(dtype) || !dtype_ok(cs_dtype)) return ERR_DTYPE;
    if (rot <= 0 || rot % 2 || rot / 2 > MAX_HALF_ROT) return ERR_ROTARY_DIM;
    for (int64_t i = 0; i < tokens; i++) {
        int64_t p = read_index(positions, i * pos_stride, pos_64);
        if (p < 0 || p >= max_position) return ERR_POSITION;
    }
    const rotated_t t[2] = {{(char *)query, q_token_stride, q_head_stride, q_heads},
                            {(char *)key, k_token_stride, k_head_stride, k_heads}};
    const int64_t half = rot / 2;
    if (num_threads > 1 && tokens > 1 && tokens * (q_heads + k_heads) * rot >= PARALLEL_MIN_ELEMENTS) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t tok = 0; tok < tokens; tok++)
            rotary_tokens(positions, pos_stride, pos_64, t, 2, cos_sin, cs_stride, cs_dtype, half, is_neox, dtype, tok,
                          tok + 1);
    } else {
        rotary_tokens(positions, pos_stride, pos_64, t, 2, cos_sin, cs_stride, cs_dtype, half, is_neox, dtype, 0,
                      tokens);
    }
    return OK;
}

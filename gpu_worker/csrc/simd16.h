/*
 * 16-lane float32 vectors and bfloat16 conversions shared by the worker's C sources.
 *
 * v16 is a GCC/clang vector of 16 floats: the compiler maps it onto the machine's SIMD (one
 * AVX-512 register, two AVX2 registers, ...). bf16 values are 16-bit patterns, the top half of
 * a float32: widening is exact (a 16-bit shift); narrowing rounds to nearest even and keeps
 * NaNs quiet NaNs. With AVX-512 the conversions are single instructions (vpmovzxwd, and
 * vcvtneps2bf16 where AVX512-BF16 exists, else vpmovdw after integer rounding); elsewhere the
 * generic vector code below, which compilers turn into longer shuffle sequences.
 */
#ifndef PAGEDSERVE_SIMD16_H
#define PAGEDSERVE_SIMD16_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define W16 16
typedef float v16 __attribute__((vector_size(W16 * sizeof(float))));
typedef int32_t i16 __attribute__((vector_size(W16 * sizeof(int32_t))));
typedef uint32_t u16 __attribute__((vector_size(W16 * sizeof(uint32_t))));
typedef uint16_t h16 __attribute__((vector_size(W16 * sizeof(uint16_t))));
typedef float v8 __attribute__((vector_size(8 * sizeof(float))));
typedef int32_t i8v __attribute__((vector_size(8 * sizeof(int32_t))));

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

static inline v16 splat16(float x) {
    return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
}

static inline float bf16_widen(uint16_t h) {
    uint32_t w = (uint32_t)h << 16;
    float f;
    memcpy(&f, &w, sizeof f);
    return f;
}

static inline uint16_t bf16_narrow(float x) {
    uint32_t w;
    memcpy(&w, &x, sizeof w);
    if ((w & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((w | 0x00400000u) >> 16); /* NaN */
    w += 0x7fffu + ((w >> 16) & 1u);
    return (uint16_t)(w >> 16);
}

/* Element i of `base`: a float, or a bf16 value (`bf16`) widened; callers pass `bf16` as a
 * constant, so each entry point compiles its own branch-free copy. */
static inline __attribute__((always_inline)) float load_elem(const void *base, int64_t i,
                                                             const int bf16) {
    return bf16 ? bf16_widen(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* Stores x at element index i: as a float, or rounded to the nearest bf16 (ties to even). */
static inline __attribute__((always_inline)) void store_elem(void *base, int64_t i, float x,
                                                             const int bf16) {
    if (bf16)
        ((uint16_t *)base)[i] = bf16_narrow(x);
    else
        ((float *)base)[i] = x;
}

/* 16 bf16 values at p, widened. */
static inline v16 load_bf16x16(const uint16_t *p) {
#if defined(__AVX512F__)
    __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
    return (v16)_mm512_castsi512_ps(w);
#else
    h16 h;
    memcpy(&h, p, sizeof h);
    u16 w = __builtin_convertvector(h, u16) << 16;
    v16 v;
    memcpy(&v, &w, sizeof v);
    return v;
#endif
}

/* 16 floats rounded to bf16 at p. */
static inline void store_bf16x16(uint16_t *p, v16 v) {
#if defined(__AVX512BF16__)
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh((__m512)v));
#elif defined(__AVX512F__)
    u16 w;
    memcpy(&w, &v, sizeof w);
    const u16 nan = (u16)((w & 0x7fffffffu) > 0x7f800000u); /* all-ones lanes where NaN */
    w = (nan & (w | 0x00400000u)) | (~nan & (w + 0x7fffu + ((w >> 16) & 1u)));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32((__m512i)w, 16)));
#else
    /* Two halves of 8 lanes: GCC lowers a 16-lane compare on 8-lane machines to 16 scalar
     * compares (see lt16), and AVX2 has no unsigned compare; |bits| < 2^31, so the NaN test
     * is a signed one, the same answer. */
    typedef uint32_t u8v __attribute__((vector_size(8 * sizeof(uint32_t))));
    typedef uint16_t h8 __attribute__((vector_size(8 * sizeof(uint16_t))));
    u8v half[2];
    memcpy(half, &v, sizeof half);
    for (int i = 0; i < 2; i++) {
        u8v w = half[i];
        const u8v nan = (u8v)((i8v)(w & 0x7fffffffu) > 0x7f800000);
        w = (nan & (w | 0x00400000u)) | (~nan & (w + 0x7fffu + ((w >> 16) & 1u)));
        const h8 h = __builtin_convertvector(w >> 16, h8);
        memcpy(p + 8 * i, &h, sizeof h);
    }
#endif
}

/* 8-lane vectors: one AVX2 register. Kernels whose inner loops hold many vectors at once use
 * them where the machine has no AVX-512 (`NARROW_SIMD`): sixteen 16-lane vectors take all of
 * AVX2's sixteen registers twice over, and the compiler spills them to the stack. */
#if !defined(__AVX512F__)
#define NARROW_SIMD 1
#endif

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

static inline v8 splat8(float x) { return (v8){x, x, x, x, x, x, x, x}; }

/* 8 bf16 values at p, widened. */
static inline v8 load_bf16x8(const uint16_t *p) {
    typedef uint16_t h8 __attribute__((vector_size(8 * sizeof(uint16_t))));
    typedef uint32_t u8v __attribute__((vector_size(8 * sizeof(uint32_t))));
    h8 h;
    memcpy(&h, p, sizeof h);
    const u8v w = __builtin_convertvector(h, u8v) << 16;
    v8 v;
    memcpy(&v, &w, sizeof v);
    return v;
}

/* Lane-wise a < b: all-ones lanes where true, zeros elsewhere. Where the machine's vectors
 * are narrower than 16 floats (AVX2: 8), GCC lowers a 16-lane compare to 16 scalar compares
 * and inserts; two native 8-lane compares, joined, keep it in vector registers. */
static inline i16 lt16(v16 a, v16 b) {
#if defined(__AVX512F__)
    return a < b;
#else
    const v8 alo = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7);
    const v8 ahi = __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
    const v8 blo = __builtin_shufflevector(b, b, 0, 1, 2, 3, 4, 5, 6, 7);
    const v8 bhi = __builtin_shufflevector(b, b, 8, 9, 10, 11, 12, 13, 14, 15);
    const i8v lo = alo < blo, hi = ahi < bhi;
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
}

/* Lanes of a where mask is set, of b elsewhere (mask lanes all-ones or zeros, as lt16 gives). */
static inline v16 select16(i16 mask, v16 a, v16 b) {
    return (v16)((mask & (i16)a) | (~mask & (i16)b));
}

/* exp(x) for x <= 0, 16 lanes (libm's expf is a scalar call): x = n*ln2 + r with
 * |r| <= ln2/2 (Cody-Waite split of ln2), exp(r) by its degree-6 Taylor polynomial (relative
 * error < 2e-7), times 2^n built in the exponent bits; n = round(x / ln2) through a truncating
 * conversion, corrected where it rounded up. Below -87 the result is flushed to exp(-87)
 * ~ 1.6e-38. */
static inline v16 exp_nonpositive16(v16 x) {
    x = select16(lt16(x, splat16(-87.f)), splat16(-87.f), x);
    const v16 y = x * splat16(1.44269504088896341f) + splat16(0.5f);
    v16 n = __builtin_convertvector(__builtin_convertvector(y, i16), v16);
    n -= (v16)(lt16(y, n) & (i16)splat16(1.f));
    const v16 r = (x - n * splat16(0.693359375f)) - n * splat16(-2.12194440e-4f);
    v16 p = splat16(1.f / 720.f);
    p = p * r + splat16(1.f / 120.f);
    p = p * r + splat16(1.f / 24.f);
    p = p * r + splat16(1.f / 6.f);
    p = p * r + splat16(0.5f);
    p = p * r + splat16(1.f);
    p = p * r + splat16(1.f);
    const i16 e = (__builtin_convertvector(n, i16) + 127) << 23;
    return p * (v16)e;
}

/* The softmax weights of scores s[0 .. valid), in place and unnormalised (exp of each less
 * their max), zeros in s[valid .. padded); returns 1 / their sum. `padded` is a multiple of 16
 * (whole vectors throughout: the tail scores -inf, weighs exp(-87) at most, and is zeroed). The
 * loops are written with explicit vectors: left to the compiler, they stayed scalar in some
 * inlined copies. */
static inline float softmax_weights16(float *s, int valid, int padded) {
    for (int j = valid; j < padded; j++) s[j] = -INFINITY;
    v16 mv = splat16(-INFINITY);
    for (int j = 0; j < padded; j += W16) {
        const v16 x = load16(s + j);
        mv = select16(lt16(mv, x), x, mv);
    }
    float m = mv[0];
    for (int l = 1; l < W16; l++) m = mv[l] > m ? mv[l] : m;
    v16 sv = splat16(0.f);
    for (int j = 0; j < padded; j += W16) {
        const v16 e = exp_nonpositive16(load16(s + j) - splat16(m));
        store16(s + j, e);
        sv += e;
    }
    float sum = 0.f;
    for (int l = 0; l < W16; l++) sum += sv[l];
    for (int j = valid; j < padded; j++) sum -= s[j], s[j] = 0.f;
    return 1.f / sum;
}

#endif

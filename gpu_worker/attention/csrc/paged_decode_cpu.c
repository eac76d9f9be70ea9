/*
 * Paged attention for decode rows on the CPU, float32: one query token per sequence, read
 * straight from the block pool through the block table (no gathered copy of the context).
 *
 * Layouts (all row-major):
 *   q            token rows q_token_stride floats apart; head h of sequence s at
 *                q + rows[s]*q_token_stride + h*D
 *   rows         [S] int64, the flat token row of each sequence's query (and output)
 *   k_cache      [num_blocks, block_size, KV, D]   (v_cache the same)
 *   block_tables [S, table_stride] int32, logical block -> physical block
 *   seq_lens     [S] int32, context length including the new token (already in the cache)
 *   out          [T, H, D]; sequence s writes row rows[s]
 *
 * Work item = one sequence, all heads: each token's K and V rows (KV * D floats, contiguous
 * in the cache) are read once, in block order, for every query head. Two passes: scores and
 * their max per head, then exp-weights and the weighted sum of V rows. Per thread, scratch
 * holds H * max_len scores and the H * D accumulator. The common head sizes get their own
 * inlined copy with D a constant (short fixed-length loops vectorize without remainders).
 * Threads: OpenMP, the same libgomp torch has loaded.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEADS 256

/* exp(x) for x <= 0 in a form the compiler vectorizes (libm's expf is a scalar call):
 * x = n*ln2 + r with |r| <= ln2/2 (Cody-Waite split of ln2), exp(r) by its degree-6 Taylor
 * polynomial (relative error < 2e-7), times 2^n built in the exponent bits. Below -87 the
 * result is flushed to exp(-87) ~ 1.6e-38, which is 0 next to the row's max term (1). */
static inline float exp_nonpositive(float x) {
    x = x < -87.f ? -87.f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    union {
        int32_t i;
        float f;
    } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}

static inline __attribute__((always_inline)) void decode_seq(
    const float *qs, const float *k_cache, const float *v_cache, const int32_t *table, int len,
    float *o, float *scores, float *acc, int num_heads, int num_kv_heads, const int D,
    int block_size, int max_len, float scale) {
    const int rep = num_heads / num_kv_heads;
    const int64_t row = (int64_t)num_kv_heads * D; /* floats between consecutive slots */
    for (int h = 0; h < num_heads; h++) acc[h] = -INFINITY; /* acc[0:H] holds the maxes first */
    for (int j0 = 0; j0 < len; j0 += block_size) {
        const int64_t base = (int64_t)table[j0 / block_size] * block_size;
        const int n = len - j0 < block_size ? len - j0 : block_size;
        for (int i = 0; i < n; i++) {
            const float *kp = k_cache + (base + i) * row;
            for (int h = 0; h < num_heads; h++) {
                const float *kh = kp + (int64_t)(h / rep) * D;
                const float *qh = qs + (int64_t)h * D;
                float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < D; d++) dot += qh[d] * kh[d];
                dot *= scale;
                scores[(int64_t)h * max_len + j0 + i] = dot;
                if (dot > acc[h]) acc[h] = dot;
            }
        }
    }
    float sums[MAX_HEADS];
    for (int h = 0; h < num_heads; h++) {
        float *sh = scores + (int64_t)h * max_len;
        const float m = acc[h];
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int j = 0; j < len; j++) {
            sh[j] = exp_nonpositive(sh[j] - m);
            sum += sh[j];
        }
        sums[h] = sum;
    }
    memset(acc, 0, sizeof(float) * (size_t)num_heads * (size_t)D);
    for (int j0 = 0; j0 < len; j0 += block_size) {
        const int64_t base = (int64_t)table[j0 / block_size] * block_size;
        const int n = len - j0 < block_size ? len - j0 : block_size;
        for (int i = 0; i < n; i++) {
            const float *vp = v_cache + (base + i) * row;
            for (int h = 0; h < num_heads; h++) {
                const float *vh = vp + (int64_t)(h / rep) * D;
                const float w = scores[(int64_t)h * max_len + j0 + i];
                float *ah = acc + (int64_t)h * D;
#pragma omp simd
                for (int d = 0; d < D; d++) ah[d] += w * vh[d];
            }
        }
    }
    for (int h = 0; h < num_heads; h++) {
        const float inv = 1.f / sums[h];
#pragma omp simd
        for (int d = 0; d < D; d++) o[(int64_t)h * D + d] = acc[(int64_t)h * D + d] * inv;
    }
}

int paged_decode_f32(const float *q, int64_t q_token_stride, const int64_t *rows,
                     const float *k_cache, const float *v_cache, const int32_t *block_tables,
                     int64_t table_stride, const int32_t *seq_lens, float *out, int num_seqs,
                     int num_heads, int num_kv_heads, int head_dim, int block_size, int max_len,
                     float scale, int num_threads) {
    /* Return codes: 0 ok, 1 out of memory, 2 bad head counts, 3 a length outside 1..max_len. */
    if (num_heads > MAX_HEADS || num_heads % num_kv_heads != 0) return 2;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)num_heads * (size_t)max_len);
        float *acc = (float *)malloc(sizeof(float) * (size_t)num_heads * (size_t)head_dim);
        if (scores == NULL || acc == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int s = 0; s < num_seqs; s++) {
            if (scores == NULL || acc == NULL) continue;
            if (seq_lens[s] < 1 || seq_lens[s] > max_len) {
#pragma omp atomic write
                failed = 3;
                continue;
            }
            const float *qs = q + rows[s] * q_token_stride;
            float *o = out + rows[s] * num_heads * head_dim;
            const int32_t *table = block_tables + (int64_t)s * table_stride;
#define DECODE(D)                                                                             \
    decode_seq(qs, k_cache, v_cache, table, seq_lens[s], o, scores, acc, num_heads,         \
               num_kv_heads, D, block_size, max_len, scale)
            switch (head_dim) {
            case 32: DECODE(32); break;
            case 64: DECODE(64); break;
            case 128: DECODE(128); break;
            default: DECODE(head_dim); break;
            }
#undef DECODE
        }
        free(scores);
        free(acc);
    }
    return failed;
}

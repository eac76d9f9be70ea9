/*
 * Structured output's token mask applied to logits on the CPU: each listed row's logits whose
 * bit is clear in the row's bitmask (one bit per token, 32 to an int32 word, token 32w + i at
 * bit i of word w) become -inf. A word of all ones is skipped whole, so a mask that allows
 * most of the vocabulary costs little more than reading it. Rows are split over OpenMP
 * threads (torch's libgomp).
 */
#include <math.h>
#include <stdint.h>

void apply_token_mask_f32(float *logits, int64_t row_stride, const int32_t *bitmask,
                          const int64_t *rows, int num_rows, int vocab, int threads) {
    const int words = (vocab + 31) / 32;
#pragma omp parallel for num_threads(threads) if (num_rows > 1)
    for (int r = 0; r < num_rows; r++) {
        float *row = logits + rows[r] * row_stride;
        const uint32_t *mask = (const uint32_t *)(bitmask + (int64_t)r * words);
        for (int w = 0; w < words; w++) {
            const uint32_t bits = mask[w];
            if (bits == 0xFFFFFFFFu)
                continue;
            const int base = w * 32;
            const int end = base + 32 < vocab ? base + 32 : vocab;
            for (int t = base; t < end; t++)
                if (!((bits >> (t - base)) & 1u))
                    row[t] = -INFINITY;
        }
    }
}

/*
 * The bfloat16 decoder's elementwise steps, fused, for the CPU: in torch each is several ops,
 * and every bf16 op widens its inputs to float32, computes and rounds its output back, one
 * pass over memory each. Here each step is one pass, computing in float32 and rounding once
 * (to nearest even) where it stores.
 *
 *   add_rms_norm_bf16  h += delta (in place, rounded as torch's bf16 add rounds), then
 *                      out = h / sqrt(mean(h^2) + eps) * weight
 *   silu_mul_bf16      out = silu(gate) * up, gate|up halves of one [rows, 2 * inter] row
 *   rope_bf16          rotates the first `heads` head vectors of each token row in place, by
 *                      the cos|sin table row of the token's position (half-rotation layout)
 *
 * bf16 values are 16-bit patterns (a float32's top half), converted by simd16.h. Rows are
 * split over OpenMP threads (torch's libgomp) when there are enough of them.
 */
#include "simd16.h"

#define W W16

static inline float silu(float x) { return x / (1.f + expf(-x)); }

/* Below this many elements a call runs on one thread: waking the others costs more. */
#define PARALLEL_MIN 32768

static inline void norm_row(const uint16_t *x, const uint16_t *weight, uint16_t *out, int dim,
                            float eps) {
    v16 acc = splat16(0.f);
    int i = 0;
    for (; i + W <= dim; i += W) {
        const v16 v = load_bf16x16(x + i);
        acc += v * v;
    }
    float ss = 0.f;
    for (int l = 0; l < W; l++) ss += acc[l];
    for (; i < dim; i++) ss += bf16_widen(x[i]) * bf16_widen(x[i]);
    const float inv = 1.f / sqrtf(ss / (float)dim + eps);
    for (i = 0; i + W <= dim; i += W)
        store_bf16x16(out + i, load_bf16x16(x + i) * splat16(inv) * load_bf16x16(weight + i));
    for (; i < dim; i++) out[i] = bf16_narrow(bf16_widen(x[i]) * inv * bf16_widen(weight[i]));
}

void add_rms_norm_bf16(uint16_t *h, const uint16_t *delta, const uint16_t *weight,
                       uint16_t *out, int64_t rows, int hidden, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * hidden >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *hr = h + r * hidden;
        if (delta != NULL) {
            const uint16_t *dr = delta + r * hidden;
            int i = 0;
            for (; i + W <= hidden; i += W) store_bf16x16(hr + i, load_bf16x16(hr + i) + load_bf16x16(dr + i));
            for (; i < hidden; i++) hr[i] = bf16_narrow(bf16_widen(hr[i]) + bf16_widen(dr[i]));
        }
        norm_row(hr, weight, out + r * hidden, hidden, eps);
    }
}

void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int inter,
                   int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * inter >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * 2 * inter, *u = g + inter;
        uint16_t *o = out + r * inter;
        int i = 0;
        for (; i + W <= inter; i += W) {
            /* sigmoid(x) from e = exp(-|x|): 1 / (1 + e) for x >= 0, e / (1 + e) below. */
            const v16 x = load_bf16x16(g + i);
            const i16 neg = x < splat16(0.f);
            const v16 e = exp_nonpositive16((v16)((i16)x | (i16)splat16(-0.f)));
            const v16 num = (v16)((neg & (i16)e) | (~neg & (i16)splat16(1.f)));
            store_bf16x16(o + i, x * (num / (splat16(1.f) + e)) * load_bf16x16(u + i));
        }
        for (; i < inter; i++) o[i] = bf16_narrow(silu(bf16_widen(g[i])) * bf16_widen(u[i]));
    }
}

/* x: token rows `token_stride` elements apart, `heads` head vectors of D at the start of
 * each; cos_sin: [max_positions, D] rows, cos in the first half, sin in the second. */
void rope_bf16(uint16_t *x, int64_t token_stride, const int64_t *positions, int64_t tokens,
               int heads, int D, const uint16_t *cos_sin, int num_threads) {
    const int half = D / 2;
#pragma omp parallel for num_threads(num_threads) if (tokens * heads * D >= PARALLEL_MIN)
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *cs = cos_sin + positions[t] * D;
        for (int hd = 0; hd < heads; hd++) {
            uint16_t *a = x + t * token_stride + (int64_t)hd * D, *b = a + half;
            int i = 0;
            for (; i + W <= half; i += W) {
                const v16 c = load_bf16x16(cs + i), s = load_bf16x16(cs + half + i);
                const v16 x1 = load_bf16x16(a + i), x2 = load_bf16x16(b + i);
                store_bf16x16(a + i, x1 * c - x2 * s);
                store_bf16x16(b + i, x2 * c + x1 * s);
            }
            for (; i < half; i++) {
                const float c = bf16_widen(cs[i]), s = bf16_widen(cs[half + i]);
                const float x1 = bf16_widen(a[i]), x2 = bf16_widen(b[i]);
                a[i] = bf16_narrow(x1 * c - x2 * s);
                b[i] = bf16_narrow(x2 * c + x1 * s);
            }
        }
    }
}

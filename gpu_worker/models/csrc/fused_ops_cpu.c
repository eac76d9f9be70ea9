/*
 * The decoder's elementwise steps, fused, for the CPU, in bfloat16 and float32: in torch each
 * is several ops, one pass over memory and one dispatch each (and in bf16 every op widens its
 * inputs to float32, computes and rounds its output back). Here each step is one pass,
 * computing in float32 and, in bf16, rounding once (to nearest even) where it stores.
 *
 *   add_rms_norm_*  h += delta (in place, rounded as torch's add rounds), then
 *                   out = h / sqrt(mean(h^2) + eps) * weight
 *   silu_mul_*      out = silu(gate) * up, gate|up halves of one [rows, 2 * inter] row
 *   rope_*          rotates the first `heads` head vectors of each token row in place, by the
 *                   cos|sin table row of the token's position (half-rotation layout)
 *
 * One body serves both element types: each exported function calls an always-inlined body
 * with its type as a constant, so the compiler emits a specialised copy per type. bf16 values
 * are 16-bit patterns (a float32's top half), converted by simd16.h. Rows are split over
 * OpenMP threads (torch's libgomp) when there are enough of them.
 */
#include "simd16.h"

#define W W16
#define INLINE static inline __attribute__((always_inline))

typedef enum { BF16, F32 } elem_t;

INLINE v16 ld(const void *p, int64_t i, elem_t t) {
    return t == BF16 ? load_bf16x16((const uint16_t *)p + i) : load16((const float *)p + i);
}

INLINE void st(void *p, int64_t i, v16 v, elem_t t) {
    if (t == BF16)
        store_bf16x16((uint16_t *)p + i, v);
    else
        store16((float *)p + i, v);
}

INLINE float ld1(const void *p, int64_t i, elem_t t) {
    return t == BF16 ? bf16_widen(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

INLINE void st1(void *p, int64_t i, float x, elem_t t) {
    if (t == BF16)
        ((uint16_t *)p)[i] = bf16_narrow(x);
    else
        ((float *)p)[i] = x;
}

static inline float silu(float x) { return x / (1.f + expf(-x)); }

/* Below this many elements a call runs on one thread: waking the others costs more. */
#define PARALLEL_MIN 32768

INLINE void add_rms_norm(void *h, const void *delta, const void *weight, void *out,
                         int64_t rows, int hidden, float eps, int num_threads, elem_t t) {
#pragma omp parallel for num_threads(num_threads) if (rows * hidden >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r * hidden;
        int i = 0;
        if (delta != NULL) {
            for (; i + W <= hidden; i += W) st(h, base + i, ld(h, base + i, t) + ld(delta, base + i, t), t);
            for (; i < hidden; i++) st1(h, base + i, ld1(h, base + i, t) + ld1(delta, base + i, t), t);
        }
        v16 acc = splat16(0.f);
        for (i = 0; i + W <= hidden; i += W) {
            const v16 v = ld(h, base + i, t);
            acc += v * v;
        }
        float ss = 0.f;
        for (int l = 0; l < W; l++) ss += acc[l];
        for (; i < hidden; i++) ss += ld1(h, base + i, t) * ld1(h, base + i, t);
        const float inv = 1.f / sqrtf(ss / (float)hidden + eps);
        for (i = 0; i + W <= hidden; i += W)
            st(out, base + i, ld(h, base + i, t) * splat16(inv) * ld(weight, i, t), t);
        for (; i < hidden; i++) st1(out, base + i, ld1(h, base + i, t) * inv * ld1(weight, i, t), t);
    }
}

INLINE void silu_mul(const void *gate_up, void *out, int64_t rows, int inter, int num_threads,
                     elem_t t) {
#pragma omp parallel for num_threads(num_threads) if (rows * inter >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t g = r * 2 * inter, u = g + inter, o = r * inter;
        int i = 0;
        for (; i + W <= inter; i += W) {
            /* sigmoid(x) from e = exp(-|x|): 1 / (1 + e) for x >= 0, e / (1 + e) below. */
            const v16 x = ld(gate_up, g + i, t);
            const v16 e = exp_nonpositive16((v16)((i16)x | (i16)splat16(-0.f)));
            const v16 num = select16(lt16(x, splat16(0.f)), e, splat16(1.f));
            st(out, o + i, x * (num / (splat16(1.f) + e)) * ld(gate_up, u + i, t), t);
        }
        for (; i < inter; i++) st1(out, o + i, silu(ld1(gate_up, g + i, t)) * ld1(gate_up, u + i, t), t);
    }
}

/* x: token rows `token_stride` elements apart, `heads` head vectors of D at the start of
 * each; cos_sin: [max_positions, D] rows, cos in the first half, sin in the second. */
INLINE void rope(void *x, int64_t token_stride, const int64_t *positions, int64_t tokens,
                 int heads, int D, const void *cos_sin, int num_threads, elem_t t) {
    const int half = D / 2;
#pragma omp parallel for num_threads(num_threads) if (tokens * heads * D >= PARALLEL_MIN)
    for (int64_t tok = 0; tok < tokens; tok++) {
        const int64_t cs = positions[tok] * D;
        for (int hd = 0; hd < heads; hd++) {
            const int64_t a = tok * token_stride + (int64_t)hd * D, b = a + half;
            int i = 0;
            for (; i + W <= half; i += W) {
                const v16 c = ld(cos_sin, cs + i, t), s = ld(cos_sin, cs + half + i, t);
                const v16 x1 = ld(x, a + i, t), x2 = ld(x, b + i, t);
                st(x, a + i, x1 * c - x2 * s, t);
                st(x, b + i, x2 * c + x1 * s, t);
            }
            for (; i < half; i++) {
                const float c = ld1(cos_sin, cs + i, t), s = ld1(cos_sin, cs + half + i, t);
                const float x1 = ld1(x, a + i, t), x2 = ld1(x, b + i, t);
                st1(x, a + i, x1 * c - x2 * s, t);
                st1(x, b + i, x2 * c + x1 * s, t);
            }
        }
    }
}

#define EXPORT(SUFFIX, TYPE)                                                                    \
    void add_rms_norm_##SUFFIX(void *h, const void *delta, const void *weight, void *out,        \
                               int64_t rows, int hidden, float eps, int num_threads) {           \
        add_rms_norm(h, delta, weight, out, rows, hidden, eps, num_threads, TYPE);               \
    }                                                                                            \
    void silu_mul_##SUFFIX(const void *gate_up, void *out, int64_t rows, int inter,              \
                           int num_threads) {                                                    \
        silu_mul(gate_up, out, rows, inter, num_threads, TYPE);                                  \
    }                                                                                            \
    void rope_##SUFFIX(void *x, int64_t token_stride, const int64_t *positions, int64_t tokens,   \
                       int heads, int D, const void *cos_sin, int num_threads) {                 \
        rope(x, token_stride, positions, tokens, heads, D, cos_sin, num_threads, TYPE);          \
    }

EXPORT(bf16, BF16)
EXPORT(f32, F32)

/* An LM head's bf16 logits [rows, vocab] widened to float32 `out`, and the `k` largest of each
 * row's (ties in any order) in `top` [rows, k], in one pass: a k-entry min-heap per row whose
 * root is the bar a vector's lanes must clear before any of them is looked at one by one. */
static void sift_down(float *val, int64_t *id, int k, int i) {
    for (;;) {
        int least = i, l = 2 * i + 1, r = l + 1;
        if (l < k && val[l] < val[least]) least = l;
        if (r < k && val[r] < val[least]) least = r;
        if (least == i) return;
        float tv = val[i];
        val[i] = val[least];
        val[least] = tv;
        int64_t ti = id[i];
        id[i] = id[least];
        id[least] = ti;
        i = least;
    }
}

void widen_top_bf16(const uint16_t *logits, float *out, int64_t *top, int64_t rows,
                    int64_t vocab, int k, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * vocab >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *in = logits + r * vocab;
        float *o = out + r * vocab;
        int64_t *id = top + r * k;
        float val[k];
        for (int j = 0; j < k; j++) {
            val[j] = bf16_widen(in[j]);
            id[j] = j;
            o[j] = val[j];
        }
        for (int j = k / 2 - 1; j >= 0; j--) sift_down(val, id, k, j);
        int64_t i = k;
        for (; i < vocab && i % W; i++) {  /* up to a multiple of W, then whole vectors */
            o[i] = bf16_widen(in[i]);
            if (o[i] > val[0]) {
                val[0] = o[i];
                id[0] = i;
                sift_down(val, id, k, 0);
            }
        }
        for (; i + W <= vocab; i += W) {
            const v16 v = load_bf16x16(in + i);
            store16(o + i, v);
            const i16 above = lt16(splat16(val[0]), v);
            int any = 0;
            for (int l = 0; l < W; l++) any |= above[l];
            if (!any) continue;
            for (int l = 0; l < W; l++) {
                if (v[l] > val[0]) {
                    val[0] = v[l];
                    id[0] = i + l;
                    sift_down(val, id, k, 0);
                }
            }
        }
        for (; i < vocab; i++) {
            o[i] = bf16_widen(in[i]);
            if (o[i] > val[0]) {
                val[0] = o[i];
                id[0] = i;
                sift_down(val, id, k, 0);
            }
        }
    }
}

/* The float32 logits of each row's `k` ids in `top` [rows, k], recomputed from the bf16 hidden
 * state [rows, hidden] and LM head [vocab, hidden] (this rank's rows) and written into `out`
 * [rows, vocab] at those ids: exact products of the bf16 values summed in float32, 16 lanes
 * at a time, in place of a gather of the head's rows, their widening and a batched product. */
void refine_top_bf16(const uint16_t *hidden, const uint16_t *head, float *out,
                     const int64_t *top, int64_t rows, int64_t vocab, int64_t hidden_size, int k,
                     int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * k * hidden_size >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *x = hidden + r * hidden_size;
        for (int j = 0; j < k; j++) {
            const int64_t id = top[r * k + j];
            const uint16_t *w = head + id * hidden_size;
            v16 acc = splat16(0.f);
            int64_t d = 0;
            for (; d + W <= hidden_size; d += W) acc += load_bf16x16(w + d) * load_bf16x16(x + d);
            float sum = 0.f;
            for (int l = 0; l < W; l++) sum += acc[l];
            for (; d < hidden_size; d++) sum += bf16_widen(w[d]) * bf16_widen(x[d]);
            out[r * vocab + id] = sum;
        }
    }
}

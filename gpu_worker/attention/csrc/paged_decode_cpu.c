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
 *   D            a multiple of 16, at most MAX_HEAD_DIM
 *
 * Work item = one sequence, all its heads: each token's K and V rows are read once, as one
 * contiguous run per block, for the `rep` = H / KV query heads of each kv head. A batch with
 * fewer sequences than twice the threads splits each sequence's kv heads over several items.
 * Context tokens go in tiles of 16 (any block size: each token's row is found through the
 * table); the next tile's rows are prefetched into L2 while one is computed, a share of them
 * with each head's work (prefetch_share).
 *
 * Scores: for a query head and a tile, the 16 dot products q . k_t are formed as 16 vectors
 * of 16 partial sums (D / 16 multiply-adds each) and reduced together by a transposing tree
 * (transpose_sum16): 30 shuffles and 15 adds give all 16 scores in one vector, where one
 * horizontal sum per token would take 8 dependent steps. Then per head the max, the
 * exp-weights and their sum over the whole context (scores stay in per-thread scratch), and
 * the weighted sum of V rows, two tokens at a time into independent accumulators.
 *
 * Vectors are GCC/clang vector extensions, 16 floats wide: the compiler maps them onto the
 * machine's SIMD (one AVX-512 register, two AVX2 registers, ...). Threads: OpenMP, the same
 * libgomp torch has loaded.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 16
#define MAX_HEAD_DIM 256

typedef float v16 __attribute__((vector_size(TILE * sizeof(float))));

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

static inline v16 splat16(float x) {
    return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
}

#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)

/* Lane t of the result = the sum of the 16 lanes of p[t]. Each level adds the two halves of
 * every token's lanes, packing twice as many tokens per vector: pairs of vectors hold tokens
 * (2i, 2i+1) with 8 lanes each, then 4 tokens with 4 lanes, 8 with 2, 16 with 1. */
static inline v16 transpose_sum16(const v16 *p) {
    v16 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = SHUF(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22,
                    23) +
               SHUF(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                    30, 31);
    for (int i = 0; i < 4; i++)
        b[i] = SHUF(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26,
                    27) +
               SHUF(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29,
                    30, 31);
    for (int i = 0; i < 2; i++)
        c[i] = SHUF(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28,
                    29) +
               SHUF(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27,
                    30, 31);
    return SHUF(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           SHUF(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

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

/* Float offsets of the cache rows of context tokens j0 .. j0+15; tokens past len repeat the
 * last one, so that every load reads a written row (their scores and weights are unused). */
static inline void tile_offsets(int64_t *off, const int32_t *table, int j0, int len,
                                int block_size, int64_t row) {
    int blk = j0 / block_size, pos = j0 % block_size;
    int64_t slot = (int64_t)table[blk] * block_size + pos;
    for (int t = 0; t < TILE; t++) {
        off[t] = slot * row;
        if (j0 + t + 1 >= len) continue; /* stay on the last token */
        if (++pos == block_size) {
            pos = 0;
            slot = (int64_t)table[++blk] * block_size;
        } else {
            slot++;
        }
    }
}

/* Asks for the cache lines of one tile's rows (`n` floats from each offset) ahead of their
 * use: blocks sit anywhere in the pool, so the hardware prefetchers cannot guess the next. */
static inline void prefetch_tile(const float *base, const int64_t *off, int n) {
    for (int t = 0; t < TILE; t++)
        for (int c = 0; c < n; c += TILE) __builtin_prefetch(base + off[t] + c, 0, 2);
}

/* The offsets of the tile after the one at j0 into `next`; false, doing nothing, when j0's
 * tile is the last. */
static inline int advance_tile(int64_t *next, const int32_t *table, int j0, int len,
                               int block_size, int64_t row) {
    if (j0 + TILE >= len) return 0;
    tile_offsets(next, table, j0 + TILE, len, block_size, row);
    return 1;
}

/* Share x of `parts` of prefetch_tile's work (the tile's cache lines, `n` floats from each
 * offset, split evenly). Issued one share per head while the current tile is computed, the
 * requests reach memory at an even pace. Measured on SmolLM2's shapes (192 lines a tile) with
 * the pool in DRAM: one burst per tile was no faster than no prefetch at all; spread, the
 * kernel takes 1.3x less time, and no more with the pool in cache. */
static inline void prefetch_share(const float *base, const int64_t *off, int n, int x,
                                  int parts) {
    const int per_row = n / TILE, total = TILE * per_row;
    const int per = (total + parts - 1) / parts;
    const int end = (x + 1) * per < total ? (x + 1) * per : total;
    int k = x * per, t = k / per_row, c = k - t * per_row;
    for (; k < end; k++) {
        __builtin_prefetch(base + off[t] + c * TILE, 0, 2);
        if (++c == per_row) {
            c = 0;
            t++;
        }
    }
}

/* Query heads of kv heads g0 .. g0+ng-1 of one sequence (nh = ng * rep heads, contiguous in q
 * and out). Scratch: scores nh rows of `stride` floats; qbuf, acc nh * D. */
static inline __attribute__((always_inline)) void decode_heads(
    const float *qs, const float *k_cache, const float *v_cache, const int32_t *table, int len,
    float *o, float *scores, float *qbuf, float *acc, int g0, int ng, int rep, int num_kv_heads,
    const int D, int block_size, int stride, float scale) {
    const int C = D / TILE, nh = ng * rep;
    const int64_t row = (int64_t)num_kv_heads * D; /* floats between consecutive slots */
    const float *kg = k_cache + (int64_t)g0 * D; /* kv head g0 + i / rep: + (i / rep) * D */
    const float *vg = v_cache + (int64_t)g0 * D;
    const float *qh = qs + (int64_t)g0 * rep * D;
    for (int i = 0; i < nh * D; i++) qbuf[i] = qh[i] * scale;
    int64_t first[TILE], tiles[2][TILE];
    tile_offsets(first, table, 0, len, block_size, row);
    prefetch_tile(kg, first, ng * D);

    memcpy(tiles[0], first, sizeof first);
    for (int j0 = 0, cur = 0; j0 < len; j0 += TILE, cur ^= 1) {
        const int64_t *off = tiles[cur];
        const int more = advance_tile(tiles[cur ^ 1], table, j0, len, block_size, row);
        if (!more) prefetch_tile(vg, first, ng * D); /* the V pass starts there */
        for (int i = 0; i < nh; i++) {
            if (more) prefetch_share(kg, tiles[cur ^ 1], ng * D, i, nh);
            const float *qi = qbuf + (int64_t)i * D, *ki = kg + (int64_t)(i / rep) * D;
            v16 p[TILE];
            for (int t = 0; t < TILE; t++) {
                const float *kt = ki + off[t];
                v16 x = load16(qi) * load16(kt);
                for (int c = 1; c < C; c++) x += load16(qi + c * TILE) * load16(kt + c * TILE);
                p[t] = x;
            }
            store16(scores + (int64_t)i * stride + j0, transpose_sum16(p));
        }
    }

    /* Whole tiles throughout (no scalar remainder loops): the tail past len scores -inf,
     * its weights are then exp(-87) ~ 1.6e-38 at most and are zeroed before the V pass. */
    const int padded = (len + TILE - 1) / TILE * TILE;
    float inv[nh];
    for (int i = 0; i < nh; i++) {
        float *si = scores + (int64_t)i * stride;
        for (int j = len; j < padded; j++) si[j] = -INFINITY;
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int j = 0; j < padded; j++) m = si[j] > m ? si[j] : m;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int j = 0; j < padded; j++) {
            si[j] = exp_nonpositive(si[j] - m);
            sum += si[j];
        }
        for (int j = len; j < padded; j++) si[j] = 0.f;
        inv[i] = 1.f / sum;
    }
    memset(acc, 0, sizeof(float) * (size_t)nh * (size_t)D);

    memcpy(tiles[0], first, sizeof first);
    for (int j0 = 0, cur = 0; j0 < len; j0 += TILE, cur ^= 1) {
        const int64_t *off = tiles[cur];
        const int more = advance_tile(tiles[cur ^ 1], table, j0, len, block_size, row);
        for (int i = 0; i < nh; i++) {
            if (more) prefetch_share(vg, tiles[cur ^ 1], ng * D, i, nh);
            const float *w = scores + (int64_t)i * stride + j0, *vi = vg + (int64_t)(i / rep) * D;
            float *ai = acc + (int64_t)i * D;
            v16 a0[MAX_HEAD_DIM / TILE], a1[MAX_HEAD_DIM / TILE];
            for (int c = 0; c < C; c++) a0[c] = a1[c] = splat16(0.f);
            for (int t = 0; t < TILE; t += 2) {
                const float *v0 = vi + off[t], *v1 = vi + off[t + 1];
                const v16 w0 = splat16(w[t]), w1 = splat16(w[t + 1]);
                for (int c = 0; c < C; c++) {
                    a0[c] += w0 * load16(v0 + c * TILE);
                    a1[c] += w1 * load16(v1 + c * TILE);
                }
            }
            for (int c = 0; c < C; c++)
                store16(ai + c * TILE, load16(ai + c * TILE) + a0[c] + a1[c]);
        }
    }
    float *oh = o + (int64_t)g0 * rep * D;
    for (int i = 0; i < nh; i++)
        for (int d = 0; d < D; d++) oh[(int64_t)i * D + d] = acc[(int64_t)i * D + d] * inv[i];
}

int paged_decode_f32(const float *q, int64_t q_token_stride, const int64_t *rows,
                     const float *k_cache, const float *v_cache, const int32_t *block_tables,
                     int64_t table_stride, const int32_t *seq_lens, float *out, int num_seqs,
                     int num_heads, int num_kv_heads, int head_dim, int block_size, int max_len,
                     float scale, int num_threads) {
    /* Return codes: 0 ok, 1 out of memory, 2 bad head counts or head size, 3 a length outside
     * 1..max_len. */
    if (num_kv_heads < 1 || num_heads % num_kv_heads != 0 || head_dim % TILE != 0 ||
        head_dim < TILE || head_dim > MAX_HEAD_DIM)
        return 2;
    const int rep = num_heads / num_kv_heads;
    const int stride = (max_len + TILE - 1) / TILE * TILE;
    /* Each item is a sequence's kv heads split `splits` ways: whole rows (one contiguous run
     * per block) when there are sequences enough to keep every thread busy, else the fewest
     * splits that give each thread two items. */
    int splits = 1;
    while (num_seqs * splits < 2 * num_threads && splits < num_kv_heads) {
        do splits++;
        while (num_kv_heads % splits != 0);
    }
    const int ng = num_kv_heads / splits;
    /* A multiple of TILE floats (64 bytes), as aligned_alloc wants. */
    const size_t scratch = (size_t)ng * rep * ((size_t)stride + 2 * (size_t)head_dim);
    const int items = num_seqs * splits;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *buf = (float *)aligned_alloc(64, sizeof(float) * scratch);
        if (buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        float *scores = buf, *qbuf = buf + (size_t)ng * rep * stride;
        float *acc = qbuf + (size_t)ng * rep * head_dim;
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < items; item++) {
            if (buf == NULL) continue;
            const int s = item / splits, g0 = item % splits * ng;
            if (seq_lens[s] < 1 || seq_lens[s] > max_len) {
#pragma omp atomic write
                failed = 3;
                continue;
            }
            const float *qs = q + rows[s] * q_token_stride;
            float *o = out + rows[s] * num_heads * head_dim;
            const int32_t *table = block_tables + (int64_t)s * table_stride;
#define DECODE(D)                                                                             \
    decode_heads(qs, k_cache, v_cache, table, seq_lens[s], o, scores, qbuf, acc, g0, ng, rep, \
                 num_kv_heads, D, block_size, stride, scale)
            switch (head_dim) {
            case 32: DECODE(32); break;
            case 64: DECODE(64); break;
            case 128: DECODE(128); break;
            default: DECODE(head_dim); break;
            }
#undef DECODE
        }
        free(buf);
    }
    return failed;
}

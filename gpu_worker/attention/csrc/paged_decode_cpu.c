/*
 * Paged attention for decode rows on the CPU: one query token per sequence, read straight from
 * the block pool through the block table (no gathered copy of the context). Two entry points
 * share one body: paged_decode_f32 (q, cache and out in float32) and paged_decode_bf16 (all
 * three in bfloat16, the 16-bit pattern of a float32's top half). Arithmetic is float32 in both:
 * a bf16 value widens to float32 exactly (a 16-bit shift), products and sums accumulate in
 * float32, and only the output is rounded back (to nearest even). With AVX512-BF16 the bf16
 * q.k products take vdpbf16ps on the bf16 pairs directly (exact products, float32 sums).
 *
 * Layouts (all row-major; "elements" are floats or bf16 values):
 *   q            token rows q_token_stride elements apart; head h of sequence s at
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
 * Where the machine has no AVX-512 (simd16.h's NARROW_SIMD: AVX2's sixteen 8-float registers),
 * a tile's sixteen 16-lane partial sums would fill every register twice over and live on the
 * stack; there the scores go 8 tokens at a time in 8-lane vectors (transpose_sum8), and the V
 * rows are summed 32 columns at a time, so that the accumulators stay in registers.
 *
 * Vectors and bf16 conversions come from simd16.h (16-float vectors the compiler maps onto the
 * machine's SIMD; a bf16 load is one widening). Threads: OpenMP, the same libgomp torch has
 * loaded; or, where the worker runs the CPU team (team.h, `paged_decode_set_team`) and the
 * caller passes `team_gen`, the team: the same items, a helper's output written to its scratch
 * and copied out.
 */
#include <stdlib.h>

#include "simd16.h"
#include "team.h"

static team_run_fn team_runner;

void paged_decode_set_team(void *runner, void *left) {
    (void)left; /* the items' inputs are the caller's to hold */
    team_runner = (team_run_fn)runner;
}

#define TILE W16
#define MAX_HEAD_DIM 256

/* 16 elements at element index i of `base`: floats, or bf16 values (`bf16`) widened. Callers
 * pass `bf16` as a constant, so each entry point compiles its own branch-free copy. */
static inline __attribute__((always_inline)) v16 load_elems(const void *base, int64_t i,
                                                            const int bf16) {
    return bf16 ? load_bf16x16((const uint16_t *)base + i) : load16((const float *)base + i);
}

#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)

#if defined(NARROW_SIMD)
/* 8 elements at element index i of `base`, as load_elems. */
static inline __attribute__((always_inline)) v8 load_elems8(const void *base, int64_t i,
                                                            const int bf16) {
    return bf16 ? load_bf16x8((const uint16_t *)base + i) : load8((const float *)base + i);
}

/* Lane t of the result = the sum of the 8 lanes of p[t], by the same transposing tree as
 * transpose_sum16 on half the tokens. */
static inline v8 transpose_sum8(const v8 *p) {
    v8 a[4], b[2];
    for (int i = 0; i < 4; i++)
        a[i] = SHUF(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               SHUF(p[2 * i], p[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)
        b[i] = SHUF(a[2 * i], a[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
               SHUF(a[2 * i], a[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return SHUF(b[0], b[1], 0, 2, 4, 6, 8, 10, 12, 14) + SHUF(b[0], b[1], 1, 3, 5, 7, 9, 11, 13, 15);
}

/* The 16 scores of one query head `qi` (scaled, float32) against a tile's K rows, 8 tokens
 * at a time: 8 partial-sum vectors and the query stay in registers. */
static inline __attribute__((always_inline)) void tile_scores8(float *dst, const float *qi,
                                                               const void *k_cache, int64_t ki,
                                                               const int64_t *off, const int D,
                                                               const int bf16) {
    for (int h = 0; h < TILE; h += 8) {
        v8 p[8];
        for (int t = 0; t < 8; t++) {
            const int64_t kt = ki + off[h + t];
            v8 x = load8(qi) * load_elems8(k_cache, kt, bf16);
            for (int c = 8; c < D; c += 8)
                x += load8(qi + c) * load_elems8(k_cache, kt + c, bf16);
            p[t] = x;
        }
        store8(dst + h, transpose_sum8(p));
    }
}

/* acc[0 .. 8n) += the tile's V rows (columns from vi, n <= 4 vectors of 8) weighted by w:
 * two tokens at a time into independent accumulators, 2n of them. */
static inline __attribute__((always_inline)) void tile_values8(float *acc, const float *w,
                                                               const void *v_cache, int64_t vi,
                                                               const int64_t *off, const int n,
                                                               const int bf16) {
    v8 a0[4], a1[4];
    for (int c = 0; c < n; c++) a0[c] = a1[c] = splat8(0.f);
    for (int t = 0; t < TILE; t += 2) {
        const int64_t v0 = vi + off[t], v1 = vi + off[t + 1];
        const v8 w0 = splat8(w[t]), w1 = splat8(w[t + 1]);
        for (int c = 0; c < n; c++) {
            a0[c] += w0 * load_elems8(v_cache, v0 + 8 * c, bf16);
            a1[c] += w1 * load_elems8(v_cache, v1 + 8 * c, bf16);
        }
    }
    for (int c = 0; c < n; c++) store8(acc + 8 * c, load8(acc + 8 * c) + a0[c] + a1[c]);
}
#endif

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

/* Element offsets of the cache rows of context tokens j0 .. j0+15; tokens past len repeat the
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

#define LINE 64 /* bytes in a cache line */

/* Asks for the cache lines of one tile's rows (`bytes` from each offset, elements of `esize`
 * bytes) ahead of their use: blocks sit anywhere in the pool, so the hardware prefetchers
 * cannot guess the next. */
static inline void prefetch_tile(const char *base, const int64_t *off, int bytes, int esize) {
    for (int t = 0; t < TILE; t++)
        for (int c = 0; c < bytes; c += LINE) __builtin_prefetch(base + off[t] * esize + c, 0, 2);
}

/* The offsets of the tile after the one at j0 into `next`; false, doing nothing, when j0's
 * tile is the last. */
static inline int advance_tile(int64_t *next, const int32_t *table, int j0, int len,
                               int block_size, int64_t row) {
    if (j0 + TILE >= len) return 0;
    tile_offsets(next, table, j0 + TILE, len, block_size, row);
    return 1;
}

/* Share x of `parts` of prefetch_tile's work: the tile's rows split evenly (its lines, where
 * there are more parts than rows). Issued one share per head while the current tile is
 * computed, the requests reach memory at an even pace. Measured on SmolLM2's shapes (192 lines
 * a float32 tile) with the pool in DRAM: one burst per tile was no faster than no prefetch at
 * all; spread, the kernel takes 1.3x less time, and no more with the pool in cache. */
static inline void prefetch_share(const char *base, const int64_t *off, int bytes, int esize,
                                  int x, int parts) {
    if (parts <= TILE) { /* whole rows: no index arithmetic per line */
        const int t1 = (x + 1) * TILE / parts;
        for (int t = x * TILE / parts; t < t1; t++) {
            const char *row = base + off[t] * esize;
            for (int c = 0; c < bytes; c += LINE) __builtin_prefetch(row + c, 0, 2);
        }
        return;
    }
    const int per_row = (bytes + LINE - 1) / LINE, total = TILE * per_row;
    const int per = (total + parts - 1) / parts;
    const int end = (x + 1) * per < total ? (x + 1) * per : total;
    int k = x * per, t = k / per_row, c = k - t * per_row;
    for (; k < end; k++) {
        __builtin_prefetch(base + off[t] * esize + c * LINE, 0, 2);
        if (++c == per_row) {
            c = 0;
            t++;
        }
    }
}

/* Query heads of kv heads g0 .. g0+ng-1 of one sequence (nh = ng * rep heads, contiguous in q
 * and out; qs, o point at the sequence's token row). Scratch: scores nh rows of `stride`
 * floats; qbuf, acc nh * D floats. */
static inline __attribute__((always_inline)) void decode_heads(
    const void *qs, const void *k_cache, const void *v_cache, const int32_t *table, int len,
    void *o, float *scores, float *qbuf, float *acc, int g0, int ng, int rep, int num_kv_heads,
    const int D, int block_size, int stride, float scale, const int bf16) {
    const int C = D / TILE, nh = ng * rep, esize = bf16 ? 2 : 4, bytes = ng * D * esize;
    const int64_t row = (int64_t)num_kv_heads * D; /* elements between consecutive slots */
    const int64_t kv0 = (int64_t)g0 * D, h0 = (int64_t)g0 * rep * D; /* first kv / q element */
    const char *kp = (const char *)k_cache + kv0 * esize, *vp = (const char *)v_cache + kv0 * esize;
    for (int i = 0; i < nh * D; i++) qbuf[i] = load_elem(qs, h0 + i, bf16) * scale;
    int64_t first[TILE], tiles[2][TILE];
    tile_offsets(first, table, 0, len, block_size, row);
    prefetch_tile(kp, first, bytes, esize);

    memcpy(tiles[0], first, sizeof first);
    for (int j0 = 0, cur = 0; j0 < len; j0 += TILE, cur ^= 1) {
        const int64_t *off = tiles[cur];
        const int more = advance_tile(tiles[cur ^ 1], table, j0, len, block_size, row);
        if (!more) prefetch_tile(vp, first, bytes, esize); /* the V pass starts there */
        for (int i = 0; i < nh; i++) {
            if (more) prefetch_share(kp, tiles[cur ^ 1], bytes, esize, i, nh);
            const float *qi = qbuf + (int64_t)i * D;
            const int64_t ki = kv0 + (int64_t)(i / rep) * D;
#if defined(NARROW_SIMD)
            tile_scores8(scores + (int64_t)i * stride + j0, qi, k_cache, ki, off, D, bf16);
#else
            v16 p[TILE];
#if defined(__AVX512BF16__)
            if (bf16 && D % 32 == 0) {
                /* bf16 pairs straight into vdpbf16ps (exact products, float32 sums): no
                 * widening of K; the unscaled bf16 query, scaled after. */
                const uint16_t *q16 = (const uint16_t *)qs + h0 + (int64_t)i * D;
                const uint16_t *k16 = (const uint16_t *)k_cache;
                for (int t = 0; t < TILE; t++) {
                    const uint16_t *kt = k16 + ki + off[t];
                    __m512 x = _mm512_setzero_ps();
                    for (int c = 0; c < D; c += 32)
                        x = _mm512_dpbf16_ps(x, (__m512bh)_mm512_loadu_si512(q16 + c),
                                             (__m512bh)_mm512_loadu_si512(kt + c));
                    p[t] = (v16)x;
                }
                store16(scores + (int64_t)i * stride + j0, transpose_sum16(p) * splat16(scale));
                continue;
            }
#endif
            for (int t = 0; t < TILE; t++) {
                const int64_t kt = ki + off[t];
                v16 x = load16(qi) * load_elems(k_cache, kt, bf16);
                for (int c = 1; c < C; c++)
                    x += load16(qi + c * TILE) * load_elems(k_cache, kt + c * TILE, bf16);
                p[t] = x;
            }
            store16(scores + (int64_t)i * stride + j0, transpose_sum16(p));
#endif
        }
    }

    /* Whole tiles throughout (no scalar remainder loops): the tail past len weighs zero. */
    const int padded = (len + TILE - 1) / TILE * TILE;
    float inv[nh];
    for (int i = 0; i < nh; i++)
        inv[i] = softmax_weights16(scores + (int64_t)i * stride, len, padded);
    memset(acc, 0, sizeof(float) * (size_t)nh * (size_t)D);

    memcpy(tiles[0], first, sizeof first);
    for (int j0 = 0, cur = 0; j0 < len; j0 += TILE, cur ^= 1) {
        const int64_t *off = tiles[cur];
        const int more = advance_tile(tiles[cur ^ 1], table, j0, len, block_size, row);
        for (int i = 0; i < nh; i++) {
            if (more) prefetch_share(vp, tiles[cur ^ 1], bytes, esize, i, nh);
            const float *w = scores + (int64_t)i * stride + j0;
            const int64_t vi = kv0 + (int64_t)(i / rep) * D;
            float *ai = acc + (int64_t)i * D;
#if defined(NARROW_SIMD)
            for (int c = 0; c < D; c += 32) /* D is a multiple of 16 */
                tile_values8(ai + c, w, v_cache, vi + c, off, D - c >= 32 ? 4 : 2, bf16);
#else
            v16 a0[MAX_HEAD_DIM / TILE], a1[MAX_HEAD_DIM / TILE];
            for (int c = 0; c < C; c++) a0[c] = a1[c] = splat16(0.f);
            for (int t = 0; t < TILE; t += 2) {
                const int64_t v0 = vi + off[t], v1 = vi + off[t + 1];
                const v16 w0 = splat16(w[t]), w1 = splat16(w[t + 1]);
                for (int c = 0; c < C; c++) {
                    a0[c] += w0 * load_elems(v_cache, v0 + c * TILE, bf16);
                    a1[c] += w1 * load_elems(v_cache, v1 + c * TILE, bf16);
                }
            }
            for (int c = 0; c < C; c++)
                store16(ai + c * TILE, load16(ai + c * TILE) + a0[c] + a1[c]);
#endif
        }
    }
    for (int i = 0; i < nh; i++)
        for (int d = 0; d < D; d++)
            store_elem(o, h0 + (int64_t)i * D + d, acc[(int64_t)i * D + d] * inv[i], bf16);
}

typedef struct {
    const void *q, *k_cache, *v_cache;
    const int64_t *rows;
    const int32_t *block_tables, *seq_lens;
    void *out;
    float *main_buf; /* the calling thread's scratch */
    int64_t q_token_stride, table_stride;
    int num_heads, num_kv_heads, head_dim, block_size, stride, splits, ng, rep, bf16;
    float scale;
} decode_job;

/* Item `item` with scratch `buf` (scores, q, accumulators), its output to `o_base` (laid out
 * as `out`'s token row: head h at o_base + h * D elements). */
static inline __attribute__((always_inline)) void decode_item_into(const decode_job *j,
                                                                   int64_t item, float *buf,
                                                                   char *o_base, const int bf16) {
    const int s = (int)(item / j->splits), g0 = (int)(item % j->splits) * j->ng;
    const int esize = bf16 ? 2 : 4;
    float *scores = buf, *qbuf = buf + (size_t)j->ng * j->rep * j->stride;
    float *acc = qbuf + (size_t)j->ng * j->rep * j->head_dim;
    const char *qs = (const char *)j->q + j->rows[s] * j->q_token_stride * esize;
    const int32_t *table = j->block_tables + (int64_t)s * j->table_stride;
#define DECODE(D)                                                                              \
    decode_heads(qs, j->k_cache, j->v_cache, table, j->seq_lens[s], o_base, scores, qbuf, acc, \
                 g0, j->ng, j->rep, j->num_kv_heads, D, j->block_size, j->stride, j->scale,    \
                 bf16)
    switch (j->head_dim) {
    case 32: DECODE(32); break;
    case 64: DECODE(64); break;
    case 128: DECODE(128); break;
    default: DECODE(j->head_dim); break;
    }
#undef DECODE
}

static size_t decode_scratch(const decode_job *j) {
    return (size_t)j->ng * j->rep * ((size_t)j->stride + 2 * (size_t)j->head_dim);
}

static void decode_item(const void *params, int64_t item, float *scratch) {
    const decode_job *j = params;
    const int esize = j->bf16 ? 2 : 4, s = (int)(item / j->splits);
    const int64_t row = (int64_t)j->num_heads * j->head_dim; /* elements per output token */
    char *o = (char *)j->out + j->rows[s] * row * esize;
    float *buf = j->main_buf;
    if (scratch) { /* a helper: work in its scratch, the output after it (copied out later) */
        buf = scratch;
        const int64_t h0 = (int64_t)(item % j->splits) * j->ng * j->rep * j->head_dim;
        o = (char *)(scratch + decode_scratch(j)) - h0 * esize;
    }
    if (j->bf16)
        decode_item_into(j, item, buf, o, 1);
    else
        decode_item_into(j, item, buf, o, 0);
}

static void decode_copy(const void *params, int64_t item, const float *scratch) {
    const decode_job *j = params;
    const int esize = j->bf16 ? 2 : 4, s = (int)(item / j->splits);
    const int64_t row = (int64_t)j->num_heads * j->head_dim;
    const int64_t h0 = (int64_t)(item % j->splits) * j->ng * j->rep * j->head_dim;
    const size_t bytes = (size_t)j->ng * j->rep * j->head_dim * esize;
    memcpy((char *)j->out + (j->rows[s] * row + h0) * esize, scratch + decode_scratch(j), bytes);
}

/* Return codes: 0 ok, 1 out of memory, 2 bad head counts or head size, 3 a length outside
 * 1..max_len. With `team_gen` (not NULL) and a team set, the items run on the team and
 * *team_gen receives team.h's generation. */
static inline __attribute__((always_inline)) int paged_decode(
    const void *q, int64_t q_token_stride, const int64_t *rows, const void *k_cache,
    const void *v_cache, const int32_t *block_tables, int64_t table_stride,
    const int32_t *seq_lens, void *out, int num_seqs, int num_heads, int num_kv_heads,
    int head_dim, int block_size, int max_len, float scale, int num_threads, const int bf16,
    uint64_t *team_gen) {
    if (num_kv_heads < 1 || num_heads % num_kv_heads != 0 || head_dim % TILE != 0 ||
        head_dim < TILE || head_dim > MAX_HEAD_DIM)
        return 2;
    const int rep = num_heads / num_kv_heads, esize = bf16 ? 2 : 4;
    const int stride = (max_len + TILE - 1) / TILE * TILE;
    const int on_team = team_gen != NULL && team_runner != NULL;
    if (on_team) num_threads = 2; /* the caller and (at least) one helper */
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
    if (team_gen != NULL) *team_gen = 0;
    for (int s = 0; s < num_seqs; s++)
        if (seq_lens[s] < 1 || seq_lens[s] > max_len) return 3;
    decode_job j = {q,         k_cache,      v_cache,  rows,       block_tables,
                    seq_lens,  out,          NULL,     q_token_stride, table_stride,
                    num_heads, num_kv_heads, head_dim, block_size, stride,
                    splits,    ng,           rep,      bf16,       scale};
    if (on_team) {
        j.main_buf = (float *)aligned_alloc(64, sizeof(float) * scratch);
        if (j.main_buf == NULL) return 1;
        /* a helper's scratch: the work buffers, then its item's output */
        const int64_t helper_floats = (int64_t)scratch + (int64_t)ng * rep * head_dim;
        *team_gen = team_runner(decode_item, decode_copy, &j, sizeof j, items, helper_floats);
        free(j.main_buf);
        return 0;
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *buf = (float *)aligned_alloc(64, sizeof(float) * scratch);
        if (buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < items; item++) {
            if (buf == NULL) continue;
            char *o = (char *)out + rows[item / splits] * num_heads * head_dim * esize;
            decode_item_into(&j, item, buf, o, bf16);
        }
        free(buf);
    }
    return failed;
}

int paged_decode_f32(const float *q, int64_t q_token_stride, const int64_t *rows,
                     const float *k_cache, const float *v_cache, const int32_t *block_tables,
                     int64_t table_stride, const int32_t *seq_lens, float *out, int num_seqs,
                     int num_heads, int num_kv_heads, int head_dim, int block_size, int max_len,
                     float scale, int num_threads, uint64_t *team_gen) {
    return paged_decode(q, q_token_stride, rows, k_cache, v_cache, block_tables, table_stride,
                        seq_lens, out, num_seqs, num_heads, num_kv_heads, head_dim, block_size,
                        max_len, scale, num_threads, 0, team_gen);
}

int paged_decode_bf16(const uint16_t *q, int64_t q_token_stride, const int64_t *rows,
                      const uint16_t *k_cache, const uint16_t *v_cache,
                      const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                      uint16_t *out, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                      int block_size, int max_len, float scale, int num_threads,
                      uint64_t *team_gen) {
    return paged_decode(q, q_token_stride, rows, k_cache, v_cache, block_tables, table_stride,
                        seq_lens, out, num_seqs, num_heads, num_kv_heads, head_dim, block_size,
                        max_len, scale, num_threads, 1, team_gen);
}

/*
 * Causal attention of prompt chunks on the CPU: each segment is a sequence's new rows in this
 * step, after C keys of context already in the paged KV cache (C = 0: a fresh prompt). Row i
 * attends to the C cached keys and to its own segment's rows 0..i of the step's k and v. Two
 * entry points share one body: prefill_attention_f32 and prefill_attention_bf16 (q, k, v and
 * out all bfloat16). Arithmetic is float32 in both; only the output is rounded.
 *
 * Layouts (row-major, "elements" floats or bf16 values):
 *   q     token rows q_stride elements apart, each token's H heads of D contiguous
 *   k, v  token rows k_stride / v_stride apart, each token's KV heads of D contiguous
 *   out   [T, H, D] contiguous
 *   starts, lens [S] int32: segment s is token rows starts[s] .. starts[s] + lens[s] - 1
 *   ctx   [S] int32, the cached keys before each segment's first row, or NULL (all 0)
 *   k_cache, v_cache [blocks][block_size][KV][D] in float32 or bf16 (`cache_bf16`), read for
 *         the ctx keys through tables [S][table_stride] int32 (NULL where ctx is)
 *   D     a multiple of 16, at most MAX_HEAD_DIM; H a multiple of KV (grouped queries)
 *
 * Two phases in one parallel region:
 *
 *   1. per (segment, kv head): K widened to float32 and transposed, kt[d][j] (the C cached
 *      keys, then the segment's own; padded to whole tiles of 16 keys with zeros), V widened,
 *      vf[j][d]; both in a buffer shared by the threads.
 *   2. per (segment, query head, tile of QT query rows), the late tiles first (a causal tile's
 *      work grows with its rows' positions; dynamic scheduling then evens the threads out):
 *      R query rows at a time, their scores against 16 keys at once (one kt row load feeds R
 *      multiply-adds with each row's broadcast q element), a softmax over the row's keys, and
 *      the weighted sum of V rows, R rows sharing each V load.
 *
 * Whole key tiles throughout: keys past a row's position get zero weight
 * (softmax_weights16).
 *
 * On the CPU team (team.h; `prefill_attention_set_team`, and the caller passes `team_gen`):
 * phase 1 on the calling thread, phase 2's items on the team, a helper's rows written to its
 * scratch and copied out. Phase 1's buffer (`arena`) then outlives the call: a helper whose
 * item was taken back may still read it, so until every helper has left that call the next
 * one takes a fresh buffer and the old one waits in `retired`.
 */
#include <stdlib.h>

#include "simd16.h"
#include "team.h"

static team_run_fn team_runner;
static team_left_fn team_left;

void prefill_attention_set_team(void *runner, void *left) {
    team_runner = (team_run_fn)runner;
    team_left = (team_left_fn)left;
}

#define TILE W16
#define MAX_HEAD_DIM 256
/* bf16 keys stay bf16 where the CPU has vdpbf16ps: kt then holds pairs of head elements per
 * key, [D/2][ld][2] (exact products, float32 sums, as the decode kernel's q.k), in the first
 * half of its float32 room. Each pair is stored swapped, element 2e+1 first: vdpbf16ps adds
 * the upper product before the lower, so the sums run in the order of the float32 path, and
 * with a power-of-two scale (head size 64 or 256) the scores are the float32 path's, bit for
 * bit. */
#if defined(__AVX512BF16__)
#define PAIRED_KEYS 1
#else
#define PAIRED_KEYS 0
#endif

/* Where segments' cached keys are (`ctx` NULL: none has any); one struct, as ctypes passes it. */
typedef struct {
    const int32_t *ctx;
    const void *k_cache, *v_cache;
    const int32_t *tables;
    int64_t table_stride;
    int32_t block_size, cache_bf16;
} paged_context;
#define R 4   /* query rows computed together */
#define QT 32 /* query rows per work item */
#define DC 4  /* 16-float vectors of the output accumulated per pass over the keys */

/* Rows i0 .. i0+nr-1 (nr <= R) of one query head of one segment after c cached keys. q: the
 * head's first element of segment row 0; kt [D][ld], vf [ld][D] of its kv head (key c + i is
 * row i's own); scores: R rows of ld floats. */
static inline __attribute__((always_inline)) void rows_block(
    const void *q, int64_t q_stride, const float *kt, const float *vf, int ld, int c, int i0,
    int nr, void *out, int64_t out_stride, float *scores, const int D, float scale,
    const int bf16) {
    const int last = c + i0 + nr - 1; /* the block's last row sees keys 0..last */
    const int keys = (last + TILE) / TILE * TILE;
#if PAIRED_KEYS
    if (bf16) { /* kt holds bf16 pairs: vdpbf16ps on q's pairs, the scale on the sums */
        const uint16_t *kp = (const uint16_t *)kt;
        int32_t qp[R][MAX_HEAD_DIM / 2];
        for (int r = 0; r < R; r++)
            for (int e = 0; e < D / 2; e++) {
                const uint16_t *qe = (const uint16_t *)q + (int64_t)(i0 + r) * q_stride + 2 * e;
                qp[r][e] = r < nr ? (int32_t)((uint32_t)qe[0] << 16 | qe[1]) : 0; /* swapped */
            }
        for (int j0 = 0; j0 < keys; j0 += TILE) {
            __m512 acc[R];
            for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
            for (int e = 0; e < D / 2; e++) {
                const __m512bh kv =
                    (__m512bh)_mm512_loadu_si512(kp + ((int64_t)e * ld + j0) * 2);
                for (int r = 0; r < R; r++)
                    acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(qp[r][e]), kv);
            }
            for (int r = 0; r < R; r++)
                store16(scores + (int64_t)r * ld + j0, (v16)acc[r] * splat16(scale));
        }
    } else
#endif
    {
    float qb[R][MAX_HEAD_DIM];
    for (int r = 0; r < R; r++)
        for (int d = 0; d < D; d++)
            qb[r][d] = r < nr ? load_elem(q, (int64_t)(i0 + r) * q_stride + d, bf16) * scale : 0.f;
    for (int j0 = 0; j0 < keys; j0 += TILE) {
        v16 acc[R];
        for (int r = 0; r < R; r++) acc[r] = splat16(0.f);
        for (int d = 0; d < D; d++) {
            const v16 kv = load16(kt + (int64_t)d * ld + j0);
            for (int r = 0; r < R; r++) acc[r] += splat16(qb[r][d]) * kv;
        }
        for (int r = 0; r < R; r++) store16(scores + (int64_t)r * ld + j0, acc[r]);
    }
    }

    float inv[R];
    for (int r = 0; r < nr; r++) /* row i0+r sees keys 0 .. c+i0+r */
        inv[r] = softmax_weights16(scores + (int64_t)r * ld, c + i0 + r + 1, keys);
    for (int r = nr; r < R; r++) { /* rows past the segment: zero weights, never stored */
        memset(scores + (int64_t)r * ld, 0, sizeof(float) * (size_t)keys);
        inv[r] = 0.f;
    }

    const int C = D / TILE;
    for (int c0 = 0; c0 < C; c0 += DC) {
        const int nc = C - c0 < DC ? C - c0 : DC;
        v16 o[R][DC];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < DC; c++) o[r][c] = splat16(0.f);
        for (int j = 0; j <= last; j++) {
            const float *vj = vf + (int64_t)j * D + c0 * TILE;
            for (int c = 0; c < DC; c++) {
                if (c >= nc) break;
                const v16 x = load16(vj + c * TILE);
                for (int r = 0; r < R; r++) o[r][c] += splat16(scores[(int64_t)r * ld + j]) * x;
            }
        }
        for (int r = 0; r < nr; r++)
            for (int c = 0; c < nc; c++) {
                const v16 y = o[r][c] * splat16(inv[r]);
                const int64_t at = (int64_t)(i0 + r) * out_stride + (c0 + c) * TILE;
                if (bf16)
                    store_bf16x16((uint16_t *)out + at, y);
                else
                    store16((float *)out + at, y);
            }
    }
}

/* Phase 2 on the team: what each item needs (team.h copies it for the helpers). */
typedef struct {
    const void *q;
    const float *kv;
    const int64_t *base;
    const int *first_item;
    const int32_t *lens;
    const int32_t *ctx;
    void *out; /* the segment rows' output, or NULL for a helper's scratch */
    const int32_t *starts;
    float *main_scores;
    int64_t q_stride;
    int num_heads, rep, D, max_ld, bf16, items;
    float scale;
} prefill_job;

/* Phase 2's item `it`: segment s, head h, query tile `tile`, whose rows end before `end`. */
typedef struct {
    int s, h, tile, end;
} tile_place;

static inline tile_place place_of(const int *first_item, const int32_t *lens, int it) {
    int s = 0;
    while (first_item[s + 1] <= it) s++;
    const int local = it - first_item[s], tiles = (lens[s] + QT - 1) / QT;
    const int tile = local % tiles, end = (tile + 1) * QT < lens[s] ? (tile + 1) * QT : lens[s];
    return (tile_place){s, local / tiles, tile, end};
}

/* Phase 2's item `it`: into `out` at its rows and head h's columns, or, with `oh_override`,
 * into that buffer from the tile's first row on, rows `override_stride` elements apart (a
 * helper's scratch); scores: R rows of the step's widest segment. */
static inline __attribute__((always_inline)) void phase2_item(
    const void *q, int64_t q_stride, const float *kv, const int64_t *base, const int *first_item,
    const int32_t *starts, const int32_t *lens, const int32_t *ctx, int it, int num_heads,
    int rep, int D, float scale, float *scores, char *oh_override, int64_t override_stride,
    void *out, const int bf16) {
    const int esize = bf16 ? 2 : 4;
    const tile_place t = place_of(first_item, lens, it);
    const int s = t.s, h = t.h, tile = t.tile, g = h / rep, L = lens[s], end = t.end;
    const int c = ctx ? ctx[s] : 0, ld = (c + L + TILE - 1) / TILE * TILE;
    const float *kt = kv + base[s] + (int64_t)g * 2 * D * ld, *vf = kt + (int64_t)D * ld;
    const char *qh = (const char *)q + ((int64_t)starts[s] * q_stride + h * D) * esize;
    char *oh = oh_override ? oh_override - (int64_t)tile * QT * override_stride * esize
                           : (char *)out + ((int64_t)starts[s] * num_heads * D + h * D) * esize;
    const int64_t ostride = oh_override ? override_stride : (int64_t)num_heads * D;
    for (int i0 = tile * QT; i0 < end; i0 += R) {
        const int nr = end - i0 < R ? end - i0 : R;
#define BLOCK(DIM) \
    rows_block(qh, q_stride, kt, vf, ld, c, i0, nr, oh, ostride, scores, DIM, scale, bf16)
        switch (D) {
        case 64: BLOCK(64); break;
        case 128: BLOCK(128); break;
        default: BLOCK(D); break;
        }
#undef BLOCK
    }
}

/* Items run high to low, as the OpenMP loop does: the long late tiles first. */
static void prefill_item(const void *params, int64_t item, float *scratch) {
    const prefill_job *j = params;
    const int it = j->items - 1 - (int)item;
    float *scores = scratch ? scratch : j->main_scores;
    char *oh = scratch ? (char *)(scratch + (size_t)R * j->max_ld) : NULL;
    if (j->bf16)
        phase2_item(j->q, j->q_stride, j->kv, j->base, j->first_item, j->starts, j->lens,
                    j->ctx, it, j->num_heads, j->rep, j->D, j->scale, scores, oh, j->D, j->out,
                    1);
    else
        phase2_item(j->q, j->q_stride, j->kv, j->base, j->first_item, j->starts, j->lens,
                    j->ctx, it, j->num_heads, j->rep, j->D, j->scale, scores, oh, j->D, j->out,
                    0);
}

static void prefill_copy(const void *params, int64_t item, const float *scratch) {
    const prefill_job *j = params;
    const int it = j->items - 1 - (int)item, esize = j->bf16 ? 2 : 4;
    const tile_place t = place_of(j->first_item, j->lens, it);
    const char *src = (const char *)(scratch + (size_t)R * j->max_ld);
    for (int i = t.tile * QT; i < t.end; i++)
        memcpy((char *)j->out +
                   (((int64_t)j->starts[t.s] + i) * j->num_heads * j->D + (int64_t)t.h * j->D) *
                       esize,
               src + (int64_t)(i - t.tile * QT) * j->D * esize, (size_t)j->D * esize);
}

/* Phase 1's buffer on the team: first_item (S + 1 ints), base (S + 1 int64), the widened K/V.
 * `arena_gen`: the last call whose helper may still read it (team.h's generation, 0: none).
 * A chunk after a long context widens all of it, so the buffer can grow large: one past
 * ARENA_KEEP_BYTES is given back once a call needs less than a quarter of it, and buffers
 * still read wait in `retired` up to RETIRED_MAX_BYTES in all (past that a call runs alone in
 * a private buffer). */
static char *arena;
static size_t arena_bytes;
static uint64_t arena_gen;
#define MAX_RETIRED 64
#define ARENA_KEEP_BYTES ((size_t)16 << 20)
#define RETIRED_MAX_BYTES ((size_t)256 << 20)
static struct {
    char *block;
    size_t bytes;
    uint64_t gen;
} retired[MAX_RETIRED];
static int num_retired;
static size_t retired_bytes;

static char *arena_for(size_t bytes) {
    const uint64_t left = team_left();
    for (int i = 0; i < num_retired;) /* free what every helper has left */
        if (retired[i].gen <= left) {
            free(retired[i].block);
            retired_bytes -= retired[i].bytes;
            retired[i] = retired[--num_retired];
        } else {
            i++;
        }
    const int busy = arena != NULL && arena_gen > left;
    const int oversized = arena_bytes > ARENA_KEEP_BYTES && bytes < arena_bytes / 4;
    if (bytes <= arena_bytes && !busy && !oversized) return arena;
    if (busy) {
        if (num_retired == MAX_RETIRED || retired_bytes + arena_bytes > RETIRED_MAX_BYTES)
            return NULL;
        retired[num_retired].block = arena;
        retired[num_retired].bytes = arena_bytes;
        retired[num_retired++].gen = arena_gen;
        retired_bytes += arena_bytes;
    } else {
        free(arena);
    }
    arena = NULL;
    arena_bytes = 0;
    arena_gen = 0;
    const size_t want = (bytes + bytes / 2 + 63) / 64 * 64; /* room to grow */
    arena = (char *)aligned_alloc(64, want);
    if (arena != NULL) arena_bytes = want;
    return arena;
}

/* Return codes: 0 ok, 1 out of memory, 2 bad head counts or head size, 3 a bad segment. */
static inline __attribute__((always_inline)) int prefill_attention(
    const void *q, int64_t q_stride, const void *k, int64_t k_stride, const void *v,
    int64_t v_stride, const int32_t *starts, const int32_t *lens, int num_segs, void *out,
    int num_heads, int num_kv_heads, int head_dim, float scale, int num_threads, const int bf16,
    const paged_context *pc, uint64_t *team_gen) {
    if (num_kv_heads < 1 || num_heads % num_kv_heads != 0 || head_dim % TILE != 0 ||
        head_dim < TILE || head_dim > MAX_HEAD_DIM)
        return 2;
    const int32_t *ctx = pc != NULL ? pc->ctx : NULL;
    if (ctx != NULL && (pc->k_cache == NULL || pc->v_cache == NULL || pc->tables == NULL ||
                        pc->block_size < 1))
        return 3;
    const int rep = num_heads / num_kv_heads, D = head_dim;
    int on_team = team_gen != NULL && team_runner != NULL;
    if (team_gen != NULL) *team_gen = 0;
    int max_ld = TILE;
    int64_t kv_floats = 0;
    for (int s = 0; s < num_segs; s++) {
        const int c = ctx ? ctx[s] : 0;
        if (lens[s] < 1 || starts[s] < 0 || c < 0 ||
            (c > 0 && (c - 1) / pc->block_size >= pc->table_stride))
            return 3;
        const int ld = (c + lens[s] + TILE - 1) / TILE * TILE;
        max_ld = ld > max_ld ? ld : max_ld;
        kv_floats += (int64_t)num_kv_heads * 2 * D * ld;
    }
    /* Where each segment's widened K/V start in the shared buffer, and the work items. */
    const size_t head_bytes = ((sizeof(int) * ((size_t)num_segs + 1) + 63) / 64) * 64;
    const size_t base_bytes = ((sizeof(int64_t) * ((size_t)num_segs + 1) + 63) / 64) * 64;
    const size_t need = head_bytes + base_bytes + sizeof(float) * (size_t)kv_floats;
    char *block = on_team ? arena_for(need) : NULL;
    if (block == NULL) { /* not on the team, or every retired buffer still read: a private one */
        on_team = 0;
        block = (char *)aligned_alloc(64, (need + 63) / 64 * 64);
    }
    if (block == NULL) return 1;
    int *first_item = (int *)block;
    int64_t *base = (int64_t *)(block + head_bytes);
    float *kv = (float *)(block + head_bytes + base_bytes);
    base[0] = 0;
    first_item[0] = 0;
    for (int s = 0; s < num_segs; s++) {
        const int ld = ((ctx ? ctx[s] : 0) + lens[s] + TILE - 1) / TILE * TILE;
        base[s + 1] = base[s] + (int64_t)num_kv_heads * 2 * D * ld;
        first_item[s + 1] = first_item[s] + num_heads * ((lens[s] + QT - 1) / QT);
    }
    int failed = 0;
    const int items = first_item[num_segs], prep = num_segs * num_kv_heads;
    if (on_team) num_threads = 1; /* phase 1 here, on the calling thread */
#pragma omp parallel num_threads(num_threads)
    {
        /* A multiple of 16 floats (64 bytes), as aligned_alloc wants. */
        float *scores = (float *)aligned_alloc(64, sizeof(float) * R * (size_t)max_ld);
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int it = 0; it < prep; it++) {
            const int s = it / num_kv_heads, g = it % num_kv_heads, L = lens[s];
            const int c = ctx ? ctx[s] : 0, ld = (c + L + TILE - 1) / TILE * TILE;
            float *kt = kv + base[s] + (int64_t)g * 2 * D * ld, *vf = kt + (int64_t)D * ld;
            const int64_t r0 = starts[s] - (int64_t)c, off = (int64_t)g * D;
            const int32_t *table = ctx ? pc->tables + (int64_t)s * pc->table_stride : NULL;
            uint16_t *kp = (uint16_t *)kt; /* PAIRED_KEYS && bf16: [D/2][ld][2] */
            const int paired = PAIRED_KEYS && bf16;
            for (int j = 0; j < ld; j++) {
                float *vj = vf + (int64_t)j * D;
                if (j >= c + L) { /* padding: zero keys and values */
                    for (int d = 0; d < D; d++) {
                        if (paired)
                            kp[((int64_t)(d / 2) * ld + j) * 2 + 1 - d % 2] = 0;
                        else
                            kt[(int64_t)d * ld + j] = 0.f;
                        vj[d] = 0.f;
                    }
                    continue;
                }
                const void *ks = k, *vs = v;
                int64_t at = (r0 + j) * k_stride + off, vat = (r0 + j) * v_stride + off;
                int kb16 = bf16;
                if (j < c) { /* cached: through the block table, in the cache's dtype */
                    const int64_t row = (int64_t)table[j / pc->block_size] * pc->block_size +
                                        j % pc->block_size;
                    ks = pc->k_cache, vs = pc->v_cache, kb16 = pc->cache_bf16;
                    at = vat = row * num_kv_heads * D + off;
                }
                if (paired && kb16) /* the pairs as they are */
                    for (int e = 0; e < D / 2; e++)
                        for (int h = 0; h < 2; h++)
                            kp[((int64_t)e * ld + j) * 2 + 1 - h] =
                                ((const uint16_t *)ks)[at + 2 * e + h];
                else if (paired) /* a float32 cache under a bf16 model: bf16 values widened */
                    for (int d = 0; d < D; d++)
                        kp[((int64_t)(d / 2) * ld + j) * 2 + 1 - d % 2] =
                            bf16_narrow(((const float *)ks)[at + d]);
                else if (kb16)
                    for (int d = 0; d < D; d++)
                        kt[(int64_t)d * ld + j] = load_elem(ks, at + d, 1);
                else
                    for (int d = 0; d < D; d++) kt[(int64_t)d * ld + j] = load_elem(ks, at + d, 0);
                if (kb16)
                    for (int d = 0; d < D; d++) vj[d] = load_elem(vs, vat + d, 1);
                else
                    for (int d = 0; d < D; d++) vj[d] = load_elem(vs, vat + d, 0);
            }
        }
        if (on_team) {
            if (scores != NULL) {
                const prefill_job j = {q,         kv,        base,   first_item, lens,
                                       ctx,       out,       starts, scores,     q_stride,
                                       num_heads, rep,       D,      max_ld,     bf16,
                                       items,     scale};
                const int64_t helper_floats = (int64_t)R * max_ld + (int64_t)QT * D;
                *team_gen = team_runner(prefill_item, prefill_copy, &j, sizeof j, items,
                                        helper_floats);
                if (*team_gen) arena_gen = *team_gen;
            }
        } else {
#pragma omp for schedule(dynamic, 1)
            for (int it = items - 1; it >= 0; it--) {
                if (scores == NULL) continue;
                phase2_item(q, q_stride, kv, base, first_item, starts, lens, ctx, it, num_heads,
                            rep, D, scale, scores, NULL, 0, out, bf16);
            }
        }
        free(scores);
    }
    if (!on_team) free(block);
    return failed;
}

int prefill_attention_f32(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                          const float *v, int64_t v_stride, const int32_t *starts,
                          const int32_t *lens, int num_segs, float *out, int num_heads,
                          int num_kv_heads, int head_dim, float scale, int num_threads,
                          const paged_context *pc, uint64_t *team_gen) {
    return prefill_attention(q, q_stride, k, k_stride, v, v_stride, starts, lens, num_segs, out,
                             num_heads, num_kv_heads, head_dim, scale, num_threads, 0, pc,
                             team_gen);
}

int prefill_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k,
                           int64_t k_stride, const uint16_t *v, int64_t v_stride,
                           const int32_t *starts, const int32_t *lens, int num_segs,
                           uint16_t *out, int num_heads, int num_kv_heads, int head_dim,
                           float scale, int num_threads, const paged_context *pc,
                           uint64_t *team_gen) {
    return prefill_attention(q, q_stride, k, k_stride, v, v_stride, starts, lens, num_segs, out,
                             num_heads, num_kv_heads, head_dim, scale, num_threads, 1, pc,
                             team_gen);
}

/*
 * A team for the worker's CPU steps that no other process can stall, and the products that run
 * on it (float32; bf16 with vdpbf16ps, or on AMX tiles).
 *
 * OpenMP ends every parallel region at a barrier: when another process (the gateway, the
 * control plane, a load client) takes the core of one thread of the team, the others wait at
 * the barrier until it gets the core back, so every millisecond of their CPU costs the step a
 * millisecond on each core. Here the calling thread (the model's) works with helper threads
 * on a shared list of items and never waits for a helper that has lost its core:
 *
 *   team_run_items:   the caller claims items from the front, the helpers from the back, each
 *                     by compare-and-swap on the item's state, so no item is done twice by
 *                     choice. A helper computes into its own scratch and copies the result
 *                     out only after a second compare-and-swap (HELPER -> COPYING). When the
 *                     caller runs out of items, it waits for the helpers' items a few times as
 *                     long as its own took, then takes back the ones still running (HELPER ->
 *                     STOLEN) and computes them itself; the helper's late result is dropped.
 *
 * Item states carry the job's generation, so a helper woken late cannot claim an item of a
 * later job with an earlier job's parameters. A helper whose item was taken back may still be
 * reading that job's inputs: the call returns the generation, and the caller keeps the inputs
 * alive until every helper has left it (`team_left_gen`). Outputs are written only by the
 * caller or under COPYING, which the caller waits out, so nothing is written after the call
 * returns. Helpers spin `spin_us` after a job, then sleep on a futex.
 *
 * The products: `gemm_f32` computes x @ w.T (+ bias) for a weight packed by `pack_f32` into
 * panels of NR columns ([panels][K][NR], zero-padded), one item per (rows, panel),
 * with an MR x NR register block (16-float vectors from simd16.h: NR = 32 on AVX-512, 16 on
 * narrower SIMD). Linux only (futex, CPU affinity).
 */
#define _GNU_SOURCE
#include "simd16.h"
#include "team.h"
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

/* ---- the team ----------------------------------------------------------------------------- */

enum { FREE = 0, MAIN = 1, HELPER = 2, COPYING = 3, DONE = 4, STOLEN = 5 };
#define MAX_ITEMS 16384
#define MAX_HELPERS 15
#define SCRATCH_FLOATS (64 * 1024) /* a helper's scratch at least; a job may ask more */
#define PARAM_BYTES TEAM_PARAM_BYTES

typedef team_item_fn item_fn;
typedef team_copy_fn copy_fn;

typedef struct {
    item_fn run;
    copy_fn copy;
    int64_t n_items, scratch_floats;
    _Alignas(16) char params[PARAM_BYTES];
} job_t;

static job_t job;
static _Atomic uint64_t job_gen; /* 2 * generation; odd while the job is being written */
static _Atomic uint64_t states[MAX_ITEMS];
static _Atomic uint32_t wake_word, sleepers;
static _Atomic uint64_t left_gen[MAX_HELPERS]; /* the last generation each helper left */
static pthread_t threads[MAX_HELPERS];
static int num_helpers;
static int64_t spin_ns = 100000;
static int64_t stall_us; /* fault injection (tests): each helper pauses this long per claim */
static uint64_t gen_counter;
static _Atomic uint64_t taken_back_count; /* items the caller took back from a helper */

static inline uint64_t st(uint64_t gen, uint64_t s) { return (gen << 3) | s; }

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Waits until a job newer than `seen` is published; its job_gen value. */
static uint64_t await_job(uint64_t seen) {
    int64_t t0 = now_ns();
    for (;;) {
        uint64_t g = atomic_load_explicit(&job_gen, memory_order_acquire);
        if (g != seen && !(g & 1)) return g;
        if (now_ns() - t0 < spin_ns) {
            cpu_relax();
            continue;
        }
        uint32_t w = atomic_load(&wake_word);
        atomic_fetch_add(&sleepers, 1);
        g = atomic_load(&job_gen);
        if (g == seen || (g & 1))
            syscall(SYS_futex, (uint32_t *)&wake_word, FUTEX_WAIT_PRIVATE, w, NULL, NULL, 0);
        atomic_fetch_sub(&sleepers, 1);
        t0 = now_ns();
    }
}

static float *first_scratch[MAX_HELPERS]; /* allocated by team_start: a helper never fails */

static void *helper_main(void *arg) {
    const int h = (int)(intptr_t)arg;
    int64_t capacity = SCRATCH_FLOATS;
    float *scratch = first_scratch[h];
    uint64_t seen = 0;
    job_t local;
    for (;;) {
        uint64_t g = await_job(seen);
        memcpy(&local, &job, sizeof local); /* a seqlock read: valid if job_gen did not move */
        atomic_thread_fence(memory_order_acquire);
        if (atomic_load_explicit(&job_gen, memory_order_relaxed) != g) continue;
        seen = g;
        const uint64_t gen = g >> 1;
        if (local.scratch_floats > capacity) { /* sized in whole 64-byte lines */
            float *bigger = aligned_alloc(64, (size_t)(local.scratch_floats + 15) / 16 * 64);
            if (bigger == NULL) { /* no share in this job: the caller does it all */
                atomic_store_explicit(&left_gen[h], gen, memory_order_release);
                continue;
            }
            free(scratch);
            scratch = bigger;
            capacity = local.scratch_floats;
        }
        for (int64_t i = local.n_items - 1; i >= 0; i--) {
            uint64_t expect = st(gen, FREE);
            if (!atomic_compare_exchange_strong(&states[i], &expect, st(gen, HELPER))) {
                /* another helper's: go on; the caller's, or a later job: stop */
                if (expect == st(gen, HELPER) || expect == st(gen, COPYING) ||
                    expect == st(gen, DONE))
                    continue;
                break;
            }
            /* as if it lost its core after claiming the item: taken back, then computed from
             * inputs the caller must still keep alive (team_left_gen) */
            if (stall_us > 0) usleep((useconds_t)stall_us);
            local.run(local.params, i, scratch);
            expect = st(gen, HELPER);
            if (!atomic_compare_exchange_strong(&states[i], &expect, st(gen, COPYING))) break;
            local.copy(local.params, i, scratch);
            atomic_store_explicit(&states[i], st(gen, DONE), memory_order_release);
        }
        atomic_store_explicit(&left_gen[h], gen, memory_order_release);
    }
    return NULL;
}

/* Starts `n` helpers, helper i bound to cpus[i] where cpus[i] >= 0; `stall` (tests only: 0)
 * makes each helper pause that many microseconds on every item it claims, before computing it.
 * Returns the helpers running (a second call starts none). */
int team_start(int n, const int *cpus, int64_t spin_us, int64_t stall) {
    if (num_helpers > 0 || n <= 0) return num_helpers;
    if (n > MAX_HELPERS) n = MAX_HELPERS;
    spin_ns = spin_us * 1000;
    stall_us = stall;
    for (int i = 0; i < n; i++) {
        first_scratch[i] = aligned_alloc(64, SCRATCH_FLOATS * sizeof(float));
        if (first_scratch[i] == NULL) break;
        if (pthread_create(&threads[i], NULL, helper_main, (void *)(intptr_t)i) != 0) {
            free(first_scratch[i]);
            break;
        }
        if (cpus[i] >= 0) {
            cpu_set_t set;
            CPU_ZERO(&set);
            CPU_SET(cpus[i], &set);
            pthread_setaffinity_np(threads[i], sizeof set, &set);
        }
        num_helpers = i + 1;
    }
    return num_helpers;
}

uint64_t team_taken_back(void) { return atomic_load(&taken_back_count); }

/* The oldest generation some helper may still be reading: every job at or below it is left. */
uint64_t team_left_gen(void) {
    uint64_t m = UINT64_MAX;
    for (int i = 0; i < num_helpers; i++) {
        uint64_t g = atomic_load_explicit(&left_gen[i], memory_order_acquire);
        if (g < m) m = g;
    }
    return m;
}

/* Runs items 0..n-1 with the helpers (team.h). Returns this job's generation if a helper may
 * still read its inputs (an item was taken back from it), else 0. */
uint64_t team_run_items(item_fn run, copy_fn copy, const void *params, size_t psize, int64_t n,
                        int64_t scratch_floats) {
    if (num_helpers == 0 || n < 2 || n > MAX_ITEMS || psize > PARAM_BYTES) {
        for (int64_t i = 0; i < n; i++) run(params, i, NULL);
        return 0;
    }
    const uint64_t gen = ++gen_counter;
    atomic_store_explicit(&job_gen, gen * 2 - 1, memory_order_relaxed); /* odd: writing */
    atomic_thread_fence(memory_order_release); /* ... before any of the writes below */
    job.run = run;
    job.copy = copy;
    job.n_items = n;
    job.scratch_floats = scratch_floats;
    memcpy(job.params, params, psize);
    for (int64_t i = 0; i < n; i++)
        atomic_store_explicit(&states[i], st(gen, FREE), memory_order_relaxed);
    atomic_store(&job_gen, gen * 2);
    if (atomic_load(&sleepers) > 0) {
        atomic_fetch_add(&wake_word, 1);
        syscall(SYS_futex, (uint32_t *)&wake_word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    }
    int64_t i = 0, spent = 0, mine = 0;
    for (; i < n; i++) {
        uint64_t expect = st(gen, FREE);
        if (!atomic_compare_exchange_strong(&states[i], &expect, st(gen, MAIN))) break;
        const int64_t t = now_ns();
        run(params, i, NULL);
        spent += now_ns() - t;
        mine++;
    }
    /* A helper gets three of the caller's item times to finish (200 us when the caller did
     * none: helpers that took every item are more likely busy than stalled), then its item
     * is taken back. */
    const int64_t patience = (mine ? 3 * spent / mine : 200000) + 2000;
    uint64_t taken_back = 0;
    for (int64_t j = i; j < n; j++) {
        const int64_t t0 = now_ns();
        for (;;) {
            uint64_t s = atomic_load_explicit(&states[j], memory_order_acquire);
            if (s == st(gen, DONE)) break;
            if (s == st(gen, FREE) || (s == st(gen, HELPER) && now_ns() - t0 > patience)) {
                const int from_helper = s == st(gen, HELPER);
                if (atomic_compare_exchange_strong(&states[j], &s,
                                                   st(gen, from_helper ? STOLEN : MAIN))) {
                    run(params, j, NULL);
                    if (from_helper) {
                        taken_back = gen;
                        atomic_fetch_add_explicit(&taken_back_count, 1, memory_order_relaxed);
                    }
                    break;
                }
                continue;
            }
            cpu_relax();
        }
    }
    return taken_back;
}

/* ---- products ------------------------------------------------------------------------------ */

#if defined(__AVX512F__)
#define NV 2
#else
#define NV 1
#endif
#define NR (NV * W16)
#define MR 6
#if defined(__AVX512BF16__) && NV == 2
#define HAVE_BF16_PRODUCTS 1
#else
#define HAVE_BF16_PRODUCTS 0
#endif
/* An item's rows: all of them up to WHOLE_ROWS (a decode step: each panel is read once and
 * stays in L1 across the rows), else blocks of ROWS_PER_ITEM (a multiple of MR); either fits a
 * helper's scratch. */
#define ROWS_PER_ITEM 96
#define WHOLE_ROWS 128
static inline int64_t item_rows_of(int64_t m) { return m <= WHOLE_ROWS ? m : ROWS_PER_ITEM; }

int64_t gemm_panel_width(void) { return NR; }

/* Where the CPU has AVX512-BF16 (and AVX-512's 32-column panels): bf16 products. */
int gemm_bf16_supported(void) { return HAVE_BF16_PRODUCTS; }

/* w [n, k] (row-major, as torch's Linear weight) -> out [ceil(n / NR)][k][NR], zero-padded. */
void pack_f32(const float *w, int64_t n, int64_t k, float *out) {
    const int64_t panels = (n + NR - 1) / NR;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t j = 0; j < NR; j++) {
                const int64_t col = p * NR + j;
                out[(p * k + kk) * NR + j] = col < n ? w[col * k + kk] : 0.0f;
            }
}

/* bf16 w [n, k] -> [panels][ceil(k / 2)][NR][2]: each column's pairs of consecutive k, as
 * vdpbf16ps takes them; zero past n and past an odd k. */
void pack_bf16(const uint16_t *w, int64_t n, int64_t k, uint16_t *out) {
    const int64_t panels = (n + NR - 1) / NR, kp = (k + 1) / 2;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t q = 0; q < kp; q++)
            for (int64_t j = 0; j < NR; j++)
                for (int64_t e = 0; e < 2; e++) {
                    const int64_t col = p * NR + j, kk = 2 * q + e;
                    out[((p * kp + q) * NR + j) * 2 + e] =
                        col < n && kk < k ? w[col * k + kk] : (uint16_t)0;
                }
}

#if defined(NARROW_SIMD)
/* The float32 block where vectors are 8 floats wide (AVX2): its 12 accumulators, the panel
 * row's two vectors and the broadcast are 15 of the 16 registers. Held as 16-float vectors,
 * GCC kept them on the stack and the product ran at a sixth of the core's rate. The same
 * multiply-adds in the same order as the 16-float block. */
static inline __attribute__((always_inline)) void micro_f32_narrow(const float *a, int64_t lda,
                                                                   const float *bp, int64_t k,
                                                                   float *c, int64_t ldc,
                                                                   int64_t ncols,
                                                                   const float *bias,
                                                                   const int mr) {
    v8 acc[MR][2];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < 2; v++) acc[r][v] = bias ? load8(bias + 8 * v) : splat8(0.0f);
    for (int64_t kk = 0; kk < k; kk++) {
        const v8 b0 = load8(bp + kk * NR), b1 = load8(bp + kk * NR + 8);
        for (int r = 0; r < mr; r++) {
            const v8 s = splat8(a[r * lda + kk]);
            acc[r][0] += s * b0;
            acc[r][1] += s * b1;
        }
    }
    for (int r = 0; r < mr; r++) {
        float tmp[NR];
        float *row = ncols == NR ? c + r * ldc : tmp;
        store8(row, acc[r][0]);
        store8(row + 8, acc[r][1]);
        if (ncols != NR) memcpy(c + r * ldc, tmp, (size_t)ncols * sizeof(float));
    }
}
#endif

/* c[0:mr, 0:ncols] = a[0:mr] @ panel + bias (NULL: none), mr * NV vector accumulators over k.
 * float32: one multiply-add per k. bf16: vdpbf16ps per pair of k (exact products, float32
 * sums; an odd k's last one paired with 0), the output rounded once to bf16. */
static inline __attribute__((always_inline)) void micro(const void *a_, int64_t lda,
                                                        const void *bp_, int64_t k, void *c_,
                                                        int64_t ldc, int64_t ncols,
                                                        const float *bias, const int mr,
                                                        const int bf16) {
#if defined(NARROW_SIMD)
    if (!bf16) {
        micro_f32_narrow(a_, lda, bp_, k, c_, ldc, ncols, bias, mr);
        return;
    }
#endif
    v16 acc[MR][NV];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = bias ? load16(bias + v * W16) : splat16(0.0f);
    if (!bf16) {
        const float *a = a_, *bp = bp_;
        for (int64_t kk = 0; kk < k; kk++) {
            v16 b[NV];
            for (int v = 0; v < NV; v++) b[v] = load16(bp + kk * NR + v * W16);
            for (int r = 0; r < mr; r++) {
                const v16 s = splat16(a[r * lda + kk]);
                for (int v = 0; v < NV; v++) acc[r][v] += s * b[v];
            }
        }
    }
#if HAVE_BF16_PRODUCTS
    if (bf16) {
        const uint16_t *a = a_, *bp = bp_;
        const int64_t full = k / 2;
        for (int64_t q = 0; q < (k + 1) / 2; q++) {
            const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bp + q * 2 * NR);
            const __m512bh b1 = (__m512bh)_mm512_loadu_si512(bp + q * 2 * NR + NR);
            for (int r = 0; r < mr; r++) {
                uint32_t pair = a[r * lda + 2 * q]; /* past full: paired with 0 */
                if (q < full) memcpy(&pair, a + r * lda + 2 * q, sizeof pair);
                const __m512bh s = (__m512bh)_mm512_set1_epi32((int)pair);
                acc[r][0] = (v16)_mm512_dpbf16_ps((__m512)acc[r][0], s, b0);
                acc[r][1] = (v16)_mm512_dpbf16_ps((__m512)acc[r][1], s, b1);
            }
        }
    }
#endif
    const int esize = bf16 ? 2 : 4;
    for (int r = 0; r < mr; r++) {
        char tmp[NR * 4];
        char *row = ncols == NR ? (char *)c_ + r * ldc * esize : tmp;
        for (int v = 0; v < NV; v++) {
            if (bf16)
                store_bf16x16((uint16_t *)row + v * W16, acc[r][v]);
            else
                store16((float *)row + v * W16, acc[r][v]);
        }
        if (ncols != NR) memcpy((char *)c_ + r * ldc * esize, tmp, (size_t)ncols * esize);
    }
}

typedef struct {
    const void *a, *wp, *bias; /* float32 or bf16, as `bf16` says */
    void *c;
    int64_t m, k, n, panels, rows; /* rows: an item's */
    int bf16, tiles;               /* tiles: a bf16 product's TILES_* */
} gemm_params;

/* Panel p's bias widened to float32 (the last panel's columns past n zero). */
static inline void widen_bias(const gemm_params *g, int64_t p, int64_t ncols, float *bias) {
    for (int64_t j = 0; j < NR; j++)
        bias[j] = g->bias && j < ncols ? load_elem(g->bias, p * NR + j, g->bf16) : 0.f;
}

/* Rows [r0, r1) of panel p into c (row stride ldc elements). */
static inline __attribute__((always_inline)) void gemm_rows(const gemm_params *g, int64_t r0,
                                                            int64_t r1, int64_t p, void *c,
                                                            int64_t ldc, const int bf16) {
    const int esize = bf16 ? 2 : 4;
    const int64_t kk = bf16 ? (g->k + 1) / 2 * 2 : g->k; /* a panel's k, padded to pairs */
    const char *bp = (const char *)g->wp + p * kk * NR * esize;
    const int64_t ncols = g->n - p * NR < NR ? g->n - p * NR : NR;
    float bias[NR];
    if (g->bias) widen_bias(g, p, ncols, bias);
    const float *b = g->bias ? bias : NULL;
    const char *a = (const char *)g->a;
    char *cc = (char *)c;
    int64_t r = r0;
    for (; r + MR <= r1; r += MR)
        micro(a + r * g->k * esize, g->k, bp, g->k, cc + (r - r0) * ldc * esize, ldc, ncols, b,
              MR, bf16);
#define TAIL(N)                                                                                \
    micro(a + r * g->k * esize, g->k, bp, g->k, cc + (r - r0) * ldc * esize, ldc, ncols, b, N, \
          bf16)
    switch (r1 - r) {
    case 5: TAIL(5); break;
    case 4: TAIL(4); break;
    case 3: TAIL(3); break;
    case 2: TAIL(2); break;
    case 1: TAIL(1); break;
    default: break;
    }
#undef TAIL
}

static inline void item_rows(const gemm_params *g, int64_t item, int64_t *p, int64_t *r0,
                             int64_t *r1) {
    *p = item % g->panels;
    *r0 = item / g->panels * g->rows;
    *r1 = *r0 + g->rows < g->m ? *r0 + g->rows : g->m;
}

/* ---- bf16 products on AMX tiles ------------------------------------------------------------
 *
 * Where the CPU has AMX, the team's bf16 products can run on its tiles (team_set_tiles): each
 * item's blocks of 32 rows by the panel's 32 columns as 4 tile accumulators (amx_tiles.h).
 * The same code also runs on a software model of the tile unit (TILES_MODEL), which checks
 * every configuration and operation as the CPU would (a fault is counted and the operation
 * skipped, where the CPU raises #UD or #GP) and sums the products in float32: the tests run it
 * on CPUs without AMX. Products whose k is not a multiple of 32 keep the vdpbf16ps block. */

enum { TILES_OFF = 0, TILES_CPU = 1, TILES_MODEL = 2 };
static int tiles_mode = TILES_OFF;
/* How far ahead of its tile loads a block fetches the weights from memory, in bytes: 4 steps
 * of k (a step of 32 k by 32 columns takes 64 cycles of tdpbf16ps for 32 rows). */
#ifndef TILE_AHEAD
#define TILE_AHEAD (4 * 32 * NR * 2)
#endif

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;
_Static_assert(sizeof(tile_config) == 64 && offsetof(tile_config, colsb) == 16 &&
                   offsetof(tile_config, rows) == 48,
               "ldtilecfg's 64-byte layout");

/* The tiles of amx_tiles.h for a block of mr (1-32) rows. */
static void tile_config_for(tile_config *cfg, int mr) {
    const int m0 = mr < 16 ? mr : 16, m1 = mr - m0;
    memset(cfg, 0, sizeof *cfg);
    cfg->palette = 1;
    const uint8_t rows[8] = {m0, m0, m1, m1, m0, m1, 16, 16};
    for (int t = 0; t < 8; t++) {
        cfg->rows[t] = rows[t];
        cfg->colsb[t] = rows[t] ? 64 : 0;
    }
}

/* A bf16 row of ncols (<= NR) from NR floats. */
static inline void store_bf16_row(uint16_t *c, const float *acc, int64_t ncols) {
    uint16_t tmp[NR];
    uint16_t *row = ncols == NR ? c : tmp;
    for (int v = 0; v < NV; v++) store_bf16x16(row + v * W16, load16(acc + v * W16));
    if (ncols != NR) memcpy(c, tmp, (size_t)ncols * sizeof(uint16_t));
}

/* The software model: one tile unit per thread, as on the CPU. */
typedef struct {
    tile_config cfg;
    int configured;
    uint8_t data[8][16][64];
} tile_model;
static __thread tile_model model;
static _Atomic uint64_t model_faults;

static int model_fault(void) {
    atomic_fetch_add_explicit(&model_faults, 1, memory_order_relaxed);
    return 0;
}

static int model_tile(int t) {
    return model.configured && t < 8 && model.cfg.rows[t] ? 1 : model_fault();
}

static void model_config(const tile_config *cfg) {
    int ok = cfg->palette == 1 && cfg->start_row == 0;
    for (int i = 0; i < 14; i++) ok &= cfg->reserved[i] == 0;
    for (int t = 0; t < 16; t++)
        ok &= cfg->rows[t] <= 16 && cfg->colsb[t] <= 64 && !cfg->rows[t] == !cfg->colsb[t] &&
              (t < 8 || cfg->rows[t] == 0);
    model.configured = ok ? 1 : model_fault();
    model.cfg = *cfg;
    memset(model.data, 0, sizeof model.data);
}

static void model_load(int t, const void *base, int64_t stride) {
    if (!model_tile(t)) return;
    memset(model.data[t], 0, sizeof model.data[t]); /* rows and bytes past the shape: zero */
    for (int r = 0; r < model.cfg.rows[t]; r++)
        memcpy(model.data[t][r], (const char *)base + r * stride, model.cfg.colsb[t]);
}

static void model_store(int t, void *base, int64_t stride) {
    if (!model_tile(t)) return;
    for (int r = 0; r < model.cfg.rows[t]; r++)
        memcpy((char *)base + r * stride, model.data[t][r], model.cfg.colsb[t]);
}

static float model_bf16(const uint8_t *p) { /* input denormals read as zero */
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return bf16_widen((h & 0x7f80) ? h : (uint16_t)(h & 0x8000));
}

/* tdpbf16ps c, a, b: c[m][n] += sum over pairs q of a[m][2q] b[q][2n] + a[m][2q+1] b[q][2n+1]. */
static void model_dp(int c, int a, int b) {
    const tile_config *f = &model.cfg;
    if (!model_tile(c) || !model_tile(a) || !model_tile(b)) return;
    if (c == a || c == b || a == b || f->colsb[c] != f->colsb[b] || f->rows[c] != f->rows[a] ||
        f->colsb[a] / 4 != f->rows[b] || f->colsb[a] % 4 || f->colsb[c] % 4) {
        model_fault();
        return;
    }
    for (int m = 0; m < f->rows[c]; m++)
        for (int n = 0; n < f->colsb[c] / 4; n++) {
            float acc;
            memcpy(&acc, model.data[c][m] + 4 * n, sizeof acc);
            for (int q = 0; q < f->colsb[a] / 4; q++)
                for (int e = 0; e < 2; e++)
                    acc += model_bf16(model.data[a][m] + 4 * q + 2 * e) *
                           model_bf16(model.data[b][q] + 4 * n + 2 * e);
            memcpy(model.data[c][m] + 4 * n, &acc, sizeof acc);
        }
}

static void model_release(void) { model.configured = 0; }

#define TILE_FN(name) tiles_model_##name
#define TILE_TARGET
#define TILE_CONFIG(cfg) model_config(cfg)
#define TILE_LOAD(t, base, stride) model_load(t, base, stride)
#define TILE_STORE(t, base, stride) model_store(t, base, stride)
#define TILE_DP(c, a, b) model_dp(c, a, b)
#define TILE_RELEASE() model_release()
#define TILE_PREFETCH(p) ((void)(p))
#include "amx_tiles.h"
#undef TILE_FN
#undef TILE_TARGET
#undef TILE_CONFIG
#undef TILE_LOAD
#undef TILE_STORE
#undef TILE_DP
#undef TILE_RELEASE
#undef TILE_PREFETCH

/* The CPU's tiles: x86-64 Linux with a compiler that has the AMX intrinsics, and AVX-512's
 * 32-column panels. */
#if defined(__x86_64__) && defined(__linux__) && NR == 32 &&                                  \
    ((defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11) ||                           \
     (defined(__clang__) && __clang_major__ >= 12))
#define HAVE_TILE_CODE 1
#include <cpuid.h>
#define TILE_FN(name) tiles_cpu_##name
#define TILE_TARGET __attribute__((target("amx-tile,amx-bf16")))
/* The intrinsics' asm names no memory it reads or writes (ldtilecfg 8 bytes of 64): a compiler
 * barrier keeps the stores of a configuration, a bias, a block's rows before the instruction
 * that reads them, and the reads of a stored tile after it. */
#define TILE_FENCE() __asm__ volatile("" ::: "memory")
#define TILE_CONFIG(cfg)                                                                       \
    do {                                                                                       \
        TILE_FENCE();                                                                          \
        _tile_loadconfig(cfg);                                                                 \
    } while (0)
#define TILE_LOAD(t, base, stride)                                                             \
    do {                                                                                       \
        TILE_FENCE();                                                                          \
        _tile_loadd(t, base, stride);                                                          \
    } while (0)
#define TILE_STORE(t, base, stride)                                                            \
    do {                                                                                       \
        _tile_stored(t, base, stride);                                                         \
        TILE_FENCE();                                                                          \
    } while (0)
#define TILE_DP(c, a, b) _tile_dpbf16ps(c, a, b)
#define TILE_RELEASE() _tile_release()
#define TILE_PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)
#include "amx_tiles.h"

/* AMX-TILE and AMX-BF16 (cpuid 7.0 edx bits 24 and 22), and Linux's leave to use the tiles'
 * 8 KiB of state (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, once per process). */
static int tiles_on_cpu(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22)))
        return 0;
    const long req_perm = 0x1023, get_perm = 0x1022, xtiledata = 18;
    uint64_t granted = 0;
    if (syscall(SYS_arch_prctl, req_perm, xtiledata) != 0) return 0;
    if (syscall(SYS_arch_prctl, get_perm, &granted) != 0) return 0;
    return (granted >> xtiledata) & 1;
}
#else
#define HAVE_TILE_CODE 0
static int tiles_on_cpu(void) { return 0; }
#endif

/* Where bf16 products run from now on: TILES_OFF (vdpbf16ps), TILES_CPU (AMX; where the CPU,
 * the OS and this build have it) or TILES_MODEL (the software model, for tests). Either needs
 * the vdpbf16ps block too, for products whose k is not a multiple of 32. Returns the mode set:
 * TILES_OFF where the one asked for is not available. Call between products. */
int team_set_tiles(int mode) {
    if (!HAVE_BF16_PRODUCTS) mode = TILES_OFF;
    if (mode == TILES_CPU && !tiles_on_cpu()) mode = TILES_OFF;
    if (mode != TILES_CPU && mode != TILES_MODEL) mode = TILES_OFF;
    tiles_mode = mode;
    return mode;
}

int team_tiles(void) { return tiles_mode; }

/* Operations the software model refused so far (where the CPU would have faulted). */
uint64_t team_tile_faults(void) { return atomic_load(&model_faults); }

static void tile_rows(const gemm_params *g, int64_t r0, int64_t r1, int64_t p, int dir,
                      void *c, int64_t ldc) {
#if HAVE_TILE_CODE
    if (g->tiles == TILES_CPU) {
        tiles_cpu_rows(g, r0, r1, p, dir, c, ldc);
        return;
    }
#endif
    tiles_model_rows(g, r0, r1, p, dir, c, ldc);
}

static void gemm_item(const void *params, int64_t item, float *scratch) {
    const gemm_params *g = params;
    int64_t p, r0, r1;
    item_rows(g, item, &p, &r0, &r1);
    const int esize = g->bf16 ? 2 : 4;
    void *c = scratch ? (void *)scratch : (char *)g->c + (r0 * g->n + p * NR) * esize;
    const int64_t ldc = scratch ? NR : g->n;
    if (g->tiles) /* the caller's items go up, a helper's (into its scratch) down */
        tile_rows(g, r0, r1, p, scratch ? -1 : 1, c, ldc);
    else if (g->bf16)
        gemm_rows(g, r0, r1, p, c, ldc, 1);
    else
        gemm_rows(g, r0, r1, p, c, ldc, 0);
}

static void gemm_copy(const void *params, int64_t item, const float *scratch) {
    const gemm_params *g = params;
    int64_t p, r0, r1;
    item_rows(g, item, &p, &r0, &r1);
    const int esize = g->bf16 ? 2 : 4;
    const int64_t ncols = g->n - p * NR < NR ? g->n - p * NR : NR;
    for (int64_t r = r0; r < r1; r++)
        memcpy((char *)g->c + (r * g->n + p * NR) * esize,
               (const char *)scratch + (r - r0) * NR * esize, (size_t)(ncols * esize));
}

static uint64_t gemm_run(gemm_params g) {
    if (g.m <= 0 || g.n <= 0) return 0;
    g.panels = (g.n + NR - 1) / NR;
    g.rows = item_rows_of(g.m);
    const int64_t items = g.panels * ((g.m + g.rows - 1) / g.rows);
    const int64_t rows = MAX_ITEMS / g.panels * g.rows; /* per slice; 0: over MAX_ITEMS panels */
    /* within MAX_ITEMS: one job; over it in panels alone: the caller alone (team_run_items) */
    if (items <= MAX_ITEMS || rows == 0)
        return team_run_items(gemm_item, gemm_copy, &g, sizeof g, items, 0);
    /* as one job per slice of rows */
    const int esize = g.bf16 ? 2 : 4;
    uint64_t last = 0;
    for (int64_t r = 0; r < g.m; r += rows) {
        gemm_params slice = g;
        slice.a = (const char *)g.a + r * g.k * esize;
        slice.c = (char *)g.c + r * g.n * esize;
        slice.m = g.m - r < rows ? g.m - r : rows;
        const uint64_t gen = gemm_run(slice);
        if (gen) last = gen;
    }
    return last;
}

/* c [m, n] = a [m, k] @ w.T (+ bias [n], or NULL), w packed by pack_f32; a and c contiguous.
 * Returns team_run_items' generation (nonzero: keep a, wp and bias alive until team_left_gen()
 * reaches it). */
uint64_t gemm_f32(const float *a, int64_t m, int64_t k, const float *wp, int64_t n,
                  const float *bias, float *c) {
    return gemm_run((gemm_params){a, wp, bias, c, m, k, n, 0, 0, 0, TILES_OFF});
}

/* The same in bf16 (a, w packed by pack_bf16, bias and c), on tiles where team_set_tiles says
 * so and k is a multiple of 32; (uint64_t)-1 where the CPU has no AVX512-BF16. */
uint64_t gemm_bf16(const uint16_t *a, int64_t m, int64_t k, const uint16_t *wp, int64_t n,
                   const uint16_t *bias, uint16_t *c) {
    if (!HAVE_BF16_PRODUCTS) return (uint64_t)-1;
    const int tiles = k % 32 == 0 ? tiles_mode : TILES_OFF;
    const uint64_t gen = gemm_run((gemm_params){a, wp, bias, c, m, k, n, 0, 0, 1, tiles});
    if (tiles == TILES_MODEL) tiles_model_let_go(); /* the model's thread: its tiles back */
#if HAVE_TILE_CODE
    if (tiles == TILES_CPU) tiles_cpu_let_go();
#endif
    return gen;
}

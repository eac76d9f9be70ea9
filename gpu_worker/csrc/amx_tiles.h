/*
 * The CPU team's bf16 product on AMX tiles, written once over a set of tile operations:
 * team_cpu.c includes this file twice, once with the CPU's tile instructions and once with a
 * software model of the tile unit (the same configuration rules, rows and row widths, the
 * products summed in float32), which the tests run on CPUs without AMX.
 *
 * Defined by the includer: TILE_FN(name) (this copy's function names), TILE_TARGET (their
 * attributes), TILE_CONFIG(cfg), TILE_LOAD(t, base, stride), TILE_STORE(t, base, stride),
 * TILE_DP(c, a, b) (tdpbf16ps: c += a . b), TILE_RELEASE(), TILE_PREFETCH(p) (a cache line
 * the thread reads soon); and before it NR (32), TILE_AHEAD, gemm_params, tile_config_for and
 * the bias/row helpers.
 *
 * Tiles (tile_config_for): 0 and 1 accumulate a block's rows 0-15 over the panel's columns
 * 0-15 and 16-31 (16 x 16 floats), 2 and 3 its rows 16-31; 4 and 5 hold those rows of a (16
 * rows x 32 bf16 of k); 6 and 7 the panel's two halves of columns over 32 k, which pack_bf16's
 * layout already is: a row of tile 6 is one pair of k for columns 0-15 (64 bytes), and the
 * next pair of k starts NR * 2 elements later. The accumulators start from the bias (16 rows
 * of it).
 */

/* c[0:mr] (mr <= 32, rows ldc elements apart) = a[0:mr] @ panel + bias (the panel's bias in
 * each of 16 rows); k a multiple of 32, the tiles configured for mr rows. Where `next` is not
 * NULL, each step of k also fetches the weights TILE_AHEAD bytes past the ones it loads, in
 * this panel and then in `next` (a panel of the same size; `next` == bp: none). */
static TILE_TARGET void TILE_FN(block)(const uint16_t *a, int64_t lda, const uint16_t *bp,
                                       int64_t k, uint16_t *c, int64_t ldc, int64_t ncols,
                                       const float (*bias)[NR], const int mr,
                                       const uint16_t *next) {
    const int64_t step = 32 * NR * 2, bytes = k / 32 * step; /* a step's weights, a panel's */
    const int64_t end = next == bp ? bytes : 2 * bytes;
    const int two = mr > 16;
    TILE_LOAD(0, bias[0], NR * 4);
    TILE_LOAD(1, bias[0] + 16, NR * 4);
    if (two) {
        TILE_LOAD(2, bias[0], NR * 4);
        TILE_LOAD(3, bias[0] + 16, NR * 4);
    }
    for (int64_t kk = 0; kk < k; kk += 32) {
        const uint16_t *b = bp + kk * NR; /* pair of k kk / 2, each NR * 2 elements */
        const int64_t ahead = kk / 32 * step + TILE_AHEAD;
        if (next && ahead < end) {
            const char *f = ahead < bytes ? (const char *)bp + ahead
                                          : (const char *)next + (ahead - bytes);
            for (int64_t line = 0; line < step; line += 64) TILE_PREFETCH(f + line);
        }
        TILE_LOAD(6, b, NR * 4);
        TILE_LOAD(7, b + 32, NR * 4);
        TILE_LOAD(4, a + kk, lda * 2);
        TILE_DP(0, 4, 6);
        TILE_DP(1, 4, 7);
        if (two) {
            TILE_LOAD(5, a + 16 * lda + kk, lda * 2);
            TILE_DP(2, 5, 6);
            TILE_DP(3, 5, 7);
        }
    }
    _Alignas(64) float acc[32][NR];
    TILE_STORE(0, acc[0], NR * 4);
    TILE_STORE(1, acc[0] + 16, NR * 4);
    if (two) {
        TILE_STORE(2, acc[16], NR * 4);
        TILE_STORE(3, acc[16] + 16, NR * 4);
    }
    for (int r = 0; r < mr; r++) store_bf16_row(c + r * ldc, acc[r], ncols);
}

/* The block rows (1-32) the tiles of this thread are configured for; 0: not configured. */
static __thread int TILE_FN(configured);

/* Rows [r0, r1) of panel p into c (ldc elements apart), in blocks of 32 rows. The tile
 * configuration stays loaded across items: until TILE_FN(let_go) on the model's thread, at
 * the end of each product (other libraries there, oneDNN, configure the tiles their own way
 * between calls), and for good on a helper, where nothing else uses them. The first block
 * reads the panel from memory (a decode step reads each weight once), so it also fetches
 * ahead, on into panel p + dir: the next one this thread most likely takes (the caller's
 * items go up, a helper's down). */
static TILE_TARGET void TILE_FN(rows)(const gemm_params *g, int64_t r0, int64_t r1, int64_t p,
                                      int dir, uint16_t *c, int64_t ldc) {
    const uint16_t *bp = (const uint16_t *)g->wp + p * g->k * NR;
    const uint16_t *next = p + dir >= 0 && p + dir < g->panels ? bp + dir * g->k * NR : bp;
    const int64_t ncols = g->n - p * NR < NR ? g->n - p * NR : NR;
    _Alignas(64) float bias[16][NR];
    widen_bias(g, p, ncols, bias[0]);
    for (int r = 1; r < 16; r++) memcpy(bias[r], bias[0], sizeof bias[0]);
    const uint16_t *a = g->a;
    for (int64_t r = r0; r < r1; r += 32) {
        const int mr = r1 - r < 32 ? (int)(r1 - r) : 32;
        if (mr != TILE_FN(configured)) {
            tile_config cfg;
            tile_config_for(&cfg, mr);
            TILE_CONFIG(&cfg);
            TILE_FN(configured) = mr;
        }
        TILE_FN(block)(a + r * g->k, g->k, bp, g->k, c + (r - r0) * ldc, ldc, ncols,
                       (const float(*)[NR])bias, mr, r == r0 ? next : NULL);
    }
}

/* Releases this thread's tiles, where they are configured. */
static TILE_TARGET void TILE_FN(let_go)(void) {
    if (TILE_FN(configured)) TILE_RELEASE();
    TILE_FN(configured) = 0;
}

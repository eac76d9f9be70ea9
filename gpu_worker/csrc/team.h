/*
 * The CPU team's entry point as other kernels' libraries call it (team_cpu.c has the team):
 * a pointer handed over by Python (`cpu_team.runner_address`), so that each library stays
 * loadable alone.
 *
 * run(params, item, scratch) computes one item: straight into the outputs when `scratch` is
 * NULL (the model's thread), else into `scratch` (a helper's own, at least `scratch_floats`
 * floats), which copy(params, item, scratch) then moves to the outputs. `params` (at most
 * TEAM_PARAM_BYTES) is copied for the helpers. The call returns 0, or the job's generation
 * while a helper may still read its inputs (the caller keeps them alive until
 * team_left_gen() reaches it).
 */
#ifndef PAGEDSERVE_TEAM_H
#define PAGEDSERVE_TEAM_H

#include <stddef.h>
#include <stdint.h>

#define TEAM_PARAM_BYTES 256

typedef void (*team_item_fn)(const void *params, int64_t item, float *scratch);
typedef void (*team_copy_fn)(const void *params, int64_t item, const float *scratch);
typedef uint64_t (*team_run_fn)(team_item_fn run, team_copy_fn copy, const void *params,
                                size_t psize, int64_t n, int64_t scratch_floats);
/* team_left_gen: every generation at or below it no helper reads any more. */
typedef uint64_t (*team_left_fn)(void);

#endif

/*
 * normal_checks.h - what the normal-mode GPU tests share (test_normal.c, test_trace.c,
 * test_normal_dispatch_extras.c) on top of the world of world.h: their case type, a fixture
 * (world, group, handle, device inputs), the expert outputs, and the checks of dispatch and
 * combine results against the CPU reference in tests/ref (first mismatch printed).
 */
#ifndef EPX_TESTS_NORMAL_CHECKS_H_
#define EPX_TESTS_NORMAL_CHECKS_H_

#include <stdint.h>

#include "gpu/world.h"

/* A normal-mode case: its world (drawn with WORLD_NORMAL) and the payload dispatched. */
typedef struct {
  const char *name;
  world_spec_t world;
  int fp8;
} normal_case_t;

/* What the GPU received vs the reference, field by field, first mismatch printed. */
int normal_check_recv(const world_t *w, int me, const epx_dispatch_result_t *res, int fp8,
                      int check_meta, const epx_ref_recv_t *ref, const char *label);
/* y_d = expert output of rank d: its received BF16 rows scaled by (1 + d/4). */
uint16_t *normal_expert_output(const world_t *w, int d, int *num_recv);
/* out (BF16, on the GPU) of an unweighted combine of the dispatched rows sent back unchanged
 * equals the reference bit for bit (sums of at most R BF16 rows of one token are exact in
 * float32); the first mismatch is printed with label. */
int normal_check_combine_unchanged(const world_t *w, int me, const void *out_dev,
                                   const char *label);
/* out (BF16, on the GPU) within BF16 rounding of the float64 reference. */
int normal_check_combine(const world_t *w, int me, const void *out_dev, const float *weights,
                         const char *label);

/* A world (WORLD_NORMAL) with its group, handle and device inputs. Use it in place: the
 * world's reference points into it, so a copy of the struct would dangle. */
typedef struct {
  world_t w;
  epx_group_t g;
  epx_handle_t h;
  world_dev_t d;
} normal_fixture_t;

/* Draw the world of spec, create the group (gpu_test_config of the world's shape; timeout_ms
 * 0 keeps its timeout), a handle and the device inputs (room for R x M received rows). */
int normal_fixture_make(epx_test_rank_t *t, const world_spec_t *spec, int timeout_ms, uint64_t *rng,
                        normal_fixture_t *f);
/* Release everything of f (handle and group destroys expected to succeed). */
int normal_fixture_free(normal_fixture_t *f, const char *label);
/* Combine the received rows sent back as the expert output y (normal_expert_output) unweighted,
 * into a poisoned out, and check it against the reference. */
int normal_combine_and_check(epx_test_rank_t *t, const normal_fixture_t *f, const char *label);
/* The group works: a dispatch of this rank's tokens (counts synchronized) checked against the
 * reference, then normal_combine_and_check. */
int normal_round_trip_and_check(epx_test_rank_t *t, const normal_fixture_t *f, const char *label);

#endif /* EPX_TESTS_NORMAL_CHECKS_H_ */

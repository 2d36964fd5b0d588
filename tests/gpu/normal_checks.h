/*
 * normal_checks.h - what the normal-mode GPU tests share (test_normal.c, test_trace.c) on top of
 * the world of world.h: their case type, the expert outputs, and the checks of dispatch and
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

#endif /* EPX_TESTS_NORMAL_CHECKS_H_ */

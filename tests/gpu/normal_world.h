/*
 * normal_world.h - what the normal-mode GPU tests share (test_normal.c, test_trace.c): a
 * random "world" (every rank's tokens, routing and payload, generated identically on every
 * rank from the test seed), its device copies, and checks of dispatch and combine results
 * against the CPU reference in tests/ref.
 */
#ifndef EPX_TESTS_NORMAL_WORLD_H_
#define EPX_TESTS_NORMAL_WORLD_H_

#include <stddef.h>
#include <stdint.h>

#include "gpu/gpu_util.h"
#include "ref/epx_ref.h"

typedef enum { ROUTE_UNIFORM, ROUTE_ONE_EXPERT, ROUTE_EMPTY, ROUTE_HOLES, ROUTE_ONE_RANK } route_t;

typedef struct {
  const char *name;
  int max_tokens, hidden, experts, top_k; /* experts 0: = R */
  route_t route;
  int tokens;     /* -1: random in [0, max] per rank (uneven); else for every rank */
  int empty_rank; /* a rank with 0 tokens, or -1 */
  int fp8;
} normal_case_t;

/* The world: every rank's inputs, generated identically on every rank. */
typedef struct {
  int R, E, K, H;
  epx_ref_rank_t ranks[EPX_MAX_RANKS];
  int64_t *idx[EPX_MAX_RANKS];
  float *w[EPX_MAX_RANKS];
  uint16_t *x[EPX_MAX_RANKS];
  uint8_t *x8[EPX_MAX_RANKS];
  float *sc[EPX_MAX_RANKS];
  epx_ref_world_t ref;
} world_t;

/* Device copies of this rank's inputs. */
typedef struct {
  void *x, *x8, *idx, *w, *sc, *y, *out;
} dev_inputs_t;

/* The world of case c at R ranks; free with world_free. */
void world_make(world_t *w, int R, const normal_case_t *c, uint64_t *rng);
void world_free(world_t *w);
/* Device copies of rank me's inputs, and room for cap_rows expert-output rows. */
int upload(const world_t *w, int me, dev_inputs_t *d, size_t cap_rows);
void dev_free(dev_inputs_t *d);
/* What the GPU received vs the reference, field by field, first mismatch printed. */
int check_recv(const world_t *w, int me, const epx_dispatch_result_t *res, int fp8, int check_meta,
               const epx_ref_recv_t *ref, const char *label);
/* y_d = expert output of rank d: its received BF16 rows scaled by (1 + d/4). */
uint16_t *expert_output(const world_t *w, int d, int *num_recv);
/* out (BF16, on the GPU) of an unweighted combine of the dispatched rows sent back unchanged
 * equals the reference bit for bit (sums of at most R BF16 rows of one token are exact in
 * float32); the first mismatch is printed with label. */
int check_combine_unchanged(const world_t *w, int me, const void *out_dev, const char *label);
/* out (BF16, on the GPU) within BF16 rounding of the float64 reference. */
int check_combine(const world_t *w, int me, const void *out_dev, const float *weights,
                  const char *label);

#endif /* EPX_TESTS_NORMAL_WORLD_H_ */

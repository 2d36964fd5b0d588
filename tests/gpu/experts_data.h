/*
 * experts_data.h - random expert weights for the GPU tests of the experts' FFN and the MoE
 * layer (test_experts_ffn.c, test_moe.c): host copies the CPU oracle reads
 * (tests/ref/epx_ref_experts.h) and, optionally, device copies the library reads.
 *
 * Draws: BF16 weights U(-1/sqrt(K), 1/sqrt(K)) for a K-deep product; FP8 weights are codes of
 * U(-448, 448) with 128x128 block scales U(0.5, 1.5) / (448 sqrt(K)), so that either format
 * gives outputs of the order of the inputs. The draws are a pure function of the rng state:
 * every rank of a test can draw every rank's experts and keep the same state.
 */
#ifndef EPX_TESTS_EXPERTS_DATA_H_
#define EPX_TESTS_EXPERTS_DATA_H_

#include <stdint.h>

#include "epx.h"
#include "gpu/world.h"
#include "ref/epx_ref_experts.h"

typedef struct {
  epx_ref_experts_t ref; /* points at the host arrays below */
  epx_experts_t dev;     /* device copies (zeroed pointers when not uploaded) */
  uint16_t *gu16, *dn16; /* BF16 weights */
  uint8_t *gu8, *dn8;    /* FP8 weights */
  float *gus, *dns;      /* FP8 block scales */
} experts_data_t;

/* Draw E experts of H x I (BF16 or FP8 weights) from *rng; upload = 1 also copies them to the
 * current GPU. Returns TEST_PASS or TEST_FAIL (message printed). */
int experts_data_make(int E, int H, int I, int fp8, int upload, uint64_t *rng, experts_data_t *d);
void experts_data_free(experts_data_t *d);

/* A MoE layer's test world: spec's world at R ranks with spec->experts experts per rank
 * (WORLD_LL payload), then every rank's experts of intermediate size I (BF16 or FP8), drawn in
 * rank order from the same *rng on every rank, uploaded for rank me only; ref[r] = ex[r].ref.
 * Returns TEST_PASS or TEST_FAIL. */
int experts_world_make(int R, int me, const world_spec_t *spec, int I, int fp8, uint64_t *rng,
                       world_t *w, experts_data_t *ex, epx_ref_experts_t *ref);

/* U(-amp, amp) BF16 values into p[0, n). */
void experts_fill_bf16(uint16_t *p, size_t n, float amp, uint64_t *rng);

#endif /* EPX_TESTS_EXPERTS_DATA_H_ */

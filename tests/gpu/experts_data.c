/*
 * experts_data.c - random expert weights for the FFN and MoE-layer GPU tests (experts_data.h).
 */
#include "gpu/experts_data.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/runner.h"
#include "ref/epx_ref.h"

static float uniform(uint64_t *s, float lo, float hi) {
  return lo + (hi - lo) * epx_test_rand_unit(s);
}

void experts_fill_bf16(uint16_t *p, size_t n, float amp, uint64_t *rng) {
  for (size_t i = 0; i < n; i++) p[i] = epx_ref_bf16_from_float(uniform(rng, -amp, amp));
}

static void fill_fp8(uint8_t *p, float *scales, size_t n, size_t num_scales, int k, uint64_t *s) {
  for (size_t i = 0; i < n; i++) p[i] = epx_ref_fp8_from_float(uniform(s, -448.f, 448.f));
  for (size_t i = 0; i < num_scales; i++)
    scales[i] = uniform(s, 0.5f, 1.5f) / (448.f * sqrtf((float)k));
}

static int upload(const void **dev, const void *host, size_t bytes) {
  void *p = NULL;
  EXPECT_CUDA(cudaMalloc(&p, bytes > 0 ? bytes : 16));
  *dev = p;
  if (bytes) EXPECT_CUDA(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice));
  return TEST_PASS;
}

int experts_data_make(int E_, int H_, int I_, int fp8, int up, uint64_t *s, experts_data_t *d) {
  memset(d, 0, sizeof *d);
  const size_t E = E_, H = H_, I = I_;
  const size_t n_gu = E * 2 * I * H, n_dn = E * H * I;
  d->ref = (epx_ref_experts_t){E_, H_, I_, fp8, NULL, NULL, NULL, NULL, NULL, NULL};
  d->dev = (epx_experts_t)EPX_EXPERTS_INIT;
  d->dev.num_experts = E_, d->dev.hidden = H_, d->dev.intermediate = I_;
  d->dev.weight_dtype = fp8 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16;
  if (!fp8) {
    d->gu16 = malloc(n_gu * 2), d->dn16 = malloc(n_dn * 2);
    EXPECT(d->gu16 && d->dn16);
    experts_fill_bf16(d->gu16, n_gu, 1.f / sqrtf((float)H), s);
    experts_fill_bf16(d->dn16, n_dn, 1.f / sqrtf((float)I), s);
    d->ref.gate_up_bf16 = d->gu16, d->ref.down_bf16 = d->dn16;
    if (up) {
      EXPECT(upload(&d->dev.gate_up, d->gu16, n_gu * 2) == TEST_PASS);
      EXPECT(upload(&d->dev.down, d->dn16, n_dn * 2) == TEST_PASS);
    }
    return TEST_PASS;
  }
  const size_t s_gu = E * (2 * I / 128) * (H / 128), s_dn = E * (H / 128) * (I / 128);
  d->gu8 = malloc(n_gu), d->dn8 = malloc(n_dn);
  d->gus = malloc(s_gu * 4), d->dns = malloc(s_dn * 4);
  EXPECT(d->gu8 && d->dn8 && d->gus && d->dns);
  fill_fp8(d->gu8, d->gus, n_gu, s_gu, H_, s);
  fill_fp8(d->dn8, d->dns, n_dn, s_dn, I_, s);
  d->ref.gate_up_fp8 = d->gu8, d->ref.down_fp8 = d->dn8;
  d->ref.gate_up_scales = d->gus, d->ref.down_scales = d->dns;
  if (up) {
    EXPECT(upload(&d->dev.gate_up, d->gu8, n_gu) == TEST_PASS);
    EXPECT(upload(&d->dev.down, d->dn8, n_dn) == TEST_PASS);
    EXPECT(upload((const void **)&d->dev.gate_up_scales, d->gus, s_gu * 4) == TEST_PASS);
    EXPECT(upload((const void **)&d->dev.down_scales, d->dns, s_dn * 4) == TEST_PASS);
  }
  return TEST_PASS;
}

void experts_data_free(experts_data_t *d) {
  free(d->gu16), free(d->dn16), free(d->gu8), free(d->dn8), free(d->gus), free(d->dns);
  cudaFree((void *)d->dev.gate_up), cudaFree((void *)d->dev.down);
  cudaFree((void *)d->dev.gate_up_scales), cudaFree((void *)d->dev.down_scales);
  memset(d, 0, sizeof *d);
}

int experts_world_make(int R, int me, const world_spec_t *spec, int I, int fp8, uint64_t *rng,
                       world_t *w, experts_data_t *ex, epx_ref_experts_t *ref) {
  world_spec_t all = *spec;
  all.experts = spec->experts * R;
  world_make(w, R, &all, WORLD_LL, rng);
  for (int r = 0; r < R; r++) {
    if (experts_data_make(w->L, w->H, I, fp8, r == me, rng, &ex[r]) != TEST_PASS) return TEST_FAIL;
    ref[r] = ex[r].ref;
  }
  return TEST_PASS;
}

/*
 * test_ref_experts.c - the experts' FFN oracle (tests/ref/epx_ref_experts.h) on cases with a
 * known answer, so the GPU tests compare against something that is itself checked.
 *
 * x = 1 in channel 0 and 0 elsewhere, gate[n][0] = a_n, up[n][0] = b_n and down = identity
 * (H = I = 128): then h_n = silu(a_n) * b_n and out_c = h_c (rounded as the oracle rounds).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/runner.h"
#include "ref/epx_ref.h"
#include "ref/epx_ref_experts.h"

#define N 128

static double silu_mul(double g, double u) {
  return g / (1.0 + exp(-g)) * u;
}

EPX_HOST_TEST(ref_experts_rows_follow_the_cut_rule, 10) {
  const int count[4] = {5, -2, 50, 7}, begin[4] = {0, 3, 90, 101};
  int first[4], rows[4];
  epx_ref_experts_rows(4, 100, count, begin, 0, first, rows);
  EXPECT(rows[0] == 5 && rows[1] == 0 && first[2] == 90 && rows[2] == 10 && rows[3] == 0);
  epx_ref_experts_rows(4, 100, count, NULL, 20, first, rows);
  EXPECT(first[3] == 60 && rows[2] == 20 && rows[3] == 7 && rows[1] == 0);
  return TEST_PASS;
}

EPX_HOST_TEST(ref_experts_known_answer_bf16, 10) {
  uint16_t *gu = calloc(2 * N * N, 2), *dn = calloc(N * N, 2), x[N] = {0}, out[N];
  EXPECT(gu && dn);
  for (int n = 0; n < N; n++) {
    gu[(size_t)n * N] = epx_ref_bf16_from_float((float)(n - 64) / 16.f);     /* gate */
    gu[(size_t)(N + n) * N] = epx_ref_bf16_from_float((float)(n % 7) - 3.f); /* up */
    dn[(size_t)n * N + n] = epx_ref_bf16_from_float(1.f);
  }
  x[0] = epx_ref_bf16_from_float(1.f);
  const epx_ref_experts_t w = {1, N, N, 0, gu, dn, NULL, NULL, NULL, NULL};
  const int first = 0, rows = 1;
  EXPECT(epx_ref_experts_ffn(&w, x, 0, NULL, 1, &first, &rows, out) == 0);
  for (int n = 0; n < N; n++) {
    const float h = epx_ref_bf16_to_float(
        epx_ref_bf16_from_float((float)silu_mul((n - 64) / 16.0, (double)(n % 7) - 3.0)));
    EXPECTF(epx_ref_bf16_to_float(out[n]) == h, "channel %d: %g, want %g", n,
            epx_ref_bf16_to_float(out[n]), h);
  }
  free(gu), free(dn);
  return TEST_PASS;
}

/* The same in FP8: weight codes exact (a_n, b_n are FP8 values), block scales 1 except the
 * down projection's (2), so out = 2 * quantized h; and the one-step allowance of output c is
 * exactly 2 x (the step of h_c's code) x h's scale: how far h_c rounded one step the other way
 * would move it. */
EPX_HOST_TEST(ref_experts_known_answer_fp8, 10) {
  uint8_t *gu = calloc(2 * N * N, 1), *dn = calloc(N * N, 1), xq[N] = {0};
  float gus[2] = {1.f, 1.f}, dns[1] = {2.f}, xs[1] = {1.f}, step[N];
  uint16_t out[N];
  EXPECT(gu && dn);
  for (int n = 0; n < N; n++) {
    gu[(size_t)n * N] = epx_ref_fp8_from_float((float)(n - 64) / 16.f);
    gu[(size_t)(N + n) * N] = epx_ref_fp8_from_float((float)(n % 7) - 3.f);
    dn[(size_t)n * N + n] = epx_ref_fp8_from_float(1.f);
  }
  xq[0] = epx_ref_fp8_from_float(1.f);
  const epx_ref_experts_t w = {1, N, N, 1, NULL, NULL, gu, gus, dn, dns};
  const int first = 0, rows = 1;
  EXPECT(epx_ref_experts_ffn_one_step(&w, xq, 1, xs, 1, &first, &rows, out, step) == 0);
  float h[N], amax = 0.f;
  for (int n = 0; n < N; n++) {
    h[n] = (float)silu_mul(epx_ref_fp8_to_float(gu[(size_t)n * N]),
                           epx_ref_fp8_to_float(gu[(size_t)(N + n) * N]));
    amax = fmaxf(amax, fabsf(h[n]));
  }
  const float scale = epx_ref_fp8_scale(amax, 0), inv = 1.0f / scale;
  for (int n = 0; n < N; n++) {
    const float want = 2.f * (epx_ref_fp8_to_float(epx_ref_fp8_from_float(h[n] * inv)) * scale);
    EXPECTF(epx_ref_bf16_to_float(out[n]) == epx_ref_bf16_to_float(epx_ref_bf16_from_float(want)),
            "channel %d: %g, want %g", n, epx_ref_bf16_to_float(out[n]), want);
    const double want_step = 2.0 * epx_ref_fp8_step(epx_ref_fp8_from_float(h[n] * inv)) * scale;
    EXPECTF(fabs(step[n] - want_step) <= 1e-6 * want_step, "channel %d: step %g, want %g", n,
            step[n], want_step);
  }
  free(gu), free(dn);
  return TEST_PASS;
}

/* epx_ref_fp8_step: the larger gap to a same-sign neighbour, at the edges of the code range. */
EPX_HOST_TEST(ref_fp8_step_known_values, 10) {
  EXPECT(epx_ref_fp8_step(0x00) == 0x1p-9f); /* 0: only up, to the least subnormal */
  EXPECT(epx_ref_fp8_step(0x01) == 0x1p-9f); /* subnormals are 2^-9 apart */
  EXPECT(epx_ref_fp8_step(0x38) == 0.125f);  /* 1.0: 1.125 above, 0.9375 below */
  EXPECT(epx_ref_fp8_step(0xb8) == 0.125f);  /* -1.0: the same */
  EXPECT(epx_ref_fp8_step(0x7e) == 32.f);    /* 448: only down, to 416 */
  EXPECT(epx_ref_fp8_step(0x7d) == 32.f);    /* 416: 448 above, 384 below */
  EXPECT(isnan(epx_ref_fp8_step(0x7f)) && isnan(epx_ref_fp8_step(0xff)));
  return TEST_PASS;
}

/* With BF16 weights there is no one-step allowance (h rounds to BF16, far below the bounds). */
EPX_HOST_TEST(ref_experts_one_step_is_zero_for_bf16, 10) {
  uint16_t *gu = calloc(2 * N * N, 2), *dn = calloc(N * N, 2), x[N] = {0}, out[N];
  float step[N];
  EXPECT(gu && dn);
  for (int n = 0; n < N; n++) {
    gu[(size_t)n * N] = epx_ref_bf16_from_float((float)(n - 64) / 16.f);
    dn[(size_t)n * N + n] = epx_ref_bf16_from_float(1.f);
    step[n] = -1.f;
  }
  x[0] = epx_ref_bf16_from_float(1.f);
  const epx_ref_experts_t w = {1, N, N, 0, gu, dn, NULL, NULL, NULL, NULL};
  const int first = 0, rows = 1;
  EXPECT(epx_ref_experts_ffn_one_step(&w, x, 0, NULL, 1, &first, &rows, out, step) == 0);
  for (int n = 0; n < N; n++) EXPECTF(step[n] == 0.f, "channel %d: step %g", n, step[n]);
  free(gu), free(dn);
  return TEST_PASS;
}

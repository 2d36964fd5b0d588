/*
 * test_ref_moe.c - the MoE layer's oracle (tests/ref/epx_ref_moe.h) against the layer's
 * definition computed another way: per token, out[t] = sum over valid slots k of
 * w[t][k] x FFN_{e_k}(x[t]), each FFN row from epx_ref_experts_ffn on that one row alone (FP8
 * rows quantized per 128 channels first). No dispatch or combine is involved on this side, so
 * a wrong row placement, source map or weight in the composition shows up. The same for the
 * magnitude (the sum of |w| x |the slot rows' values|) and the one-step allowance (the largest
 * |w| x the slot rows' allowances).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/runner.h"
#include "gpu/experts_data.h"
#include "ref/epx_ref.h"
#include "ref/epx_ref_experts.h"
#include "ref/epx_ref_moe.h"

enum { R = 2, L = 3, E = R * L, K = 3, H = 256, I = 128, M = 5 };

/* FFN of expert j (of experts x) on one BF16 row, BF16 out, and its one-step allowance. */
static int ffn_row(const epx_ref_experts_t *x, int j, const uint16_t *row, int fp8, uint16_t *out,
                   float *step) {
  int first[L] = {0}, rows[L] = {0};
  rows[j] = 1;
  if (!fp8) return epx_ref_experts_ffn_one_step(x, row, 0, NULL, 1, first, rows, out, step);
  uint8_t q[H];
  float scales[H / 128];
  if (epx_ref_fp8_quantize(row, 1, H, 0, q, scales) != 0) return -1;
  return epx_ref_experts_ffn_one_step(x, q, 1, scales, 1, first, rows, out, step);
}

static int check_world(int fp8, uint64_t *rng) {
  static const int T[R] = {4, 3};
  /* Token 1 of rank 0 lists expert 4 twice (two rows, two weights); token 2 has a hole. */
  static const int64_t ids0[4 * K] = {0, 3, 5, 4, 1, 4, 2, -1, 3, 5, 5, 5};
  static const int64_t ids1[3 * K] = {1, 2, 0, -1, -1, -1, 4, 0, 3};
  const int64_t *ids[R] = {ids0, ids1};
  experts_data_t ex[R];
  epx_ref_experts_t ref_ex[R];
  uint16_t *x[R];
  float *w[R];
  epx_ref_rank_t ranks[R];
  for (int r = 0; r < R; r++) {
    EXPECT(experts_data_make(L, H, I, fp8, 0, rng, &ex[r]) == TEST_PASS);
    ref_ex[r] = ex[r].ref;
    x[r] = malloc((size_t)T[r] * H * 2);
    w[r] = malloc(sizeof(float) * T[r] * K);
    EXPECT(x[r] && w[r]);
    experts_fill_bf16(x[r], (size_t)T[r] * H, 2.f, rng);
    for (int i = 0; i < T[r] * K; i++) w[r][i] = 0.25f + 0.5f * epx_test_rand_unit(rng);
    ranks[r] = (epx_ref_rank_t){T[r], ids[r], w[r], x[r], NULL, NULL};
  }
  const epx_ref_world_t world = {R, E, K, H, ranks};
  int rc = TEST_PASS;
  for (int s = 0; s < R && rc == TEST_PASS; s++) {
    double *got = malloc(sizeof(double) * T[s] * H), *mag = malloc(sizeof(double) * T[s] * H);
    double *one_step = malloc(sizeof(double) * T[s] * H);
    EXPECT(got && mag && one_step);
    EXPECT(epx_ref_moe_decode(&world, ref_ex, M, fp8, s, got, mag, NULL, one_step) == 0);
    for (int t = 0; t < T[s] && rc == TEST_PASS; t++) {
      double want[H] = {0}, absum[H] = {0}, stepmax[H] = {0};
      for (int k = 0; k < K; k++) {
        const int64_t e = ids[s][t * K + k];
        if (e < 0) continue;
        uint16_t y[H];
        float step[H];
        EXPECT(ffn_row(&ref_ex[e / L], (int)(e % L), x[s] + (size_t)t * H, fp8, y, step) == 0);
        for (int c = 0; c < H; c++) {
          const double v = (double)w[s][t * K + k] * epx_ref_bf16_to_float(y[c]);
          want[c] += v;
          absum[c] += fabs(v);
          const double m = fabs((double)w[s][t * K + k]) * step[c];
          if (m > stepmax[c]) stepmax[c] = m;
        }
      }
      for (int c = 0; c < H; c++) {
        const size_t i = (size_t)t * H + c;
        if (!(fabs(got[i] - want[c]) <= 1e-6 * absum[c] + 1e-12) ||
            !(fabs(mag[i] - absum[c]) <= 1e-9 * absum[c] + 1e-12) ||
            !(fabs(one_step[i] - stepmax[c]) <= 1e-9 * stepmax[c] + 1e-12) ||
            (fp8 && absum[c] > 0 && !(one_step[i] > 0)) || (!fp8 && one_step[i] != 0)) {
          fprintf(stderr,
                  "  fp8 %d rank %d token %d col %d: oracle %.10g (|.| %.6g, one step %.6g), "
                  "direct %.10g (|.| %.6g, one step %.6g)\n",
                  fp8, s, t, c, got[i], mag[i], one_step[i], want[c], absum[c], stepmax[c]);
          rc = TEST_FAIL;
          break;
        }
      }
    }
    free(got), free(mag), free(one_step);
  }
  for (int r = 0; r < R; r++) experts_data_free(&ex[r]), free(x[r]), free(w[r]);
  return rc;
}

EPX_HOST_TEST(ref_moe_matches_the_definition, 60) {
  uint64_t rng = epx_test_seed();
  EXPECT(check_world(0, &rng) == TEST_PASS);
  EXPECT(check_world(1, &rng) == TEST_PASS);
  /* Arguments the library refuses. */
  const epx_ref_world_t empty = {0, 4, 1, 128, NULL};
  double out[1];
  EXPECT(epx_ref_moe_decode(&empty, NULL, 4, 0, 0, out, NULL, NULL, NULL) == -1);
  return TEST_PASS;
}

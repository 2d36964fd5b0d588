/*
 * test_ref_combine_extras.c - host tests of the reference's normal-combine extras
 * (epx_ref_combine_ex: the top-k weight reduction and the bias, DeepEP combine's
 * `combined_topk_weights` and `bias`), on a hand world worked out on paper:
 *
 *   R = 2, E = 4, K = 2, H = 2; rank 0 hosts experts 0,1, rank 1 hosts 2,3.
 *   rank 0, T = 3                      rank 1, T = 2
 *   t  topk_idx  topk_weights          t  topk_idx  topk_weights
 *   0  [ 0,  2]  [0.5,  0.25]          0  [1, 1]    [0.125, 0.375]   expert 1 listed twice
 *   1  [ 3, -1]  [0.75, 0   ]          1  [2, 9]    [0.5,   4.0  ]   9 is a bad id (E = 4)
 *   2  [-1, -1]  [0,    0   ]
 *
 * Receive orders (source rank, then source token): rank 0 gets (0, t0), (1, t0); rank 1 gets
 * (0, t0), (0, t1), (1, t1).
 */
#include <string.h>

#include "common/runner.h"
#include "ref/epx_ref.h"

static const int64_t ex_idx0[3 * 2] = {0, 2, 3, -1, -1, -1};
static const float ex_w0[3 * 2] = {0.5f, 0.25f, 0.75f, 0.0f, 0.0f, 0.0f};
static const int64_t ex_idx1[2 * 2] = {1, 1, 2, 9};
static const float ex_w1[2 * 2] = {0.125f, 0.375f, 0.5f, 4.0f};

static void ex_world(epx_ref_rank_t *ranks, epx_ref_world_t *w) {
  memset(ranks, 0, 2 * sizeof *ranks);
  ranks[0].num_tokens = 3, ranks[0].topk_idx = ex_idx0, ranks[0].topk_weights = ex_w0;
  ranks[1].num_tokens = 2, ranks[1].topk_idx = ex_idx1, ranks[1].topk_weights = ex_w1;
  *w = (epx_ref_world_t){2, 4, 2, 2, ranks};
}

/* Returned weights summed per token: the dispatch's received weights (zero where the slot lives
 * elsewhere) give back each token's own weights, valid slots only; dense weights add up. */
EPX_HOST_TEST(ref_combine_topk_weights_hand, 10) {
  epx_ref_rank_t ranks[2];
  epx_ref_world_t w;
  ex_world(ranks, &w);
  uint16_t y0[2 * 2] = {0}, y1[3 * 2] = {0}, out[3 * 2];
  const uint16_t *y[2] = {y0, y1};
  epx_ref_recv_t r[2];
  memset(r, 0, sizeof r);
  for (int d = 0; d < 2; d++)
    EXPECT_EQ_INT(epx_ref_dispatch(&w, d, EPX_REF_PAYLOAD_NONE, 1, &r[d]), 0);
  EXPECT_EQ_INT(r[0].num_recv, 2);
  EXPECT_EQ_INT(r[1].num_recv, 3);
  const float *recv_w[2] = {r[0].topk_weights, r[1].topk_weights};
  /* rank 0: t0 = {0.5, 0} (rank 0) + {0, 0.25} (rank 1); t1 = {0.75, 0}; t2 on no rank.
   * rank 1: t0 = {0.125, 0.375} (one row, rank 0); t1 = {0.5, 0}: the bad slot's 4.0 is gone. */
  const float want0[6] = {0.5f, 0.25f, 0.75f, 0.0f, 0.0f, 0.0f};
  const float want1[4] = {0.125f, 0.375f, 0.5f, 0.0f};
  for (int s = 0; s < 2; s++) {
    float got[6];
    memset(got, 0xAB, sizeof got);
    epx_ref_combine_extras_t ex = {recv_w, got, {NULL, NULL}};
    EXPECT_EQ_INT(epx_ref_combine_ex(&w, s, y, NULL, &ex, out), 0);
    for (int i = 0; i < (s ? 4 : 6); i++)
      EXPECTF(got[i] == (s ? want1 : want0)[i], "rank %d out_w[%d][%d] = %g, want %g", s, i / 2,
              i % 2, got[i], (s ? want1 : want0)[i]);
  }
  /* Dense weights: rank 0's t0 is row 0 of both ranks, t1 row 1 of rank 1; rank 1's t0 is row
   * 1 of rank 0, t1 row 2 of rank 1. */
  const float dense0[4] = {1, 2, 3, 4}, dense1[6] = {8, 16, 32, 64, 128, 256};
  const float *dense[2] = {dense0, dense1};
  const float want_d0[6] = {9, 18, 32, 64, 0, 0}, want_d1[4] = {3, 4, 128, 256};
  for (int s = 0; s < 2; s++) {
    float got[6];
    double out64[6];
    epx_ref_combine_extras_t ex = {dense, got, {NULL, NULL}};
    EXPECT_EQ_INT(epx_ref_combine_ex_f64(&w, s, y, NULL, &ex, out64), 0);
    for (int i = 0; i < (s ? 4 : 6); i++)
      EXPECTF(got[i] == (s ? want_d1 : want_d0)[i], "rank %d dense out_w[%d] = %g", s, i, got[i]);
  }
  /* Refusals: recv_w without out_w; no weights for a rank that received rows. */
  {
    float got[6];
    const float *missing[2] = {dense0, NULL};
    epx_ref_combine_extras_t half = {dense, NULL, {NULL, NULL}};
    epx_ref_combine_extras_t hole = {missing, got, {NULL, NULL}};
    epx_ref_set_quiet(1); /* the refusals below are expected */
    EXPECT_EQ_INT(epx_ref_combine_ex(&w, 0, y, NULL, &half, out), -1);
    EXPECT_EQ_INT(epx_ref_combine_ex(&w, 0, y, NULL, &hole, out), -1);
    epx_ref_set_quiet(0);
  }
  epx_ref_recv_free(&r[0]);
  epx_ref_recv_free(&r[1]);
  return TEST_PASS;
}

/* One and two bias rows added after the rows' sum, before the BF16 rounding; a token on no rank
 * gets its bias; no extras is exactly epx_ref_combine. */
EPX_HOST_TEST(ref_combine_bias_hand, 10) {
  epx_ref_rank_t ranks[2];
  epx_ref_world_t w;
  ex_world(ranks, &w);
  const float y0f[4] = {1, 2, 3, 4}, y1f[6] = {10, 20, 30, 40, 50, 60};
  uint16_t y0[4], y1[6], b0[6], b1[6], out[6], plain[6];
  for (int i = 0; i < 4; i++) y0[i] = epx_ref_bf16_from_float(y0f[i]);
  for (int i = 0; i < 6; i++) y1[i] = epx_ref_bf16_from_float(y1f[i]);
  const float b0f[6] = {0.5f, -1, 1, 1, -2, 2}, b1f[6] = {0.25f, 0, 0, 0, 0, 1};
  for (int i = 0; i < 6; i++)
    b0[i] = epx_ref_bf16_from_float(b0f[i]), b1[i] = epx_ref_bf16_from_float(b1f[i]);
  const uint16_t *y[2] = {y0, y1};
  /* rank 0 unweighted: t0 = y0 row 0 + y1 row 0 = {11, 22}, t1 = y1 row 1 = {30, 40}, t2 = 0. */
  const float want_one[6] = {11.5f, 21, 31, 41, -2, 2};
  const float want_two[6] = {11.75f, 21, 31, 41, -2, 3};
  for (int two = 0; two < 2; two++) {
    epx_ref_combine_extras_t ex = {NULL, NULL, {b0, two ? b1 : NULL}};
    const float *want = two ? want_two : want_one;
    double out64[6];
    memset(out, 0xAB, sizeof out);
    EXPECT_EQ_INT(epx_ref_combine_ex(&w, 0, y, NULL, &ex, out), 0);
    EXPECT_EQ_INT(epx_ref_combine_ex_f64(&w, 0, y, NULL, &ex, out64), 0);
    for (int i = 0; i < 6; i++) {
      EXPECTF(out[i] == epx_ref_bf16_from_float(want[i]), "%d bias: out[%d][%d] = %g, want %g",
              two + 1, i / 2, i % 2, epx_ref_bf16_to_float(out[i]), want[i]);
      EXPECTF(out64[i] == want[i], "%d bias: f64 out[%d] = %g", two + 1, i, out64[i]);
    }
  }
  /* Rounding happens once, after the bias: 1 + 2^-8 is a BF16 tie (-> 1.0), 1 + 2^-8 + 2^-9 is
   * not (-> 1 + 2^-7). */
  y0[0] = epx_ref_bf16_from_float(1.0f), y1[0] = epx_ref_bf16_from_float(0x1p-8f);
  b0[0] = epx_ref_bf16_from_float(0x1p-9f);
  epx_ref_combine_extras_t one = {NULL, NULL, {b0, NULL}};
  EXPECT_EQ_INT(epx_ref_combine_ex(&w, 0, y, NULL, &one, out), 0);
  EXPECT_EQ_INT(out[0], 0x3f81);
  /* No extras: exactly epx_ref_combine. */
  epx_ref_combine_extras_t none = {NULL, NULL, {NULL, NULL}};
  EXPECT_EQ_INT(epx_ref_combine_ex(&w, 1, y, ex_w1, &none, out), 0);
  EXPECT_EQ_INT(epx_ref_combine(&w, 1, y, ex_w1, plain), 0);
  EXPECT(memcmp(out, plain, 2 * 2 * sizeof(uint16_t)) == 0);
  return TEST_PASS;
}

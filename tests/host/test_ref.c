/*
 * test_ref.c - host tests of the CPU reference (tests/ref/epx_ref.h), the oracle of the GPU tests.
 *
 * The hand cases below were worked out on paper; their expected arrays are written literally.
 * The hand world (R = 2 ranks, E = 4 experts, K = 2; rank 0 hosts experts 0,1, rank 1 hosts 2,3):
 *
 *   rank 0, T = 4                      rank 1, T = 3
 *   t  topk_idx  topk_weights          t  topk_idx  topk_weights
 *   0  [ 1,  2]  [0.5,   0.25]         0  [2, 0]    [0.5,  0.5 ]   both ranks
 *   1  [ 3,  2]  [0.125, 0.75]         1  [7, 3]    [2.0,  0.25]   7 is a bad id (E = 4)
 *   2  [-1, -1]  [0,     0   ]         2  [1, 1]    [0.25, 0.5 ]   expert 1 listed twice
 *   3  [ 0, -1]  [1.0,   0   ]
 *
 * Token 0 of rank 0 goes to both ranks, token 1 has both experts on rank 1, token 2 chose no
 * expert, token 3 has an empty slot. The payload of token t of rank s is {v, -v}, v = 10s+t+1.
 *
 * The randomized tests check self-consistency on many random worlds (seed printed by the
 * runner): layout totals against dispatch row counts, dispatch then combine with identity
 * experts, low-latency dispatch then combine.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/runner.h"
#include "ref/epx_ref.h"

/* ---------------------------------------------------------------------------------------------
 * Helpers.
 * ------------------------------------------------------------------------------------------- */

static uint32_t fbits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static float ffrom(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static uint16_t bf(float f) {
  return epx_ref_bf16_from_float(f);
}
static float fb(uint16_t b) {
  return epx_ref_bf16_to_float(b);
}

/* The hand world (see the file comment). */
#define HAND_R 2
#define HAND_E 4
#define HAND_K 2
#define HAND_H 2
static const int64_t hand_idx0[4 * HAND_K] = {1, 2, 3, 2, -1, -1, 0, -1};
static const float hand_w0[4 * HAND_K] = {0.5f, 0.25f, 0.125f, 0.75f, 0.0f, 0.0f, 1.0f, 0.0f};
static const int64_t hand_idx1[3 * HAND_K] = {2, 0, 7, 3, 1, 1};
static const float hand_w1[3 * HAND_K] = {0.5f, 0.5f, 2.0f, 0.25f, 0.25f, 0.5f};

typedef struct {
  uint16_t x0[4 * HAND_H], x1[3 * HAND_H];
  epx_ref_rank_t ranks[HAND_R];
  epx_ref_world_t world;
} hand_world_t;

static void hand_world_init(hand_world_t *h) {
  memset(h, 0, sizeof *h);
  for (int t = 0; t < 4; t++)
    h->x0[t * 2] = bf((float)(t + 1)), h->x0[t * 2 + 1] = bf(-(float)(t + 1));
  for (int t = 0; t < 3; t++)
    h->x1[t * 2] = bf((float)(11 + t)), h->x1[t * 2 + 1] = bf(-(float)(11 + t));
  h->ranks[0] = (epx_ref_rank_t){4, hand_idx0, hand_w0, h->x0, NULL, NULL};
  h->ranks[1] = (epx_ref_rank_t){3, hand_idx1, hand_w1, h->x1, NULL, NULL};
  h->world = (epx_ref_world_t){HAND_R, HAND_E, HAND_K, HAND_H, h->ranks};
}

/* ---------------------------------------------------------------------------------------------
 * Layout.
 * ------------------------------------------------------------------------------------------- */

static int check_layout(const int64_t *idx, int T, long long want_bad, const int *want_rank,
                        const int *want_expert, const uint8_t *want_in, const int *want_pos) {
  int rank[HAND_R], expert[HAND_E], pos[16];
  uint8_t in[16];
  memset(rank, 0xAB, sizeof rank), memset(expert, 0xAB, sizeof expert);
  memset(in, 0xAB, sizeof in), memset(pos, 0xAB, sizeof pos);
  long long bad = epx_ref_layout(idx, T, HAND_K, HAND_E, HAND_R, rank, expert, in, pos);
  EXPECT_EQ_INT(bad, want_bad);
  for (int r = 0; r < HAND_R; r++)
    EXPECTF(rank[r] == want_rank[r], "rank %d: %d vs %d", r, rank[r], want_rank[r]);
  for (int e = 0; e < HAND_E; e++)
    EXPECTF(expert[e] == want_expert[e], "expert %d: %d vs %d", e, expert[e], want_expert[e]);
  for (int i = 0; i < T * HAND_R; i++) {
    EXPECTF(in[i] == want_in[i], "is_token_in_rank[%d][%d]: %d vs %d", i / HAND_R, i % HAND_R,
            in[i], want_in[i]);
    EXPECTF(pos[i] == want_pos[i], "token_pos_in_rank[%d][%d]: %d vs %d", i / HAND_R, i % HAND_R,
            pos[i], want_pos[i]);
  }
  EXPECTF(in[T * HAND_R] == 0xAB && pos[T * HAND_R] == (int)0xABABABAB, "written past the end");
  return TEST_PASS;
}

EPX_HOST_TEST(ref_layout_hand, 10) {
  {
    const int rank[HAND_R] = {2, 2}, expert[HAND_E] = {1, 1, 2, 1};
    const uint8_t in[4 * HAND_R] = {1, 1, 0, 1, 0, 0, 1, 0};
    const int pos[4 * HAND_R] = {0, 0, -1, 1, -1, -1, 1, -1};
    if (check_layout(hand_idx0, 4, -1, rank, expert, in, pos) != TEST_PASS) return TEST_FAIL;
  }
  {
    /* Bad id 7 at flat index 2 is reported and ignored; expert 1 counts token 2 once. */
    const int rank[HAND_R] = {2, 2}, expert[HAND_E] = {1, 1, 1, 1};
    const uint8_t in[3 * HAND_R] = {1, 1, 0, 1, 1, 0};
    const int pos[3 * HAND_R] = {0, 0, -1, 1, 1, -1};
    if (check_layout(hand_idx1, 3, 2, rank, expert, in, pos) != TEST_PASS) return TEST_FAIL;
  }
  {
    /* Two bad ids, -2 and 5: the lower flat index (1) is reported; both are empty slots. */
    const int64_t idx[4] = {0, -2, 5, 1};
    const int rank[HAND_R] = {2, 0}, expert[HAND_E] = {1, 1, 0, 0};
    const uint8_t in[2 * HAND_R] = {1, 0, 1, 0};
    const int pos[2 * HAND_R] = {0, -1, 1, -1};
    if (check_layout(idx, 2, 1, rank, expert, in, pos) != TEST_PASS) return TEST_FAIL;
  }
  {
    const int64_t idx[4] = {0, 1, 2, 4}; /* E itself is out of range */
    EXPECT_EQ_INT(epx_ref_layout(idx, 2, 2, 4, 2, NULL, NULL, NULL, NULL), 3);
    const int64_t ok[4] = {-1, 3, 3, -1};
    EXPECT_EQ_INT(epx_ref_layout(ok, 2, 2, 4, 2, NULL, NULL, NULL, NULL), -1);
  }
  {
    /* No tokens: counts are written (as zeros), nothing else. */
    int rank[2] = {7, 7}, expert[4] = {7, 7, 7, 7};
    EXPECT_EQ_INT(epx_ref_layout(NULL, 0, 2, 4, 2, rank, expert, NULL, NULL), -1);
    for (int i = 0; i < 2; i++) EXPECT_EQ_INT(rank[i], 0);
    for (int i = 0; i < 4; i++) EXPECT_EQ_INT(expert[i], 0);
  }
  /* Invalid dimensions are refused, not read through. */
  epx_ref_set_quiet(1); /* the refusal below is expected */
  EXPECT_EQ_INT(epx_ref_layout(hand_idx0, 4, 2, 5, 2, NULL, NULL, NULL, NULL), -2);
  epx_ref_set_quiet(0);
  return TEST_PASS;
}

/* ---------------------------------------------------------------------------------------------
 * BF16 and FP8 conversions.
 * ------------------------------------------------------------------------------------------- */

EPX_HOST_TEST(ref_bf16_conversion, 10) {
  EXPECT_EQ_INT(bf(1.0f), 0x3f80);
  EXPECT_EQ_INT(bf(-2.0f), 0xc000);
  EXPECT_EQ_INT(bf(0.0f), 0x0000);
  EXPECT_EQ_INT(bf(-0.0f), 0x8000);
  EXPECT_EQ_INT(bf(1.0f + 0x1p-8f), 0x3f80);            /* tie, even is 1.0 */
  EXPECT_EQ_INT(bf(1.0f + 3 * 0x1p-8f), 0x3f82);        /* tie, even is up */
  EXPECT_EQ_INT(bf(1.0f + 0x1p-8f + 0x1p-20f), 0x3f81); /* just above the tie */
  EXPECT_EQ_INT(bf(1.0f + 0x1p-7f - 0x1p-20f), 0x3f81); /* just below the next value */
  EXPECT_EQ_INT(bf(ffrom(0x3f80ffffu)), 0x3f81);
  EXPECT_EQ_INT(bf(ffrom(0x3f817fffu)), 0x3f81);
  EXPECT_EQ_INT(bf(ffrom(0x3f818000u)), 0x3f82);
  EXPECT_EQ_INT(bf(INFINITY), 0x7f80);
  EXPECT_EQ_INT(bf(-INFINITY), 0xff80);
  EXPECT_EQ_INT(bf(ffrom(0x7f7fffffu)), 0x7f80); /* FLT_MAX rounds to infinity */
  EXPECT_EQ_INT(bf(ffrom(0x7f7f7fffu)), 0x7f7f); /* below the tie: largest finite BF16 */
  EXPECT_EQ_INT(bf(ffrom(0x00000001u)), 0x0000); /* float32 subnormals */
  EXPECT_EQ_INT(bf(ffrom(0x00008000u)), 0x0000);
  EXPECT_EQ_INT(bf(ffrom(0x00018000u)), 0x0002);
  EXPECT_EQ_INT(bf(ffrom(0x80018001u)), 0x8002);
  {
    uint16_t n = bf(NAN);
    EXPECTF((n & 0x7f80) == 0x7f80 && (n & 0x7f) != 0, "NaN -> 0x%04x", n);
    n = bf(ffrom(0x7f800001u)); /* a NaN whose payload is only in the dropped bits */
    EXPECTF((n & 0x7f80) == 0x7f80 && (n & 0x7f) != 0, "NaN 0x7f800001 -> 0x%04x", n);
    n = bf(ffrom(0xffc00000u));
    EXPECTF((n & 0xff80) == 0xff80 && (n & 0x7f) != 0, "-NaN -> 0x%04x", n);
  }
  EXPECT(fb(0x3f80) == 1.0f);
  EXPECT(fb(0xc000) == -2.0f);
  EXPECT(fb(0x0001) == 0x1p-133f);
  EXPECT(isinf(fb(0xff80)) && fb(0xff80) < 0);
  EXPECT(isnan(fb(0x7fc1)));
  /* Every code: round trip (NaNs stay NaNs); midpoints to the even neighbour. */
  for (uint32_t c = 0; c <= 0xffff; c++) {
    const int is_nan = (c & 0x7f80) == 0x7f80 && (c & 0x7f) != 0;
    const uint16_t back = bf(fb((uint16_t)c));
    if (is_nan) {
      EXPECTF((back & 0x7f80) == 0x7f80 && (back & 0x7f) != 0, "NaN 0x%04x -> 0x%04x", c, back);
      continue;
    }
    EXPECTF(back == c, "0x%04x -> %g -> 0x%04x", c, fb((uint16_t)c), back);
    if ((c & 0x7f80) == 0x7f80) continue;     /* infinities */
    const uint32_t mid = (c << 16) | 0x8000u; /* exactly halfway between c and the next code */
    const uint32_t want = (c & 1) ? c + 1 : c;
    EXPECTF(bf(ffrom(mid)) == want, "midpoint above 0x%04x -> 0x%04x", c, bf(ffrom(mid)));
    EXPECTF(bf(ffrom(mid + 1)) == c + 1, "above the midpoint of 0x%04x", c);
    EXPECTF(bf(ffrom(mid - 1)) == c, "below the midpoint of 0x%04x", c);
  }
  return TEST_PASS;
}

/* Independent FP8 oracle: the value of a positive finite code (0..0x7e) from the format's
 * definition, and the nearest code to a double by brute force. */
static double fp8_value(int c) {
  const int e = c >> 3, m = c & 7;
  return e == 0 ? ldexp(m, -9) : ldexp(1.0 + m / 8.0, e - 7);
}

static uint8_t fp8_nearest(float x) {
  if (isnan(x)) return 0x7f;
  const uint8_t sign = signbit(x) ? 0x80 : 0;
  const double a = fabs((double)x);
  if (a >= 448.0) return sign | 0x7e;
  int best = 0;
  for (int c = 1; c <= 0x7e; c++) {
    const double dc = fabs(fp8_value(c) - a), db = fabs(fp8_value(best) - a);
    if (dc < db || (dc == db && (c & 1) == 0)) best = c;
  }
  return (uint8_t)(sign | best);
}

EPX_HOST_TEST(ref_fp8_conversion, 30) {
  /* Known codes. */
  EXPECT(epx_ref_fp8_to_float(0x38) == 1.0f);
  EXPECT(epx_ref_fp8_to_float(0xb8) == -1.0f);
  EXPECT(epx_ref_fp8_to_float(0x7e) == 448.0f);
  EXPECT(epx_ref_fp8_to_float(0xfe) == -448.0f);
  EXPECT(epx_ref_fp8_to_float(0x01) == 0x1p-9f);
  EXPECT(epx_ref_fp8_to_float(0x07) == 7 * 0x1p-9f);
  EXPECT(epx_ref_fp8_to_float(0x08) == 0x1p-6f);
  EXPECT(epx_ref_fp8_to_float(0x44) == 3.0f);
  EXPECT(epx_ref_fp8_to_float(0x00) == 0.0f && !signbit(epx_ref_fp8_to_float(0x00)));
  EXPECT(epx_ref_fp8_to_float(0x80) == 0.0f && signbit(epx_ref_fp8_to_float(0x80)));
  EXPECT(isnan(epx_ref_fp8_to_float(0x7f)) && isnan(epx_ref_fp8_to_float(0xff)));

  /* Every code: the value matches the format definition, round trips, and the values of
   * 0..0x7e increase strictly. */
  for (int c = 0; c < 256; c++) {
    const float v = epx_ref_fp8_to_float((uint8_t)c);
    if ((c & 0x7f) == 0x7f) {
      EXPECTF(isnan(v), "0x%02x is not NaN", c);
      EXPECTF(epx_ref_fp8_from_float(v) == 0x7f, "NaN of 0x%02x -> 0x%02x", c,
              epx_ref_fp8_from_float(v));
      continue;
    }
    const double want = (c & 0x80) ? -fp8_value(c & 0x7f) : fp8_value(c);
    EXPECTF((double)v == want, "0x%02x -> %g, want %g", c, v, want);
    EXPECTF(epx_ref_fp8_from_float(v) == c, "0x%02x -> %g -> 0x%02x", c, v,
            epx_ref_fp8_from_float(v));
    if (c > 0 && c < 0x7f)
      EXPECTF(v > epx_ref_fp8_to_float((uint8_t)(c - 1)), "not increasing at 0x%02x", c);
  }

  /* Midpoints between neighbours round to the even code; one float away they do not tie. */
  for (int c = 0; c < 0x7e; c++) {
    const float a = epx_ref_fp8_to_float((uint8_t)c), b = epx_ref_fp8_to_float((uint8_t)(c + 1));
    const float mid = (a + b) / 2; /* exact: a and b have 4 significant bits */
    const int even = (c & 1) ? c + 1 : c;
    EXPECTF(epx_ref_fp8_from_float(mid) == even, "mid %g of 0x%02x -> 0x%02x", mid, c,
            epx_ref_fp8_from_float(mid));
    EXPECTF(epx_ref_fp8_from_float(-mid) == (0x80 | even), "-mid %g", mid);
    EXPECTF(epx_ref_fp8_from_float(nextafterf(mid, INFINITY)) == c + 1, "above mid %g", mid);
    EXPECTF(epx_ref_fp8_from_float(nextafterf(mid, 0.0f)) == c, "below mid %g", mid);
  }

  /* Saturation: everything at or past 448 is 448, infinities included. */
  const float big[] = {448.0f,  448.5f, 449.0f, 463.99f, 464.0f,
                       464.01f, 480.0f, 1e4f,   1e30f,   INFINITY};
  for (size_t i = 0; i < sizeof big / sizeof big[0]; i++) {
    EXPECTF(epx_ref_fp8_from_float(big[i]) == 0x7e, "%g -> 0x%02x", big[i],
            epx_ref_fp8_from_float(big[i]));
    EXPECTF(epx_ref_fp8_from_float(-big[i]) == 0xfe, "%g -> 0x%02x", -big[i],
            epx_ref_fp8_from_float(-big[i]));
  }
  EXPECT_EQ_INT(epx_ref_fp8_from_float(447.0f), 0x7e); /* nearest is 448 */
  EXPECT_EQ_INT(epx_ref_fp8_from_float(432.0f), 0x7e); /* tie 416/448: 0x7e is even */
  EXPECT_EQ_INT(epx_ref_fp8_from_float(431.9f), 0x7d);
  EXPECT_EQ_INT(epx_ref_fp8_from_float(400.0f), 0x7c); /* tie 384/416: 0x7c is even */

  /* Tiny values: to zero (signed) or to subnormals. */
  EXPECT_EQ_INT(epx_ref_fp8_from_float(0x1p-10f), 0x00); /* tie between 0 and 2^-9: 0 */
  EXPECT_EQ_INT(epx_ref_fp8_from_float(-0x1p-10f), 0x80);
  EXPECT_EQ_INT(epx_ref_fp8_from_float(nextafterf(0x1p-10f, 1.0f)), 0x01);
  EXPECT_EQ_INT(epx_ref_fp8_from_float(0x1p-9f), 0x01);
  EXPECT_EQ_INT(epx_ref_fp8_from_float(1.5f * 0x1p-9f), 0x02); /* tie 1/2: 2 is even */
  EXPECT_EQ_INT(epx_ref_fp8_from_float(2.5f * 0x1p-9f), 0x02); /* tie 2/3: 2 is even */
  EXPECT_EQ_INT(epx_ref_fp8_from_float(7.5f * 0x1p-9f), 0x08); /* tie 7/8: smallest normal */
  EXPECT_EQ_INT(epx_ref_fp8_from_float(1e-30f), 0x00);
  EXPECT_EQ_INT(epx_ref_fp8_from_float(-1e-30f), 0x80);
  EXPECT_EQ_INT(epx_ref_fp8_from_float(ffrom(0x00000001u)), 0x00);
  EXPECT_EQ_INT(epx_ref_fp8_from_float(-0.0f), 0x80);
  EXPECT_EQ_INT(epx_ref_fp8_from_float(NAN), 0x7f);
  EXPECT_EQ_INT(epx_ref_fp8_from_float(-NAN), 0x7f);

  /* Random floats against the brute-force oracle: half near the FP8 range, half any bits. */
  uint64_t rng = epx_test_seed() ^ 0xF8F8F8F8ull;
  for (int i = 0; i < 200000; i++) {
    uint32_t u = (uint32_t)epx_test_rand(&rng);
    if (i & 1) u = (u & 0x807fffffu) | ((uint32_t)(110 + epx_test_rand_int(&rng, 30)) << 23);
    const float x = ffrom(u);
    if (isnan(x)) continue;
    const uint8_t got = epx_ref_fp8_from_float(x), want = fp8_nearest(x);
    EXPECTF(got == want, "%a (0x%08x) -> 0x%02x, oracle 0x%02x", x, u, got, want);
  }
  return TEST_PASS;
}

/* ---------------------------------------------------------------------------------------------
 * FP8 quantization.
 * ------------------------------------------------------------------------------------------- */

EPX_HOST_TEST(ref_fp8_quantize_hand, 10) {
  /* One token, H = 384: group 0 has amax 448 (scale 1), group 1 amax 1, group 2 is all zero. */
  enum { H = 384 };
  uint16_t x[H];
  memset(x, 0, sizeof x);
  x[0] = bf(-448.0f);
  x[1] = bf(3.0f);
  x[2] = bf(0.3f); /* 0x3e99999a rounds up to 0x3e9a = 0.30078125 */
  x[3] = bf(0x1p-9f);
  x[4] = bf(0x1p-10f);
  x[5] = bf(-1.5f * 0x1p-9f);
  x[6] = bf(17.0f);
  x[7] = bf(19.0f);
  x[128] = bf(1.0f);
  x[129] = bf(-0.5f);
  x[130] = bf(0.25f);
  EXPECT_EQ_INT(x[2], 0x3e9a);

  /* Group 0 (both scale kinds, scale 1.0): codes of the values themselves. */
  const uint8_t want_g0[8] = {0xfe, 0x44, 0x2a, 0x01, 0x00, 0x82, 0x58, 0x5a};
  /* Group 1, float32 scale: scale = fl(1/448) = 0x3b124925, inv = fl(1/scale) = 448 - 2^-15;
   * 1*inv -> 448, -0.5*inv -> -224, 0.25*inv -> 112. */
  const uint8_t want_g1_f32[3] = {0x7e, 0xf6, 0x6e};
  /* Group 1, UE8M0: scale = 2^-8, inv = 256: 256, -128, 64. */
  const uint8_t want_g1_ue8m0[3] = {0x78, 0xf0, 0x68};
  /* Scales: group 2 has amax floored at 1e-4: fl(1e-4f/448) = 0x346facad; UE8M0 2^-22. */
  const uint32_t want_scales[2][3] = {{0x3f800000u, 0x3b124925u, 0x346facadu},
                                      {0x3f800000u, 0x3b800000u, 0x34800000u}};

  for (int ue8m0 = 0; ue8m0 < 2; ue8m0++) {
    uint8_t q[H];
    float s[H / 128 + 1];
    memset(q, 0xAB, sizeof q);
    s[3] = -1.0f;
    EXPECT_EQ_INT(epx_ref_fp8_quantize(x, 1, H, ue8m0, q, s), 0);
    for (int g = 0; g < 3; g++)
      EXPECTF(fbits(s[g]) == want_scales[ue8m0][g], "ue8m0=%d scale[%d] = 0x%08x, want 0x%08x",
              ue8m0, g, fbits(s[g]), want_scales[ue8m0][g]);
    EXPECT(s[3] == -1.0f);
    for (int c = 0; c < 8; c++)
      EXPECTF(q[c] == want_g0[c], "ue8m0=%d q[%d] = 0x%02x, want 0x%02x", ue8m0, c, q[c],
              want_g0[c]);
    for (int c = 0; c < 3; c++) {
      const uint8_t w = ue8m0 ? want_g1_ue8m0[c] : want_g1_f32[c];
      EXPECTF(q[128 + c] == w, "ue8m0=%d q[%d] = 0x%02x, want 0x%02x", ue8m0, 128 + c, q[128 + c],
              w);
    }
    for (int c = 0; c < H; c++)
      if ((c >= 8 && c < 128) || (c >= 131)) EXPECTF(q[c] == 0, "q[%d] = 0x%02x", c, q[c]);

    /* Dequantize: float(q) * scale. */
    float d[H];
    EXPECT_EQ_INT(epx_ref_fp8_dequantize(q, s, 1, H, d), 0);
    EXPECT(d[0] == -448.0f && d[1] == 3.0f && d[2] == 0.3125f && d[3] == 0x1p-9f && d[4] == 0.0f);
    EXPECT(d[5] == -2 * 0x1p-9f && d[6] == 16.0f && d[7] == 20.0f && d[200] == 0.0f);
    if (ue8m0) {
      EXPECT(d[128] == 1.0f && d[129] == -0.5f && d[130] == 0.25f);
    } else {
      EXPECT(d[128] == 448.0f * ffrom(0x3b124925u));
      EXPECT(d[129] == -224.0f * ffrom(0x3b124925u));
    }
  }
  EXPECT(epx_ref_fp8_scale(448.0f, 0) == 1.0f);
  EXPECT(epx_ref_fp8_scale(0.0f, 0) == ffrom(0x346facadu));
  EXPECT(epx_ref_fp8_scale(896.0f, 1) == 2.0f);    /* exact power of two stays */
  EXPECT(epx_ref_fp8_scale(897.0f, 1) == 4.0f);    /* just above goes up */
  EXPECT(epx_ref_fp8_scale(1e-5f, 1) == 0x1p-22f); /* the floor applies before rounding */
  uint8_t q[100];
  float s[1];
  epx_ref_set_quiet(1); /* the refusal below is expected */
  EXPECT_EQ_INT(epx_ref_fp8_quantize(x, 1, 100, 0, q, s), -1);
  epx_ref_set_quiet(0);
  return TEST_PASS;
}

/* ---------------------------------------------------------------------------------------------
 * Normal dispatch and combine.
 * ------------------------------------------------------------------------------------------- */

/* The 4 received rows of a hand-world dispatch (top-2, hidden 2): sources, ids, weights, x. */
static int check_hand_rows(const epx_ref_recv_t *r, const int *src_rank, const int *src_token,
                           const int64_t *idx, const float *w, const float *x) {
  for (int i = 0; i < 4; i++) {
    EXPECT_EQ_INT(r->src_rank[i], src_rank[i]);
    EXPECT_EQ_INT(r->src_token[i], src_token[i]);
  }
  for (int i = 0; i < 8; i++) {
    EXPECTF(r->topk_idx[i] == idx[i], "topk_idx[%d][%d] = %lld, want %lld", i / 2, i % 2,
            (long long)r->topk_idx[i], (long long)idx[i]);
    EXPECTF(r->topk_weights[i] == w[i], "topk_weights[%d][%d] = %g, want %g", i / 2, i % 2,
            r->topk_weights[i], w[i]);
    EXPECTF(r->x[i] == bf(x[i]), "x[%d][%d] = %g, want %g", i / 2, i % 2, fb(r->x[i]), x[i]);
  }
  return TEST_PASS;
}

EPX_HOST_TEST(ref_dispatch_hand, 10) {
  hand_world_t h;
  hand_world_init(&h);
  /* Rank 0 (experts 0, 1): rank 0's tokens 0, 3, then rank 1's tokens 0, 2. */
  {
    epx_ref_recv_t r;
    EXPECT_EQ_INT(epx_ref_dispatch_num_recv(&h.world, 0), 4);
    EXPECT_EQ_INT(epx_ref_dispatch(&h.world, 0, EPX_REF_PAYLOAD_BF16, 3, &r), 0);
    EXPECT_EQ_INT(r.num_recv, 4);
    EXPECT_EQ_INT(r.num_local_experts, 2);
    const int src_rank[4] = {0, 0, 1, 1}, src_token[4] = {0, 3, 0, 2};
    const int64_t idx[8] = {1, -1, 0, -1, -1, 0, 1, 1};
    const float w[8] = {0.5f, 0, 1.0f, 0, 0, 0.5f, 0.25f, 0.5f};
    const float x[8] = {1, -1, 4, -4, 11, -11, 13, -13};
    const int prefix[3] = {0, 2, 4};
    EXPECT(check_hand_rows(&r, src_rank, src_token, idx, w, x) == TEST_PASS);
    for (int s = 0; s < 3; s++) EXPECT_EQ_INT(r.rank_prefix[s], prefix[s]);
    EXPECT_EQ_INT(r.num_recv_per_expert[0], 2);
    EXPECT_EQ_INT(r.num_recv_per_expert[1], 2);
    EXPECT_EQ_INT(r.num_recv_per_expert_aligned[0], 3);
    EXPECT_EQ_INT(r.num_recv_per_expert_aligned[1], 3);
    EXPECT(r.x_fp8 == NULL && r.x_scales == NULL);
    epx_ref_recv_free(&r);
    EXPECT(r.x == NULL && r.num_recv == 0);
  }
  /* Rank 1 (experts 2, 3): rank 0's tokens 0, 1, then rank 1's tokens 0, 1 (bad id dropped). */
  {
    epx_ref_recv_t r;
    EXPECT_EQ_INT(epx_ref_dispatch(&h.world, 1, EPX_REF_PAYLOAD_BF16, 2, &r), 0);
    EXPECT_EQ_INT(r.num_recv, 4);
    const int src_rank[4] = {0, 0, 1, 1}, src_token[4] = {0, 1, 0, 1};
    const int64_t idx[8] = {-1, 0, 1, 0, 0, -1, -1, 1};
    const float w[8] = {0, 0.25f, 0.125f, 0.75f, 0.5f, 0, 0, 0.25f};
    const float x[8] = {1, -1, 2, -2, 11, -11, 12, -12};
    EXPECT(check_hand_rows(&r, src_rank, src_token, idx, w, x) == TEST_PASS);
    EXPECT_EQ_INT(r.num_recv_per_expert[0], 3);
    EXPECT_EQ_INT(r.num_recv_per_expert[1], 2);
    EXPECT_EQ_INT(r.num_recv_per_expert_aligned[0], 4);
    EXPECT_EQ_INT(r.num_recv_per_expert_aligned[1], 2);
    epx_ref_recv_free(&r);
  }
  /* Without weights, received weights are 0; alignment 1 keeps exact counts. */
  {
    h.ranks[0].topk_weights = NULL;
    epx_ref_recv_t r;
    EXPECT_EQ_INT(epx_ref_dispatch(&h.world, 1, EPX_REF_PAYLOAD_NONE, 1, &r), 0);
    EXPECT(r.x == NULL);
    EXPECT(r.topk_weights[0] == 0.0f && r.topk_weights[1] == 0.0f && r.topk_weights[3] == 0.0f);
    EXPECT(r.topk_weights[4] == 0.5f); /* rank 1 still has weights */
    EXPECT_EQ_INT(r.num_recv_per_expert_aligned[0], 3);
    epx_ref_recv_free(&r);
    h.ranks[0].topk_weights = hand_w0;
  }
  /* FP8 payload (H = 256): bytes and scales are copied bit-exactly, not requantized. */
  {
    enum { H = 256 };
    static uint8_t q0[4 * H], q1[3 * H];
    static float s0[4 * 2], s1[3 * 2];
    for (int i = 0; i < 4 * H; i++) q0[i] = (uint8_t)(i * 7 + 1);
    for (int i = 0; i < 3 * H; i++) q1[i] = (uint8_t)(i * 13 + 5);
    for (int i = 0; i < 8; i++) s0[i] = 0.5f + i;
    for (int i = 0; i < 6; i++) s1[i] = -1.0f - i; /* not even plausible scales: copied as is */
    epx_ref_rank_t ranks[2] = {h.ranks[0], h.ranks[1]};
    ranks[0].x = NULL, ranks[1].x = NULL;
    ranks[0].x_fp8 = q0, ranks[0].x_scales = s0;
    ranks[1].x_fp8 = q1, ranks[1].x_scales = s1;
    epx_ref_world_t w = {2, 4, 2, H, ranks};
    epx_ref_recv_t r;
    EXPECT_EQ_INT(epx_ref_dispatch(&w, 0, EPX_REF_PAYLOAD_FP8, 1, &r), 0);
    EXPECT(r.x == NULL);
    const int src_rank[4] = {0, 0, 1, 1}, src_token[4] = {0, 3, 0, 2};
    for (int i = 0; i < 4; i++) {
      const uint8_t *q = (src_rank[i] ? q1 : q0) + src_token[i] * H;
      const float *s = (src_rank[i] ? s1 : s0) + src_token[i] * 2;
      EXPECTF(memcmp(r.x_fp8 + i * H, q, H) == 0, "fp8 row %d", i);
      EXPECTF(r.x_scales[i * 2] == s[0] && r.x_scales[i * 2 + 1] == s[1], "scales of row %d", i);
    }
    epx_ref_recv_free(&r);
    w.hidden = 200;       /* FP8 needs H % 128 == 0 */
    epx_ref_set_quiet(1); /* the refusal below is expected */
    EXPECT_EQ_INT(epx_ref_dispatch(&w, 0, EPX_REF_PAYLOAD_FP8, 1, &r), -1);
    epx_ref_set_quiet(0);
    epx_ref_recv_free(&r);
  }
  return TEST_PASS;
}

EPX_HOST_TEST(ref_combine_hand, 10) {
  hand_world_t h;
  hand_world_init(&h);
  /* Expert outputs in each rank's receive order (4 rows each, see ref_dispatch_hand). */
  const float y0f[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  const float y1f[8] = {10, 20, 30, 40, 50, 60, 70, 80};
  uint16_t y0[8], y1[8];
  for (int i = 0; i < 8; i++) y0[i] = bf(y0f[i]), y1[i] = bf(y1f[i]);
  const uint16_t *y[2] = {y0, y1};

  /* rank 0: t0 = y0[0] + y1[0], t1 = y1[1], t2 = 0, t3 = y0[1];
   * weighted: t0 0.5*y0[0] + 0.25*y1[0], t1 (0.125+0.75)*y1[1], t3 1.0*y0[1]. */
  const float want0_u[8] = {11, 22, 30, 40, 0, 0, 3, 4};
  const float want0_w[8] = {3, 6, 26.25f, 35, 0, 0, 3, 4};
  /* rank 1: t0 = y0[2] + y1[2], t1 = y1[3] (bad slot ignored), t2 = y0[3];
   * weighted: t0 0.5*y0[2] + 0.5*y1[2], t1 0.25*y1[3], t2 (0.25+0.5)*y0[3]. */
  const float want1_u[6] = {55, 66, 70, 80, 7, 8};
  const float want1_w[6] = {27.5f, 33, 17.5f, 20, 5.25f, 6};

  for (int s = 0; s < 2; s++) {
    const int T = s ? 3 : 4;
    const float *want_u = s ? want1_u : want0_u, *want_w = s ? want1_w : want0_w;
    const float *wts = s ? hand_w1 : hand_w0;
    uint16_t out[8];
    double out64[8];
    memset(out, 0xAB, sizeof out);
    EXPECT_EQ_INT(epx_ref_combine(&h.world, s, y, NULL, out), 0);
    for (int i = 0; i < T * 2; i++)
      EXPECTF(out[i] == bf(want_u[i]), "rank %d unweighted out[%d][%d] = %g, want %g", s, i / 2,
              i % 2, fb(out[i]), want_u[i]);
    EXPECT_EQ_INT(epx_ref_combine_f64(&h.world, s, y, NULL, out64), 0);
    for (int i = 0; i < T * 2; i++)
      EXPECTF(out64[i] == want_u[i], "rank %d f64 out[%d] = %g", s, i, out64[i]);
    EXPECT_EQ_INT(epx_ref_combine(&h.world, s, y, wts, out), 0);
    for (int i = 0; i < T * 2; i++)
      EXPECTF(out[i] == bf(want_w[i]), "rank %d weighted out[%d][%d] = %g, want %g", s, i / 2,
              i % 2, fb(out[i]), want_w[i]);
    EXPECT_EQ_INT(epx_ref_combine_f64(&h.world, s, y, wts, out64), 0);
    for (int i = 0; i < T * 2; i++)
      EXPECTF(out64[i] == want_w[i], "rank %d weighted f64 out[%d] = %g", s, i, out64[i]);
  }
  /* The zero row is +0.0 exactly. */
  {
    uint16_t out[8];
    memset(out, 0xAB, sizeof out);
    EXPECT_EQ_INT(epx_ref_combine(&h.world, 0, y, hand_w0, out), 0);
    EXPECT_EQ_INT(out[4], 0x0000);
    EXPECT_EQ_INT(out[5], 0x0000);
  }
  /* Rounding: 1 + 2^-8 is a BF16 tie (-> 1.0); 1 + 2^-8 + 2^-14 is not (-> 1 + 2^-7). The
   * float64 sum keeps them. */
  {
    y0[0] = bf(1.0f), y1[0] = bf(0x1p-8f);
    uint16_t out[8];
    double out64[8];
    EXPECT_EQ_INT(epx_ref_combine(&h.world, 0, y, NULL, out), 0);
    EXPECT_EQ_INT(out[0], 0x3f80);
    EXPECT_EQ_INT(epx_ref_combine_f64(&h.world, 0, y, NULL, out64), 0);
    EXPECT(out64[0] == 1.0 + 0x1p-8);
    y1[0] = bf(0x1p-8f + 0x1p-14f);
    EXPECT_EQ_INT(epx_ref_combine(&h.world, 0, y, NULL, out), 0);
    EXPECT_EQ_INT(out[0], 0x3f81);
  }
  /* A rank that received rows must have its y. */
  {
    const uint16_t *ynull[2] = {y0, NULL};
    uint16_t out[8];
    epx_ref_set_quiet(1); /* the refusal below is expected */
    EXPECT_EQ_INT(epx_ref_combine(&h.world, 0, ynull, NULL, out), -1);
    epx_ref_set_quiet(0);
  }
  return TEST_PASS;
}

/* ---------------------------------------------------------------------------------------------
 * Low-latency dispatch and combine.
 * ------------------------------------------------------------------------------------------- */

#define LL_M 4
#define LL_ROWS (HAND_R * LL_M) /* rows per local expert */
#define LL_LOCAL (HAND_E / HAND_R)

EPX_HOST_TEST(ref_ll_dispatch_hand, 10) {
  hand_world_t h;
  hand_world_init(&h);
  /* Expected rows per (rank d, local expert j): (src_rank, src_token, src_slot), and per-source
   * begin/num. Rank 0: expert 0 <- (0,3,0) (1,0,1); expert 1 <- (0,0,0) (1,2,0) (1,2,1).
   * Rank 1: expert 2 <- (0,0,1) (0,1,1) (1,0,0); expert 3 <- (0,1,0) (1,1,1). */
  const int want_count[2][LL_LOCAL] = {{2, 3}, {3, 2}};
  const int want_begin[2][LL_LOCAL * HAND_R] = {{0, 1, 0, 1}, {0, 2, 0, 1}};
  const int want_num[2][LL_LOCAL * HAND_R] = {{1, 1, 1, 2}, {2, 1, 1, 1}};
  const int want_rows[2][LL_LOCAL][3][3] = {
      {{{0, 3, 0}, {1, 0, 1}}, {{0, 0, 0}, {1, 2, 0}, {1, 2, 1}}},
      {{{0, 0, 1}, {0, 1, 1}, {1, 0, 0}}, {{0, 1, 0}, {1, 1, 1}}},
  };
  for (int d = 0; d < 2; d++) {
    uint16_t x[LL_LOCAL * LL_ROWS * HAND_H];
    int count[LL_LOCAL], begin[LL_LOCAL * HAND_R], num[LL_LOCAL * HAND_R];
    int src_rank[LL_LOCAL * LL_ROWS], src_token[LL_LOCAL * LL_ROWS], src_slot[LL_LOCAL * LL_ROWS];
    memset(x, 0xAB, sizeof x), memset(count, 0xAB, sizeof count), memset(begin, 0xAB, sizeof begin);
    memset(num, 0xAB, sizeof num), memset(src_rank, 0xAB, sizeof src_rank);
    memset(src_token, 0xAB, sizeof src_token), memset(src_slot, 0xAB, sizeof src_slot);
    epx_ref_ll_recv_t out = {x, NULL, NULL, count, begin, num, src_rank, src_token, src_slot};
    EXPECT_EQ_INT(epx_ref_ll_dispatch(&h.world, d, LL_M, 0, &out), 0);
    for (int j = 0; j < LL_LOCAL; j++) {
      EXPECTF(count[j] == want_count[d][j], "rank %d count[%d] = %d, want %d", d, j, count[j],
              want_count[d][j]);
      for (int s = 0; s < HAND_R; s++) {
        EXPECTF(begin[j * HAND_R + s] == want_begin[d][j * HAND_R + s],
                "rank %d begin[%d][%d] = %d", d, j, s, begin[j * HAND_R + s]);
        EXPECTF(num[j * HAND_R + s] == want_num[d][j * HAND_R + s], "rank %d num[%d][%d] = %d", d,
                j, s, num[j * HAND_R + s]);
      }
      for (int i = 0; i < LL_ROWS; i++) {
        const int row = j * LL_ROWS + i;
        if (i >= want_count[d][j]) {
          EXPECTF(
              src_rank[row] == (int)0xABABABAB && x[row * 2] == 0xABAB && x[row * 2 + 1] == 0xABAB,
              "rank %d expert %d row %d beyond count was written", d, j, i);
          continue;
        }
        const int *w = want_rows[d][j][i];
        EXPECTF(src_rank[row] == w[0] && src_token[row] == w[1] && src_slot[row] == w[2],
                "rank %d expert %d row %d = (%d,%d,%d), want (%d,%d,%d)", d, j, i, src_rank[row],
                src_token[row], src_slot[row], w[0], w[1], w[2]);
        const float v = (float)(10 * w[0] + w[1] + 1);
        EXPECTF(x[row * 2] == bf(v) && x[row * 2 + 1] == bf(-v),
                "rank %d expert %d row %d payload %g", d, j, i, fb(x[row * 2]));
      }
    }
  }
  /* FP8 on the fly (H = 128): each row is the per-128 quantization of its source token. */
  {
    enum { H = 128 };
    static uint16_t x0[4 * H], x1[3 * H];
    for (int i = 0; i < 4 * H; i++) x0[i] = bf((float)((i * 37) % 101 - 50) / 8.0f);
    for (int i = 0; i < 3 * H; i++) x1[i] = bf((float)((i * 53) % 97 - 48) / 64.0f);
    epx_ref_rank_t ranks[2] = {h.ranks[0], h.ranks[1]};
    ranks[0].x = x0, ranks[1].x = x1;
    epx_ref_world_t w = {2, 4, 2, H, ranks};
    for (int ue8m0 = 0; ue8m0 < 2; ue8m0++) {
      static uint8_t q[LL_LOCAL * LL_ROWS * H], want_q[H];
      static float s[LL_LOCAL * LL_ROWS], want_s[1];
      epx_ref_ll_recv_t out = {NULL, q, s, NULL, NULL, NULL, NULL, NULL, NULL};
      EXPECT_EQ_INT(epx_ref_ll_dispatch(&w, 1, LL_M, ue8m0, &out), 0);
      for (int j = 0; j < LL_LOCAL; j++)
        for (int i = 0; i < want_count[1][j]; i++) {
          const int *r = want_rows[1][j][i];
          EXPECT_EQ_INT(
              epx_ref_fp8_quantize((r[0] ? x1 : x0) + r[1] * H, 1, H, ue8m0, want_q, want_s), 0);
          const int row = j * LL_ROWS + i;
          EXPECTF(memcmp(q + row * H, want_q, H) == 0 && s[row] == want_s[0],
                  "ue8m0=%d expert %d row %d", ue8m0, j, i);
        }
    }
  }
  return TEST_PASS;
}

EPX_HOST_TEST(ref_ll_combine_hand, 10) {
  hand_world_t h;
  hand_world_init(&h);
  /* y_d[j][i] = {64d + 8j + i, 64d + 8j + i + 0.5}. */
  static uint16_t y0[LL_LOCAL * LL_ROWS * HAND_H], y1[LL_LOCAL * LL_ROWS * HAND_H];
  for (int d = 0; d < 2; d++)
    for (int j = 0; j < LL_LOCAL; j++)
      for (int i = 0; i < LL_ROWS; i++) {
        uint16_t *row = (d ? y1 : y0) + (j * LL_ROWS + i) * HAND_H;
        row[0] = bf((float)(64 * d + 8 * j + i));
        row[1] = bf((float)(64 * d + 8 * j + i) + 0.5f);
      }
  const uint16_t *y[2] = {y0, y1};
  /* Rank 0: t0 = 0.5*y0[1][0] + 0.25*y1[0][0]; t1 = 0.125*y1[1][0] + 0.75*y1[0][1];
   * t2 = 0; t3 = 1.0*y0[0][0]. t1's second channel, 58.1875, rounds to 58.25 in BF16. */
  const double want0[8] = {20, 20.375, 57.75, 58.1875, 0, 0, 0, 0.5};
  const float want0_bf16[8] = {20, 20.375f, 57.75f, 58.25f, 0, 0, 0, 0.5f};
  /* Rank 1: t0 = 0.5*y1[0][2] + 0.5*y0[0][1]; t1 = 0.25*y1[1][1] (bad slot ignored);
   * t2 = 0.25*y0[1][1] + 0.5*y0[1][2] (expert 1 twice: two rows). */
  const double want1[6] = {33.5, 34, 18.25, 18.375, 7.25, 7.625};
  for (int s = 0; s < 2; s++) {
    const int T = s ? 3 : 4;
    const double *want = s ? want1 : want0;
    uint16_t out[8];
    double out64[8];
    memset(out, 0xAB, sizeof out);
    EXPECT_EQ_INT(epx_ref_ll_combine(&h.world, s, LL_M, y, s ? hand_w1 : hand_w0, out), 0);
    EXPECT_EQ_INT(epx_ref_ll_combine_f64(&h.world, s, LL_M, y, s ? hand_w1 : hand_w0, out64), 0);
    for (int i = 0; i < T * 2; i++) {
      const float wb = s ? (float)want1[i] : want0_bf16[i];
      EXPECTF(out[i] == bf(wb), "rank %d out[%d][%d] = %g, want %g", s, i / 2, i % 2, fb(out[i]),
              wb);
      EXPECTF(out64[i] == want[i], "rank %d f64 out[%d][%d] = %.10g, want %.10g", s, i / 2, i % 2,
              out64[i], want[i]);
    }
  }
  /* Without weights every valid slot counts once: rank 1 t2 = y0[1][1] + y0[1][2] = 9 + 10. */
  {
    uint16_t out[6];
    EXPECT_EQ_INT(epx_ref_ll_combine(&h.world, 1, LL_M, y, NULL, out), 0);
    EXPECT(fb(out[4]) == 19.0f && fb(out[5]) == 20.0f);
  }
  /* More tokens than max_tokens_per_rank is refused. */
  {
    uint16_t out[8];
    epx_ref_set_quiet(1); /* the refusal below is expected */
    EXPECT_EQ_INT(epx_ref_ll_combine(&h.world, 0, 3, y, NULL, out), -1);
    epx_ref_set_quiet(0);
  }
  return TEST_PASS;
}

/* ---------------------------------------------------------------------------------------------
 * Argument checks.
 * ------------------------------------------------------------------------------------------- */

EPX_HOST_TEST(ref_refuses_bad_arguments, 10) {
  epx_ref_set_quiet(1); /* every refusal here is expected */
  hand_world_t h;
  hand_world_init(&h);
  epx_ref_recv_t r;
  epx_ref_world_t w = h.world;
  w.num_experts = 5; /* not a multiple of R */
  EXPECT_EQ_INT(epx_ref_dispatch(&w, 0, EPX_REF_PAYLOAD_NONE, 1, &r), -1);
  epx_ref_recv_free(&r);
  EXPECT_EQ_INT(epx_ref_dispatch_num_recv(&w, 0), -1);
  EXPECT_EQ_INT(epx_ref_dispatch(&h.world, 2, EPX_REF_PAYLOAD_NONE, 1, &r), -1); /* no rank 2 */
  epx_ref_recv_free(&r);
  EXPECT_EQ_INT(epx_ref_dispatch(&h.world, 0, EPX_REF_PAYLOAD_NONE, 0, &r), -1); /* alignment */
  epx_ref_recv_free(&r);
  EXPECT_EQ_INT(epx_ref_dispatch(&h.world, 0, EPX_REF_PAYLOAD_FP8, 1, &r), -1); /* no FP8 data */
  epx_ref_recv_free(&r);

  /* Low latency: T > M; and an expert over its R*M rows (repeated ids) writes nothing. */
  int count[2] = {-7, -7};
  epx_ref_ll_recv_t out = {NULL, NULL, NULL, count, NULL, NULL, NULL, NULL, NULL};
  EXPECT_EQ_INT(epx_ref_ll_dispatch(&h.world, 0, 3, 0, &out), -1);
  const int64_t rep[4 * 2] = {0, 0, 0, 0, 0, 0, 0, 0}; /* 8 rows for expert 0 */
  epx_ref_rank_t ranks[2] = {{4, rep, NULL, NULL, NULL, NULL}, {0, NULL, NULL, NULL, NULL, NULL}};
  epx_ref_world_t wr = {2, 4, 2, 2, ranks};
  EXPECT_EQ_INT(epx_ref_ll_dispatch(&wr, 0, 3, 0, &out), -1); /* 8 > 2*3 */
  EXPECT(count[0] == -7 && count[1] == -7);
  EXPECT_EQ_INT(epx_ref_ll_dispatch(&wr, 0, 4, 0, &out), 0); /* 8 <= 2*4 */
  EXPECT(count[0] == 8 && count[1] == 0);
  return TEST_PASS;
}

/* ---------------------------------------------------------------------------------------------
 * Randomized self-consistency.
 * ------------------------------------------------------------------------------------------- */

#define RW_MAX_R 8

typedef struct {
  epx_ref_rank_t ranks[RW_MAX_R];
  epx_ref_world_t world;
  int64_t *idx[RW_MAX_R];
  float *w[RW_MAX_R];
  uint16_t *x[RW_MAX_R];
  int max_tokens;
} rand_world_t;

/* R in {1,2,4,8}, E = R * (1..4), K in 1..6, T_r in 0..max_t (sometimes 0), H in {128, 256}.
 * Ids: mostly uniform (repeats allowed), some -1, a few out of range when allow_bad. */
static int rand_world_init(rand_world_t *rw, uint64_t *rng, int max_t, int allow_bad) {
  memset(rw, 0, sizeof *rw);
  const int R = 1 << epx_test_rand_int(rng, 4);
  const int E = R * (1 + epx_test_rand_int(rng, 4)), K = 1 + epx_test_rand_int(rng, 6);
  const int H = 128 * (1 + epx_test_rand_int(rng, 2));
  for (int r = 0; r < R; r++) {
    const int T = epx_test_rand_int(rng, 5) == 0 ? 0 : epx_test_rand_int(rng, max_t + 1);
    rw->idx[r] = malloc(sizeof(int64_t) * ((size_t)T * K + 1));
    rw->w[r] = malloc(sizeof(float) * ((size_t)T * K + 1));
    rw->x[r] = malloc(sizeof(uint16_t) * ((size_t)T * H + 1));
    if (!rw->idx[r] || !rw->w[r] || !rw->x[r]) return -1;
    for (int i = 0; i < T * K; i++) {
      const int p = epx_test_rand_int(rng, 100);
      int64_t e = epx_test_rand_int(rng, E);
      if (p < 15)
        e = -1;
      else if (allow_bad && p < 18)
        e = p == 15 ? E : (p == 16 ? -2 : 1000);
      rw->idx[r][i] = e;
      rw->w[r][i] = (float)(1 + epx_test_rand_int(rng, 1000)) / 997.0f;
    }
    for (int i = 0; i < T * H; i++)
      rw->x[r][i] = bf((float)(epx_test_rand_int(rng, 2001) - 1000) / 128.0f);
    rw->ranks[r] = (epx_ref_rank_t){T, rw->idx[r], rw->w[r], rw->x[r], NULL, NULL};
    if (T > rw->max_tokens) rw->max_tokens = T;
  }
  rw->world = (epx_ref_world_t){R, E, K, H, rw->ranks};
  return 0;
}

static void rand_world_free(rand_world_t *rw) {
  for (int r = 0; r < RW_MAX_R; r++) free(rw->idx[r]), free(rw->w[r]), free(rw->x[r]);
}

/* One random world through layout, dispatch and combine. */
static int check_normal_world(rand_world_t *rw, uint64_t *rng) {
  const epx_ref_world_t *w = &rw->world;
  const int R = w->num_ranks, E = w->num_experts, K = w->top_k, H = w->hidden, L = E / R;
  int per_rank[RW_MAX_R][RW_MAX_R], *per_expert[RW_MAX_R], *pos[RW_MAX_R];
  uint8_t *in[RW_MAX_R];
  for (int s = 0; s < R; s++) {
    const int T = w->ranks[s].num_tokens;
    per_expert[s] = malloc(sizeof(int) * E);
    pos[s] = malloc(sizeof(int) * ((size_t)T * R + 1));
    in[s] = malloc((size_t)T * R + 1);
    EXPECT(per_expert[s] && pos[s] && in[s]);
    EXPECT(epx_ref_layout(w->ranks[s].topk_idx, T, K, E, R, per_rank[s], per_expert[s], in[s],
                          pos[s]) >= -1);
  }
  epx_ref_recv_t recv[RW_MAX_R];
  const uint16_t *y[RW_MAX_R];
  for (int d = 0; d < R; d++) {
    const int align = 1 + epx_test_rand_int(rng, 8);
    epx_ref_recv_t *rv = &recv[d];
    EXPECT_EQ_INT(epx_ref_dispatch(w, d, EPX_REF_PAYLOAD_BF16, align, rv), 0);
    y[d] = rv->x;
    /* Row counts agree with the layouts. */
    int total = 0;
    for (int s = 0; s < R; s++) {
      EXPECT_EQ_INT(rv->rank_prefix[s], total);
      total += per_rank[s][d];
    }
    EXPECT_EQ_INT(rv->rank_prefix[R], total);
    EXPECT_EQ_INT(rv->num_recv, total);
    EXPECT_EQ_INT(epx_ref_dispatch_num_recv(w, d), total);
    for (int j = 0; j < L; j++) {
      int want = 0;
      for (int s = 0; s < R; s++) want += per_expert[s][d * L + j];
      EXPECTF(rv->num_recv_per_expert[j] == want, "rank %d expert %d: %d rows, layouts say %d", d,
              j, rv->num_recv_per_expert[j], want);
      const int a = rv->num_recv_per_expert_aligned[j];
      EXPECTF(a % align == 0 && a >= want && a < want + align, "aligned %d of %d to %d", a, want,
              align);
    }
    /* Rows: ordered by (source, token), at the layout's position, with the right ids, weights
     * and payload. */
    for (int i = 0; i < rv->num_recv; i++) {
      const int s = rv->src_rank[i], t = rv->src_token[i];
      EXPECT(s >= 0 && s < R && t >= 0 && t < w->ranks[s].num_tokens);
      if (i > 0)
        EXPECT(s > rv->src_rank[i - 1] || (s == rv->src_rank[i - 1] && t > rv->src_token[i - 1]));
      EXPECT_EQ_INT(in[s][t * R + d], 1);
      EXPECT_EQ_INT(i - rv->rank_prefix[s], pos[s][t * R + d]);
      for (int k = 0; k < K; k++) {
        const int64_t e = w->ranks[s].topk_idx[t * K + k];
        const int here = e >= 0 && e < E && e / L == d;
        EXPECT_EQ_INT(rv->topk_idx[i * K + k], here ? e - d * L : -1);
        EXPECT(rv->topk_weights[i * K + k] == (here ? w->ranks[s].topk_weights[t * K + k] : 0.0f));
      }
      EXPECT(memcmp(rv->x + (size_t)i * H, w->ranks[s].x + (size_t)t * H, sizeof(uint16_t) * H) ==
             0);
    }
  }
  /* Combine with identity experts. Unweighted: each token times the number of its ranks. Weighted
   * (float64): the same sum computed from the routing alone; BF16 within its rounding. */
  for (int s = 0; s < R; s++) {
    const int T = w->ranks[s].num_tokens;
    uint16_t *out = malloc(sizeof(uint16_t) * ((size_t)T * H + 1));
    double *out64 = malloc(sizeof(double) * ((size_t)T * H + 1));
    EXPECT(out && out64);
    EXPECT_EQ_INT(epx_ref_combine(w, s, y, NULL, out), 0);
    for (int t = 0; t < T; t++) {
      int n = 0;
      for (int d = 0; d < R; d++) n += in[s][t * R + d];
      for (int c = 0; c < H; c++) {
        const float v = fb(w->ranks[s].x[(size_t)t * H + c]);
        const float want = n == 0 ? 0.0f : (float)n * v; /* the sum starts at +0 */
        EXPECTF(out[(size_t)t * H + c] == bf(want), "rank %d token %d ch %d: %g, want %d x %g", s,
                t, c, fb(out[(size_t)t * H + c]), n, v);
      }
    }
    EXPECT_EQ_INT(epx_ref_combine(w, s, y, w->ranks[s].topk_weights, out), 0);
    EXPECT_EQ_INT(epx_ref_combine_f64(w, s, y, w->ranks[s].topk_weights, out64), 0);
    for (int t = 0; t < T; t++) {
      double want_factor[RW_MAX_R] = {0};
      for (int k = 0; k < K; k++) {
        const int64_t e = w->ranks[s].topk_idx[t * K + k];
        if (e >= 0 && e < E) want_factor[e / L] += (double)w->ranks[s].topk_weights[t * K + k];
      }
      for (int c = 0; c < H; c++) {
        const double v = fb(w->ranks[s].x[(size_t)t * H + c]);
        double want = 0.0;
        for (int d = 0; d < R; d++)
          if (in[s][t * R + d]) want += want_factor[d] * v;
        const double got64 = out64[(size_t)t * H + c], got = fb(out[(size_t)t * H + c]);
        EXPECTF(fabs(got64 - want) <= 1e-12 * fabs(want),
                "rank %d token %d ch %d: f64 %.17g, want %.17g", s, t, c, got64, want);
        EXPECTF(fabs(got - want) <= 0x1p-8 * fabs(want), "rank %d token %d ch %d: bf16 %g, f64 %g",
                s, t, c, got, want);
      }
    }
    free(out), free(out64);
  }
  for (int d = 0; d < R; d++) epx_ref_recv_free(&recv[d]);
  for (int s = 0; s < R; s++) free(per_expert[s]), free(pos[s]), free(in[s]);
  return TEST_PASS;
}

EPX_HOST_TEST(ref_random_normal_roundtrip, 60) {
  uint64_t rng = epx_test_seed() ^ 0x4E4F524D414Cull;
  for (int iter = 0; iter < 200; iter++) {
    rand_world_t rw;
    EXPECT(rand_world_init(&rw, &rng, 40, 1) == 0);
    const int r = check_normal_world(&rw, &rng);
    if (r != TEST_PASS)
      fprintf(stderr, "  world %d: R=%d E=%d K=%d H=%d\n", iter, rw.world.num_ranks,
              rw.world.num_experts, rw.world.top_k, rw.world.hidden);
    rand_world_free(&rw);
    if (r != TEST_PASS) return r;
  }
  return TEST_PASS;
}

/* One random world through low-latency dispatch (BF16 and FP8) and combine. */
static int check_ll_world(rand_world_t *rw, int M, int ue8m0) {
  const epx_ref_world_t *w = &rw->world;
  const int R = w->num_ranks, E = w->num_experts, K = w->top_k, H = w->hidden, L = E / R;
  const size_t cap = (size_t)R * M, G = (size_t)H / 128;
  /* Rows per expert, counted directly from the routing. */
  int *want_count = calloc(E, sizeof(int));
  EXPECT(want_count);
  int overflow[RW_MAX_R] = {0}, any_overflow = 0;
  for (int s = 0; s < R; s++)
    for (int i = 0; i < w->ranks[s].num_tokens * K; i++) {
      const int64_t e = w->ranks[s].topk_idx[i];
      if (e >= 0 && e < E && (size_t)++want_count[e] > cap) overflow[e / L] = any_overflow = 1;
    }
  if (any_overflow) {
    /* Exactly the ranks with an expert over R*M rows refuse, and write nothing. */
    epx_ref_set_quiet(1);
    for (int d = 0; d < R; d++) {
      int count[4] = {-7, -7, -7, -7};
      epx_ref_ll_recv_t out = {NULL, NULL, NULL, count, NULL, NULL, NULL, NULL, NULL};
      EXPECT_EQ_INT(epx_ref_ll_dispatch(w, d, M, ue8m0, &out), overflow[d] ? -1 : 0);
      if (overflow[d]) EXPECT(count[0] == -7);
    }
    epx_ref_set_quiet(0);
    free(want_count);
    return TEST_SKIP;
  }
  uint16_t *y[RW_MAX_R];
  for (int d = 0; d < R; d++) {
    uint16_t *x = malloc(sizeof(uint16_t) * L * cap * H);
    uint8_t *q = malloc(L * cap * H);
    float *sc = malloc(sizeof(float) * L * cap * G);
    int *count = malloc(sizeof(int) * L), *begin = malloc(sizeof(int) * L * R),
        *num = malloc(sizeof(int) * L * R);
    int *sr = malloc(sizeof(int) * L * cap), *st = malloc(sizeof(int) * L * cap),
        *sk = malloc(sizeof(int) * L * cap);
    uint8_t *want_q = malloc(H);
    float *want_s = malloc(sizeof(float) * G);
    EXPECT(x && q && sc && count && begin && num && sr && st && sk && want_q && want_s);
    memset(x, 0xAB, sizeof(uint16_t) * L * cap * H);
    memset(sr, 0xAB, sizeof(int) * L * cap);
    epx_ref_ll_recv_t out = {x, q, sc, count, begin, num, sr, st, sk};
    EXPECT_EQ_INT(epx_ref_ll_dispatch(w, d, M, ue8m0, &out), 0);
    y[d] = x;
    for (int j = 0; j < L; j++) {
      const int e = d * L + j;
      EXPECT_EQ_INT(count[j], want_count[e]);
      int sum = 0;
      for (int s = 0; s < R; s++) {
        EXPECT_EQ_INT(begin[j * R + s], sum);
        sum += num[j * R + s];
      }
      EXPECT_EQ_INT(sum, count[j]);
      for (size_t i = 0; i < cap; i++) {
        const size_t row = j * cap + i;
        if ((int)i >= count[j]) {
          EXPECTF(sr[row] == (int)0xABABABAB && x[row * H] == 0xABAB,
                  "row %zu beyond count written", i);
          continue;
        }
        const int s = sr[row], t = st[row], k = sk[row];
        EXPECT(s >= 0 && s < R && t >= 0 && t < w->ranks[s].num_tokens && k >= 0 && k < K);
        EXPECT((int)i >= begin[j * R + s] && (int)i < begin[j * R + s] + num[j * R + s]);
        EXPECT_EQ_INT(w->ranks[s].topk_idx[t * K + k], e);
        if (i > 0) {
          const size_t p = row - 1;
          EXPECT(s > sr[p] || (s == sr[p] && (t > st[p] || (t == st[p] && k > sk[p]))));
        }
        const uint16_t *src = w->ranks[s].x + (size_t)t * H;
        EXPECT(memcmp(x + row * H, src, sizeof(uint16_t) * H) == 0);
        EXPECT_EQ_INT(epx_ref_fp8_quantize(src, 1, H, ue8m0, want_q, want_s), 0);
        EXPECT(memcmp(q + row * H, want_q, H) == 0);
        EXPECT(memcmp(sc + row * G, want_s, sizeof(float) * G) == 0);
      }
    }
    free(q), free(sc), free(count), free(begin), free(num), free(sr), free(st), free(sk);
    free(want_q), free(want_s);
  }
  /* Combine with identity experts: sum over valid slots of w * x, from the routing alone. */
  for (int s = 0; s < R; s++) {
    const int T = w->ranks[s].num_tokens;
    uint16_t *out = malloc(sizeof(uint16_t) * ((size_t)T * H + 1));
    double *out64 = malloc(sizeof(double) * ((size_t)T * H + 1));
    EXPECT(out && out64);
    EXPECT_EQ_INT(
        epx_ref_ll_combine(w, s, M, (const uint16_t *const *)y, w->ranks[s].topk_weights, out), 0);
    EXPECT_EQ_INT(epx_ref_ll_combine_f64(w, s, M, (const uint16_t *const *)y,
                                         w->ranks[s].topk_weights, out64),
                  0);
    for (int t = 0; t < T; t++)
      for (int c = 0; c < H; c++) {
        const double v = fb(w->ranks[s].x[(size_t)t * H + c]);
        double want = 0.0;
        for (int k = 0; k < K; k++) {
          const int64_t e = w->ranks[s].topk_idx[t * K + k];
          if (e >= 0 && e < E) want += (double)w->ranks[s].topk_weights[t * K + k] * v;
        }
        const double got64 = out64[(size_t)t * H + c], got = fb(out[(size_t)t * H + c]);
        EXPECTF(fabs(got64 - want) <= 1e-12 * fabs(want),
                "rank %d token %d ch %d: f64 %.17g, want %.17g", s, t, c, got64, want);
        EXPECTF(fabs(got - want) <= 0x1p-8 * fabs(want), "rank %d token %d ch %d: bf16 %g, f64 %g",
                s, t, c, got, want);
      }
    free(out), free(out64);
  }
  for (int d = 0; d < R; d++) free(y[d]);
  free(want_count);
  return TEST_PASS;
}

EPX_HOST_TEST(ref_random_ll_roundtrip, 60) {
  uint64_t rng = epx_test_seed() ^ 0x4C4F574C4154ull;
  int checked = 0;
  for (int iter = 0; iter < 200; iter++) {
    rand_world_t rw;
    EXPECT(rand_world_init(&rw, &rng, 24, 1) == 0);
    /* M = the largest T (tight: repeated experts may overflow, which must be refused), or room
     * for every slot naming one expert (never overflows). */
    const int M = rw.max_tokens + (iter % 2 ? 0 : rw.max_tokens * (rw.world.top_k - 1)) +
                  (rw.max_tokens == 0);
    const int r = check_ll_world(&rw, M, iter % 3 == 0);
    if (r == TEST_FAIL)
      fprintf(stderr, "  world %d: R=%d E=%d K=%d H=%d M=%d\n", iter, rw.world.num_ranks,
              rw.world.num_experts, rw.world.top_k, rw.world.hidden, M);
    rand_world_free(&rw);
    if (r == TEST_FAIL) return r;
    checked += r == TEST_PASS;
  }
  EXPECTF(checked >= 100, "only %d of 200 worlds fit their capacity",
          checked); /* even ones always */
  return TEST_PASS;
}

/* ---------------------------------------------------------------------------------------------
 * Low-latency, EPX's fixed-slot layout.
 * ------------------------------------------------------------------------------------------- */

/* The hand world with M = 4: rows (src_rank, src_token, src_slot) at their fixed slots.
 * Rank 0: expert 0 <- (0,3,0) at 0, (1,0,1) at 4; expert 1 <- (0,0,0) at 0, (1,2,0) at 4 (token
 * (1,2) lists expert 1 twice: one row). Rank 1: expert 2 <- (0,0,1) at 0, (0,1,1) at 1,
 * (1,0,0) at 4; expert 3 <- (0,1,0) at 0, (1,1,1) at 4 (token (1,1) has the bad id 7 too). */
EPX_HOST_TEST(ref_ll_fixed_hand, 10) {
  hand_world_t h;
  hand_world_init(&h);
  const int want_count[2][LL_LOCAL] = {{2, 2}, {3, 2}};
  const int want_num[2][LL_LOCAL * HAND_R] = {{1, 1, 1, 1}, {2, 1, 1, 1}};
  /* [rank][expert][row] = (src_rank, src_token, src_slot), or -1 when not written */
  int want[2][LL_LOCAL][LL_ROWS][3];
  memset(want, 0xff, sizeof want);
  const int rows[][6] = {/* rank, j, row, s, t, k */
                         {0, 0, 0, 0, 3, 0}, {0, 0, 4, 1, 0, 1}, {0, 1, 0, 0, 0, 0},
                         {0, 1, 4, 1, 2, 0}, {1, 0, 0, 0, 0, 1}, {1, 0, 1, 0, 1, 1},
                         {1, 0, 4, 1, 0, 0}, {1, 1, 0, 0, 1, 0}, {1, 1, 4, 1, 1, 1}};
  for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++)
    for (int f = 0; f < 3; f++) want[rows[i][0]][rows[i][1]][rows[i][2]][f] = rows[i][3 + f];
  for (int d = 0; d < 2; d++) {
    uint16_t x[LL_LOCAL * LL_ROWS * HAND_H];
    int count[LL_LOCAL], begin[LL_LOCAL * HAND_R], num[LL_LOCAL * HAND_R];
    int src_rank[LL_LOCAL * LL_ROWS], src_token[LL_LOCAL * LL_ROWS], src_slot[LL_LOCAL * LL_ROWS];
    memset(x, 0xAB, sizeof x), memset(src_rank, 0xAB, sizeof src_rank);
    epx_ref_ll_recv_t out = {x, NULL, NULL, count, begin, num, src_rank, src_token, src_slot};
    EXPECT_EQ_INT(epx_ref_ll_dispatch_layout(&h.world, d, LL_M, 0, EPX_REF_LL_FIXED, &out), 0);
    for (int j = 0; j < LL_LOCAL; j++) {
      EXPECTF(count[j] == want_count[d][j], "rank %d count[%d] = %d", d, j, count[j]);
      for (int s = 0; s < HAND_R; s++) {
        EXPECT_EQ_INT(begin[j * HAND_R + s], s * LL_M);
        EXPECT_EQ_INT(num[j * HAND_R + s], want_num[d][j * HAND_R + s]);
      }
      for (int i = 0; i < LL_ROWS; i++) {
        const int row = j * LL_ROWS + i, *w = want[d][j][i];
        if (w[0] < 0) {
          EXPECTF(src_rank[row] == (int)0xABABABAB && x[row * 2] == 0xABAB,
                  "rank %d expert %d row %d outside the segments was written", d, j, i);
          continue;
        }
        EXPECTF(src_rank[row] == w[0] && src_token[row] == w[1] && src_slot[row] == w[2],
                "rank %d expert %d row %d = (%d,%d,%d), want (%d,%d,%d)", d, j, i, src_rank[row],
                src_token[row], src_slot[row], w[0], w[1], w[2]);
        const float v = (float)(10 * w[0] + w[1] + 1);
        EXPECTF(x[row * 2] == bf(v) && x[row * 2 + 1] == bf(-v), "rank %d expert %d row %d", d, j,
                i);
        EXPECT_EQ_INT(epx_ref_ll_row(&h.world, LL_M, w[0], w[1], d * LL_LOCAL + j), i);
      }
    }
  }
  EXPECT_EQ_INT(epx_ref_ll_row(&h.world, LL_M, 0, 2, 1), -1); /* token (0,2) lists nothing */

  /* Combine, y_d[j][i] = {64d + 8j + i, 64d + 8j + i + 0.5}: token (1,2) lists expert 1 (rank 0,
   * j = 1, row 4) twice with weights 0.25 and 0.5: 0.25*12 + 0.5*12 = 9, 0.75*12.5 = 9.375.
   * Token (1,1): expert 3 (rank 1, j 1, row 4 -> 76) with 0.25 -> 19, 19.125 (7 is invalid). */
  uint16_t y0[LL_LOCAL * LL_ROWS * HAND_H], y1[LL_LOCAL * LL_ROWS * HAND_H];
  for (int j = 0; j < LL_LOCAL; j++)
    for (int i = 0; i < LL_ROWS; i++)
      for (int c = 0; c < 2; c++) {
        y0[(j * LL_ROWS + i) * 2 + c] = bf((float)(8 * j + i) + 0.5f * c);
        y1[(j * LL_ROWS + i) * 2 + c] = bf((float)(64 + 8 * j + i) + 0.5f * c);
      }
  const uint16_t *y[2] = {y0, y1};
  uint16_t out[3 * HAND_H];
  double out64[3 * HAND_H];
  EXPECT_EQ_INT(epx_ref_ll_combine_layout(&h.world, 1, LL_M, EPX_REF_LL_FIXED, y, hand_w1, out), 0);
  EXPECT_EQ_INT(
      epx_ref_ll_combine_f64_layout(&h.world, 1, LL_M, EPX_REF_LL_FIXED, y, hand_w1, out64), 0);
  EXPECTF(out[4] == bf(9.0f) && out[5] == bf(9.375f), "token 2: %g %g", fb(out[4]), fb(out[5]));
  EXPECTF(out[2] == bf(19.0f) && out[3] == bf(19.125f), "token 1: %g %g", fb(out[2]), fb(out[3]));
  EXPECT(out64[4] == 9.0 && out64[5] == 9.375 && out64[2] == 19.0);
  /* Token (1,0): expert 2 (rank 1, j 0, row 4 -> 68) x 0.5 + expert 0 (rank 0, j 0, row 4 -> 4)
   * x 0.5 = 36, 36.5. */
  EXPECTF(out[0] == bf(36.0f) && out[1] == bf(36.5f), "token 0: %g %g", fb(out[0]), fb(out[1]));
  epx_ref_set_quiet(1);
  int count[LL_LOCAL];
  epx_ref_ll_recv_t bad = {NULL, NULL, NULL, count, NULL, NULL, NULL, NULL, NULL};
  EXPECT_EQ_INT(epx_ref_ll_dispatch_layout(&h.world, 0, LL_M, 0, (epx_ref_ll_layout_t)7, &bad), -1);
  epx_ref_set_quiet(0);
  return TEST_PASS;
}

/* Random worlds through the fixed layout: segments, order, payload, FP8, combine identity. */
EPX_HOST_TEST(ref_random_ll_fixed_roundtrip, 60) {
  uint64_t rng = epx_test_seed() ^ 0x46495845444cull;
  for (int iter = 0; iter < 200; iter++) {
    rand_world_t rw;
    EXPECT(rand_world_init(&rw, &rng, 24, 1) == 0);
    const epx_ref_world_t *w = &rw.world;
    const int R = w->num_ranks, E = w->num_experts, K = w->top_k, H = w->hidden, L = E / R;
    const int M = rw.max_tokens + (rw.max_tokens == 0), ue8m0 = iter % 2;
    const size_t cap = (size_t)R * M, G = (size_t)H / 128;
    uint16_t *y[RW_MAX_R];
    for (int d = 0; d < R; d++) {
      uint16_t *x = malloc(sizeof(uint16_t) * L * cap * H);
      uint8_t *q = malloc(L * cap * H), *want_q = malloc(H);
      float *sc = malloc(sizeof(float) * L * cap * G), *want_s = malloc(sizeof(float) * G);
      int *count = malloc(sizeof(int) * L), *begin = malloc(sizeof(int) * L * R);
      int *num = malloc(sizeof(int) * L * R), *sr = malloc(sizeof(int) * L * cap);
      int *st = malloc(sizeof(int) * L * cap), *sk = malloc(sizeof(int) * L * cap);
      EXPECT(x && q && want_q && sc && want_s && count && begin && num && sr && st && sk);
      memset(x, 0, sizeof(uint16_t) * L * cap * H);
      epx_ref_ll_recv_t out = {x, q, sc, count, begin, num, sr, st, sk};
      EXPECT_EQ_INT(epx_ref_ll_dispatch_layout(w, d, M, ue8m0, EPX_REF_LL_FIXED, &out), 0);
      for (int j = 0; j < L; j++) {
        const int e = d * L + j;
        int total = 0;
        for (int s = 0; s < R; s++) {
          /* num[j][s] = tokens of s listing e (once each), in ascending token order */
          int want_num = 0;
          for (int t = 0; t < w->ranks[s].num_tokens; t++) {
            int has = 0, first = -1;
            for (int k = 0; k < K; k++)
              if (w->ranks[s].topk_idx[t * K + k] == e) {
                has = 1;
                if (first < 0) first = k;
              }
            if (!has) continue;
            const size_t row = j * cap + (size_t)s * M + want_num;
            EXPECT(sr[row] == s && st[row] == t && sk[row] == first);
            EXPECT(memcmp(x + row * H, w->ranks[s].x + (size_t)t * H, sizeof(uint16_t) * H) == 0);
            EXPECT_EQ_INT(
                epx_ref_fp8_quantize(w->ranks[s].x + (size_t)t * H, 1, H, ue8m0, want_q, want_s),
                0);
            EXPECT(memcmp(q + row * H, want_q, H) == 0);
            EXPECT(memcmp(sc + row * G, want_s, sizeof(float) * G) == 0);
            EXPECT_EQ_INT(epx_ref_ll_row(w, M, s, t, e), s * M + want_num);
            want_num++;
          }
          EXPECT_EQ_INT(num[j * R + s], want_num);
          EXPECT_EQ_INT(begin[j * R + s], s * M);
          total += want_num;
        }
        EXPECT_EQ_INT(count[j], total);
      }
      y[d] = x;
      free(q), free(want_q), free(sc), free(want_s), free(count), free(begin), free(num);
      free(sr), free(st), free(sk);
    }
    /* Identity experts: out[t] = sum over valid slots of w * x[t]. */
    for (int s = 0; s < R; s++) {
      const int T = w->ranks[s].num_tokens;
      double *out64 = malloc(sizeof(double) * ((size_t)T * H + 1));
      EXPECT(out64);
      EXPECT_EQ_INT(
          epx_ref_ll_combine_f64_layout(w, s, M, EPX_REF_LL_FIXED, (const uint16_t *const *)y,
                                        w->ranks[s].topk_weights, out64),
          0);
      for (int t = 0; t < T; t++)
        for (int c = 0; c < H; c++) {
          double want = 0.0;
          for (int k = 0; k < K; k++) {
            const int64_t e = w->ranks[s].topk_idx[t * K + k];
            if (e >= 0 && e < E)
              want += (double)w->ranks[s].topk_weights[t * K + k] * fb(w->ranks[s].x[t * H + c]);
          }
          EXPECTF(fabs(out64[(size_t)t * H + c] - want) <= 1e-12 * fabs(want), "rank %d token %d",
                  s, t);
        }
      free(out64);
    }
    for (int d = 0; d < R; d++) free(y[d]);
    rand_world_free(&rw);
  }
  return TEST_PASS;
}

/*
 * test_ref_expand.c - the expert-major layout's oracle (tests/ref/epx_ref_expand.h) against
 * hand-computed answers and against the normal-mode oracle it is defined from.
 *
 *   ref_expand_hand                      two ranks, duplicates, -1 and a bad id: every row,
 *                                        its source, slot, weight and padding, by hand
 *   ref_expand_random_matches_dispatch   random and adversarial worlds (one expert, all
 *                                        empty, an empty rank, duplicates, bad ids; R 1-8,
 *                                        alignment 1/4/128): each (token, expert) once, in its
 *                                        expert's segment, in dispatch order, payload copied
 *   ref_combine_expand_random            the expanded combine equals epx_ref_combine of the
 *                                        expert side's BF16 partial rows, bit for bit, and its
 *                                        float64 sum the per-token definition, exactly (dyadic
 *                                        values keep every sum exact)
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/runner.h"
#include "ref/epx_ref.h"
#include "ref/epx_ref_expand.h"

static uint16_t bf16(float f) {
  return epx_ref_bf16_from_float(f);
}

/* Rank 0: t0 {1, 2}, t1 {3, -1}, t2 {2, 2}. Rank 1: t0 {0, 3}, t1 {-1, -1}, t2 {5 (bad), 1}.
 * E = 4, R = 2: rank 0 hosts experts 0, 1; rank 1 hosts 2, 3. x of token t of rank s: every
 * channel 10 s + t. */
EPX_HOST_TEST(ref_expand_hand, 10) {
  enum { K = 2, H = 8 };
  const int64_t idx0[3 * K] = {1, 2, 3, -1, 2, 2}, idx1[3 * K] = {0, 3, -1, -1, 5, 1};
  const float w0[3 * K] = {0.5f, 0.25f, 1.0f, 0.0f, 0.5f, 0.125f};
  const float w1[3 * K] = {0.75f, 0.25f, 0.0f, 0.0f, 2.0f, 4.0f};
  uint16_t x0[3 * H], x1[3 * H];
  for (int t = 0; t < 3; t++)
    for (int c = 0; c < H; c++) x0[t * H + c] = bf16((float)t), x1[t * H + c] = bf16(10.0f + t);
  const epx_ref_rank_t ranks[2] = {{3, idx0, w0, x0, NULL, NULL}, {3, idx1, w1, x1, NULL, NULL}};
  const epx_ref_world_t w = {2, 4, K, H, ranks};

  /* Rank 1, alignment 4: expert 2 (local 0) <- (0, t0, slot 1, 0.25), (0, t2, slot 0, 0.5 +
   * 0.125); expert 3 (local 1) <- (0, t1, slot 0, 1.0), (1, t0, slot 1, 0.25). */
  epx_ref_expand_t e;
  EXPECT_EQ_INT(epx_ref_dispatch_expand(&w, 1, EPX_REF_PAYLOAD_BF16, 4, &e), 0);
  EXPECT_EQ_INT(e.num_local_experts, 2);
  EXPECT_EQ_INT(e.num_rows, 8);
  EXPECT(e.begin[0] == 0 && e.begin[1] == 4 && e.begin[2] == 8);
  EXPECT(e.count[0] == 2 && e.count[1] == 2);
  const int src1[8] = {0, 0, -1, -1, 0, 1, -1, -1}, tok1[8] = {0, 2, -1, -1, 1, 0, -1, -1};
  const int slot1[8] = {1, 0, -1, -1, 0, 1, -1, -1};
  const float wt1[8] = {0.25f, 0.625f, 0, 0, 1.0f, 0.25f, 0, 0};
  for (int i = 0; i < 8; i++) {
    EXPECTF(e.src_rank[i] == src1[i] && e.src_token[i] == tok1[i] && e.src_slot[i] == slot1[i] &&
                e.weight[i] == wt1[i],
            "rank 1 row %d: (%d, %d, %d, %g)", i, e.src_rank[i], e.src_token[i], e.src_slot[i],
            e.weight[i]);
    const float want = src1[i] < 0 ? 0.0f : (float)(10 * src1[i] + tok1[i]);
    EXPECTF(e.x[(size_t)i * H + H - 1] == bf16(want), "rank 1 row %d payload", i);
  }
  epx_ref_expand_free(&e);

  /* Rank 0, alignment 1: expert 0 <- (1, t0, slot 0, 0.75); expert 1 <- (0, t0, slot 0, 0.5),
   * (1, t2, slot 1, 4.0): the bad id of slot 0 is an empty slot. */
  EXPECT_EQ_INT(epx_ref_dispatch_expand(&w, 0, EPX_REF_PAYLOAD_NONE, 1, &e), 0);
  EXPECT_EQ_INT(e.num_rows, 3);
  EXPECT(e.begin[1] == 1 && e.begin[2] == 3 && e.x == NULL);
  const int src0[3] = {1, 0, 1}, tok0[3] = {0, 0, 2}, slot0[3] = {0, 0, 1};
  const float wt0[3] = {0.75f, 0.5f, 4.0f};
  for (int i = 0; i < 3; i++)
    EXPECTF(e.src_rank[i] == src0[i] && e.src_token[i] == tok0[i] && e.src_slot[i] == slot0[i] &&
                e.weight[i] == wt0[i],
            "rank 0 row %d", i);
  epx_ref_expand_free(&e);

  /* Combine of rank 0's tokens, y = 1 on rank 0's rows, 2 on rank 1's: t0 = 0.5 x 1 (rank 0)
   * + 0.25 x 2 (rank 1) = 1; t1 = 1.0 x 2 = 2; t2 = 0.625 x 2 = 1.25. */
  uint16_t ya[8 * H], yb[8 * H], out[3 * H]; /* alignment 4: 8 rows on each rank */
  for (int i = 0; i < 8 * H; i++) ya[i] = bf16(1.0f);
  for (int i = 0; i < 8 * H; i++) yb[i] = bf16(2.0f);
  const uint16_t *y[2] = {ya, yb};
  double out64[3 * H];
  EXPECT_EQ_INT(epx_ref_combine_expand(&w, 0, 4, y, 1, out, out64), 0);
  const float want0[3] = {1.0f, 2.0f, 1.25f};
  for (int t = 0; t < 3; t++)
    EXPECTF(out[t * H] == bf16(want0[t]) && out64[t * H] == want0[t], "token %d: %g", t,
            (double)epx_ref_bf16_to_float(out[t * H]));
  /* Unweighted: t2 lists expert 2 twice but has one row: 2. */
  EXPECT_EQ_INT(epx_ref_combine_expand(&w, 0, 4, y, 0, out, NULL), 0);
  EXPECT(out[0] == bf16(3.0f) && out[H] == bf16(2.0f) && out[2 * H] == bf16(2.0f));
  /* Refusals. */
  epx_ref_set_quiet(1);
  EXPECT_EQ_INT(epx_ref_dispatch_expand(&w, 2, EPX_REF_PAYLOAD_NONE, 1, &e), -1);
  epx_ref_expand_free(&e);
  EXPECT_EQ_INT(epx_ref_dispatch_expand(&w, 0, EPX_REF_PAYLOAD_NONE, 0, &e), -1);
  epx_ref_expand_free(&e);
  epx_ref_set_quiet(0);
  return TEST_PASS;
}

/* ---------------------------------------------------------------------------------------------
 * Random and adversarial worlds.
 * ------------------------------------------------------------------------------------------- */

enum { ROUTE_RANDOM, ROUTE_ONE_EXPERT, ROUTE_ALL_EMPTY, ROUTE_DUPLICATES, NUM_ROUTES };

typedef struct {
  epx_ref_rank_t ranks[8];
  epx_ref_world_t world;
  int64_t *idx[8];
  float *w[8];
  uint16_t *x[8];
} world_t;

/* R in {1, 2, 4, 8}, E = R x (1..4), K 1..6, H 128, T_r in 0..40 (one rank empty at times),
 * weights in {1/4, 1/2, 1, 2} and x in {-4, ..., 4}: every sum of the combine is exact. */
static int make_world(world_t *m, uint64_t *rng, int route) {
  memset(m, 0, sizeof *m);
  const int R = 1 << epx_test_rand_int(rng, 4), E = R * (1 + epx_test_rand_int(rng, 4));
  const int K = 1 + epx_test_rand_int(rng, 6), H = 128;
  const int empty_rank = epx_test_rand_int(rng, 3) == 0 ? epx_test_rand_int(rng, R) : -1;
  for (int r = 0; r < R; r++) {
    const int T = r == empty_rank ? 0 : epx_test_rand_int(rng, 41);
    m->idx[r] = malloc(sizeof(int64_t) * ((size_t)T * K + 1));
    m->w[r] = malloc(sizeof(float) * ((size_t)T * K + 1));
    m->x[r] = malloc(sizeof(uint16_t) * ((size_t)T * H + 1));
    if (!m->idx[r] || !m->w[r] || !m->x[r]) return -1;
    for (int i = 0; i < T * K; i++) {
      const int p = epx_test_rand_int(rng, 100);
      int64_t e = epx_test_rand_int(rng, E);
      if (route == ROUTE_ONE_EXPERT) e = 0;
      if (route == ROUTE_ALL_EMPTY || p < 12) e = -1;
      if (route == ROUTE_RANDOM && p >= 12 && p < 15) e = p == 12 ? E : -2; /* bad ids */
      if (route == ROUTE_DUPLICATES && i % K) e = m->idx[r][i - 1];
      m->idx[r][i] = e;
      m->w[r][i] = 0.25f * (float)(1 << epx_test_rand_int(rng, 4));
    }
    for (int i = 0; i < T * H; i++) m->x[r][i] = bf16((float)(epx_test_rand_int(rng, 9) - 4));
    m->ranks[r] = (epx_ref_rank_t){T, m->idx[r], m->w[r], m->x[r], NULL, NULL};
  }
  m->world = (epx_ref_world_t){R, E, K, H, m->ranks};
  return 0;
}

static void free_world(world_t *m) {
  for (int r = 0; r < 8; r++) free(m->idx[r]), free(m->w[r]), free(m->x[r]);
}

/* The expanded rows of d against the normal dispatch and the world itself. */
static int check_expand(const world_t *m, int d, int align, const char *label) {
  const epx_ref_world_t *w = &m->world;
  const int K = w->top_k, H = w->hidden, E = w->num_experts, L = E / w->num_ranks;
  epx_ref_recv_t r;
  epx_ref_expand_t e;
  EXPECT_EQ_INT(epx_ref_dispatch(w, d, EPX_REF_PAYLOAD_BF16, align, &r), 0);
  EXPECT_EQ_INT(epx_ref_dispatch_expand(w, d, EPX_REF_PAYLOAD_BF16, align, &e), 0);
  EXPECT_EQ_INT(e.num_local_experts, L);
  EXPECT_EQ_INT(e.begin[0], 0);
  long long pairs = 0; /* distinct (token, expert of d) pairs in the world */
  for (int s = 0; s < w->num_ranks; s++)
    for (int t = 0; t < w->ranks[s].num_tokens; t++)
      for (int j = 0; j < L; j++) {
        int has = 0;
        for (int k = 0; k < K; k++) has |= w->ranks[s].topk_idx[(size_t)t * K + k] == d * L + j;
        pairs += has;
      }
  long long rows = 0;
  for (int j = 0; j < L; j++) {
    EXPECTF(e.count[j] == r.num_recv_per_expert[j], "%s: rank %d expert %d: %d rows, dispatch %d",
            label, d, j, e.count[j], r.num_recv_per_expert[j]);
    EXPECTF(
        e.begin[j + 1] - e.begin[j] == r.num_recv_per_expert_aligned[j] && e.begin[j] % align == 0,
        "%s: rank %d expert %d: segment [%d, %d)", label, d, j, e.begin[j], e.begin[j + 1]);
    int prev = -1; /* dispatch row of the previous real row: strictly ascending */
    for (int i = e.begin[j]; i < e.begin[j + 1]; i++) {
      const int real = i < e.begin[j] + e.count[j];
      if (!real) {
        EXPECTF(e.src_rank[i] == -1 && e.src_token[i] == -1 && e.src_slot[i] == -1 &&
                    e.weight[i] == 0.0f && e.x[(size_t)i * H] == 0,
                "%s: rank %d row %d: padding not empty", label, d, i);
        continue;
      }
      rows++;
      const int s = e.src_rank[i], t = e.src_token[i], k = e.src_slot[i];
      EXPECTF(s >= 0 && s < w->num_ranks && t >= 0 && t < w->ranks[s].num_tokens && k >= 0 && k < K,
              "%s: rank %d row %d: source (%d, %d, %d)", label, d, i, s, t, k);
      const int64_t *idx = w->ranks[s].topk_idx + (size_t)t * K;
      EXPECTF(idx[k] == d * L + j, "%s: rank %d row %d: slot %d holds expert %lld, not %d", label,
              d, i, k, (long long)idx[k], d * L + j);
      float want_w = 0.0f;
      for (int q = 0; q < K; q++) {
        EXPECTF(q >= k || idx[q] != idx[k], "%s: rank %d row %d: slot %d is not the first", label,
                d, i, k);
        if (idx[q] == idx[k]) want_w = want_w + w->ranks[s].topk_weights[(size_t)t * K + q];
      }
      EXPECTF(e.weight[i] == want_w, "%s: rank %d row %d: weight %g, want %g", label, d, i,
              e.weight[i], want_w);
      EXPECT(memcmp(e.x + (size_t)i * H, w->ranks[s].x + (size_t)t * H, sizeof(uint16_t) * H) == 0);
      int at = -1; /* the same token in the dispatch's order */
      for (int q = r.rank_prefix[s]; q < r.rank_prefix[s + 1] && at < 0; q++)
        if (r.src_token[q] == t) at = q;
      EXPECTF(at > prev, "%s: rank %d row %d: out of dispatch order", label, d, i);
      prev = at;
    }
  }
  EXPECTF(rows == pairs, "%s: rank %d: %lld rows for %lld (token, expert) pairs", label, d, rows,
          pairs);
  epx_ref_recv_free(&r);
  epx_ref_expand_free(&e);
  return TEST_PASS;
}

EPX_HOST_TEST(ref_expand_random_matches_dispatch, 60) {
  uint64_t rng = epx_test_seed();
  const int aligns[3] = {1, 4, 128};
  for (int round = 0; round < 120; round++) {
    world_t m;
    const int route = round % NUM_ROUTES;
    EXPECT_EQ_INT(make_world(&m, &rng, route), 0);
    char label[64];
    snprintf(label, sizeof label, "round %d (route %d, R %d)", round, route, m.world.num_ranks);
    for (int d = 0; d < m.world.num_ranks; d++)
      if (check_expand(&m, d, aligns[(round / NUM_ROUTES) % 3], label) != TEST_PASS) {
        free_world(&m);
        return TEST_FAIL;
      }
    free_world(&m);
  }
  return TEST_PASS;
}

/* y of rank d's expanded row i: a value in {-4, ..., 4} from (d, i, c). */
static uint16_t *expert_outputs(const epx_ref_world_t *w, int d, int align, int *num_rows) {
  epx_ref_expand_t e;
  if (epx_ref_dispatch_expand(w, d, EPX_REF_PAYLOAD_NONE, align, &e) != 0) return NULL;
  const int H = w->hidden;
  uint16_t *y = malloc(sizeof(uint16_t) * ((size_t)e.num_rows * H + 1));
  for (int i = 0; y && i < e.num_rows; i++)
    for (int c = 0; c < H; c++) y[(size_t)i * H + c] = bf16((float)((d * 7 + i * 3 + c) % 9 - 4));
  *num_rows = e.num_rows;
  epx_ref_expand_free(&e);
  return y;
}

/* The rows rank d sends home in the normal layout: per dispatch row (token on d), the BF16 sum
 * of its expanded rows times their weights, in expert order. */
static uint16_t *partial_rows(const epx_ref_world_t *w, int d, int align, const uint16_t *y) {
  epx_ref_recv_t r;
  epx_ref_expand_t e;
  const int H = w->hidden;
  if (epx_ref_dispatch(w, d, EPX_REF_PAYLOAD_NONE, align, &r) != 0 ||
      epx_ref_dispatch_expand(w, d, EPX_REF_PAYLOAD_NONE, align, &e) != 0)
    return NULL;
  uint16_t *rows = malloc(sizeof(uint16_t) * ((size_t)r.num_recv * H + 1));
  float *acc = malloc(sizeof(float) * ((size_t)H + 1));
  for (int q = 0; rows && acc && q < r.num_recv; q++) {
    for (int c = 0; c < H; c++) acc[c] = 0.0f;
    for (int i = 0; i < e.num_rows; i++)
      if (e.src_rank[i] == r.src_rank[q] && e.src_token[i] == r.src_token[q])
        for (int c = 0; c < H; c++) {
          volatile float p = e.weight[i] * epx_ref_bf16_to_float(y[(size_t)i * H + c]);
          acc[c] = acc[c] + p;
        }
    for (int c = 0; c < H; c++) rows[(size_t)q * H + c] = bf16(acc[c]);
  }
  free(acc);
  epx_ref_recv_free(&r);
  epx_ref_expand_free(&e);
  return rows;
}

EPX_HOST_TEST(ref_combine_expand_random, 60) {
  uint64_t rng = epx_test_seed() ^ 0x5eedull;
  for (int round = 0; round < 60; round++) {
    world_t m;
    EXPECT_EQ_INT(make_world(&m, &rng, round % NUM_ROUTES), 0);
    const epx_ref_world_t *w = &m.world;
    const int R = w->num_ranks, H = w->hidden, K = w->top_k;
    const int align = round % 3 == 0 ? 1 : 4 << (round % 3);
    uint16_t *y[8] = {0}, *part[8] = {0};
    int num_rows[8] = {0};
    epx_ref_expand_t ex[8];
    memset(ex, 0, sizeof ex);
    for (int d = 0; d < R; d++) {
      y[d] = expert_outputs(w, d, align, &num_rows[d]);
      part[d] = partial_rows(w, d, align, y[d]);
      EXPECT(y[d] && part[d]);
      EXPECT_EQ_INT(epx_ref_dispatch_expand(w, d, EPX_REF_PAYLOAD_NONE, align, &ex[d]), 0);
    }
    for (int s = 0; s < R; s++) {
      const int T = w->ranks[s].num_tokens;
      uint16_t *got = malloc(sizeof(uint16_t) * ((size_t)T * H + 1));
      uint16_t *want = malloc(sizeof(uint16_t) * ((size_t)T * H + 1));
      double *got64 = malloc(sizeof(double) * ((size_t)T * H + 1));
      EXPECT(got && want && got64);
      EXPECT_EQ_INT(epx_ref_combine_expand(w, s, align, (const uint16_t *const *)y, 1, got, got64),
                    0);
      EXPECT_EQ_INT(epx_ref_combine(w, s, (const uint16_t *const *)part, NULL, want), 0);
      EXPECTF(memcmp(got, want, sizeof(uint16_t) * T * H) == 0,
              "round %d rank %d: expanded combine differs from the normal combine of its partial "
              "rows",
              round, s);
      /* Per-token definition in float64, channel 0: every (token, expert) once, times the
       * weights of the slots listing that expert (from the world, not from the rows). */
      for (int t = 0; t < T; t++) {
        const int64_t *idx = w->ranks[s].topk_idx + (size_t)t * K;
        double sum = 0.0;
        for (int d = 0; d < R; d++)
          for (int i = 0; i < ex[d].num_rows; i++) {
            if (ex[d].src_rank[i] != s || ex[d].src_token[i] != t) continue;
            const int64_t expert = idx[ex[d].src_slot[i]];
            double wsum = 0.0;
            for (int k = 0; k < K; k++)
              if (idx[k] == expert) wsum += w->ranks[s].topk_weights[(size_t)t * K + k];
            sum += wsum * epx_ref_bf16_to_float(y[d][(size_t)i * H]);
          }
        EXPECTF(got64[(size_t)t * H] == sum, "round %d rank %d token %d: %g, want %g", round, s, t,
                got64[(size_t)t * H], sum);
      }
      free(got), free(want), free(got64);
    }
    for (int d = 0; d < R; d++) free(y[d]), free(part[d]), epx_ref_expand_free(&ex[d]);
    free_world(&m);
  }
  return TEST_PASS;
}

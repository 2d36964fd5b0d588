/*
 * test_ref_dispatch_extras.c - host tests of the reference's DeepEP-parity dispatch options
 * (tests/ref/epx_ref.h, last section): rank-mask routing, the rank prefix matrix, worst-case
 * rows, strided scales and UE8M0 packing.
 *
 * The hand world (R = 2, E = 4, K = 2, H = 2 BF16; rank 0 hosts experts 0, 1):
 *   rank 0, T = 3: masks [1 0] [1 1] [0 0]   tokens_per_expert [1 2 0 3]
 *   rank 1, T = 2: masks [0 5] [1 0]         tokens_per_expert [4 0 1 1]   (5: nonzero = sent)
 * Rank 0 receives (0,0) (0,1) (1,1); rank 1 receives (0,1) (1,0).
 */
#include <stdlib.h>
#include <string.h>

#include "common/runner.h"
#include "ref/epx_ref.h"

typedef struct {
  int64_t ids[2][6];
  uint16_t x[2][6];
  epx_ref_rank_t ranks[2];
  epx_ref_world_t world;
  uint8_t mask0[6], mask1[4];
  const uint8_t *masks[2];
  int tpe0[4], tpe1[4];
  const int *tpe[2];
} mask_world_t;

static void mask_world_init(mask_world_t *m) {
  memset(m, 0, sizeof *m);
  const uint8_t mask0[6] = {1, 0, 1, 1, 0, 0}, mask1[4] = {0, 5, 1, 0};
  const int tpe0[4] = {1, 2, 0, 3}, tpe1[4] = {4, 0, 1, 1};
  memcpy(m->mask0, mask0, sizeof mask0), memcpy(m->mask1, mask1, sizeof mask1);
  memcpy(m->tpe0, tpe0, sizeof tpe0), memcpy(m->tpe1, tpe1, sizeof tpe1);
  const int T[2] = {3, 2};
  for (int s = 0; s < 2; s++) {
    for (int i = 0; i < 6; i++) m->ids[s][i] = 3; /* ids are not read by a mask dispatch */
    for (int t = 0; t < T[s]; t++) {
      const float v = (float)(10 * s + t + 1);
      m->x[s][2 * t] = epx_ref_bf16_from_float(v);
      m->x[s][2 * t + 1] = epx_ref_bf16_from_float(-v);
    }
    m->ranks[s].num_tokens = T[s];
    m->ranks[s].topk_idx = m->ids[s];
    m->ranks[s].x = m->x[s];
  }
  m->world.num_ranks = 2, m->world.num_experts = 4, m->world.top_k = 2, m->world.hidden = 2;
  m->world.ranks = m->ranks;
  m->masks[0] = m->mask0, m->masks[1] = m->mask1;
  m->tpe[0] = m->tpe0, m->tpe[1] = m->tpe1;
}

EPX_HOST_TEST(ref_dispatch_mask_hand, 10) {
  mask_world_t m;
  mask_world_init(&m);
  epx_ref_recv_t r;
  EXPECT_EQ_INT(epx_ref_dispatch_mask(&m.world, m.masks, m.tpe, 0, EPX_REF_PAYLOAD_BF16, 4, &r), 0);
  EXPECT_EQ_INT(r.num_recv, 3);
  const int src_rank0[3] = {0, 0, 1}, src_token0[3] = {0, 1, 1}, prefix0[3] = {0, 2, 3};
  for (int i = 0; i < 3; i++) {
    EXPECT_EQ_INT(r.src_rank[i], src_rank0[i]);
    EXPECT_EQ_INT(r.src_token[i], src_token0[i]);
    EXPECT(epx_ref_bf16_to_float(r.x[2 * i]) == (float)(10 * src_rank0[i] + src_token0[i] + 1));
    EXPECT(r.topk_idx[2 * i] == -1 && r.topk_idx[2 * i + 1] == -1);
    EXPECT(r.topk_weights[2 * i] == 0.f && r.topk_weights[2 * i + 1] == 0.f);
  }
  for (int s = 0; s < 3; s++) EXPECT_EQ_INT(r.rank_prefix[s], prefix0[s]);
  EXPECT_EQ_INT(r.num_recv_per_expert[0], 5);
  EXPECT_EQ_INT(r.num_recv_per_expert[1], 2);
  EXPECT_EQ_INT(r.num_recv_per_expert_aligned[0], 8);
  EXPECT_EQ_INT(r.num_recv_per_expert_aligned[1], 4);
  epx_ref_recv_free(&r);
  EXPECT_EQ_INT(epx_ref_dispatch_mask(&m.world, m.masks, m.tpe, 1, EPX_REF_PAYLOAD_BF16, 1, &r), 0);
  EXPECT_EQ_INT(r.num_recv, 2);
  EXPECT(r.src_rank[0] == 0 && r.src_token[0] == 1 && r.src_rank[1] == 1 && r.src_token[1] == 0);
  EXPECT_EQ_INT(r.num_recv_per_expert[0], 1);
  EXPECT_EQ_INT(r.num_recv_per_expert[1], 4);
  epx_ref_recv_free(&r);
  /* Refusals: no counts, a missing mask. */
  const int prev = epx_ref_set_quiet(1);
  EXPECT(epx_ref_dispatch_mask(&m.world, m.masks, NULL, 0, EPX_REF_PAYLOAD_BF16, 1, &r) == -1);
  epx_ref_recv_free(&r);
  const uint8_t *missing[2] = {m.mask0, NULL};
  EXPECT(epx_ref_dispatch_mask(&m.world, missing, m.tpe, 0, EPX_REF_PAYLOAD_BF16, 1, &r) == -1);
  epx_ref_recv_free(&r);
  epx_ref_set_quiet(prev);
  return TEST_PASS;
}

EPX_HOST_TEST(ref_rank_prefix_matrix_hand, 10) {
  mask_world_t m;
  mask_world_init(&m);
  int p[4];
  EXPECT_EQ_INT(epx_ref_rank_prefix_matrix(&m.world, m.masks, p), 0);
  const int want[4] = {2, 1, 3, 2}; /* [0][0], [0][1], [1][0], [1][1] */
  for (int i = 0; i < 4; i++) EXPECT_EQ_INT(p[i], want[i]);
  return TEST_PASS;
}

/* On random worlds: the masks of epx_ref_layout with its expert counts give, through the mask
 * dispatch, the same rows and counts as the dispatch by ids; the prefix matrix by ids equals the
 * one by masks and ends in each rank's receive count. */
EPX_HOST_TEST(ref_mask_dispatch_matches_ids, 60) {
  uint64_t rng = 12345;
  for (int it = 0; it < 50; it++) {
    const int R = 2 + epx_test_rand_int(&rng, 3), L = 1 + epx_test_rand_int(&rng, 4), E = R * L;
    const int K = 1 + epx_test_rand_int(&rng, 4), H = 8;
    epx_ref_rank_t ranks[4];
    int64_t *ids[4];
    uint16_t *x[4];
    uint8_t *masks[4];
    int *tpe[4];
    for (int s = 0; s < R; s++) {
      const int T = it % 5 == 0 && s == 1 ? 0 : epx_test_rand_int(&rng, 40);
      ids[s] = malloc(sizeof(int64_t) * (T * K + 1));
      x[s] = malloc(2 * (T * H + 1));
      masks[s] = malloc(T * R + 1);
      tpe[s] = malloc(sizeof(int) * E);
      for (int i = 0; i < T * K; i++)
        ids[s][i] = epx_test_rand_int(&rng, 4) == 0 ? -1 : epx_test_rand_int(&rng, E);
      for (int i = 0; i < T * H; i++) x[s][i] = (uint16_t)epx_test_rand_int(&rng, 0x7f00);
      memset(&ranks[s], 0, sizeof ranks[s]);
      ranks[s].num_tokens = T, ranks[s].topk_idx = ids[s], ranks[s].x = x[s];
      EXPECT(epx_ref_layout(ids[s], T, K, E, R, NULL, tpe[s], masks[s], NULL) == -1);
    }
    epx_ref_world_t w = {R, E, K, H, ranks};
    int p_ids[16], p_mask[16];
    EXPECT_EQ_INT(epx_ref_rank_prefix_matrix(&w, NULL, p_ids), 0);
    EXPECT_EQ_INT(epx_ref_rank_prefix_matrix(&w, (const uint8_t *const *)masks, p_mask), 0);
    for (int d = 0; d < R; d++) {
      epx_ref_recv_t a, b;
      EXPECT_EQ_INT(epx_ref_dispatch(&w, d, EPX_REF_PAYLOAD_BF16, 1, &a), 0);
      EXPECT_EQ_INT(epx_ref_dispatch_mask(&w, (const uint8_t *const *)masks,
                                          (const int *const *)tpe, d, EPX_REF_PAYLOAD_BF16, 1, &b),
                    0);
      EXPECT_EQ_INT(a.num_recv, b.num_recv);
      EXPECT_EQ_INT(p_ids[(R - 1) * R + d], a.num_recv);
      for (int i = 0; i < a.num_recv; i++)
        EXPECT(a.src_rank[i] == b.src_rank[i] && a.src_token[i] == b.src_token[i]);
      EXPECT(memcmp(a.x, b.x, (size_t)a.num_recv * H * 2) == 0);
      for (int j = 0; j < L; j++) EXPECT_EQ_INT(a.num_recv_per_expert[j], b.num_recv_per_expert[j]);
      epx_ref_recv_free(&a), epx_ref_recv_free(&b);
    }
    for (int i = 0; i < R * R; i++) EXPECT_EQ_INT(p_ids[i], p_mask[i]);
    for (int s = 0; s < R; s++) free(ids[s]), free(x[s]), free(masks[s]), free(tpe[s]);
  }
  return TEST_PASS;
}

EPX_HOST_TEST(ref_worst_topk_idx, 10) {
  int64_t idx[4] = {0, -1, 1, 1};
  epx_ref_recv_t r;
  memset(&r, 0, sizeof r);
  r.num_recv = 2, r.topk_idx = idx;
  int64_t out[8];
  EXPECT_EQ_INT(epx_ref_worst_topk_idx(&r, 2, 4, out), 0);
  const int64_t want[8] = {0, -1, 1, 1, -1, -1, -1, -1};
  for (int i = 0; i < 8; i++) EXPECT(out[i] == want[i]);
  const int prev = epx_ref_set_quiet(1);
  EXPECT(epx_ref_worst_topk_idx(&r, 2, 1, out) == -1); /* fewer rows than received */
  epx_ref_set_quiet(prev);
  return TEST_PASS;
}

EPX_HOST_TEST(ref_scales_strided_and_packed, 10) {
  /* Two tokens, five groups: 2^-3, 1, 2, 0.5, 4 and their doubles. */
  const float sc[10] = {0.125f, 1.f, 2.f, 0.5f, 4.f, 0.25f, 2.f, 4.f, 1.f, 8.f};
  int32_t packed[4];
  EXPECT_EQ_INT(epx_ref_ue8m0_pack(sc, 2, 5, packed), 0);
  EXPECT((uint32_t)packed[0] == 0x7e807f7cu); /* bytes 7c 7f 80 7e: groups 0..3, low first */
  EXPECT((uint32_t)packed[1] == 0x81u);       /* group 4, then zero bytes */
  EXPECT((uint32_t)packed[2] == 0x7f81807du);
  EXPECT((uint32_t)packed[3] == 0x82u);
  /* Column-major [2, 5]: element (t, g) at g * 2 + t. */
  float cm[10];
  EXPECT_EQ_INT(epx_ref_scales_strided(sc, 2, 5, 1, 2, cm), 0);
  for (int t = 0; t < 2; t++)
    for (int g = 0; g < 5; g++) EXPECT(cm[g * 2 + t] == sc[t * 5 + g]);
  const int prev = epx_ref_set_quiet(1);
  EXPECT(epx_ref_scales_strided(sc, 2, 5, 0, 2, cm) == -1);
  epx_ref_set_quiet(prev);
  return TEST_PASS;
}

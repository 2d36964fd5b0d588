/*
 * test_layout_one_gpu.c - the layout kernel on one GPU with no group (EPX_ONE_GPU_TEST): launched
 * through epx__layout_launch on a group-free context (one_gpu_ctx.c) and compared, output by
 * output, with the CPU reference (tests/ref), every output poisoned before each call (one
 * element past each end included, which must stay poisoned).
 *
 * Every shape T x R x E x K x id width below, with every routing, on fresh random data from the
 * test's seed (printed with any failure):
 *   T in {4096, 1, 65536, 0, 511, 513, 512, 4095}: 0, 1 and 8 tiles and the edges of one tile,
 *     in an order where a call with fewer tiles follows one with more and the other way round
 *   R in {2, 4, 8}, E in {16, 256}, K in {1, 8}, int64 and int32 ids
 *
 *   routing      what each token's K slots hold
 *   uniform      K distinct experts, uniform
 *   one_expert   every slot of every token = one expert (K repeats; one rank gets everything)
 *   dups         uniform, then each slot repeats an earlier slot of its token with p = 1/3
 *   holes        uniform, then each slot -1 with p = 1/4 (tokens with every slot -1 included)
 *   skip_rank    uniform over the experts of every rank but one, which gets no token
 *   bad          uniform, then 1 to 3 slots out of [-1, E): the lowest flat position must be
 *                raised as EPX_ERR_INVALID_ARGUMENT, stage LAYOUT, with its value; the others
 *                count as empty slots
 * Then the rank-mask variant (epx_dispatch with is_token_in_rank) on the same shapes with the
 * uniform and holes routings: the mask is the routing's is_token_in_rank with random nonzero
 * bytes for 1, and the caller's per-expert counts (random) must be copied unchanged.
 * layout_one_gpu_recovers_from_a_broken_scan: a scan state left mid-call gives an async error
 * within the wait budget, not a hang, and the rearm makes the next calls right.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/gpu_util.h"
#include "gpu/one_gpu_ctx.h"
#include "kernels/api.h"
#include "ref/epx_ref.h"

#define MAX_T 65536
#define MAX_R 8
#define MAX_E 256
#define MAX_K 8
#define POISON 0xAB

static const int kTokens[] = {4096, 1, 65536, 0, 511, 513, 512, 4095};
static const int kRanks[] = {2, 4, 8};
static const int kExperts[] = {16, 256};
static const int kTopK[] = {1, 8};

typedef enum {
  ROUTE_UNIFORM,
  ROUTE_ONE_EXPERT,
  ROUTE_DUPS,
  ROUTE_HOLES,
  ROUTE_SKIP_RANK,
  ROUTE_BAD,
  NUM_ROUTES
} route_t;
static const char *const kRouteNames[NUM_ROUTES] = {"uniform", "one_expert", "dups",
                                                    "holes",   "skip_rank",  "bad"};

typedef struct buffers {
  /* host */
  int64_t *idx;
  int32_t *idx32;
  uint8_t *mask, *ref_in, *got_in;
  int *ref_rank, *ref_expert, *ref_pos, *got_rank, *got_expert, *got_pos, *in_per_expert;
  /* device, one element past each output's end */
  void *d_idx;
  uint8_t *d_mask, *d_in;
  int *d_rank, *d_expert, *d_pos, *d_in_per_expert;
} buffers_t;

typedef struct layout_case {
  int T, R, E, K, int32_ids, from_mask;
  route_t route;
} layout_case_t;

static void describe(const layout_case_t *c, char *out, size_t n) {
  snprintf(out, n, "T=%d R=%d E=%d K=%d %s ids, %s%s (seed 0x%llx)", c->T, c->R, c->E, c->K,
           c->int32_ids ? "int32" : "int64", kRouteNames[c->route],
           c->from_mask ? ", rank-mask variant" : "", (unsigned long long)epx_test_seed());
}

/* The routing of c into b->idx; returns the lowest flat position set out of range, or -1. */
static long long make_routing(const layout_case_t *c, buffers_t *b, uint64_t *rng) {
  const int T = c->T, K = c->K, E = c->E, L = c->E / c->R;
  const int skipped = epx_test_rand_int(rng, c->R); /* skip_rank: the rank left out */
  const int64_t one = epx_test_rand_int(rng, E);
  for (int t = 0; t < T; t++) {
    int64_t *ids = b->idx + (size_t)t * K;
    for (int k = 0; k < K; k++) {
      int64_t e;
      if (c->route == ROUTE_ONE_EXPERT) {
        e = one;
      } else if (c->route == ROUTE_SKIP_RANK) {
        e = -1; /* K distinct experts off rank `skipped`, or -1 when they run out */
        for (int tries = 0; tries < 100 && e < 0; tries++) {
          const int64_t x = epx_test_rand_int(rng, E - L);
          const int64_t cand = x < (int64_t)skipped * L ? x : x + L;
          int again = 0;
          for (int j = 0; j < k; j++) again |= ids[j] == cand;
          if (!again) e = cand;
        }
      } else {
        e = epx_test_rand_new_expert(rng, ids, k, E);
        if (c->route == ROUTE_DUPS && k > 0 && epx_test_rand_int(rng, 3) == 0)
          e = ids[epx_test_rand_int(rng, k)];
        if (c->route == ROUTE_HOLES && epx_test_rand_int(rng, 4) == 0) e = -1;
      }
      ids[k] = e;
    }
  }
  long long bad = -1;
  if (c->route == ROUTE_BAD && T > 0) {
    static const int64_t kBadValues[] = {0, -2, -1000, 1 << 30}; /* [0]: E, set below */
    const int n = 1 + epx_test_rand_int(rng, 3);
    for (int i = 0; i < n; i++) {
      const long long pos = epx_test_rand_int(rng, T * K);
      const int which = epx_test_rand_int(rng, 4);
      b->idx[pos] = which == 0 ? E : kBadValues[which];
      if (bad < 0 || pos < bad) bad = pos;
    }
  }
  return bad;
}

static int run_case(one_gpu_ctx_t *ctx, buffers_t *b, const layout_case_t *c, uint64_t *rng) {
  const int T = c->T, R = c->R, E = c->E, K = c->K;
  const size_t TK = (size_t)T * K, TR = (size_t)T * R;
  char label[160];
  describe(c, label, sizeof label);

  const long long bad_pos = make_routing(c, b, rng);
  const long long ref_bad =
      epx_ref_layout(b->idx, T, K, E, R, b->ref_rank, b->ref_expert, b->ref_in, b->ref_pos);
  EXPECTF(ref_bad == bad_pos, "%s: reference reports %lld, routing made %lld", label, ref_bad,
          bad_pos);

  /* Inputs. */
  if (c->from_mask) {
    for (size_t i = 0; i < TR; i++)
      b->mask[i] = b->ref_in[i] ? (uint8_t)(1 + epx_test_rand_int(rng, 255)) : 0;
    for (int e = 0; e < E; e++) b->in_per_expert[e] = epx_test_rand_int(rng, 1 << 20);
    EXPECT_CUDA(cudaMemcpy(b->d_mask, b->mask, TR, cudaMemcpyHostToDevice));
    EXPECT_CUDA(
        cudaMemcpy(b->d_in_per_expert, b->in_per_expert, sizeof(int) * E, cudaMemcpyHostToDevice));
    memcpy(b->ref_expert, b->in_per_expert, sizeof(int) * E); /* copied, not counted */
  } else if (c->int32_ids) {
    for (size_t i = 0; i < TK; i++) b->idx32[i] = (int32_t)b->idx[i];
    EXPECT_CUDA(cudaMemcpy(b->d_idx, b->idx32, sizeof(int32_t) * TK, cudaMemcpyHostToDevice));
  } else {
    EXPECT_CUDA(cudaMemcpy(b->d_idx, b->idx, sizeof(int64_t) * TK, cudaMemcpyHostToDevice));
  }
  /* Poisoned outputs, one element past each end included. */
  EXPECT_CUDA(cudaMemset(b->d_rank, POISON, sizeof(int) * (R + 1)));
  EXPECT_CUDA(cudaMemset(b->d_expert, POISON, sizeof(int) * (E + 1)));
  EXPECT_CUDA(cudaMemset(b->d_in, POISON, TR + 1));
  EXPECT_CUDA(cudaMemset(b->d_pos, POISON, sizeof(int) * (TR + 1)));
  /* NOTE: cudaMemcpy / cudaMemset run on the legacy stream: done before the launch. */
  EXPECT_CUDA(cudaDeviceSynchronize());

  epx__layout_launch_args_t a;
  memset(&a, 0, sizeof a);
  a.topk_idx = c->from_mask ? NULL : b->d_idx;
  a.idx_is_int64 = !c->int32_ids;
  a.num_tokens = T;
  a.top_k = K;
  a.num_experts = E;
  a.num_ranks = R;
  a.num_tokens_per_rank = b->d_rank;
  a.num_tokens_per_expert = b->d_expert;
  a.is_token_in_rank = b->d_in;
  a.token_pos_in_rank = b->d_pos;
  a.from_mask = c->from_mask;
  a.in_rank_mask = c->from_mask ? b->d_mask : NULL;
  a.in_tokens_per_expert = c->from_mask ? b->d_in_per_expert : NULL;
  EXPECTF(epx__layout_launch(&ctx->ctx, &a, 0) == EPX_OK, "%s: launch: %s", label,
          epx_last_error());
  epx__error_record_t err;
  EXPECT_CUDA(one_gpu_ctx_take_error(ctx, &err));

  EXPECT_CUDA(cudaMemcpy(b->got_rank, b->d_rank, sizeof(int) * (R + 1), cudaMemcpyDeviceToHost));
  EXPECT_CUDA(
      cudaMemcpy(b->got_expert, b->d_expert, sizeof(int) * (E + 1), cudaMemcpyDeviceToHost));
  EXPECT_CUDA(cudaMemcpy(b->got_in, b->d_in, TR + 1, cudaMemcpyDeviceToHost));
  EXPECT_CUDA(cudaMemcpy(b->got_pos, b->d_pos, sizeof(int) * (TR + 1), cudaMemcpyDeviceToHost));

  if (bad_pos >= 0) {
    EXPECTF(err.status == EPX_ERR_INVALID_ARGUMENT && err.stage == EPX_STAGE_LAYOUT,
            "%s: async status %d, stage %d; want INVALID_ARGUMENT in LAYOUT", label, err.status,
            err.stage);
    EXPECTF(err.position == bad_pos && err.value == b->idx[bad_pos],
            "%s: error at position %lld value %lld; want %lld value %lld", label, err.position,
            err.value, bad_pos, (long long)b->idx[bad_pos]);
  } else {
    EXPECTF(err.status == 0, "%s: unexpected async error %d (stage %d, position %lld, value %lld)",
            label, err.status, err.stage, err.position, err.value);
  }
  for (int r = 0; r < R; r++)
    EXPECTF(b->got_rank[r] == b->ref_rank[r], "%s: num_tokens_per_rank[%d] = %d, ref %d", label, r,
            b->got_rank[r], b->ref_rank[r]);
  for (int e = 0; e < E; e++)
    EXPECTF(b->got_expert[e] == b->ref_expert[e], "%s: num_tokens_per_expert[%d] = %d, ref %d",
            label, e, b->got_expert[e], b->ref_expert[e]);
  for (size_t i = 0; i < TR; i++) {
    EXPECTF(b->got_in[i] == b->ref_in[i], "%s: is_token_in_rank[%zu][%zu] = %d, ref %d", label,
            i / R, i % R, b->got_in[i], b->ref_in[i]);
    EXPECTF(b->got_pos[i] == b->ref_pos[i], "%s: token_pos_in_rank[%zu][%zu] = %d, ref %d", label,
            i / R, i % R, b->got_pos[i], b->ref_pos[i]);
  }
  const int poison_int = (int)0xABABABABu;
  EXPECTF(b->got_rank[R] == poison_int, "%s: num_tokens_per_rank written past its end", label);
  EXPECTF(b->got_expert[E] == poison_int, "%s: num_tokens_per_expert written past its end", label);
  EXPECTF(b->got_in[TR] == POISON, "%s: is_token_in_rank written past its end", label);
  EXPECTF(b->got_pos[TR] == poison_int, "%s: token_pos_in_rank written past its end", label);
  return TEST_PASS;
}

static int alloc_buffers(buffers_t *b) {
  const size_t TK = (size_t)MAX_T * MAX_K + 1, TR = (size_t)MAX_T * MAX_R + 1;
  memset(b, 0, sizeof *b);
  b->idx = malloc(sizeof(int64_t) * TK);
  b->idx32 = malloc(sizeof(int32_t) * TK);
  b->mask = malloc(TR);
  b->ref_in = malloc(TR);
  b->got_in = malloc(TR);
  b->ref_pos = malloc(sizeof(int) * TR);
  b->got_pos = malloc(sizeof(int) * TR);
  b->ref_rank = malloc(sizeof(int) * (MAX_R + 1));
  b->got_rank = malloc(sizeof(int) * (MAX_R + 1));
  b->ref_expert = malloc(sizeof(int) * (MAX_E + 1));
  b->got_expert = malloc(sizeof(int) * (MAX_E + 1));
  b->in_per_expert = malloc(sizeof(int) * (MAX_E + 1));
  EXPECT(b->idx && b->idx32 && b->mask && b->ref_in && b->got_in && b->ref_pos && b->got_pos &&
         b->ref_rank && b->got_rank && b->ref_expert && b->got_expert && b->in_per_expert);
  EXPECT_CUDA(cudaMalloc(&b->d_idx, sizeof(int64_t) * TK));
  EXPECT_CUDA(cudaMalloc((void **)&b->d_mask, TR));
  EXPECT_CUDA(cudaMalloc((void **)&b->d_in, TR));
  EXPECT_CUDA(cudaMalloc((void **)&b->d_pos, sizeof(int) * TR));
  EXPECT_CUDA(cudaMalloc((void **)&b->d_rank, sizeof(int) * (MAX_R + 1)));
  EXPECT_CUDA(cudaMalloc((void **)&b->d_expert, sizeof(int) * (MAX_E + 1)));
  EXPECT_CUDA(cudaMalloc((void **)&b->d_in_per_expert, sizeof(int) * (MAX_E + 1)));
  return TEST_PASS;
}

static void free_buffers(buffers_t *b) {
  free(b->idx), free(b->idx32), free(b->mask), free(b->ref_in), free(b->got_in);
  free(b->ref_pos), free(b->got_pos), free(b->ref_rank), free(b->got_rank);
  free(b->ref_expert), free(b->got_expert), free(b->in_per_expert);
  cudaFree(b->d_idx), cudaFree(b->d_mask), cudaFree(b->d_in), cudaFree(b->d_pos);
  cudaFree(b->d_rank), cudaFree(b->d_expert), cudaFree(b->d_in_per_expert);
}

#define COUNT(a) ((int)(sizeof(a) / sizeof((a)[0])))

EPX_ONE_GPU_TEST(layout_one_gpu_matches_reference, 600) {
  uint64_t rng = epx_test_seed();
  one_gpu_ctx_t ctx;
  EXPECT_CUDA(one_gpu_ctx_create(&ctx, MAX_T, 2000));
  buffers_t b;
  if (alloc_buffers(&b) != TEST_PASS) return TEST_FAIL;
  int cases = 0, result = TEST_PASS;
  for (int from_mask = 0; from_mask < 2 && result == TEST_PASS; from_mask++)
    for (int ti = 0; ti < COUNT(kTokens) && result == TEST_PASS; ti++)
      for (int ri = 0; ri < COUNT(kRanks) && result == TEST_PASS; ri++)
        for (int ei = 0; ei < COUNT(kExperts) && result == TEST_PASS; ei++)
          for (int ki = 0; ki < COUNT(kTopK) && result == TEST_PASS; ki++)
            for (int w = 0; w < (from_mask ? 1 : 2) && result == TEST_PASS; w++)
              for (int route = 0; route < NUM_ROUTES && result == TEST_PASS; route++) {
                if (from_mask && route != ROUTE_UNIFORM && route != ROUTE_HOLES) continue;
                const layout_case_t c = {kTokens[ti], kRanks[ri], kExperts[ei],  kTopK[ki],
                                         w,           from_mask,  (route_t)route};
                result = run_case(&ctx, &b, &c, &rng);
                cases++;
              }
  printf("  %d cases%s\n", cases, result == TEST_PASS ? "" : ", stopped at the first failure");
  free_buffers(&b);
  one_gpu_ctx_destroy(&ctx);
  return result;
}

/* A scan state left mid-call (here: the ticket word moved by hand, as a call killed mid-way or two
 * calls on unordered streams would leave it) makes the next call raise an error within the
 * wait budget instead of hanging; the rearm (epx_group_clear_async_error's, here
 * one_gpu_ctx_take_error's) restarts the scan and the call after it is right. */
EPX_ONE_GPU_TEST(layout_one_gpu_recovers_from_a_broken_scan, 120) {
  uint64_t rng = epx_test_seed();
  one_gpu_ctx_t ctx;
  EXPECT_CUDA(one_gpu_ctx_create(&ctx, MAX_T, 200));
  buffers_t b;
  if (alloc_buffers(&b) != TEST_PASS) return TEST_FAIL;
  const layout_case_t c = {4096, 8, 256, 8, 0, 0, ROUTE_UNIFORM};
  EXPECT(run_case(&ctx, &b, &c, &rng) == TEST_PASS);

  /* Three tickets already taken: tiles 0-2 never come, tiles 8-10 do not exist. */
  const uint64_t ticket = 3;
  EXPECT_CUDA(cudaMemcpy(ctx.workspace + ctx.ctx.layout.layout_offset, &ticket, sizeof ticket,
                         cudaMemcpyHostToDevice));
  epx__layout_launch_args_t a;
  memset(&a, 0, sizeof a);
  a.topk_idx = b.d_idx;
  a.idx_is_int64 = 1;
  a.num_tokens = c.T;
  a.top_k = c.K;
  a.num_experts = c.E;
  a.num_ranks = c.R;
  a.num_tokens_per_rank = b.d_rank;
  a.num_tokens_per_expert = b.d_expert;
  a.is_token_in_rank = b.d_in;
  a.token_pos_in_rank = b.d_pos;
  const double t0 = epx_test_now_s();
  EXPECT_OK(epx__layout_launch(&ctx.ctx, &a, 0));
  epx__error_record_t err;
  EXPECT_CUDA(one_gpu_ctx_take_error(&ctx, &err));
  const double waited = epx_test_now_s() - t0;
  printf("  broken scan: status %d, stage %d, position %lld, value %lld after %.2f s\n", err.status,
         err.stage, err.position, err.value, waited);
  EXPECTF(err.status == EPX_ERR_INTERNAL || err.status == EPX_ERR_TIMEOUT,
          "async status %d; want INTERNAL or TIMEOUT (seed 0x%llx)", err.status,
          (unsigned long long)epx_test_seed());
  EXPECT_EQ_INT(err.stage, EPX_STAGE_LAYOUT);
  EXPECTF(waited < 10.0, "the broken call took %.2f s with a 0.2 s wait budget", waited);

  /* Rearmed: right again, twice (the second call in the next epoch). */
  EXPECT(run_case(&ctx, &b, &c, &rng) == TEST_PASS);
  EXPECT(run_case(&ctx, &b, &c, &rng) == TEST_PASS);
  free_buffers(&b);
  one_gpu_ctx_destroy(&ctx);
  return TEST_PASS;
}

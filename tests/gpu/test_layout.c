/*
 * test_layout.c - epx_layout on the GPU against the CPU reference (tests/ref), on fresh random
 * routings and adversarial ones, int64 and int32 ids, every output poisoned before the call.
 *
 *   case                  T            E     K    routing
 *   random                rand..max    256   8    K distinct experts, uniform
 *   one_expert            max          256   8    every slot of every token = expert 7 (repeats)
 *   one_expert_one_slot   max          256   8    slot 0 = last expert, others -1
 *   all_empty             max          256   8    every slot -1
 *   empty_rank            0 on rank 1  256   8    uniform elsewhere
 *   e_equals_r            rand         R     R/2+ uniform
 *   top1                  rand         64    1    uniform
 *   top16                 rand         256   16   uniform
 *   e512                  max          512   8    uniform, with random -1 holes
 *   bad_ids               rand         256   8    two ids out of range (E and -2); first reported
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/gpu_util.h"
#include "ref/epx_ref.h"

#define MAX_T 4096

typedef enum {
  ROUTE_UNIFORM,
  ROUTE_ONE_EXPERT,
  ROUTE_ONE_SLOT,
  ROUTE_EMPTY,
  ROUTE_HOLES,
  ROUTE_BAD
} route_t;

typedef struct {
  const char *name;
  int num_tokens;  /* -1: random in [1, MAX_T] */
  int num_experts; /* 0: = R */
  int top_k;       /* 0: R/2 + 1, capped at R */
  route_t route;
  int empty_rank; /* rank that gets 0 tokens, or -1 */
} layout_case_t;

static void make_routing(int64_t *idx, int T, int K, int E, route_t route, uint64_t *rng) {
  for (int t = 0; t < T; t++) {
    for (int k = 0; k < K; k++) {
      int64_t e = -1;
      switch (route) {
        case ROUTE_ONE_EXPERT:
          e = 7 % E;
          break;
        case ROUTE_ONE_SLOT:
          e = k == 0 ? E - 1 : -1;
          break;
        case ROUTE_EMPTY:
          e = -1;
          break;
        default: {
          /* distinct experts per token */
          int again;
          do {
            e = epx_test_rand_int(rng, E);
            again = 0;
            for (int j = 0; j < k; j++) again |= idx[(size_t)t * K + j] == e;
          } while (again);
          if (route == ROUTE_HOLES && epx_test_rand_int(rng, 5) == 0) e = -1;
        }
      }
      idx[(size_t)t * K + k] = e;
    }
  }
}

static int run_case(epx_test_rank_t *t, const layout_case_t *lc, int use_int32, uint64_t *rng) {
  const int R = t->num_ranks;
  const int E = lc->num_experts ? lc->num_experts : R;
  int K = lc->top_k ? lc->top_k : R / 2 + 1;
  if (K > E) K = E;
  int T = lc->num_tokens >= 0 ? lc->num_tokens : 1 + epx_test_rand_int(rng, MAX_T);
  if (t->rank == lc->empty_rank) T = 0;

  epx_group_config_t c = gpu_test_config(MAX_T, 512, E, K);
  epx_group_t g = NULL;
  EXPECT_OK(epx_group_create(t->comm, &c, &g));

  int64_t *idx = (int64_t *)malloc(sizeof(int64_t) * ((size_t)T * K + 1));
  EXPECT(idx != NULL);
  make_routing(idx, T, K, E, lc->route, rng);
  long long bad_pos = -1, bad_val = 0;
  if (lc->route == ROUTE_BAD && T > 0) {
    /* Two bad ids; the lower position must be the one reported. */
    long long p1 = epx_test_rand_int(rng, T * K), p2 = epx_test_rand_int(rng, T * K);
    idx[p1] = E;
    idx[p2] = -2;
    bad_pos = p1 < p2 ? p1 : p2;
    bad_val = idx[bad_pos];
  }

  /* Reference (bad ids count as empty slots). */
  int *ref_rank = calloc(R, sizeof(int)), *ref_expert = calloc(E, sizeof(int));
  uint8_t *ref_in = calloc((size_t)T * R + 1, 1);
  int *ref_pos = calloc((size_t)T * R + 1, sizeof(int));
  long long ref_bad = epx_ref_layout(idx, T, K, E, R, ref_rank, ref_expert, ref_in, ref_pos);
  EXPECT_EQ_INT(ref_bad, bad_pos);

  /* Device inputs and poisoned outputs. */
  size_t idx_bytes = (size_t)T * K * (use_int32 ? 4 : 8);
  void *d_idx = NULL;
  int *d_rank = NULL, *d_expert = NULL, *d_pos = NULL;
  uint8_t *d_in = NULL;
  EXPECT_CUDA(cudaMalloc(&d_idx, (size_t)T * K * 8 + 8)); /* room for int64 ids in either case */
  EXPECT_CUDA(cudaMalloc((void **)&d_rank, R * sizeof(int)));
  EXPECT_CUDA(cudaMalloc((void **)&d_expert, E * sizeof(int)));
  EXPECT_CUDA(cudaMalloc((void **)&d_in, (size_t)T * R + 1));
  EXPECT_CUDA(cudaMalloc((void **)&d_pos, ((size_t)T * R + 1) * sizeof(int)));
  if (use_int32) {
    int32_t *i32 = malloc(idx_bytes + 4);
    for (size_t i = 0; i < (size_t)T * K; i++) i32[i] = (int32_t)idx[i];
    EXPECT_CUDA(cudaMemcpy(d_idx, i32, idx_bytes, cudaMemcpyHostToDevice));
    free(i32);
  } else {
    EXPECT_CUDA(cudaMemcpy(d_idx, idx, idx_bytes, cudaMemcpyHostToDevice));
  }
  EXPECT_CUDA(cudaMemset(d_rank, 0xAB, R * sizeof(int)));
  EXPECT_CUDA(cudaMemset(d_expert, 0xAB, E * sizeof(int)));
  EXPECT_CUDA(cudaMemset(d_in, 0xAB, (size_t)T * R + 1));
  EXPECT_CUDA(cudaMemset(d_pos, 0xAB, ((size_t)T * R + 1) * sizeof(int)));
  /* NOTE: cudaMemcpy/cudaMemset run on the legacy stream, which does not order with the
   * non-blocking test stream: finish them before the layout kernel runs. */
  EXPECT_CUDA(cudaDeviceSynchronize());

  epx_layout_args_t a = EPX_LAYOUT_ARGS_INIT;
  a.topk_idx = d_idx;
  a.topk_idx_dtype = use_int32 ? EPX_DTYPE_INT32 : EPX_DTYPE_INT64;
  a.num_tokens = T;
  a.num_tokens_per_rank = d_rank;
  a.num_tokens_per_expert = d_expert;
  a.is_token_in_rank = d_in;
  a.token_pos_in_rank = d_pos;
  EXPECT_OK(epx_layout(g, &a, t->stream));
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));

  int *got_rank = malloc(R * sizeof(int)), *got_expert = malloc(E * sizeof(int));
  uint8_t *got_in = malloc((size_t)T * R + 1);
  int *got_pos = malloc(((size_t)T * R + 1) * sizeof(int));
  EXPECT_CUDA(cudaMemcpy(got_rank, d_rank, R * sizeof(int), cudaMemcpyDeviceToHost));
  EXPECT_CUDA(cudaMemcpy(got_expert, d_expert, E * sizeof(int), cudaMemcpyDeviceToHost));
  EXPECT_CUDA(cudaMemcpy(got_in, d_in, (size_t)T * R + 1, cudaMemcpyDeviceToHost));
  EXPECT_CUDA(
      cudaMemcpy(got_pos, d_pos, ((size_t)T * R + 1) * sizeof(int), cudaMemcpyDeviceToHost));

  const char *label = lc->name;
  for (int r = 0; r < R; r++)
    EXPECTF(got_rank[r] == ref_rank[r], "%s: num_tokens_per_rank[%d] = %d, ref %d", label, r,
            got_rank[r], ref_rank[r]);
  for (int e = 0; e < E; e++)
    EXPECTF(got_expert[e] == ref_expert[e], "%s: num_tokens_per_expert[%d] = %d, ref %d", label, e,
            got_expert[e], ref_expert[e]);
  for (size_t i = 0; i < (size_t)T * R; i++) {
    EXPECTF(got_in[i] == ref_in[i], "%s: is_token_in_rank[%zu][%zu] = %d, ref %d", label, i / R,
            i % R, got_in[i], ref_in[i]);
    EXPECTF(got_pos[i] == ref_pos[i], "%s: token_pos_in_rank[%zu][%zu] = %d, ref %d", label, i / R,
            i % R, got_pos[i], ref_pos[i]);
  }
  /* Nothing written past the outputs. */
  EXPECTF(got_in[(size_t)T * R] == 0xAB, "%s: is_token_in_rank written past its end", label);
  EXPECTF(got_pos[(size_t)T * R] == (int)0xABABABAB, "%s: token_pos_in_rank written past its end",
          label);

  epx_async_error_t err;
  EXPECT_OK(epx_group_get_async_error(g, &err));
  if (bad_pos >= 0) {
    EXPECTF(err.status == EPX_ERR_INVALID_ARGUMENT, "%s: async status %d (%s)", label, err.status,
            err.message);
    EXPECT_EQ_INT(err.stage, EPX_STAGE_LAYOUT);
    EXPECT_EQ_INT(err.position, bad_pos);
    EXPECT_EQ_INT(err.value, bad_val);
    printf("  rank %d: %s\n", t->rank, err.message);
    EXPECT_OK(epx_group_clear_async_error(g));
    /* The group keeps working: a valid routing right after reports nothing. */
    make_routing(idx, T, K, E, ROUTE_UNIFORM, rng);
    EXPECT_CUDA(cudaMemcpy(d_idx, idx, (size_t)T * K * 8, cudaMemcpyHostToDevice));
    EXPECT_CUDA(cudaDeviceSynchronize());
    a.topk_idx_dtype = EPX_DTYPE_INT64;
    EXPECT_OK(epx_layout(g, &a, t->stream));
    EXPECT_CUDA(cudaStreamSynchronize(t->stream));
    EXPECT_OK(epx_group_get_async_error(g, &err));
  }
  EXPECTF(err.status == EPX_OK, "%s: unexpected async error: %s", label, err.message);

  free(idx);
  free(ref_rank), free(ref_expert), free(ref_in), free(ref_pos);
  free(got_rank), free(got_expert), free(got_in), free(got_pos);
  cudaFree(d_idx), cudaFree(d_rank), cudaFree(d_expert), cudaFree(d_in), cudaFree(d_pos);
  EXPECT_OK(epx_group_destroy(g));
  return TEST_PASS;
}

static const layout_case_t cases[] = {
    {"random", -1, 256, 8, ROUTE_UNIFORM, -1},
    {"one_expert", MAX_T, 256, 8, ROUTE_ONE_EXPERT, -1},
    {"one_expert_one_slot", MAX_T, 256, 8, ROUTE_ONE_SLOT, -1},
    {"all_empty", MAX_T, 256, 8, ROUTE_EMPTY, -1},
    {"empty_rank", -1, 256, 8, ROUTE_UNIFORM, 1},
    {"e_equals_r", -1, 0, 0, ROUTE_UNIFORM, -1},
    {"top1", -1, 64, 1, ROUTE_UNIFORM, -1},
    {"top16", -1, 256, 16, ROUTE_UNIFORM, -1},
    {"e512", MAX_T, 512, 8, ROUTE_HOLES, -1},
    {"bad_ids", -1, 256, 8, ROUTE_BAD, -1},
};

EPX_GPU_TEST(layout_matches_reference, 300) {
  /* Every rank draws its own routing: same seed, rank mixed in. */
  uint64_t rng = t->seed ^ (0x632BE59BD9B4E019ull * (uint64_t)(t->rank + 1));
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
    for (int use_int32 = 0; use_int32 < 2; use_int32++) {
      int r = run_case(t, &cases[i], use_int32, &rng);
      if (r != TEST_PASS) {
        fprintf(stderr, "  rank %d: case %s (%s ids) failed\n", t->rank, cases[i].name,
                use_int32 ? "int32" : "int64");
        return r;
      }
    }
  return TEST_PASS;
}

/* Host-visible argument errors are refused before anything is launched. */
EPX_GPU_TEST(layout_refuses_bad_arguments, 120) {
  epx_group_config_t c = gpu_test_config(256, 512, 4 * t->num_ranks, 4);
  epx_group_t g = NULL;
  EXPECT_OK(epx_group_create(t->comm, &c, &g));
  int64_t *d_idx = NULL;
  int *d_cnt = NULL;
  EXPECT_CUDA(cudaMalloc((void **)&d_idx, 256 * 4 * sizeof(int64_t) + 16));
  EXPECT_CUDA(cudaMalloc((void **)&d_cnt, 64 * sizeof(int)));
  epx_layout_args_t a = EPX_LAYOUT_ARGS_INIT;
  a.topk_idx = d_idx;
  a.num_tokens = 257;
  a.num_tokens_per_rank = d_cnt;
  EXPECT_STATUS(epx_layout(g, &a, t->stream), EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "num_tokens") != NULL);
  a.num_tokens = 16;
  a.topk_idx = NULL;
  EXPECT_STATUS(epx_layout(g, &a, t->stream), EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "topk_idx") != NULL);
  a.topk_idx = (const char *)d_idx + 4; /* misaligned for int64 */
  EXPECT_STATUS(epx_layout(g, &a, t->stream), EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "aligned") != NULL);
  int64_t host_idx[64];
  a.topk_idx = host_idx; /* pageable host memory */
  EXPECT_STATUS(epx_layout(g, &a, t->stream), EPX_ERR_INVALID_ARGUMENT);
  a.topk_idx = d_idx;
  a.topk_idx_dtype = EPX_DTYPE_BF16;
  EXPECT_STATUS(epx_layout(g, &a, t->stream), EPX_ERR_INVALID_ARGUMENT);
  a.topk_idx_dtype = EPX_DTYPE_INT64;
  a.size = 8;
  EXPECT_STATUS(epx_layout(g, &a, t->stream), EPX_ERR_INVALID_ARGUMENT);
  EXPECT_STATUS(epx_layout(g, NULL, t->stream), EPX_ERR_INVALID_ARGUMENT);
  /* The group still works. */
  a.size = sizeof a;
  EXPECT_CUDA(cudaMemsetAsync(d_idx, 0xFF, 16 * 4 * sizeof(int64_t), t->stream)); /* all -1 */
  EXPECT_OK(epx_layout(g, &a, t->stream));
  int cnt[EPX_MAX_RANKS];
  EXPECT_CUDA(
      cudaMemcpyAsync(cnt, d_cnt, t->num_ranks * sizeof(int), cudaMemcpyDeviceToHost, t->stream));
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  for (int r = 0; r < t->num_ranks; r++) EXPECT_EQ_INT(cnt[r], 0);
  cudaFree(d_idx);
  cudaFree(d_cnt);
  EXPECT_OK(epx_group_destroy(g));
  return TEST_PASS;
}

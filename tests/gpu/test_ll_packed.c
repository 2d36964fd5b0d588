/*
 * test_ll_packed.c - the packed low-latency layout (epx_ll_dispatch_args_t.packed) and UE8M0
 * word scales (ue8m0_packed) on 2 and 4 GPUs against the CPU reference: EPX_REF_LL_PACKED where
 * no token lists an expert twice, else the fixed-slot reference compacted (EPX sends one row per
 * distinct (token, expert); the reference's packed layout has one per slot). ll_checks.h.
 *
 *   test                          what
 *   ll_packed_cases               routes BY_RANK and DISPATCH_BY_RANK x the table below, packed:
 *                                 counts, begins, sources, rows and scales bit-exact (BF16, FP8,
 *                                 UE8M0 words), the layout range, nothing written past
 *                                 recv_count[j] (0xff poison intact), combine within BF16
 *                                 rounding; split and zero copy; fixed-slot rows with UE8M0 words
 *                                 on every route; each case twice (both buffers)
 *   ll_packed_two_microbatches    buffer 0 packed, buffer 1 fixed slots, both split dispatches in
 *                                 flight, then both split combines: the layout is per buffer
 *   ll_packed_refusals            DIRECT route: EPX_ERR_UNSUPPORTED; bad flags and a layout
 *                                 range without packed: EPX_ERR_INVALID_ARGUMENT; the group
 *                                 still works afterwards
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/ll_checks.h"

/* A case: its world (WORLD_LL) and the call's options. */
typedef struct {
  const char *name;
  world_spec_t world;
  int fp8, ue8m0, ue8m0_packed, packed, split, zero_copy;
} packed_case_t;

/*   name  {M  H  E  K  routing  T  empty_rank}  fp8 ue8m0 ue8m0_packed packed split zero_copy */
static const packed_case_t cases[] = {
    {"random_bf16", {64, 640, 32, 8, ROUTE_UNIFORM, -1, -1}, 0, 0, 0, 1, 0, 0},
    {"random_fp8_zero_copy", {64, 640, 32, 8, ROUTE_UNIFORM, -1, -1}, 1, 0, 0, 1, 0, 1},
    {"fp8_words_split", {48, 384, 16, 4, ROUTE_HOLES, -1, -1}, 1, 1, 1, 1, 1, 0},
    {"bf16_split_zero_copy", {48, 384, 16, 4, ROUTE_UNIFORM, -1, -1}, 0, 0, 0, 1, 1, 1},
    {"all_to_one_expert", {64, 256, 16, 4, ROUTE_ONE_EXPERT, 64, -1}, 1, 1, 1, 1, 0, 0},
    {"all_empty", {64, 256, 16, 4, ROUTE_EMPTY, 64, -1}, 0, 0, 0, 1, 0, 1},
    {"one_rank_gets_all", {64, 256, 16, 4, ROUTE_ONE_RANK, 64, -1}, 1, 0, 0, 1, 0, 0},
    {"duplicate_ids", {64, 256, 16, 6, ROUTE_DUPLICATES, -1, -1}, 1, 1, 1, 1, 0, 0},
    {"empty_rank_split", {64, 256, 16, 4, ROUTE_HOLES, -1, 1}, 0, 0, 0, 1, 1, 0},
    {"no_tokens", {32, 128, 8, 2, ROUTE_UNIFORM, 0, -1}, 1, 0, 0, 1, 0, 0},
    {"one_token", {32, 1024, 32, 8, ROUTE_UNIFORM, 1, -1}, 1, 1, 1, 1, 0, 0},
    {"top16_e64_words_zero_copy", {32, 256, 64, 16, ROUTE_HOLES, -1, -1}, 1, 1, 1, 1, 0, 1},
    {"e_equals_r_top1", {32, 128, 0, 1, ROUTE_UNIFORM, -1, -1}, 0, 0, 0, 1, 0, 0},
    {"deepep_shape_fp8_words", {128, 7168, 256, 8, ROUTE_UNIFORM, 128, -1}, 1, 1, 1, 1, 0, 1},
    {"deepep_shape_bf16_split", {128, 7168, 256, 8, ROUTE_UNIFORM, 128, -1}, 0, 0, 0, 1, 1, 0},
    /* fixed slots with UE8M0 words (every route, DIRECT included) */
    {"fixed_fp8_words", {64, 640, 32, 8, ROUTE_HOLES, -1, -1}, 1, 1, 1, 0, 0, 0},
    {"fixed_fp8_words_split", {48, 384, 16, 6, ROUTE_DUPLICATES, -1, -1}, 1, 1, 1, 0, 1, 1},
};

static epx_group_config_t packed_config(const world_t *w, int route) {
  epx_group_config_t cfg = gpu_test_config(w->M, w->H, w->E, w->K);
  cfg.modes = EPX_MODE_LOW_LATENCY;
  cfg.ll_route = route;
  return cfg;
}

/* 0xff over both buffers' receive arrays (rows, scales, sources, counts), then a barrier so no
 * peer writes before every rank has poisoned. Nothing may be in flight. */
static int poison_both_buffers(epx_test_rank_t *t, epx_group_t g) {
  const epx__ws_layout_t *l = &g->layout;
  const size_t bytes = l->ll_stage_offset - l->ll_x_offset;
  for (int p = 0; p < 2; p++)
    EXPECT_CUDA(
        cudaMemset(g->workspace + l->ll_offset + (size_t)p * l->ll_parity_bytes + l->ll_x_offset,
                   0xff, bytes));
  EXPECT_CUDA(cudaDeviceSynchronize());
  EXPECT_OK(epx_group_barrier(g, t->stream));
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  return TEST_PASS;
}

static epx_ll_dispatch_args_t packed_args(const world_t *w, int me, const world_dev_t *d,
                                          const packed_case_t *c, long long *range) {
  epx_ll_dispatch_args_t a = EPX_LL_DISPATCH_ARGS_INIT;
  a.x = d->x;
  a.topk_idx = d->idx;
  a.topk_weights = (const float *)d->w;
  a.num_tokens = w->ranks[me].num_tokens;
  a.recv_dtype = c->fp8 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16;
  a.ue8m0 = c->ue8m0;
  a.ue8m0_packed = c->ue8m0_packed;
  a.packed = c->packed;
  a.split = c->split;
  a.layout_range = c->packed ? range : NULL;
  return a;
}

/* The combine of res (expert outputs y uploaded into its layout's rows), checked. */
static int combine_checked(epx_test_rank_t *t, epx_group_t g, const world_t *w,
                           const epx_ll_dispatch_result_t *res, int split, int zero_copy,
                           const world_dev_t *d, const char *label) {
  const int me = t->rank;
  uint16_t *y[EPX_MAX_RANKS];
  if (ll_expert_outputs(w, y) != TEST_PASS) return TEST_FAIL;
  void *dst = zero_copy ? res->combine_input : d->y;
  const int up =
      res->packed ? ll_upload_outputs_packed(w, me, y, dst) : ll_upload_outputs(w, me, y, dst);
  if (up != TEST_PASS) return TEST_FAIL;
  EXPECT_CUDA(cudaMemset(d->out, 0xff, (size_t)w->M * w->H * 2));
  EXPECT_CUDA(cudaDeviceSynchronize());
  epx_ll_hook_t hook = {0};
  epx_ll_combine_args_t ca = EPX_LL_COMBINE_ARGS_INIT;
  ca.x = zero_copy ? NULL : d->y, ca.dispatch = res, ca.out = d->out;
  ca.split = split, ca.hook = &hook;
  EXPECT_OK(epx_ll_combine(g, &ca, t->stream));
  if (split) EXPECT_CUDA(test_spin_ns(100000, t->stream)); /* other work, then the receive */
  if (split) EXPECT_OK(epx_ll_recv(g, &hook, t->stream));
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  const int r = ll_check_combine(w, me, d->out, y, label);
  for (int q = 0; q < w->R; q++) free(y[q]);
  return r;
}

/* One packed dispatch and its combine, everything checked. */
static int packed_cycle(epx_test_rank_t *t, epx_group_t g, const world_t *w, const packed_case_t *c,
                        const world_dev_t *d, long long *range, const char *label) {
  const int me = t->rank;
  if (world_upload(w, me, d) != TEST_PASS) return TEST_FAIL;
  if (poison_both_buffers(t, g) != TEST_PASS) return TEST_FAIL;
  const epx_ll_dispatch_args_t a = packed_args(w, me, d, c, range);
  epx_ll_dispatch_result_t res;
  EXPECT_OK(epx_ll_dispatch(g, &a, &res, t->stream));
  EXPECT_EQ_INT(res.packed, c->packed);
  if (c->split) {
    EXPECT_CUDA(test_spin_ns(200000, t->stream));
    EXPECT_OK(epx_ll_recv(g, &res.hook, t->stream));
  }
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  if (ll_check_dispatch_layout(w, me, &res, c->fp8, c->ue8m0, c->ue8m0_packed,
                               c->packed ? range : NULL, label) != TEST_PASS)
    return TEST_FAIL;
  return combine_checked(t, g, w, &res, c->split, c->zero_copy, d, label);
}

static const char *route_label(int route) {
  return route == EPX_LL_ROUTE_DIRECT    ? "direct"
         : route == EPX_LL_ROUTE_BY_RANK ? "by-rank"
                                         : "mixed";
}

/* Case c on a group of `route`, twice (the second call uses the other buffer and the next
 * epochs). A packed case on DIRECT is skipped (ll_packed_refusals covers the refusal). */
static int run_case(epx_test_rank_t *t, int route, const packed_case_t *c, const world_t *w) {
  if (c->packed && route == EPX_LL_ROUTE_DIRECT) return TEST_PASS;
  char label[128];
  snprintf(label, sizeof label, "%s (%s)", c->name, route_label(route));
  epx_group_config_t cfg = packed_config(w, route);
  epx_group_t g = NULL;
  EXPECT_OK(epx_group_create(t->comm, &cfg, &g));
  world_dev_t d;
  long long *range = NULL;
  if (world_dev_alloc(w, (size_t)w->L * w->R * w->M, &d) != TEST_PASS) return TEST_FAIL;
  EXPECT_CUDA(cudaMalloc((void **)&range, sizeof(long long) * (size_t)w->E));
  int rc = TEST_PASS;
  for (int call = 0; call < 2 && rc == TEST_PASS; call++) {
    rc = packed_cycle(t, g, w, c, &d, range, label);
    if (rc != TEST_PASS) fprintf(stderr, "  rank %d: %s failed (call %d)\n", t->rank, label, call);
  }
  if (rc == TEST_PASS) EXPECT_NO_ASYNC_ERROR(g, label);
  EXPECT_CUDA(cudaFree(range));
  world_dev_free(&d);
  EXPECT_OK(epx_group_destroy(g));
  return rc;
}

EPX_GPU_TEST(ll_packed_cases, 900) {
  for (int route = EPX_LL_ROUTE_DIRECT; route <= EPX_LL_ROUTE_DISPATCH_BY_RANK; route++) {
    uint64_t rng = t->seed; /* the same on every rank: the world is shared */
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
      world_t w;
      world_make(&w, t->num_ranks, &cases[i].world, WORLD_LL, &rng);
      const int rc = run_case(t, route, &cases[i], &w);
      world_free(&w);
      if (rc != TEST_PASS) return TEST_FAIL;
    }
  }
  return TEST_PASS;
}

/* Buffer 0 packed (UE8M0 words), buffer 1 fixed slots: two split dispatches in flight, both
 * received, then two split combines. */
EPX_GPU_TEST(ll_packed_two_microbatches, 300) {
  const int me = t->rank;
  for (int route = EPX_LL_ROUTE_BY_RANK; route <= EPX_LL_ROUTE_DISPATCH_BY_RANK; route++) {
    uint64_t rng = t->seed;
    const packed_case_t c[2] = {
        {"mb packed", {64, 512, 8 * t->num_ranks, 6, ROUTE_DUPLICATES, -1, -1}, 1, 1, 1, 1, 1, 0},
        {"mb fixed", {64, 512, 8 * t->num_ranks, 6, ROUTE_HOLES, -1, -1}, 1, 0, 0, 0, 1, 0}};
    world_t w[2];
    world_dev_t d[2];
    for (int m = 0; m < 2; m++) world_make(&w[m], t->num_ranks, &c[m].world, WORLD_LL, &rng);
    epx_group_config_t cfg = packed_config(&w[0], route);
    epx_group_t g = NULL;
    EXPECT_OK(epx_group_create(t->comm, &cfg, &g));
    long long *range = NULL;
    EXPECT_CUDA(cudaMalloc((void **)&range, sizeof(long long) * (size_t)w[0].E));
    for (int m = 0; m < 2; m++) {
      if (world_dev_alloc(&w[m], (size_t)w[m].L * w[m].R * w[m].M, &d[m]) != TEST_PASS)
        return TEST_FAIL;
      if (world_upload(&w[m], me, &d[m]) != TEST_PASS) return TEST_FAIL;
    }
    if (poison_both_buffers(t, g) != TEST_PASS) return TEST_FAIL;
    epx_ll_dispatch_result_t res[2];
    for (int m = 0; m < 2; m++) {
      const epx_ll_dispatch_args_t a = packed_args(&w[m], me, &d[m], &c[m], range);
      EXPECT_OK(epx_ll_dispatch(g, &a, &res[m], t->stream));
      EXPECT_EQ_INT(res[m].buffer, m);
    }
    EXPECT_CUDA(test_spin_ns(300000, t->stream));
    for (int m = 0; m < 2; m++) EXPECT_OK(epx_ll_recv(g, &res[m].hook, t->stream));
    EXPECT_CUDA(cudaStreamSynchronize(t->stream));
    for (int m = 0; m < 2; m++) {
      char label[64];
      snprintf(label, sizeof label, "%s (%s)", c[m].name, route_label(route));
      if (ll_check_dispatch_layout(&w[m], me, &res[m], 1, c[m].ue8m0, c[m].ue8m0_packed,
                                   c[m].packed ? range : NULL, label) != TEST_PASS)
        return TEST_FAIL;
    }
    for (int m = 0; m < 2; m++) {
      char label[64];
      snprintf(label, sizeof label, "%s combine (%s)", c[m].name, route_label(route));
      if (combine_checked(t, g, &w[m], &res[m], 1, 0, &d[m], label) != TEST_PASS) return TEST_FAIL;
      world_dev_free(&d[m]);
      world_free(&w[m]);
    }
    EXPECT_NO_ASYNC_ERROR(g, __func__);
    EXPECT_CUDA(cudaFree(range));
    EXPECT_OK(epx_group_destroy(g));
  }
  return TEST_PASS;
}

/* Refused options name themselves, send nothing, and leave the group working. */
EPX_GPU_TEST(ll_packed_refusals, 300) {
  const int me = t->rank;
  uint64_t rng = t->seed;
  const packed_case_t c = {"refusals", {32, 256, 16, 4, ROUTE_UNIFORM, -1, -1}, 1, 1, 1, 1, 0, 0};
  world_t w;
  world_make(&w, t->num_ranks, &c.world, WORLD_LL, &rng);
  world_dev_t d;
  if (world_dev_make(&w, me, (size_t)w.L * w.R * w.M, &d) != TEST_PASS) return TEST_FAIL;
  long long *range = NULL;
  EXPECT_CUDA(cudaMalloc((void **)&range, sizeof(long long) * (size_t)w.E));
  for (int route = EPX_LL_ROUTE_DIRECT; route <= EPX_LL_ROUTE_BY_RANK; route++) {
    epx_group_config_t cfg = packed_config(&w, route);
    epx_group_t g = NULL;
    EXPECT_OK(epx_group_create(t->comm, &cfg, &g));
    epx_ll_dispatch_result_t res;
    epx_ll_dispatch_args_t a = packed_args(&w, me, &d, &c, range);
    if (route == EPX_LL_ROUTE_DIRECT) {
      EXPECT_STATUS(epx_ll_dispatch(g, &a, &res, t->stream), EPX_ERR_UNSUPPORTED);
      EXPECT(strstr(epx_last_error(), "args->packed") != NULL);
    }
    a.packed = 2;
    EXPECT_STATUS(epx_ll_dispatch(g, &a, &res, t->stream), EPX_ERR_INVALID_ARGUMENT);
    a.packed = 0; /* a layout range needs the packed layout */
    EXPECT_STATUS(epx_ll_dispatch(g, &a, &res, t->stream), EPX_ERR_INVALID_ARGUMENT);
    EXPECT(strstr(epx_last_error(), "args->layout_range") != NULL);
    a.layout_range = NULL;
    a.ue8m0 = 0; /* words need power-of-two scales */
    EXPECT_STATUS(epx_ll_dispatch(g, &a, &res, t->stream), EPX_ERR_INVALID_ARGUMENT);
    EXPECT(strstr(epx_last_error(), "args->ue8m0_packed") != NULL);
    a.ue8m0 = 1;
    a.ue8m0_packed = 3;
    EXPECT_STATUS(epx_ll_dispatch(g, &a, &res, t->stream), EPX_ERR_INVALID_ARGUMENT);
    /* Still works: the case itself (packed where the route allows it). */
    packed_case_t ok = c;
    ok.packed = route != EPX_LL_ROUTE_DIRECT;
    if (packed_cycle(t, g, &w, &ok, &d, range, "after refusals") != TEST_PASS) return TEST_FAIL;
    EXPECT_NO_ASYNC_ERROR(g, __func__);
    EXPECT_OK(epx_group_destroy(g));
  }
  EXPECT_CUDA(cudaFree(range));
  world_dev_free(&d);
  world_free(&w);
  return TEST_PASS;
}

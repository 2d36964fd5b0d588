/*
 * test_normal.c - normal-mode dispatch/combine on 2 and 4 GPUs against the CPU reference.
 *
 * Every rank builds the whole world (all ranks' tokens, routing, payload) from the test seed
 * (world.h, WORLD_NORMAL), so it can compute with tests/ref what it must receive and what
 * combine must return (normal_checks.h).
 *
 *   test                              what
 *   normal_dispatch_combine_cases     BF16 + FP8 bit-exact, counts, ids, weights, sources;
 *                                     combine (weighted/unweighted) vs float64; cached dispatch;
 *                                     random + adversarial routings (table below)
 *   normal_graph_replay               cached dispatch + combine captured once, replayed 100x
 *   normal_loop_1000                  1000 iterations, new T and routing each, all checked
 *   normal_refuses_bad_arguments      named errors, nothing sent, the group still works
 *   normal_bad_id_then_combine        an id outside [-1, E): async INVALID_ARGUMENT, empty slot;
 *                                     three combines after it (error on record) still right
 *   normal_combine_times_out          one rank skips a combine: TIMEOUT naming it, < budget+1s;
 *                                     the others' later combines refused, cleared or not
 *   normal_dispatch_count_timeout_is_returned  one rank skips a dispatch: the others' sync_counts
 *                                     dispatch returns EPX_ERR_TIMEOUT and num_recv = -1
 *   normal_late_rank_gets_an_error    one rank 1.5 s late (budget 0.5 s): every rank gets
 *                                     EPX_ERR_TIMEOUT, none wrong rows; then clear and recover
 *   normal_epoch_wraps                4 dispatches and combines across the notify epoch's wrap
 *   normal_too_many_tokens_fails_every_rank  one rank passes more tokens than the group holds:
 *                                     it gets INVALID_ARGUMENT, every other rank TIMEOUT naming
 *                                     it at once (not after the budget); then the group works
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpu/normal_checks.h"

static int run_case(epx_test_rank_t *t, const normal_case_t *c, uint64_t *rng) {
  const int R = t->num_ranks, me = t->rank;
  world_t w;
  world_make(&w, R, &c->world, WORLD_NORMAL, rng);
  epx_group_config_t cfg = gpu_test_config(w.M, w.H, w.E, w.K);
  cfg.modes = EPX_MODE_NORMAL;
  epx_group_t g = NULL;
  epx_handle_t h = NULL;
  EXPECT_OK(epx_group_create(t->comm, &cfg, &g));
  EXPECT_OK(epx_handle_create(g, &h));
  world_dev_t d;
  if (world_dev_make(&w, me, (size_t)R * w.M, &d) != TEST_PASS) return TEST_FAIL;
  const int align_choices[] = {0, 1, 4, 128};
  const int align = align_choices[epx_test_rand_int(rng, 4)];

  epx_ref_recv_t ref;
  memset(&ref, 0, sizeof ref);
  EXPECT(epx_ref_dispatch(&w.ref, me, c->fp8 ? EPX_REF_PAYLOAD_FP8 : EPX_REF_PAYLOAD_BF16,
                          align ? align : 1, &ref) == 0);

  epx_dispatch_args_t a = EPX_DISPATCH_ARGS_INIT;
  a.x = c->fp8 ? d.x8 : d.x;
  a.x_dtype = c->fp8 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16;
  a.x_scales = c->fp8 ? (const float *)d.sc : NULL;
  a.topk_idx = d.idx;
  a.topk_weights = (const float *)d.w;
  a.num_tokens = w.ranks[me].num_tokens;
  a.expert_alignment = align;
  int per_expert[EPX_MAX_EXPERTS];
  a.num_recv_per_expert = per_expert;
  epx_dispatch_result_t res;
  EXPECT_OK(epx_dispatch(g, h, &a, &res, t->stream));
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  EXPECT_EQ_INT(res.num_recv, ref.num_recv);
  for (int j = 0; j < w.E / R; j++)
    EXPECTF(per_expert[j] == ref.num_recv_per_expert_aligned[j],
            "%s: per-expert[%d] = %d, ref %d (align %d)", c->name, j, per_expert[j],
            ref.num_recv_per_expert_aligned[j], align);
  int dev_pe[EPX_MAX_EXPERTS];
  EXPECT_CUDA(cudaMemcpy(dev_pe, res.num_recv_per_expert_device, sizeof(int) * (w.E / R),
                         cudaMemcpyDeviceToHost));
  for (int j = 0; j < w.E / R; j++) EXPECT_EQ_INT(dev_pe[j], per_expert[j]);
  if (normal_check_recv(&w, me, &res, c->fp8, 1, &ref, c->name) != TEST_PASS) return TEST_FAIL;
  epx_ref_recv_free(&ref);

  /* Combine: expert outputs y_me, weighted then unweighted. */
  int nrecv = 0;
  uint16_t *y = normal_expert_output(&w, me, &nrecv);
  EXPECT_CUDA(cudaMemcpyAsync(d.y, y, (size_t)nrecv * w.H * 2, cudaMemcpyHostToDevice, t->stream));
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  free(y);
  for (int weighted = 1; weighted >= 0; weighted--) {
    EXPECT_CUDA(cudaMemsetAsync(d.out, 0xFF, (size_t)w.ranks[me].num_tokens * w.H * 2,
                                t->stream)); /* NaN */
    epx_combine_args_t ca = EPX_COMBINE_ARGS_INIT;
    ca.x = d.y;
    ca.out = d.out;
    if (weighted) ca.topk_idx = d.idx, ca.topk_weights = (const float *)d.w;
    EXPECT_OK(epx_combine(g, h, &ca, t->stream));
    EXPECT_CUDA(cudaStreamSynchronize(t->stream));
    char label[96];
    snprintf(label, sizeof label, "%s (%s combine)", c->name, weighted ? "weighted" : "unweighted");
    if (normal_check_combine(&w, me, d.out, weighted ? w.w[me] : NULL, label) != TEST_PASS)
      return TEST_FAIL;
  }

  /* Cached dispatch of fresh payload with the same routing. */
  for (int s = 0; s < R; s++)
    for (size_t i = 0; i < (size_t)w.ranks[s].num_tokens * w.H; i++)
      w.x[s][i] = epx_ref_bf16_from_float(epx_test_rand_unit(rng) - 0.5f);
  EXPECT_CUDA(cudaMemcpyAsync(d.x, w.x[me], (size_t)w.ranks[me].num_tokens * w.H * 2,
                              cudaMemcpyHostToDevice, t->stream));
  EXPECT_OK(epx_dispatch_cached(g, h, d.x, EPX_DTYPE_BF16, NULL, &res, t->stream));
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  memset(&ref, 0, sizeof ref);
  EXPECT(epx_ref_dispatch(&w.ref, me, EPX_REF_PAYLOAD_BF16, 1, &ref) == 0);
  char label[96];
  snprintf(label, sizeof label, "%s (cached)", c->name);
  if (normal_check_recv(&w, me, &res, 0, 1, &ref, label) != TEST_PASS) return TEST_FAIL;
  epx_ref_recv_free(&ref);

  EXPECT_NO_ASYNC_ERROR(g, c->name);
  world_dev_free(&d);
  world_free(&w);
  EXPECT_OK(epx_handle_destroy(h));
  EXPECT_OK(epx_group_destroy(g));
  return TEST_PASS;
}

/*   name  {T_max  H  E  K  routing  T  empty_rank} (the world_spec_t)  fp8 */
static const normal_case_t cases[] = {
    {"random_bf16", {512, 1024, 64, 8, ROUTE_UNIFORM, -1, -1}, 0},
    {"random_fp8", {512, 1024, 64, 8, ROUTE_UNIFORM, -1, -1}, 1},
    {"one_expert", {256, 512, 32, 4, ROUTE_ONE_EXPERT, 256, -1}, 0},
    {"all_empty", {256, 512, 32, 4, ROUTE_EMPTY, 256, -1}, 0},
    {"one_rank_gets_all", {256, 512, 32, 4, ROUTE_ONE_RANK, 256, -1}, 1},
    {"empty_rank", {256, 512, 32, 4, ROUTE_HOLES, -1, 1}, 0},
    {"e_equals_r_top1", {256, 264, 0, 1, ROUTE_UNIFORM, -1, -1}, 0},
    {"top16_e1024", {128, 512, 1024, 16, ROUTE_HOLES, -1, -1}, 1},
    {"deepep_shape", {4096, 7168, 256, 8, ROUTE_UNIFORM, 4096, -1}, 0},
    {"deepep_shape_fp8", {4096, 7168, 256, 8, ROUTE_UNIFORM, 4096, -1}, 1},
};

EPX_GPU_TEST(normal_dispatch_combine_cases, 600) {
  uint64_t rng = t->seed; /* the same on every rank: the world is shared */
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    if (run_case(t, &cases[i], &rng) != TEST_PASS) {
      fprintf(stderr, "  rank %d: case %s failed\n", t->rank, cases[i].name);
      return TEST_FAIL;
    }
  }
  return TEST_PASS;
}

/* A cached dispatch + combine (combine input = the received rows) captured once and replayed
 * 100 times; the payload changes every 20 replays and the output is checked each time. */
EPX_GPU_TEST(normal_graph_replay, 300) {
  const int R = t->num_ranks, me = t->rank;
  uint64_t rng = t->seed;
  const normal_case_t c = {"graph", {256, 1024, 32, 4, ROUTE_UNIFORM, -1, -1}, 0};
  world_t w;
  world_make(&w, R, &c.world, WORLD_NORMAL, &rng);
  epx_group_config_t cfg = gpu_test_config(w.M, w.H, w.E, w.K);
  epx_group_t g = NULL;
  epx_handle_t h = NULL;
  EXPECT_OK(epx_group_create(t->comm, &cfg, &g));
  EXPECT_OK(epx_handle_create(g, &h));
  world_dev_t d;
  if (world_dev_make(&w, me, (size_t)R * w.M, &d) != TEST_PASS) return TEST_FAIL;
  epx_dispatch_args_t a = EPX_DISPATCH_ARGS_INIT;
  a.x = d.x;
  a.topk_idx = d.idx;
  a.num_tokens = w.ranks[me].num_tokens;
  a.sync_counts = 0; /* no host sync: the whole dispatch could be captured too */
  epx_dispatch_result_t res;
  EXPECT_OK(epx_dispatch(g, h, &a, &res, t->stream));

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  EXPECT_CUDA(cudaStreamBeginCapture(t->stream, cudaStreamCaptureModeThreadLocal));
  EXPECT_OK(epx_dispatch_cached(g, h, d.x, EPX_DTYPE_BF16, NULL, &res, t->stream));
  epx_combine_args_t ca = EPX_COMBINE_ARGS_INIT;
  ca.x = res.recv_x;
  ca.out = d.out;
  EXPECT_OK(epx_combine(g, h, &ca, t->stream));
  EXPECT_CUDA(cudaStreamEndCapture(t->stream, &graph));
  EXPECT_CUDA(cudaGraphInstantiate(&exec, graph, 0));

  for (int replay = 0; replay < 100; replay++) {
    if (replay % 20 == 0) {
      for (int s = 0; s < R; s++)
        for (size_t i = 0; i < (size_t)w.ranks[s].num_tokens * w.H; i++)
          w.x[s][i] = epx_ref_bf16_from_float(4.f * epx_test_rand_unit(&rng) - 2.f);
      EXPECT_CUDA(cudaMemcpyAsync(d.x, w.x[me], (size_t)w.ranks[me].num_tokens * w.H * 2,
                                  cudaMemcpyHostToDevice, t->stream));
    }
    EXPECT_CUDA(cudaGraphLaunch(exec, t->stream));
    if (replay % 20 == 19) {
      EXPECT_CUDA(cudaStreamSynchronize(t->stream));
      /* Unweighted combine of the received rows: sum over ranks d of x (bit-exact inputs). */
      char label[32];
      snprintf(label, sizeof label, "replay %d", replay);
      if (normal_check_combine_unchanged(&w, me, d.out, label) != TEST_PASS) return TEST_FAIL;
    }
  }
  EXPECT_NO_ASYNC_ERROR(g, __func__);
  EXPECT_CUDA(cudaGraphExecDestroy(exec));
  EXPECT_CUDA(cudaGraphDestroy(graph));
  world_dev_free(&d);
  world_free(&w);
  EXPECT_OK(epx_handle_destroy(h));
  EXPECT_OK(epx_group_destroy(g));
  return TEST_PASS;
}

/* 1000 dispatch + combine iterations, token counts and routing new every iteration. */
EPX_GPU_TEST(normal_loop_1000, 600) {
  const int R = t->num_ranks, me = t->rank;
  uint64_t rng = t->seed;
  const int T_max = 96, H = 256, E = 8 * R, K = 4;
  epx_group_config_t cfg = gpu_test_config(T_max, H, E, K);
  epx_group_t g = NULL;
  epx_handle_t h = NULL;
  EXPECT_OK(epx_group_create(t->comm, &cfg, &g));
  EXPECT_OK(epx_handle_create(g, &h));
  for (int it = 0; it < 1000; it++) {
    const route_t routes[] = {ROUTE_UNIFORM, ROUTE_HOLES, ROUTE_ONE_RANK, ROUTE_UNIFORM};
    const normal_case_t c = {
        "loop", {T_max, H, E, K, routes[it % 4], -1, it % 7 == 3 ? it % R : -1}, 0};
    world_t w;
    world_make(&w, R, &c.world, WORLD_NORMAL, &rng);
    world_dev_t d;
    if (world_dev_make(&w, me, (size_t)R * T_max, &d) != TEST_PASS) return TEST_FAIL;
    epx_dispatch_args_t a = EPX_DISPATCH_ARGS_INIT;
    a.x = d.x;
    a.topk_idx = d.idx;
    a.topk_weights = (const float *)d.w;
    a.num_tokens = w.ranks[me].num_tokens;
    epx_dispatch_result_t res;
    EXPECT_OK(epx_dispatch(g, h, &a, &res, t->stream));
    /* epx_dispatch returns once the counts are known; the data may still be in flight. */
    EXPECT_CUDA(cudaStreamSynchronize(t->stream));
    epx_ref_recv_t ref;
    memset(&ref, 0, sizeof ref);
    EXPECT(epx_ref_dispatch(&w.ref, me, EPX_REF_PAYLOAD_BF16, 1, &ref) == 0);
    EXPECTF(res.num_recv == ref.num_recv, "iteration %d: num_recv %d, ref %d", it, res.num_recv,
            ref.num_recv);
    char label[64];
    snprintf(label, sizeof label, "iteration %d", it);
    if (normal_check_recv(&w, me, &res, 0, 1, &ref, label) != TEST_PASS) return TEST_FAIL;
    epx_ref_recv_free(&ref);
    int nrecv = 0;
    uint16_t *y = normal_expert_output(&w, me, &nrecv);
    EXPECT_CUDA(cudaMemcpyAsync(d.y, y, (size_t)nrecv * H * 2, cudaMemcpyHostToDevice, t->stream));
    EXPECT_CUDA(cudaStreamSynchronize(t->stream));
    free(y);
    epx_combine_args_t ca = EPX_COMBINE_ARGS_INIT;
    ca.x = d.y;
    ca.out = d.out;
    ca.topk_idx = d.idx;
    ca.topk_weights = (const float *)d.w;
    EXPECT_OK(epx_combine(g, h, &ca, t->stream));
    EXPECT_CUDA(cudaStreamSynchronize(t->stream));
    if (normal_check_combine(&w, me, d.out, w.w[me], label) != TEST_PASS) return TEST_FAIL;
    world_dev_free(&d);
    world_free(&w);
  }
  EXPECT_NO_ASYNC_ERROR(g, __func__);
  EXPECT_OK(epx_handle_destroy(h));
  EXPECT_OK(epx_group_destroy(g));
  return TEST_PASS;
}

typedef struct {
  const char *name;
  epx_dispatch_args_t args;
  const char *must_name; /* the message must contain this */
} bad_args_t;

static bad_args_t bad_case(const char *name, epx_dispatch_args_t args, const char *must_name) {
  bad_args_t b = {name, args, must_name};
  return b;
}

/* Bad arguments are refused with a named error before anything is sent; the group still works
 * (a full dispatch + combine right after is checked against the reference). */
EPX_GPU_TEST(normal_refuses_bad_arguments, 120) {
  const int R = t->num_ranks, me = t->rank;
  uint64_t rng = t->seed;
  const normal_case_t c = {"args", {64, 512, 4 * R, 2, ROUTE_UNIFORM, 64, -1}, 0};
  world_t w;
  world_make(&w, R, &c.world, WORLD_NORMAL, &rng);
  epx_group_config_t cfg = gpu_test_config(64, 512, 4 * R, 2);
  cfg.dtypes = EPX_DTYPE_BF16;
  epx_group_t g = NULL, g2 = NULL;
  epx_handle_t h = NULL, h2 = NULL;
  EXPECT_OK(epx_group_create(t->comm, &cfg, &g));
  EXPECT_OK(epx_group_create(t->comm, &cfg, &g2));
  EXPECT_OK(epx_handle_create(g, &h));
  EXPECT_OK(epx_handle_create(g2, &h2));
  world_dev_t d;
  if (world_dev_make(&w, me, (size_t)R * 64, &d) != TEST_PASS) return TEST_FAIL;
  epx_dispatch_args_t a = EPX_DISPATCH_ARGS_INIT;
  a.x = d.x;
  a.topk_idx = d.idx;
  a.topk_weights = (const float *)d.w;
  a.num_tokens = 64;
  epx_dispatch_result_t res;
  /* Before any dispatch (the too-many-tokens case below is one: it fails every rank's call but
   * leaves the handle holding that empty, failed exchange, as the peers' handles do). */
  EXPECT_STATUS(epx_combine(g, h, NULL, t->stream), EPX_ERR_INVALID_ARGUMENT);
  epx_combine_args_t ca = EPX_COMBINE_ARGS_INIT;
  ca.x = d.y;
  ca.out = d.out;
  EXPECT_STATUS(epx_combine(g, h, &ca, t->stream),
                EPX_ERR_INVALID_USAGE); /* nothing dispatched yet */
  EXPECT_STATUS(epx_dispatch_cached(g, h, d.x, EPX_DTYPE_BF16, NULL, &res, t->stream),
                EPX_ERR_INVALID_USAGE);
  bad_args_t bad[8];
  int nb = 0;
  bad[nb] = bad_case("too many tokens", a, "num_tokens"), bad[nb++].args.num_tokens = 65;
  bad[nb] = bad_case("null x", a, "x"), bad[nb++].args.x = NULL;
  bad[nb] = bad_case("misaligned x", a, "aligned"), bad[nb++].args.x = (char *)d.x + 8;
  bad[nb] = bad_case("fp8 on a bf16 group", a, "x_dtype"),
  bad[nb++].args.x_dtype = EPX_DTYPE_FP8_E4M3;
  bad[nb] = bad_case("null topk_idx", a, "topk_idx"), bad[nb++].args.topk_idx = NULL;
  bad[nb] = bad_case("host topk_idx", a, "topk_idx"), bad[nb++].args.topk_idx = w.idx[me];
  bad[nb] = bad_case("bad size", a, "size"), bad[nb++].args.size = 3;
  for (int i = 0; i < nb; i++) {
    epx_status_t s = epx_dispatch(g, h, &bad[i].args, &res, t->stream);
    EXPECTF(s == EPX_ERR_INVALID_ARGUMENT, "%s: got %s", bad[i].name, epx_status_string(s));
    EXPECTF(strstr(epx_last_error(), bad[i].must_name) != NULL, "%s: message '%s' does not name %s",
            bad[i].name, epx_last_error(), bad[i].must_name);
  }
  EXPECT_STATUS(epx_dispatch(g, h2, &a, &res, t->stream),
                EPX_ERR_INVALID_USAGE); /* another group's handle */
  EXPECT(strstr(epx_last_error(), "another group") != NULL);

  /* A payload on another GPU (the next rank's) is refused by name, nothing sent. A one-rank
   * group has no other GPU to try. */
  if (t->num_ranks > 1) {
    void *other_gpu_x = NULL;
    EXPECT_CUDA(cudaSetDevice((t->rank + 1) % t->num_ranks));
    const cudaError_t other_alloc = cudaMalloc(&other_gpu_x, (size_t)w.M * w.H * 2);
    EXPECT_CUDA(cudaSetDevice(t->rank));
    EXPECT_CUDA(other_alloc);
    epx_dispatch_args_t elsewhere = a;
    elsewhere.x = other_gpu_x;
    EXPECT_STATUS(epx_dispatch(g, h, &elsewhere, &res, t->stream), EPX_ERR_INVALID_ARGUMENT);
    EXPECTF(strstr(epx_last_error(), "args->x") && strstr(epx_last_error(), "current GPU"),
            "message: %s", epx_last_error());
    EXPECT_CUDA(cudaFree(other_gpu_x));
  }

  /* The group still works, even with a CUDA error the application left pending (a failed
   * allocation): EPX must not take it for its own after queuing its kernels (issue 14). */
  void *too_big = NULL;
  EXPECT(cudaMalloc(&too_big, (size_t)1 << 50) != cudaSuccess);
  EXPECT_OK(epx_dispatch(g, h, &a, &res, t->stream));
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  epx_ref_recv_t ref;
  memset(&ref, 0, sizeof ref);
  EXPECT(epx_ref_dispatch(&w.ref, me, EPX_REF_PAYLOAD_BF16, 1, &ref) == 0);
  if (normal_check_recv(&w, me, &res, 0, 1, &ref, "after bad arguments") != TEST_PASS)
    return TEST_FAIL;
  epx_ref_recv_free(&ref);
  EXPECT_OK(epx_handle_destroy(h2));
  EXPECT_OK(epx_handle_destroy(h));
  EXPECT_STATUS(epx_combine(g, h, &ca, t->stream), EPX_ERR_INVALID_USAGE); /* destroyed handle */
  world_dev_free(&d);
  world_free(&w);
  EXPECT_OK(epx_group_destroy(g2));
  EXPECT_OK(epx_group_destroy(g));
  return TEST_PASS;
}

/* An expert id outside [-1, E) is reported (async INVALID_ARGUMENT from the layout) and treated
 * as an empty slot; the combines that follow, with that error still on record, are still right:
 * a combine must not take an older async error for a timeout of its own and stop waiting. */
EPX_GPU_TEST(normal_bad_id_then_combine, 120) {
  const int R = t->num_ranks, me = t->rank;
  uint64_t rng = t->seed;
  const normal_case_t c = {"bad_id", {256, 1024, 8 * R, 4, ROUTE_UNIFORM, 256, -1}, 0};
  world_t w;
  world_make(&w, R, &c.world, WORLD_NORMAL, &rng);
  for (int s = 0; s < R; s++) w.idx[s][1] = w.E + 3; /* token 0, slot 1, on every rank */
  epx_group_config_t cfg = gpu_test_config(w.M, w.H, w.E, w.K);
  epx_group_t g = NULL;
  epx_handle_t h = NULL;
  EXPECT_OK(epx_group_create(t->comm, &cfg, &g));
  EXPECT_OK(epx_handle_create(g, &h));
  world_dev_t d;
  if (world_dev_make(&w, me, (size_t)R * w.M, &d) != TEST_PASS) return TEST_FAIL;
  epx_dispatch_args_t a = EPX_DISPATCH_ARGS_INIT;
  a.x = d.x;
  a.topk_idx = d.idx;
  a.topk_weights = (const float *)d.w;
  a.num_tokens = w.ranks[me].num_tokens;
  epx_dispatch_result_t res;
  EXPECT_OK(epx_dispatch(g, h, &a, &res, t->stream));
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  epx_ref_recv_t ref;
  memset(&ref, 0, sizeof ref);
  EXPECT(epx_ref_dispatch(&w.ref, me, EPX_REF_PAYLOAD_BF16, 1, &ref) == 0);
  if (normal_check_recv(&w, me, &res, 0, 1, &ref, "bad id dispatch") != TEST_PASS) return TEST_FAIL;
  epx_ref_recv_free(&ref);
  int nrecv = 0;
  uint16_t *y = normal_expert_output(&w, me, &nrecv);
  EXPECT_CUDA(cudaMemcpy(d.y, y, (size_t)nrecv * w.H * 2, cudaMemcpyHostToDevice));
  EXPECT_CUDA(cudaDeviceSynchronize()); /* legacy-stream copy before the test stream's work */
  free(y);
  for (int rep = 0; rep < 3; rep++) { /* both slab parities, the error still on record */
    epx_combine_args_t ca = EPX_COMBINE_ARGS_INIT;
    ca.x = d.y;
    ca.out = d.out;
    ca.topk_idx = d.idx;
    ca.topk_weights = (const float *)d.w;
    EXPECT_CUDA(cudaMemsetAsync(d.out, 0xFF, (size_t)a.num_tokens * w.H * 2, t->stream));
    EXPECT_OK(epx_combine(g, h, &ca, t->stream));
    EXPECT_CUDA(cudaStreamSynchronize(t->stream));
    char label[48];
    snprintf(label, sizeof label, "combine %d after a bad id", rep);
    if (normal_check_combine(&w, me, d.out, w.w[me], label) != TEST_PASS) return TEST_FAIL;
  }
  epx_async_error_t err;
  EXPECT_OK(epx_group_get_async_error(g, &err));
  EXPECT_EQ_INT(err.status, EPX_ERR_INVALID_ARGUMENT);
  EXPECT_EQ_INT(err.stage, EPX_STAGE_LAYOUT);
  EXPECT_OK(epx_group_clear_async_error(g));
  world_dev_free(&d);
  world_free(&w);
  EXPECT_OK(epx_handle_destroy(h));
  EXPECT_OK(epx_group_destroy(g));
  return TEST_PASS;
}

/* The last rank skips a combine: the others return, within the budget + 1 s, with TIMEOUT in
 * stage COMBINE naming it. */
EPX_PEER_TEST(normal_combine_times_out, 120) {
  const int R = t->num_ranks, me = t->rank;
  uint64_t rng = t->seed;
  const normal_case_t c = {"timeout", {64, 512, 4 * R, 2, ROUTE_UNIFORM, 64, -1}, 0};
  normal_fixture_t f;
  if (normal_fixture_make(t, &c.world, 500, &rng, &f) != TEST_PASS) return TEST_FAIL;
  const epx_group_t g = f.g;
  const epx_handle_t h = f.h;
  const world_dev_t d = f.d;
  epx_dispatch_args_t a = EPX_DISPATCH_ARGS_INIT;
  a.x = d.x;
  a.topk_idx = d.idx;
  a.num_tokens = 64;
  epx_dispatch_result_t res;
  EXPECT_OK(epx_dispatch(g, h, &a, &res, t->stream));
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  const int missing = R - 1;
  if (me != missing) {
    const double t0 = epx_test_now_s();
    epx_combine_args_t ca = EPX_COMBINE_ARGS_INIT;
    ca.x = res.recv_x;
    ca.out = d.out;
    EXPECT_OK(epx_combine(g, h, &ca, t->stream));
    EXPECT_CUDA(cudaStreamSynchronize(t->stream));
    const double waited = epx_test_now_s() - t0;
    epx_async_error_t err;
    EXPECT_OK(epx_group_get_async_error(g, &err));
    printf("  rank %d: combine returned after %.3f s: %s\n", me, waited, err.message);
    EXPECT_EQ_INT(err.status, EPX_ERR_TIMEOUT);
    EXPECT_EQ_INT(err.stage, EPX_STAGE_COMBINE);
    EXPECT_EQ_INT(err.peer, missing);
    EXPECTF(waited < 1.5, "took %.3f s with a 0.5 s budget", waited);
    /* The counters no longer agree: a later combine is refused, before and after a clear
     * (nothing queued: no rank waits for it). */
    EXPECT_STATUS(epx_combine(g, h, &ca, t->stream), EPX_ERR_INVALID_USAGE);
    EXPECT_OK(epx_group_clear_async_error(g));
    EXPECT_STATUS(epx_combine(g, h, &ca, t->stream), EPX_ERR_INVALID_USAGE);
    printf("  rank %d: a later combine: %s\n", me, epx_last_error());
  }
  if (gpu_host_barrier(t) != TEST_PASS) return TEST_FAIL;
  return normal_fixture_free(&f, c.name);
}

/* The last rank skips two dispatches with sync_counts = 1: the others' epx_dispatch returns
 * EPX_ERR_TIMEOUT (not EPX_OK with num_recv = 0) with num_recv = -1 both times, and the record
 * names the stage NOTIFY and the missing rank. The second comes with the first's error still
 * on record (uncleared): it used to return EPX_OK with num_recv = 0 then. */
EPX_PEER_TEST(normal_dispatch_count_timeout_is_returned, 120) {
  const int R = t->num_ranks, me = t->rank;
  uint64_t rng = t->seed;
  const normal_case_t c = {"timeout", {64, 512, 4 * R, 2, ROUTE_UNIFORM, 64, -1}, 0};
  normal_fixture_t f;
  if (normal_fixture_make(t, &c.world, 500, &rng, &f) != TEST_PASS) return TEST_FAIL;
  const epx_group_t g = f.g;
  const epx_handle_t h = f.h;
  const world_dev_t d = f.d;
  const int missing = R - 1;
  for (int round = 0; round < 2 && me != missing; round++) {
    epx_dispatch_args_t a = EPX_DISPATCH_ARGS_INIT;
    a.x = d.x;
    a.topk_idx = d.idx;
    a.num_tokens = 64;
    epx_dispatch_result_t res;
    res.num_recv = 12345;
    EXPECT_STATUS(epx_dispatch(g, h, &a, &res, t->stream), EPX_ERR_TIMEOUT);
    printf("  rank %d, round %d: %s\n", me, round, epx_last_error());
    EXPECT_EQ_INT(res.num_recv, -1);
    EXPECT_CUDA(cudaStreamSynchronize(t->stream));
    epx_async_error_t err;
    EXPECT_OK(epx_group_get_async_error(g, &err));
    EXPECT_EQ_INT(err.status, EPX_ERR_TIMEOUT);
    EXPECT_EQ_INT(err.stage, EPX_STAGE_NOTIFY);
    EXPECT_EQ_INT(err.peer, missing);
  }
  if (gpu_host_barrier(t) != TEST_PASS) return TEST_FAIL;
  return normal_fixture_free(&f, c.name);
}

/* The last rank arrives 1.5 s late (budget 0.5 s) at a dispatch the others already gave up on.
 * Every rank's epx_dispatch returns EPX_ERR_TIMEOUT (num_recv -1): the others' count exchange
 * timed out; the late one's completed, but its peers had announced that they send nothing in
 * that call (control notify_abort), so it fails too instead of returning rows its peers placed
 * with counts they never had (85 of 158 rows wrong, EPX_OK, before). Then every rank clears the
 * error and the next dispatch and combine are right. */
EPX_PEER_TEST(normal_late_rank_gets_an_error, 120) {
  const int R = t->num_ranks, me = t->rank, late = R - 1;
  uint64_t rng = t->seed;
  const normal_case_t c = {"late", {64, 512, 4 * R, 2, ROUTE_UNIFORM, 64, -1}, 0};
  normal_fixture_t f;
  if (normal_fixture_make(t, &c.world, 500, &rng, &f) != TEST_PASS) return TEST_FAIL;
  const world_t *const w = &f.w;
  const epx_group_t g = f.g;
  const epx_handle_t h = f.h;
  const world_dev_t d = f.d;
  epx_dispatch_args_t a = EPX_DISPATCH_ARGS_INIT;
  a.x = d.x;
  a.topk_idx = d.idx;
  a.topk_weights = (const float *)d.w;
  a.num_tokens = w->ranks[me].num_tokens;
  epx_dispatch_result_t res;
  if (me == late) usleep(1500 * 1000);
  const epx_status_t st = epx_dispatch(g, h, &a, &res, t->stream);
  printf("  rank %d%s: epx_dispatch: %s: %s\n", me, me == late ? " (late)" : "",
         epx_status_string(st), epx_last_error());
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  EXPECT_EQ_INT(st, EPX_ERR_TIMEOUT);
  EXPECT_EQ_INT(res.num_recv, -1);
  epx_async_error_t err;
  EXPECT_OK(epx_group_get_async_error(g, &err));
  EXPECT_EQ_INT(err.status, EPX_ERR_TIMEOUT);
  EXPECT_EQ_INT(err.stage, EPX_STAGE_NOTIFY);
  EXPECTF(me == late ? err.peer != late : err.peer == late, "rank %d: the record names peer %d", me,
          err.peer);

  /* Recovery: clear on every rank, then a dispatch everyone makes in time is right. */
  if (gpu_host_barrier(t) != TEST_PASS) return TEST_FAIL;
  EXPECT_OK(epx_group_clear_async_error(g));
  if (gpu_host_barrier(t) != TEST_PASS) return TEST_FAIL;
  if (normal_round_trip_and_check(t, &f, "after the late rank") != TEST_PASS) return TEST_FAIL;
  EXPECT_OK(epx_group_get_async_error(g, &err));
  EXPECTF(err.status == EPX_OK, "rank %d: after recovery: %s", me, err.message);
  if (gpu_host_barrier(t) != TEST_PASS) return TEST_FAIL;
  return normal_fixture_free(&f, c.name);
}

/* The last rank passes max_tokens_per_rank + 1 tokens, the others their usual ones, budget 3 s.
 * The last rank's epx_dispatch returns EPX_ERR_INVALID_ARGUMENT naming the token count; every
 * other rank's returns EPX_ERR_TIMEOUT (stage NOTIFY, naming the last rank) well inside the
 * budget: the refused rank still ran its count exchange, telling its peers it gave up. Without
 * clearing anything (the refusing rank's record is clean), the next dispatch and combine of
 * every rank are right: the counters stayed in step. Then the same with sync_counts = 0. */
EPX_PEER_TEST(normal_too_many_tokens_fails_every_rank, 120) {
  const int R = t->num_ranks, me = t->rank, over = R - 1;
  uint64_t rng = t->seed;
  const normal_case_t c = {"too many", {64, 512, 4 * R, 2, ROUTE_UNIFORM, 64, -1}, 0};
  normal_fixture_t f;
  if (normal_fixture_make(t, &c.world, 3000, &rng, &f) != TEST_PASS) return TEST_FAIL;
  const world_t *const w = &f.w;
  const epx_group_t g = f.g;
  const epx_handle_t h = f.h;
  const world_dev_t d = f.d;
  for (int sync = 1; sync >= 0; sync--) {
    epx_dispatch_args_t a = EPX_DISPATCH_ARGS_INIT;
    a.x = d.x;
    a.topk_idx = d.idx;
    a.topk_weights = (const float *)d.w;
    a.num_tokens = me == over ? w->M + 1 : w->ranks[me].num_tokens;
    a.sync_counts = sync;
    epx_dispatch_result_t res;
    if (gpu_host_barrier(t) != TEST_PASS) return TEST_FAIL;
    const double t0 = epx_test_now_s();
    const epx_status_t st = epx_dispatch(g, h, &a, &res, t->stream);
    printf("  rank %d (sync_counts %d): %s: %s\n", me, sync, epx_status_string(st),
           epx_last_error());
    EXPECT_CUDA(cudaStreamSynchronize(t->stream));
    const double took = epx_test_now_s() - t0;
    EXPECTF(took < 1.0, "rank %d: the failed call took %.3f s (budget 3 s)", me, took);
    epx_async_error_t err;
    EXPECT_OK(epx_group_get_async_error(g, &err));
    if (me == over) {
      EXPECT_STATUS(st, EPX_ERR_INVALID_ARGUMENT);
      EXPECT(strstr(epx_last_error(), "num_tokens") != NULL);
      EXPECTF(err.status == EPX_OK, "rank %d: the refusing rank's record: %s", me, err.message);
    } else {
      EXPECT_STATUS(st, sync ? EPX_ERR_TIMEOUT : EPX_OK);
      EXPECT_EQ_INT(err.status, EPX_ERR_TIMEOUT);
      EXPECT_EQ_INT(err.stage, EPX_STAGE_NOTIFY);
      EXPECT_EQ_INT(err.peer, over);
      EXPECT_OK(epx_group_clear_async_error(g));
    }
    /* The next call of every rank is right. */
    if (gpu_host_barrier(t) != TEST_PASS) return TEST_FAIL;
    if (normal_round_trip_and_check(t, &f, "after the refusal") != TEST_PASS) return TEST_FAIL;
    EXPECT_OK(epx_group_get_async_error(g, &err));
    EXPECTF(err.status == EPX_OK, "rank %d: after the refusal: %s", me, err.message);
  }
  if (gpu_host_barrier(t) != TEST_PASS) return TEST_FAIL;
  return normal_fixture_free(&f, c.name);
}

/* The notify epoch is 32 bits and wraps after 2^32 count exchanges (days at 100 us per call).
 * Started just before the wrap (the counter and the inbox words as the previous call left
 * them), four dispatches and combines across it are right: the epoch skips 0 ("never" for the
 * abort words) and the inbox compare is wrap-safe. */
EPX_GPU_TEST(normal_epoch_wraps, 120) {
  const int R = t->num_ranks, me = t->rank;
  uint64_t rng = t->seed;
  const normal_case_t c = {"wrap", {64, 512, 4 * R, 2, ROUTE_UNIFORM, -1, -1}, 0};
  normal_fixture_t f;
  if (normal_fixture_make(t, &c.world, 0, &rng, &f) != TEST_PASS) return TEST_FAIL;
  const world_t *const w = &f.w;
  const epx_group_t g = f.g;
  const epx_handle_t h = f.h;
  const world_dev_t d = f.d;
  const unsigned int before_wrap = 0xFFFFFFFEu;
  epx__control_t *ctrl = (epx__control_t *)(g->workspace + g->layout.control_offset);
  EXPECT_CUDA(
      cudaMemcpy(&ctrl->notify_epoch, &before_wrap, sizeof before_wrap, cudaMemcpyHostToDevice));
  const size_t words = g->layout.notify_bytes / 8;
  uint64_t *inbox = malloc(words * 8 + 8);
  for (size_t i = 0; i < words; i++) inbox[i] = (uint64_t)before_wrap << 32;
  EXPECT_CUDA(
      cudaMemcpy(g->workspace + g->layout.notify_offset, inbox, words * 8, cudaMemcpyHostToDevice));
  free(inbox);
  if (gpu_host_barrier(t) != TEST_PASS) return TEST_FAIL;
  epx_ref_recv_t ref;
  memset(&ref, 0, sizeof ref);
  EXPECT(epx_ref_dispatch(&w->ref, me, EPX_REF_PAYLOAD_BF16, 1, &ref) == 0);
  for (int call = 0; call < 4; call++) { /* epochs 0xFFFFFFFF, 1, 2, 3 */
    char label[64];
    snprintf(label, sizeof label, "call %d across the epoch wrap", call);
    epx_dispatch_args_t a = EPX_DISPATCH_ARGS_INIT;
    a.x = d.x;
    a.topk_idx = d.idx;
    a.topk_weights = (const float *)d.w;
    a.num_tokens = w->ranks[me].num_tokens;
    epx_dispatch_result_t res;
    EXPECT_OK(epx_dispatch(g, h, &a, &res, t->stream));
    EXPECT_CUDA(cudaStreamSynchronize(t->stream));
    EXPECT_EQ_INT(res.num_recv, ref.num_recv);
    if (normal_check_recv(w, me, &res, 0, 1, &ref, label) != TEST_PASS) return TEST_FAIL;
    if (normal_combine_and_check(t, &f, label) != TEST_PASS) return TEST_FAIL;
  }
  unsigned int now = 0;
  EXPECT_CUDA(cudaMemcpy(&now, &ctrl->notify_epoch, sizeof now, cudaMemcpyDeviceToHost));
  EXPECT_EQ_INT(now, 3);
  EXPECT_NO_ASYNC_ERROR(g, "epoch wrap");
  epx_ref_recv_free(&ref);
  return normal_fixture_free(&f, c.name);
}

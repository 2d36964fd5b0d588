/*
 * test_ll_extras.c - GPU tests of the low-latency features DeepEP callers rely on (issue 12,
 * items 2, 7 and 10), each result checked against the CPU reference (tests/ref) through
 * ll_checks, with the receive arrays, the returned rows and the outputs poisoned first:
 *   ll_combine_time_weights  weights given to epx_ll_combine (DeepEP's low_latency_combine
 *                            topk_weights) on every route, fused and split (weights uploaded
 *                            between the send and epx_ll_recv), zero copy, with and without
 *                            dispatch-time weights, adversarial routings; calls with and
 *                            without combine-time weights alternate in one group
 *   ll_separate_maxima       one group with both modes, normal max 256 and low-latency max 32:
 *                            normal calls of 200 tokens and low-latency calls interleave; a
 *                            low-latency call of 33 tokens is refused by name, the group goes on
 *   ll_maxima_must_agree     ranks passing different ll_max_tokens_per_rank are refused by name;
 *                            a group without low-latency mode refuses epx_group_mask_peer
 *   ll_manual_peer_mask      every rank masks the last one (which makes no call): the others'
 *                            calls and epx_group_barrier_unmasked finish at once with the live
 *                            ranks' results, no async error, the query shows the mask; after the
 *                            collective clear every rank works again, and the unmasked barrier
 *                            waits for a rank 300 ms late; bad peers are refused by name
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpu/ll_checks.h"
#include "gpu/normal_checks.h"

/* A combine-time weights case. */
typedef struct {
  const char *name;
  world_spec_t world;
  int fp8, split, zero_copy;
  int dispatch_weights; /* 1: the dispatch gets the world's weights (the combine's must win) */
} cw_case_t;

static const char *route_label(int route) {
  static const char *const names[] = {"auto", "direct", "by-rank", "dispatch-by-rank"};
  return names[route];
}

/* The combine of res with combine-time weights cw (NULL: none; then the dispatch's count) into a
 * poisoned out, checked against the reference of world w given those weights. Split: cw_dev
 * holds NaN until the weights are copied in on the stream between the send and epx_ll_recv
 * (the receive half is what reads them). */
static int weighted_combine(epx_test_rank_t *t, epx_group_t g, const world_t *w, float *const *cw,
                            const cw_case_t *c, const epx_ll_dispatch_result_t *res,
                            const world_dev_t *d, float *cw_dev, uint16_t *const *y,
                            const char *label) {
  const int me = t->rank;
  const size_t cw_bytes = (size_t)w->ranks[me].num_tokens * w->K * sizeof(float);
  EXPECT_CUDA(cudaMemset(d->out, 0xff, (size_t)w->M * w->H * 2));
  EXPECT_CUDA(cudaMemset(cw_dev, 0xff, (size_t)w->M * w->K * sizeof(float)));
  if (cw && !c->split) EXPECT_CUDA(cudaMemcpy(cw_dev, cw[me], cw_bytes, cudaMemcpyHostToDevice));
  EXPECT_CUDA(cudaDeviceSynchronize());
  epx_ll_hook_t hook = {0};
  epx_ll_combine_args_t ca = EPX_LL_COMBINE_ARGS_INIT;
  ca.dispatch = res;
  ca.x = c->zero_copy ? NULL : d->y;
  ca.out = d->out;
  ca.topk_weights = cw ? cw_dev : NULL;
  ca.split = c->split;
  ca.hook = &hook;
  EXPECT_OK(epx_ll_combine(g, &ca, t->stream));
  if (c->split) {
    if (cw)
      EXPECT_CUDA(cudaMemcpyAsync(cw_dev, cw[me], cw_bytes, cudaMemcpyHostToDevice, t->stream));
    EXPECT_OK(epx_ll_recv(g, &hook, t->stream));
  }
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  world_t wc = *w; /* the reference with the weights this combine applies */
  for (int s = 0; s < w->R; s++) {
    if (cw) wc.ranks[s].topk_weights = cw[s];
    if (!c->dispatch_weights && !cw) wc.ranks[s].topk_weights = NULL;
  }
  wc.ref.ranks = wc.ranks;
  return ll_check_combine(&wc, me, d->out, y, label);
}

/* One dispatch of the inputs already uploaded to d (dispatch-time weights if c says so), checked
 * against world w, then weighted_combine of its expert outputs. Callers upload and poison. */
static int weights_cycle(epx_test_rank_t *t, epx_group_t g, const world_t *w, float *const *cw,
                         const cw_case_t *c, const world_dev_t *d, float *cw_dev,
                         const char *label) {
  const int me = t->rank;
  epx_ll_dispatch_args_t da = EPX_LL_DISPATCH_ARGS_INIT;
  da.num_tokens = w->ranks[me].num_tokens;
  da.recv_dtype = c->fp8 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16;
  da.x = d->x, da.topk_idx = d->idx, da.split = c->split;
  if (c->dispatch_weights) da.topk_weights = (const float *)d->w;
  epx_ll_dispatch_result_t res;
  EXPECT_OK(epx_ll_dispatch(g, &da, &res, t->stream));
  if (c->split) EXPECT_OK(epx_ll_recv(g, &res.hook, t->stream));
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  if (ll_check_dispatch(w, me, &res, c->fp8, 0, label) != TEST_PASS) return TEST_FAIL;
  uint16_t *y[EPX_MAX_RANKS];
  if (ll_expert_outputs(w, y) != TEST_PASS) return TEST_FAIL;
  int r = ll_upload_outputs(w, me, y, c->zero_copy ? res.combine_input : d->y);
  if (r == TEST_PASS) r = weighted_combine(t, g, w, cw, c, &res, d, cw_dev, y, label);
  for (int q = 0; q < w->R; q++) free(y[q]);
  return r;
}

/* world_upload, ll_poison, weights_cycle: a checked call of every rank. */
static int full_cycle(epx_test_rank_t *t, epx_group_t g, const world_t *w, float *const *cw,
                      const cw_case_t *c, const world_dev_t *d, float *cw_dev, const char *label) {
  if (world_upload(w, t->rank, d) != TEST_PASS || ll_poison(t, g) != TEST_PASS) return TEST_FAIL;
  return weights_cycle(t, g, w, cw, c, d, cw_dev, label);
}

/*   name  {M  H  E  K  routing  T  empty_rank} (the world_spec_t)  fp8 split zero_copy dispW */
static const cw_case_t cw_cases[] = {
    {"uniform_bf16", {64, 640, 32, 8, ROUTE_UNIFORM, -1, -1}, 0, 0, 0, 1},
    {"duplicates_fp8_split", {64, 256, 16, 6, ROUTE_DUPLICATES, -1, -1}, 1, 1, 0, 1},
    {"holes_fp8_zero_copy_no_dispatch_weights", {48, 384, 16, 4, ROUTE_HOLES, -1, -1}, 1, 0, 1, 0},
    {"one_expert_split_zero_copy", {64, 256, 16, 4, ROUTE_ONE_EXPERT, 64, -1}, 0, 1, 1, 1},
    {"one_rank_gets_all", {64, 256, 16, 4, ROUTE_ONE_RANK, 64, -1}, 0, 0, 0, 0},
    {"all_empty", {32, 256, 16, 4, ROUTE_EMPTY, 32, -1}, 0, 0, 0, 1},
    {"empty_rank_split", {64, 256, 16, 4, ROUTE_HOLES, -1, 1}, 1, 1, 0, 0},
    {"top16_e64_duplicates_zero_copy", {32, 256, 64, 16, ROUTE_DUPLICATES, -1, -1}, 0, 0, 1, 1},
    {"deepep_shape_fp8_split", {128, 7168, 256, 8, ROUTE_UNIFORM, 128, -1}, 1, 1, 0, 1},
};

/* A low-latency group and what its calls need: the world (drawn with WORLD_LL), every rank's
 * combine-time weights, this rank's device buffers. */
typedef struct {
  world_t w;
  float *cw[EPX_MAX_RANKS];
  epx_group_t g;
  world_dev_t d;
  float *cw_dev; /* [M, K] */
} fixture_t;

/* The fixture of spec: a group of route with ll_max_tokens_per_rank = spec->max_tokens, and
 * also normal mode up to normal_max tokens if normal_max > 0. */
static int fixture_make(epx_test_rank_t *t, const world_spec_t *spec, int route, int normal_max,
                        uint64_t *rng, fixture_t *f) {
  const int R = t->num_ranks;
  memset(f, 0, sizeof *f);
  world_make(&f->w, R, spec, WORLD_LL, rng);
  for (int s = 0; s < R; s++) f->cw[s] = ll_draw_combine_weights(&f->w, s, rng);
  const world_t *w = &f->w;
  epx_group_config_t cfg = gpu_test_config(normal_max > 0 ? normal_max : w->M, w->H, w->E, w->K);
  cfg.modes = EPX_MODE_LOW_LATENCY | (normal_max > 0 ? EPX_MODE_NORMAL : 0);
  cfg.ll_route = route;
  cfg.ll_max_tokens_per_rank = w->M;
  EXPECT_OK(epx_group_create(t->comm, &cfg, &f->g));
  if (world_dev_alloc(w, (size_t)w->L * R * w->M, &f->d) != TEST_PASS) return TEST_FAIL;
  EXPECT_CUDA(cudaMalloc((void **)&f->cw_dev, (size_t)w->M * w->K * sizeof(float) + 16));
  return TEST_PASS;
}

static int fixture_free(fixture_t *f) {
  EXPECT_CUDA(cudaFree(f->cw_dev));
  for (int s = 0; s < f->w.R; s++) free(f->cw[s]);
  world_dev_free(&f->d);
  world_free(&f->w);
  EXPECT_OK(epx_group_destroy(f->g));
  return TEST_PASS;
}

/* Calls 0 and 2 of a group combine with combine-time weights, call 1 without (route BY_RANK
 * switches between its two combines), each on the buffer after the previous one. */
static int weights_case(epx_test_rank_t *t, int route, const cw_case_t *c, uint64_t *rng) {
  fixture_t f;
  if (fixture_make(t, &c->world, route, 0, rng, &f) != TEST_PASS) return TEST_FAIL;
  for (int call = 0; call < 3; call++) {
    char label[160];
    snprintf(label, sizeof label, "%s (%s, call %d, %s)", c->name, route_label(route), call,
             call == 1 ? "dispatch-time weights" : "combine-time weights");
    if (full_cycle(t, f.g, &f.w, call == 1 ? NULL : f.cw, c, &f.d, f.cw_dev, label) != TEST_PASS) {
      fprintf(stderr, "  rank %d: %s failed\n", t->rank, label);
      return TEST_FAIL;
    }
  }
  EXPECT_NO_ASYNC_ERROR(f.g, c->name);
  return fixture_free(&f);
}

EPX_GPU_TEST(ll_combine_time_weights, 900) {
  for (int route = EPX_LL_ROUTE_DIRECT; route <= EPX_LL_ROUTE_DISPATCH_BY_RANK; route++) {
    uint64_t rng = t->seed; /* the same on every rank: the world is shared */
    for (size_t i = 0; i < sizeof cw_cases / sizeof cw_cases[0]; i++)
      if (weights_case(t, route, &cw_cases[i], &rng) != TEST_PASS) return TEST_FAIL;
  }
  return TEST_PASS;
}

/* One normal dispatch of world w (rows sent back unchanged, unweighted combine), checked. */
static int normal_cycle(epx_test_rank_t *t, epx_group_t g, epx_handle_t h, const world_t *w,
                        const world_dev_t *d, const char *label) {
  const int me = t->rank;
  epx_dispatch_args_t a = EPX_DISPATCH_ARGS_INIT;
  a.num_tokens = w->ranks[me].num_tokens;
  a.topk_idx = d->idx;
  a.x = d->x;
  epx_dispatch_result_t res;
  EXPECT_OK(epx_dispatch(g, h, &a, &res, t->stream));
  EXPECT_CUDA(cudaMemsetAsync(d->out, 0xff, (size_t)w->M * w->H * 2, t->stream));
  epx_combine_args_t ca = EPX_COMBINE_ARGS_INIT;
  ca.out = d->out;
  ca.x = res.recv_x;
  EXPECT_OK(epx_combine(g, h, &ca, t->stream));
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  return normal_check_combine_unchanged(w, me, d->out, label);
}

EPX_GPU_TEST(ll_separate_maxima, 300) {
  const int R = t->num_ranks, me = t->rank, ll_max = 32;
  uint64_t rng = t->seed;
  const world_spec_t normal_spec = {256, 1024, 4 * R, 4, ROUTE_UNIFORM, 200, -1};
  const cw_case_t ll_case = {"ll", {ll_max, 1024, 4 * R, 4, ROUTE_HOLES, -1, -1}, 1, 0, 0, 1};
  fixture_t f; /* both modes: normal up to 256 tokens, low-latency up to 32 */
  if (fixture_make(t, &ll_case.world, EPX_LL_ROUTE_AUTO, normal_spec.max_tokens, &rng, &f) !=
      TEST_PASS)
    return TEST_FAIL;
  epx_group_config_t got;
  EXPECT_OK(epx_group_get_config(f.g, &got));
  EXPECT_EQ_INT(got.max_tokens_per_rank, 256);
  EXPECT_EQ_INT(got.ll_max_tokens_per_rank, ll_max);
  epx_workspace_sizes_t sizes = EPX_WORKSPACE_SIZES_INIT;
  EXPECT_OK(epx_workspace_size_by_mode(&got, R, &sizes));
  size_t bytes = 0;
  EXPECT_OK(epx_group_workspace_bytes(f.g, &bytes));
  EXPECT_EQ_INT(bytes, sizes.total_bytes);
  EXPECT(sizes.normal_bytes > 0 && sizes.low_latency_bytes > 0);

  world_t wn;
  world_make(&wn, R, &normal_spec, WORLD_NORMAL, &rng);
  world_dev_t dn;
  epx_handle_t h = NULL;
  EXPECT_OK(epx_handle_create(f.g, &h));
  if (world_dev_make(&wn, me, (size_t)R * wn.M, &dn) != TEST_PASS) return TEST_FAIL;
  for (int round = 0; round < 2; round++) {
    char label[64];
    snprintf(label, sizeof label, "normal call, round %d", round);
    if (normal_cycle(t, f.g, h, &wn, &dn, label) != TEST_PASS) return TEST_FAIL;
    snprintf(label, sizeof label, "low-latency call, round %d", round);
    if (full_cycle(t, f.g, &f.w, NULL, &ll_case, &f.d, f.cw_dev, label) != TEST_PASS)
      return TEST_FAIL;
    /* Above the low-latency maximum (not the normal one): refused by name, nothing queued. */
    epx_ll_dispatch_args_t a = EPX_LL_DISPATCH_ARGS_INIT;
    a.x = dn.x;
    a.topk_idx = dn.idx;
    a.num_tokens = ll_max + 1;
    epx_ll_dispatch_result_t res;
    EXPECT_STATUS(epx_ll_dispatch(f.g, &a, &res, t->stream), EPX_ERR_INVALID_ARGUMENT);
    EXPECTF(strstr(epx_last_error(), "ll_max_tokens_per_rank = 32") != NULL, "message: %s",
            epx_last_error());
  }
  EXPECT_NO_ASYNC_ERROR(f.g, __func__);
  EXPECT_OK(epx_handle_destroy(h));
  world_dev_free(&dn);
  world_free(&wn);
  return fixture_free(&f);
}

EPX_PEER_TEST(ll_maxima_must_agree, 120) {
  const int R = t->num_ranks, me = t->rank;
  epx_group_config_t cfg = gpu_test_config(256, 1024, 4 * R, 4);
  cfg.modes = EPX_MODE_NORMAL | EPX_MODE_LOW_LATENCY;
  cfg.ll_max_tokens_per_rank = me == 0 ? 32 : 64;
  epx_group_t g = (epx_group_t)1;
  EXPECT_STATUS(epx_group_create(t->comm, &cfg, &g), EPX_ERR_INVALID_USAGE);
  EXPECT(g == NULL);
  EXPECTF(strstr(epx_last_error(), "config.ll_max_tokens_per_rank") != NULL, "message: %s",
          epx_last_error());
  /* The maximum is a low-latency matter: a normal-only group has no peer mask to set. */
  cfg.modes = EPX_MODE_NORMAL;
  cfg.ll_max_tokens_per_rank = 0;
  EXPECT_OK(epx_group_create(t->comm, &cfg, &g));
  EXPECT_STATUS(epx_group_mask_peer(g, (me + 1) % R, t->stream), EPX_ERR_INVALID_USAGE);
  EXPECT(strstr(epx_last_error(), "EPX_MODE_LOW_LATENCY") != NULL);
  EXPECT_OK(epx_group_destroy(g));
  return TEST_PASS;
}

/* The live ranks' part of ll_manual_peer_mask: mask the dead rank on the stream, then two
 * checked calls (both buffers) against the world without it, fast, with no async error. */
static int masked_calls(epx_test_rank_t *t, const fixture_t *f, const cw_case_t *c, int dead,
                        const char *route) {
  epx_group_t g = f->g;
  EXPECT_OK(epx_group_mask_peer(g, dead, t->stream));
  world_t live;
  ll_world_without(&f->w, dead, &live);
  for (int call = 0; call < 2; call++) {
    char label[96];
    snprintf(label, sizeof label, "%s, rank %d masked, call %d", route, dead, call);
    const double t0 = epx_test_now_s();
    if (weights_cycle(t, g, &live, call ? f->cw : NULL, c, &f->d, f->cw_dev, label) != TEST_PASS)
      return TEST_FAIL;
    const double secs = epx_test_now_s() - t0;
    /* A masked peer is never waited for: far below the 2 s budget of a wait. */
    EXPECTF(secs < 1.0, "%s: %.3f s although the peer is masked", label, secs);
    unsigned mask = 0;
    EXPECT_OK(epx_group_get_peer_mask(g, &mask));
    EXPECT_EQ_INT(mask, 1u << dead);
  }
  ll_world_without_free(&live);
  /* The shrink-mode barrier (DeepEP's clean_low_latency_buffer) leaves the masked rank out. */
  const double t0 = epx_test_now_s();
  EXPECT_OK(epx_group_barrier_unmasked(g, t->stream));
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  const double secs = epx_test_now_s() - t0;
  EXPECTF(secs < 1.0, "barrier over the unmasked ranks: %.3f s although rank %d is masked", secs,
          dead);
  EXPECT_NO_ASYNC_ERROR(g, "manual mask"); /* a mask asked for is no failure */
  return TEST_PASS;
}

/* With no peer masked, epx_group_barrier_unmasked is a barrier of every rank: rank 0 must wait
 * for the last rank, which reaches it 300 ms late. */
static int unmasked_barrier_waits(epx_test_rank_t *t, epx_group_t g) {
  const int me = t->rank, last = t->num_ranks - 1;
  if (gpu_host_barrier(t) != TEST_PASS) return TEST_FAIL;
  if (me == last) usleep(300 * 1000);
  const double t0 = epx_test_now_s();
  EXPECT_OK(epx_group_barrier_unmasked(g, t->stream));
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  const double secs = epx_test_now_s() - t0;
  if (me == 0)
    EXPECTF(secs > 0.2,
            "rank 0 left the unmasked barrier after %.3f s: it did not wait for rank %d", secs,
            last);
  EXPECT_NO_ASYNC_ERROR(g, "unmasked barrier, no mask");
  return TEST_PASS;
}

EPX_PEER_TEST(ll_manual_peer_mask, 300) {
  const int me = t->rank, R = t->num_ranks, dead = R - 1;
  for (int route = EPX_LL_ROUTE_DIRECT; route <= EPX_LL_ROUTE_DISPATCH_BY_RANK; route++) {
    uint64_t rng = t->seed;
    const cw_case_t c = {"mask", {32, 256, 4 * R, 4, ROUTE_HOLES, -1, -1}, 1, 0, 0, 1};
    fixture_t f;
    if (fixture_make(t, &c.world, route, 0, &rng, &f) != TEST_PASS) return TEST_FAIL;
    const int bad[3] = {-1, R, me};
    for (int i = 0; i < 3; i++) {
      EXPECT_STATUS(epx_group_mask_peer(f.g, bad[i], t->stream), EPX_ERR_INVALID_ARGUMENT);
      EXPECT(strstr(epx_last_error(), "peer") != NULL);
    }
    if (full_cycle(t, f.g, &f.w, f.cw, &c, &f.d, f.cw_dev, "before masking") != TEST_PASS)
      return TEST_FAIL;
    /* Everyone uploads and poisons (a barrier); then the dead rank makes no call at all. */
    if (world_upload(&f.w, me, &f.d) != TEST_PASS || ll_poison(t, f.g) != TEST_PASS)
      return TEST_FAIL;
    if (me != dead && masked_calls(t, &f, &c, dead, route_label(route)) != TEST_PASS)
      return TEST_FAIL;
    if (gpu_host_barrier(t) != TEST_PASS) return TEST_FAIL;
    EXPECT_OK(epx_group_clear_peer_mask(f.g)); /* collective, the dead rank included */
    unsigned mask = 99;
    EXPECT_OK(epx_group_get_peer_mask(f.g, &mask));
    EXPECT_EQ_INT(mask, 0);
    if (route == EPX_LL_ROUTE_DIRECT && unmasked_barrier_waits(t, f.g) != TEST_PASS)
      return TEST_FAIL;
    for (int call = 0; call < 2; call++) {
      float *const *cw = call ? f.cw : NULL;
      if (full_cycle(t, f.g, &f.w, cw, &c, &f.d, f.cw_dev, "after the clear") != TEST_PASS)
        return TEST_FAIL;
    }
    EXPECT_NO_ASYNC_ERROR(f.g, "after the clear");
    if (fixture_free(&f) != TEST_PASS) return TEST_FAIL;
  }
  return TEST_PASS;
}

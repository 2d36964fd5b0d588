/*
 * test_moe.c - epx_moe_decode (the MoE layer at decode) against its composed CPU oracle
 * (tests/ref/epx_ref_moe.h: the step oracles of dispatch, experts' FFN and combine), on fresh
 * random worlds and experts drawn from the test seed (every rank draws every rank's experts,
 * uploads its own).
 *
 *   moe_decode_matches_reference  BF16 weights; FP8 weights with BF16 rows (quantized by the
 *                                 FFN) and with FP8 rows (quantized by the dispatch); routings
 *                                 uniform, holes, duplicates, all to one expert, all empty, a
 *                                 rank with no token, uneven token counts; routes
 *                                 DISPATCH_BY_RANK (the down projection sends its rows to the
 *                                 sources) and BY_RANK (the combine sends expert-side sums);
 *                                 three calls per case (both low-latency buffers, and back)
 *   moe_decode_graph_replay       one call captured in a CUDA graph, replayed on two new worlds
 *                                 of the same shape (inputs copied into the captured buffers)
 *   moe_decode_masked_peer        every rank masks the last (which makes no call): the layer
 *                                 matches the world without it, at once, on both routes; after
 *                                 the collective clear, the whole world again
 *   moe_decode_refusals           bad arguments refused by name on every rank with nothing
 *                                 queued (no peer waits), then a call that is right
 *
 * Tolerance per output value: 0.03 x (sum over the token's slots of |w| x |FFN row|) + 0.02 x
 * rms(FFN rows) x sum |w| (the FFN test's bound carried through the weighted sum, plus the
 * combine's float32 rounding); a wrong row, expert or weight is off by about rms x |w|.
 * With FP8 weights 0.06 and 0.05 plus twice the oracle's one-step allowance (the largest over
 * the token's slots of |w| x the most one FP8 step of one h value moves that slot's FFN row:
 * epx_ref_moe_decode's one_step; twice covers two such steps anywhere in the token), and the rms
 * of |err| / (rms x sum |w|) at most 0.03. The FP8 GEMMs sum on the tensor cores, which keep
 * fewer bits than float32 inside each 32-deep step (docs/moe.md, "FP8 on wgmma"), so an h value
 * that close to an FP8 rounding boundary rounds the other way. The 0.06 / 0.05 bound alone
 * failed once by 0.1 % (graph replay, 4 ranks, 4x H200, 2026-11-27: out[22][41] = -282, oracle
 * -236.95, bound 45, rms 343), and 0.03 / 0.02 by 1.6 % at 1445f11. A slot whose FFN row is
 * wrong is off by about 1.4 x rms x |w| in most of the token's values: past the per-value bound
 * unless |w| is small next to the slots' one-step allowances, and past the mean-square bound
 * ((|w| / sum |w|) x 1.4 / sqrt(T)) for a whole token or a heavy slot. The mean-square bound was
 * 0.01 first: fp8_one_expert reached 0.0104 (2 ranks, run seed 1801685973161545); passing runs
 * reach 0.008.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/experts_data.h"
#include "gpu/gpu_util.h"
#include "gpu/ll_checks.h"
#include "gpu/world.h"
#include "moe_test_hooks.h"
#include "ref/epx_ref_moe.h"

typedef struct {
  const char *name;
  world_spec_t world; /* experts: local experts L x R (the spec's count is per rank here) */
  int I, fp8_weights, fp8_dispatch;
  epx_ll_route_t route; /* DISPATCH_BY_RANK (the default route, named so that EPX_LL_ROUTE
                           cannot change it): the down projection sends its rows; BY_RANK: the
                           layer's other path (expert-side sums) */
} moe_case_t;

/* A group, every rank's experts (host) and this rank's (device), inputs, output, workspace. */
typedef struct {
  world_t w;
  experts_data_t ex[EPX_MAX_RANKS];
  epx_ref_experts_t ref[EPX_MAX_RANKS];
  epx_group_t g;
  world_dev_t d;
  void *ws;
  size_t ws_bytes;
} moe_fixture_t;

static int fixture_make(epx_test_rank_t *t, const moe_case_t *c, uint64_t *rng, moe_fixture_t *f) {
  const int R = t->num_ranks;
  memset(f, 0, sizeof *f);
  if (experts_world_make(R, t->rank, &c->world, c->I, c->fp8_weights, rng, &f->w, f->ex, f->ref) !=
      TEST_PASS)
    return TEST_FAIL;
  epx_group_config_t cfg = gpu_test_config(f->w.M, f->w.H, f->w.E, f->w.K);
  cfg.modes = EPX_MODE_LOW_LATENCY;
  cfg.ll_route = c->route;
  cfg.dtypes = EPX_DTYPE_BF16 | (c->fp8_dispatch ? EPX_DTYPE_FP8_E4M3 : 0);
  EXPECT_OK(epx_group_create(t->comm, &cfg, &f->g));
  if (world_dev_make(&f->w, t->rank, 1, &f->d) != TEST_PASS) return TEST_FAIL;
  const epx_dtype_t dt = c->fp8_dispatch ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16;
  EXPECT_OK(epx_moe_workspace_size(f->g, &f->ex[t->rank].dev, dt, &f->ws_bytes));
  EXPECT_CUDA(cudaMalloc(&f->ws, f->ws_bytes));
  return TEST_PASS;
}

static int fixture_free(moe_fixture_t *f) {
  for (int r = 0; r < f->w.R; r++) experts_data_free(&f->ex[r]);
  EXPECT_CUDA(cudaFree(f->ws));
  world_dev_free(&f->d);
  world_free(&f->w);
  EXPECT_OK(epx_group_destroy(f->g));
  return TEST_PASS;
}

static epx_moe_args_t args_of(const moe_fixture_t *f, const moe_case_t *c, int me) {
  epx_moe_args_t a = EPX_MOE_ARGS_INIT;
  a.x = f->d.x;
  a.topk_idx = f->d.idx;
  a.topk_weights = (const float *)f->d.w;
  a.num_tokens = f->w.ranks[me].num_tokens;
  a.dispatch_dtype = c->fp8_dispatch ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16;
  a.out = f->d.out;
  a.workspace = f->ws;
  a.workspace_bytes = f->ws_bytes;
  return a;
}

/* What this rank's output must be for one world: computed once, checked after every call. */
typedef struct {
  double *want, *mag; /* [T, H]: the oracle's output and the magnitude it is a sum of */
  double *one_step;   /* [T, H]: the most one FP8 step of h in any one slot moves the value */
  double rms;         /* of every FFN output row */
  int fp8_weights;    /* the FP8 bound applies (see the file comment) */
} moe_oracle_t;

static int oracle_make(const moe_fixture_t *f, const world_t *w, const moe_case_t *c, int me,
                       moe_oracle_t *o) {
  const size_t n = (size_t)w->ranks[me].num_tokens * w->H;
  o->fp8_weights = c->fp8_weights;
  o->want = malloc(sizeof(double) * (n + 1));
  o->mag = malloc(sizeof(double) * (n + 1));
  o->one_step = malloc(sizeof(double) * (n + 1));
  EXPECT(o->want && o->mag && o->one_step);
  EXPECT(epx_ref_moe_decode(&w->ref, f->ref, w->M, c->fp8_dispatch, me, o->want, o->mag, &o->rms,
                            o->one_step) == 0);
  return TEST_PASS;
}

static void oracle_free(moe_oracle_t *o) {
  free(o->want), free(o->mag), free(o->one_step);
}

/* This rank's output (device) against the oracle of world w. */
static int check_out(const moe_fixture_t *f, const world_t *w, const moe_oracle_t *o, int me,
                     const char *label) {
  const int T = w->ranks[me].num_tokens, H = w->H, K = w->K;
  const size_t n = (size_t)T * H;
  const double *want = o->want, *mag = o->mag, rms = o->rms;
  uint16_t *got = malloc(n * 2 + 2);
  EXPECT(got);
  EXPECT_CUDA(cudaMemcpy(got, f->d.out, n * 2, cudaMemcpyDeviceToHost));
  double worst = 0, sq_sum = 0;
  int rc = TEST_PASS;
  for (int t = 0; t < T && rc == TEST_PASS; t++) {
    double wsum = 0;
    for (int k = 0; k < K; k++) {
      const int64_t e = w->ranks[me].topk_idx[(size_t)t * K + k];
      if (e >= 0 && e < w->E) wsum += fabs((double)w->ranks[me].topk_weights[(size_t)t * K + k]);
    }
    for (int col = 0; col < H; col++) {
      const size_t i = (size_t)t * H + col;
      const double g = epx_ref_bf16_to_float(got[i]), err = fabs(g - want[i]);
      const double bound = o->fp8_weights
                               ? 0.06 * mag[i] + 0.05 * rms * wsum + 2.0 * o->one_step[i] + 1e-6
                               : 0.03 * mag[i] + 0.02 * rms * wsum + 1e-6;
      if (err / (bound > 0 ? bound : 1) > worst) worst = err / bound;
      const double scaled = rms * wsum > 0 ? err / (rms * wsum) : 0;
      sq_sum += scaled * scaled;
      if (!(err <= bound)) {
        fprintf(stderr, "  %s: out[%d][%d] = %.6g, oracle %.6g (bound %.3g, rms %.3g)\n", label, t,
                col, g, want[i], bound, rms);
        rc = TEST_FAIL;
        break;
      }
    }
  }
  /* FP8: the errors' mean square, which a wrong row, expert or weight (about rms x |w| over a
   * whole row) breaks while the rare rounding flips the per-value bound allows do not */
  const double err_rms = n ? sqrt(sq_sum / (double)n) : 0;
  if (rc == TEST_PASS && o->fp8_weights && !(err_rms <= 0.03)) {
    fprintf(stderr, "  %s: rms of |err| / (rms x sum |w|) %.4f, bound 0.03\n", label, err_rms);
    rc = TEST_FAIL;
  }
  if (rc == TEST_PASS && me == 0)
    printf(
        "  %s: ok, worst |err| / bound %.3f, rms of |err| / (rms x sum |w|) %.4f (rms of FFN "
        "rows %.3g)\n",
        label, worst, err_rms, rms);
  free(got);
  return rc;
}

/* One layer call on the fixture's inputs, its output checked against world w's oracle o (w is
 * the fixture's world, or that world without a masked rank). */
static int one_call(epx_test_rank_t *t, moe_fixture_t *f, const moe_case_t *c, const world_t *w,
                    const moe_oracle_t *o, const char *label) {
  const int me = t->rank;
  EXPECT_CUDA(cudaMemsetAsync(f->d.out, 0xff, (size_t)f->w.M * f->w.H * 2, t->stream));
  const epx_moe_args_t a = args_of(f, c, me);
  EXPECT_OK(epx_moe_decode(f->g, &f->ex[me].dev, &a, t->stream));
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  EXPECT_NO_ASYNC_ERROR(f->g, label);
  return check_out(f, w, o, me, label);
}

/* The routes of the cases, named (not 0) so that EPX_LL_ROUTE cannot change them: DBR is
 * DISPATCH_BY_RANK (the down projection sends its rows), BR is BY_RANK (expert-side sums). */
#define DBR EPX_LL_ROUTE_DISPATCH_BY_RANK
#define BR EPX_LL_ROUTE_BY_RANK

/*  name {M  H  L  K  routing  T  empty_rank}  I  fp8 weights  fp8 dispatch  route */
static const moe_case_t cases[] = {
    {"bf16_uniform", {32, 256, 8, 4, ROUTE_UNIFORM, -1, -1}, 256, 0, 0, DBR},
    {"bf16_duplicates_uneven", {24, 384, 4, 6, ROUTE_DUPLICATES, -1, -1}, 128, 0, 0, DBR},
    {"fp8w_bf16_rows_holes", {32, 256, 8, 4, ROUTE_HOLES, -1, -1}, 256, 1, 0, DBR},
    {"fp8w_fp8_rows_uniform", {32, 512, 8, 8, ROUTE_UNIFORM, 32, -1}, 256, 1, 1, DBR},
    {"fp8_one_expert", {16, 256, 4, 4, ROUTE_ONE_EXPERT, 16, -1}, 128, 1, 1, DBR},
    {"bf16_all_empty", {16, 256, 4, 4, ROUTE_EMPTY, 16, -1}, 128, 0, 0, DBR},
    {"fp8_empty_rank", {32, 256, 4, 4, ROUTE_UNIFORM, -1, 0}, 128, 1, 1, DBR},
    {"bf16_qwen3_like", {16, 2048, 4, 8, ROUTE_UNIFORM, 16, -1}, 768, 0, 0, DBR},
    {"bf16_by_rank_duplicates", {24, 256, 4, 6, ROUTE_DUPLICATES, -1, -1}, 128, 0, 0, BR},
    {"fp8_by_rank_holes", {32, 256, 8, 4, ROUTE_HOLES, -1, -1}, 256, 1, 1, BR},
};

EPX_GPU_TEST(moe_decode_matches_reference, 900) {
  uint64_t rng = t->seed; /* the same on every rank: worlds and experts are shared */
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    const moe_case_t *c = &cases[i];
    moe_fixture_t f;
    moe_oracle_t o;
    if (fixture_make(t, c, &rng, &f) != TEST_PASS) return TEST_FAIL;
    if (oracle_make(&f, &f.w, c, t->rank, &o) != TEST_PASS) return TEST_FAIL;
    /* The oracle takes seconds and longer on a rank with more tokens: meet before the
     * calls, or an early rank's waits run out of their budget on a late one. */
    if (gpu_host_barrier(t) != TEST_PASS) return TEST_FAIL;
    for (int call = 0; call < 3; call++) { /* the same world: one oracle */
      /* NaN in every receive row of both buffers first: a row the call does not write (the
       * down projection's sends included) cannot pass on what an earlier call left there. */
      if (ll_poison(t, f.g) != TEST_PASS) return TEST_FAIL;
      char label[160];
      snprintf(label, sizeof label, "%s (%d ranks, call %d)", c->name, t->num_ranks, call);
      if (one_call(t, &f, c, &f.w, &o, label) != TEST_PASS) return TEST_FAIL;
    }
    oracle_free(&o);
    if (fixture_free(&f) != TEST_PASS) return TEST_FAIL;
  }
  return TEST_PASS;
}

EPX_GPU_TEST(moe_decode_graph_replay, 300) {
  const int me = t->rank;
  uint64_t rng = t->seed;
  const moe_case_t c = {"graph", {32, 256, 4, 4, ROUTE_UNIFORM, -1, -1}, 128, 1, 1, DBR};
  moe_fixture_t f;
  if (fixture_make(t, &c, &rng, &f) != TEST_PASS) return TEST_FAIL;
  /* Capture with the maximum token count; each replay's world has exactly that many. */
  world_spec_t spec = c.world;
  spec.experts = c.world.experts * t->num_ranks;
  spec.tokens = spec.max_tokens;
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  world_t w;
  world_make(&w, t->num_ranks, &spec, WORLD_LL, &rng);
  EXPECT(world_upload(&w, me, &f.d) == TEST_PASS);
  epx_moe_args_t a = args_of(&f, &c, me);
  a.num_tokens = spec.tokens;
  EXPECT_CUDA(cudaStreamBeginCapture(t->stream, cudaStreamCaptureModeThreadLocal));
  EXPECT_OK(epx_moe_decode(f.g, &f.ex[me].dev, &a, t->stream));
  EXPECT_CUDA(cudaStreamEndCapture(t->stream, &graph));
  EXPECT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 2; replay++) {
    if (replay > 0) {
      world_free(&w);
      world_make(&w, t->num_ranks, &spec, WORLD_LL, &rng);
      EXPECT(world_upload(&w, me, &f.d) == TEST_PASS);
    }
    EXPECT_CUDA(cudaMemset(f.d.out, 0xff, (size_t)w.M * w.H * 2));
    if (ll_poison(t, f.g) != TEST_PASS) return TEST_FAIL; /* the replays share one buffer */
    EXPECT_CUDA(cudaGraphLaunch(exec, t->stream));
    EXPECT_CUDA(cudaStreamSynchronize(t->stream));
    char label[96];
    snprintf(label, sizeof label, "graph replay %d (%d ranks)", replay, t->num_ranks);
    EXPECT_NO_ASYNC_ERROR(f.g, label);
    moe_oracle_t o;
    if (oracle_make(&f, &w, &c, me, &o) != TEST_PASS) return TEST_FAIL;
    /* The oracle takes seconds and longer on a rank with more tokens: meet before the
     * calls, or an early rank's waits run out of their budget on a late one. */
    if (gpu_host_barrier(t) != TEST_PASS) return TEST_FAIL;
    const int rc = check_out(&f, &w, &o, me, label);
    oracle_free(&o);
    if (rc != TEST_PASS) return TEST_FAIL;
  }
  EXPECT_CUDA(cudaGraphExecDestroy(exec));
  EXPECT_CUDA(cudaGraphDestroy(graph));
  world_free(&w);
  return fixture_free(&f);
}

/* The live ranks' part of moe_decode_masked_peer: mask the dead rank, then two calls (both
 * buffers) on the full world's inputs, each matching the oracle of the world without the dead
 * rank, fast, with no async error. */
static int masked_calls(epx_test_rank_t *t, moe_fixture_t *f, const moe_case_t *c, int dead,
                        const world_t *live, const moe_oracle_t *o) {
  EXPECT_OK(epx_group_mask_peer(f->g, dead, t->stream));
  for (int call = 0; call < 2; call++) {
    char label[128];
    snprintf(label, sizeof label, "%s: rank %d masked (%d ranks, call %d)", c->name, dead,
             t->num_ranks, call);
    const double t0 = epx_test_now_s();
    if (one_call(t, f, c, live, o, label) != TEST_PASS) return TEST_FAIL;
    const double secs = epx_test_now_s() - t0;
    /* A masked peer is never waited for: far below a wait's budget. */
    EXPECTF(secs < 1.0, "%s: %.3f s although the peer is masked", label, secs);
  }
  return TEST_PASS;
}

/* Every rank masks the last one, which makes no call: the others' layers match the world
 * without it (its tokens gone, the slots naming its experts empty: the dispatch drops them, the
 * combine sums without it), on both of the layer's paths (DISPATCH_BY_RANK: rows sent by the
 * down projection; BY_RANK); after the collective clear every rank's layer matches the whole
 * world again. Not covered: a rank masked after its rows arrived (the down projection's skip
 * of dead sources), which needs a peer that dies between dispatch and combine. */
EPX_PEER_TEST(moe_decode_masked_peer, 300) {
  const int me = t->rank, dead = t->num_ranks - 1;
  uint64_t rng = t->seed;
  const epx_ll_route_t routes[2] = {DBR, BR};
  for (int r = 0; r < 2; r++) {
    const moe_case_t c = {r ? "masked_by_rank" : "masked_dispatch_by_rank",
                          {32, 256, 4, 4, ROUTE_UNIFORM, -1, -1},
                          128,
                          0,
                          0,
                          routes[r]};
    moe_fixture_t f;
    if (fixture_make(t, &c, &rng, &f) != TEST_PASS) return TEST_FAIL;
    world_t live;
    ll_world_without(&f.w, dead, &live);
    moe_oracle_t o_live, o_full;
    if (oracle_make(&f, &live, &c, me, &o_live) != TEST_PASS ||
        oracle_make(&f, &f.w, &c, me, &o_full) != TEST_PASS)
      return TEST_FAIL;
    if (ll_poison(t, f.g) != TEST_PASS) return TEST_FAIL; /* also the barrier after the oracles */
    if (me != dead && masked_calls(t, &f, &c, dead, &live, &o_live) != TEST_PASS) return TEST_FAIL;
    if (me != dead) EXPECT_NO_ASYNC_ERROR(f.g, "manual mask"); /* a mask asked for: no failure */
    if (gpu_host_barrier(t) != TEST_PASS) return TEST_FAIL;
    EXPECT_OK(epx_group_clear_peer_mask(f.g)); /* collective, the dead rank included */
    for (int call = 0; call < 2; call++) {
      if (ll_poison(t, f.g) != TEST_PASS) return TEST_FAIL;
      char label[128];
      snprintf(label, sizeof label, "%s: after the clear (%d ranks, call %d)", c.name, t->num_ranks,
               call);
      if (one_call(t, &f, &c, &f.w, &o_full, label) != TEST_PASS) return TEST_FAIL;
    }
    oracle_free(&o_live);
    oracle_free(&o_full);
    ll_world_without_free(&live);
    if (fixture_free(&f) != TEST_PASS) return TEST_FAIL;
  }
  return TEST_PASS;
}

/* A rank whose FFN fails after its dispatch (injected on the last rank through
 * epx__moe_test_fail_decode_ffn): it returns the error; its combine still runs with its signals
 * marked, so every other rank (each waits for every rank's signals) leaves its slots out (the
 * outputs match the world without its experts), records EPX_ERR_PEER_DATA (stage LL_COMBINE,
 * naming it), does not mask it and does not wait for it. Two clean calls first leave rows that
 * look right where the failing call's would go, in both buffers: BY_RANK's expert-side sums of
 * the failing rank's stale combine_input, DISPATCH_BY_RANK's rows its down projection wrote
 * (a marked DIRECT combine sends none): summing them would match the whole world, not the cut
 * one. After clearing the records, two clean calls match the whole world again. Both routes. */
EPX_PEER_TEST(moe_decode_failed_ffn_is_reported, 300) {
  const int me = t->rank, R = t->num_ranks, bad = R - 1;
  uint64_t rng = t->seed;
  const epx_ll_route_t routes[2] = {DBR, BR};
  for (int r = 0; r < 2; r++) {
    const moe_case_t c = {r ? "failed_ffn_by_rank" : "failed_ffn_dispatch_by_rank",
                          {32, 256, 4, 4, ROUTE_UNIFORM, 32, -1},
                          128,
                          1,
                          1,
                          routes[r]};
    moe_fixture_t f;
    if (fixture_make(t, &c, &rng, &f) != TEST_PASS) return TEST_FAIL;
    world_t cut;
    ll_world_without(&f.w, bad, &cut); /* for the others' tokens: its experts' slots emptied */
    moe_oracle_t o_cut, o_full;
    if (oracle_make(&f, &cut, &c, me, &o_cut) != TEST_PASS ||
        oracle_make(&f, &f.w, &c, me, &o_full) != TEST_PASS)
      return TEST_FAIL;
    if (gpu_host_barrier(t) != TEST_PASS) return TEST_FAIL;
    char label[128];
    for (int call = 0; call < 2; call++) {
      snprintf(label, sizeof label, "%s: clean call %d first (%d ranks)", c.name, call, R);
      if (one_call(t, &f, &c, &f.w, &o_full, label) != TEST_PASS) return TEST_FAIL;
    }
    snprintf(label, sizeof label, "%s: rank %d's FFN fails (%d ranks)", c.name, bad, R);
    EXPECT_CUDA(cudaMemsetAsync(f.d.out, 0xff, (size_t)f.w.M * f.w.H * 2, t->stream));
    const epx_moe_args_t a = args_of(&f, &c, me);
    const double t0 = epx_test_now_s();
    epx__moe_test_fail_decode_ffn = me == bad;
    const epx_status_t st = epx_moe_decode(f.g, &f.ex[me].dev, &a, t->stream);
    epx__moe_test_fail_decode_ffn = 0;
    EXPECT_CUDA(cudaStreamSynchronize(t->stream));
    const double secs = epx_test_now_s() - t0;
    epx_async_error_t e;
    EXPECT_OK(epx_group_get_async_error(f.g, &e));
    unsigned mask = 0;
    EXPECT_OK(epx_group_get_peer_mask(f.g, &mask));
    EXPECTF(mask == 0, "%s: rank %d masked peers %#x: a marked peer is alive", label, me, mask);
    if (me == bad) {
      EXPECTF(st == EPX_ERR_INTERNAL && strstr(epx_last_error(), "injected") != NULL,
              "%s: the failing rank returned %d (%s)", label, (int)st, epx_last_error());
      EXPECTF(e.status == EPX_OK, "%s: the failing rank's async record: %s", label, e.message);
    } else {
      EXPECTF(st == EPX_OK, "%s: rank %d returned %d (%s)", label, me, (int)st, epx_last_error());
      EXPECTF(secs < 1.0, "%s: rank %d took %.3f s: it waited for the failing rank", label, me,
              secs);
      EXPECTF(e.status == EPX_ERR_PEER_DATA && e.stage == EPX_STAGE_LL_COMBINE && e.peer == bad,
              "%s: rank %d's async record %d stage %d peer %d (%s), want EPX_ERR_PEER_DATA from "
              "rank %d",
              label, me, (int)e.status, (int)e.stage, e.peer, e.message, bad);
      if (check_out(&f, &cut, &o_cut, me, label) != TEST_PASS) return TEST_FAIL;
    }
    EXPECT_OK(epx_group_clear_async_error(f.g));
    if (gpu_host_barrier(t) != TEST_PASS) return TEST_FAIL;
    for (int call = 0; call < 2; call++) {
      snprintf(label, sizeof label, "%s: clean call %d after (%d ranks)", c.name, call, R);
      if (one_call(t, &f, &c, &f.w, &o_full, label) != TEST_PASS) return TEST_FAIL;
    }
    oracle_free(&o_cut);
    oracle_free(&o_full);
    ll_world_without_free(&cut);
    if (fixture_free(&f) != TEST_PASS) return TEST_FAIL;
  }
  return TEST_PASS;
}

EPX_GPU_TEST(moe_decode_refusals, 300) {
  const int me = t->rank;
  uint64_t rng = t->seed;
  const moe_case_t c = {"refusals", {16, 256, 4, 4, ROUTE_UNIFORM, -1, -1}, 128, 0, 0, DBR};
  moe_fixture_t f;
  if (fixture_make(t, &c, &rng, &f) != TEST_PASS) return TEST_FAIL;
  const epx_experts_t *ex = &f.ex[me].dev;
  epx_moe_args_t a = args_of(&f, &c, me);
  epx_experts_t bad = *ex;
  size_t bytes = 0;

  bad.num_experts = ex->num_experts + 1;
  EXPECT_REFUSED(epx_moe_decode(f.g, &bad, &a, t->stream), EPX_ERR_INVALID_ARGUMENT,
                 "experts->num_experts");
  bad = *ex, bad.hidden = 2 * ex->hidden;
  EXPECT_REFUSED(epx_moe_decode(f.g, &bad, &a, t->stream), EPX_ERR_INVALID_ARGUMENT,
                 "experts->hidden");
  bad = *ex, bad.gate_up = NULL;
  EXPECT_REFUSED(epx_moe_decode(f.g, &bad, &a, t->stream), EPX_ERR_INVALID_ARGUMENT,
                 "experts->gate_up");
  a.dispatch_dtype = EPX_DTYPE_FP8_E4M3; /* BF16 weights */
  EXPECT_REFUSED(epx_moe_decode(f.g, ex, &a, t->stream), EPX_ERR_UNSUPPORTED, "FP8 x");
  EXPECT_REFUSED(epx_moe_workspace_size(f.g, ex, EPX_DTYPE_FP8_E4M3, &bytes), EPX_ERR_UNSUPPORTED,
                 "FP8 x");
  a = args_of(&f, &c, me), a.workspace_bytes = f.ws_bytes - 1;
  EXPECT_REFUSED(epx_moe_decode(f.g, ex, &a, t->stream), EPX_ERR_INVALID_ARGUMENT,
                 "args->workspace_bytes");
  a = args_of(&f, &c, me), a.num_tokens = f.w.M + 1;
  EXPECT_REFUSED(epx_moe_decode(f.g, ex, &a, t->stream), EPX_ERR_INVALID_ARGUMENT,
                 "args->num_tokens");
  a = args_of(&f, &c, me), a.out = NULL;
  if (a.num_tokens > 0)
    EXPECT_REFUSED(epx_moe_decode(f.g, ex, &a, t->stream), EPX_ERR_INVALID_ARGUMENT, "args->out");
  a = args_of(&f, &c, me), a.size = 8;
  EXPECT_REFUSED(epx_moe_decode(f.g, ex, &a, t->stream), EPX_ERR_INVALID_ARGUMENT, "args");
  EXPECT_REFUSED(epx_moe_decode(f.g, ex, NULL, t->stream), EPX_ERR_INVALID_ARGUMENT, "args");
  EXPECT_REFUSED(epx_moe_workspace_size(f.g, ex, EPX_DTYPE_BF16, NULL), EPX_ERR_INVALID_ARGUMENT,
                 "bytes");

  /* The refusals queued nothing: the next call is right on every rank. */
  moe_oracle_t o;
  if (oracle_make(&f, &f.w, &c, me, &o) != TEST_PASS) return TEST_FAIL;
  /* The oracle takes seconds and longer on a rank with more tokens: meet before the
   * calls, or an early rank's waits run out of their budget on a late one. */
  if (gpu_host_barrier(t) != TEST_PASS) return TEST_FAIL;
  if (one_call(t, &f, &c, &f.w, &o, "after the refusals") != TEST_PASS) return TEST_FAIL;
  oracle_free(&o);
  if (fixture_free(&f) != TEST_PASS) return TEST_FAIL;

  /* A group without low-latency mode, and one whose route has no packed layout. */
  epx_group_config_t cfg = gpu_test_config(16, 256, 4 * t->num_ranks, 4);
  epx_group_t g;
  EXPECT_OK(epx_group_create(t->comm, &cfg, &g));
  EXPECT_REFUSED(epx_moe_workspace_size(g, ex, EPX_DTYPE_BF16, &bytes), EPX_ERR_INVALID_USAGE,
                 "EPX_MODE_LOW_LATENCY");
  EXPECT_OK(epx_group_destroy(g));
  return TEST_PASS;
}

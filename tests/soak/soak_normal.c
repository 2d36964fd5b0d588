/*
 * soak_normal.c - one normal-mode iteration of the soak (see soak.h): a dispatch of a fresh
 * world (WORLD_NORMAL) with the plan's count mode, payload and alignment, its combine, and
 * sometimes a cached dispatch of fresh payload and its combine; every result compared with the
 * CPU reference (tests/ref) through normal_checks.h, the combine extras (top-k weight reduction,
 * bias) through epx_ref_combine_ex_f64.
 *
 * Outputs are poisoned before each call: the receive arrays with 0x5A bytes (the worst-case
 * tail must be written), combine outputs with 0xFF (NaN). Poisoning the receive arrays on the
 * stream needs no barrier: no peer writes them before this rank's count exchange, which is
 * queued after the poison.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/normal_checks.h"
#include "soak/soak.h"

/* Fill this rank's receive arrays (everything before the combine slab) with 0x5A bytes; for a
 * cached dispatch only the payload and scales: it rewrites no ids, weights or sources (they stay
 * the handle's dispatch's), and those are checked again after it. */
static int poison_recv(soak_rank_t *s, int payload_only) {
  const epx__ws_layout_t *l = &s->g->layout;
  const size_t bytes = payload_only ? l->recv_topk_idx_offset : l->combine_slab_offset;
  SOAK_CUDA(s, cudaMemsetAsync(s->g->workspace + l->normal_offset + l->recv_x_offset, 0x5A,
                               bytes - l->recv_x_offset, s->t.stream));
  return 0;
}

/* num_worst_tokens of plan p: the same on every rank (every rank sees every rank's count). */
static int worst_rows(const world_t *w, const soak_iter_t *p) {
  const int cap = w->R * w->M;
  int most = 0;
  for (int d = 0; d < w->R; d++) {
    const int n = epx_ref_dispatch_num_recv(&w->ref, d);
    if (n > most) most = n;
  }
  if (p->worst == SOAK_WORST_CAPACITY) return cap;
  if (p->worst == SOAK_WORST_TIGHT) return most > 0 ? most : 1;
  const int between = most + (cap - most) / 3 + 1;
  return between > cap ? cap : between;
}

/* Rows [n, worst) of recv_topk_idx are -1 and their weights 0. */
static int check_worst_tail(const world_t *w, const epx_dispatch_result_t *res, int n, int worst,
                            const char *label) {
  const size_t rows = (size_t)(worst - n), nk = rows * w->K;
  int *idx = malloc(nk * 4 + 4);
  float *wt = malloc(nk * 4 + 4);
  EXPECT_CUDA(
      cudaMemcpy(idx, res->recv_topk_idx + (size_t)n * w->K, nk * 4, cudaMemcpyDeviceToHost));
  EXPECT_CUDA(
      cudaMemcpy(wt, res->recv_topk_weights + (size_t)n * w->K, nk * 4, cudaMemcpyDeviceToHost));
  long long bad = -1;
  for (size_t i = 0; i < nk && bad < 0; i++)
    if (idx[i] != -1 || wt[i] != 0.f) bad = (long long)i;
  if (bad >= 0)
    fprintf(stderr, "  %s: worst-case row %lld slot %lld: id %d weight %g, want -1 and 0\n", label,
            n + bad / w->K, bad % w->K, idx[bad], wt[bad]);
  free(idx), free(wt);
  return bad < 0 ? TEST_PASS : TEST_FAIL;
}

/* The dispatch's counts against the reference: num_recv as the count mode says, per-expert
 * counts (host and device), the rank prefix matrix. */
static int check_counts(const world_t *w, int me, const soak_iter_t *p,
                        const epx_dispatch_result_t *res, const int *per_expert, int worst,
                        const epx_ref_recv_t *ref) {
  const int want = p->counts == SOAK_COUNTS_SYNC    ? ref->num_recv
                   : p->counts == SOAK_COUNTS_WORST ? worst
                                                    : -1;
  EXPECTF(res->num_recv == want, "num_recv %d, want %d (reference %d)", res->num_recv, want,
          ref->num_recv);
  int dev[EPX_MAX_EXPERTS];
  EXPECT_CUDA(
      cudaMemcpy(dev, res->num_recv_per_expert_device, sizeof(int) * w->L, cudaMemcpyDeviceToHost));
  for (int j = 0; j < w->L; j++) {
    EXPECTF(dev[j] == ref->num_recv_per_expert_aligned[j], "device per-expert[%d] = %d, ref %d", j,
            dev[j], ref->num_recv_per_expert_aligned[j]);
    if (p->counts == SOAK_COUNTS_SYNC)
      EXPECTF(per_expert[j] == ref->num_recv_per_expert_aligned[j], "per-expert[%d] = %d, ref %d",
              j, per_expert[j], ref->num_recv_per_expert_aligned[j]);
  }
  int got[EPX_MAX_RANKS * EPX_MAX_RANKS], ref_m[EPX_MAX_RANKS * EPX_MAX_RANKS];
  EXPECT(epx_ref_rank_prefix_matrix(&w->ref, NULL, ref_m) == 0);
  EXPECT_CUDA(cudaMemcpy(got, res->rank_prefix_matrix_device, sizeof(int) * w->R * w->R,
                         cudaMemcpyDeviceToHost));
  for (int i = 0; i < w->R * w->R; i++)
    EXPECTF(got[i] == ref_m[i], "rank_prefix_matrix[%d][%d] = %d, ref %d", i / w->R, i % w->R,
            got[i], ref_m[i]);
  (void)me;
  return TEST_PASS;
}

/* The expert outputs y[d] of every rank d (the reference needs every rank's; this rank uploads
 * its own): scaled received rows, or the received rows themselves. */
static void expert_outputs(const world_t *w, int experts, uint16_t **y) {
  for (int d = 0; d < w->R; d++) {
    if (experts == SOAK_EXPERTS_SCALED) {
      int n = 0;
      y[d] = normal_expert_output(w, d, &n);
    } else {
      epx_ref_recv_t r;
      memset(&r, 0, sizeof r);
      epx_ref_dispatch(&w->ref, d, EPX_REF_PAYLOAD_BF16, 1, &r);
      y[d] = r.x;
      r.x = NULL;
      epx_ref_recv_free(&r);
    }
  }
}

/* out (and out_w) of this rank's combine c against the reference with expert outputs y, the
 * combine's factors (w->w[me] when weighted), the weights every rank returns (reduction) and the
 * bias rows. BF16 out: bit-exact for received rows summed unweighted (sums of at most R BF16
 * rows of a token are exact in float32), else within BF16 rounding of the float64 reference
 * (|got - ref| <= |ref|/256 + 1e-4, as normal_check_combine); out_w bit-exact. */
static int check_combine(const world_t *w, int me, const soak_combine_t *c, uint16_t *const *y,
                         const uint16_t *const *bias, const void *out_dev, const float *out_w_dev,
                         const char *label) {
  const int T = w->ranks[me].num_tokens, H = w->H, K = w->K, R = w->R;
  const size_t TH = (size_t)T * H, TK = (size_t)T * K;
  float *recv_w[EPX_MAX_RANKS] = {NULL};
  if (c->reduce_weights)
    for (int d = 0; d < R; d++) {
      epx_ref_recv_t r;
      memset(&r, 0, sizeof r);
      EXPECT(epx_ref_dispatch(&w->ref, d, EPX_REF_PAYLOAD_NONE, 1, &r) == 0);
      recv_w[d] = r.topk_weights;
      r.topk_weights = NULL;
      epx_ref_recv_free(&r);
    }
  float *ref_w = malloc(TK * 4 + 4), *got_w = malloc(TK * 4 + 4);
  epx_ref_combine_extras_t ex = {NULL, NULL, {NULL, NULL}};
  if (c->reduce_weights) ex.recv_w = (const float *const *)recv_w, ex.out_w = ref_w;
  for (int j = 0; j < c->num_bias; j++) ex.bias[j] = bias[j];
  const float *factors = c->weighted ? w->w[me] : NULL;
  const int exact = c->experts == SOAK_EXPERTS_IDENTITY && !c->weighted && !c->num_bias;
  double *ref = malloc(sizeof(double) * (TH + 1));
  uint16_t *ref16 = malloc(TH * 2 + 2), *got = malloc(TH * 2 + 2);
  int ok =
      exact
          ? epx_ref_combine_ex(&w->ref, me, (const uint16_t *const *)y, factors, &ex, ref16) == 0
          : epx_ref_combine_ex_f64(&w->ref, me, (const uint16_t *const *)y, factors, &ex, ref) == 0;
  if (!ok) fprintf(stderr, "  %s: the reference combine failed\n", label);
  if (ok && cudaMemcpy(got, out_dev, TH * 2, cudaMemcpyDeviceToHost) != cudaSuccess) ok = 0;
  if (ok && c->reduce_weights &&
      cudaMemcpy(got_w, out_w_dev, TK * 4, cudaMemcpyDeviceToHost) != cudaSuccess)
    ok = 0;
  long long bad = -1, bad_w = -1;
  for (size_t i = 0; ok && i < TH && bad < 0; i++) {
    if (exact) {
      if (got[i] != ref16[i]) bad = (long long)i;
    } else {
      const double g = epx_ref_bf16_to_float(got[i]), r = ref[i];
      if (!(fabs(g - r) <= fabs(r) * (1.0 / 256) + 1e-4)) bad = (long long)i;
    }
  }
  for (size_t i = 0; ok && c->reduce_weights && i < TK && bad_w < 0; i++)
    if (memcmp(&got_w[i], &ref_w[i], 4) != 0) bad_w = (long long)i;
  if (bad >= 0)
    fprintf(stderr, "  %s: out[%lld][%lld] = %.8g (0x%04x), reference %.8g\n", label, bad / H,
            bad % H, epx_ref_bf16_to_float(got[bad]), got[bad],
            exact ? epx_ref_bf16_to_float(ref16[bad]) : ref[bad]);
  if (bad_w >= 0)
    fprintf(stderr, "  %s: out_topk_weights[%lld][%lld] = %.9g, reference %.9g\n", label, bad_w / K,
            bad_w % K, got_w[bad_w], ref_w[bad_w]);
  for (int d = 0; d < R; d++) free(recv_w[d]);
  free(ref_w), free(got_w), free(ref), free(ref16), free(got);
  return ok && bad < 0 && bad_w < 0 ? TEST_PASS : TEST_FAIL;
}

/* One combine c of the dispatch res (recv_x: its received rows), checked if check. */
static int run_combine(soak_rank_t *s, const world_t *w, const soak_combine_t *c,
                       const epx_dispatch_result_t *res, uint64_t *local, int check,
                       const char *label) {
  const int me = s->rank, T = w->ranks[me].num_tokens, H = w->H, K = w->K;
  /* Unchecked iterations combine whatever d.y holds: its values do not matter then. */
  uint16_t *y[EPX_MAX_RANKS] = {NULL};
  if (check) expert_outputs(w, c->experts, y);
  if (check && c->experts == SOAK_EXPERTS_SCALED) {
    const int n = epx_ref_dispatch_num_recv(&w->ref, me);
    SOAK_CUDA(
        s, cudaMemcpyAsync(s->d.y, y[me], (size_t)n * H * 2, cudaMemcpyHostToDevice, s->t.stream));
  }
  /* Bias rows: windows of the pool, 16-byte aligned. */
  const uint16_t *bias_host[2] = {NULL, NULL};
  const void *bias_dev[2] = {NULL, NULL};
  const size_t span = s->bias_elems - (size_t)T * H;
  for (int j = 0; j < c->num_bias; j++) {
    const size_t off = (size_t)(epx_test_rand(local) % (span / 8 + 1)) * 8;
    bias_host[j] = s->bias_host + off;
    bias_dev[j] = (const uint16_t *)s->bias_dev + off;
  }
  SOAK_CUDA(s, cudaMemsetAsync(s->d.out, 0xFF, (size_t)T * H * 2, s->t.stream));
  SOAK_CUDA(s, cudaMemsetAsync(s->out_w_dev, 0xFF, (size_t)T * K * 4, s->t.stream));
  epx_combine_args_t ca = EPX_COMBINE_ARGS_INIT;
  ca.x = c->experts == SOAK_EXPERTS_SCALED ? s->d.y : res->recv_x;
  ca.out = s->d.out;
  if (c->weighted) ca.topk_idx = s->d.idx, ca.topk_weights = (const float *)s->d.w;
  if (c->reduce_weights)
    ca.recv_topk_weights = res->recv_topk_weights, ca.out_topk_weights = s->out_w_dev;
  for (int j = 0; j < c->num_bias; j++) ca.bias[j] = bias_dev[j];
  SOAK_EPX(s, epx_combine(s->g, s->h, &ca, s->t.stream));
  SOAK_CUDA(s, cudaStreamSynchronize(s->t.stream));
  if (check)
    soak_result(s, check_combine(w, me, c, y, bias_host, s->d.out, s->out_w_dev, label), label);
  for (int d = 0; d < w->R; d++) free(y[d]);
  return 0;
}

/* New payload for every rank (the same draws on every rank), this rank's uploaded. */
static int fresh_payload(soak_rank_t *s, world_t *w, int fp8, uint64_t *rng) {
  const size_t H = (size_t)w->H, G = H / 128;
  for (int r = 0; r < w->R; r++) {
    const size_t T = (size_t)w->ranks[r].num_tokens;
    for (size_t i = 0; i < T * H; i++)
      w->x[r][i] = epx_ref_bf16_from_float(4.f * epx_test_rand_unit(rng) - 2.f);
    if (!fp8) continue;
    for (size_t i = 0; i < T * H; i++) {
      uint8_t b = (uint8_t)epx_test_rand(rng);
      w->x8[r][i] = (b & 0x7f) == 0x7f ? b ^ 1 : b; /* no NaN codes */
    }
    for (size_t i = 0; i < T * G; i++) w->sc[r][i] = 0.01f + epx_test_rand_unit(rng);
  }
  const size_t T = (size_t)w->ranks[s->rank].num_tokens;
  cudaStream_t st = s->t.stream;
  SOAK_CUDA(s, cudaMemcpyAsync(s->d.x, w->x[s->rank], T * H * 2, cudaMemcpyHostToDevice, st));
  if (fp8) {
    SOAK_CUDA(s, cudaMemcpyAsync(s->d.x8, w->x8[s->rank], T * H, cudaMemcpyHostToDevice, st));
    SOAK_CUDA(s, cudaMemcpyAsync(s->d.sc, w->sc[s->rank], T * G * 4, cudaMemcpyHostToDevice, st));
  }
  return 0;
}

int soak_normal_iteration(soak_rank_t *s, const soak_iter_t *p, int check) {
  const int R = s->R, me = s->rank;
  uint64_t rng = p->rng, local = soak_mix(p->rng ^ (0xB1A5ull + (uint64_t)me));
  const world_spec_t spec = {s->M, s->H, s->E, s->K, p->route, p->tokens, p->empty_rank};
  world_t w;
  world_make(&w, R, &spec, WORLD_NORMAL, &rng);
  if (!p->dispatch_weights)
    for (int r = 0; r < R; r++) w.ranks[r].topk_weights = NULL; /* received weights 0 */
  SOAK_TRY(s, world_upload(&w, me, &s->d) == TEST_PASS, "uploading the inputs");
  const int fp8 = p->fp8, align = p->expert_alignment;
  const epx_ref_payload_t payload = fp8 ? EPX_REF_PAYLOAD_FP8 : EPX_REF_PAYLOAD_BF16;
  const int worst = p->counts == SOAK_COUNTS_WORST ? worst_rows(&w, p) : 0;
  epx_ref_recv_t ref;
  memset(&ref, 0, sizeof ref);
  SOAK_TRY(s, !check || epx_ref_dispatch(&w.ref, me, payload, align ? align : 1, &ref) == 0,
           "the reference dispatch");

  if (poison_recv(s, 0)) return -1;
  epx_dispatch_args_t a = EPX_DISPATCH_ARGS_INIT;
  a.x = fp8 ? s->d.x8 : s->d.x;
  a.x_dtype = fp8 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16;
  a.x_scales = fp8 ? (const float *)s->d.sc : NULL;
  a.topk_idx = s->d.idx;
  a.topk_weights = p->dispatch_weights ? (const float *)s->d.w : NULL;
  a.num_tokens = w.ranks[me].num_tokens;
  a.expert_alignment = align;
  a.sync_counts = p->counts == SOAK_COUNTS_SYNC;
  a.num_worst_tokens = worst;
  int per_expert[EPX_MAX_EXPERTS];
  a.num_recv_per_expert = a.sync_counts ? per_expert : NULL;
  epx_dispatch_result_t res;
  SOAK_EPX(s, epx_dispatch(s->g, s->h, &a, &res, s->t.stream));
  SOAK_CUDA(s, cudaStreamSynchronize(s->t.stream));
  if (check) {
    soak_result(s, check_counts(&w, me, p, &res, per_expert, worst, &ref), "dispatch counts");
    soak_result(s, normal_check_recv(&w, me, &res, fp8, 1, &ref, "dispatch"), "dispatch rows");
    if (p->counts == SOAK_COUNTS_WORST)
      soak_result(s, check_worst_tail(&w, &res, ref.num_recv, worst, "dispatch"),
                  "num_worst_tokens tail");
  }
  epx_ref_recv_free(&ref);
  if (soak_check_async(s, &w, EPX_STAGE_LAYOUT)) return -1;
  if (run_combine(s, &w, &p->combine, &res, &local, check, "combine")) return -1;

  if (p->cached) {
    if (fresh_payload(s, &w, fp8, &rng)) return -1;
    SOAK_TRY(s, !check || epx_ref_dispatch(&w.ref, me, payload, align ? align : 1, &ref) == 0,
             "the reference dispatch");
    if (poison_recv(s, 1)) return -1;
    if (fp8)
      SOAK_EPX(s, epx_dispatch_cached(s->g, s->h, s->d.x8, EPX_DTYPE_FP8_E4M3,
                                      (const float *)s->d.sc, &res, s->t.stream));
    else
      SOAK_EPX(s, epx_dispatch_cached(s->g, s->h, s->d.x, EPX_DTYPE_BF16, NULL, &res, s->t.stream));
    SOAK_CUDA(s, cudaStreamSynchronize(s->t.stream));
    if (check) {
      const int want = p->counts == SOAK_COUNTS_WORST ? worst : -1;
      if (res.num_recv != want)
        fprintf(stderr, "  cached dispatch: num_recv %d, want %d\n", res.num_recv, want);
      soak_result(s, res.num_recv == want ? TEST_PASS : TEST_FAIL, "cached dispatch num_recv");
      soak_result(s, normal_check_recv(&w, me, &res, fp8, 1, &ref, "cached dispatch"),
                  "cached dispatch rows");
    }
    epx_ref_recv_free(&ref);
    if (run_combine(s, &w, &p->cached_combine, &res, &local, check, "combine after cached"))
      return -1;
  }
  if (soak_check_async(s, NULL, EPX_STAGE_NONE)) return -1;
  world_free(&w);
  s->normal_iters++;
  return 0;
}

/*
 * normal_checks.c - expert outputs and result checks of the normal-mode GPU tests (see
 * normal_checks.h).
 */
#include "gpu/normal_checks.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Compare what the GPU received with the reference, field by field, first mismatch printed. */
int normal_check_recv(const world_t *w, int me, const epx_dispatch_result_t *res, int fp8,
                      int check_meta, const epx_ref_recv_t *ref, const char *label) {
  const int n = ref->num_recv, H = w->H, K = w->K, R = w->R;
  int prefix[EPX_MAX_RANKS + 1];
  EXPECT_CUDA(
      cudaMemcpy(prefix, res->recv_rank_prefix, sizeof(int) * (R + 1), cudaMemcpyDeviceToHost));
  for (int s = 0; s <= R; s++)
    EXPECTF(prefix[s] == ref->rank_prefix[s], "%s: rank_prefix[%d] = %d, ref %d", label, s,
            prefix[s], ref->rank_prefix[s]);
  int ndev = -1;
  EXPECT_CUDA(cudaMemcpy(&ndev, res->num_recv_device, sizeof ndev, cudaMemcpyDeviceToHost));
  EXPECT_EQ_INT(ndev, n);
  const size_t row_bytes = (size_t)H * (fp8 ? 1 : 2);
  char *got = malloc((size_t)n * row_bytes + 1);
  EXPECT_CUDA(cudaMemcpy(got, res->recv_x, (size_t)n * row_bytes, cudaMemcpyDeviceToHost));
  const char *want = fp8 ? (const char *)ref->x_fp8 : (const char *)ref->x;
  for (int i = 0; i < n; i++)
    if (memcmp(got + i * row_bytes, want + i * row_bytes, row_bytes)) {
      fprintf(stderr, "  %s: recv_x row %d (source rank %d token %d) differs from the reference\n",
              label, i, ref->src_rank[i], ref->src_token[i]);
      free(got);
      return TEST_FAIL;
    }
  free(got);
  if (fp8) {
    const size_t ns = (size_t)n * (H / 128);
    float *sc = malloc(ns * 4 + 4);
    EXPECT_CUDA(cudaMemcpy(sc, res->recv_x_scales, ns * 4, cudaMemcpyDeviceToHost));
    int bad = memcmp(sc, ref->x_scales, ns * 4) != 0;
    free(sc);
    EXPECTF(!bad, "%s: recv_x_scales differ from the reference", label);
  }
  if (check_meta) {
    int *idx = malloc((size_t)n * K * 4 + 4), *src = malloc((size_t)n * 4 + 4);
    float *wt = malloc((size_t)n * K * 4 + 4);
    EXPECT_CUDA(cudaMemcpy(idx, res->recv_topk_idx, (size_t)n * K * 4, cudaMemcpyDeviceToHost));
    EXPECT_CUDA(cudaMemcpy(wt, res->recv_topk_weights, (size_t)n * K * 4, cudaMemcpyDeviceToHost));
    EXPECT_CUDA(cudaMemcpy(src, res->recv_src_token, (size_t)n * 4, cudaMemcpyDeviceToHost));
    int bad = -1;
    for (int i = 0; i < n && bad < 0; i++) {
      if (src[i] != ref->src_token[i]) bad = i;
      for (int k = 0; k < K; k++)
        if (idx[i * K + k] != ref->topk_idx[(size_t)i * K + k] ||
            wt[i * K + k] != ref->topk_weights[(size_t)i * K + k])
          bad = i;
    }
    free(idx), free(src), free(wt);
    EXPECTF(bad < 0, "%s: row %d: topk ids, weights or source token differ from the reference",
            label, bad);
  }
  (void)me;
  return TEST_PASS;
}

/* y_d = expert output of rank d: its received BF16 rows scaled by (1 + d/4), so that rows of
 * one token differ from rank to rank. */
uint16_t *normal_expert_output(const world_t *w, int d, int *num_recv) {
  epx_ref_recv_t r;
  memset(&r, 0, sizeof r);
  epx_ref_dispatch(&w->ref, d, EPX_REF_PAYLOAD_BF16, 1, &r);
  *num_recv = r.num_recv;
  uint16_t *y = malloc((size_t)r.num_recv * w->H * 2 + 2);
  for (size_t i = 0; i < (size_t)r.num_recv * w->H; i++)
    y[i] = epx_ref_bf16_from_float(epx_ref_bf16_to_float(r.x[i]) * (1.f + 0.25f * d));
  epx_ref_recv_free(&r);
  return y;
}

/* out (BF16, on the GPU) within BF16 rounding of the float64 reference. */
int normal_check_combine(const world_t *w, int me, const void *out_dev, const float *weights,
                         const char *label) {
  const int T = w->ranks[me].num_tokens, H = w->H;
  uint16_t *y[EPX_MAX_RANKS];
  int nrecv;
  for (int d = 0; d < w->R; d++) y[d] = normal_expert_output(w, d, &nrecv);
  double *ref = malloc(sizeof(double) * ((size_t)T * H + 1));
  EXPECT(epx_ref_combine_f64(&w->ref, me, (const uint16_t *const *)y, weights, ref) == 0);
  uint16_t *got = malloc((size_t)T * H * 2 + 2);
  EXPECT_CUDA(cudaMemcpy(got, out_dev, (size_t)T * H * 2, cudaMemcpyDeviceToHost));
  long long bad = -1;
  double worst = 0;
  for (size_t i = 0; i < (size_t)T * H; i++) {
    const double g = epx_ref_bf16_to_float(got[i]), r = ref[i];
    const double tol = fabs(r) * (1.0 / 256) + 1e-4;
    if (!(fabs(g - r) <= tol) && bad < 0) bad = (long long)i;
    if (fabs(g - r) > worst) worst = fabs(g - r);
  }
  int ok = bad < 0;
  if (!ok)
    fprintf(stderr, "  %s: combine out[%lld][%lld] = %g, float64 reference %.8g\n", label, bad / H,
            bad % H, epx_ref_bf16_to_float(got[bad]), ref[bad]);
  for (int d = 0; d < w->R; d++) free(y[d]);
  free(ref), free(got);
  return ok ? TEST_PASS : TEST_FAIL;
}

int normal_check_combine_unchanged(const world_t *w, int me, const void *out_dev,
                                   const char *label) {
  const int R = w->R;
  uint16_t *y[EPX_MAX_RANKS] = {NULL};
  for (int d = 0; d < R; d++) {
    epx_ref_recv_t r;
    memset(&r, 0, sizeof r);
    EXPECT(epx_ref_dispatch(&w->ref, d, EPX_REF_PAYLOAD_BF16, 1, &r) == 0);
    y[d] = r.x;
    r.x = NULL;
    epx_ref_recv_free(&r);
  }
  const size_t n = (size_t)w->ranks[me].num_tokens * w->H;
  uint16_t *want = malloc(n * 2 + 2), *got = malloc(n * 2 + 2);
  int ok = epx_ref_combine(&w->ref, me, (const uint16_t *const *)y, NULL, want) == 0;
  for (int d = 0; d < R; d++) free(y[d]);
  if (ok && cudaMemcpy(got, out_dev, n * 2, cudaMemcpyDeviceToHost) != cudaSuccess) ok = 0;
  long long bad = -1;
  for (size_t i = 0; ok && i < n && bad < 0; i++)
    if (got[i] != want[i]) bad = (long long)i;
  if (bad >= 0)
    fprintf(stderr, "  %s: out[%lld][%lld] = 0x%04x, reference 0x%04x\n", label, bad / w->H,
            bad % w->H, got[bad], want[bad]);
  free(want), free(got);
  EXPECTF(ok, "%s: reference combine or copy-back failed", label);
  return bad < 0 ? TEST_PASS : TEST_FAIL;
}

int normal_fixture_make(epx_test_rank_t *t, const world_spec_t *spec, int timeout_ms, uint64_t *rng,
                        normal_fixture_t *f) {
  memset(f, 0, sizeof *f);
  world_make(&f->w, t->num_ranks, spec, WORLD_NORMAL, rng);
  epx_group_config_t cfg = gpu_test_config(f->w.M, f->w.H, f->w.E, f->w.K);
  if (timeout_ms > 0) cfg.timeout_ms = timeout_ms;
  const epx_status_t st = epx_group_create(t->comm, &cfg, &f->g);
  EXPECTF(st == EPX_OK && epx_handle_create(f->g, &f->h) == EPX_OK, "group or handle: %s",
          epx_last_error());
  return world_dev_make(&f->w, t->rank, (size_t)t->num_ranks * f->w.M, &f->d);
}

int normal_fixture_free(normal_fixture_t *f, const char *label) {
  world_dev_free(&f->d);
  world_free(&f->w);
  const epx_status_t st = epx_handle_destroy(f->h);
  EXPECTF(st == EPX_OK && epx_group_destroy(f->g) == EPX_OK, "%s: destroy: %s", label,
          epx_last_error());
  return TEST_PASS;
}

int normal_combine_and_check(epx_test_rank_t *t, const normal_fixture_t *f, const char *label) {
  const world_t *w = &f->w;
  int nrecv = 0;
  uint16_t *y = normal_expert_output(w, t->rank, &nrecv);
  EXPECT_CUDA(
      cudaMemcpyAsync(f->d.y, y, (size_t)nrecv * w->H * 2, cudaMemcpyHostToDevice, t->stream));
  EXPECT_CUDA(
      cudaMemsetAsync(f->d.out, 0xFF, (size_t)w->ranks[t->rank].num_tokens * w->H * 2, t->stream));
  epx_combine_args_t ca = EPX_COMBINE_ARGS_INIT;
  ca.x = f->d.y;
  ca.out = f->d.out;
  EXPECT_OK(epx_combine(f->g, f->h, &ca, t->stream));
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  free(y);
  return normal_check_combine(w, t->rank, f->d.out, NULL, label);
}

int normal_round_trip_and_check(epx_test_rank_t *t, const normal_fixture_t *f, const char *label) {
  const world_t *w = &f->w;
  const int me = t->rank;
  epx_dispatch_args_t a = EPX_DISPATCH_ARGS_INIT;
  a.x = f->d.x;
  a.topk_idx = f->d.idx;
  a.topk_weights = (const float *)f->d.w;
  a.num_tokens = w->ranks[me].num_tokens;
  epx_dispatch_result_t res;
  EXPECT_OK(epx_dispatch(f->g, f->h, &a, &res, t->stream));
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  epx_ref_recv_t ref;
  memset(&ref, 0, sizeof ref);
  EXPECT(epx_ref_dispatch(&w->ref, me, EPX_REF_PAYLOAD_BF16, 1, &ref) == 0);
  EXPECT_EQ_INT(res.num_recv, ref.num_recv);
  if (normal_check_recv(w, me, &res, 0, 1, &ref, label) != TEST_PASS) return TEST_FAIL;
  epx_ref_recv_free(&ref);
  return normal_combine_and_check(t, f, label);
}

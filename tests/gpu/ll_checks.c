/*
 * ll_checks.c - the reference's fixed-slot receive arrays, the expert outputs and the result
 * checks of the low-latency GPU tests (see ll_checks.h).
 */
#include "gpu/ll_checks.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void ll_world_without(const world_t *w, int dead, world_t *out) {
  *out = *w;
  for (int s = 0; s < w->R; s++) {
    const size_t TK = (size_t)w->ranks[s].num_tokens * w->K;
    out->idx[s] = malloc(sizeof(int64_t) * (TK + 1));
    for (size_t i = 0; i < TK; i++) {
      const int64_t e = w->idx[s][i];
      out->idx[s][i] = (e >= 0 && e < w->E && e / w->L == dead) ? -1 : e;
    }
    out->ranks[s].topk_idx = out->idx[s];
    if (s == dead) out->ranks[s].num_tokens = 0;
  }
  out->ref.ranks = out->ranks;
}

void ll_world_without_free(world_t *w) {
  for (int s = 0; s < w->R; s++) free(w->idx[s]);
}

void ll_ref_recv_free(ll_ref_recv_t *r) {
  free(r->x), free(r->q), free(r->sc), free(r->count), free(r->begin), free(r->num);
  free(r->sr), free(r->st), free(r->sk);
  memset(r, 0, sizeof *r);
}

/* NOTE: malloc without touching: the reference writes only the rows of the segments. */
int ll_ref_recv(const world_t *w, int d, int fp8, int ue8m0, ll_ref_recv_t *r) {
  const size_t rows = (size_t)w->L * w->R * w->M, H = (size_t)w->H;
  memset(r, 0, sizeof *r);
  r->x = malloc(rows * H * 2 + 2);
  r->q = fp8 ? malloc(rows * H + 1) : NULL;
  r->sc = fp8 ? malloc(rows * (H / 128) * 4 + 4) : NULL;
  r->count = malloc(sizeof(int) * w->L);
  r->begin = malloc(sizeof(int) * w->L * w->R);
  r->num = malloc(sizeof(int) * w->L * w->R);
  r->sr = malloc(sizeof(int) * rows);
  r->st = malloc(sizeof(int) * rows);
  r->sk = malloc(sizeof(int) * rows);
  epx_ref_ll_recv_t out = {r->x, r->q, r->sc, r->count, r->begin, r->num, r->sr, r->st, r->sk};
  EXPECT(epx_ref_ll_dispatch_layout(&w->ref, d, w->M, ue8m0, EPX_REF_LL_FIXED, &out) == 0);
  return TEST_PASS;
}

/* Expert output of rank d, local expert j, from a received BF16 value. */
static uint16_t expert_fn(uint16_t v, int d, int j) {
  return epx_ref_bf16_from_float(epx_ref_bf16_to_float(v) * (0.5f + 0.25f * (float)d) +
                                 0.015625f * (float)(j + 1));
}

int ll_expert_outputs(const world_t *w, uint16_t **y) {
  const size_t RM = (size_t)w->R * w->M, H = (size_t)w->H;
  for (int d = 0; d < w->R; d++) {
    ll_ref_recv_t r;
    if (ll_ref_recv(w, d, 0, 0, &r) != TEST_PASS) return TEST_FAIL;
    y[d] = malloc((size_t)w->L * RM * H * 2 + 2);
    for (int j = 0; j < w->L; j++)
      for (int s = 0; s < w->R; s++)
        for (int i = 0; i < r.num[j * w->R + s]; i++) {
          const size_t row = (size_t)j * RM + (size_t)s * w->M + i;
          for (size_t c = 0; c < H; c++) y[d][row * H + c] = expert_fn(r.x[row * H + c], d, j);
        }
    ll_ref_recv_free(&r);
  }
  return TEST_PASS;
}

int ll_identity_outputs(const world_t *w, uint16_t **y) {
  for (int d = 0; d < w->R; d++) {
    ll_ref_recv_t r;
    if (ll_ref_recv(w, d, 0, 0, &r) != TEST_PASS) return TEST_FAIL;
    y[d] = r.x;
    r.x = NULL;
    ll_ref_recv_free(&r);
  }
  return TEST_PASS;
}

int ll_check_dispatch(const world_t *w, int me, const epx_ll_dispatch_result_t *res, int fp8,
                      int ue8m0, const char *label) {
  const int L = w->L, R = w->R, M = w->M, H = w->H, G = H / 128;
  const size_t RM = (size_t)R * M;
  ll_ref_recv_t ref;
  if (ll_ref_recv(w, me, fp8, ue8m0, &ref) != TEST_PASS) return TEST_FAIL;
  EXPECT_EQ_INT(res->num_local_experts, L);
  EXPECT_EQ_INT(res->rows_per_expert, (int)RM);
  EXPECT_EQ_INT(res->num_tokens, w->ranks[me].num_tokens);
  int *count = malloc(sizeof(int) * L), *begin = malloc(sizeof(int) * L * R),
      *num = malloc(sizeof(int) * L * R);
  EXPECT_CUDA(cudaMemcpy(count, res->recv_count, sizeof(int) * L, cudaMemcpyDeviceToHost));
  EXPECT_CUDA(cudaMemcpy(begin, res->recv_begin, sizeof(int) * L * R, cudaMemcpyDeviceToHost));
  EXPECT_CUDA(cudaMemcpy(num, res->recv_num, sizeof(int) * L * R, cudaMemcpyDeviceToHost));
  const size_t row_bytes = (size_t)H * (fp8 ? 1 : 2);
  char *rows = malloc((size_t)M * row_bytes + 16);
  float *sc = malloc(sizeof(float) * (size_t)M * G + 4);
  int *info = malloc(sizeof(int) * 4 * (size_t)M + 4);
  int bad = 0;
  for (int j = 0; j < L && !bad; j++) {
    EXPECTF(count[j] == ref.count[j], "%s: recv_count[%d] = %d, reference %d", label, j, count[j],
            ref.count[j]);
    for (int s = 0; s < R && !bad; s++) {
      const int n = num[j * R + s];
      EXPECTF(begin[j * R + s] == s * M, "%s: recv_begin[%d][%d] = %d", label, j, s,
              begin[j * R + s]);
      EXPECTF(n == ref.num[j * R + s], "%s: recv_num[%d][%d] = %d, reference %d", label, j, s, n,
              ref.num[j * R + s]);
      if (n == 0) continue;
      const size_t row0 = (size_t)j * RM + (size_t)s * M;
      EXPECT_CUDA(cudaMemcpy(rows, (const char *)res->recv_x + row0 * row_bytes, n * row_bytes,
                             cudaMemcpyDeviceToHost));
      EXPECT_CUDA(cudaMemcpy(info, res->recv_src_info + row0 * 4, sizeof(int) * 4 * n,
                             cudaMemcpyDeviceToHost));
      if (fp8)
        EXPECT_CUDA(cudaMemcpy(sc, res->recv_x_scales + row0 * G, sizeof(float) * G * n,
                               cudaMemcpyDeviceToHost));
      for (int i = 0; i < n && !bad; i++) {
        const size_t r = row0 + i;
        const void *want = fp8 ? (const void *)(ref.q + r * H) : (const void *)(ref.x + r * H);
        if (info[4 * i] != ref.sr[r] || info[4 * i + 1] != ref.st[r] ||
            info[4 * i + 2] != ref.sk[r] || info[4 * i + 3] != 0) {
          fprintf(stderr,
                  "  %s: expert %d row %zu: src_info (%d,%d,%d,%d), reference (%d,%d,%d,0)\n",
                  label, j, (size_t)s * M + i, info[4 * i], info[4 * i + 1], info[4 * i + 2],
                  info[4 * i + 3], ref.sr[r], ref.st[r], ref.sk[r]);
          bad = 1;
        } else if (memcmp(rows + i * row_bytes, want, row_bytes)) {
          fprintf(stderr, "  %s: expert %d row %zu (source %d token %d): %s payload differs\n",
                  label, j, (size_t)s * M + i, ref.sr[r], ref.st[r], fp8 ? "FP8" : "BF16");
          bad = 1;
        } else if (fp8 && memcmp(sc + (size_t)i * G, ref.sc + r * G, sizeof(float) * G)) {
          fprintf(stderr, "  %s: expert %d row %zu: FP8 scales differ (%g vs %g)\n", label, j,
                  (size_t)s * M + i, sc[(size_t)i * G], ref.sc[r * G]);
          bad = 1;
        }
      }
    }
  }
  free(count), free(begin), free(num), free(rows), free(sc), free(info);
  ll_ref_recv_free(&ref);
  return bad ? TEST_FAIL : TEST_PASS;
}

int ll_upload_outputs(const world_t *w, int me, uint16_t *const *y, void *dst) {
  const size_t RM = (size_t)w->R * w->M, H = (size_t)w->H;
  ll_ref_recv_t ref;
  if (ll_ref_recv(w, me, 0, 0, &ref) != TEST_PASS) return TEST_FAIL;
  for (int j = 0; j < w->L; j++)
    for (int s = 0; s < w->R; s++) {
      const int n = ref.num[j * w->R + s];
      const size_t row0 = (size_t)j * RM + (size_t)s * w->M;
      if (n > 0)
        EXPECT_CUDA(cudaMemcpy((char *)dst + row0 * H * 2, y[me] + row0 * H, n * H * 2,
                               cudaMemcpyHostToDevice));
    }
  ll_ref_recv_free(&ref);
  EXPECT_CUDA(cudaDeviceSynchronize());
  return TEST_PASS;
}

int ll_check_combine(const world_t *w, int me, const void *out_dev, uint16_t *const *y,
                     const char *label) {
  const int T = w->ranks[me].num_tokens, H = w->H, K = w->K;
  const size_t RM = (size_t)w->R * w->M;
  const float *weights = w->ranks[me].topk_weights;
  double *ref = malloc(sizeof(double) * ((size_t)T * H + 1));
  EXPECT(epx_ref_ll_combine_f64_layout(&w->ref, me, w->M, EPX_REF_LL_FIXED,
                                       (const uint16_t *const *)y, weights, ref) == 0);
  uint16_t *got = malloc((size_t)T * H * 2 + 2);
  EXPECT_CUDA(cudaMemcpy(got, out_dev, (size_t)T * H * 2, cudaMemcpyDeviceToHost));
  double *absum = calloc((size_t)H, sizeof(double));
  int ok = 1;
  for (int t = 0; t < T && ok; t++) {
    memset(absum, 0, sizeof(double) * H);
    for (int k = 0; k < K; k++) {
      const int64_t e = w->ranks[me].topk_idx[(size_t)t * K + k];
      if (e < 0 || e >= w->E) continue;
      const int d = (int)(e / w->L), j = (int)(e % w->L);
      const int row = epx_ref_ll_row(&w->ref, w->M, me, t, (int)e);
      const double wk = weights ? fabs((double)weights[(size_t)t * K + k]) : 1.0;
      const uint16_t *yr = y[d] + ((size_t)j * RM + row) * H;
      for (int c = 0; c < H; c++) absum[c] += wk * fabs((double)epx_ref_bf16_to_float(yr[c]));
    }
    for (int c = 0; c < H && ok; c++) {
      const double g = epx_ref_bf16_to_float(got[(size_t)t * H + c]), r = ref[(size_t)t * H + c];
      if (!(fabs(g - r) <= absum[c] / 256 + 1e-6)) {
        fprintf(stderr, "  %s: combine out[%d][%d] = %.8g, float64 reference %.8g (|w*y| %g)\n",
                label, t, c, g, r, absum[c]);
        ok = 0;
      }
    }
  }
  free(ref), free(got), free(absum);
  return ok ? TEST_PASS : TEST_FAIL;
}

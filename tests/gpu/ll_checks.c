/*
 * ll_checks.c - the reference's fixed-slot receive arrays, the expert outputs and the result
 * checks of the low-latency GPU tests (see ll_checks.h).
 */
#include "gpu/ll_checks.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* 0xff (NaN in BF16 and float32) over both buffers' receive arrays and returned-rows areas,
 * then a device barrier, so that no peer writes before every rank has poisoned. */
int ll_poison(epx_test_rank_t *t, epx_group_t g) {
  const epx__ws_layout_t *l = &g->layout;
  const size_t begin[2] = {l->ll_x_offset, l->ll_combine_recv_offset};
  const size_t end[2] = {l->ll_stage_offset, l->ll_my_ids_offset};
  for (int i = 0; i < 4; i++) {
    char *buf = g->workspace + l->ll_offset + (size_t)(i >> 1) * l->ll_parity_bytes;
    EXPECT_CUDA(cudaMemset(buf + begin[i & 1], 0xff, end[i & 1] - begin[i & 1]));
  }
  EXPECT_CUDA(cudaDeviceSynchronize());
  EXPECT_OK(epx_group_barrier(g, t->stream));
  return gpu_host_barrier(t);
}

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
static int ref_recv_layout(const world_t *w, int d, int fp8, int ue8m0, epx_ref_ll_layout_t layout,
                           ll_ref_recv_t *r) {
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
  EXPECT(epx_ref_ll_dispatch_layout(&w->ref, d, w->M, ue8m0, layout, &out) == 0);
  return TEST_PASS;
}

int ll_ref_recv(const world_t *w, int d, int fp8, int ue8m0, ll_ref_recv_t *r) {
  return ref_recv_layout(w, d, fp8, ue8m0, EPX_REF_LL_FIXED, r);
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

/* y[me]'s segment rows to dst: at s*M (fixed slots) or back to back from row 0 (packed). */
static int upload_rows(const world_t *w, int me, uint16_t *const *y, void *dst, int packed) {
  const size_t RM = (size_t)w->R * w->M, H = (size_t)w->H;
  ll_ref_recv_t ref;
  if (ll_ref_recv(w, me, 0, 0, &ref) != TEST_PASS) return TEST_FAIL;
  for (int j = 0; j < w->L; j++) {
    size_t next = 0; /* packed: rows of the sources before s */
    for (int s = 0; s < w->R; s++) {
      const size_t n = (size_t)ref.num[j * w->R + s], fixed = (size_t)s * w->M;
      const size_t from = (size_t)j * RM + fixed, to = (size_t)j * RM + (packed ? next : fixed);
      if (n > 0)
        EXPECT_CUDA(cudaMemcpy((char *)dst + to * H * 2, y[me] + from * H, n * H * 2,
                               cudaMemcpyHostToDevice));
      next += n;
    }
  }
  ll_ref_recv_free(&ref);
  EXPECT_CUDA(cudaDeviceSynchronize());
  return TEST_PASS;
}

int ll_upload_outputs(const world_t *w, int me, uint16_t *const *y, void *dst) {
  return upload_rows(w, me, y, dst, 0);
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

/* ---------------------------------------------------------------------------------------------
 * Packed layout
 * ------------------------------------------------------------------------------------------- */
/* Some token lists an expert in two valid slots (the references' packed layouts then differ). */
static int has_repeated_expert(const world_t *w) {
  for (int s = 0; s < w->R; s++)
    for (int t = 0; t < w->ranks[s].num_tokens; t++) {
      const int64_t *ids = w->idx[s] + (size_t)t * w->K;
      for (int k = 0; k < w->K; k++)
        for (int q = 0; q < k; q++)
          if (ids[k] >= 0 && ids[k] < w->E && ids[q] == ids[k]) return 1;
    }
  return 0;
}

/* The fixed-slot arrays of r packed in place: each source's segment moves forward to the rows
 * of the sources before it (a row only ever moves to a lower index, so memmove in order). */
static void pack_in_place(const world_t *w, int fp8, ll_ref_recv_t *r) {
  const int L = w->L, R = w->R, M = w->M;
  const size_t RM = (size_t)R * M, H = (size_t)w->H, G = H / 128;
  for (int j = 0; j < L; j++) {
    int next = 0;
    for (int s = 0; s < R; s++) {
      const size_t n = (size_t)r->num[j * R + s];
      const size_t from = (size_t)j * RM + (size_t)s * M, to = (size_t)j * RM + next;
      if (n > 0 && from != to) {
        memmove(r->x + to * H, r->x + from * H, n * H * 2);
        if (fp8) memmove(r->q + to * H, r->q + from * H, n * H);
        if (fp8) memmove(r->sc + to * G, r->sc + from * G, n * G * 4);
        memmove(r->sr + to, r->sr + from, n * sizeof(int));
        memmove(r->st + to, r->st + from, n * sizeof(int));
        memmove(r->sk + to, r->sk + from, n * sizeof(int));
      }
      r->begin[j * R + s] = next;
      next += (int)n;
    }
  }
}

/* got (packed from the fixed reference) against the reference's own EPX_REF_LL_PACKED. */
static int same_as_ref_packed(const world_t *w, int d, int fp8, int ue8m0,
                              const ll_ref_recv_t *got) {
  const int L = w->L, R = w->R;
  const size_t RM = (size_t)R * w->M, H = (size_t)w->H, G = H / 128;
  ll_ref_recv_t want;
  if (ref_recv_layout(w, d, fp8, ue8m0, EPX_REF_LL_PACKED, &want) != TEST_PASS) return TEST_FAIL;
  int bad = 0;
  for (int j = 0; j < L && !bad; j++) {
    bad = got->count[j] != want.count[j] ||
          memcmp(got->begin + j * R, want.begin + j * R, sizeof(int) * R) ||
          memcmp(got->num + j * R, want.num + j * R, sizeof(int) * R);
    for (size_t i = (size_t)j * RM; i < (size_t)j * RM + want.count[j] && !bad; i++)
      bad = got->sr[i] != want.sr[i] || got->st[i] != want.st[i] || got->sk[i] != want.sk[i] ||
            memcmp(got->x + i * H, want.x + i * H, H * 2) ||
            (fp8 && (memcmp(got->q + i * H, want.q + i * H, H) ||
                     memcmp(got->sc + i * G, want.sc + i * G, G * 4)));
    if (bad) fprintf(stderr, "  rank %d expert %d: packed reference != EPX_REF_LL_PACKED\n", d, j);
  }
  ll_ref_recv_free(&want);
  return bad ? TEST_FAIL : TEST_PASS;
}

int ll_ref_recv_packed(const world_t *w, int d, int fp8, int ue8m0, ll_ref_recv_t *r) {
  if (ll_ref_recv(w, d, fp8, ue8m0, r) != TEST_PASS) return TEST_FAIL;
  pack_in_place(w, fp8, r);
  if (!has_repeated_expert(w) && same_as_ref_packed(w, d, fp8, ue8m0, r) != TEST_PASS) {
    ll_ref_recv_free(r);
    return TEST_FAIL;
  }
  return TEST_PASS;
}

/* The UE8M0 word w of a row from its float32 power-of-two scales sc[0, G). */
static uint32_t ue8m0_word(const float *sc, int G, int w) {
  uint32_t word = 0;
  for (int i = 0; i < 4 && 4 * w + i < G; i++) {
    uint32_t bits;
    memcpy(&bits, &sc[4 * w + i], 4);
    word |= ((bits >> 23) & 0xffu) << (8 * i);
  }
  return word;
}

/* Rows [row0, row0 + n) of the GPU's scales against the reference's float32 scales. */
static int check_scales(const world_t *w, const epx_ll_dispatch_result_t *res, int pack_scales,
                        size_t row0, int n, const float *want, const char *label) {
  const int G = w->H / 128, nw = (w->H + 511) / 512, per_row = pack_scales ? nw : G;
  uint32_t *got = malloc(sizeof(uint32_t) * (size_t)n * per_row + 4);
  const void *src = pack_scales ? (const void *)(res->recv_x_scales_packed + row0 * nw)
                                : (const void *)(res->recv_x_scales + row0 * G);
  EXPECT_CUDA(cudaMemcpy(got, src, sizeof(uint32_t) * (size_t)n * per_row, cudaMemcpyDeviceToHost));
  int bad = 0;
  for (int i = 0; i < n && !bad; i++)
    for (int q = 0; q < per_row && !bad; q++) {
      uint32_t expect;
      if (pack_scales)
        expect = ue8m0_word(want + (size_t)i * G, G, q);
      else
        memcpy(&expect, &want[(size_t)i * G + q], 4);
      if (got[(size_t)i * per_row + q] != expect) {
        fprintf(stderr, "  %s: row %zu scale word %d = 0x%08x, reference 0x%08x\n", label, row0 + i,
                q, got[(size_t)i * per_row + q], expect);
        bad = 1;
      }
    }
  free(got);
  return bad ? TEST_FAIL : TEST_PASS;
}

/* Packed: up to 32 rows past count of expert j still hold the 0xff poison. */
static int check_untouched(const world_t *w, const epx_ll_dispatch_result_t *res, int fp8,
                           int pack_scales, int j, int count, const char *label) {
  const size_t RM = (size_t)w->R * w->M, row0 = (size_t)j * RM + count;
  const int n = (int)(RM - count < 32 ? RM - count : 32);
  if (n <= 0) return TEST_PASS;
  const size_t row_bytes = (size_t)w->H * (fp8 ? 1 : 2);
  const size_t sc_bytes =
      fp8 ? (pack_scales ? (size_t)(w->H + 511) / 512 : (size_t)w->H / 128) * 4 : 0;
  const size_t total = n * (row_bytes + 16 + sc_bytes);
  unsigned char *buf = malloc(total + 1);
  EXPECT_CUDA(cudaMemcpy(buf, (const char *)res->recv_x + row0 * row_bytes, n * row_bytes,
                         cudaMemcpyDeviceToHost));
  EXPECT_CUDA(cudaMemcpy(buf + n * row_bytes, res->recv_src_info + row0 * 4, n * 16,
                         cudaMemcpyDeviceToHost));
  if (fp8) {
    const char *sc =
        pack_scales ? (const char *)res->recv_x_scales_packed : (const char *)res->recv_x_scales;
    EXPECT_CUDA(cudaMemcpy(buf + n * (row_bytes + 16), sc + row0 * sc_bytes, n * sc_bytes,
                           cudaMemcpyDeviceToHost));
  }
  size_t i = 0;
  while (i < total && buf[i] == 0xff) i++;
  free(buf);
  EXPECTF(i == total, "%s: expert %d: a row past recv_count = %d was written (byte %zu of %zu)",
          label, j, count, i, total);
  return TEST_PASS;
}

int ll_check_dispatch_layout(const world_t *w, int me, const epx_ll_dispatch_result_t *res, int fp8,
                             int ue8m0, int pack_scales, const long long *layout_range_dev,
                             const char *label) {
  const int L = w->L, R = w->R, H = w->H, G = H / 128, packed = res->packed;
  const size_t RM = (size_t)R * w->M, row_bytes = (size_t)H * (fp8 ? 1 : 2);
  ll_ref_recv_t ref;
  if ((packed ? ll_ref_recv_packed(w, me, fp8, ue8m0, &ref)
              : ll_ref_recv(w, me, fp8, ue8m0, &ref)) != TEST_PASS)
    return TEST_FAIL;
  EXPECT_EQ_INT(res->num_local_experts, L);
  EXPECT_EQ_INT(res->rows_per_expert, (int)RM);
  EXPECT(fp8 && pack_scales ? !res->recv_x_scales && res->recv_x_scales_packed
                            : !res->recv_x_scales_packed);
  int *ints = malloc(sizeof(int) * (size_t)L * (2 * R + 1));
  int *count = ints, *begin = ints + L, *num = ints + L + (size_t)L * R;
  long long *range = malloc(sizeof(long long) * (size_t)L * R);
  EXPECT_CUDA(cudaMemcpy(count, res->recv_count, sizeof(int) * L, cudaMemcpyDeviceToHost));
  EXPECT_CUDA(cudaMemcpy(begin, res->recv_begin, sizeof(int) * L * R, cudaMemcpyDeviceToHost));
  EXPECT_CUDA(cudaMemcpy(num, res->recv_num, sizeof(int) * L * R, cudaMemcpyDeviceToHost));
  if (layout_range_dev)
    EXPECT_CUDA(
        cudaMemcpy(range, layout_range_dev, sizeof(long long) * L * R, cudaMemcpyDeviceToHost));
  char *rows = malloc((size_t)w->M * row_bytes + 16);
  int *info = malloc(sizeof(int) * 4 * (size_t)w->M + 4);
  int bad = 0;
  for (int j = 0; j < L && !bad; j++) {
    EXPECTF(count[j] == ref.count[j], "%s: recv_count[%d] = %d, reference %d", label, j, count[j],
            ref.count[j]);
    for (int s = 0; s < R && !bad; s++) {
      const int i0 = j * R + s, n = num[i0];
      EXPECTF(begin[i0] == ref.begin[i0] && n == ref.num[i0],
              "%s: (expert %d, source %d): begin %d num %d, reference %d %d", label, j, s,
              begin[i0], n, ref.begin[i0], ref.num[i0]);
      if (layout_range_dev)
        EXPECTF(range[i0] == (((long long)begin[i0] << 32) | n),
                "%s: layout_range[%d][%d] = 0x%llx, begin %d num %d", label, j, s, range[i0],
                begin[i0], n);
      if (n == 0) continue;
      const size_t row0 = (size_t)j * RM + begin[i0];
      EXPECT_CUDA(cudaMemcpy(rows, (const char *)res->recv_x + row0 * row_bytes, n * row_bytes,
                             cudaMemcpyDeviceToHost));
      EXPECT_CUDA(cudaMemcpy(info, res->recv_src_info + row0 * 4, sizeof(int) * 4 * n,
                             cudaMemcpyDeviceToHost));
      for (int i = 0; i < n && !bad; i++) {
        const size_t r = row0 + i;
        const void *want = fp8 ? (const void *)(ref.q + r * H) : (const void *)(ref.x + r * H);
        bad = info[4 * i] != ref.sr[r] || info[4 * i + 1] != ref.st[r] ||
              info[4 * i + 2] != ref.sk[r] || info[4 * i + 3] != 0 ||
              memcmp(rows + i * row_bytes, want, row_bytes);
        if (bad)
          fprintf(stderr, "  %s: expert %d row %zu: source (%d,%d,%d), reference (%d,%d,%d), %s\n",
                  label, j, r - (size_t)j * RM, info[4 * i], info[4 * i + 1], info[4 * i + 2],
                  ref.sr[r], ref.st[r], ref.sk[r],
                  memcmp(rows + i * row_bytes, want, row_bytes) ? "payload differs" : "payload ok");
      }
      if (!bad && fp8 && check_scales(w, res, pack_scales, row0, n, ref.sc + row0 * G, label))
        bad = 1;
    }
    if (!bad && packed && check_untouched(w, res, fp8, pack_scales, j, count[j], label)) bad = 1;
  }
  free(ints), free(range), free(rows), free(info);
  ll_ref_recv_free(&ref);
  return bad ? TEST_FAIL : TEST_PASS;
}

int ll_upload_outputs_packed(const world_t *w, int me, uint16_t *const *y, void *dst) {
  return upload_rows(w, me, y, dst, 1);
}

float *ll_draw_combine_weights(const world_t *w, int s, uint64_t *rng) {
  const size_t n = (size_t)w->ranks[s].num_tokens * w->K;
  float *cw = malloc(sizeof(float) * (n + 1));
  for (size_t i = 0; i < n; i++) {
    const float v = 2.5f * epx_test_rand_unit(rng) - 1.f;
    cw[i] = epx_test_rand_int(rng, 5) == 0 ? 0.f : v;
  }
  return cw;
}

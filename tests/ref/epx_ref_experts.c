/*
 * epx_ref_experts.c - the CPU oracle of the experts' FFN (epx_ref_experts.h).
 */
#include "ref/epx_ref_experts.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref/epx_ref.h"

void epx_ref_experts_rows(int num_experts, int num_rows, const int *count, const int *begin,
                          int rows_per_expert, int *first, int *rows) {
  for (int e = 0; e < num_experts; e++) {
    int b = begin ? begin[e] : e * rows_per_expert, c = count[e];
    if (begin && (b < 0 || b > num_rows)) b = 0, c = 0;
    const int room = begin ? num_rows - b : rows_per_expert;
    if (c > room) c = room;
    if (c < 0) c = 0;
    first[e] = b;
    rows[e] = c;
  }
}

static double silu_mul(double g, double u) {
  return g / (1.0 + exp(-g)) * u;
}

/* y[n] = sum_k a[k] w[n][k] for n < N: BF16 operands, double sums. */
static void gemv_bf16(const double *a, const uint16_t *w, int n_rows, int k, double *y) {
  for (int n = 0; n < n_rows; n++) {
    const uint16_t *wr = w + (size_t)n * k;
    double s = 0;
    for (int i = 0; i < k; i++) s += a[i] * (double)epx_ref_bf16_to_float(wr[i]);
    y[n] = s;
  }
}

/* The FP8 form: a given as codes qa with per-128 scales sa; w [N, K] codes with block scales
 * ws [N/128, K/128]; each 128-deep block's sum times ws * sa. */
static void gemv_fp8(const uint8_t *qa, const float *sa, const uint8_t *w, const float *ws,
                     int n_rows, int k, double *y) {
  const int kb = k / 128;
  for (int n = 0; n < n_rows; n++) {
    const uint8_t *wr = w + (size_t)n * k;
    double total = 0;
    for (int b = 0; b < kb; b++) {
      double s = 0;
      for (int i = b * 128; i < b * 128 + 128; i++)
        s += (double)epx_ref_fp8_to_float(qa[i]) * (double)epx_ref_fp8_to_float(wr[i]);
      total += s * ((double)ws[(size_t)(n / 128) * kb + b] * (double)sa[b]);
    }
    y[n] = total;
  }
}

/* Quantize one float row of n channels (a multiple of 128) by epx_ref.h's rule. */
static void quantize_float_row(const float *f, int n, uint8_t *q, float *scales) {
  for (int g = 0; g < n / 128; g++) {
    float amax = 0.f;
    for (int c = 0; c < 128; c++) amax = fmaxf(amax, fabsf(f[g * 128 + c]));
    const float scale = epx_ref_fp8_scale(amax, 0);
    const float inv = 1.0f / scale;
    for (int c = 0; c < 128; c++) q[g * 128 + c] = epx_ref_fp8_from_float(f[g * 128 + c] * inv);
    scales[g] = scale;
  }
}

/* One step of each h value moves output c by |w_down[c][j]| x step_j at most: the largest.
 * hstep: scratch for the k steps of h's codes, found once for all n_rows outputs. */
static void one_step_row(const uint8_t *wd, const float *ws, const uint8_t *hq, const float *hs,
                         int n_rows, int k, double *hstep, float *step_out) {
  const int kb = k / 128;
  for (int j = 0; j < k; j++) hstep[j] = (double)epx_ref_fp8_step(hq[j]);
  for (int c = 0; c < n_rows; c++) {
    double most = 0;
    for (int j = 0; j < k; j++) {
      const double m = fabs((double)epx_ref_fp8_to_float(wd[(size_t)c * k + j])) *
                       (double)ws[(size_t)(c / 128) * kb + j / 128] * hstep[j] *
                       (double)hs[j / 128];
      if (m > most) most = m;
    }
    step_out[c] = (float)most;
  }
}

int epx_ref_experts_ffn(const epx_ref_experts_t *w, const void *x, int x_fp8, const float *x_scales,
                        int num_rows, const int *first, const int *rows, uint16_t *out) {
  return epx_ref_experts_ffn_one_step(w, x, x_fp8, x_scales, num_rows, first, rows, out, NULL);
}

int epx_ref_experts_ffn_one_step(const epx_ref_experts_t *w, const void *x, int x_fp8,
                                 const float *x_scales, int num_rows, const int *first,
                                 const int *rows, uint16_t *out, float *one_step) {
  const int H = w->hidden, I = w->intermediate, E = w->num_experts;
  if (H < 128 || H % 128 || I < 128 || I % 128 || E < 1 || (x_fp8 && !w->fp8)) {
    fprintf(stderr, "epx_ref_experts_ffn: unsupported shape H %d I %d E %d x_fp8 %d fp8 %d\n", H, I,
            E, x_fp8, w->fp8);
    return -1;
  }
  double *a = malloc(sizeof(double) * (size_t)H), *gu = malloc(sizeof(double) * 2 * (size_t)I);
  double *hd = malloc(sizeof(double) * (size_t)I), *y = malloc(sizeof(double) * (size_t)H);
  float *hf = malloc(sizeof(float) * (size_t)I), *xs = malloc(sizeof(float) * (size_t)(H / 128));
  float *hs = malloc(sizeof(float) * (size_t)(I / 128));
  uint8_t *xq = malloc((size_t)H), *hq = malloc((size_t)I);
  float *xf = malloc(sizeof(float) * (size_t)H);
  int rc = (a && gu && hd && y && hf && xs && hs && xq && hq && xf) ? 0 : -1;
  for (int e = 0; e < E; e++)
    if (first[e] < 0 || rows[e] < 0 || first[e] + rows[e] > num_rows) {
      fprintf(stderr, "epx_ref_experts_ffn: expert %d rows [%d, +%d) outside [0, %d)\n", e,
              first[e], rows[e], num_rows);
      rc = -1;
    }
  for (int e = 0; e < E && rc == 0; e++) {
    for (int r = first[e]; r < first[e] + rows[e]; r++) {
      if (!w->fp8) {
        const uint16_t *xr = (const uint16_t *)x + (size_t)r * H;
        for (int k = 0; k < H; k++) a[k] = epx_ref_bf16_to_float(xr[k]);
        gemv_bf16(a, w->gate_up_bf16 + (size_t)e * 2 * I * H, 2 * I, H, gu);
        for (int n = 0; n < I; n++)
          hd[n] = epx_ref_bf16_to_float(epx_ref_bf16_from_float((float)silu_mul(gu[n], gu[I + n])));
        gemv_bf16(hd, w->down_bf16 + (size_t)e * H * I, H, I, y);
      } else {
        const uint8_t *qx;
        const float *sx;
        if (x_fp8) {
          qx = (const uint8_t *)x + (size_t)r * H;
          sx = x_scales + (size_t)r * (H / 128);
        } else {
          const uint16_t *xr = (const uint16_t *)x + (size_t)r * H;
          for (int k = 0; k < H; k++) xf[k] = epx_ref_bf16_to_float(xr[k]);
          quantize_float_row(xf, H, xq, xs);
          qx = xq;
          sx = xs;
        }
        gemv_fp8(qx, sx, w->gate_up_fp8 + (size_t)e * 2 * I * H,
                 w->gate_up_scales + (size_t)e * (2 * I / 128) * (H / 128), 2 * I, H, gu);
        for (int n = 0; n < I; n++) hf[n] = (float)silu_mul(gu[n], gu[I + n]);
        quantize_float_row(hf, I, hq, hs);
        gemv_fp8(hq, hs, w->down_fp8 + (size_t)e * H * I,
                 w->down_scales + (size_t)e * (H / 128) * (I / 128), H, I, y);
        if (one_step)
          one_step_row(w->down_fp8 + (size_t)e * H * I,
                       w->down_scales + (size_t)e * (H / 128) * (I / 128), hq, hs, H, I,
                       hd /* the BF16 path's h, unused here */, one_step + (size_t)r * H);
      }
      if (one_step && !w->fp8) memset(one_step + (size_t)r * H, 0, sizeof(float) * (size_t)H);
      for (int c = 0; c < H; c++) out[(size_t)r * H + c] = epx_ref_bf16_from_float((float)y[c]);
    }
  }
  free(a), free(gu), free(hd), free(y), free(hf), free(xs), free(hs), free(xq), free(hq), free(xf);
  return rc;
}

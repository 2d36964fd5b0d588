/*
 * epx_ref_moe.c - the MoE layer's oracle (epx_ref_moe.h): the three step oracles composed.
 */
#include "ref/epx_ref_moe.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* One rank's received rows (fixed slots) and their FFN outputs. */
typedef struct {
  uint16_t *x16, *y;
  uint8_t *x8;
  float *scales, *step; /* step: the FFN rows' one-step allowance, or NULL */
  int *count, *num;
} rank_rows_t;

static void rank_rows_free(rank_rows_t *r) {
  free(r->x16), free(r->y), free(r->x8), free(r->scales), free(r->step), free(r->count);
  free(r->num);
}

/* Steps 1 and 2 for rank d: the FFN runs once per source, on each expert's segment of it. */
static int run_rank(const epx_ref_world_t *w, const epx_ref_experts_t *ex, int M, int fp8, int d,
                    int want_step, rank_rows_t *r) {
  const int R = w->num_ranks, L = w->num_experts / R, H = w->hidden;
  const size_t rows = (size_t)L * R * M;
  memset(r, 0, sizeof *r);
  r->y = calloc(rows * H + 1, 2);
  r->count = calloc((size_t)L, sizeof(int));
  r->num = calloc((size_t)L * R, sizeof(int));
  if (want_step) r->step = calloc(rows * H + 1, sizeof(float));
  if (fp8) {
    r->x8 = calloc(rows * H + 1, 1);
    r->scales = calloc(rows * (H / 128) + 1, sizeof(float));
  } else {
    r->x16 = calloc(rows * H + 1, 2);
  }
  int *first = malloc(sizeof(int) * L), *n = malloc(sizeof(int) * L);
  if (!(r->y && r->count && r->num && first && n && (fp8 ? r->x8 && r->scales : r->x16 != NULL) &&
        (!want_step || r->step))) {
    fprintf(stderr, "epx_ref_moe_decode: out of memory\n");
    free(first), free(n);
    return -1;
  }
  const epx_ref_ll_recv_t out = {r->x16, r->x8, r->scales, r->count, NULL,
                                 r->num, NULL,  NULL,      NULL};
  int rc = epx_ref_ll_dispatch_layout(w, d, M, 0, EPX_REF_LL_FIXED, &out);
  for (int s = 0; s < R && rc == 0; s++) {
    for (int j = 0; j < L; j++) first[j] = j * R * M + s * M, n[j] = r->num[j * R + s];
    rc = epx_ref_experts_ffn_one_step(&ex[d], fp8 ? (const void *)r->x8 : (const void *)r->x16, fp8,
                                      r->scales, (int)rows, first, n, r->y, r->step);
  }
  free(first), free(n);
  return rc;
}

int epx_ref_moe_decode(const epx_ref_world_t *w, const epx_ref_experts_t *experts, int M,
                       int fp8_dispatch, int src_rank, double *out, double *abs_sum, double *y_rms,
                       double *one_step) {
  if (!w || !experts || !out || w->num_ranks < 1 || w->num_ranks > 64 || src_rank < 0 ||
      src_rank >= w->num_ranks || M < 1 || w->num_experts % w->num_ranks) {
    fprintf(stderr, "epx_ref_moe_decode: invalid arguments\n");
    return -1;
  }
  const int R = w->num_ranks, L = w->num_experts / R, H = w->hidden, K = w->top_k;
  const int T = w->ranks[src_rank].num_tokens;
  const float *weights = w->ranks[src_rank].topk_weights;
  const int64_t *ids = w->ranks[src_rank].topk_idx;
  rank_rows_t ranks[64];
  const uint16_t *y[64];
  int rc = 0, made = 0;
  for (; made < R && rc == 0; made++) {
    rc = run_rank(w, experts, M, fp8_dispatch, made, one_step != NULL, &ranks[made]);
    y[made] = ranks[made].y;
  }
  if (rc == 0)
    rc = epx_ref_ll_combine_f64_layout(w, src_rank, M, EPX_REF_LL_FIXED, y, weights, out);
  /* The magnitude of each output: every valid slot's |w| x |its expert's row|; and the largest
   * of the slots' |w| x one-step allowances. */
  if (rc == 0 && (abs_sum || one_step)) {
    if (abs_sum) memset(abs_sum, 0, sizeof(double) * (size_t)T * H);
    if (one_step) memset(one_step, 0, sizeof(double) * (size_t)T * H);
    for (int t = 0; t < T; t++)
      for (int k = 0; k < K; k++) {
        const int64_t e = ids[(size_t)t * K + k];
        if (e < 0 || e >= w->num_experts) continue;
        const int row = epx_ref_ll_row(w, M, src_rank, t, (int)e);
        const size_t at = ((size_t)(e % L) * R * M + row) * H;
        const double wk = weights ? fabs((double)weights[(size_t)t * K + k]) : 1.0;
        for (int c = 0; c < H; c++) {
          if (abs_sum)
            abs_sum[(size_t)t * H + c] +=
                wk * fabs((double)epx_ref_bf16_to_float(ranks[e / L].y[at + c]));
          if (one_step) {
            const double m = wk * (double)ranks[e / L].step[at + c];
            if (m > one_step[(size_t)t * H + c]) one_step[(size_t)t * H + c] = m;
          }
        }
      }
  }
  if (rc == 0 && y_rms) { /* over every received row of every rank */
    double sq = 0;
    long long vals = 0;
    for (int d = 0; d < R; d++)
      for (int j = 0; j < L; j++)
        for (int s = 0; s < R; s++)
          for (int i = 0; i < ranks[d].num[j * R + s]; i++) {
            const uint16_t *yr = ranks[d].y + ((size_t)j * R * M + (size_t)s * M + i) * H;
            for (int c = 0; c < H; c++) {
              const double v = epx_ref_bf16_to_float(yr[c]);
              sq += v * v;
            }
            vals += H;
          }
    *y_rms = vals ? sqrt(sq / (double)vals) : 0.0;
  }
  for (int d = 0; d < made; d++) rank_rows_free(&ranks[d]);
  return rc;
}

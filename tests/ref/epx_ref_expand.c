/*
 * epx_ref_expand.c - the expert-major layout's oracle (epx_ref_expand.h), built on
 * epx_ref_dispatch: its rows, regrouped by local expert.
 */
#include "ref/epx_ref_expand.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* NOTE: the volatile store rounds the product to float32 on its own, so the following addition
 * is never contracted into a fused multiply-add (the same rule as epx_ref.c). */
static float product_f32(float a, float b) {
  volatile float p = a * b;
  return p;
}

static double product_f64(double a, double b) {
  volatile double p = a * b;
  return p;
}

static int refuse(const char *what) {
  fprintf(stderr, "epx_ref_expand: %s\n", what);
  return -1;
}

void epx_ref_expand_free(epx_ref_expand_t *e) {
  if (!e) return;
  free(e->begin), free(e->count), free(e->x), free(e->x_fp8), free(e->x_scales);
  free(e->src_rank), free(e->src_token), free(e->src_slot), free(e->weight);
  memset(e, 0, sizeof *e);
}

/* Row i of the dispatch r holds local expert j: its first slot listing j, else -1. */
static int first_slot(const epx_ref_recv_t *r, int K, int i, int j) {
  for (int k = 0; k < K; k++)
    if (r->topk_idx[(size_t)i * K + k] == j) return k;
  return -1;
}

int epx_ref_dispatch_expand(const epx_ref_world_t *world, int dst_rank, epx_ref_payload_t payload,
                            int expert_alignment, epx_ref_expand_t *out) {
  if (!out) return refuse("out is NULL");
  memset(out, 0, sizeof *out);
  epx_ref_recv_t r;
  if (epx_ref_dispatch(world, dst_rank, payload, expert_alignment, &r) != 0) {
    epx_ref_recv_free(&r);
    return -1;
  }
  const int L = r.num_local_experts, K = world->top_k, H = world->hidden, G = H / 128;
  out->num_local_experts = L;
  out->begin = calloc((size_t)L + 1, sizeof(int));
  out->count = calloc((size_t)L + 1, sizeof(int));
  int ok = out->begin && out->count;
  for (int j = 0; ok && j < L; j++) {
    out->count[j] = r.num_recv_per_expert[j];
    out->begin[j + 1] = out->begin[j] + r.num_recv_per_expert_aligned[j];
  }
  const int n = ok ? out->begin[L] : 0;
  out->num_rows = n;
  out->src_rank = malloc(sizeof(int) * ((size_t)n + 1));
  out->src_token = malloc(sizeof(int) * ((size_t)n + 1));
  out->src_slot = malloc(sizeof(int) * ((size_t)n + 1));
  out->weight = calloc((size_t)n + 1, sizeof(float));
  ok = ok && out->src_rank && out->src_token && out->src_slot && out->weight;
  if (payload == EPX_REF_PAYLOAD_BF16) {
    out->x = calloc((size_t)n * H + 1, sizeof(uint16_t));
    ok = ok && out->x;
  } else if (payload == EPX_REF_PAYLOAD_FP8) {
    out->x_fp8 = calloc((size_t)n * H + 1, 1);
    out->x_scales = calloc((size_t)n * G + 1, sizeof(float));
    ok = ok && out->x_fp8 && out->x_scales;
  }
  if (!ok) {
    epx_ref_recv_free(&r);
    return refuse("out of memory");
  }
  for (int i = 0; i < n; i++) out->src_rank[i] = out->src_token[i] = out->src_slot[i] = -1;

  for (int j = 0; j < L; j++) {
    int row = out->begin[j];
    for (int i = 0; i < r.num_recv; i++) {
      const int slot = first_slot(&r, K, i, j);
      if (slot < 0) continue;
      float w = 0.0f;
      for (int k = slot; k < K; k++)
        if (r.topk_idx[(size_t)i * K + k] == j) w = w + r.topk_weights[(size_t)i * K + k];
      out->src_rank[row] = r.src_rank[i];
      out->src_token[row] = r.src_token[i];
      out->src_slot[row] = slot;
      out->weight[row] = w;
      if (out->x) memcpy(out->x + (size_t)row * H, r.x + (size_t)i * H, sizeof(uint16_t) * H);
      if (out->x_fp8) {
        memcpy(out->x_fp8 + (size_t)row * H, r.x_fp8 + (size_t)i * H, (size_t)H);
        memcpy(out->x_scales + (size_t)row * G, r.x_scales + (size_t)i * G, sizeof(float) * G);
      }
      row++;
    }
  }
  epx_ref_recv_free(&r);
  return 0;
}

int epx_ref_combine_expand(const epx_ref_world_t *world, int src_rank, int expert_alignment,
                           const uint16_t *const *y, int weighted, uint16_t *out, double *out_f64) {
  if (!y) return refuse("y is NULL");
  if (!world || src_rank < 0 || src_rank >= world->num_ranks)
    return refuse("world is NULL or src_rank is out of range");
  const int R = world->num_ranks, H = world->hidden, T = world->ranks[src_rank].num_tokens;
  float *acc = calloc((size_t)T * H + 1, sizeof(float));     /* home sums */
  float *partial = calloc((size_t)T * H + 1, sizeof(float)); /* rank d's sums */
  double *acc64 = calloc((size_t)T * H + 1, sizeof(double)); /* float64, no rounding */
  unsigned char *on_d = calloc((size_t)T + 1, 1);            /* token t has a row on d */
  int res = acc && partial && acc64 && on_d ? 0 : refuse("out of memory");
  for (int d = 0; res == 0 && d < R; d++) {
    epx_ref_expand_t e;
    if (epx_ref_dispatch_expand(world, d, EPX_REF_PAYLOAD_NONE, expert_alignment, &e) != 0) {
      res = -1;
    } else if (e.num_rows > 0 && !y[d]) {
      res = refuse("y[d] is NULL but rank d has rows");
    } else {
      memset(partial, 0, sizeof(float) * (size_t)T * H);
      memset(on_d, 0, (size_t)T);
      for (int i = 0; i < e.num_rows; i++) { /* rows in order: a token's experts ascending */
        if (e.src_rank[i] != src_rank) continue;
        const float w = weighted ? e.weight[i] : 1.0f;
        on_d[e.src_token[i]] = 1;
        float *p = partial + (size_t)e.src_token[i] * H;
        double *p64 = acc64 + (size_t)e.src_token[i] * H;
        for (int c = 0; c < H; c++) {
          const float v = epx_ref_bf16_to_float(y[d][(size_t)i * H + c]);
          p[c] = p[c] + product_f32(w, v);
          p64[c] = p64[c] + product_f64(w, v);
        }
      }
      /* The row d sends home, rounded to BF16, added by tokens with a row on d only (a +0.0
       * partial of a token not on d would turn a -0.0 sum into +0.0). */
      for (size_t t = 0; t < (size_t)T; t++)
        for (int c = 0; on_d[t] && c < H; c++)
          acc[t * H + c] =
              acc[t * H + c] + epx_ref_bf16_to_float(epx_ref_bf16_from_float(partial[t * H + c]));
    }
    epx_ref_expand_free(&e);
  }
  for (size_t i = 0; res == 0 && i < (size_t)T * H; i++) {
    if (out) out[i] = epx_ref_bf16_from_float(acc[i]);
    if (out_f64) out_f64[i] = acc64[i];
  }
  free(acc), free(partial), free(acc64), free(on_d);
  return res;
}

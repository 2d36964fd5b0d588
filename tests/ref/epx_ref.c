/*
 * epx_ref.c - the plain-C CPU reference of EPX (see epx_ref.h for the definitions it implements).
 *
 * Written for clarity, not speed: every output element is computed by the most direct loop over
 * the definition, and every function recomputes what it needs from the routing of all ranks
 * (row positions, prefixes) instead of sharing hidden state, so each can be read alone.
 *
 * Key invariant: float32 arithmetic here is exactly IEEE binary32 with round-to-nearest-even.
 * Floats must be evaluated as floats (no excess precision), and every product that is then added
 * goes through mul_f32() (float64: mul_f64()) so that no compiler (gnu11 with FMA enabled,
 * clang's default contraction) can fuse it into a multiply-add.
 */
#include "ref/epx_ref.h"

#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* 0: float arithmetic in float; 16 (gcc -march with AVX512-FP16): only _Float16 is widened. */
#if !defined(FLT_EVAL_METHOD) || (FLT_EVAL_METHOD != 0 && FLT_EVAL_METHOD != 16)
#error "epx_ref.c needs float arithmetic without excess precision (FLT_EVAL_METHOD 0)"
#endif

/* ---------------------------------------------------------------------------------------------
 * Small helpers.
 * ------------------------------------------------------------------------------------------- */

static uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static float f32_from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* NOTE: the volatile store forces the product to be rounded to float32 on its own, so the
 * following addition can never be contracted into a fused multiply-add. */
static float mul_f32(float a, float b) {
  volatile float p = a * b;
  return p;
}

/* The same for the float64 sums: they are exact-order too, whatever the compiler flags. */
static double mul_f64(double a, double b) {
  volatile double p = a * b;
  return p;
}

static int quiet_refusals;

int epx_ref_set_quiet(int quiet) {
  const int previous = quiet_refusals;
  quiet_refusals = quiet;
  return previous;
}

/* Prints one "epx_ref: ..." line (unless quiet) and returns -1. */
static int fail(const char *fmt, ...) {
  if (quiet_refusals) return -1;
  va_list ap;
  va_start(ap, fmt);
  fputs("epx_ref: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  return -1;
}

static int is_valid_expert(int64_t e, int num_experts) {
  return e >= 0 && e < num_experts;
}

/* 1 if the token (its K ids at idx) has a valid slot on rank r. */
static int token_on_rank(const int64_t *idx, int top_k, int num_experts, int experts_per_rank,
                         int r) {
  for (int k = 0; k < top_k; k++)
    if (is_valid_expert(idx[k], num_experts) && idx[k] / experts_per_rank == r) return 1;
  return 0;
}

/* Checks what every world-taking function needs: dimensions, ranks[], topk_idx where T > 0. */
static int check_world(const epx_ref_world_t *w) {
  if (!w) return fail("world is NULL");
  if (w->num_ranks < 1) return fail("num_ranks = %d, want >= 1", w->num_ranks);
  if (w->num_experts < 1 || w->num_experts % w->num_ranks != 0)
    return fail("num_experts = %d, want a positive multiple of num_ranks = %d", w->num_experts,
                w->num_ranks);
  if (w->top_k < 1) return fail("top_k = %d, want >= 1", w->top_k);
  if (w->hidden < 1) return fail("hidden = %d, want >= 1", w->hidden);
  if (!w->ranks) return fail("ranks is NULL");
  for (int r = 0; r < w->num_ranks; r++) {
    if (w->ranks[r].num_tokens < 0)
      return fail("ranks[%d].num_tokens = %d, want >= 0", r, w->ranks[r].num_tokens);
    if (w->ranks[r].num_tokens > 0 && !w->ranks[r].topk_idx)
      return fail("ranks[%d].topk_idx is NULL", r);
  }
  return 0;
}

static int check_rank_arg(const epx_ref_world_t *w, int rank, const char *name) {
  if (rank < 0 || rank >= w->num_ranks)
    return fail("%s = %d, want 0..%d", name, rank, w->num_ranks - 1);
  return 0;
}

/* Every rank with tokens must provide the BF16 payload (need_bf16) / the FP8 payload and its
 * scales (need_fp8, which also needs hidden % 128 == 0). */
static int check_payload(const epx_ref_world_t *w, int need_bf16, int need_fp8) {
  if (need_fp8 && w->hidden % EPX_REF_FP8_GROUP != 0)
    return fail("hidden = %d, want a multiple of %d for FP8", w->hidden, EPX_REF_FP8_GROUP);
  for (int r = 0; r < w->num_ranks; r++) {
    const epx_ref_rank_t *rk = &w->ranks[r];
    if (rk->num_tokens == 0) continue;
    if (need_bf16 && !rk->x) return fail("ranks[%d].x is NULL", r);
    if (need_fp8 && (!rk->x_fp8 || !rk->x_scales))
      return fail("ranks[%d].x_fp8 or x_scales is NULL", r);
  }
  return 0;
}

/* calloc that never returns NULL for a zero size, so that an empty output is still an array. */
static void *alloc_array(size_t n, size_t elem_bytes) {
  return calloc(n ? n : 1, elem_bytes);
}

/* ---------------------------------------------------------------------------------------------
 * Number formats.
 * ------------------------------------------------------------------------------------------- */

uint16_t epx_ref_bf16_from_float(float x) {
  uint32_t u = f32_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u); /* quiet NaN */
  /* Round to nearest even on the 16 dropped bits: add just under half an ulp, plus one when the
   * kept lsb is odd, so that an exact half rounds to the even neighbour. A carry into the
   * exponent is the correct rounding (up to infinity for values past the largest BF16). */
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

float epx_ref_bf16_to_float(uint16_t bits) {
  return f32_from_bits((uint32_t)bits << 16);
}

uint8_t epx_ref_fp8_from_float(float x) {
  const uint32_t u = f32_bits(x);
  const uint8_t sign = (uint8_t)((u >> 31) << 7);
  const uint32_t abs_bits = u & 0x7fffffffu;
  if (abs_bits > 0x7f800000u) return 0x7f; /* NaN: the canonical E4M3 NaN */
  /* Everything at or above 448 (0x43e00000), infinities included, saturates. Values in
   * (448, 464) would round to 448 anyway; from 464 on they would round to 480, which is NaN. */
  if (abs_bits >= 0x43e00000u) return (uint8_t)(sign | 0x7e);

  const uint32_t exp_f32 = abs_bits >> 23; /* biased by 127 */
  const uint32_t mant_f32 = abs_bits & 0x7fffffu;
  if (exp_f32 >= 121) {
    /* Normal E4M3 range, |x| >= 2^-6: exponent field e = exp_f32 - 127 + 7 in 1..15. Keep 3 of
     * the 23 mantissa bits and round the other 20 to nearest even; a carry out of the mantissa
     * increments the exponent, which is exactly right (and cannot pass 0x7e since |x| < 448). */
    uint32_t code = ((exp_f32 - 120) << 3) | (mant_f32 >> 20);
    const uint32_t rest = mant_f32 & 0xfffffu, half = 0x80000u;
    if (rest > half || (rest == half && (code & 1u))) code++;
    return (uint8_t)(sign | code);
  }
  /* Subnormal E4M3 range: the code is m = round(|x| / 2^-9), m = 0..8 (8 is the smallest
   * normal, code 0x08, so the carry is again right). With the float32 significand
   * sig = 2^23 + mant (exp_f32 >= 1), |x| / 2^-9 = sig * 2^(exp_f32 - 141): shift sig right by
   * 141 - exp_f32 >= 21 bits and round to nearest even. A shift of 25 or more leaves less than
   * half (sig < 2^24), as do float32 subnormals: both give zero. */
  if (exp_f32 == 0) return sign;
  const uint32_t shift = 141 - exp_f32;
  if (shift >= 25) return sign;
  const uint32_t sig = (1u << 23) | mant_f32;
  uint32_t code = sig >> shift;
  const uint32_t rest = sig & ((1u << shift) - 1u), half = 1u << (shift - 1);
  if (rest > half || (rest == half && (code & 1u))) code++;
  return (uint8_t)(sign | code);
}

float epx_ref_fp8_to_float(uint8_t bits) {
  const uint32_t sign = (uint32_t)(bits & 0x80u) << 24;
  const uint32_t e = (bits >> 3) & 0xfu, m = bits & 0x7u;
  if (e == 15 && m == 7) return f32_from_bits(sign | 0x7fc00000u);
  if (e == 0) {
    const float v = (float)m * 0x1p-9f; /* exact */
    return sign ? -v : v;
  }
  /* value = 2^(e-7) * (1 + m/8): float32 exponent field e - 7 + 127, mantissa m in the top 3. */
  return f32_from_bits(sign | ((e + 120u) << 23) | (m << 20));
}

float epx_ref_fp8_step(uint8_t bits) {
  const uint8_t mag = bits & 0x7fu;
  if (mag == 0x7fu) return epx_ref_fp8_to_float(bits); /* NaN */
  const float v = epx_ref_fp8_to_float(mag);
  const float up = mag < 0x7eu ? epx_ref_fp8_to_float((uint8_t)(mag + 1)) - v : 0.f;
  const float down = mag > 0 ? v - epx_ref_fp8_to_float((uint8_t)(mag - 1)) : 0.f;
  return up > down ? up : down;
}

/* ---------------------------------------------------------------------------------------------
 * FP8 per-128-channel quantization.
 * ------------------------------------------------------------------------------------------- */

float epx_ref_fp8_scale(float amax, int ue8m0) {
  amax = fmaxf(amax, 1e-4f);
  float scale = amax / EPX_REF_FP8_MAX;
  if (ue8m0) {
    /* scale is positive and normal here (>= 1e-4/448), so incrementing the exponent field and
     * clearing the mantissa gives the next power of two. */
    uint32_t b = f32_bits(scale);
    if (b & 0x7fffffu) b = (b & 0xff800000u) + 0x800000u;
    scale = f32_from_bits(b);
  }
  return scale;
}

/* One token: q [H], scales [H/128]. */
static void quantize_row(const uint16_t *x, int hidden, int ue8m0, uint8_t *q, float *scales) {
  for (int g = 0; g < hidden / EPX_REF_FP8_GROUP; g++) {
    const uint16_t *xg = x + (size_t)g * EPX_REF_FP8_GROUP;
    uint8_t *qg = q + (size_t)g * EPX_REF_FP8_GROUP;
    float amax = 0.0f;
    for (int c = 0; c < EPX_REF_FP8_GROUP; c++)
      amax = fmaxf(amax, fabsf(epx_ref_bf16_to_float(xg[c])));
    const float scale = epx_ref_fp8_scale(amax, ue8m0);
    const float inv = 1.0f / scale;
    for (int c = 0; c < EPX_REF_FP8_GROUP; c++)
      qg[c] = epx_ref_fp8_from_float(epx_ref_bf16_to_float(xg[c]) * inv);
    scales[g] = scale;
  }
}

int epx_ref_fp8_quantize(const uint16_t *x, int num_tokens, int hidden, int ue8m0, uint8_t *q,
                         float *scales) {
  if (hidden < 1 || hidden % EPX_REF_FP8_GROUP != 0)
    return fail("hidden = %d, want a positive multiple of %d", hidden, EPX_REF_FP8_GROUP);
  const int num_groups = hidden / EPX_REF_FP8_GROUP;
  for (int t = 0; t < num_tokens; t++)
    quantize_row(x + (size_t)t * hidden, hidden, ue8m0, q + (size_t)t * hidden,
                 scales + (size_t)t * num_groups);
  return 0;
}

int epx_ref_fp8_dequantize(const uint8_t *q, const float *scales, int num_tokens, int hidden,
                           float *out) {
  if (hidden < 1 || hidden % EPX_REF_FP8_GROUP != 0)
    return fail("hidden = %d, want a positive multiple of %d", hidden, EPX_REF_FP8_GROUP);
  const int num_groups = hidden / EPX_REF_FP8_GROUP;
  for (int t = 0; t < num_tokens; t++)
    for (int c = 0; c < hidden; c++) {
      const size_t i = (size_t)t * hidden + c;
      out[i] = epx_ref_fp8_to_float(q[i]) * scales[(size_t)t * num_groups + c / EPX_REF_FP8_GROUP];
    }
  return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Layout.
 * ------------------------------------------------------------------------------------------- */

long long epx_ref_layout(const int64_t *topk_idx, int num_tokens, int top_k, int num_experts,
                         int num_ranks, int *num_tokens_per_rank, int *num_tokens_per_expert,
                         uint8_t *is_token_in_rank, int *token_pos_in_rank) {
  if (num_tokens < 0 || top_k < 1 || num_ranks < 1 || num_experts < 1 ||
      num_experts % num_ranks != 0 || (num_tokens > 0 && !topk_idx)) {
    fail("epx_ref_layout: bad dimensions T=%d K=%d E=%d R=%d or NULL topk_idx", num_tokens, top_k,
         num_experts, num_ranks);
    return -2;
  }
  const int experts_per_rank = num_experts / num_ranks;

  long long first_bad = -1;
  for (long long i = 0; i < (long long)num_tokens * top_k && first_bad < 0; i++)
    if (topk_idx[i] < -1 || topk_idx[i] >= num_experts) first_bad = i;

  /* Per rank, one pass over the tokens in ascending order: the running count is the position. */
  for (int r = 0; r < num_ranks; r++) {
    int count = 0;
    for (int t = 0; t < num_tokens; t++) {
      const int in =
          token_on_rank(topk_idx + (size_t)t * top_k, top_k, num_experts, experts_per_rank, r);
      const size_t i = (size_t)t * num_ranks + r;
      if (is_token_in_rank) is_token_in_rank[i] = (uint8_t)in;
      if (token_pos_in_rank) token_pos_in_rank[i] = in ? count : -1;
      count += in;
    }
    if (num_tokens_per_rank) num_tokens_per_rank[r] = count;
  }

  if (num_tokens_per_expert) {
    memset(num_tokens_per_expert, 0, sizeof(int) * (size_t)num_experts);
    for (int t = 0; t < num_tokens; t++) {
      const int64_t *idx = topk_idx + (size_t)t * top_k;
      for (int k = 0; k < top_k; k++) {
        if (!is_valid_expert(idx[k], num_experts)) continue;
        int repeated = 0; /* count a token once per expert: only its first slot naming it */
        for (int k2 = 0; k2 < k; k2++) repeated |= idx[k2] == idx[k];
        if (!repeated) num_tokens_per_expert[idx[k]]++;
      }
    }
  }
  return first_bad;
}

/* ---------------------------------------------------------------------------------------------
 * Normal mode.
 * ------------------------------------------------------------------------------------------- */

int epx_ref_dispatch_num_recv(const epx_ref_world_t *world, int dst_rank) {
  if (check_world(world) || check_rank_arg(world, dst_rank, "dst_rank")) return -1;
  const int K = world->top_k, E = world->num_experts, experts_per_rank = E / world->num_ranks;
  int n = 0;
  for (int s = 0; s < world->num_ranks; s++)
    for (int t = 0; t < world->ranks[s].num_tokens; t++)
      n +=
          token_on_rank(world->ranks[s].topk_idx + (size_t)t * K, K, E, experts_per_rank, dst_rank);
  return n;
}

int epx_ref_dispatch(const epx_ref_world_t *world, int dst_rank, epx_ref_payload_t payload,
                     int expert_alignment, epx_ref_recv_t *recv) {
  if (!recv) return fail("recv is NULL");
  memset(recv, 0, sizeof *recv);
  if (check_world(world) || check_rank_arg(world, dst_rank, "dst_rank")) return -1;
  if (payload != EPX_REF_PAYLOAD_NONE && payload != EPX_REF_PAYLOAD_BF16 &&
      payload != EPX_REF_PAYLOAD_FP8)
    return fail("payload = %d is not an epx_ref_payload_t", (int)payload);
  if (check_payload(world, payload == EPX_REF_PAYLOAD_BF16, payload == EPX_REF_PAYLOAD_FP8))
    return -1;
  if (expert_alignment < 1) return fail("expert_alignment = %d, want >= 1", expert_alignment);

  const int R = world->num_ranks, E = world->num_experts, K = world->top_k, H = world->hidden;
  const int experts_per_rank = E / R, num_groups = H / EPX_REF_FP8_GROUP;
  const int first_expert = dst_rank * experts_per_rank;
  const int n = epx_ref_dispatch_num_recv(world, dst_rank);

  recv->num_recv = n;
  recv->num_local_experts = experts_per_rank;
  recv->rank_prefix = alloc_array((size_t)R + 1, sizeof(int));
  recv->topk_idx = alloc_array((size_t)n * K, sizeof(int64_t));
  recv->topk_weights = alloc_array((size_t)n * K, sizeof(float));
  recv->src_rank = alloc_array((size_t)n, sizeof(int));
  recv->src_token = alloc_array((size_t)n, sizeof(int));
  recv->num_recv_per_expert = alloc_array((size_t)experts_per_rank, sizeof(int));
  recv->num_recv_per_expert_aligned = alloc_array((size_t)experts_per_rank, sizeof(int));
  int ok = recv->rank_prefix && recv->topk_idx && recv->topk_weights && recv->src_rank &&
           recv->src_token && recv->num_recv_per_expert && recv->num_recv_per_expert_aligned;
  if (payload == EPX_REF_PAYLOAD_BF16) {
    recv->x = alloc_array((size_t)n * H, sizeof(uint16_t));
    ok = ok && recv->x;
  } else if (payload == EPX_REF_PAYLOAD_FP8) {
    recv->x_fp8 = alloc_array((size_t)n * H, sizeof(uint8_t));
    recv->x_scales = alloc_array((size_t)n * num_groups, sizeof(float));
    ok = ok && recv->x_fp8 && recv->x_scales;
  }
  if (!ok) return fail("out of memory for %d received rows", n);

  int row = 0;
  for (int s = 0; s < R; s++) {
    const epx_ref_rank_t *src = &world->ranks[s];
    recv->rank_prefix[s] = row;
    for (int t = 0; t < src->num_tokens; t++) {
      const int64_t *idx = src->topk_idx + (size_t)t * K;
      if (!token_on_rank(idx, K, E, experts_per_rank, dst_rank)) continue;
      for (int k = 0; k < K; k++) {
        const int here = is_valid_expert(idx[k], E) && idx[k] / experts_per_rank == dst_rank;
        recv->topk_idx[(size_t)row * K + k] = here ? idx[k] - first_expert : -1;
        recv->topk_weights[(size_t)row * K + k] =
            here && src->topk_weights ? src->topk_weights[(size_t)t * K + k] : 0.0f;
      }
      recv->src_rank[row] = s;
      recv->src_token[row] = t;
      if (payload == EPX_REF_PAYLOAD_BF16)
        memcpy(recv->x + (size_t)row * H, src->x + (size_t)t * H, sizeof(uint16_t) * H);
      if (payload == EPX_REF_PAYLOAD_FP8) {
        memcpy(recv->x_fp8 + (size_t)row * H, src->x_fp8 + (size_t)t * H, (size_t)H);
        memcpy(recv->x_scales + (size_t)row * num_groups, src->x_scales + (size_t)t * num_groups,
               sizeof(float) * num_groups);
      }
      row++;
    }
  }
  recv->rank_prefix[R] = row;

  for (int j = 0; j < experts_per_rank; j++) {
    int count = 0;
    for (int i = 0; i < n; i++) {
      int has = 0;
      for (int k = 0; k < K; k++) has |= recv->topk_idx[(size_t)i * K + k] == j;
      count += has;
    }
    recv->num_recv_per_expert[j] = count;
    recv->num_recv_per_expert_aligned[j] =
        (count + expert_alignment - 1) / expert_alignment * expert_alignment;
  }
  return 0;
}

void epx_ref_recv_free(epx_ref_recv_t *recv) {
  if (!recv) return;
  free(recv->rank_prefix);
  free(recv->x);
  free(recv->x_fp8);
  free(recv->x_scales);
  free(recv->topk_idx);
  free(recv->topk_weights);
  free(recv->src_rank);
  free(recv->src_token);
  free(recv->num_recv_per_expert);
  free(recv->num_recv_per_expert_aligned);
  memset(recv, 0, sizeof *recv);
}

/* Normal combine, both precisions at once (either output may be NULL); ex: the top-k weight
 * reduction and the bias (epx_ref_combine_ex), or NULL. */
static int combine_impl(const epx_ref_world_t *world, int src_rank, const uint16_t *const *y,
                        const float *topk_weights, const epx_ref_combine_extras_t *ex,
                        uint16_t *out_bf16, double *out_f64) {
  if (check_world(world) || check_rank_arg(world, src_rank, "src_rank")) return -1;
  if (!y) return fail("y is NULL");
  if (ex && !ex->recv_w != !ex->out_w) return fail("recv_w and out_w: both or neither");
  const int R = world->num_ranks, E = world->num_experts, K = world->top_k, H = world->hidden;
  const int experts_per_rank = E / R;
  const epx_ref_rank_t *me = &world->ranks[src_rank];

  /* Row of (src_rank, t) on rank d = base[d] (rows there from sources before src_rank) +
   * next[d] (src_rank's tokens on d before t). */
  int *base = alloc_array((size_t)R, sizeof(int)), *next = alloc_array((size_t)R, sizeof(int));
  float *acc32 = alloc_array((size_t)H, sizeof(float));
  double *acc64 = alloc_array((size_t)H, sizeof(double));
  int res = 0;
  if (!base || !next || !acc32 || !acc64) {
    res = fail("out of memory");
    goto exit;
  }
  for (int s = 0; s < src_rank; s++)
    for (int t = 0; t < world->ranks[s].num_tokens; t++)
      for (int d = 0; d < R; d++)
        base[d] +=
            token_on_rank(world->ranks[s].topk_idx + (size_t)t * K, K, E, experts_per_rank, d);

  for (int t = 0; t < me->num_tokens; t++) {
    const int64_t *idx = me->topk_idx + (size_t)t * K;
    for (int c = 0; c < H; c++) acc32[c] = 0.0f, acc64[c] = 0.0;
    float *out_w = ex && ex->out_w ? ex->out_w + (size_t)t * K : NULL;
    for (int k = 0; out_w && k < K; k++) out_w[k] = 0.0f;
    for (int d = 0; d < R; d++) {
      if (!token_on_rank(idx, K, E, experts_per_rank, d)) continue;
      const int row = base[d] + next[d]++;
      if (!y[d] || (out_w && !ex->recv_w[d])) {
        res = fail("y[%d] or recv_w[%d] is NULL but rank %d received rows", d, d, d);
        goto exit;
      }
      for (int k = 0; out_w && k < K; k++) out_w[k] = out_w[k] + ex->recv_w[d][(size_t)row * K + k];
      float factor32 = 1.0f;
      double factor64 = 1.0;
      if (topk_weights) {
        factor32 = 0.0f, factor64 = 0.0;
        for (int k = 0; k < K; k++)
          if (is_valid_expert(idx[k], E) && idx[k] / experts_per_rank == d) {
            factor32 = factor32 + topk_weights[(size_t)t * K + k];
            factor64 = factor64 + (double)topk_weights[(size_t)t * K + k];
          }
      }
      const uint16_t *yrow = y[d] + (size_t)row * H;
      for (int c = 0; c < H; c++) {
        const float v = epx_ref_bf16_to_float(yrow[c]);
        acc32[c] = acc32[c] + mul_f32(factor32, v);
        acc64[c] = acc64[c] + mul_f64(factor64, (double)v);
      }
    }
    for (int j = 0; ex && j < 2; j++)
      for (int c = 0; ex->bias[j] && c < H; c++) {
        const float b = epx_ref_bf16_to_float(ex->bias[j][(size_t)t * H + c]);
        acc32[c] = acc32[c] + b;
        acc64[c] = acc64[c] + (double)b;
      }
    for (int c = 0; c < H; c++) {
      if (out_bf16) out_bf16[(size_t)t * H + c] = epx_ref_bf16_from_float(acc32[c]);
      if (out_f64) out_f64[(size_t)t * H + c] = acc64[c];
    }
  }
exit:
  free(base), free(next), free(acc32), free(acc64);
  return res;
}

int epx_ref_combine(const epx_ref_world_t *world, int src_rank, const uint16_t *const *y,
                    const float *topk_weights, uint16_t *out) {
  if (!out) return fail("out is NULL");
  return combine_impl(world, src_rank, y, topk_weights, NULL, out, NULL);
}

int epx_ref_combine_f64(const epx_ref_world_t *world, int src_rank, const uint16_t *const *y,
                        const float *topk_weights, double *out) {
  if (!out) return fail("out is NULL");
  return combine_impl(world, src_rank, y, topk_weights, NULL, NULL, out);
}

/* ---------------------------------------------------------------------------------------------
 * Low-latency mode.
 * ------------------------------------------------------------------------------------------- */

static int check_max_tokens(const epx_ref_world_t *w, int max_tokens_per_rank) {
  if (max_tokens_per_rank < 1)
    return fail("max_tokens_per_rank = %d, want >= 1", max_tokens_per_rank);
  for (int r = 0; r < w->num_ranks; r++)
    if (w->ranks[r].num_tokens > max_tokens_per_rank)
      return fail("ranks[%d].num_tokens = %d exceeds max_tokens_per_rank = %d", r,
                  w->ranks[r].num_tokens, max_tokens_per_rank);
  return 0;
}

static int check_layout_arg(epx_ref_ll_layout_t layout) {
  if (layout != EPX_REF_LL_PACKED && layout != EPX_REF_LL_FIXED)
    return fail("layout = %d is not an epx_ref_ll_layout_t", (int)layout);
  return 0;
}

static int ll_dispatch_fixed(const epx_ref_world_t *world, int dst_rank, int M, int ue8m0,
                             const epx_ref_ll_recv_t *out);

int epx_ref_ll_dispatch(const epx_ref_world_t *world, int dst_rank, int max_tokens_per_rank,
                        int ue8m0, const epx_ref_ll_recv_t *out) {
  return epx_ref_ll_dispatch_layout(world, dst_rank, max_tokens_per_rank, ue8m0, EPX_REF_LL_PACKED,
                                    out);
}

int epx_ref_ll_dispatch_layout(const epx_ref_world_t *world, int dst_rank, int max_tokens_per_rank,
                               int ue8m0, epx_ref_ll_layout_t layout,
                               const epx_ref_ll_recv_t *out) {
  if (!out) return fail("out is NULL");
  if (check_layout_arg(layout)) return -1;
  if (check_world(world) || check_rank_arg(world, dst_rank, "dst_rank") ||
      check_max_tokens(world, max_tokens_per_rank))
    return -1;
  if (out->x_fp8 && !out->x_scales) return fail("out->x_fp8 needs out->x_scales");
  if (check_payload(world, out->x || out->x_fp8, 0)) return -1;
  if (out->x_fp8 && world->hidden % EPX_REF_FP8_GROUP != 0)
    return fail("hidden = %d, want a multiple of %d for FP8", world->hidden, EPX_REF_FP8_GROUP);

  if (layout == EPX_REF_LL_FIXED)
    return ll_dispatch_fixed(world, dst_rank, max_tokens_per_rank, ue8m0, out);
  const int R = world->num_ranks, E = world->num_experts, K = world->top_k, H = world->hidden;
  const int experts_per_rank = E / R, first_expert = dst_rank * experts_per_rank;
  const int num_groups = H / EPX_REF_FP8_GROUP;
  const size_t capacity = (size_t)R * max_tokens_per_rank; /* rows per local expert */

  /* num[j][s] first, then begin[j][s] as its prefix over s, and the capacity check. */
  int *num = alloc_array((size_t)experts_per_rank * R, sizeof(int));
  int *begin = alloc_array((size_t)experts_per_rank * R, sizeof(int));
  int *next = alloc_array((size_t)experts_per_rank, sizeof(int));
  uint8_t *qrow = alloc_array((size_t)H, sizeof(uint8_t));
  float *srow = alloc_array((size_t)num_groups, sizeof(float));
  int res = 0;
  if (!num || !begin || !next || !qrow || !srow) {
    res = fail("out of memory");
    goto exit;
  }
  for (int s = 0; s < R; s++) {
    const epx_ref_rank_t *src = &world->ranks[s];
    for (size_t i = 0; i < (size_t)src->num_tokens * K; i++)
      if (is_valid_expert(src->topk_idx[i], E) && src->topk_idx[i] / experts_per_rank == dst_rank)
        num[(src->topk_idx[i] - first_expert) * R + s]++;
  }
  for (int j = 0; j < experts_per_rank; j++) {
    size_t count = 0;
    for (int s = 0; s < R; s++) {
      begin[j * R + s] = (int)count;
      count += (size_t)num[j * R + s];
    }
    if (count > capacity) {
      res = fail("local expert %d of rank %d gets %zu rows, more than R*M = %zu", j, dst_rank,
                 count, capacity);
      goto exit;
    }
  }

  for (int j = 0; j < experts_per_rank; j++) {
    int count = 0;
    for (int s = 0; s < R; s++) {
      if (out->begin) out->begin[j * R + s] = begin[j * R + s];
      if (out->num) out->num[j * R + s] = num[j * R + s];
      count += num[j * R + s];
    }
    if (out->count) out->count[j] = count;
  }

  /* The rows: sources in order, each source's (t, k) in order; next[j] counts the rows of the
   * current source already placed in expert j. */
  for (int s = 0; s < R; s++) {
    const epx_ref_rank_t *src = &world->ranks[s];
    memset(next, 0, sizeof(int) * (size_t)experts_per_rank);
    for (int t = 0; t < src->num_tokens; t++) {
      const int64_t *idx = src->topk_idx + (size_t)t * K;
      if (!token_on_rank(idx, K, E, experts_per_rank, dst_rank)) continue;
      if (out->x_fp8) quantize_row(src->x + (size_t)t * H, H, ue8m0, qrow, srow);
      for (int k = 0; k < K; k++) {
        if (!is_valid_expert(idx[k], E) || idx[k] / experts_per_rank != dst_rank) continue;
        const int j = (int)(idx[k] - first_expert);
        const size_t row = (size_t)j * capacity + (size_t)(begin[j * R + s] + next[j]++);
        if (out->src_rank) out->src_rank[row] = s;
        if (out->src_token) out->src_token[row] = t;
        if (out->src_slot) out->src_slot[row] = k;
        if (out->x) memcpy(out->x + row * H, src->x + (size_t)t * H, sizeof(uint16_t) * H);
        if (out->x_fp8) {
          memcpy(out->x_fp8 + row * H, qrow, (size_t)H);
          memcpy(out->x_scales + row * num_groups, srow, sizeof(float) * num_groups);
        }
      }
    }
  }
exit:
  free(num), free(begin), free(next), free(qrow), free(srow);
  return res;
}

/* The FIXED layout's row of (s, t, e): s*M + the tokens of s before t listing e; -1 if t does
 * not list e. The world is checked by the callers. */
static int fixed_row(const epx_ref_world_t *w, int M, int s, int t, int e) {
  const int K = w->top_k;
  const int64_t *idx = w->ranks[s].topk_idx;
  int lists = 0, before = 0;
  for (int k = 0; k < K; k++) lists |= idx[(size_t)t * K + k] == e;
  if (!lists || e < 0 || e >= w->num_experts) return -1;
  for (int t2 = 0; t2 < t; t2++) {
    int has = 0;
    for (int k = 0; k < K; k++) has |= idx[(size_t)t2 * K + k] == e;
    before += has;
  }
  return s * M + before;
}

int epx_ref_ll_row(const epx_ref_world_t *world, int max_tokens_per_rank, int src_rank, int token,
                   int expert) {
  if (check_world(world) || check_rank_arg(world, src_rank, "src_rank") ||
      check_max_tokens(world, max_tokens_per_rank))
    return -1;
  if (token < 0 || token >= world->ranks[src_rank].num_tokens) return -1;
  return fixed_row(world, max_tokens_per_rank, src_rank, token, expert);
}

/* FIXED dispatch: every source s, every token t in order, every distinct valid expert of t on
 * dst_rank, at [j][s*M + i]. */
static int ll_dispatch_fixed(const epx_ref_world_t *world, int dst_rank, int M, int ue8m0,
                             const epx_ref_ll_recv_t *out) {
  const int R = world->num_ranks, E = world->num_experts, K = world->top_k, H = world->hidden;
  const int experts_per_rank = E / R, first_expert = dst_rank * experts_per_rank;
  const int num_groups = H / EPX_REF_FP8_GROUP;
  const size_t capacity = (size_t)R * M;
  int *num = alloc_array((size_t)experts_per_rank * R, sizeof(int));
  uint8_t *qrow = alloc_array((size_t)H, sizeof(uint8_t));
  float *srow = alloc_array((size_t)num_groups, sizeof(float));
  int res = 0;
  if (!num || !qrow || !srow) {
    res = fail("out of memory");
    goto exit;
  }
  for (int s = 0; s < R; s++) {
    const epx_ref_rank_t *src = &world->ranks[s];
    for (int t = 0; t < src->num_tokens; t++) {
      const int64_t *idx = src->topk_idx + (size_t)t * K;
      if (!token_on_rank(idx, K, E, experts_per_rank, dst_rank)) continue;
      if (out->x_fp8) quantize_row(src->x + (size_t)t * H, H, ue8m0, qrow, srow);
      for (int k = 0; k < K; k++) {
        if (!is_valid_expert(idx[k], E) || idx[k] / experts_per_rank != dst_rank) continue;
        int repeated = 0; /* one row per distinct expert: only its first slot */
        for (int k2 = 0; k2 < k; k2++) repeated |= idx[k2] == idx[k];
        if (repeated) continue;
        const int j = (int)(idx[k] - first_expert);
        const size_t row = (size_t)j * capacity + (size_t)s * M + (size_t)num[j * R + s]++;
        if (out->src_rank) out->src_rank[row] = s;
        if (out->src_token) out->src_token[row] = t;
        if (out->src_slot) out->src_slot[row] = k;
        if (out->x) memcpy(out->x + row * H, src->x + (size_t)t * H, sizeof(uint16_t) * H);
        if (out->x_fp8) {
          memcpy(out->x_fp8 + row * H, qrow, (size_t)H);
          memcpy(out->x_scales + row * num_groups, srow, sizeof(float) * num_groups);
        }
      }
    }
  }
  for (int j = 0; j < experts_per_rank; j++) {
    int count = 0;
    for (int s = 0; s < R; s++) {
      if (out->begin) out->begin[j * R + s] = s * M;
      if (out->num) out->num[j * R + s] = num[j * R + s];
      count += num[j * R + s];
    }
    if (out->count) out->count[j] = count;
  }
exit:
  free(num), free(qrow), free(srow);
  return res;
}

/* Low-latency combine, both precisions at once (either output may be NULL). */
static int ll_combine_impl(const epx_ref_world_t *world, int src_rank, int max_tokens_per_rank,
                           epx_ref_ll_layout_t layout, const uint16_t *const *y,
                           const float *topk_weights, uint16_t *out_bf16, double *out_f64) {
  if (check_world(world) || check_rank_arg(world, src_rank, "src_rank") ||
      check_max_tokens(world, max_tokens_per_rank))
    return -1;
  if (!y) return fail("y is NULL");
  const int R = world->num_ranks, E = world->num_experts, K = world->top_k, H = world->hidden;
  const int experts_per_rank = E / R;
  const size_t capacity = (size_t)R * max_tokens_per_rank;
  const epx_ref_rank_t *me = &world->ranks[src_rank];

  /* Row of (src_rank, t, k) with expert e, within e's rows on its rank: base[e] (rows of e from
   * sources before src_rank) + next[e] (src_rank's slots naming e before (t, k)). */
  int *base = alloc_array((size_t)E, sizeof(int)), *next = alloc_array((size_t)E, sizeof(int));
  float *acc32 = alloc_array((size_t)H, sizeof(float));
  double *acc64 = alloc_array((size_t)H, sizeof(double));
  int res = 0;
  if (!base || !next || !acc32 || !acc64) {
    res = fail("out of memory");
    goto exit;
  }
  for (int s = 0; s < src_rank; s++)
    for (size_t i = 0; i < (size_t)world->ranks[s].num_tokens * K; i++)
      if (is_valid_expert(world->ranks[s].topk_idx[i], E)) base[world->ranks[s].topk_idx[i]]++;

  for (int t = 0; t < me->num_tokens; t++) {
    const int64_t *idx = me->topk_idx + (size_t)t * K;
    for (int c = 0; c < H; c++) acc32[c] = 0.0f, acc64[c] = 0.0;
    for (int k = 0; k < K; k++) {
      if (!is_valid_expert(idx[k], E)) continue;
      const int e = (int)idx[k], d = e / experts_per_rank, j = e % experts_per_rank;
      const size_t row = layout == EPX_REF_LL_FIXED
                             ? (size_t)fixed_row(world, max_tokens_per_rank, src_rank, t, e)
                             : (size_t)(base[e] + next[e]++);
      if (row >= capacity) {
        res = fail("expert %d gets more than R*M = %zu rows", e, capacity);
        goto exit;
      }
      if (!y[d]) {
        res = fail("y[%d] is NULL but token %d has a slot there", d, t);
        goto exit;
      }
      const float w = topk_weights ? topk_weights[(size_t)t * K + k] : 1.0f;
      const uint16_t *yrow = y[d] + ((size_t)j * capacity + row) * H;
      for (int c = 0; c < H; c++) {
        const float v = epx_ref_bf16_to_float(yrow[c]);
        acc32[c] = acc32[c] + mul_f32(w, v);
        acc64[c] = acc64[c] + mul_f64((double)w, (double)v);
      }
    }
    for (int c = 0; c < H; c++) {
      if (out_bf16) out_bf16[(size_t)t * H + c] = epx_ref_bf16_from_float(acc32[c]);
      if (out_f64) out_f64[(size_t)t * H + c] = acc64[c];
    }
  }
exit:
  free(base), free(next), free(acc32), free(acc64);
  return res;
}

int epx_ref_ll_combine(const epx_ref_world_t *world, int src_rank, int max_tokens_per_rank,
                       const uint16_t *const *y, const float *topk_weights, uint16_t *out) {
  return epx_ref_ll_combine_layout(world, src_rank, max_tokens_per_rank, EPX_REF_LL_PACKED, y,
                                   topk_weights, out);
}

int epx_ref_ll_combine_f64(const epx_ref_world_t *world, int src_rank, int max_tokens_per_rank,
                           const uint16_t *const *y, const float *topk_weights, double *out) {
  return epx_ref_ll_combine_f64_layout(world, src_rank, max_tokens_per_rank, EPX_REF_LL_PACKED, y,
                                       topk_weights, out);
}

int epx_ref_ll_combine_layout(const epx_ref_world_t *world, int src_rank, int max_tokens_per_rank,
                              epx_ref_ll_layout_t layout, const uint16_t *const *y,
                              const float *topk_weights, uint16_t *out) {
  if (!out) return fail("out is NULL");
  if (check_layout_arg(layout)) return -1;
  return ll_combine_impl(world, src_rank, max_tokens_per_rank, layout, y, topk_weights, out, NULL);
}

int epx_ref_ll_combine_f64_layout(const epx_ref_world_t *world, int src_rank,
                                  int max_tokens_per_rank, epx_ref_ll_layout_t layout,
                                  const uint16_t *const *y, const float *topk_weights,
                                  double *out) {
  if (!out) return fail("out is NULL");
  if (check_layout_arg(layout)) return -1;
  return ll_combine_impl(world, src_rank, max_tokens_per_rank, layout, y, topk_weights, NULL, out);
}

/* ---------------------------------------------------------------------------------------------
 * Normal combine's top-k weight reduction and bias (DeepEP parity): combine_impl with extras.
 * ------------------------------------------------------------------------------------------- */

int epx_ref_combine_ex(const epx_ref_world_t *world, int src_rank, const uint16_t *const *y,
                       const float *topk_weights, const epx_ref_combine_extras_t *extras,
                       uint16_t *out) {
  if (!out) return fail("out is NULL");
  return combine_impl(world, src_rank, y, topk_weights, extras, out, NULL);
}

int epx_ref_combine_ex_f64(const epx_ref_world_t *world, int src_rank, const uint16_t *const *y,
                           const float *topk_weights, const epx_ref_combine_extras_t *extras,
                           double *out) {
  if (!out) return fail("out is NULL");
  return combine_impl(world, src_rank, y, topk_weights, extras, NULL, out);
}

/* ---------------------------------------------------------------------------------------------
 * DeepEP-parity dispatch options.
 * ------------------------------------------------------------------------------------------- */

/* A world with the same payload whose routing says the masks: R slots per token, slot r naming
 * the first expert of rank r when the mask sends the token there, else -1. ids[s] are allocated
 * here ([T_s, R] int64); the caller frees them. */
static int mask_world(const epx_ref_world_t *w, const uint8_t *const *masks, epx_ref_rank_t *ranks,
                      int64_t **ids, epx_ref_world_t *out) {
  const int R = w->num_ranks, first_of = w->num_experts / R;
  *out = *w;
  out->top_k = R;
  out->ranks = ranks;
  for (int s = 0; s < R; s++) {
    const int T = w->ranks[s].num_tokens;
    ranks[s] = w->ranks[s];
    ranks[s].topk_weights = NULL;
    ids[s] = alloc_array((size_t)T * R, sizeof(int64_t));
    if (!ids[s]) return fail("out of memory for rank %d's mask", s);
    if (T > 0 && (!masks || !masks[s])) return fail("masks[%d] is NULL with %d tokens", s, T);
    for (size_t i = 0; i < (size_t)T * R; i++)
      ids[s][i] = masks[s][i] ? (int64_t)(i % R) * first_of : -1;
    ranks[s].topk_idx = ids[s];
  }
  return 0;
}

int epx_ref_dispatch_mask(const epx_ref_world_t *world, const uint8_t *const *masks,
                          const int *const *tokens_per_expert, int dst_rank,
                          epx_ref_payload_t payload, int expert_alignment, epx_ref_recv_t *recv) {
  if (!recv) return fail("recv is NULL");
  memset(recv, 0, sizeof *recv);
  if (check_world(world) || check_rank_arg(world, dst_rank, "dst_rank")) return -1;
  if (!tokens_per_expert) return fail("tokens_per_expert is NULL");
  const int R = world->num_ranks, K = world->top_k, L = world->num_experts / R;
  enum { kMaxRanks = 64 };
  epx_ref_rank_t ranks[kMaxRanks];
  int64_t *ids[kMaxRanks] = {NULL};
  if (R > kMaxRanks) return fail("num_ranks = %d, want <= %d", R, (int)kMaxRanks);
  epx_ref_world_t mw;
  int res = mask_world(world, masks, ranks, ids, &mw);
  if (res == 0) res = epx_ref_dispatch(&mw, dst_rank, payload, expert_alignment, recv);
  for (int s = 0; s < R; s++) free(ids[s]);
  if (res) return -1;
  /* No ids travel: K columns of -1 / 0; the per-expert counts are the callers'. */
  const size_t n = (size_t)recv->num_recv;
  free(recv->topk_idx), free(recv->topk_weights);
  recv->topk_idx = alloc_array(n * K, sizeof(int64_t));
  recv->topk_weights = alloc_array(n * K, sizeof(float));
  if (!recv->topk_idx || !recv->topk_weights) return fail("out of memory for %zu rows", n);
  for (size_t i = 0; i < n * K; i++) recv->topk_idx[i] = -1;
  for (int j = 0; j < L; j++) {
    int count = 0;
    for (int s = 0; s < R; s++) {
      if (!tokens_per_expert[s]) return fail("tokens_per_expert[%d] is NULL", s);
      count += tokens_per_expert[s][dst_rank * L + j];
    }
    recv->num_recv_per_expert[j] = count;
    recv->num_recv_per_expert_aligned[j] =
        (count + expert_alignment - 1) / expert_alignment * expert_alignment;
  }
  return 0;
}

int epx_ref_rank_prefix_matrix(const epx_ref_world_t *world, const uint8_t *const *masks,
                               int *out) {
  if (check_world(world)) return -1;
  if (!out) return fail("out is NULL");
  const int R = world->num_ranks, K = world->top_k, E = world->num_experts;
  for (int j = 0; j < R; j++) {
    int sum = 0;
    for (int i = 0; i < R; i++) {
      const epx_ref_rank_t *src = &world->ranks[i];
      if (masks && src->num_tokens > 0 && !masks[i]) return fail("masks[%d] is NULL", i);
      for (int t = 0; t < src->num_tokens; t++)
        sum += masks ? masks[i][(size_t)t * R + j] != 0
                     : token_on_rank(src->topk_idx + (size_t)t * K, K, E, E / R, j);
      out[i * R + j] = sum;
    }
  }
  return 0;
}

int epx_ref_worst_topk_idx(const epx_ref_recv_t *recv, int top_k, int num_worst, int64_t *out) {
  if (!recv || !out) return fail("recv or out is NULL");
  if (top_k < 1) return fail("top_k = %d, want >= 1", top_k);
  if (num_worst < recv->num_recv)
    return fail("num_worst = %d, want >= num_recv = %d", num_worst, recv->num_recv);
  const size_t n = (size_t)recv->num_recv * top_k;
  if (n) memcpy(out, recv->topk_idx, n * sizeof(int64_t));
  for (size_t i = n; i < (size_t)num_worst * top_k; i++) out[i] = -1;
  return 0;
}

int epx_ref_scales_strided(const void *scales, int num_tokens, int num_groups, int stride_token,
                           int stride_group, void *out) {
  if (num_tokens < 0 || num_groups < 0) return fail("negative dimension");
  if (stride_token < 1 || stride_group < 1)
    return fail("strides %d, %d: want >= 1", stride_token, stride_group);
  const uint32_t *in = scales;
  uint32_t *o = out;
  for (int t = 0; t < num_tokens; t++)
    for (int g = 0; g < num_groups; g++)
      o[(size_t)t * stride_token + (size_t)g * stride_group] = in[(size_t)t * num_groups + g];
  return 0;
}

int epx_ref_ue8m0_pack(const float *scales, int num_tokens, int num_groups, int32_t *out) {
  if (num_tokens < 0 || num_groups < 0) return fail("negative dimension");
  const int words = (num_groups + 3) / 4;
  for (int t = 0; t < num_tokens; t++)
    for (int j = 0; j < words; j++) {
      uint32_t word = 0;
      for (int i = 0; i < 4 && 4 * j + i < num_groups; i++) {
        const uint32_t exponent =
            (f32_bits(scales[(size_t)t * num_groups + 4 * j + i]) >> 23) & 0xff;
        word |= exponent << (8 * i);
      }
      out[(size_t)t * words + j] = (int32_t)word;
    }
  return 0;
}

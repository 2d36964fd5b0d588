/*
 * experts.c - epx_experts_ffn and its workspace size: argument checks, the scratch layout, then
 * up to three launches on the caller's stream (src/kernels/experts_ffn.cu for BF16 weights,
 *   experts_fp8.cu for FP8):
 *   [FP8 weights, BF16 x] quantize x -> gate/up GEMM with SwiGLU -> down GEMM.
 * Needs no group and no host synchronization; every launch is checked.
 */
#include <stdint.h>
#include <string.h>

#include "arg_check.h"
#include "checks.h"
#include "experts.h"
#include "kernels/api.h"
#include "param.h"

#define WS_ALIGN 256

typedef struct {
  size_t h, h_scales, xq, xq_scales, total; /* offsets into the workspace, and its size */
} scratch_layout_t;

static size_t align_up(size_t v) {
  return (v + WS_ALIGN - 1) / WS_ALIGN * WS_ALIGN;
}

/* The workspace: h [rows, I] (BF16, or FP8 and its [rows, I/128] scales), then with FP8
 * weights and BF16 x, x quantized: [rows, H] FP8 and [rows, H/128] scales. */
static scratch_layout_t scratch_layout(const epx_experts_t *w, int num_rows, epx_dtype_t x_dtype) {
  const int fp8 = w->weight_dtype == EPX_DTYPE_FP8_E4M3;
  const size_t rows = (size_t)num_rows;
  scratch_layout_t s = {0, 0, 0, 0, 0};
  size_t off = align_up(rows * (size_t)w->intermediate * (fp8 ? 1 : 2));
  if (fp8) {
    s.h_scales = off;
    off += align_up(rows * (size_t)(w->intermediate / 128) * sizeof(float));
    if (x_dtype == EPX_DTYPE_BF16) {
      s.xq = off;
      off += align_up(rows * (size_t)w->hidden);
      s.xq_scales = off;
      off += align_up(rows * (size_t)(w->hidden / 128) * sizeof(float));
    }
  }
  s.total = off;
  return s;
}

/* The weights' shape and dtype (pointers are checked by the call that reads them). */
static epx_status_t check_experts_shape(const char *fn, const epx_experts_t *w) {
  EPX_CHECK(epx__check_not_null(fn, "experts", w));
  EPX_CHECK(
      epx__check_struct_size(fn, "experts", w->size, sizeof(epx_experts_t), "EPX_EXPERTS_INIT"));
  EPX_ARG_CHECK(w->num_experts >= 1, "%s: experts->num_experts = %d: must be at least 1", fn,
                w->num_experts);
  EPX_ARG_CHECK(w->hidden >= 128 && w->hidden % 128 == 0 && w->hidden <= (1 << 20),
                "%s: experts->hidden = %d: must be a positive multiple of 128 (at most 2^20)", fn,
                w->hidden);
  EPX_ARG_CHECK(
      w->intermediate >= 128 && w->intermediate % 128 == 0 && w->intermediate <= (1 << 20),
      "%s: experts->intermediate = %d: must be a positive multiple of 128 (at most 2^20)", fn,
      w->intermediate);
  EPX_ARG_CHECK(w->weight_dtype == EPX_DTYPE_BF16 || w->weight_dtype == EPX_DTYPE_FP8_E4M3,
                "%s: experts->weight_dtype = %d: must be EPX_DTYPE_BF16 or EPX_DTYPE_FP8_E4M3", fn,
                (int)w->weight_dtype);
  return EPX_OK;
}

static epx_status_t check_x_dtype(const char *fn, const epx_experts_t *w, epx_dtype_t x_dtype) {
  EPX_ARG_CHECK(x_dtype == EPX_DTYPE_BF16 || x_dtype == EPX_DTYPE_FP8_E4M3,
                "%s: x_dtype = %d: must be EPX_DTYPE_BF16 or EPX_DTYPE_FP8_E4M3", fn, (int)x_dtype);
  if (x_dtype == EPX_DTYPE_FP8_E4M3 && w->weight_dtype == EPX_DTYPE_BF16)
    return epx__set_error(EPX_ERR_UNSUPPORTED,
                          "%s: FP8 x with BF16 weights is not supported: pass BF16 rows "
                          "(recv_dtype EPX_DTYPE_BF16) or FP8 weights",
                          fn);
  return EPX_OK;
}

EPX_EXPORT epx_status_t epx_experts_ffn_workspace_size(const epx_experts_t *experts, int num_rows,
                                                       epx_dtype_t x_dtype, size_t *bytes) {
  static const char fn[] = "epx_experts_ffn_workspace_size";
  EPX_CHECK(check_experts_shape(fn, experts));
  EPX_CHECK(check_x_dtype(fn, experts, x_dtype));
  EPX_CHECK(epx__check_not_null(fn, "bytes", bytes));
  EPX_ARG_CHECK(num_rows >= 0, "%s: num_rows = %d: must be at least 0", fn, num_rows);
  *bytes = scratch_layout(experts, num_rows, x_dtype).total;
  return EPX_OK;
}

static epx_status_t check_weight_pointers(const char *fn, const epx_experts_t *w) {
  EPX_CHECK(epx__check_device_ptr(fn, "experts->gate_up", w->gate_up, 16));
  EPX_CHECK(epx__check_device_ptr(fn, "experts->down", w->down, 16));
  if (w->weight_dtype == EPX_DTYPE_FP8_E4M3) {
    EPX_CHECK(epx__check_device_ptr(fn, "experts->gate_up_scales", w->gate_up_scales, 4));
    EPX_CHECK(epx__check_device_ptr(fn, "experts->down_scales", w->down_scales, 4));
  }
  return EPX_OK;
}

epx_status_t epx__experts_check(const char *fn, const epx_experts_t *w, epx_dtype_t x_dtype) {
  EPX_CHECK(check_experts_shape(fn, w));
  EPX_CHECK(check_x_dtype(fn, w, x_dtype));
  return check_weight_pointers(fn, w);
}

epx_status_t epx__experts_check_share(const char *fn, const epx_experts_t *w, int local_experts,
                                      int hidden) {
  EPX_ARG_CHECK(w->num_experts == local_experts,
                "%s: experts->num_experts = %d: must be the group's local experts, "
                "num_experts / num_ranks = %d",
                fn, w->num_experts, local_experts);
  EPX_ARG_CHECK(w->hidden == hidden,
                "%s: experts->hidden = %d: must be the group's config.hidden = %d", fn, w->hidden,
                hidden);
  return EPX_OK;
}

/* [p, p + n) and [q, q + m) share a byte. */
static int overlaps(const void *p, size_t n, const void *q, size_t m) {
  const uintptr_t a = (uintptr_t)p, b = (uintptr_t)q;
  return n > 0 && m > 0 && a < b + m && b < a + n;
}

static epx_status_t check_args(const char *fn, const epx_experts_t *w,
                               const epx_experts_ffn_args_t *a, scratch_layout_t *scratch) {
  EPX_CHECK(check_experts_shape(fn, w));
  EPX_CHECK(epx__check_not_null(fn, "args", a));
  EPX_CHECK(epx__check_struct_size(fn, "args", a->size, sizeof(epx_experts_ffn_args_t),
                                   "EPX_EXPERTS_FFN_ARGS_INIT"));
  EPX_CHECK(check_x_dtype(fn, w, a->x_dtype));
  EPX_ARG_CHECK(a->num_rows >= 0, "%s: args->num_rows = %d: must be at least 0", fn, a->num_rows);
  const size_t rows = (size_t)a->num_rows, E = (size_t)w->num_experts;
  if (!a->expert_begin)
    EPX_ARG_CHECK(a->rows_per_expert >= 0 && (size_t)a->rows_per_expert * E <= rows,
                  "%s: args->rows_per_expert = %d: must be in [0, num_rows / num_experts = %d] "
                  "(masked layout: expert e's rows start at e * rows_per_expert)",
                  fn, a->rows_per_expert, a->num_rows / w->num_experts);
  *scratch = scratch_layout(w, a->num_rows, a->x_dtype);
  if (a->num_rows == 0) return EPX_OK;

  const size_t x_bytes = rows * (size_t)w->hidden * (a->x_dtype == EPX_DTYPE_BF16 ? 2 : 1);
  const size_t out_bytes = rows * (size_t)w->hidden * 2;
  EPX_CHECK(epx__check_device_ptr(fn, "args->x", a->x, 16));
  EPX_CHECK(epx__check_device_ptr(fn, "args->out", a->out, 16));
  EPX_CHECK(epx__check_device_ptr(fn, "args->expert_count", a->expert_count, 4));
  if (a->expert_begin)
    EPX_CHECK(epx__check_device_ptr(fn, "args->expert_begin", a->expert_begin, 4));
  if (a->x_dtype == EPX_DTYPE_FP8_E4M3)
    EPX_CHECK(epx__check_device_ptr(fn, "args->x_scales", a->x_scales, 4));
  EPX_CHECK(check_weight_pointers(fn, w));
  EPX_ARG_CHECK(!overlaps(a->x, x_bytes, a->out, out_bytes),
                "%s: args->out = %p: overlaps args->x (%p); the down projection would overwrite "
                "rows the gate and up projections of other CTAs still read",
                fn, a->out, a->x);
  EPX_CHECK(epx__check_device_ptr(fn, "args->workspace", a->workspace, WS_ALIGN));
  EPX_ARG_CHECK(a->workspace_bytes >= scratch->total,
                "%s: args->workspace_bytes = %zu: must be at least %zu "
                "(epx_experts_ffn_workspace_size for %d rows)",
                fn, a->workspace_bytes, scratch->total, a->num_rows);
  EPX_ARG_CHECK(!overlaps(a->workspace, scratch->total, a->x, x_bytes) &&
                    !overlaps(a->workspace, scratch->total, a->out, out_bytes),
                "%s: args->workspace = %p: overlaps args->x or args->out", fn, a->workspace);
  return EPX_OK;
}

EPX_EXPORT epx_status_t epx_experts_ffn(const epx_experts_t *experts,
                                        const epx_experts_ffn_args_t *args, cudaStream_t stream) {
  return epx__experts_ffn_enqueue(experts, args, NULL, 0, stream);
}

epx_status_t epx__experts_ffn_enqueue(const epx_experts_t *experts,
                                      const epx_experts_ffn_args_t *args,
                                      const epx__experts_scatter_t *send_rows, int early,
                                      cudaStream_t stream) {
  static const char fn[] = "epx_experts_ffn";
  scratch_layout_t s;
  EPX_CHECK(check_args(fn, experts, args, &s));
  if (args->num_rows == 0) return EPX_OK;
  /* early: the first kernel is launched early (the caller's choice); each later one follows
   * one of ours and is launched early unless EPX_EARLY_LAUNCH=0. */
  const int chained = epx__param_EarlyLaunch() != 0;

  const int fp8 = experts->weight_dtype == EPX_DTYPE_FP8_E4M3;
  char *ws = (char *)args->workspace;
  const void *x = args->x;
  const float *x_scales = args->x_scales;
  if (fp8 && args->x_dtype == EPX_DTYPE_BF16) { /* the FP8 GEMMs multiply FP8 by FP8 */
    epx__experts_quantize_args_t q = {args->x,
                                      ws + s.xq,
                                      (float *)(ws + s.xq_scales),
                                      experts->hidden,
                                      experts->num_experts,
                                      args->num_rows,
                                      args->rows_per_expert,
                                      args->expert_count,
                                      args->expert_begin,
                                      early};
    EPX_CHECK(epx__experts_quantize_x_launch(&q, stream));
    x = q.codes;
    x_scales = q.scales;
    early = chained;
  }

  epx__experts_gemm_args_t g;
  memset(&g, 0, sizeof g);
  g.num_experts = experts->num_experts;
  g.num_rows = args->num_rows;
  g.rows_per_expert = args->rows_per_expert;
  g.expert_count = args->expert_count;
  g.expert_begin = args->expert_begin;
  g.fp8 = fp8;

  /* h = silu(x Wg^T) * (x Wu^T) */
  g.x = x;
  g.x_scales = x_scales;
  g.w = experts->gate_up;
  g.w_scales = experts->gate_up_scales;
  g.k = experts->hidden;
  g.n = 2 * experts->intermediate;
  g.swiglu = 1;
  g.out = ws + s.h;
  g.out_scales = fp8 ? (float *)(ws + s.h_scales) : NULL;
  g.early_launch = early;
  EPX_CHECK(epx__experts_gemm_launch(&g, stream));
  g.early_launch = chained;

  /* out = h Wd^T */
  g.x = ws + s.h;
  g.x_scales = g.out_scales;
  g.w = experts->down;
  g.w_scales = experts->down_scales;
  g.k = experts->intermediate;
  g.n = experts->hidden;
  g.swiglu = 0;
  g.out = args->out;
  g.out_scales = NULL;
  if (send_rows) {
    g.scatter_rows = 1;
    g.scatter = *send_rows;
  }
  return epx__experts_gemm_launch(&g, stream);
}

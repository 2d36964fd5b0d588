/*
 * dispatch_args.c - the argument checks of the normal-mode dispatch entries (dispatch_args.h).
 * Every message names the field as the caller wrote it ("args->x_scales_stride_group = 0: ...").
 */
#include "dispatch_args.h"

#include <stdio.h>
#include <string.h>

#include "arg_check.h"
#include "checks.h"
#include "group.h"
#include "registry.h"

/* The scale format of an FP8 payload: packed or float32 words, per-row count and strides. */
static epx_status_t check_scale_format(epx_group_t g, const char *fn, const char *prefix,
                                       const epx_dispatch_args_t *a, int num_tokens,
                                       epx__dispatch_launch_args_t *d) {
  const int packed = a->x_scales_dtype == EPX_DTYPE_INT32;
  EPX_ARG_CHECK(a->x_scales_dtype == 0 || a->x_scales_dtype == EPX_DTYPE_FLOAT32 || packed,
                "%s: %sx_scales_dtype = %d: must be EPX_DTYPE_FLOAT32 (or 0) or EPX_DTYPE_INT32 "
                "(UE8M0 packed four per int32)",
                fn, prefix, (int)a->x_scales_dtype);
  const int groups = g->config.hidden / 128, cols = packed ? (groups + 3) / 4 : groups;
  const int st = a->x_scales_stride_token, sg = a->x_scales_stride_group;
  EPX_ARG_CHECK((st == 0 && sg == 0) || (st >= 1 && sg >= 1),
                "%s: %sx_scales_stride_token = %d, %sx_scales_stride_group = %d: both 0 "
                "(contiguous) or both >= 1",
                fn, prefix, st, prefix, sg);
  d->scales_packed = packed;
  d->scale_cols = cols;
  d->scale_stride_token = st ? st : cols;
  d->scale_stride_group = sg ? sg : 1;
  d->scales_strided = d->scale_stride_token != cols || d->scale_stride_group != 1;
  if (num_tokens == 0) return EPX_OK;
  char arg[64];
  snprintf(arg, sizeof arg, "%sx_scales", prefix);
  return epx__check_device_ptr(fn, arg, a->x_scales, 4);
}

epx_status_t epx__dispatch_check_payload(epx_group_t g, const char *fn, const char *prefix,
                                         const epx_dispatch_args_t *a, int num_tokens,
                                         epx__dispatch_launch_args_t *d) {
  char arg[64];
  snprintf(arg, sizeof arg, "%sx_dtype", prefix);
  const epx_dtype_t x_dtype = a->x_dtype;
  EPX_ARG_CHECK(x_dtype == EPX_DTYPE_BF16 || x_dtype == EPX_DTYPE_FP8_E4M3,
                "%s: %s = %d: must be EPX_DTYPE_BF16 or EPX_DTYPE_FP8_E4M3", fn, arg, (int)x_dtype);
  EPX_ARG_CHECK(g->config.dtypes & x_dtype,
                "%s: %s = %s: must be one the group was created with (config.dtypes = 0x%x)", fn,
                arg, x_dtype == EPX_DTYPE_BF16 ? "BF16" : "FP8_E4M3", g->config.dtypes);
  d->x = a->x;
  d->x_is_fp8 = x_dtype == EPX_DTYPE_FP8_E4M3;
  d->x_scales = a->x_scales;
  if (d->x_is_fp8) {
    EPX_CHECK(check_scale_format(g, fn, prefix, a, num_tokens, d));
  } else {
    EPX_ARG_CHECK(a->x_scales_dtype == 0 || a->x_scales_dtype == EPX_DTYPE_FLOAT32,
                  "%s: %sx_scales_dtype = %d: scales only go with x_dtype = EPX_DTYPE_FP8_E4M3", fn,
                  prefix, (int)a->x_scales_dtype);
    EPX_ARG_CHECK(a->x_scales_stride_token == 0 && a->x_scales_stride_group == 0,
                  "%s: %sx_scales_stride_token / _group = %d / %d: scales only go with x_dtype = "
                  "EPX_DTYPE_FP8_E4M3",
                  fn, prefix, a->x_scales_stride_token, a->x_scales_stride_group);
  }
  if (num_tokens == 0) return EPX_OK;
  snprintf(arg, sizeof arg, "%sx", prefix);
  return epx__check_device_ptr(fn, arg, a->x, 16);
}

/* is_token_in_rank + num_tokens_per_expert instead of topk_idx (DeepEP's is_token_in_rank). */
static epx_status_t check_mask_routing(const char *fn, const epx_dispatch_args_t *a) {
  EPX_ARG_CHECK(!a->topk_idx,
                "%s: args->topk_idx = %p: must be NULL when args->is_token_in_rank or "
                "args->num_tokens_per_expert routes by rank mask",
                fn, a->topk_idx);
  EPX_ARG_CHECK(!a->topk_weights,
                "%s: args->topk_weights = %p: must be NULL with rank-mask routing (no ids to "
                "weigh)",
                fn, (const void *)a->topk_weights);
  EPX_CHECK(epx__check_device_ptr(fn, "args->num_tokens_per_expert", a->num_tokens_per_expert, 4));
  if (a->num_tokens > 0)
    EPX_CHECK(epx__check_device_ptr(fn, "args->is_token_in_rank", a->is_token_in_rank, 1));
  return EPX_OK;
}

epx_status_t epx__dispatch_check_routing(epx_group_t g, const char *fn,
                                         const epx_dispatch_args_t *a) {
  EPX_CHECK(
      epx__check_token_count(fn, "args->num_tokens", a->num_tokens, g->config.max_tokens_per_rank));
  EPX_ARG_CHECK(a->expert_alignment >= 0 && a->expert_alignment <= 4096,
                "%s: args->expert_alignment = %d: must be in [0, 4096]", fn, a->expert_alignment);
  EPX_CHECK(epx__check_flag(fn, "args->sync_counts", a->sync_counts));
  EPX_ARG_CHECK(a->sync_counts || !a->num_recv_per_expert,
                "%s: args->num_recv_per_expert = %p: must be NULL unless args->sync_counts = 1 "
                "(use the device counts otherwise)",
                fn, (void *)a->num_recv_per_expert);
  const int capacity = (int)g->layout.recv_capacity;
  EPX_ARG_CHECK(a->num_worst_tokens >= 0 && a->num_worst_tokens <= capacity,
                "%s: args->num_worst_tokens = %d: must be in [0, capacity = %d]", fn,
                a->num_worst_tokens, capacity);
  EPX_ARG_CHECK(a->num_worst_tokens == 0 || a->sync_counts == 0,
                "%s: args->num_worst_tokens = %d with args->sync_counts = 1: worst-case rows are "
                "for dispatches without host sync; set sync_counts = 0",
                fn, a->num_worst_tokens);
  EPX_ARG_CHECK(a->recv_topk_idx_dtype == 0 || a->recv_topk_idx_dtype == EPX_DTYPE_INT32 ||
                    a->recv_topk_idx_dtype == EPX_DTYPE_INT64,
                "%s: args->recv_topk_idx_dtype = %d: must be EPX_DTYPE_INT32 (or 0) or "
                "EPX_DTYPE_INT64",
                fn, (int)a->recv_topk_idx_dtype);
  if (epx__dispatch_by_mask(a)) return check_mask_routing(fn, a);
  EPX_CHECK(epx__check_index_dtype(fn, "args->topk_idx_dtype", a->topk_idx_dtype));
  if (a->num_tokens > 0) {
    EPX_CHECK(epx__check_device_ptr(fn, "args->topk_idx", a->topk_idx,
                                    epx__index_bytes(a->topk_idx_dtype)));
    if (a->topk_weights)
      EPX_CHECK(epx__check_device_ptr(fn, "args->topk_weights", a->topk_weights, 4));
  }
  return EPX_OK;
}

epx_status_t epx__dispatch_check_call(epx_group_t g, epx_handle_t h, const char *fn,
                                      const epx_dispatch_args_t *a, const void *result) {
  EPX_CHECK(epx__handle_check(g, h));
  EPX_CHECK(epx__check_not_null(fn, "args", a));
  EPX_CHECK(epx__check_not_null(fn, "result", result));
  return epx__check_struct_size(fn, "args", a->size, sizeof(epx_dispatch_args_t),
                                "EPX_DISPATCH_ARGS_INIT");
}

epx_status_t epx__dispatch_check_inputs(epx_group_t g, const char *fn, const epx_dispatch_args_t *a,
                                        cudaStream_t stream, epx__dispatch_launch_args_t *d) {
  EPX_CHECK(epx__dispatch_check_routing(g, fn, a));
  memset(d, 0, sizeof *d);
  EPX_CHECK(epx__dispatch_check_payload(g, fn, "args->", a, a->num_tokens, d));
  if (a->sync_counts && epx__stream_is_capturing(stream))
    return epx__set_error(
        EPX_ERR_INVALID_USAGE,
        "%s: args->sync_counts = 1 on a stream being captured; use sync_counts = 0 in graphs", fn);
  return EPX_OK;
}

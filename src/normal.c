/*
 * normal.c - the host side of normal (high-throughput) mode: handles, epx_dispatch,
 * epx_dispatch_cached, epx_combine. Checks every argument, then queues the kernels of
 * src/kernels/notify.cu, normal_dispatch.cu and normal_combine.cu (and layout.cu) on the
 * caller's stream.
 *
 * A dispatch is: layout (into the handle) -> notify (count exchange into the handle's meta)
 * -> dispatch kernel. With sync_counts the host waits for notify only; the dispatch kernel is
 * already queued behind it.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "arg_check.h"
#include "checks.h"
#include "group.h"
#include "handle.h"
#include "kernels/api.h"
#include "layout.h"
#include "registry.h"

static epx__routing_t routing_of(epx_handle_t h) {
  epx__routing_t r = {h->is_token_in_rank,
                      h->token_pos_in_rank,
                      h->num_tokens_per_rank,
                      h->num_tokens_per_expert,
                      h->meta,
                      h->num_tokens};
  return r;
}

static void fill_result(epx_group_t g, epx_handle_t h, int x_is_fp8, int num_recv,
                        epx_dispatch_result_t *out) {
  char *base = g->workspace + g->layout.normal_offset;
  out->num_recv = num_recv;
  out->capacity = (int)g->layout.recv_capacity;
  out->recv_x = base + g->layout.recv_x_offset;
  out->recv_x_scales = x_is_fp8 ? (float *)(base + g->layout.recv_scales_offset) : NULL;
  out->recv_topk_idx = (int *)(base + g->layout.recv_topk_idx_offset);
  out->recv_topk_weights = (float *)(base + g->layout.recv_topk_weights_offset);
  out->recv_src_token = (int *)(base + g->layout.recv_src_token_offset);
  out->recv_rank_prefix = h->meta->rank_prefix;
  out->num_recv_device = &h->meta->num_recv;
  out->num_recv_per_expert_device = h->meta->per_expert;
}

/* Payload checks shared by epx_dispatch and epx_dispatch_cached. */
static epx_status_t check_payload(epx_group_t g, const char *fn, const char *x_name, const void *x,
                                  epx_dtype_t x_dtype, const float *x_scales, int num_tokens) {
  char arg[64];
  snprintf(arg, sizeof arg, "%s_dtype", x_name);
  EPX_ARG_CHECK(x_dtype == EPX_DTYPE_BF16 || x_dtype == EPX_DTYPE_FP8_E4M3,
                "%s: %s = %d: must be EPX_DTYPE_BF16 or EPX_DTYPE_FP8_E4M3", fn, arg, (int)x_dtype);
  EPX_ARG_CHECK(g->config.dtypes & x_dtype,
                "%s: %s = %s: must be one the group was created with (config.dtypes = 0x%x)", fn,
                arg, x_dtype == EPX_DTYPE_BF16 ? "BF16" : "FP8_E4M3", g->config.dtypes);
  if (num_tokens == 0) return EPX_OK;
  EPX_CHECK(epx__check_device_ptr(fn, x_name, x, 16));
  if (x_dtype == EPX_DTYPE_FP8_E4M3) {
    snprintf(arg, sizeof arg, "%s_scales", x_name);
    EPX_CHECK(epx__check_device_ptr(fn, arg, x_scales, 4));
  }
  return EPX_OK;
}

static int stream_is_capturing(cudaStream_t stream) {
  enum cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &st) != cudaSuccess) return 0;
  return st != cudaStreamCaptureStatusNone;
}

static epx__dispatch_launch_args_t dispatch_args_of(epx_group_t g, epx_handle_t h, const void *x,
                                                    epx_dtype_t x_dtype, const float *x_scales) {
  epx__dispatch_launch_args_t d;
  memset(&d, 0, sizeof d);
  d.routing = routing_of(h);
  d.x = x;
  d.x_is_fp8 = x_dtype == EPX_DTYPE_FP8_E4M3;
  d.x_scales = x_scales;
  d.hidden = g->config.hidden;
  d.top_k = g->config.top_k;
  d.num_experts = g->config.num_experts;
  d.num_blocks = g->config.num_sms;
  d.idx_is_int64 = 1;
  return d;
}

EPX_EXPORT epx_status_t epx_dispatch(epx_group_t g, epx_handle_t h, const epx_dispatch_args_t *a,
                                     epx_dispatch_result_t *out, cudaStream_t stream) {
  static const char fn[] = "epx_dispatch";
  EPX_CHECK(epx__handle_check(g, h));
  EPX_CHECK(epx__check_not_null(fn, "args", a));
  EPX_CHECK(epx__check_not_null(fn, "result", out));
  EPX_CHECK(epx__check_struct_size(fn, "args", a->size, sizeof(epx_dispatch_args_t),
                                   "EPX_DISPATCH_ARGS_INIT"));
  EPX_CHECK(
      epx__check_token_count(fn, "args->num_tokens", a->num_tokens, g->config.max_tokens_per_rank));
  EPX_CHECK(epx__check_index_dtype(fn, "args->topk_idx_dtype", a->topk_idx_dtype));
  EPX_ARG_CHECK(a->expert_alignment >= 0 && a->expert_alignment <= 4096,
                "%s: args->expert_alignment = %d: must be in [0, 4096]", fn, a->expert_alignment);
  EPX_CHECK(epx__check_flag(fn, "args->sync_counts", a->sync_counts));
  EPX_ARG_CHECK(a->sync_counts || !a->num_recv_per_expert,
                "%s: args->num_recv_per_expert = %p: must be NULL unless args->sync_counts = 1 "
                "(use the device counts otherwise)",
                fn, (void *)a->num_recv_per_expert);
  EPX_CHECK(check_payload(g, fn, "args->x", a->x, a->x_dtype, a->x_scales, a->num_tokens));
  if (a->num_tokens > 0) {
    EPX_CHECK(epx__check_device_ptr(fn, "args->topk_idx", a->topk_idx,
                                    epx__index_bytes(a->topk_idx_dtype)));
    if (a->topk_weights)
      EPX_CHECK(epx__check_device_ptr(fn, "args->topk_weights", a->topk_weights, 4));
  }
  if (a->sync_counts && stream_is_capturing(stream))
    return epx__set_error(
        EPX_ERR_INVALID_USAGE,
        "%s: args->sync_counts = 1 on a stream being captured; use sync_counts = 0 in graphs", fn);

  epx__kernel_ctx_t ctx;
  epx__group_kernel_ctx(g, &ctx);
  h->num_tokens = a->num_tokens;
  epx_layout_args_t la = EPX_LAYOUT_ARGS_INIT;
  la.topk_idx = a->topk_idx;
  la.topk_idx_dtype = a->topk_idx_dtype;
  la.num_tokens = a->num_tokens;
  la.num_tokens_per_rank = h->num_tokens_per_rank;
  la.num_tokens_per_expert = h->num_tokens_per_expert;
  la.is_token_in_rank = h->is_token_in_rank;
  la.token_pos_in_rank = h->token_pos_in_rank;
  EPX_CHECK(epx__layout_enqueue(g, &la, stream));
  epx__notify_launch_args_t na = {routing_of(h), g->config.num_experts, a->expert_alignment,
                                  g->config.max_tokens_per_rank,
                                  a->sync_counts ? h->host_counts_dev : NULL};
  EPX_CHECK(epx__notify_launch(&ctx, &na, stream));
  if (a->sync_counts) CUDA_CHECK(cudaEventRecord(h->counts_ready, stream));
  epx__dispatch_launch_args_t d = dispatch_args_of(g, h, a->x, a->x_dtype, a->x_scales);
  d.topk_idx = a->topk_idx;
  d.idx_is_int64 = a->topk_idx_dtype == EPX_DTYPE_INT64;
  d.topk_weights = a->topk_weights;
  EPX_CHECK(epx__dispatch_launch(&ctx, &d, stream));

  int num_recv = -1;
  if (a->sync_counts) {
    /* The one host synchronization of EPX: wait for the count exchange, not for the data. */
    CUDA_CHECK(cudaEventSynchronize(h->counts_ready));
    num_recv = ((volatile int *)h->host_counts)[0];
    if (a->num_recv_per_expert)
      for (int j = 0; j < g->config.num_experts / g->num_ranks; j++)
        a->num_recv_per_expert[j] = ((volatile int *)h->host_counts)[1 + j];
  }
  fill_result(g, h, a->x_dtype == EPX_DTYPE_FP8_E4M3, num_recv, out);
  return EPX_OK;
}

EPX_EXPORT epx_status_t epx_dispatch_cached(epx_group_t g, epx_handle_t h, const void *x,
                                            epx_dtype_t x_dtype, const float *x_scales,
                                            epx_dispatch_result_t *out, cudaStream_t stream) {
  static const char fn[] = "epx_dispatch_cached";
  EPX_CHECK(epx__handle_check(g, h));
  EPX_CHECK(epx__check_not_null(fn, "result", out));
  if (h->num_tokens < 0)
    return epx__set_error(EPX_ERR_INVALID_USAGE,
                          "%s: the handle holds no routing yet; call epx_dispatch first", fn);
  EPX_CHECK(check_payload(g, fn, "x", x, x_dtype, x_scales, h->num_tokens));
  epx__kernel_ctx_t ctx;
  epx__group_kernel_ctx(g, &ctx);
  epx__dispatch_launch_args_t d = dispatch_args_of(g, h, x, x_dtype, x_scales);
  EPX_CHECK(epx__dispatch_launch(&ctx, &d, stream));
  fill_result(g, h, x_dtype == EPX_DTYPE_FP8_E4M3, -1, out);
  return EPX_OK;
}

/* The top-k weight reduction and the bias of a combine (DeepEP combine's `topk_weights` and
 * `bias`): weights both or neither; every pointer given must be device memory, except the [T, ..]
 * outputs and biases of a rank with no tokens, which are never touched. */
static epx_status_t check_combine_extras(const char *fn, const epx_combine_args_t *a, int T) {
  EPX_ARG_CHECK(!a->recv_topk_weights == !a->out_topk_weights,
                "%s: args->recv_topk_weights = %p, args->out_topk_weights = %p: the top-k weight "
                "reduction needs both (or neither)",
                fn, (const void *)a->recv_topk_weights, (void *)a->out_topk_weights);
  /* The received rows may be 0 on this rank, but the pointer must still be valid memory. */
  if (a->recv_topk_weights)
    EPX_CHECK(epx__check_device_ptr(fn, "args->recv_topk_weights", a->recv_topk_weights, 4));
  if (T == 0) return EPX_OK;
  if (a->out_topk_weights)
    EPX_CHECK(epx__check_device_ptr(fn, "args->out_topk_weights", a->out_topk_weights, 4));
  if (a->bias[0]) EPX_CHECK(epx__check_device_ptr(fn, "args->bias[0]", a->bias[0], 16));
  if (a->bias[1]) EPX_CHECK(epx__check_device_ptr(fn, "args->bias[1]", a->bias[1], 16));
  return EPX_OK;
}

EPX_EXPORT epx_status_t epx_combine(epx_group_t g, epx_handle_t h, const epx_combine_args_t *a,
                                    cudaStream_t stream) {
  static const char fn[] = "epx_combine";
  EPX_CHECK(epx__handle_check(g, h));
  EPX_CHECK(epx__check_not_null(fn, "args", a));
  EPX_CHECK(epx__check_struct_size(fn, "args", a->size, sizeof(epx_combine_args_t),
                                   "EPX_COMBINE_ARGS_INIT"));
  if (h->num_tokens < 0)
    return epx__set_error(EPX_ERR_INVALID_USAGE,
                          "%s: the handle holds no routing yet; call epx_dispatch first", fn);
  /* The rows to send back may be 0 on this rank, but the pointer must still be valid memory. */
  EPX_CHECK(epx__check_device_ptr(fn, "args->x", a->x, 16));
  if (h->num_tokens > 0) EPX_CHECK(epx__check_device_ptr(fn, "args->out", a->out, 16));
  EPX_ARG_CHECK(!a->topk_weights == !a->topk_idx,
                "%s: args->topk_idx and args->topk_weights: a weighted combine needs both (or "
                "neither)",
                fn);
  if (a->topk_weights && h->num_tokens > 0) {
    EPX_CHECK(epx__check_index_dtype(fn, "args->topk_idx_dtype", a->topk_idx_dtype));
    EPX_CHECK(epx__check_device_ptr(fn, "args->topk_idx", a->topk_idx,
                                    epx__index_bytes(a->topk_idx_dtype)));
    EPX_CHECK(epx__check_device_ptr(fn, "args->topk_weights", a->topk_weights, 4));
  }
  EPX_CHECK(check_combine_extras(fn, a, h->num_tokens));
  epx__kernel_ctx_t ctx;
  epx__group_kernel_ctx(g, &ctx);
  epx__combine_launch_args_t c;
  memset(&c, 0, sizeof c);
  c.routing = routing_of(h);
  c.x = a->x;
  c.topk_idx = a->topk_idx;
  c.idx_is_int64 = a->topk_idx_dtype == EPX_DTYPE_INT64;
  c.topk_weights = a->topk_weights;
  c.out = a->out;
  c.hidden = g->config.hidden;
  c.top_k = g->config.top_k;
  c.num_experts = g->config.num_experts;
  c.max_tokens = g->config.max_tokens_per_rank;
  c.num_blocks = g->config.num_sms;
  const epx__combine_extras_t x = {
      a->recv_topk_weights, a->out_topk_weights, {a->bias[0], a->bias[1]}};
  return epx__combine_launch(&ctx, &c, &x, stream);
}

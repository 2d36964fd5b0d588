/*
 * normal.c - the host side of normal (high-throughput) mode: epx_dispatch,
 * epx_dispatch_cached(_args), epx_combine. Checks every argument (dispatch's in
 * dispatch_args.c), then queues the kernels of
 * src/kernels/notify.cu, normal_dispatch.cu and normal_combine.cu (and layout.cu) on the
 * caller's stream.
 *
 * A dispatch is: layout (into the handle) -> notify (count exchange into the handle's meta)
 * -> (num_worst_tokens: the tail of the receive metadata) -> dispatch kernel. With sync_counts
 * the host waits for notify only; the dispatch kernel is already queued behind it.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "arg_check.h"
#include "checks.h"
#include "dispatch_args.h"
#include "group.h"
#include "handle.h"
#include "kernels/api.h"
#include "layout.h"
#include "registry.h"

/* Where the received data is. scales_packed: the payload's scales are packed UE8M0 words. */
static void fill_result(epx_group_t g, epx_handle_t h, int x_is_fp8, int scales_packed,
                        int num_recv, epx_dispatch_result_t *out) {
  char *base = g->workspace + g->layout.normal_offset;
  void *scales = base + g->layout.recv_scales_offset, *idx = base + g->layout.recv_topk_idx_offset;
  memset(out, 0, sizeof *out);
  out->num_recv = num_recv;
  out->capacity = (int)g->layout.recv_capacity;
  out->recv_x = base + g->layout.recv_x_offset;
  out->recv_x_scales = x_is_fp8 && !scales_packed ? (float *)scales : NULL;
  out->recv_x_scales_packed = x_is_fp8 && scales_packed ? (int32_t *)scales : NULL;
  out->recv_topk_idx = h->recv_topk_idx_int64 ? NULL : (int *)idx;
  out->recv_topk_idx_int64 = h->recv_topk_idx_int64 ? (int64_t *)idx : NULL;
  out->recv_topk_weights = (float *)(base + g->layout.recv_topk_weights_offset);
  out->recv_src_token = (int *)(base + g->layout.recv_src_token_offset);
  out->recv_rank_prefix = h->meta->rank_prefix;
  out->num_recv_device = &h->meta->num_recv;
  out->num_recv_per_expert_device = h->meta->per_expert;
  out->rank_prefix_matrix_device = h->meta->rank_prefix_matrix;
}

/* The launch arguments every dispatch shares; the payload fields come from
 * epx__dispatch_check_payload. */
static void dispatch_args_of(epx_group_t g, epx_handle_t h, epx__dispatch_launch_args_t *d) {
  d->routing = epx__handle_routing(h);
  d->hidden = g->config.hidden;
  d->top_k = g->config.top_k;
  d->num_experts = g->config.num_experts;
  d->num_blocks = g->config.num_sms;
  d->idx_is_int64 = 1;
  d->recv_idx_int64 = h->recv_topk_idx_int64;
}

/* Layout into the handle, from topk_idx or from the caller's rank mask. */
static epx_status_t enqueue_layout(epx_group_t g, epx_handle_t h, const epx_dispatch_args_t *a,
                                   cudaStream_t stream) {
  epx_layout_args_t la = epx__handle_layout_args(h, a);
  if (epx__dispatch_by_mask(a))
    return epx__layout_mask_enqueue(g, &la, a->is_token_in_rank, a->num_tokens_per_expert, stream);
  return epx__layout_enqueue(g, &la, stream);
}

/* A dispatch with more tokens than the group holds, refused on this rank while its peers may
 * have started theirs: the refused count exchange fails every rank's call at once, and the empty
 * dispatch kernel keeps the completion counters in step, so the group stays usable. */
static epx_status_t tell_peers_refused(epx_group_t g, epx_handle_t h, epx_dispatch_result_t *out,
                                       cudaStream_t stream) {
  epx__kernel_ctx_t ctx;
  epx__group_kernel_ctx(g, &ctx);
  EPX_CHECK(epx__handle_enqueue_refusal(g, h, 0, &ctx, stream));
  epx__dispatch_launch_args_t d;
  memset(&d, 0, sizeof d);
  dispatch_args_of(g, h, &d);
  d.write_meta = 1;
  EPX_CHECK(epx__dispatch_launch(&ctx, &d, stream));
  fill_result(g, h, 0, 0, -1, out); /* as a failed count exchange leaves it */
  return EPX_OK;
}

static epx_status_t refuse_for_all(epx_group_t g, epx_handle_t h, epx_dispatch_result_t *out,
                                   cudaStream_t stream, epx_status_t refused) {
  if (epx__stream_is_capturing(stream)) return refused; /* nothing would run now */
  char why[768];
  snprintf(why, sizeof why, "%s", epx_last_error());
  return epx__handle_refused(refused, why, tell_peers_refused(g, h, out, stream));
}

EPX_EXPORT epx_status_t epx_dispatch(epx_group_t g, epx_handle_t h, const epx_dispatch_args_t *a,
                                     epx_dispatch_result_t *out, cudaStream_t stream) {
  static const char fn[] = "epx_dispatch";
  EPX_CHECK(epx__dispatch_check_call(g, h, fn, a, out));
  epx__dispatch_launch_args_t d;
  const epx_status_t checked = epx__dispatch_check_inputs(g, fn, a, stream, &d);
  if (checked != EPX_OK)
    return a->num_tokens > g->config.max_tokens_per_rank
               ? refuse_for_all(g, h, out, stream, checked)
               : checked;

  epx__kernel_ctx_t ctx;
  epx__group_kernel_ctx(g, &ctx);
  h->num_tokens = a->num_tokens;
  h->recv_topk_idx_int64 = a->recv_topk_idx_dtype == EPX_DTYPE_INT64;
  h->num_worst_tokens = a->num_worst_tokens;
  h->expand = 0;
  EPX_CHECK(enqueue_layout(g, h, a, stream));
  EPX_CHECK(epx__handle_enqueue_notify(g, h, a, 0, &ctx, stream));
  if (a->num_worst_tokens > 0) {
    epx__worst_tail_launch_args_t wa = {h->meta, a->num_worst_tokens, g->config.top_k,
                                        h->recv_topk_idx_int64};
    EPX_CHECK(epx__worst_tail_launch(&ctx, &wa, stream));
  }
  dispatch_args_of(g, h, &d);
  d.topk_idx = a->topk_idx;
  d.idx_is_int64 = a->topk_idx_dtype == EPX_DTYPE_INT64;
  d.topk_weights = a->topk_weights;
  d.write_meta = 1;
  EPX_CHECK(epx__dispatch_launch(&ctx, &d, stream));

  int num_recv = a->num_worst_tokens > 0 ? a->num_worst_tokens : -1;
  if (a->sync_counts) {
    /* The one host synchronization of EPX: wait for the count exchange, not for the data. A
     * timed-out exchange returns the timeout, not a num_recv that looks valid. */
    epx_async_error_t err;
    int timed_out = 0;
    EPX_CHECK(epx__handle_wait_counts(g, h, &timed_out, &err));
    if (timed_out) {
      fill_result(g, h, d.x_is_fp8, d.scales_packed, -1, out);
      return epx__set_error(EPX_ERR_TIMEOUT,
                            "epx_dispatch: %s; the receive counts are unknown (result->num_recv "
                            "= -1); see epx_group_get_async_error",
                            err.message);
    }
    num_recv = ((volatile int *)h->host_counts)[0];
    if (a->num_recv_per_expert)
      for (int j = 0; j < g->config.num_experts / g->num_ranks; j++)
        a->num_recv_per_expert[j] = ((volatile int *)h->host_counts)[1 + j];
  }
  fill_result(g, h, d.x_is_fp8, d.scales_packed, num_recv, out);
  return EPX_OK;
}

/* A cached dispatch of the payload in a (its payload fields only), num_tokens = the handle's. */
static epx_status_t dispatch_cached(epx_group_t g, epx_handle_t h, const char *fn,
                                    const char *prefix, const epx_dispatch_args_t *a,
                                    epx_dispatch_result_t *out, cudaStream_t stream) {
  epx__dispatch_launch_args_t d;
  memset(&d, 0, sizeof d);
  EPX_CHECK(epx__dispatch_check_payload(g, fn, prefix, a, h->num_tokens, &d));
  epx__kernel_ctx_t ctx;
  epx__group_kernel_ctx(g, &ctx);
  dispatch_args_of(g, h, &d);
  /* A fresh dispatch's count exchange keeps a peer from writing our receive rows before our
   * stream is done with the previous ones; a cached dispatch has no exchange, so it waits for
   * every rank's stream to reach it first (without this, a fast peer overwrote rows that were
   * still being read: test_normal_dispatch_extras caught it). */
  EPX_CHECK(epx__barrier_launch(&ctx, 0, stream));
  EPX_CHECK(epx__dispatch_launch(&ctx, &d, stream));
  fill_result(g, h, d.x_is_fp8, d.scales_packed, h->num_worst_tokens > 0 ? h->num_worst_tokens : -1,
              out);
  return EPX_OK;
}

static epx_status_t check_cached(epx_group_t g, epx_handle_t h, const char *fn,
                                 epx_dispatch_result_t *out) {
  EPX_CHECK(epx__handle_check(g, h));
  EPX_CHECK(epx__check_not_null(fn, "result", out));
  if (h->num_tokens < 0)
    return epx__set_error(EPX_ERR_INVALID_USAGE,
                          "%s: the handle holds no routing yet; call epx_dispatch first", fn);
  if (h->expand)
    return epx__set_error(EPX_ERR_INVALID_USAGE,
                          "%s: the handle holds an expert-major routing (epx_dispatch_expand); a "
                          "cached dispatch delivers epx_dispatch's layout only",
                          fn);
  return EPX_OK;
}

EPX_EXPORT epx_status_t epx_dispatch_cached(epx_group_t g, epx_handle_t h, const void *x,
                                            epx_dtype_t x_dtype, const float *x_scales,
                                            epx_dispatch_result_t *out, cudaStream_t stream) {
  static const char fn[] = "epx_dispatch_cached";
  EPX_CHECK(check_cached(g, h, fn, out));
  epx_dispatch_args_t a = EPX_DISPATCH_ARGS_INIT;
  a.x = x;
  a.x_dtype = x_dtype;
  a.x_scales = x_scales;
  return dispatch_cached(g, h, fn, "", &a, out, stream);
}

EPX_EXPORT epx_status_t epx_dispatch_cached_args(epx_group_t g, epx_handle_t h,
                                                 const epx_dispatch_args_t *a,
                                                 epx_dispatch_result_t *out, cudaStream_t stream) {
  static const char fn[] = "epx_dispatch_cached_args";
  EPX_CHECK(check_cached(g, h, fn, out));
  EPX_CHECK(epx__check_not_null(fn, "args", a));
  EPX_CHECK(epx__check_struct_size(fn, "args", a->size, sizeof(epx_dispatch_args_t),
                                   "EPX_DISPATCH_ARGS_INIT"));
  EPX_ARG_CHECK(a->num_tokens == h->num_tokens,
                "%s: args->num_tokens = %d: must be the handle's (%d), whose routing is reused", fn,
                a->num_tokens, h->num_tokens);
  EPX_ARG_CHECK(
      !a->topk_idx && !a->topk_weights && !a->is_token_in_rank && !a->num_tokens_per_expert,
      "%s: args->topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert: must "
      "be NULL (a cached dispatch reuses the handle's routing)",
      fn);
  return dispatch_cached(g, h, fn, "args->", a, out, stream);
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
  EPX_CHECK(epx__group_check_combine_in_step(g, fn));
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
  c.routing = epx__handle_routing(h);
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

/*
 * expand.c - the host side of normal mode's expert-major layout: epx_dispatch_expand and
 * epx_combine_expand (include/epx.h; docs/moe.md, "Expert-major layout"). Checks every argument
 * (the payload and routing checks are epx_dispatch's, dispatch_args.c), then queues:
 *   dispatch: layout with the per-expert positions (layout.cu, kExpand) -> notify's expand
 *             variant (all E counts to every rank: segment begins and row bases, notify.cu) ->
 *             the expert-major dispatch kernel (payload once per (token, rank), every row's
 *             source and weight) -> the receiver's fan-out of the payload to the token's other
 *             rows (both expand_dispatch.cu): a kernel after the dispatch (config.expand_fan_out
 *             AFTER), or the dispatch kernel's extra blocks as rows land (DURING)
 *   combine:  the expert-side reduce into BF16 partial rows (expand_combine.cu), in the plain
 *             receive slab's rows, which an expert-major dispatch does not use -> today's normal
 *             combine of those rows, unweighted (normal_combine.cu)
 * With sync_counts the host waits for notify only, as epx_dispatch does. The dispatch is two
 * halves (expand.h): queue everything, then wait for the counts; the prefill layer queues the
 * next chunk's dispatch between them.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "arg_check.h"
#include "checks.h"
#include "dispatch_args.h"
#include "expand.h"
#include "group.h"
#include "handle.h"
#include "kernels/api.h"
#include "layout.h"
#include "param.h"
#include "registry.h"

/* Where the expanded rows are (workspace) and the device counts (the handle's meta). */
static void fill_result(epx_group_t g, epx_handle_t h, const epx__dispatch_launch_args_t *d,
                        int num_recv, int num_rows, epx_dispatch_expand_result_t *out) {
  char *base = g->workspace + g->layout.normal_offset;
  void *scales = base + g->layout.expand_scales_offset;
  memset(out, 0, sizeof *out);
  out->num_rows = num_rows;
  out->num_recv = num_recv;
  out->capacity = (int)g->layout.expand_rows;
  out->num_local_experts = g->config.num_experts / g->num_ranks;
  out->recv_x = base + g->layout.expand_x_offset;
  out->recv_x_scales = d->x_is_fp8 && !d->scales_packed ? (float *)scales : NULL;
  out->recv_x_scales_packed = d->x_is_fp8 && d->scales_packed ? (int32_t *)scales : NULL;
  out->recv_src_info = (int *)(base + g->layout.expand_src_info_offset);
  out->recv_weights = (float *)(base + g->layout.expand_weights_offset);
  out->expert_begin_device = h->meta->expand_begin;
  out->expert_count_device = h->meta->expand_count;
  out->num_rows_device = &h->meta->expand_rows;
  out->token_rows = (const int *)(base + g->layout.expand_token_rows_offset);
  out->recv_rank_prefix = h->meta->rank_prefix;
  out->num_recv_device = &h->meta->num_recv;
  out->expert_ready =
      (const uint32_t *)(base + g->layout.expand_arrival_offset) + out->num_local_experts;
  out->counts_event = h->counts_ready;
}

/* What epx_dispatch_expand refuses beyond epx_dispatch's checks. */
static epx_status_t check_expand_args(epx_group_t g, const char *fn, const epx_dispatch_args_t *a) {
  if (g->layout.expand_rows == 0)
    return epx__set_error(EPX_ERR_INVALID_USAGE,
                          "%s: the group was created with config.expand_max_rows = 0 (no "
                          "expert-major receive buffer); set it at epx_group_create",
                          fn);
  EPX_ARG_CHECK(!epx__dispatch_by_mask(a),
                "%s: args->is_token_in_rank = %p, args->num_tokens_per_expert = %p: must be NULL "
                "(the expert-major layout places rows by topk_idx)",
                fn, (const void *)a->is_token_in_rank, (const void *)a->num_tokens_per_expert);
  EPX_ARG_CHECK(a->num_worst_tokens == 0,
                "%s: args->num_worst_tokens = %d: must be 0 (worst-case rows are for "
                "epx_dispatch's layout)",
                fn, a->num_worst_tokens);
  return EPX_OK;
}

static const char kDispatchFn[] = "epx_dispatch_expand";

int epx__expand_fan_out_blocks(int device_sms, int num_sms, int num_ranks, int top_k,
                               int64_t want) {
  const int room = device_sms - num_sms;
  if (want > 0) return want > room ? room : (int)want;
  /* Too few fan-out blocks fall behind the landing rows; too many slow the transfer itself (their
   * polls and copies share L2 and HBM with it). Measured on 4x H200 at num_sms 24 (59cefd9,
   * epx_bench --rows normal, `epx dispatch expand during` median us against about 234 and 519
   * for the plain dispatch): EP2, 48 / 56 / 64 / 72 / 80 / 88 / 108 blocks: 262 / 259 / 257 /
   * 257 / 260 / 263 / 262; EP4, 24 / 32 / 40 / 48 / 56 / 72 / 108: 572 / 557 / 524 / 512 / 518 /
   * 527 / 534. The best count follows the copies per received token, d = the token's rows on a
   * rank beyond the first, under uniform routing: K / R experts on a rank it goes to, over the
   * chance 1 - (1 - 1/R)^K that it goes there, less one (EP2 3.0, EP4 1.2, EP8 0.5). The line
   * num_sms x (1.5 + 0.42 d) passes both optima (66 and 48 blocks); other SM counts and EP8 are
   * not measured. */
  const double p = 1.0 - pow(1.0 - 1.0 / num_ranks, top_k);
  const double d = p > 0 ? (double)top_k / num_ranks / p - 1.0 : 0.0;
  const long blocks = lround(num_sms * (1.5 + 0.42 * d));
  return blocks < 1 ? 1 : blocks > room ? room : (int)blocks;
}

int epx__expand_alone_fan_out(int64_t asked, int config_fan_out, int num_sms, int device_sms) {
  const int mode = asked == EPX_EXPAND_FAN_OUT_AFTER || asked == EPX_EXPAND_FAN_OUT_DURING
                       ? (int)asked
                       : config_fan_out;
  return mode == EPX_EXPAND_FAN_OUT_DURING && 2 * num_sms <= device_sms ? EPX_EXPAND_FAN_OUT_DURING
                                                                        : EPX_EXPAND_FAN_OUT_AFTER;
}

int epx__expand_publish_batch(int64_t want) {
  return want < 1 ? 1 : want > 32 ? 32 : (int)want;
}

/* An expert-major dispatch with more tokens than the group holds, refused on this rank while its
 * peers may have started theirs: as epx_dispatch's (normal.c), the refused count exchange fails
 * every rank's call at once and the empty dispatch kernel (its sending blocks only: they alone
 * signal) keeps the completion counters in step. */
static epx_status_t tell_peers_refused(epx_group_t g, epx_handle_t h,
                                       epx_dispatch_expand_result_t *out, cudaStream_t stream) {
  epx__kernel_ctx_t ctx;
  epx__group_kernel_ctx(g, &ctx);
  EPX_CHECK(epx__handle_enqueue_refusal(g, h, 1, &ctx, stream));
  epx__expand_dispatch_launch_args_t xa;
  memset(&xa, 0, sizeof xa);
  xa.d.routing = epx__handle_routing(h);
  xa.d.hidden = g->config.hidden;
  xa.d.top_k = g->config.top_k;
  xa.d.num_experts = g->config.num_experts;
  xa.d.num_blocks = g->config.num_sms;
  xa.expand_pos = h->expand_pos;
  xa.publish_batch = 1;
  EPX_CHECK(epx__expand_dispatch_launch(&ctx, &xa, stream));
  fill_result(g, h, &xa.d, -1, -1, out); /* as a failed count exchange leaves it */
  return EPX_OK;
}

static epx_status_t refuse_for_all(epx_group_t g, epx_handle_t h, epx_dispatch_expand_result_t *out,
                                   cudaStream_t stream, epx_status_t refused) {
  if (epx__stream_is_capturing(stream)) return refused; /* nothing would run now */
  char why[768];
  snprintf(why, sizeof why, "%s", epx_last_error());
  return epx__handle_refused(refused, why, tell_peers_refused(g, h, out, stream));
}

epx_status_t epx__dispatch_expand_enqueue(epx_group_t g, epx_handle_t h,
                                          const epx_dispatch_args_t *a,
                                          epx_dispatch_expand_result_t *out, cudaStream_t stream,
                                          int local_blocks, int fan_out,
                                          epx__expand_pending_t *pending) {
  const char *fn = kDispatchFn;
  memset(pending, 0, sizeof *pending);
  EPX_CHECK(epx__dispatch_check_call(g, h, fn, a, out));
  EPX_CHECK(check_expand_args(g, fn, a));
  epx__dispatch_launch_args_t d;
  const epx_status_t checked = epx__dispatch_check_inputs(g, fn, a, stream, &d);
  if (checked != EPX_OK)
    return a->num_tokens > g->config.max_tokens_per_rank
               ? refuse_for_all(g, h, out, stream, checked)
               : checked;

  epx__kernel_ctx_t ctx;
  epx__group_kernel_ctx(g, &ctx);
  h->num_tokens = a->num_tokens;
  h->recv_topk_idx_int64 = 0;
  h->num_worst_tokens = 0;
  h->expand = 0; /* until everything is queued */

  epx_layout_args_t la = epx__handle_layout_args(h, a);
  EPX_CHECK(epx__layout_expand_enqueue(g, &la, h->expand_pos, stream));
  EPX_CHECK(epx__handle_enqueue_notify(g, h, a, 1, &ctx, stream));
  epx__expand_dispatch_launch_args_t xa;
  memset(&xa, 0, sizeof xa);
  xa.d = d;
  xa.d.routing = epx__handle_routing(h);
  xa.d.hidden = g->config.hidden;
  xa.d.top_k = g->config.top_k;
  xa.d.num_experts = g->config.num_experts;
  xa.d.num_blocks = g->config.num_sms;
  xa.d.topk_idx = a->topk_idx;
  xa.d.idx_is_int64 = a->topk_idx_dtype == EPX_DTYPE_INT64;
  xa.d.topk_weights = a->topk_weights;
  xa.expand_pos = h->expand_pos;
  /* The payload comes once per (token, rank); the fan-out copies it to the token's other rows:
   * local HBM traffic instead of NVLink's. AFTER: a kernel after the dispatch (every SM, two
   * blocks each). DURING: more blocks of the dispatch kernel, as rows land, as many as
   * epx__expand_fan_out_blocks says (too few fall behind the landing rows, too many slow the
   * transfer; docs/moe.md, "Fan-out DURING"). Group creation checked that 2 x num_sms blocks
   * fit for either DURING a caller may pass: the config's and the group's alone_fan_out. */
  if (fan_out == 0) fan_out = g->config.expand_fan_out;
  if (fan_out == EPX_EXPAND_FAN_OUT_DURING)
    xa.fan_out_blocks =
        epx__expand_fan_out_blocks(g->num_device_sms, g->config.num_sms, g->num_ranks,
                                   g->config.top_k, epx__param_ExpandFanOutBlocks());
  xa.publish_batch = epx__expand_publish_batch(epx__param_ExpandPublishBatch());
  EPX_CHECK(epx__expand_dispatch_launch(&ctx, &xa, stream));
  if (xa.fan_out_blocks == 0) { /* AFTER: the fan-out is a kernel of its own */
    const epx__expand_fan_out_launch_args_t fa = {
        h->meta,
        g->config.top_k,
        g->config.hidden * (d.x_is_fp8 ? 1 : 2),
        d.x_is_fp8 ? d.scale_cols : 0,
        local_blocks > 0 ? local_blocks : 2 * g->num_device_sms,
        g->config.num_experts / g->num_ranks};
    EPX_CHECK(epx__expand_fan_out_launch(&ctx, &fa, stream));
  }
  h->expand = 1;
  pending->d = d;
  pending->sync_counts = a->sync_counts;
  pending->num_recv_per_expert = a->num_recv_per_expert;
  return EPX_OK;
}

epx_status_t epx__dispatch_expand_finish(epx_group_t g, epx_handle_t h,
                                         const epx__expand_pending_t *pending,
                                         epx_dispatch_expand_result_t *out) {
  const char *fn = kDispatchFn;
  const int L = g->config.num_experts / g->num_ranks;
  int num_recv = -1, num_rows = -1;
  if (pending->sync_counts) {
    /* The one host synchronization: wait for the count exchange, not for the data. */
    epx_async_error_t err;
    int timed_out = 0;
    EPX_CHECK(epx__handle_wait_counts(g, h, &timed_out, &err));
    if (timed_out) {
      fill_result(g, h, &pending->d, -1, -1, out);
      return epx__set_error(EPX_ERR_TIMEOUT,
                            "%s: %s; the receive counts are unknown (result->num_rows = -1); see "
                            "epx_group_get_async_error",
                            fn, err.message);
    }
    const volatile int *hc = (const volatile int *)h->host_counts;
    num_recv = hc[0];
    num_rows = hc[1 + L];
    if (pending->num_recv_per_expert)
      for (int j = 0; j < L; j++) pending->num_recv_per_expert[j] = hc[1 + j];
  }
  fill_result(g, h, &pending->d, num_recv, num_rows, out);
  if (num_rows > (int)g->layout.expand_rows)
    return epx__set_error(EPX_ERR_INVALID_ARGUMENT,
                          "%s: this rank receives %d expert-major rows (padding included), "
                          "config.expand_max_rows = %zu; the rows past it were not written",
                          fn, num_rows, g->layout.expand_rows);
  return EPX_OK;
}

EPX_EXPORT epx_status_t epx_dispatch_expand(epx_group_t g, epx_handle_t h,
                                            const epx_dispatch_args_t *a,
                                            epx_dispatch_expand_result_t *out,
                                            cudaStream_t stream) {
  epx__expand_pending_t pending;
  EPX_CHECK(epx__dispatch_expand_enqueue(g, h, a, out, stream, 0, 0, &pending));
  return epx__dispatch_expand_finish(g, h, &pending, out);
}

EPX_EXPORT epx_status_t epx_combine_expand(epx_group_t g, epx_handle_t h,
                                           const epx_combine_expand_args_t *a,
                                           cudaStream_t stream) {
  return epx__combine_expand_blocked(g, h, a, 0, 0, 0, 0, stream);
}

/* The checks every expert-major combine makes before anything is queued. */
static epx_status_t check_combine_expand(const char *fn, epx_group_t g, epx_handle_t h,
                                         const epx_combine_expand_args_t *a) {
  EPX_CHECK(epx__handle_check(g, h));
  EPX_CHECK(epx__check_not_null(fn, "args", a));
  EPX_CHECK(epx__check_struct_size(fn, "args", a->size, sizeof(epx_combine_expand_args_t),
                                   "EPX_COMBINE_EXPAND_ARGS_INIT"));
  if (!h->expand)
    return epx__set_error(EPX_ERR_INVALID_USAGE,
                          "%s: the handle's last dispatch was not an epx_dispatch_expand", fn);
  EPX_CHECK(epx__group_check_combine_in_step(g, fn));
  /* The rows may be 0 on this rank, but the pointer must still be valid memory. */
  EPX_CHECK(epx__check_device_ptr(fn, "args->x", a->x, 16));
  if (h->num_tokens > 0) EPX_CHECK(epx__check_device_ptr(fn, "args->out", a->out, 16));
  return epx__check_flag(fn, "args->weighted", a->weighted);
}

/* The partial rows go where epx_dispatch's received rows would be (BF16: the group has it). */
static void *partial_rows(epx_group_t g) {
  return g->workspace + g->layout.normal_offset + g->layout.recv_x_offset;
}

/* The expert-side reduce's launch: every received token (source < 0) or one source's. The reduce
 * is local HBM traffic: alone on the GPU, every SM, two blocks each. At config.num_sms blocks
 * (24) it was latency-bound: 1.58 ms of the 2.10 ms combine at EP4, 4096 tokens, H 7168 (bench,
 * 98d7421), against about 0.05 ms of bytes. Beside GEMMs the caller passes fewer (local_blocks). */
static epx__expand_reduce_launch_args_t reduce_args(epx_group_t g, epx_handle_t h, const void *y,
                                                    int weighted, int block_rows, int local_blocks,
                                                    int source) {
  epx__expand_reduce_launch_args_t ra;
  memset(&ra, 0, sizeof ra);
  ra.meta = h->meta;
  ra.x = y;
  ra.partial = partial_rows(g);
  ra.weighted = weighted;
  ra.hidden = g->config.hidden;
  ra.top_k = g->config.top_k;
  ra.num_blocks = local_blocks > 0 ? local_blocks : 2 * g->num_device_sms;
  ra.block_rows = block_rows;
  ra.num_local_experts = g->config.num_experts / g->num_ranks;
  ra.one_source = source >= 0;
  ra.source = source >= 0 ? source : 0;
  return ra;
}

/* The normal combine of the partial rows, unweighted, on num_blocks blocks (0: num_sms). */
static epx__combine_launch_args_t combine_args(epx_group_t g, epx_handle_t h, void *out,
                                               int rows_invalid, int num_blocks) {
  epx__combine_launch_args_t c;
  memset(&c, 0, sizeof c);
  c.routing = epx__handle_routing(h);
  c.x = partial_rows(g);
  c.idx_is_int64 = 1;
  c.out = out;
  c.hidden = g->config.hidden;
  c.top_k = g->config.top_k;
  c.num_experts = g->config.num_experts;
  c.max_tokens = g->config.max_tokens_per_rank;
  c.num_blocks = num_blocks > 0 ? num_blocks : g->config.num_sms;
  c.rows_invalid = rows_invalid;
  return c;
}

epx_status_t epx__combine_expand_blocked(epx_group_t g, epx_handle_t h,
                                         const epx_combine_expand_args_t *a, int block_rows,
                                         int local_blocks, int rows_invalid, int combine_blocks,
                                         cudaStream_t stream) {
  static const char fn[] = "epx_combine_expand";
  EPX_CHECK(check_combine_expand(fn, g, h, a));
  epx__kernel_ctx_t ctx;
  epx__group_kernel_ctx(g, &ctx);
  const epx__expand_reduce_launch_args_t ra =
      reduce_args(g, h, a->x, a->weighted, block_rows, local_blocks, -1);
  /* Past here the peers wait for this combine: a failed reduce still sends, its rows marked */
  const epx_status_t reduced = epx__expand_reduce_launch(&ctx, &ra, stream);
  const epx__combine_launch_args_t c =
      combine_args(g, h, a->out, rows_invalid || reduced != EPX_OK, combine_blocks);
  char reduce_failure[256] = "";
  if (reduced != EPX_OK) snprintf(reduce_failure, sizeof reduce_failure, "%s", epx_last_error());
  const epx_status_t combined = epx__combine_launch(&ctx, &c, NULL, stream);
  if (reduced == EPX_OK) return combined;
  /* the reduce's failure is the one returned, with its message (the combine's may be newer) */
  return combined == EPX_OK ? reduced : epx__set_error(reduced, "%s", reduce_failure);
}

/* A gated combine (rows_sent: the rows are in the peers' slabs of `parity` already). */
static epx_status_t launch_gated(epx_group_t g, epx_handle_t h, const epx_combine_expand_args_t *a,
                                 const unsigned *gate, unsigned gate_value, int rows_sent,
                                 unsigned parity, int rows_invalid, int num_blocks,
                                 cudaStream_t stream) {
  static const char fn[] = "epx_combine_expand";
  EPX_CHECK(check_combine_expand(fn, g, h, a));
  epx__kernel_ctx_t ctx;
  epx__group_kernel_ctx(g, &ctx);
  epx__combine_launch_args_t c = combine_args(g, h, a->out, rows_invalid, num_blocks);
  c.gate = gate;
  c.gate_value = gate_value;
  c.rows_sent = rows_sent;
  c.rows_sent_parity = parity > 1u ? 2u : parity;
  return epx__combine_launch(&ctx, &c, NULL, stream);
}

epx_status_t epx__combine_expand_gated(epx_group_t g, epx_handle_t h,
                                       const epx_combine_expand_args_t *a, const unsigned *gate,
                                       unsigned gate_value, int num_blocks, cudaStream_t stream) {
  return launch_gated(g, h, a, gate, gate_value, 0, 0, 0, num_blocks, stream);
}

epx_status_t epx__combine_expand_sent(epx_group_t g, epx_handle_t h,
                                      const epx_combine_expand_args_t *a, const unsigned *gate,
                                      unsigned gate_value, unsigned parity, int rows_invalid,
                                      int num_blocks, cudaStream_t stream) {
  return launch_gated(g, h, a, gate, gate_value, 1, parity, rows_invalid, num_blocks, stream);
}

epx_status_t epx__combine_copy_rows(epx_group_t g, int source, int first, int rows, unsigned parity,
                                    cudaStream_t stream) {
  if (rows <= 0) return EPX_OK;
  if (rows > g->config.max_tokens_per_rank || first < 0)
    return epx__set_error(EPX_ERR_INTERNAL,
                          "epx__combine_copy_rows: rows [%d, %d + %d) of source %d do not fit its "
                          "slab (max_tokens_per_rank %d)",
                          first, first, rows, source, g->config.max_tokens_per_rank);
  const epx__ws_layout_t *l = &g->layout;
  const size_t row_bytes = (size_t)g->config.hidden * 2;
  const char *src = (const char *)partial_rows(g) + (size_t)first * row_bytes;
  char *dst = g->peer_base[source] + l->normal_offset + l->combine_slab_offset +
              (parity & 1u) * l->combine_slab_bytes +
              (size_t)g->rank * g->config.max_tokens_per_rank * row_bytes;
  CUDA_CHECK(cudaMemcpyAsync(dst, src, (size_t)rows * row_bytes, cudaMemcpyDeviceToDevice, stream));
  return EPX_OK;
}

epx_status_t epx__expand_reduce_source(epx_group_t g, epx_handle_t h, const void *y, int weighted,
                                       int source, const int *parts, const int *part_out,
                                       int local_blocks, cudaStream_t stream) {
  epx__kernel_ctx_t ctx;
  epx__group_kernel_ctx(g, &ctx);
  epx__expand_reduce_launch_args_t ra = reduce_args(g, h, y, weighted, 0, local_blocks, source);
  ra.parts = parts;
  ra.part_out = part_out;
  ra.num_parts = g->config.num_experts; /* L x R */
  return epx__expand_reduce_launch(&ctx, &ra, stream);
}

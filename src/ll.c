/*
 * ll.c - the host side of low-latency mode: epx_ll_dispatch, epx_ll_combine, epx_ll_recv and
 * the peer-mask calls (manual mask, query, collective clear). Checks every argument (nothing is
 * queued when one is refused), keeps the bookkeeping of buffers and split calls (epx__ll_host_t in
 * group.h), then queues the kernels of src/kernels/ll_dispatch.cu and ll_combine.cu on the caller's
 * stream.
 *
 * Buffers: dispatches alternate between the two buffers of the workspace's ll region; a
 * combine uses its dispatch's buffer. A split call leaves its buffer "pending" until its hook
 * is passed to epx_ll_recv; a dispatch or combine that would reuse a pending buffer is refused.
 * Hook ids are (seq << 2) | (kind << 1) | buffer with seq >= 1, so 0 never names a call.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "agree.h"
#include "arg_check.h"
#include "checks.h"
#include "group.h"
#include "kernels/api.h"
#include "ll.h"
#include "registry.h"

enum { KIND_DISPATCH = 0, KIND_COMBINE = 1 };

static unsigned long long hook_id(unsigned long long seq, int kind, int parity) {
  return (seq << 2) | ((unsigned long long)kind << 1) | (unsigned long long)parity;
}

static epx_status_t require_ll(epx_group_t g, const char *fn) {
  if (!(g->config.modes & EPX_MODE_LOW_LATENCY))
    return epx__set_error(EPX_ERR_INVALID_USAGE,
                          "%s: the group was created without EPX_MODE_LOW_LATENCY in config.modes",
                          fn);
  return EPX_OK;
}

static char *ll_buffer(epx_group_t g, int parity) {
  return g->workspace + g->layout.ll_offset + (size_t)parity * g->layout.ll_parity_bytes;
}

static void fill_result(epx_group_t g, int parity, int num_tokens, epx_dtype_t dtype,
                        epx_ll_dispatch_result_t *out) {
  const epx__ws_layout_t *l = &g->layout;
  char *base = ll_buffer(g, parity);
  memset(out, 0, sizeof *out);
  out->num_tokens = num_tokens;
  out->num_local_experts = g->config.num_experts / g->num_ranks;
  out->rows_per_expert = (int)l->ll_rows;
  out->max_tokens_per_rank = g->config.ll_max_tokens_per_rank;
  out->recv_dtype = dtype;
  out->recv_x = base + l->ll_x_offset;
  out->recv_x_scales = dtype == EPX_DTYPE_FP8_E4M3 && !g->ll.dispatch_pack_scales[parity]
                           ? (float *)(base + l->ll_scales_offset)
                           : NULL;
  /* UE8M0 words live where the float32 scales would: ceil(H/512) <= H/128 words per row. */
  out->recv_x_scales_packed =
      g->ll.dispatch_pack_scales[parity] ? (int *)(base + l->ll_scales_offset) : NULL;
  out->packed = g->ll.dispatch_packed[parity];
  out->recv_src_info = (int *)(base + l->ll_src_info_offset);
  out->recv_count = (int *)(base + l->ll_recv_count_offset);
  out->recv_begin = (int *)(base + l->ll_recv_begin_offset);
  out->recv_num = (int *)(base + l->ll_recv_num_offset);
  out->combine_input = base + l->ll_combine_in_offset;
  out->buffer = parity;
}

static epx__ll_dispatch_launch_args_t dispatch_launch_args(epx_group_t g, int parity, int fp8,
                                                           int phases) {
  epx__ll_dispatch_launch_args_t d;
  memset(&d, 0, sizeof d);
  d.idx_is_int64 = 1;
  d.num_tokens = g->ll.dispatch_tokens[parity];
  d.hidden = g->config.hidden;
  d.top_k = g->config.top_k;
  d.num_experts = g->config.num_experts;
  d.max_tokens = g->config.ll_max_tokens_per_rank;
  d.fp8 = fp8;
  d.by_rank = g->config.ll_route == EPX_LL_ROUTE_BY_RANK ||
              g->config.ll_route == EPX_LL_ROUTE_DISPATCH_BY_RANK;
  d.parity = parity;
  d.phases = phases;
  d.num_blocks = g->config.ll_num_sms;
  d.packed = g->ll.dispatch_packed[parity];
  d.pack_scales = g->ll.dispatch_pack_scales[parity];
  d.layout_range = g->ll.layout_range[parity];
  return d;
}

/* weights: combine-time topk_weights or NULL. With them route BY_RANK runs the DIRECT combine:
 * the expert side cannot apply weights it does not have, and both dispatch routes leave what the
 * DIRECT combine reads (every received row's src_info, and the returned-rows area). */
static epx__ll_combine_launch_args_t combine_launch_args(epx_group_t g, int parity, const void *x,
                                                         void *out, const float *weights,
                                                         int phases) {
  epx__ll_combine_launch_args_t c;
  memset(&c, 0, sizeof c);
  c.x = x;
  c.out = out;
  c.topk_weights = weights;
  c.num_tokens = g->ll.dispatch_tokens[parity];
  c.hidden = g->config.hidden;
  c.top_k = g->config.top_k;
  c.num_experts = g->config.num_experts;
  c.max_tokens = g->config.ll_max_tokens_per_rank;
  c.by_rank = !epx__ll_combine_is_direct(g) && weights == NULL;
  c.parity = parity;
  c.phases = phases;
  c.num_blocks = g->config.ll_num_sms;
  c.packed = g->ll.dispatch_packed[parity];
  return c;
}

/* The packed-layout options of a dispatch (docs/low-latency.md, "Packed layout"). */
static epx_status_t check_packed_args(epx_group_t g, const char *fn,
                                      const epx_ll_dispatch_args_t *a) {
  EPX_CHECK(epx__check_flag(fn, "args->packed", a->packed));
  EPX_CHECK(epx__check_flag(fn, "args->ue8m0_packed", a->ue8m0_packed));
  EPX_ARG_CHECK(!a->ue8m0_packed || a->ue8m0,
                "%s: args->ue8m0_packed = 1: needs args->ue8m0 = 1 (power-of-two FP8 scales)", fn);
  if (a->packed && g->config.ll_route == EPX_LL_ROUTE_DIRECT)
    return epx__set_error(
        EPX_ERR_UNSUPPORTED,
        "%s: args->packed = 1: the group's ll_route is EPX_LL_ROUTE_DIRECT, whose "
        "senders write final rows without knowing the other sources' counts; "
        "use EPX_LL_ROUTE_BY_RANK or EPX_LL_ROUTE_DISPATCH_BY_RANK (the default)",
        fn);
  EPX_ARG_CHECK(!a->layout_range || a->packed,
                "%s: args->layout_range is set: needs args->packed = 1", fn);
  if (a->layout_range)
    EPX_CHECK(epx__check_device_ptr(fn, "args->layout_range", a->layout_range, 8));
  return EPX_OK;
}

EPX_EXPORT epx_status_t epx_ll_dispatch(epx_group_t g, const epx_ll_dispatch_args_t *a,
                                        epx_ll_dispatch_result_t *out, cudaStream_t stream) {
  static const char fn[] = "epx_ll_dispatch";
  EPX_CHECK(epx__group_check(g));
  EPX_CHECK(epx__check_not_null(fn, "args", a));
  EPX_CHECK(epx__check_not_null(fn, "result", out));
  EPX_CHECK(require_ll(g, fn));
  EPX_CHECK(epx__check_struct_size(fn, "args", a->size, sizeof(epx_ll_dispatch_args_t),
                                   "EPX_LL_DISPATCH_ARGS_INIT"));
  EPX_ARG_CHECK(a->num_tokens >= 0 && a->num_tokens <= g->config.ll_max_tokens_per_rank,
                "%s: args->num_tokens = %d: must be in [0, ll_max_tokens_per_rank = %d]", fn,
                a->num_tokens, g->config.ll_max_tokens_per_rank);
  EPX_CHECK(epx__check_index_dtype(fn, "args->topk_idx_dtype", a->topk_idx_dtype));
  EPX_ARG_CHECK(a->recv_dtype == EPX_DTYPE_BF16 || a->recv_dtype == EPX_DTYPE_FP8_E4M3,
                "%s: args->recv_dtype = %d: must be EPX_DTYPE_BF16 or EPX_DTYPE_FP8_E4M3", fn,
                (int)a->recv_dtype);
  EPX_ARG_CHECK(g->config.dtypes & a->recv_dtype,
                "%s: args->recv_dtype = %s: must be one the group was created with (config.dtypes "
                "= 0x%x)",
                fn, a->recv_dtype == EPX_DTYPE_BF16 ? "BF16" : "FP8_E4M3", g->config.dtypes);
  EPX_CHECK(epx__check_flag(fn, "args->ue8m0", a->ue8m0));
  EPX_ARG_CHECK(!a->ue8m0 || a->recv_dtype == EPX_DTYPE_FP8_E4M3,
                "%s: args->ue8m0 = 1: needs args->recv_dtype = EPX_DTYPE_FP8_E4M3", fn);
  EPX_CHECK(epx__check_flag(fn, "args->split", a->split));
  EPX_CHECK(check_packed_args(g, fn, a));
  if (a->num_tokens > 0) {
    EPX_CHECK(epx__check_device_ptr(fn, "args->x", a->x, 16));
    EPX_CHECK(epx__check_device_ptr(fn, "args->topk_idx", a->topk_idx,
                                    epx__index_bytes(a->topk_idx_dtype)));
    if (a->topk_weights)
      EPX_CHECK(epx__check_device_ptr(fn, "args->topk_weights", a->topk_weights, 4));
  }
  const int parity = g->ll.next_parity;
  if (g->ll.pending[KIND_DISPATCH][parity] || g->ll.pending[KIND_COMBINE][parity])
    return epx__set_error(EPX_ERR_INVALID_USAGE,
                          "%s: buffer %d, which this dispatch would reuse, still has a split %s "
                          "waiting for epx_ll_recv",
                          fn, parity,
                          g->ll.pending[KIND_DISPATCH][parity] ? "dispatch" : "combine");

  const int fp8 = a->recv_dtype == EPX_DTYPE_FP8_E4M3;
  epx__ll_dispatch_launch_args_t d = dispatch_launch_args(
      g, parity, fp8, a->split ? EPX_LL_PHASE_SEND : EPX_LL_PHASE_SEND | EPX_LL_PHASE_RECV);
  d.num_tokens = a->num_tokens;
  d.x = a->x;
  d.topk_idx = a->topk_idx;
  d.idx_is_int64 = a->topk_idx_dtype == EPX_DTYPE_INT64;
  d.topk_weights = a->topk_weights;
  d.ue8m0 = a->ue8m0;
  d.packed = a->packed;
  d.pack_scales = a->ue8m0_packed;
  d.layout_range = a->layout_range;
  epx__kernel_ctx_t ctx;
  epx__group_kernel_ctx(g, &ctx);
  EPX_CHECK(epx__ll_dispatch_launch(&ctx, &d, stream));
  /* Only a queued dispatch owns the buffer: a failed launch leaves the previous call's state. */
  g->ll.dispatch_tokens[parity] = a->num_tokens;
  g->ll.dispatch_packed[parity] = a->packed; /* for its receive, combine and result */
  g->ll.dispatch_pack_scales[parity] = a->ue8m0_packed;
  g->ll.layout_range[parity] = a->layout_range;

  const unsigned long long seq = ++g->ll.seq;
  g->ll.dispatch_id[parity] = seq;
  g->ll.dispatch_fp8[parity] = fp8;
  g->ll.next_parity = parity ^ 1;
  fill_result(g, parity, a->num_tokens, a->recv_dtype, out);
  out->call_id = seq;
  if (a->split) {
    out->hook.id = hook_id(seq, KIND_DISPATCH, parity);
    g->ll.pending[KIND_DISPATCH][parity] = out->hook.id;
  }
  return EPX_OK;
}

/* epx_ll_combine, and epx_moe_decode's combine (ll.h): rows_sent, early. */
epx_status_t epx__ll_combine_enqueue(epx_group_t g, const epx_ll_combine_args_t *a, int rows_sent,
                                     int early, int rows_invalid, cudaStream_t stream) {
  static const char fn[] = "epx_ll_combine";
  EPX_CHECK(epx__group_check(g));
  EPX_CHECK(epx__check_not_null(fn, "args", a));
  EPX_CHECK(require_ll(g, fn));
  EPX_CHECK(epx__check_struct_size(fn, "args", a->size, sizeof(epx_ll_combine_args_t),
                                   "EPX_LL_COMBINE_ARGS_INIT"));
  EPX_CHECK(epx__check_not_null(fn, "args->dispatch", a->dispatch));
  const epx_ll_dispatch_result_t *d = a->dispatch;
  EPX_ARG_CHECK(d->buffer == 0 || d->buffer == 1,
                "%s: args->dispatch->buffer = %d: not a dispatch result of this group", fn,
                d->buffer);
  const int parity = d->buffer;
  if (d->call_id == 0 || d->call_id != g->ll.dispatch_id[parity])
    return epx__set_error(EPX_ERR_INVALID_USAGE,
                          "%s: args->dispatch (call %llu) is not one of the two latest dispatches "
                          "of this group: its buffer %d has been reused (or it is from another "
                          "group)",
                          fn, d->call_id, parity);
  if (g->ll.pending[KIND_DISPATCH][parity])
    return epx__set_error(EPX_ERR_INVALID_USAGE,
                          "%s: the receive of args->dispatch is still pending; call "
                          "epx_ll_recv(&result->hook) first",
                          fn);
  if (g->ll.pending[KIND_COMBINE][parity])
    return epx__set_error(EPX_ERR_INVALID_USAGE,
                          "%s: a split combine of args->dispatch still waits for epx_ll_recv", fn);
  EPX_CHECK(epx__check_flag(fn, "args->split", a->split));
  EPX_ARG_CHECK(!a->split || a->hook != NULL, "%s: args->hook is NULL: args->split = 1 needs it",
                fn);
  const int T = g->ll.dispatch_tokens[parity];
  if (T > 0) EPX_CHECK(epx__check_device_ptr(fn, "args->out", a->out, 16));
  if (T > 0 && a->topk_weights)
    EPX_CHECK(epx__check_device_ptr(fn, "args->topk_weights", a->topk_weights, 4));
  const void *x =
      a->x ? a->x : (const void *)(ll_buffer(g, parity) + g->layout.ll_combine_in_offset);
  /* Expert outputs may be 0 rows on this rank, but the pointer must still be device memory. */
  if (a->x) EPX_CHECK(epx__check_device_ptr(fn, "args->x", a->x, 16));

  /* Not dropped when T = 0: the route's combine must be the same on every rank. */
  const float *weights = a->topk_weights;
  epx__ll_combine_launch_args_t c =
      combine_launch_args(g, parity, x, a->out, weights,
                          a->split ? EPX_LL_PHASE_SEND : EPX_LL_PHASE_SEND | EPX_LL_PHASE_RECV);
  if (rows_sent && (c.by_rank || a->split || weights))
    return epx__set_error(EPX_ERR_INTERNAL,
                          "%s: rows sent by the experts need the DIRECT combine, unsplit and "
                          "without combine-time weights",
                          fn);
  c.rows_sent = rows_sent;
  c.early_launch = early;
  c.rows_invalid = rows_invalid;
  epx__kernel_ctx_t ctx;
  epx__group_kernel_ctx(g, &ctx);
  EPX_CHECK(epx__ll_combine_launch(&ctx, &c, stream));
  const unsigned long long seq = ++g->ll.seq;
  if (a->split) {
    a->hook->id = hook_id(seq, KIND_COMBINE, parity);
    g->ll.pending[KIND_COMBINE][parity] = a->hook->id;
    g->ll.combine_out[parity] = a->out;
    g->ll.combine_weights[parity] = weights;
  }
  return EPX_OK;
}

EPX_EXPORT epx_status_t epx_ll_combine(epx_group_t g, const epx_ll_combine_args_t *a,
                                       cudaStream_t stream) {
  return epx__ll_combine_enqueue(g, a, 0, 0, 0, stream);
}

int epx__ll_combine_is_direct(epx_group_t g) {
  return g->config.ll_route != EPX_LL_ROUTE_BY_RANK;
}

void epx__ll_send_targets(epx_group_t g, const epx_ll_dispatch_result_t *d,
                          epx__experts_scatter_t *sc) {
  epx__kernel_ctx_t ctx;
  epx__group_kernel_ctx(g, &ctx);
  memset(sc, 0, sizeof *sc);
  sc->src_info = d->recv_src_info;
  for (int r = 0; r < g->num_ranks; r++)
    sc->recv[r] = ctx.peer_base[r] + g->layout.ll_offset +
                  (size_t)d->buffer * g->layout.ll_parity_bytes + g->layout.ll_combine_recv_offset;
  sc->dead_mask = &epx__group_control(g)->ll_peer_mask;
  sc->num_ranks = g->num_ranks;
  sc->top_k = g->config.top_k;
  sc->max_tokens = g->config.ll_max_tokens_per_rank;
}

EPX_EXPORT epx_status_t epx_ll_recv(epx_group_t g, epx_ll_hook_t *hook, cudaStream_t stream) {
  static const char fn[] = "epx_ll_recv";
  EPX_CHECK(epx__group_check(g));
  EPX_CHECK(epx__check_not_null(fn, "hook", hook));
  EPX_CHECK(require_ll(g, fn));
  const unsigned long long id = hook->id;
  const int kind = (int)((id >> 1) & 1u), parity = (int)(id & 1u);
  if (id == 0 || g->ll.pending[kind][parity] != id)
    return epx__set_error(EPX_ERR_INVALID_USAGE,
                          "%s: hook %llu is not pending on this group (completed already, not "
                          "from a split call, or from another group)",
                          fn, id);
  epx__kernel_ctx_t ctx;
  epx__group_kernel_ctx(g, &ctx);
  if (kind == KIND_DISPATCH) {
    epx__ll_dispatch_launch_args_t d =
        dispatch_launch_args(g, parity, g->ll.dispatch_fp8[parity], EPX_LL_PHASE_RECV);
    EPX_CHECK(epx__ll_dispatch_launch(&ctx, &d, stream));
  } else {
    epx__ll_combine_launch_args_t c =
        combine_launch_args(g, parity, NULL, g->ll.combine_out[parity],
                            g->ll.combine_weights[parity], EPX_LL_PHASE_RECV);
    EPX_CHECK(epx__ll_combine_launch(&ctx, &c, stream));
  }
  g->ll.pending[kind][parity] = 0;
  hook->id = 0;
  return EPX_OK;
}

EPX_EXPORT epx_status_t epx_group_mask_peer(epx_group_t g, int peer, cudaStream_t stream) {
  static const char fn[] = "epx_group_mask_peer";
  EPX_CHECK(epx__group_check(g));
  EPX_CHECK(require_ll(g, fn));
  EPX_ARG_CHECK(peer >= 0 && peer < g->num_ranks, "%s: peer = %d: must be a rank in [0, %d)", fn,
                peer, g->num_ranks);
  EPX_ARG_CHECK(peer != g->rank, "%s: peer = %d: is this rank; a rank cannot mask itself", fn,
                peer);
  epx__kernel_ctx_t ctx;
  epx__group_kernel_ctx(g, &ctx);
  return epx__peer_mask_launch(&ctx, 1u << peer, stream);
}

EPX_EXPORT epx_status_t epx_group_get_peer_mask(epx_group_t g, unsigned int *mask) {
  EPX_CHECK(epx__group_check(g));
  EPX_CHECK(epx__check_not_null("epx_group_get_peer_mask", "mask", mask));
  const epx__control_t *ctrl = epx__group_control(g);
  /* NOTE: a copy on the group's own non-blocking stream: it waits for no caller stream, so a
   * low-latency kernel that is still waiting on a peer does not block the query. */
  unsigned value = 0;
  CUDA_CHECK(cudaMemcpyAsync(&value, &ctrl->ll_peer_mask, sizeof value, cudaMemcpyDeviceToHost,
                             g->setup_stream));
  CUDA_CHECK(cudaStreamSynchronize(g->setup_stream));
  *mask = value;
  return EPX_OK;
}

EPX_EXPORT epx_status_t epx_group_clear_peer_mask(epx_group_t g) {
  EPX_CHECK(epx__group_check(g));
  EPX_CHECK(epx__group_check_collective(g, "epx_group_clear_peer_mask"));
  epx_status_t res = EPX_OK;
  const size_t num_epochs = 2 * 2 * EPX_LL_MAX_BLOCKS;
  uint32_t *host = NULL;
  epx__control_t *ctrl = epx__group_control(g);
  uint32_t *epochs = (uint32_t *)(g->workspace + g->layout.ll_offset + g->layout.ll_epoch_offset);
  const int ll = (g->config.modes & EPX_MODE_LOW_LATENCY) != 0;
  /* 1. Nothing of ours is in flight any more. A local failure here does not return at once:
   *    it is this rank's word in the agreement, so that every rank fails alike and the ranks'
   *    agreement counts stay equal. */
  epx_status_t local = CUDA_STATUS(cudaDeviceSynchronize());
  char local_msg[512];
  host = local == EPX_OK ? (uint32_t *)calloc(num_epochs, sizeof *host) : NULL;
  if (local == EPX_OK && !host)
    local = epx__set_error(EPX_ERR_SYSTEM, "epx_group_clear_peer_mask: out of memory");
  /* 2. The largest epoch any block of any rank has used: after this agreement (which is also
   *    the barrier, bounded: a dead peer makes every rank return EPX_ERR_TIMEOUT with nothing
   *    cleared) every rank restarts from it, so no signal or header of the failed period can
   *    carry the epoch of a new call. */
  /*    The unmasked barriers' count too: epx_group_barrier_unmasked advanced the live ranks'
   *    past a masked rank's, whose next one would otherwise wait for epochs the others passed
   *    long ago (the ordinary barrier counts apart and stays in step). */
  uint32_t largest = 0;
  unsigned long long barriers = 0;
  if (local == EPX_OK)
    local = CUDA_STATUS(cudaMemcpyAsync(&barriers, &ctrl->unmasked_barrier_epoch, sizeof barriers,
                                        cudaMemcpyDeviceToHost, g->setup_stream));
  if (ll && local == EPX_OK)
    local = CUDA_STATUS(cudaMemcpyAsync(host, epochs, num_epochs * sizeof *host,
                                        cudaMemcpyDeviceToHost, g->setup_stream));
  if (local == EPX_OK) local = CUDA_STATUS(cudaStreamSynchronize(g->setup_stream));
  for (size_t i = 0; ll && local == EPX_OK && i < num_epochs; i++)
    if (host[i] > largest) largest = host[i];
  snprintf(local_msg, sizeof local_msg, "%s", epx_last_error());
  {
    long long all[2 * EPX_MAX_RANKS];
    const long long mine[2] = {local == EPX_OK ? (long long)largest : -1, (long long)barriers};
    EPX_CHECK_GOTO(
        epx__agree_group(g, g->setup_stream, mine, 2, all, "epx_group_clear_peer_mask", 0, NULL),
        res, exit);
    for (int q = 0; q < g->num_ranks; q++)
      if ((unsigned long long)all[2 * q + 1] > barriers)
        barriers = (unsigned long long)all[2 * q + 1];
    for (int q = 0; q < g->num_ranks; q++) {
      if (all[2 * q] < 0) {
        res = q == g->rank ? epx__set_error(local, "%s", local_msg)
                           : epx__set_error(EPX_ERR_INVALID_USAGE,
                                            "epx_group_clear_peer_mask: rank %d failed its local "
                                            "steps (see its log); nothing was cleared",
                                            q);
        goto exit;
      }
      if ((uint32_t)all[2 * q] > largest) largest = (uint32_t)all[2 * q];
    }
  }
  /* 3. Every epoch of this rank to that value, the mask to 0, the bookkeeping to its start. */
  if (ll) {
    for (size_t i = 0; i < num_epochs; i++) host[i] = largest;
    CUDA_CHECK_GOTO(cudaMemcpyAsync(epochs, host, num_epochs * sizeof *host, cudaMemcpyHostToDevice,
                                    g->setup_stream),
                    res, exit);
  }
  CUDA_CHECK_GOTO(
      cudaMemsetAsync(&ctrl->ll_peer_mask, 0, sizeof ctrl->ll_peer_mask, g->setup_stream), res,
      exit);
  /* (barriers lives on the host until the copy has run: the synchronization below) */
  CUDA_CHECK_GOTO(cudaMemcpyAsync(&ctrl->unmasked_barrier_epoch, &barriers, sizeof barriers,
                                  cudaMemcpyHostToDevice, g->setup_stream),
                  res, exit);
  CUDA_CHECK_GOTO(cudaStreamSynchronize(g->setup_stream), res, exit);
  {
    const unsigned long long seq = g->ll.seq; /* call ids stay unique: old results are refused */
    memset(&g->ll, 0, sizeof g->ll);
    g->ll.seq = seq;
  }
exit:
  free(host);
  return res;
}

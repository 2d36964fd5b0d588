/*
 * moe.c - epx_moe_decode: one MoE layer at decode size on a low-latency group, as three
 * stream-ordered steps (docs/moe.md):
 *   epx_ll_dispatch (packed layout, the tokens' weights)  ->  epx_experts_ffn (masked layout)
 *   ->  epx_ll_combine.
 * With a DIRECT combine (route DISPATCH_BY_RANK, the default) the down projection sends each
 * tile it finishes straight to its tokens' receive rows on the source ranks, so the combine's
 * send overlaps the experts still computing and the combine kernel only signals and sums;
 * route BY_RANK (expert-side sums) writes the dispatch's combine buffer and sends it after.
 *
 * Invariant: everything a step could refuse is checked before the dispatch is queued, from
 * arguments every rank passes alike for the group's shape; once the dispatch is queued its
 * combine is always queued too, so no peer is left waiting for this rank's rows.
 */
#include <stdio.h>
#include <string.h>

#include "arg_check.h"
#include "checks.h"
#include "experts.h"
#include "group.h"
#include "ll.h"
#include "moe_test_hooks.h"
#include "param.h"
#include "registry.h"

#define WS_ALIGN 256

/* The group's low-latency mode and the experts' fit with it; *rows = the rows a dispatch can
 * deliver (L x R x M), the FFN's row count. */
static epx_status_t check_layer(const char *fn, epx_group_t g, const epx_experts_t *w,
                                epx_dtype_t dispatch_dtype, int *rows) {
  EPX_CHECK(epx__group_check(g));
  if (!(g->config.modes & EPX_MODE_LOW_LATENCY))
    return epx__set_error(EPX_ERR_INVALID_USAGE,
                          "%s: the group was created without EPX_MODE_LOW_LATENCY in config.modes",
                          fn);
  EPX_ARG_CHECK(dispatch_dtype == EPX_DTYPE_BF16 || dispatch_dtype == EPX_DTYPE_FP8_E4M3,
                "%s: dispatch_dtype = %d: must be EPX_DTYPE_BF16 or EPX_DTYPE_FP8_E4M3", fn,
                (int)dispatch_dtype);
  EPX_CHECK(epx__experts_check(fn, w, dispatch_dtype));
  const int L = g->config.num_experts / g->num_ranks;
  EPX_CHECK(epx__experts_check_share(fn, w, L, g->config.hidden));
  if (g->config.ll_route == EPX_LL_ROUTE_DIRECT)
    return epx__set_error(EPX_ERR_UNSUPPORTED,
                          "%s: the group's ll_route is EPX_LL_ROUTE_DIRECT, which has no packed "
                          "layout; the layer needs BY_RANK or DISPATCH_BY_RANK (the default)",
                          fn);
  const size_t total = (size_t)L * g->layout.ll_rows;
  if (total > (size_t)(1 << 30))
    return epx__set_error(EPX_ERR_UNSUPPORTED,
                          "%s: %zu receive rows (local experts x ranks x ll_max_tokens_per_rank): "
                          "at most 2^30",
                          fn, total);
  *rows = (int)total;
  return EPX_OK;
}

EPX_EXPORT epx_status_t epx_moe_workspace_size(epx_group_t g, const epx_experts_t *experts,
                                               epx_dtype_t dispatch_dtype, size_t *bytes) {
  static const char fn[] = "epx_moe_workspace_size";
  int rows = 0;
  EPX_CHECK(check_layer(fn, g, experts, dispatch_dtype, &rows));
  EPX_CHECK(epx__check_not_null(fn, "bytes", bytes));
  return epx_experts_ffn_workspace_size(experts, rows, dispatch_dtype, bytes);
}

int epx__moe_test_fail_decode_ffn = 0;

EPX_EXPORT epx_status_t epx_moe_decode(epx_group_t g, const epx_experts_t *experts,
                                       const epx_moe_args_t *a, cudaStream_t stream) {
  static const char fn[] = "epx_moe_decode";
  EPX_CHECK(epx__check_not_null(fn, "args", a));
  EPX_CHECK(
      epx__check_struct_size(fn, "args", a->size, sizeof(epx_moe_args_t), "EPX_MOE_ARGS_INIT"));
  int rows = 0;
  EPX_CHECK(check_layer(fn, g, experts, a->dispatch_dtype, &rows));
  size_t need = 0;
  EPX_CHECK(epx_experts_ffn_workspace_size(experts, rows, a->dispatch_dtype, &need));
  EPX_CHECK(epx__check_device_ptr(fn, "args->workspace", a->workspace, WS_ALIGN));
  EPX_ARG_CHECK(a->workspace_bytes >= need,
                "%s: args->workspace_bytes = %zu: must be at least %zu (epx_moe_workspace_size)",
                fn, a->workspace_bytes, need);
  if (a->num_tokens > 0) EPX_CHECK(epx__check_device_ptr(fn, "args->out", a->out, 16));

  /* 1. Dispatch: checks its own arguments (x, ids, weights, token count, a pending split on the
   * buffer) before it queues anything. */
  epx_ll_dispatch_args_t d = EPX_LL_DISPATCH_ARGS_INIT;
  d.x = a->x;
  d.topk_idx = a->topk_idx;
  d.topk_idx_dtype = a->topk_idx_dtype;
  d.topk_weights = a->topk_weights; /* applied where the route sums: no combine-time weights */
  d.num_tokens = a->num_tokens;
  d.recv_dtype = a->dispatch_dtype;
  d.packed = 1; /* expert j's rows from row 0: the FFN's masked layout */
  epx_ll_dispatch_result_t res;
  EPX_CHECK(epx_ll_dispatch(g, &d, &res, stream));

  /* 2. The local experts on every row the dispatch can deliver; each expert's count is read on
   * the device, so only received rows are computed. */
  epx_experts_ffn_args_t f = EPX_EXPERTS_FFN_ARGS_INIT;
  f.x = res.recv_x;
  f.x_dtype = a->dispatch_dtype;
  f.x_scales = res.recv_x_scales;
  f.num_rows = rows;
  f.expert_count = res.recv_count;
  f.rows_per_expert = res.rows_per_expert;
  f.out = res.combine_input;
  f.workspace = a->workspace;
  f.workspace_bytes = a->workspace_bytes;
  /* DIRECT combine: the down projection writes each finished tile straight into its tokens'
   * receive rows on their source ranks (the combine's send, overlapped with the experts still
   * computing), and the combine only signals and sums. EPX_MOE_SEND_ROWS=0 and
   * EPX_EARLY_LAUNCH=0 give the chain of the public calls back, for measuring (docs/env.md). */
  const int send_rows = epx__ll_combine_is_direct(g) && epx__param_MoeSendRows() != 0;
  epx__experts_scatter_t targets;
  if (send_rows) epx__ll_send_targets(g, &res, &targets);
  const int early = epx__param_EarlyLaunch() != 0;
  const epx_status_t ffn =
      epx__moe_test_fail_decode_ffn
          ? epx__set_error(EPX_ERR_INTERNAL, "%s: an FFN failure injected by a test", fn)
          : epx__experts_ffn_enqueue(experts, &f, send_rows ? &targets : NULL, early, stream);
  char ffn_message[512] = "";
  if (ffn != EPX_OK) snprintf(ffn_message, sizeof ffn_message, "%s", epx_last_error());

  /* 3. Combine, queued even if the FFN failed: the peers wait for this rank's rows. The call
   * then returns the FFN's error. */
  epx_ll_combine_args_t c = EPX_LL_COMBINE_ARGS_INIT;
  c.dispatch = &res;
  c.x = NULL; /* combine_input: the FFN's rows where it did not send them itself */
  c.out = a->out;
  /* A failed FFN sent nothing, or not all: the combine then sends combine_input (whatever it
   * holds) with its signals marked, so that no peer waits and every peer leaves this rank's
   * rows out and records EPX_ERR_PEER_DATA. */
  const epx_status_t combine = epx__ll_combine_enqueue(
      g, &c, send_rows && ffn == EPX_OK, early && ffn == EPX_OK, ffn != EPX_OK, stream);
  if (ffn != EPX_OK) /* the first failure is the one to report */
    return epx__set_error(ffn,
                          "%s: the experts' FFN failed after the dispatch was queued (the "
                          "combine was queued so that no peer waits): %s",
                          fn, ffn_message);
  return combine;
}

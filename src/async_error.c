/*
 * async_error.c - errors the kernels report asynchronously: epx_group_get_async_error reads the
 * group's host-mapped error record (kernel_ctx.h) into a message, epx_group_clear_async_error
 * rearms it (and restarts the layout kernel's tile scan, which an error may have left
 * mid-call). Kernels write the record on a timeout or a bad top-k index (docs/api.md).
 * Invariant: the record's status is written last, after a system fence, so the host reads the
 * status first and the other fields only when it is nonzero.
 */
#include <stdio.h>
#include <string.h>

#include "arg_check.h"
#include "checks.h"
#include "group.h"
#include "registry.h"

static const char *stage_name(int stage) {
  static const char *const names[] = {"none",
                                      "layout",
                                      "barrier",
                                      "notify",
                                      "dispatch",
                                      "combine",
                                      "low-latency dispatch",
                                      "low-latency combine"};
  return stage >= 0 && stage < (int)(sizeof names / sizeof names[0]) ? names[stage] : "unknown";
}

EPX_EXPORT epx_status_t epx_group_get_async_error(epx_group_t g, epx_async_error_t *err) {
  EPX_CHECK(epx__group_check(g));
  EPX_CHECK(epx__check_not_null("epx_group_get_async_error", "error", err));
  memset(err, 0, sizeof *err);
  err->peer = -1;
  err->position = -1;
  /* NOTE: status is written last by the kernel, after a system fence; read it first. */
  int status = g->error_host->status;
  if (status == 0) return EPX_OK;
  __sync_synchronize();
  err->status = (epx_status_t)status;
  err->stage = (epx_stage_t)g->error_host->stage;
  err->peer = g->error_host->peer;
  err->position = g->error_host->position;
  err->value = g->error_host->value;
  if (err->stage == EPX_STAGE_LAYOUT && status == EPX_ERR_INVALID_ARGUMENT) {
    int k = g->config.top_k;
    snprintf(err->message, sizeof err->message,
             "rank %d: topk_idx[%lld][%lld] = %lld is outside [-1, %d) (flat position %lld); that "
             "slot was treated as empty",
             g->rank, err->position / k, err->position % k, err->value, g->config.num_experts,
             err->position);
  } else if (status == EPX_ERR_TIMEOUT && err->stage == EPX_STAGE_LAYOUT) {
    snprintf(err->message, sizeof err->message,
             "rank %d: layout timed out after %d ms waiting for the counts of its tile %lld (call "
             "epoch %lld); were two calls of this group running on unordered streams?",
             g->rank, g->config.timeout_ms, err->position, err->value);
  } else if (status == EPX_ERR_PEER_DATA) {
    snprintf(err->message, sizeof err->message,
             "rank %d: peer %d's rows in %s call %lld were not valid (a step before it failed on "
             "that peer) and were left out of this rank's sums",
             g->rank, err->peer, stage_name(err->stage), err->value);
  } else if (status == EPX_ERR_TIMEOUT) {
    snprintf(err->message, sizeof err->message,
             "rank %d: %s timed out after %d ms waiting for peer %d (waited for value %lld)",
             g->rank, stage_name(err->stage), g->config.timeout_ms, err->peer, err->value);
  } else {
    snprintf(err->message, sizeof err->message,
             "rank %d: %s in %s (peer %d, position %lld, value %lld)", g->rank,
             epx_status_string(err->status), stage_name(err->stage), err->peer, err->position,
             err->value);
  }
  return EPX_OK;
}

/* Whether the record holds a combine's timeout (status read first, as the kernels write it
 * last). */
static int record_says_combine_timed_out(epx_group_t g) {
  if (g->error_host->status != EPX_ERR_TIMEOUT) return 0;
  __sync_synchronize();
  return g->error_host->stage == EPX_STAGE_COMBINE;
}

epx_status_t epx__group_check_combine_in_step(epx_group_t g, const char *fn) {
  if (record_says_combine_timed_out(g)) g->combine_out_of_step = 1;
  if (!g->combine_out_of_step) return EPX_OK;
  return epx__set_error(EPX_ERR_INVALID_USAGE,
                        "%s: a combine of this group timed out before (stage COMBINE in "
                        "epx_group_get_async_error): the ranks' combine counters no longer agree; "
                        "destroy the group on every rank and create a new one",
                        fn);
}

EPX_EXPORT epx_status_t epx_group_clear_async_error(epx_group_t g) {
  EPX_CHECK(epx__group_check(g));
  /* (waiting for the device would wait for an NCCL operation left pending) */
  EPX_CHECK(epx__group_check_collective(g, "epx_group_clear_async_error"));
  CUDA_CHECK(cudaDeviceSynchronize());
  /* (clearing the record does not put the combine counters back in step) */
  if (record_says_combine_timed_out(g)) g->combine_out_of_step = 1;
  epx__control_t *ctrl = epx__group_control(g);
  CUDA_CHECK(cudaMemsetAsync(&ctrl->error_claim, 0, sizeof ctrl->error_claim, g->setup_stream));
  /* The layout scan starts over too: an error may have left it mid-call (workspace.h). */
  CUDA_CHECK(cudaMemsetAsync(g->workspace + g->layout.layout_offset, 0, g->layout.layout_bytes,
                             g->setup_stream));
  CUDA_CHECK(cudaStreamSynchronize(g->setup_stream));
  memset((void *)g->error_host, 0, sizeof *g->error_host);
  return EPX_OK;
}

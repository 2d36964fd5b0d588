/*
 * handle.c - epx_handle_create / epx_handle_destroy: the device buffers that keep the routing
 * of one normal-mode dispatch for its combine and cached dispatches (handle.h).
 */
#include <stdio.h>
#include <stdlib.h>

#include "arg_check.h"
#include "checks.h"
#include "group.h"
#include "handle.h"
#include "registry.h"

EPX_EXPORT epx_status_t epx_handle_create(epx_group_t g, epx_handle_t *handle) {
  EPX_CHECK(epx__group_check(g));
  EPX_CHECK(epx__check_not_null("epx_handle_create", "handle", handle));
  *handle = NULL;
  if (!(g->config.modes & EPX_MODE_NORMAL))
    return epx__set_error(EPX_ERR_INVALID_USAGE,
                          "epx_handle_create: the group was created without EPX_MODE_NORMAL");
  const size_t T = (size_t)g->config.max_tokens_per_rank, R = (size_t)g->num_ranks,
               E = (size_t)g->config.num_experts;
  /* One device block: meta | pos [T, R] | per-rank [R] | per-expert [E] | in_rank [T, R] */
  const size_t meta_bytes = epx__align_up(sizeof(epx__recv_meta_t), 256);
  const size_t pos_bytes = epx__align_up(T * R * 4, 256), rank_bytes = epx__align_up(R * 4, 256);
  const size_t expert_bytes = epx__align_up(E * 4, 256), in_bytes = epx__align_up(T * R, 256);
  /* ... | expand_pos [T, K] (groups with expert-major dispatch only) */
  const size_t expand_bytes =
      g->layout.expand_rows ? epx__align_up(T * (size_t)g->config.top_k * 4, 256) : 0;
  epx_handle_t h = (epx_handle_t)calloc(1, sizeof *h);
  if (!h) return epx__set_error(EPX_ERR_SYSTEM, "epx_handle_create: out of host memory");
  h->group = g;
  h->group_serial = epx__registry_serial(g);
  h->num_tokens = -1;
  epx_status_t res = EPX_OK;
  CUDA_CHECK_GOTO(cudaMalloc(&h->device_block, meta_bytes + pos_bytes + rank_bytes + expert_bytes +
                                                   in_bytes + expand_bytes),
                  res, fail);
  char *p = (char *)h->device_block;
  h->meta = (epx__recv_meta_t *)p;
  h->token_pos_in_rank = (int *)(p += meta_bytes);
  h->num_tokens_per_rank = (int *)(p += pos_bytes);
  h->num_tokens_per_expert = (int *)(p += rank_bytes);
  h->is_token_in_rank = (uint8_t *)(p += expert_bytes);
  h->expand_pos = expand_bytes ? (int *)(p += in_bytes) : NULL;
  CUDA_CHECK_GOTO(cudaMemset(h->meta, 0, sizeof *h->meta), res, fail);
  CUDA_CHECK_GOTO(cudaDeviceSynchronize(), res,
                  fail); /* the legacy-stream memset is done before any use */
  CUDA_CHECK_GOTO(cudaHostAlloc((void **)&h->host_counts, EPX__HOST_COUNTS(E, R) * sizeof(int),
                                cudaHostAllocMapped),
                  res, fail);
  CUDA_CHECK_GOTO(cudaHostGetDevicePointer((void **)&h->host_counts_dev, h->host_counts, 0), res,
                  fail);
  CUDA_CHECK_GOTO(cudaEventCreateWithFlags(&h->counts_ready, cudaEventDisableTiming), res, fail);
  EPX_CHECK_GOTO(epx__registry_add(h), res, fail);
  *handle = h;
  return EPX_OK;
fail:
  if (h->counts_ready) cudaEventDestroy(h->counts_ready);
  if (h->host_counts) cudaFreeHost(h->host_counts);
  if (h->device_block) cudaFree(h->device_block);
  free(h);
  return res;
}

void epx__handle_free_host(epx_handle_t h) {
  epx__registry_remove(h);
  free(h);
}

EPX_EXPORT epx_status_t epx_handle_destroy(epx_handle_t h) {
  if (!h) return EPX_OK;
  EPX_CHECK(epx__handle_check(h->group, h));
  if (h->group->nccl_pending) {
    /* Waiting for the device, or freeing device memory, would wait for the group's pending
     * NCCL operation (group.h): the handle's device memory is left allocated. */
    epx__handle_free_host(h);
    return EPX_OK;
  }
  epx__registry_remove(h);
  /* Release everything, report the first failure. */
  epx_status_t res = CUDA_STATUS(cudaDeviceSynchronize());
  const epx_status_t e1 = CUDA_STATUS(cudaEventDestroy(h->counts_ready));
  const epx_status_t e2 = CUDA_STATUS(cudaFreeHost(h->host_counts));
  const epx_status_t e3 = CUDA_STATUS(cudaFree(h->device_block));
  free(h);
  if (res == EPX_OK) res = e1 != EPX_OK ? e1 : e2 != EPX_OK ? e2 : e3;
  return res;
}

epx__routing_t epx__handle_routing(epx_handle_t h) {
  epx__routing_t r = {h->is_token_in_rank,
                      h->token_pos_in_rank,
                      h->num_tokens_per_rank,
                      h->num_tokens_per_expert,
                      h->meta,
                      h->num_tokens};
  return r;
}

epx_layout_args_t epx__handle_layout_args(epx_handle_t h, const epx_dispatch_args_t *a) {
  epx_layout_args_t la = EPX_LAYOUT_ARGS_INIT;
  la.topk_idx = a->topk_idx;
  la.topk_idx_dtype = a->topk_idx_dtype;
  la.num_tokens = a->num_tokens;
  la.num_tokens_per_rank = h->num_tokens_per_rank;
  la.num_tokens_per_expert = h->num_tokens_per_expert;
  la.is_token_in_rank = h->is_token_in_rank;
  la.token_pos_in_rank = h->token_pos_in_rank;
  return la;
}

epx_status_t epx__handle_enqueue_notify(epx_group_t g, epx_handle_t h, const epx_dispatch_args_t *a,
                                        int expand, const epx__kernel_ctx_t *ctx,
                                        cudaStream_t stream) {
  const epx__notify_launch_args_t na = {epx__handle_routing(h),
                                        g->config.num_experts,
                                        a->expert_alignment,
                                        g->config.max_tokens_per_rank,
                                        a->sync_counts ? h->host_counts_dev : NULL,
                                        expand,
                                        0};
  EPX_CHECK(epx__notify_launch(ctx, &na, stream));
  /* expand: also the result's counts_event (its arrival signals are reset by this kernel) */
  if (a->sync_counts || expand) CUDA_CHECK(cudaEventRecord(h->counts_ready, stream));
  return EPX_OK;
}

epx_status_t epx__handle_enqueue_refusal(epx_group_t g, epx_handle_t h, int expand,
                                         const epx__kernel_ctx_t *ctx, cudaStream_t stream) {
  /* The handle holds the call as the peers' handles do: an empty dispatch whose count exchange
   * failed (meta aborted), so whatever the ranks do next with a failed call (combine it or
   * not), this rank can do too. */
  h->num_tokens = 0;
  h->num_worst_tokens = 0;
  h->recv_topk_idx_int64 = 0;
  h->expand = expand;
  const epx__notify_launch_args_t na = {epx__handle_routing(h),
                                        g->config.num_experts,
                                        0,
                                        g->config.max_tokens_per_rank,
                                        NULL,
                                        expand,
                                        1};
  EPX_CHECK(epx__notify_launch(ctx, &na, stream));
  if (expand) CUDA_CHECK(cudaEventRecord(h->counts_ready, stream)); /* the result's counts_event */
  return EPX_OK;
}

epx_status_t epx__handle_refused(epx_status_t refused, const char *why, epx_status_t told) {
  if (told != EPX_OK) {
    char failed[512]; /* epx__set_error writes the buffer epx_last_error() reads */
    snprintf(failed, sizeof failed, "%s", epx_last_error());
    return epx__set_error(refused,
                          "%s (telling the other ranks failed: %s; their calls time out, and the "
                          "group's counters may be out of step: destroy it on every rank)",
                          why, failed);
  }
  return epx__set_error(refused,
                        "%s (every rank's call fails: the others get EPX_ERR_TIMEOUT, stage "
                        "NOTIFY, naming this rank)",
                        why);
}

epx_status_t epx__handle_wait_counts(epx_group_t g, epx_handle_t h, int *timed_out,
                                     epx_async_error_t *err) {
  CUDA_CHECK(cudaEventSynchronize(h->counts_ready));
  /* notify writes num_recv -1 when the exchange failed: this call's own answer, also when an
   * earlier error is still on record (before, such a call returned EPX_OK with num_recv 0) */
  *timed_out = ((const volatile int *)h->host_counts)[0] < 0;
  if (*timed_out && epx_group_get_async_error(g, err) != EPX_OK)
    snprintf(err->message, sizeof err->message, "the count exchange failed");
  return EPX_OK;
}

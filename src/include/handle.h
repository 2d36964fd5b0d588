/*
 * handle.h - the routing of one normal-mode dispatch (device buffers) and its host-visible
 * counts: the object behind epx_handle_t (src/handle.c).
 */
#ifndef EPX_HANDLE_H_
#define EPX_HANDLE_H_

#include <stdint.h>

#include "epx.h"
#include "kernels/api.h"
#include "workspace.h"

struct epx_handle {
  epx_group_t group;
  unsigned long long group_serial; /* the group's registry serial at creation (registry.h) */
  void *device_block;              /* one allocation behind the routing arrays and meta */
  uint8_t *is_token_in_rank;
  int *token_pos_in_rank;
  int *num_tokens_per_rank;
  int *num_tokens_per_expert;
  epx__recv_meta_t *meta;
  int *host_counts, *host_counts_dev; /* mapped [EPX__HOST_COUNTS(E, R)]: num_recv, per-expert,
                                         and after an expert-major dispatch its rows (begin[L]),
                                         then [E/R][R] each local expert's rows per source, [R]
                                         the tokens received from each source, and the group's
                                         combines completed before it (the slab parity) */
  int *expand_pos; /* [max_tokens, K] (group with expand_max_rows, else NULL): the layout's
                      position of token t among this rank's tokens listing expert topk[t][k] */
  cudaEvent_t counts_ready;
  int num_tokens;          /* of the dispatch that filled the handle; -1 before */
  int recv_topk_idx_int64; /* the dispatch that filled the handle wrote int64 recv_topk_idx */
  int num_worst_tokens;    /* its num_worst_tokens (0 = off) */
  int expand;              /* it was an epx_dispatch_expand */
};

/* Forgets a live handle and frees its host memory only, its device memory left allocated: for
 * when waiting for the device would wait behind a group's pending NCCL operation (group.h). */
void epx__handle_free_host(epx_handle_t h);

/* The handle's routing arrays as the kernels take them. */
epx__routing_t epx__handle_routing(epx_handle_t h);

/* After queuing a dispatch with sync_counts: the host waits for its count exchange (not its
 * data). *timed_out = 1 when the exchange failed in this call (notify wrote num_recv -1; so
 * an earlier error still on record cannot hide it): *err is then the group's record, for the
 * caller's message (it may name the earlier error). Else the counts in host_counts are the
 * call's. Returns EPX_ERR_CUDA if the wait itself fails. */
epx_status_t epx__handle_wait_counts(epx_group_t g, epx_handle_t h, int *timed_out,
                                     epx_async_error_t *err);

/* The layout's arguments of a dispatch of a into this handle (its routing arrays as outputs). */
epx_layout_args_t epx__handle_layout_args(epx_handle_t h, const epx_dispatch_args_t *a);

/* Queues the count exchange of a dispatch of a into this handle (expand: epx_dispatch_expand's
 * all-E variant) and, with a->sync_counts or expand, records the handle's counts_ready after
 * it, which epx__handle_wait_counts waits for (and an expand result's counts_event is). */
epx_status_t epx__handle_enqueue_notify(epx_group_t g, epx_handle_t h, const epx_dispatch_args_t *a,
                                        int expand, const epx__kernel_ctx_t *ctx,
                                        cudaStream_t stream);

/* For a dispatch this rank refuses after its peers may have started theirs (more tokens than
 * config.max_tokens_per_rank: the one refusal that depends on the data, so it can come on one
 * rank alone): queues the count exchange in its refused form (every peer's call fails at once,
 * naming this rank, instead of waiting out its budget) and leaves the handle without routing.
 * The caller then queues its empty dispatch kernel (the meta says aborted), which keeps the
 * completion counters in step, and returns `refused` with the refusal's message. */
epx_status_t epx__handle_enqueue_refusal(epx_group_t g, epx_handle_t h, int expand,
                                         const epx__kernel_ctx_t *ctx, cudaStream_t stream);
/* The refusal's status with its message `why`, saying whether the peers were told (told: the
 * status of queuing the refusal and the empty dispatch; its message is the last error). */
epx_status_t epx__handle_refused(epx_status_t refused, const char *why, epx_status_t told);

#endif /* EPX_HANDLE_H_ */

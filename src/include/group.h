/*
 * group.h - the group object behind epx_group_t: the resolved config, the workspace layout,
 * the transport state, the peer base pointers, the host-mapped async error record, and the
 * state of the modules that hang off it (tracing, low-latency bookkeeping).
 */
#ifndef EPX_GROUP_H_
#define EPX_GROUP_H_

#include "epx.h"
#include "kernel_ctx.h"
#include "ll_state.h"
#include "workspace.h"

#ifdef __cplusplus
extern "C" {
#endif

struct epx__transport_ops;
struct epx__trace;

struct epx_group {
  int rank, num_ranks, cuda_device, num_device_sms;
  ncclComm_t comm;
  epx_group_config_t config; /* resolved: no auto fields */
  /* Where the prefill layer's dispatch with nothing beside it fans out (AFTER or DURING):
   * EPX_MOE_ALONE_FAN_OUT resolved against this GPU at creation, compared across ranks there
   * (DURING's senders and receivers must agree; epx__expand_alone_fan_out). */
  int alone_fan_out;
  epx__ws_layout_t layout;
  const struct epx__transport_ops *transport;
  void *transport_state;
  char *workspace;                /* local base of the symmetric workspace */
  char *peer_base[EPX_MAX_RANKS]; /* resolved by the transport */
  epx__error_record_t *error_host, *error_dev;
  cudaStream_t setup_stream; /* internal work at create/destroy/clear */
  long long *agree_dev;      /* EPX_AGREE_GROUP_SCRATCH_BYTES for epx__agree_group */
  /* An NCCL operation of EPX on comm timed out and may still be pending on setup_stream or a
   * trace stream: destroy then neither waits for the device nor closes the transport (it would
   * wait for that operation) and leaves the workspace allocated; steps that would queue behind
   * the operation refuse. */
  int nccl_pending;
  /* A normal-mode combine of the group timed out (seen in the async record): the ranks'
   * combine counters no longer agree, so a later combine could pass its waits before its rows
   * land. Combines refuse from then on (epx__group_check_combine_in_step). */
  int combine_out_of_step;
  struct epx__trace *trace;           /* host state of tracing (src/trace/), or NULL */
  struct epx__trace_ring *trace_ring; /* what kernels record into; NULL when not tracing */
  epx__ll_host_t ll;                  /* low-latency bookkeeping; zero at creation */
};

/* How long EPX's own NCCL steps (group creation's agreements, the trace dump's transfer) wait
 * for the slowest rank, from config.timeout_ms (0: the default): ten budgets, at least 60 s
 * (ranks reach creation further apart than calls, and a transfer's length grows with its
 * bytes). */
int epx__group_nccl_timeout_ms(int timeout_ms);
/* EPX_OK, or EPX_ERR_INVALID_USAGE naming fn when an earlier NCCL operation of g timed out
 * (g->nccl_pending): collective steps of the group would queue behind it. */
epx_status_t epx__group_check_collective(epx_group_t g, const char *fn);
/* EPX_OK, or EPX_ERR_INVALID_USAGE naming fn once a combine of g timed out on this rank (the
 * async record says so, or said so before it was cleared): destroy and re-create the group. */
epx_status_t epx__group_check_combine_in_step(epx_group_t g, const char *fn);
/* The kernel context of g (by value into every launch). */
void epx__group_kernel_ctx(epx_group_t g, epx__kernel_ctx_t *ctx);
/* This rank's control region (host view of the workspace). */
epx__control_t *epx__group_control(epx_group_t g);

#ifdef __cplusplus
}
#endif

#endif /* EPX_GROUP_H_ */

/*
 * kernel_ctx.h - what every kernel receives from its group: the kernel context (peer bases,
 * rank, wait budget, workspace layout, trace ring) and the async-error record it writes.
 */
#ifndef EPX_KERNEL_CTX_H_
#define EPX_KERNEL_CTX_H_

#include "epx.h"
#include "workspace.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Written by kernels through a host-mapped pointer, read by the host without synchronizing.
 * `status` is written last (after a system fence), so a nonzero status means the rest is set. */
typedef struct epx__error_record {
  volatile int status; /* epx_status_t; 0 = none */
  int stage;           /* epx_stage_t */
  int peer;
  int reserved;
  long long position;
  long long value;
} epx__error_record_t;

struct epx__trace_ring;

/* Everything a kernel needs from the group, passed by value at launch. */
typedef struct epx__kernel_ctx {
  char *peer_base[EPX_MAX_RANKS]; /* workspace base of every rank as mapped here; own included */
  int rank, num_ranks;
  unsigned long long timeout_ns; /* budget of each wait on a peer */
  epx__error_record_t *error;    /* device alias of the host-mapped error record */
  epx__ws_layout_t layout;
  struct epx__trace_ring *trace; /* device event buffer while the group traces, else NULL */
} epx__kernel_ctx_t;

#ifdef __cplusplus
}
#endif

#endif /* EPX_KERNEL_CTX_H_ */

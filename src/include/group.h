/*
 * group.h - the group object behind epx_group_t, and what kernels receive from it.
 *
 * A group owns: the resolved config, the workspace layout, the transport state (symmetric
 * window, device communicator), the table of peer base pointers, and the host-mapped async
 * error record. Live groups are kept in a registry so that a destroyed or foreign handle is
 * refused with EPX_ERR_INVALID_USAGE instead of being dereferenced.
 */
#ifndef EPX_GROUP_H_
#define EPX_GROUP_H_

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

/* Everything a kernel needs from the group, passed by value at launch. */
typedef struct epx__kernel_ctx {
  char *peer_base[EPX_MAX_RANKS]; /* workspace base of every rank as mapped here; own included */
  int rank, num_ranks;
  unsigned long long timeout_ns; /* budget of each wait on a peer */
  epx__error_record_t *error;    /* device alias of the host-mapped error record */
  epx__ws_layout_t layout;
  struct epx__trace_ring *trace; /* device event buffer while the group traces, else NULL */
} epx__kernel_ctx_t;

struct epx__transport_ops;
struct epx__trace;

/* Host-side bookkeeping of low-latency calls (src/ll.c). Every rank makes the same collective
 * calls, so these evolve identically on every rank; a captured graph replays its calls with the
 * buffers chosen at capture time. */
typedef struct epx__ll_host {
  unsigned long long seq;            /* low-latency calls issued; call ids are seq values */
  int next_parity;                   /* buffer of the next dispatch */
  unsigned long long dispatch_id[2]; /* call id of the latest dispatch on each buffer */
  int dispatch_tokens[2];            /* its num_tokens */
  int dispatch_fp8[2];               /* its receive dtype is FP8 */
  void *combine_out[2];              /* out of a split combine, for its epx_ll_recv */
  unsigned long long pending[2][2];  /* [0 dispatch, 1 combine][buffer]: hook id of a split call
                                        awaiting epx_ll_recv, or 0 */
} epx__ll_host_t;

struct epx_group {
  int rank, num_ranks, cuda_device, num_device_sms;
  ncclComm_t comm;
  epx_group_config_t config; /* resolved: no auto fields */
  epx__ws_layout_t layout;
  const struct epx__transport_ops *transport;
  void *transport_state;
  char *workspace;                /* local base of the symmetric workspace */
  char *peer_base[EPX_MAX_RANKS]; /* resolved by the transport */
  epx__error_record_t *error_host, *error_dev;
  cudaStream_t setup_stream;          /* internal work at create/destroy/clear */
  struct epx__trace *trace;           /* host state of tracing (src/trace.c), or NULL */
  struct epx__trace_ring *trace_ring; /* what kernels record into; NULL when not tracing */
  epx__ll_host_t ll;                  /* low-latency bookkeeping; zero at creation */
};

/* Transports behind one table, chosen at group creation; common code never branches on it. */
typedef struct epx__transport_ops {
  const char *name;
  /* Allocate g->layout.total_bytes of workspace on every rank, zeroed, register it and fill
   * g->workspace and g->peer_base. Collective. */
  epx_status_t (*open)(struct epx_group *g);
  /* Release what open created; safe on a partially opened group. Collective. */
  epx_status_t (*close)(struct epx_group *g);
} epx__transport_ops_t;

extern const epx__transport_ops_t epx__transport_nvlink;

/* The routing of one normal-mode dispatch (device buffers) and its host-visible counts. */
struct epx_handle {
  epx_group_t group;
  void *device_block; /* one allocation behind the routing arrays and meta */
  uint8_t *is_token_in_rank;
  int *token_pos_in_rank;
  int *num_tokens_per_rank;
  int *num_tokens_per_expert;
  epx__recv_meta_t *meta;
  int *host_counts, *host_counts_dev; /* mapped [1 + E/R]: num_recv, per-expert */
  cudaEvent_t counts_ready;
  int num_tokens; /* of the dispatch that filled the handle; -1 before */
};

/* Registry of live objects (groups and handles): a destroyed handle is refused, never read. */
epx_status_t epx__registry_add(const void *object);
void epx__registry_remove(const void *object);
/* EPX_OK if h is a live handle of the live group g. */
epx_status_t epx__handle_check(epx_group_t g, epx_handle_t h);
/* Queue the layout kernel for already-checked arguments (epx_layout and epx_dispatch). */
epx_status_t epx__layout_enqueue(epx_group_t g, const epx_layout_args_t *args, cudaStream_t stream);
/* Refuse NULL, misaligned or host-only pointers, naming `what`. */
epx_status_t epx__check_device_ptr(const void *p, size_t align, const char *what);

/* EPX_OK if g is a live group; EPX_ERR_INVALID_ARGUMENT if NULL; EPX_ERR_INVALID_USAGE if
 * destroyed or never created. */
epx_status_t epx__group_check(epx_group_t g);
void epx__group_kernel_ctx(epx_group_t g, epx__kernel_ctx_t *ctx);

#ifdef __cplusplus
}
#endif

#endif /* EPX_GROUP_H_ */

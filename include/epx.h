/*
 * epx.h - the public C API of EPX, expert-parallel exchange for Mixture-of-Experts.
 *
 * EPX moves MoE tokens to the GPUs that hold their experts (dispatch) and brings the expert
 * outputs back, reduced, to the tokens' home GPUs (combine). One process drives one GPU; a
 * group of R processes shares a symmetric workspace registered with NCCL, and kernels write
 * into peers' memory over NVLink.
 *
 * Conventions used throughout:
 *  - Every function returns an epx_status_t; EPX_OK is 0. On failure epx_last_error() returns a
 *    message (per thread) naming the argument or the condition.
 *  - Structs passed in start with a `size` field; initialize them with their EPX_*_INIT macro so
 *    that later versions can grow them. 0 in a field marked "0 = auto" selects the default.
 *  - Device pointers are plain CUDA device pointers; operations are asynchronous on the
 *    `cudaStream_t` given last and ordered with the caller's other work on that stream.
 *  - "Collective" means every rank of the group must make the call, in the same order.
 *
 * This header is plain C11 and needs only <nccl.h> and <cuda_runtime_api.h>.
 */
#ifndef EPX_H_
#define EPX_H_

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------------
 * Version
 * ------------------------------------------------------------------------------------------- */
#define EPX_VERSION_MAJOR 0
#define EPX_VERSION_MINOR 1
#define EPX_VERSION_PATCH 1
#define EPX_VERSION_CODE (EPX_VERSION_MAJOR * 10000 + EPX_VERSION_MINOR * 100 + EPX_VERSION_PATCH)

/* ---------------------------------------------------------------------------------------------
 * Status codes: one list, expanded into the enum here and into the strings in src/status.c.
 * ------------------------------------------------------------------------------------------- */
#define EPX_STATUS_MAP(X)                                                                          \
  X(OK, 0, "success")                                                                              \
  X(ERR_CUDA, 1, "a CUDA call failed; run with EPX_DEBUG=INFO for details")                        \
  X(ERR_NCCL, 2, "an NCCL call failed; run with NCCL_DEBUG=WARN and EPX_DEBUG=INFO for details")   \
  X(ERR_SYSTEM, 3, "a system call or allocation failed; check memory and limits")                  \
  X(ERR_INTERNAL, 4, "internal error in EPX; please report it with EPX_DEBUG=TRACE output")        \
  X(ERR_INVALID_ARGUMENT, 5, "invalid argument; epx_last_error() names it")                        \
  X(ERR_INVALID_USAGE, 6, "invalid usage (wrong order, destroyed handle, or mismatched ranks)")    \
  X(ERR_TIMEOUT, 7, "a wait on a peer exceeded its time budget; see epx_group_get_async_error")    \
  X(ERR_PEER_FAILED, 8, "a peer stopped responding and was masked; see epx_group_get_async_error") \
  X(ERR_UNSUPPORTED, 9, "unsupported configuration or machine; epx_last_error() says which part")  \
  X(ERR_PEER_DATA, 10,                                                                             \
    "a peer's rows were not valid and were left out; see epx_group_get_async_error")

typedef enum epx_status {
#define EPX_STATUS_ENUM_(name, value, text) EPX_##name = value,
  EPX_STATUS_MAP(EPX_STATUS_ENUM_)
#undef EPX_STATUS_ENUM_
      EPX_NUM_STATUS
} epx_status_t;

/* epx_get_version - the EPX_VERSION_CODE the library was built with.
 *   version - [OUT] e.g. 100 for 0.1.0.
 * Returns EPX_OK, or EPX_ERR_INVALID_ARGUMENT if version is NULL. Not collective. */
epx_status_t epx_get_version(int *version);

/* epx_get_nccl_version - the NCCL this library was compiled against and the one the process has
 * loaded (ncclGetVersion), as NCCL_VERSION_CODE values (e.g. 22809 for 2.28.9). They must be
 * equal for epx_group_create to accept a communicator; a binding can check at import.
 *   built  - [OUT] optional: NCCL_VERSION_CODE of the headers EPX was built with.
 *   loaded - [OUT] optional: the loaded runtime's version.
 * Returns EPX_OK, EPX_ERR_INVALID_ARGUMENT (both NULL) or EPX_ERR_NCCL. Not collective. */
epx_status_t epx_get_nccl_version(int *built, int *loaded);

/* epx_status_string - a static, human-readable string for a status (never NULL). */
const char *epx_status_string(epx_status_t status);

/* epx_last_error - the message of the last failed EPX call on this thread ("" if none). The
 * pointer stays valid until the next EPX call on this thread. */
const char *epx_last_error(void);

/* ---------------------------------------------------------------------------------------------
 * Data types and modes
 * ------------------------------------------------------------------------------------------- */
typedef enum epx_dtype {
  EPX_DTYPE_BF16 = 1 << 0,     /* bfloat16 payload */
  EPX_DTYPE_FP8_E4M3 = 1 << 1, /* float8 e4m3 payload with per-128-channel float32 scales */
  EPX_DTYPE_INT32 = 1 << 2,    /* topk_idx as int32 */
  EPX_DTYPE_INT64 = 1 << 3,    /* topk_idx as int64 */
  EPX_DTYPE_FLOAT32 = 1 << 4   /* weights, scales */
} epx_dtype_t;

typedef enum epx_mode {
  EPX_MODE_NORMAL = 1 << 0,     /* high-throughput dispatch/combine (prefill, training) */
  EPX_MODE_LOW_LATENCY = 1 << 1 /* fixed-slot dispatch/combine (decode) */
} epx_mode_t;

/* Compiled limits. A config beyond them is refused with EPX_ERR_UNSUPPORTED. */
#define EPX_MAX_RANKS 8
#define EPX_MAX_TOP_K 16
#define EPX_MAX_EXPERTS 1024
#define EPX_MAX_HIDDEN 32768
#define EPX_MAX_TOKENS_PER_RANK 65536
#define EPX_MAX_EXPAND_ROWS (1 << 24) /* config.expand_max_rows */

/* 0 in a config field marked "0 = auto" selects the library default. */
#define EPX_AUTO 0

/* ---------------------------------------------------------------------------------------------
 * Group configuration
 * ------------------------------------------------------------------------------------------- */
typedef struct epx_group_config {
  size_t size;             /* sizeof(epx_group_config_t); set by EPX_GROUP_CONFIG_INIT */
  int version;             /* EPX_VERSION_CODE the caller compiled against */
  int max_tokens_per_rank; /* required: most tokens any rank passes to one call, 1..65536 */
  int hidden;              /* required: elements per token; multiple of 8 (FP8: of 128) */
  int num_experts;         /* required: E, a multiple of the rank count, up to 1024 */
  int top_k;               /* required: experts per token, 1..16 */
  unsigned int dtypes;     /* payload dtypes to support (EPX_DTYPE_BF16 | ..._FP8_E4M3);
                              0 = auto: BF16 and FP8 */
  unsigned int modes;      /* EPX_MODE_* to size the workspace for; 0 = auto: NORMAL */
  int num_sms;             /* SM budget of normal-mode kernels; 0 = auto (24) */
  int timeout_ms;          /* budget of every wait on a peer; 0 = auto (EPX_TIMEOUT_MS or
                              5000) */
  int ll_num_sms;          /* blocks (one per SM) of low-latency kernels; 0 = auto (EPX_LL_NUM_SMS,
                              else every SM of the GPU); must come out equal on every rank */
  int ll_route;            /* epx_ll_route_t of low-latency calls; 0 = auto (EPX_LL_ROUTE, else
                              the measured default, see docs/low-latency.md) */
  int ll_max_tokens_per_rank; /* most tokens any rank passes to one low-latency call, 1..65536;
                                 sizes the low-latency region alone, so one group can serve
                                 prefill (max_tokens_per_rank = 4096) and decode (128); 0 = auto:
                                 max_tokens_per_rank (DeepEP's num_max_dispatch_tokens_per_rank) */
  int expand_max_rows; /* rows of the expert-major receive buffer of epx_dispatch_expand on each
                          rank, padding included, 0..EPX_MAX_EXPAND_ROWS; 0 = none (the expand
                          calls are refused, nothing is allocated for them). Needs
                          EPX_MODE_NORMAL and EPX_DTYPE_BF16. Worst case: R x max_tokens_per_rank
                          x min(top_k, E/R) + (E/R) x (expert_alignment - 1) */
  int expand_fan_out;  /* epx_expand_fan_out_t of epx_dispatch_expand; 0 = auto
                          (EPX_EXPAND_FAN_OUT, else the default below) */
} epx_group_config_t;

#define EPX_GROUP_CONFIG_INIT                                                             \
  {                                                                                       \
    sizeof(epx_group_config_t), EPX_VERSION_CODE, 0, 0, 0, 0, 0u, 0u, EPX_AUTO, EPX_AUTO, \
        EPX_AUTO, EPX_AUTO, EPX_AUTO, 0, EPX_AUTO                                         \
  }

/* How low-latency mode moves a token to the experts of one rank. Every rank of a group uses the
 * same route (it is part of the config, checked at group creation). */
typedef enum epx_ll_route {
  EPX_LL_ROUTE_AUTO = 0,    /* the measured default (docs/low-latency.md) */
  EPX_LL_ROUTE_DIRECT = 1,  /* one NVLink copy per (token, expert), written into its final row;
                               combine returns one row per (token, expert) */
  EPX_LL_ROUTE_BY_RANK = 2, /* one NVLink copy per (token, destination rank), fanned out to the
                               rank's experts by the receiver; combine sums a token's rows on
                               the expert side and returns one float32 partial per (token,
                               rank) */
  EPX_LL_ROUTE_DISPATCH_BY_RANK = 3 /* dispatch as BY_RANK, combine as DIRECT: the fastest of
                                       each measured on 4x H200 (the default) */
} epx_ll_route_t;

/* Where epx_dispatch_expand copies a token's payload to its other local-expert rows on the
 * receiver (it crosses NVLink once per (token, rank), into the row of the token's lowest local
 * expert there). Part of the config: every rank of a group uses the same (checked at creation).
 * docs/moe.md, "Expert-major layout". */
typedef enum epx_expand_fan_out {
  EPX_EXPAND_FAN_OUT_AUTO = 0,  /* the default: AFTER, which leaves all but num_sms SMs to
                                   other work during the transfer */
  EPX_EXPAND_FAN_OUT_AFTER = 1, /* a kernel after the dispatch's wait for every source (on 4x
                                   H200 at 4096 tokens, H 7168: 648 us, 1.25x the plain
                                   dispatch's 518; docs/moe.md) */
  EPX_EXPAND_FAN_OUT_DURING = 2 /* num_sms x 2 more blocks of the dispatch kernel at 4
                                   ranks, x 2.75 at 2 (top-8; cut to the SMs the sending
                                   blocks leave; EPX_EXPAND_FAN_OUT_BLOCKS sets the count)
                                   copy each token as its row lands (the sender marks it
                                   ready), overlapping the copies with the NVLink transfer:
                                   the fastest standalone (4x H200, 4096 tokens, H 7168,
                                   num_sms 24: 511-513 us at 4 ranks, 0.98x the plain
                                   dispatch; 255 us at 2 ranks, 1.09-1.10x; docs/moe.md),
                                   but the dispatch holds num_sms + those SMs while it runs:
                                   kernels of other streams get fewer SMs meanwhile (a
                                   low-latency kernel of another group, which needs all its
                                   blocks resident, can time out), and in epx_moe_prefill's
                                   overlap the fan-out blocks take SMs the GEMMs would use
                                   (docs/moe.md has the layer measured both ways). Group
                                   creation refuses it where 2 x num_sms blocks do not fit */
} epx_expand_fan_out_t;

/* epx_workspace_size - bytes of symmetric workspace a group with this config allocates on each
 * GPU, before anything is allocated. Uses the same layout code as the kernels. The normal-mode
 * part grows with max_tokens_per_rank, the low-latency part with ll_max_tokens_per_rank; the
 * bytes of each: epx_workspace_size_by_mode.
 *   config    - [IN] a config; auto fields are resolved as epx_group_create would.
 *   num_ranks - [IN] ranks of the group, 1..EPX_MAX_RANKS.
 *   bytes     - [OUT] workspace bytes per GPU.
 * Returns EPX_OK, EPX_ERR_INVALID_ARGUMENT (bad field, named in epx_last_error), or
 * EPX_ERR_UNSUPPORTED (beyond the compiled limits). Not collective; touches no GPU. */
epx_status_t epx_workspace_size(const epx_group_config_t *config, int num_ranks, size_t *bytes);

/* Workspace bytes per GPU, by mode (epx_workspace_size_by_mode). total = common + normal +
 * low_latency; a mode the config does not ask for counts 0. */
typedef struct epx_workspace_sizes {
  size_t size;              /* sizeof(epx_workspace_sizes_t); set by EPX_WORKSPACE_SIZES_INIT */
  size_t total_bytes;       /* [OUT] what epx_workspace_size returns */
  size_t common_bytes;      /* [OUT] control words and the normal-mode count exchange */
  size_t normal_bytes;      /* [OUT] EPX_MODE_NORMAL: receive and combine slabs, by
                               max_tokens_per_rank */
  size_t low_latency_bytes; /* [OUT] EPX_MODE_LOW_LATENCY: two buffers, by
                               ll_max_tokens_per_rank */
} epx_workspace_sizes_t;

#define EPX_WORKSPACE_SIZES_INIT \
  { sizeof(epx_workspace_sizes_t), 0, 0, 0, 0 }

/* epx_workspace_size_by_mode - epx_workspace_size split by mode, e.g. to see what a
 * low-latency region at ll_max_tokens_per_rank adds to a normal-mode group.
 *   config    - [IN] as epx_workspace_size.
 *   num_ranks - [IN] ranks of the group, 1..EPX_MAX_RANKS.
 *   sizes     - [OUT] initialized with EPX_WORKSPACE_SIZES_INIT; the byte fields are filled.
 * Returns as epx_workspace_size. Not collective; touches no GPU. */
epx_status_t epx_workspace_size_by_mode(const epx_group_config_t *config, int num_ranks,
                                        epx_workspace_sizes_t *sizes);

/* epx_config_validate - the checks epx_group_create applies to a config, without a GPU.
 * Returns as epx_workspace_size. Not collective. */
epx_status_t epx_config_validate(const epx_group_config_t *config, int num_ranks);

/* ---------------------------------------------------------------------------------------------
 * Group
 * ------------------------------------------------------------------------------------------- */
typedef struct epx_group *epx_group_t;

/* epx_group_create - create a group over an existing NCCL communicator. COLLECTIVE over comm.
 * The current CUDA device must be the communicator's device. Checks that the NCCL runtime
 * matches the headers EPX was built with, that every rank passed the same config, that every
 * peer is reachable over NVLink/P2P, then allocates the workspace (ncclMemAlloc), registers it as
 * a symmetric window and resolves peer pointers. The group keeps a reference to comm; destroy
 * the group before the communicator.
 *   comm   - [IN] an initialized NCCL communicator, 1..EPX_MAX_RANKS ranks on one host (one
 *            rank: every token stays on its GPU, through the same kernels).
 *   config - [IN] the group's maxima and options; must be identical on every rank.
 *   group  - [OUT] the new group; NULL on failure.
 * Returns EPX_OK; EPX_ERR_INVALID_ARGUMENT (bad config field); EPX_ERR_UNSUPPORTED (config
 * beyond the compiled limits, peers not all on NVLink, NCCL version mismatch);
 * EPX_ERR_INVALID_USAGE (configs differ across ranks); EPX_ERR_NCCL / EPX_ERR_CUDA. A failure
 * caused by the config or the machine is seen by every rank alike, so no rank is left waiting. */
epx_status_t epx_group_create(ncclComm_t comm, const epx_group_config_t *config,
                              epx_group_t *group);

/* epx_group_destroy - release the workspace and everything the group holds. COLLECTIVE.
 * Synchronizes the device first. destroy(NULL) returns EPX_OK; a destroyed handle passed to any
 * call returns EPX_ERR_INVALID_USAGE (as long as its memory was not reused). Bounded when a
 * peer is dead: EPX's kernels end within timeout_ms, and with EPX_TRACE the dump gives up
 * within two budgets (a warning, nothing written); it waits for the whole device, so work of
 * the application's that waits on the dead peer makes it wait too. After one of EPX's NCCL
 * operations timed out (an EPX_ERR_TIMEOUT that says so), destroy waits for nothing and leaves
 * the workspace allocated; abort the communicator next (docs/api.md, "After a fault"). */
epx_status_t epx_group_destroy(epx_group_t group);

/* Queries. Not collective; no GPU work.
 *   epx_group_rank / epx_group_size - [OUT] this rank and the number of ranks.
 *   epx_group_get_config - [OUT] the resolved config (auto fields filled in).
 *   epx_group_workspace_bytes - [OUT] bytes of symmetric workspace on each GPU. */
epx_status_t epx_group_rank(epx_group_t group, int *rank);
epx_status_t epx_group_size(epx_group_t group, int *num_ranks);
epx_status_t epx_group_get_config(epx_group_t group, epx_group_config_t *config);
epx_status_t epx_group_workspace_bytes(epx_group_t group, size_t *bytes);

/* epx_group_barrier - a device-side barrier across all ranks, on stream. COLLECTIVE. The kernel
 * returns once every rank's barrier kernel has started; each wait is bounded by the group's
 * timeout, and an expired wait is reported through epx_group_get_async_error (stage
 * EPX_STAGE_BARRIER, naming the peer) instead of hanging. Capturable in a CUDA graph. */
epx_status_t epx_group_barrier(epx_group_t group, cudaStream_t stream);

/* epx_group_barrier_unmasked - a barrier of this rank and the peers it has not masked
 * (epx_group_get_peer_mask: peers given up on in low-latency calls, or masked with
 * epx_group_mask_peer): a masked peer is neither told nor waited for, so a dead one costs
 * nothing (DeepEP's clean_low_latency_buffer in shrink mode). COLLECTIVE over the unmasked
 * ranks. A rank that masked this one does not tell it either: if this rank has not masked that
 * rank in turn, it waits for it until timeout_ms (EPX_ERR_TIMEOUT, stage BARRIER, through
 * epx_group_get_async_error). Counted apart from epx_group_barrier, so a masked rank that is
 * alive stays in step with the others' ordinary barriers; epx_group_clear_peer_mask brings the
 * unmasked barriers' counts back together. Bounded and capturable as epx_group_barrier. */
epx_status_t epx_group_barrier_unmasked(epx_group_t group, cudaStream_t stream);

/* ---------------------------------------------------------------------------------------------
 * Asynchronous errors: conditions that kernels detect (timeouts, bad expert ids) are recorded
 * in host-visible memory as they happen; the first one is kept until cleared.
 * ------------------------------------------------------------------------------------------- */
typedef enum epx_stage {
  EPX_STAGE_NONE = 0,
  EPX_STAGE_LAYOUT = 1,
  EPX_STAGE_BARRIER = 2,
  EPX_STAGE_NOTIFY = 3,
  EPX_STAGE_DISPATCH = 4,
  EPX_STAGE_COMBINE = 5,
  EPX_STAGE_LL_DISPATCH = 6,
  EPX_STAGE_LL_COMBINE = 7
} epx_stage_t;

typedef struct epx_async_error {
  epx_status_t status; /* EPX_OK when nothing was recorded */
  epx_stage_t stage;   /* where it happened */
  int peer;            /* the peer waited for, -1 if none */
  long long position;  /* e.g. flat index t*top_k+k of the first bad expert id; -1 if none */
  long long value;     /* e.g. the bad expert id, or the flag value waited for */
  char message[256];   /* one line, ready to log */
} epx_async_error_t;

/* epx_group_get_async_error - the first asynchronous error recorded since the last clear. Does
 * not synchronize with any stream: to see the errors of work already queued, synchronize that
 * stream first. Not collective.
 *   error - [OUT] error->status is EPX_OK when none was recorded.
 * Returns EPX_OK (whether or not an error was recorded) or EPX_ERR_INVALID_ARGUMENT/USAGE. */
epx_status_t epx_group_get_async_error(epx_group_t group, epx_async_error_t *error);

/* epx_group_clear_async_error - forget the recorded error, and restart the layout kernel's
 * scan state (an error may have left it mid-call). Synchronizes the device. Not collective. */
epx_status_t epx_group_clear_async_error(epx_group_t group);

/* ---------------------------------------------------------------------------------------------
 * Layout: from the router's choice, what each rank will send where.
 * ------------------------------------------------------------------------------------------- */
typedef struct epx_layout_args {
  size_t size;                /* sizeof(epx_layout_args_t); set by EPX_LAYOUT_ARGS_INIT */
  const void *topk_idx;       /* [IN] [num_tokens, top_k] expert ids, -1 = empty slot */
  epx_dtype_t topk_idx_dtype; /* EPX_DTYPE_INT64 or EPX_DTYPE_INT32 */
  int num_tokens;             /* T, 0..max_tokens_per_rank */
  /* Outputs, device memory, written in full; any may be NULL to skip it. */
  int *num_tokens_per_rank;   /* [OUT] [R] tokens this rank sends to each rank (own included) */
  int *num_tokens_per_expert; /* [OUT] [E] tokens choosing each expert (a token is counted
                                 once per expert even if it lists it twice) */
  uint8_t *is_token_in_rank;  /* [OUT] [T, R] 1 if token t goes to rank r, else 0 */
  int *token_pos_in_rank;     /* [OUT] [T, R] position of token t among the tokens this rank
                                 sends to rank r (source-token order), -1 if not sent */
} epx_layout_args_t;

#define EPX_LAYOUT_ARGS_INIT \
  { sizeof(epx_layout_args_t), NULL, EPX_DTYPE_INT64, 0, NULL, NULL, NULL, NULL }

/* epx_layout - compute the dispatch layout of this rank's tokens on the GPU, asynchronously on
 * stream. Not collective. Expert ids outside [-1, E) are found on the GPU: they are treated as
 * empty slots (nothing is written out of bounds) and the first one (lowest t*top_k+k) is
 * recorded as an asynchronous error with status EPX_ERR_INVALID_ARGUMENT, stage
 * EPX_STAGE_LAYOUT, its position and value; epx_group_get_async_error returns it once the
 * stream has been synchronized. Uses the group's workspace (the layout's scan state): like
 * every call of a group, order it with the group's other calls (one stream, or events).
 * Returns EPX_OK once queued; EPX_ERR_INVALID_ARGUMENT for bad host-visible arguments (NULL or
 * misaligned pointers, num_tokens out of range, bad dtype), naming the argument; nothing is
 * launched then. */
epx_status_t epx_layout(epx_group_t group, const epx_layout_args_t *args, cudaStream_t stream);

/* ---------------------------------------------------------------------------------------------
 * Normal (high-throughput) mode: dispatch, combine, cached dispatch. Needs EPX_MODE_NORMAL.
 *
 * Dispatch delivers to each rank every token that chose one of its experts, exactly once, in
 * source-rank then source-token order, into the group's workspace: the outputs are plain
 * device arrays there (recv_x is a [num_recv, H] matrix), valid until the next dispatch on the
 * group. A handle records the routing so that combine (and a cached dispatch) can reuse it.
 * ------------------------------------------------------------------------------------------- */
typedef struct epx_handle *epx_handle_t;

/* epx_handle_create - device buffers for one routing (layout of max_tokens_per_rank tokens).
 * Not collective. Create handles once and reuse them: dispatch allocates nothing. */
epx_status_t epx_handle_create(epx_group_t group, epx_handle_t *handle);
/* epx_handle_destroy - release a handle (synchronizes the device). destroy(NULL) is EPX_OK.
 * Destroy a group's handles before the group: afterwards they are refused (INVALID_USAGE). */
epx_status_t epx_handle_destroy(epx_handle_t handle);

typedef struct epx_dispatch_args {
  size_t size;                /* sizeof(epx_dispatch_args_t); set by EPX_DISPATCH_ARGS_INIT */
  const void *x;              /* [IN] [T, H] payload, 16-byte aligned: BF16, or FP8 E4M3 */
  epx_dtype_t x_dtype;        /* EPX_DTYPE_BF16 or EPX_DTYPE_FP8_E4M3. x_dtype and
                                 x_scales_dtype are collective: every rank passes the same, a
                                 rank with no tokens too, since each receiver reads its rows in
                                 its own call's format (not checked across ranks) */
  const float *x_scales;      /* [IN] FP8 only: [T, H/128] float32 scales (UE8M0 scales are
                                 passed as float32 powers of two; they are copied bit-exactly) */
  const void *topk_idx;       /* [IN] [T, K] expert ids, -1 = empty slot */
  epx_dtype_t topk_idx_dtype; /* EPX_DTYPE_INT64 or EPX_DTYPE_INT32 */
  const float *topk_weights;  /* [IN] [T, K] float32, or NULL (received weights are then 0) */
  int num_tokens;             /* T, 0..max_tokens_per_rank */
  int expert_alignment;       /* round each per-expert receive count up to a multiple of this
                                 (for grouped GEMM); 0 or 1 = exact counts */
  int sync_counts;            /* 1: learn the receive counts on the host before returning (the
                                 only host synchronization of EPX); 0: no host sync, counts only
                                 on the device (capturable in a CUDA graph) */
  int *num_recv_per_expert;   /* [OUT] optional host array [E/R] (sync_counts = 1 only) */
  /* DeepEP-parity options (docs/normal-mode.md). Their defaults keep the behaviour above. */
  const uint8_t *is_token_in_rank;  /* [IN] [T, R] bool (0 / nonzero): route by rank mask instead
                                       of topk_idx (which must then be NULL, and topk_weights
                                       too); needs num_tokens_per_expert. NULL = route by ids */
  const int *num_tokens_per_expert; /* [IN] device [E] int32: with is_token_in_rank, the tokens of
                                       this rank per expert; they make the receivers' per-expert
                                       counts. NULL otherwise */
  int num_worst_tokens;             /* 0 = off; else the receive row count the caller planned
                                       for (1..capacity): needs sync_counts = 0; result->num_recv
                                       is then this number, and rows [real count, this) of
                                       recv_topk_idx are -1 (weights 0), written on the GPU */
  epx_dtype_t recv_topk_idx_dtype;  /* 0 or EPX_DTYPE_INT32: result->recv_topk_idx (int32);
                                       EPX_DTYPE_INT64: result->recv_topk_idx_int64 */
  epx_dtype_t x_scales_dtype;       /* FP8 only. 0 or EPX_DTYPE_FLOAT32: x_scales are [T, H/128]
                                       float32; EPX_DTYPE_INT32: UE8M0 exponents packed four per
                                       int32, [T, ceil(H/512)], carried as they are */
  int x_scales_stride_token;        /* FP8 only: element strides of x_scales; both 0 = contiguous
                                       rows; DeepEP's column-major [T, H/128]: 1 and T */
  int x_scales_stride_group;
} epx_dispatch_args_t;

#define EPX_DISPATCH_ARGS_INIT                                                                     \
  {                                                                                                \
    sizeof(epx_dispatch_args_t), NULL, EPX_DTYPE_BF16, NULL, NULL, EPX_DTYPE_INT64, NULL, 0, 0, 1, \
        NULL, NULL, NULL, 0, EPX_DTYPE_INT32, EPX_DTYPE_FLOAT32, 0, 0                              \
  }

typedef struct epx_dispatch_result {
  int num_recv;                /* rows received (sync_counts = 1); num_worst_tokens when that
                                  is set (the real count is num_recv_device); else -1 */
  int capacity;                /* rows the outputs can hold: R x max_tokens_per_rank */
  void *recv_x;                /* [capacity, H] BF16 or FP8 in the workspace; rows
                                  [0, num_recv) are this dispatch's, source-rank major */
  float *recv_x_scales;        /* [capacity, H/128] (FP8 dispatch, float32 scales), else NULL */
  int *recv_topk_idx;          /* [capacity, K] int32 local expert ids, -1 elsewhere (NULL when
                                  recv_topk_idx_dtype = INT64) */
  float *recv_topk_weights;    /* [capacity, K] float32, 0 where the slot is elsewhere */
  int *recv_src_token;         /* [capacity] source token index of each row */
  const int *recv_rank_prefix; /* device [R+1]: rows of source s are [prefix[s], prefix[s+1]) */
  const int *num_recv_device;  /* device int: rows received */
  const int *num_recv_per_expert_device; /* device [E/R], aligned as asked */
  const int *rank_prefix_matrix_device;  /* device [R, R] int32 row-major: [i][j] = tokens ranks
                                            0..i send to rank j (DeepEP's rank_prefix_matrix) */
  int64_t *recv_topk_idx_int64;  /* [capacity, K] int64 when recv_topk_idx_dtype = INT64 (then
                                    recv_topk_idx is NULL), else NULL */
  int32_t *recv_x_scales_packed; /* [capacity, ceil(H/512)] int32 UE8M0 words when x_scales_dtype
                                    = INT32 (then recv_x_scales is NULL), else NULL */
} epx_dispatch_result_t;

/* epx_dispatch - send this rank's tokens to the ranks of their experts. COLLECTIVE: every rank
 * calls it (with its own tokens, possibly 0), in the same order as other EPX collectives.
 * Ordered on stream. With sync_counts = 1 the host waits for the count exchange (one round
 * trip) to fill result->num_recv and args->num_recv_per_expert; nothing else blocks the host.
 *   handle - [IN/OUT] records this routing for epx_combine and epx_dispatch_cached.
 *   result - [OUT] where the received data is.
 * Returns EPX_OK once queued, or EPX_ERR_INVALID_ARGUMENT naming the argument (nothing sent;
 * except num_tokens > config.max_tokens_per_rank, which can come on one rank alone: that rank
 * still runs its count exchange, refused, so every other rank's call fails at once with
 * EPX_ERR_TIMEOUT, stage NOTIFY, naming it, and an empty dispatch; its result and handle are
 * then those of a failed count exchange, num_recv = -1).
 * Expert ids out of range are reported asynchronously (stage LAYOUT) and treated as empty. A
 * peer that does not arrive within timeout_ms is reported asynchronously (EPX_ERR_TIMEOUT); with
 * sync_counts = 1 a count exchange that timed out also makes this call return EPX_ERR_TIMEOUT
 * (result->num_recv = -1), also with an earlier error still on record.
 * With num_worst_tokens, a real receive count above it is reported asynchronously
 * (EPX_ERR_INVALID_ARGUMENT, stage DISPATCH, value = the count); every row is still written.
 * The DeepEP-parity options (rank mask, worst-case rows, int64 ids, strided / packed scales,
 * rank prefix matrix) and the DeepEP calls they serve: docs/normal-mode.md. */
epx_status_t epx_dispatch(epx_group_t group, epx_handle_t handle, const epx_dispatch_args_t *args,
                          epx_dispatch_result_t *result, cudaStream_t stream);

/* epx_dispatch_cached - dispatch new payload with the routing recorded in handle: no layout, no
 * count exchange, no host synchronization; capturable in a CUDA graph. COLLECTIVE. It starts
 * with a device barrier of the group (a few us), so no peer writes this rank's receive rows
 * before this rank's stream has reached the call (the previous outputs stay valid until then).
 * recv_topk_idx / weights / src_token keep the values of the dispatch that filled the handle.
 *   x, x_scales, x_dtype - as in epx_dispatch_args_t (the token count is the handle's). */
epx_status_t epx_dispatch_cached(epx_group_t group, epx_handle_t handle, const void *x,
                                 epx_dtype_t x_dtype, const float *x_scales,
                                 epx_dispatch_result_t *result, cudaStream_t stream);

/* epx_dispatch_cached_args - epx_dispatch_cached with every payload format of
 * epx_dispatch_args_t (strided or packed UE8M0 scales). COLLECTIVE; as epx_dispatch_cached.
 *   args - [IN] x, x_dtype, x_scales, x_scales_dtype, x_scales_stride_*; num_tokens must be the
 *          handle's; topk_idx, topk_weights, is_token_in_rank and num_tokens_per_expert must be
 *          NULL; the other fields are ignored (result->num_recv is the handle's
 *          num_worst_tokens when it had one, else -1). */
epx_status_t epx_dispatch_cached_args(epx_group_t group, epx_handle_t handle,
                                      const epx_dispatch_args_t *args,
                                      epx_dispatch_result_t *result, cudaStream_t stream);

typedef struct epx_combine_args {
  size_t size;          /* sizeof(epx_combine_args_t); set by EPX_COMBINE_ARGS_INIT */
  const void *x;        /* [IN] [num_recv, H] BF16 expert outputs, rows in dispatch order
                           (may be the dispatch's recv_x itself) */
  const void *topk_idx; /* [IN] weighted mode: the [T, K] ids given to dispatch, else NULL */
  epx_dtype_t topk_idx_dtype;
  const float *topk_weights; /* [IN] [T, K]: row from rank d is scaled by the sum of the weights
                                of the token's slots on d; NULL = unweighted sum */
  void *out;                 /* [OUT] [T, H] BF16, T = the dispatch's num_tokens */
  /* Top-k weight reduction (DeepEP combine's `topk_weights` -> `combined_topk_weights`): both
   * or neither, and the same choice on every rank (collective; a rank that sends none leaves
   * its share of its peers' outputs undefined). */
  const float *recv_topk_weights; /* [IN] [num_recv, K] float32 of the received rows, in
                                     dispatch order (may be the dispatch's recv_topk_weights) */
  float *out_topk_weights;        /* [OUT] [T, K] float32: out_topk_weights[t][k] = sum over the
                                     ranks d holding token t, d ascending, from +0.0f, of row
                                     (t on d)'s [k]; 0 for a token on no rank */
  const void *bias[2]; /* [IN] [T, H] BF16 each, or NULL (DeepEP combine's `bias`, one tensor or
                          a pair): added in float32 to the sum, bias[0] then bias[1], before the
                          one BF16 rounding; a token on no rank gets its bias */
} epx_combine_args_t;

#define EPX_COMBINE_ARGS_INIT                                                          \
  {                                                                                    \
    sizeof(epx_combine_args_t), NULL, NULL, EPX_DTYPE_INT64, NULL, NULL, NULL, NULL, { \
      NULL, NULL                                                                       \
    }                                                                                  \
  }

/* epx_combine - return each received row to its source token and sum the rows of one token in
 * float32, written once as BF16; tokens that chose no expert get zeros (plus their bias, if
 * any). With recv_topk_weights, each row's K weights travel with it and come back summed per
 * source token into out_topk_weights. COLLECTIVE, ordered on stream, no host synchronization;
 * capturable in a CUDA graph.
 * Returns EPX_OK once queued; EPX_ERR_INVALID_ARGUMENT naming the argument (nothing is sent, the
 * group still works); EPX_ERR_INVALID_USAGE (no dispatch in the handle yet; or a combine of the
 * group timed out on this rank before, cleared or not: the ranks' counters no longer agree,
 * destroy and re-create the group, docs/api.md "After a fault"). */
epx_status_t epx_combine(epx_group_t group, epx_handle_t handle, const epx_combine_args_t *args,
                         cudaStream_t stream);

/* ---------------------------------------------------------------------------------------------
 * Expert-major ("expanded") normal mode (docs/moe.md, "Expert-major layout"): dispatch writes
 * one row per (token, local expert) straight into its final row, each local expert's rows
 * contiguous and its segment padded to expert_alignment, so a grouped GEMM (DeepGEMM's
 * contiguous layout) reads them in place; combine takes the experts' outputs in that layout,
 * weights and sums a token's rows on the expert side and sends one BF16 row per (token, rank)
 * home, where today's combine sums the ranks' rows. Needs config.expand_max_rows > 0.
 *
 * With L = E/R local experts, on each rank:
 *  - local expert j's rows are [begin[j], begin[j] + count[j]), in source-rank then
 *    source-token order; count[j] counts a token once even if it lists j twice; begin[0] = 0,
 *    begin[j + 1] = begin[j] + count[j] rounded up to expert_alignment; rows
 *    [begin[j] + count[j], begin[j + 1]) are padding;
 *  - a row carries (source rank, source token, first top-k slot of the token listing the
 *    expert) and a weight: the sum, in float32 from 0 in ascending slot order, of the token's
 *    topk_weights over the slots listing the expert (0 without topk_weights). Padding rows
 *    carry (-1, -1, -1) and weight 0; their payload is not written.
 * tests/ref/epx_ref_expand.h is the definition, bit for bit.
 * ------------------------------------------------------------------------------------------- */

typedef struct epx_dispatch_expand_result {
  int num_rows;                  /* begin[L], padding included (sync_counts = 1), else -1 */
  int num_recv;                  /* tokens received, one per (source, token) (sync_counts = 1), else
                                    -1 */
  int capacity;                  /* config.expand_max_rows: rows the outputs can hold */
  int num_local_experts;         /* L */
  void *recv_x;                  /* [capacity, H] BF16 or FP8 in the workspace, rows as above */
  float *recv_x_scales;          /* [capacity, H/128] float32 (FP8 dispatch, float32 scales), else
                                    NULL */
  int32_t *recv_x_scales_packed; /* [capacity, ceil(H/512)] int32 UE8M0 words (FP8 dispatch
                                    with x_scales_dtype = INT32), else NULL */
  int *recv_src_info;            /* [capacity, 4] int32 per row: source rank, source token, first
                                    slot, 0 (padding: -1, -1, -1, 0) */
  float *recv_weights;           /* [capacity] float32 per row (padding: 0) */
  const int *expert_begin_device; /* device [L + 1]: begin[j]; begin[L] = the rows in all */
  const int *expert_count_device; /* device [L]: count[j], the real rows of j */
  const int *num_rows_device;     /* device int: begin[L] */
  const int *token_rows;          /* [R x max_tokens_per_rank, K] int32 in the workspace: per
                                     received token (source-rank major, as epx_dispatch's rows),
                                     its rows in ascending local expert, then -1 */
  const int *recv_rank_prefix;    /* device [R+1]: received tokens of source s are
                                     [prefix[s], prefix[s+1]) in token_rows */
  const int *num_recv_device;     /* device int: tokens received */
  /* Arrival signals (docs/moe.md, "Arrival signals"): expert_ready[j] becomes 1 once every real
   * row of local expert j below the capacity (payload, scales, src_info, weight) has landed and
   * been fanned out, before the dispatch ends: a kernel that acquire-loads 1 (ld.acquire.gpu)
   * and then reads the rows with ordinary loads (not ld.global.nc / __ldg), or a stream after
   * cuStreamWaitValue32(expert_ready + j, 1, CU_STREAM_WAIT_VALUE_EQ), sees them complete.
   * Padding rows' src_info and weights are complete only when the dispatch ends. An expert with
   * no rows is 1 from the start. The words say something only for a call that succeeds: after
   * a failed count exchange on this rank they all stay 0, after a peer's failure some may stay
   * 0 and others rise; check the call's status and the group's async error. So a waiter needs
   * its own time budget, and a kernel that spins on them must leave the dispatch its SMs (the
   * dispatch grid is config.num_sms blocks, 2 x num_sms or more with the DURING fan-out, each
   * needing a whole SM). The call's count exchange resets them, so a waiter on another stream
   * must be ordered after it: with sync_counts = 1 anything queued after the call returns is;
   * otherwise wait for counts_event (under stream capture, from a stream forked into the same
   * capture). Valid until the next dispatch of the group, as the rows. Today's sending order
   * (by token) completes most experts near the end of the transfer (docs/moe.md). */
  const uint32_t *expert_ready; /* device [L] uint32, in the workspace */
  cudaEvent_t counts_event;     /* recorded on the call's stream after its count exchange */
} epx_dispatch_expand_result_t;

/* epx_dispatch_expand - epx_dispatch into the expert-major layout. COLLECTIVE: every rank
 * calls it (T may be 0), in the same order as the group's other collectives. Ordered on
 * stream; with sync_counts = 1 the host waits for the count exchange only (as epx_dispatch).
 *   handle - [IN/OUT] records the routing for epx_combine_expand (and epx_combine, whose x is
 *            then in epx_dispatch's row order).
 *   args   - [IN] as epx_dispatch's, with these differences: topk_idx is required (no rank-mask
 *            routing: is_token_in_rank and num_tokens_per_expert must be NULL); num_worst_tokens
 *            must be 0; recv_topk_idx_dtype is ignored (no recv_topk_idx is written);
 *            expert_alignment (0 or 1: none) pads each local expert's segment;
 *            num_recv_per_expert (sync_counts = 1) gets count[j], the real rows of each local
 *            expert (epx_dispatch gives the aligned counts).
 *   result - [OUT] where the rows are; valid until the next dispatch of the group.
 * Rows past the capacity are not written (their token_rows entries are -1): the receiver
 * raises EPX_ERR_INVALID_ARGUMENT asynchronously (stage DISPATCH, position = capacity, value =
 * the rows needed), and with sync_counts = 1 the call returns EPX_ERR_INVALID_ARGUMENT with
 * result filled in (num_rows = the rows needed).
 * Returns EPX_OK once queued; EPX_ERR_INVALID_ARGUMENT naming the argument (nothing sent, but
 * for too many tokens, as epx_dispatch: the result then num_rows = num_recv = -1);
 * EPX_ERR_INVALID_USAGE (group without config.expand_max_rows, sync_counts on a capturing
 * stream); EPX_ERR_TIMEOUT as epx_dispatch. Capturable with sync_counts = 0. */
epx_status_t epx_dispatch_expand(epx_group_t group, epx_handle_t handle,
                                 const epx_dispatch_args_t *args,
                                 epx_dispatch_expand_result_t *result, cudaStream_t stream);

typedef struct epx_combine_expand_args {
  size_t size;   /* sizeof(epx_combine_expand_args_t); set by EPX_COMBINE_EXPAND_ARGS_INIT */
  const void *x; /* [IN] [num_rows, H] BF16 expert outputs, row for row as epx_dispatch_expand
                    delivered them (padding rows are not read); 16-byte aligned. May be the
                    dispatch's recv_x (BF16 dispatch) */
  int weighted;  /* 1: each row times its recv_weights entry; 0: plain sum */
  void *out;     /* [OUT] [T, H] BF16, T = the dispatch's num_tokens */
} epx_combine_expand_args_t;

#define EPX_COMBINE_EXPAND_ARGS_INIT \
  { sizeof(epx_combine_expand_args_t), NULL, 1, NULL }

/* epx_combine_expand - combine of an expert-major dispatch: rank d computes, for each token it
 * received, partial = BF16(sum over the token's rows on d, ascending local expert, of w x y),
 * w = the row's weight (weighted) or 1, each product and sum rounded to float32 (no fused
 * multiply-add), and sends it home into the combine slab; the home rank writes
 * out[t] = BF16(sum over ranks d holding t, d ascending, of partial_d), +0 for a token on no
 * rank. Bit for bit tests/ref/epx_ref_expand.h's epx_ref_combine_expand. COLLECTIVE, ordered
 * on stream, no host synchronization, capturable. The handle's last dispatch must be an
 * epx_dispatch_expand, and no dispatch of the group may have run since (its token_rows and
 * weights are in the workspace).
 * Returns EPX_OK once queued; EPX_ERR_INVALID_ARGUMENT naming the argument (nothing sent);
 * EPX_ERR_INVALID_USAGE (no expand dispatch in the handle; a combine timed out before, as
 * epx_combine). Timeouts as epx_combine. */
epx_status_t epx_combine_expand(epx_group_t group, epx_handle_t handle,
                                const epx_combine_expand_args_t *args, cudaStream_t stream);

/* ---------------------------------------------------------------------------------------------
 * Low-latency mode (decode): fixed-slot dispatch and combine. Needs EPX_MODE_LOW_LATENCY and a
 * hidden size that is a multiple of 128. How it works: docs/low-latency.md.
 *
 * With L = E/R local experts and M = ll_max_tokens_per_rank, each rank owns, in the group's
 * workspace, an expert-major receive buffer of L x (R*M) rows. Source rank s writes its rows of
 * local expert j at the FIXED slots [j][s*M + i], i = 0, 1, ... in ascending token order, one
 * row per distinct (token, expert) pair (a token listing an expert twice sends it once). So a
 * sender computes every address alone: no count exchange, no host synchronization, no copy on
 * the receiver. The rows of expert j are the R segments [s*M, s*M + num[j][s]); rows between
 * segments are stale. A grouped GEMM takes the segments (begin, num) or masks by source.
 *
 * Two buffers alternate between consecutive dispatches, so two micro-batches can be in flight:
 * a dispatch's outputs stay valid until the dispatch after next. Nothing is zeroed between
 * calls: every signal carries a call epoch kept on the device, so a CUDA graph with both calls
 * replays correctly.
 * ------------------------------------------------------------------------------------------- */

/* Completes the receive half of a split call (epx_ll_recv). id 0 means nothing is pending. */
typedef struct epx_ll_hook {
  unsigned long long id;
} epx_ll_hook_t;

typedef struct epx_ll_dispatch_args {
  size_t size;                /* sizeof(epx_ll_dispatch_args_t); set by EPX_LL_DISPATCH_ARGS_INIT */
  const void *x;              /* [IN] [T, H] BF16, 16-byte aligned */
  const void *topk_idx;       /* [IN] [T, K] expert ids, -1 = empty slot */
  epx_dtype_t topk_idx_dtype; /* EPX_DTYPE_INT64 or EPX_DTYPE_INT32 */
  const float *topk_weights;  /* [IN] [T, K] float32 combine weights, or NULL (all 1); may be
                                 given to epx_ll_combine instead, as DeepEP does */
  int num_tokens;             /* T, 0..ll_max_tokens_per_rank */
  epx_dtype_t recv_dtype;     /* EPX_DTYPE_BF16 (copied) or EPX_DTYPE_FP8_E4M3 (quantized on the
                                 fly, one float32 scale per 128 channels) */
  int ue8m0;                  /* FP8: 1 = round every scale up to a power of two */
  int split;                  /* 1: return after issuing the sends; epx_ll_recv(result->hook)
                                 completes the receive later. 0: one kernel does both */
  int packed;                 /* 1: DeepEP's packed layout: the rows of local expert j are
                                 [0, recv_count[j]), source s's rows contiguous from
                                 recv_begin[j][s] (sources in rank order); no row past
                                 recv_count[j] is written. Routes BY_RANK and DISPATCH_BY_RANK
                                 only (DIRECT: EPX_ERR_UNSUPPORTED). 0: fixed slots */
  int ue8m0_packed;           /* with ue8m0 = 1: the scales come out as int32 words of four UE8M0
                                 exponents, result->recv_x_scales_packed (DeepGEMM's format) */
  long long *layout_range;    /* [OUT] optional, packed = 1 only: device [L, R] int64,
                                 (begin << 32) | count per (local expert, source), as DeepEP's
                                 packed_recv_layout_range; valid with the other outputs */
} epx_ll_dispatch_args_t;

#define EPX_LL_DISPATCH_ARGS_INIT                                                                  \
  {                                                                                                \
    sizeof(epx_ll_dispatch_args_t), NULL, NULL, EPX_DTYPE_INT64, NULL, 0, EPX_DTYPE_BF16, 0, 0, 0, \
        0, NULL                                                                                    \
  }

typedef struct epx_ll_dispatch_result {
  int num_tokens;          /* T this rank dispatched (the rows its combine returns) */
  int num_local_experts;   /* L = E/R */
  int rows_per_expert;     /* R x M, M = the group's ll_max_tokens_per_rank */
  int max_tokens_per_rank; /* M: the group's ll_max_tokens_per_rank */
  epx_dtype_t recv_dtype;
  /* Device arrays in the workspace, valid until the dispatch after next: */
  void *recv_x;               /* [L, R*M, H] BF16 or FP8 E4M3 */
  float *recv_x_scales;       /* FP8: [L, R*M, H/128] float32 scales, else NULL */
  int *recv_src_info;         /* [L, R*M, 4] int32 per row: source rank, source token, the source's
                                 first top-k slot naming the expert, 0 */
  int *recv_count;            /* [L] rows of local expert j (summed over sources) */
  int *recv_begin;            /* [L, R] first row of source s in expert j: s*M (fixed slots),
                                 the rows of sources < s (packed) */
  int *recv_num;              /* [L, R] rows of source s in expert j */
  void *combine_input;        /* [L, R*M, H] BF16 in the workspace: an expert GEMM may write its
                                 output here and pass NULL (or this pointer) as epx_ll_combine x */
  int buffer;                 /* which of the two buffers (0 or 1) this dispatch used */
  unsigned long long call_id; /* identifies this dispatch to epx_ll_combine */
  epx_ll_hook_t hook;         /* split: pass to epx_ll_recv before using the outputs; else id 0 */
  int packed;                 /* the layout: 1 packed (args->packed), 0 fixed slots */
  int *recv_x_scales_packed;  /* ue8m0_packed: [L, R*M, ceil(H/512)] int32, word w of a row holds
                                 the exponent byte (bits 23..30 of the float32 power of two) of
                                 channel group 4w + i in bits 8i..8i+7 (unused bytes 0); the
                                 float recv_x_scales is NULL then. Else NULL */
} epx_ll_dispatch_result_t;

/* epx_ll_dispatch - send this rank's tokens to the experts they chose, low-latency mode.
 * COLLECTIVE: every rank calls it (T may be 0), in the same order as the group's other
 * low-latency calls. Ordered on stream; no host synchronization; capturable in a CUDA graph.
 *   args   - [IN] tokens, routing, receive dtype, split.
 *   result - [OUT] where this rank's received rows are; keep it for epx_ll_combine.
 * With args->split = 1 the kernel returns once its sends are issued and holds no SM afterwards;
 * the outputs are valid only after epx_ll_recv(group, &result->hook, stream) has run.
 * Returns EPX_OK once queued; EPX_ERR_INVALID_ARGUMENT naming the argument (nothing is sent, the
 * group still works); EPX_ERR_INVALID_USAGE (group without low-latency mode, or the buffer this
 * call would use still has a receive pending). Expert ids outside [-1, E) are reported
 * asynchronously (EPX_ERR_INVALID_ARGUMENT, stage EPX_STAGE_LL_DISPATCH) and treated as empty.
 * A peer that does not answer within timeout_ms is masked (EPX_ERR_PEER_FAILED, see
 * epx_group_get_peer_mask): the call completes without it. */
epx_status_t epx_ll_dispatch(epx_group_t group, const epx_ll_dispatch_args_t *args,
                             epx_ll_dispatch_result_t *result, cudaStream_t stream);

typedef struct epx_ll_combine_args {
  size_t size;   /* sizeof(epx_ll_combine_args_t); set by EPX_LL_COMBINE_ARGS_INIT */
  const void *x; /* [IN] [L, R*M, H] BF16 expert outputs, row for row as the dispatch delivered
                    them (only the rows of each (expert, source) segment are read); NULL = the
                    dispatch's combine_input in the workspace (zero copy) */
  const epx_ll_dispatch_result_t *dispatch; /* [IN] the dispatch whose rows these are */
  void *out;                                /* [OUT] [T, H] BF16, T = dispatch->num_tokens */
  int split;                 /* 1: return after the sends; epx_ll_recv(hook) writes out later */
  epx_ll_hook_t *hook;       /* [OUT] split only: the hook to pass to epx_ll_recv */
  const float *topk_weights; /* [IN] [T, K] float32 combine weights of the dispatch's tokens, in
                                the slot order of its topk_idx (DeepEP's low_latency_combine
                                topk_weights), read when the receive runs (split: by
                                epx_ll_recv); NULL = the dispatch's topk_weights. Route BY_RANK:
                                every rank passes weights or none (see epx_ll_combine) */
} epx_ll_combine_args_t;

#define EPX_LL_COMBINE_ARGS_INIT \
  { sizeof(epx_ll_combine_args_t), NULL, NULL, NULL, 0, NULL, NULL }

/* epx_ll_combine - return every row of a low-latency dispatch to its source token:
 *   out[t] = BF16( sum over the token's valid top-k slots k of w[t][k] * x[row of (t, e_k)] )
 * summed in float32, w = args->topk_weights if given, else the dispatch's topk_weights (1 when
 * NULL); tokens with no valid slot, and slots on masked peers, contribute nothing (a token with
 * none is +0). The slots and experts are always the dispatch's: there is no topk_idx argument
 * (DeepEP's combine takes the dispatch's ids again; EPX kept them in the workspace).
 * Combine-time weights are applied by this rank as it reduces the returned rows, so route BY_RANK
 * (which sums w * y on the expert side, where these weights are unknown) runs the DIRECT combine
 * for such a call: one returned BF16 row per (token, expert) instead of one float32 partial per
 * (token, rank); all ranks must then pass weights alike (all or none), since the two combines
 * exchange different rows. Routes DIRECT and DISPATCH_BY_RANK run as without weights.
 * COLLECTIVE, ordered on stream, no host synchronization, capturable in a CUDA graph. The
 * dispatch must be one of the two most recent and its receive complete. With args->split = 1 the
 * kernel returns after its sends; out is written by epx_ll_recv(group, args->hook, stream).
 * Returns EPX_OK once queued; EPX_ERR_INVALID_ARGUMENT naming the argument; EPX_ERR_INVALID_USAGE
 * (stale or still-pending dispatch). */
epx_status_t epx_ll_combine(epx_group_t group, const epx_ll_combine_args_t *args,
                            cudaStream_t stream);

/* epx_ll_recv - the receive half of a split epx_ll_dispatch or epx_ll_combine: waits (on the
 * GPU, bounded by timeout_ms) for the peers' data, then writes the outputs. COLLECTIVE in the
 * sense that every rank must eventually call it for the same split calls, in the same order as
 * the sends. Must be ordered after the send on the GPU (same stream, or an event); other work
 * may run in between. Capturable.
 *   hook - [IN/OUT] the hook of the split call; its id is set to 0.
 * Returns EPX_OK once queued; EPX_ERR_INVALID_ARGUMENT (NULL hook); EPX_ERR_INVALID_USAGE (the
 * hook is not pending: completed already, or from another group). */
epx_status_t epx_ll_recv(epx_group_t group, epx_ll_hook_t *hook, cudaStream_t stream);

/* epx_group_get_peer_mask - the peers this rank has masked (bit p = rank p) after they stopped
 * answering a low-latency call within timeout_ms, or with epx_group_mask_peer (DeepEP's
 * low_latency_query_mask_buffer). Reads the device word without waiting for any stream. Not
 * collective.
 *   mask - [OUT] 0 when every peer answers. */
epx_status_t epx_group_get_peer_mask(epx_group_t group, unsigned int *mask);

/* epx_group_mask_peer - mask `peer` on demand (DeepEP's low_latency_update_mask_buffer(rank,
 * True)): low-latency calls of this rank ordered after this one on the GPU neither send to the
 * peer nor wait for it, exactly as after a timeout, but no async error is recorded. A kernel of
 * one thread sets the bit in this rank's mask, stream-ordered; epx_group_get_peer_mask sees it
 * once that kernel ran (synchronize stream first). Not collective: each rank masks for itself,
 * and a rank that keeps calling still sees the masked peer's results unless the peer masks it
 * too. Unmask with epx_group_clear_peer_mask (collective; DeepEP unmasks one rank at a time, EPX
 * restarts every epoch so all peers come back together). Capturable.
 *   peer - [IN] a rank of the group other than this one.
 * Returns EPX_OK once queued; EPX_ERR_INVALID_ARGUMENT (peer out of range or this rank);
 * EPX_ERR_INVALID_USAGE (group without low-latency mode). */
epx_status_t epx_group_mask_peer(epx_group_t group, int peer, cudaStream_t stream);

/* epx_group_clear_peer_mask - unmask every peer once the failed ranks are back (DeepEP's
 * low_latency_clean_mask_buffer). COLLECTIVE over
 * every rank (the recovered ones included); synchronizes the device and the ranks (an
 * agreement through the workspace, bounded by timeout_ms), then moves every low-latency epoch
 * of every rank to one common value so that no signal of the failed period can be mistaken for
 * a new one, and every rank's count of epx_group_barrier_unmasked calls to the largest (those
 * left a masked rank behind). The async error record is kept (clear it with
 * epx_group_clear_async_error). Like every collective call, the ranks must reach it within
 * timeout_ms of each other: it returns EPX_ERR_TIMEOUT, with nothing cleared, when some rank does
 * not take part in time (it is dead, stalled or late; a late one gets the same error at once); call
 * it again on every rank once they are all there. */
epx_status_t epx_group_clear_peer_mask(epx_group_t group);

/* ---------------------------------------------------------------------------------------------
 * In-kernel tracing (docs/profiling.md). While a group traces, its kernels record the begin
 * and end of their stages (per block and warp, %globaltimer) into a preallocated device buffer
 * on each rank; a dump gathers every rank's events, aligns the GPUs' clocks and writes one
 * Chrome trace JSON file (pid = rank, tid = block/warp) that Perfetto and chrome://tracing
 * load. Off by default; when off a kernel pays one predictable branch per record site.
 * EPX_TRACE=path traces a group from its creation to its destruction (docs/env.md).
 * Tracing start and dump are group barriers: order them with the group's other barriers and
 * collectives (one stream, or synchronized streams).
 * ------------------------------------------------------------------------------------------- */

/* What a dump wrote; the same on every rank. */
typedef struct epx_trace_summary {
  long long num_events;      /* events written, all ranks */
  long long num_dropped;     /* events lost because a rank's buffer was full, all ranks */
  long long clock_spread_ns; /* largest spread of a rank's measured clock offset over the sync
                                rounds: the jitter of the alignment (docs/profiling.md) */
  long long clock_drift_ns;  /* largest change of a rank's offset between start and dump */
  long long timer_tick_ns;   /* step of the GPUs' %globaltimer (largest over ranks) */
} epx_trace_summary_t;

/* epx_trace_start - start recording the group's kernels on every rank. COLLECTIVE.
 * Empties (allocating once, or when the capacity changes) this rank's buffer, then queues on
 * stream a barrier kernel that measures the GPUs' clock offsets. Kernels the group launches
 * after the call, on any stream, are recorded until epx_trace_dump; kernels captured into a
 * CUDA graph while tracing keep recording when the graph is replayed.
 *   capacity - [IN] events kept per rank, 1..2^24 (24 bytes each); 0 = auto (EPX_TRACE_EVENTS
 *              or 65536). Events beyond it are counted as dropped, not written.
 *   stream   - [IN] orders the clock measurement with the caller's work; not a capturing one.
 * Returns EPX_OK; EPX_ERR_INVALID_ARGUMENT (capacity); EPX_ERR_INVALID_USAGE (already
 * tracing, or stream is capturing); EPX_ERR_UNSUPPORTED (built with TRACE=0); EPX_ERR_CUDA. */
epx_status_t epx_trace_start(epx_group_t group, int capacity, cudaStream_t stream);

/* epx_trace_dump - stop recording and write the trace. COLLECTIVE; synchronizes stream.
 * Queues the second clock measurement on stream, waits for it, gathers every rank's events to
 * rank 0 over the group's communicator and has rank 0 write `path` (replaced if it exists). A
 * rank with no events is fine. Events lost to a full buffer are counted per rank in the file
 * and in summary, and logged as a warning. Tracing is off afterwards; start it again for a
 * new window (the buffer is kept).
 *   path    - [IN] the JSON file (rank 0 only; other ranks' value is ignored); NULL: discard.
 *   summary - [OUT] optional: counts and clock figures, filled on every rank.
 *   stream  - [IN] the stream the traced work was queued on; not a capturing one.
 * Returns EPX_OK; EPX_ERR_INVALID_USAGE if some rank was not tracing (every rank returns it,
 * naming the rank; nothing is written); EPX_ERR_TIMEOUT if some rank does not take part within
 * timeout_ms (dead, stalled or late: every rank, the late one too, returns it within two
 * budgets; nothing is written; tracing is off), or if the events' NCCL transfer does not end
 * within ten budgets (a rank died after agreeing; the message says the operation stays pending:
 * destroy the group, then abort the communicator); EPX_ERR_SYSTEM on rank 0 if the file cannot
 * be written; EPX_ERR_CUDA / EPX_ERR_NCCL. */
epx_status_t epx_trace_dump(epx_group_t group, const char *path, epx_trace_summary_t *summary,
                            cudaStream_t stream);

/* ---------------------------------------------------------------------------------------------
 * Experts' FFN: the SwiGLU feed-forward of the experts one GPU holds, on the rows a dispatch
 * delivered (docs/moe.md). Needs no group: out = down(silu(gate(x)) * up(x)) per expert, with
 * each expert's row count read on the device, so it needs no host synchronization and is
 * capturable in a CUDA graph. Built for decode-sized groups (tens of rows per expert), where
 * reading the weights is the cost: each CTA streams a tile of one expert's weights once per
 * 32 rows.
 * ------------------------------------------------------------------------------------------- */

/* The weights of E experts. Row-major, K contiguous (nn.Linear's [out, in] and vLLM's
 * w13 / w2): */
typedef struct epx_experts {
  size_t size;              /* sizeof(epx_experts_t); set by EPX_EXPERTS_INIT */
  int num_experts;          /* E >= 1: the experts held here */
  int hidden;               /* H: multiple of 128 */
  int intermediate;         /* I: multiple of 128 */
  epx_dtype_t weight_dtype; /* EPX_DTYPE_BF16, or EPX_DTYPE_FP8_E4M3 with block scales */
  const void *gate_up;      /* [E, 2I, H]: expert e's gate rows [0, I) then its up rows [I, 2I) */
  const float *gate_up_scales; /* FP8: [E, 2I/128, H/128] float32; block (n/128, k/128) of
                                  expert e is float(w) * scale (DeepSeek-V3's weight_scale_inv) */
  const void *down;            /* [E, H, I] */
  const float *down_scales;    /* FP8: [E, H/128, I/128] float32 */
} epx_experts_t;

#define EPX_EXPERTS_INIT \
  { sizeof(epx_experts_t), 0, 0, 0, EPX_DTYPE_BF16, NULL, NULL, NULL, NULL }

/* Where each expert's rows are, and where the results go. Two layouts:
 *  - masked (expert_begin NULL): expert e's rows are [e * rows_per_expert, + count[e]), as
 *    epx_ll_dispatch delivers them (recv_x, recv_count, rows_per_expert; write out to
 *    combine_input);
 *  - contiguous (expert_begin set): expert e's rows are [begin[e], begin[e] + count[e]).
 * Rows outside every expert's range are neither read nor written. */
typedef struct epx_experts_ffn_args {
  size_t size;             /* sizeof(epx_experts_ffn_args_t); set by EPX_EXPERTS_FFN_ARGS_INIT */
  const void *x;           /* [IN] [num_rows, H], 16-byte aligned: BF16, or FP8 E4M3 (FP8
                              weights only) */
  epx_dtype_t x_dtype;     /* EPX_DTYPE_BF16 or EPX_DTYPE_FP8_E4M3 */
  const float *x_scales;   /* [IN] FP8 x: [num_rows, H/128] float32 (per-128-channel, as
                              epx_ll_dispatch's recv_x_scales) */
  int num_rows;            /* rows of x and out */
  const int *expert_count; /* [IN] device [E]: rows of expert e. A count past the expert's
                              room (rows_per_expert, or num_rows - begin) is cut to it; a
                              negative count, or a begin outside [0, num_rows], means none */
  const int *expert_begin; /* [IN] device [E] or NULL (masked layout) */
  int rows_per_expert;     /* masked layout: each expert's stride and room; E * rows_per_expert
                              <= num_rows. Ignored with expert_begin */
  void *out;               /* [OUT] [num_rows, H] BF16, 16-byte aligned; may not overlap x */
  void *workspace;         /* device scratch of epx_experts_ffn_workspace_size bytes,
                              256-byte aligned; not shared by two calls in flight */
  size_t workspace_bytes;
} epx_experts_ffn_args_t;

#define EPX_EXPERTS_FFN_ARGS_INIT \
  { sizeof(epx_experts_ffn_args_t), NULL, EPX_DTYPE_BF16, NULL, 0, NULL, NULL, 0, NULL, NULL, 0 }

/* epx_experts_ffn_workspace_size - scratch bytes epx_experts_ffn needs for num_rows rows:
 * the intermediate activations (BF16, or FP8 and scales), and FP8 x when BF16 rows meet FP8
 * weights. Local; no GPU work.
 * Returns EPX_OK; EPX_ERR_INVALID_ARGUMENT naming the field. */
epx_status_t epx_experts_ffn_workspace_size(const epx_experts_t *experts, int num_rows,
                                            epx_dtype_t x_dtype, size_t *bytes);

/* epx_experts_ffn - out[r] = down_e(silu(gate_e(x[r])) * up_e(x[r])) for every row r of every
 * expert e. Local (no group, no other rank); ordered on stream; no host synchronization;
 * capturable in a CUDA graph. BF16 weights: accumulates in float32; the intermediate is
 * rounded to BF16. FP8 weights: x (quantized first if BF16) and the intermediate are FP8 with
 * per-128-channel scales (tests/ref/epx_ref.h's rule), each 128-deep block of products scaled
 * by the weight block's and the row's scales (DeepSeek-V3's inference recipe); the products
 * are summed 32 at a time on the tensor cores (which keep fewer bits than float32 in such a
 * sum), those sums in float32. Needs a Hopper GPU (sm_90) with FP8 weights.
 * Returns EPX_OK once queued; EPX_ERR_INVALID_ARGUMENT naming the field (nothing queued);
 * EPX_ERR_UNSUPPORTED (BF16 weights with FP8 x); EPX_ERR_CUDA. */
epx_status_t epx_experts_ffn(const epx_experts_t *experts, const epx_experts_ffn_args_t *args,
                             cudaStream_t stream);

/* ---------------------------------------------------------------------------------------------
 * MoE layer at decode (docs/moe.md): router output to layer output in one call, on a group
 * with low-latency mode. Runs epx_ll_dispatch (packed layout, the tokens' weights given to the
 * dispatch), epx_experts_ffn on the received rows with its output written straight into the
 * dispatch's combine buffer, and epx_ll_combine (zero copy):
 *   out[t] = sum over t's valid top-k slots k of w[t][k] * FFN_{e_k}(x[t])
 * with x[t] as the dispatch delivers it (BF16, or FP8 with per-128-channel scales). No host
 * synchronization; capturable in a CUDA graph.
 * ------------------------------------------------------------------------------------------- */

typedef struct epx_moe_args {
  size_t size;                /* sizeof(epx_moe_args_t); set by EPX_MOE_ARGS_INIT */
  const void *x;              /* [IN] [T, H] BF16, 16-byte aligned */
  const void *topk_idx;       /* [IN] [T, K] expert ids, -1 = empty slot */
  epx_dtype_t topk_idx_dtype; /* EPX_DTYPE_INT64 or EPX_DTYPE_INT32 */
  const float *topk_weights;  /* [IN] [T, K] float32 gate weights, or NULL (all 1) */
  int num_tokens;             /* T, 0..ll_max_tokens_per_rank */
  epx_dtype_t dispatch_dtype; /* EPX_DTYPE_BF16, or EPX_DTYPE_FP8_E4M3 (quantized on the fly,
                                 half the bytes on the wire; FP8 weights only) */
  void *out;                  /* [OUT] [T, H] BF16, 16-byte aligned */
  void *workspace;            /* device scratch of epx_moe_workspace_size bytes, 256-byte
                                 aligned; not shared by two calls in flight */
  size_t workspace_bytes;
} epx_moe_args_t;

#define EPX_MOE_ARGS_INIT \
  { sizeof(epx_moe_args_t), NULL, NULL, EPX_DTYPE_INT64, NULL, 0, EPX_DTYPE_BF16, NULL, NULL, 0 }

/* epx_moe_workspace_size - scratch bytes epx_moe_decode needs on this group with these
 * experts: the FFN's intermediate rows for every row the dispatch can deliver (L x R x M,
 * M = ll_max_tokens_per_rank). Local; no GPU work.
 * Returns EPX_OK; EPX_ERR_INVALID_ARGUMENT naming the field; EPX_ERR_INVALID_USAGE (group
 * without low-latency mode); EPX_ERR_UNSUPPORTED (FP8 dispatch with BF16 weights). */
epx_status_t epx_moe_workspace_size(epx_group_t group, const epx_experts_t *experts,
                                    epx_dtype_t dispatch_dtype, size_t *bytes);

/* epx_moe_decode - one MoE layer at decode size: dispatch, the local experts' SwiGLU FFN,
 * combine. COLLECTIVE like epx_ll_dispatch (every rank calls it, T may be 0, in the same order
 * as the group's other low-latency calls); ordered on stream; no host synchronization;
 * capturable. experts holds this rank's L = E/R experts (expert r*L + j is this rank's j) with
 * the group's hidden size. Uses one of the group's two low-latency buffers, as a dispatch and
 * its combine do; the rows it received are not returned. With route DISPATCH_BY_RANK (the
 * default) the down projection writes each row it finishes straight into its token's receive
 * row on the source rank, so the combine's send overlaps the experts still computing (route
 * BY_RANK sums on the expert side first and sends after the FFN; docs/moe.md).
 * Every argument is checked before anything is queued, identically on every rank for the
 * group's shape, so a refused call leaves no peer waiting. Once the dispatch is queued the
 * combine is queued too, even after an FFN launch failure (returned, EPX_ERR_CUDA), with its
 * signals marked: every peer leaves this rank's slots out, records EPX_ERR_PEER_DATA (stage
 * LL_COMBINE, naming this rank) and does not mask it (docs/api.md, "After a fault").
 * Returns EPX_OK once queued; EPX_ERR_INVALID_ARGUMENT naming the argument; EPX_ERR_UNSUPPORTED
 * (route DIRECT, which has no packed layout; FP8 dispatch with BF16 weights);
 * EPX_ERR_INVALID_USAGE (as epx_ll_dispatch); EPX_ERR_CUDA (an FFN launch, after the combine
 * was queued); asynchronous errors as epx_ll_dispatch and epx_ll_combine. */
epx_status_t epx_moe_decode(epx_group_t group, const epx_experts_t *experts,
                            const epx_moe_args_t *args, cudaStream_t stream);

/* ---------------------------------------------------------------------------------------------
 * MoE layer at prefill (docs/moe.md, "MoE layer at prefill"): router output to layer output in
 * normal mode, on the expert-major layout: epx_dispatch_expand (sync_counts = 1: the host learns
 * each local expert's row count), the local experts' SwiGLU FFN (BF16 weights: cuBLAS, one
 * batched GEMM per projection or one GEMM per expert; FP8 block-scaled weights: EPX's grouped
 * FP8 GEMM, one launch per projection for every expert, or cuBLASLt's 128x128 / 1x128 block
 * scaling per expert, or EPX's own epx_experts_ffn: config.ffn_backend), and
 * epx_combine_expand (weighted):
 *   out[t] = sum over t's valid top-k slots k of w[t][k] * FFN_{e_k}(x[t])
 * Overlap: the tokens are cut into chunks pipelined over two groups, so that chunk c+1's
 * dispatch and chunk c-1's combine (config.num_sms blocks) run while chunk c's GEMMs use the
 * other SMs. A plan holds what a call needs beyond the caller's buffers: the groups, one handle
 * per group, two streams (communication at the highest priority, compute), events, the cuBLAS
 * handles and repacked FP8 scales.
 * The layer synchronizes the host once per chunk (the count exchange), so it is not capturable
 * in a CUDA graph.
 * ------------------------------------------------------------------------------------------- */

typedef struct epx_moe_prefill *epx_moe_prefill_t;

/* Which GEMMs run the experts' FFN. */
typedef enum epx_moe_ffn_backend {
  EPX_MOE_FFN_AUTO = 0,   /* BF16 weights: EPX_MOE_FFN_CUBLAS_GROUPED; FP8 weights:
                             EPX_MOE_FFN_EPX_GROUPED where it runs and an expert's gate/up GEMM
                             in a chunk is small: under 1e10 operations on the rows a uniform
                             routing of max_tokens_per_rank tokens a rank, cut into num_chunks,
                             gives it (the rule assumes calls of about max_tokens_per_rank
                             tokens; at 4096 tokens a rank and two chunks that is Qwen3-30B-A3B's
                             experts at 2-8 ranks and DeepSeek-V3's at 2); else cuBLASLt where it
                             has a kernel; else (or no cuBLAS at all) EPX. The same on every rank
                             of one machine type; where a choice fell back, epx_last_error says
                             why (docs/moe.md, "Which FFN AUTO runs") */
  EPX_MOE_FFN_CUBLAS = 1, /* cuBLAS / cuBLASLt, one GEMM per (expert, projection) over the GEMM
                             lanes; refused at creation if it has no kernel */
  EPX_MOE_FFN_EPX = 2,    /* epx_experts_ffn (built for decode sizes) */
  EPX_MOE_FFN_CUBLAS_GROUPED = 3, /* BF16 weights only: one cublasGemmBatchedEx per projection
                                    for all of a chunk's experts, each on a block of the largest
                                    expert's rows: two host calls per chunk instead of two per
                                    expert; a chunk whose blocks would add over 50% padding
                                    runs one GEMM per expert (docs/moe.md). Refused at
                                    creation with FP8 weights */
  EPX_MOE_FFN_EPX_GROUPED = 4     /* FP8 weights only: EPX's grouped FP8 GEMM, one launch per
                                     projection for all of a chunk's experts, each expert's rows
                                     read from device memory (TMA and wgmma; Hopper). No per-expert
                                     host calls, so no GEMM lanes; FP8 on the wire as with cuBLAS.
                                     Refused at creation with BF16 weights or on a GPU other than
                                     compute capability 9.0. Its GEMMs take every SM unless
                                     gemm_sms says otherwise. Faster than cuBLASLt at
                                     Qwen3-30B-A3B's expert shape, level with it at
                                     DeepSeek-V3's at 2 ranks and slower at 4 (docs/moe.md) */
} epx_moe_ffn_backend_t;

typedef struct epx_moe_prefill_config {
  size_t size;        /* sizeof(epx_moe_prefill_config_t); set by EPX_MOE_PREFILL_CONFIG_INIT */
  int num_chunks;     /* chunks of an overlapped call, 2..16; 0 = auto (2). Every rank must use the
                         same value (each chunk is one dispatch and one combine, collective) */
  int ffn_backend;    /* epx_moe_ffn_backend_t; 0 = auto */
  int gemm_sms;       /* SMs the GEMMs are tuned for while communication runs beside them
                         (cuBLAS's SM count target; EPX's grouped FP8 GEMM's CTAs); 0 = auto:
                         the GPU's SMs minus the group's config.num_sms, every SM with EPX's
                         grouped FP8 GEMM; chain calls always target every SM, and so does the
                         batched backend's down projection (docs/moe.md) */
  int gemm_lanes;     /* streams the per-expert GEMMs are spread over (EPX_MOE_FFN_CUBLAS, and
                         the batched backend's chunks that fall back to them), 1..8; 0 = auto
                         (4); not used by the EPX and EPX grouped backends (info says 1).
                         An expert's GEMM has a few hundred rows at prefill, too few tiles to
                         fill the GPU alone: lanes run several experts' GEMMs at once */
  int dispatch_dtype; /* what crosses NVLink: 0 = auto (FP8 where the weights are FP8, the FFN
                         runs on cuBLAS or EPX_MOE_FFN_EPX_GROUPED and the groups'
                         config.dtypes has FP8, else BF16),
                         EPX_DTYPE_BF16, or EPX_DTYPE_FP8_E4M3 (the layer quantizes each chunk's
                         tokens per 128 channels before its dispatch, the rule the expert side
                         would apply: the same codes and scales, half the bytes; needs FP8
                         weights on cuBLAS or EPX_MOE_FFN_EPX_GROUPED and FP8 groups). Every rank
                         must come out with the same (info.dispatch_dtype): auto follows the local
                         weights and backend, so pass it explicitly where ranks could differ (e.g.
                         cuBLAS installed on some hosts only); a mismatch is not detected. (With
                         this field the struct grew from 0.1.0's 24 bytes, so a caller built against
                         0.1.0 is refused by its size.) */
} epx_moe_prefill_config_t;

#define EPX_MOE_PREFILL_CONFIG_INIT \
  { sizeof(epx_moe_prefill_config_t), 0, 0, 0, 0, 0 }

/* What a plan resolved (epx_moe_prefill_get_info). */
typedef struct epx_moe_prefill_info {
  size_t size;          /* sizeof(epx_moe_prefill_info_t); set by EPX_MOE_PREFILL_INFO_INIT */
  int num_chunks;       /* [OUT] of an overlapped call */
  int num_groups;       /* [OUT] 1 (chain only) or 2 */
  int ffn_backend;      /* [OUT] EPX_MOE_FFN_CUBLAS, EPX_MOE_FFN_CUBLAS_GROUPED, EPX_MOE_FFN_EPX or
                           EPX_MOE_FFN_EPX_GROUPED */
  int gemm_sms;         /* [OUT] SM count target of overlapped GEMMs (not the batched down) */
  int gate_up_out_fp32; /* [OUT] FP8 cuBLASLt: 1 if the gate/up GEMM writes float32 (else BF16) */
  int expert_alignment; /* [OUT] the alignment the layer's dispatches pad each expert to */
  size_t workspace_bytes; /* [OUT] epx_moe_prefill_workspace_size */
  int gemm_lanes;         /* [OUT] streams the per-expert GEMMs run on (1 with EPX's FFN) */
  int dispatch_dtype;     /* [OUT] EPX_DTYPE_BF16 or EPX_DTYPE_FP8_E4M3: what the dispatches
                             carry */
} epx_moe_prefill_info_t;

#define EPX_MOE_PREFILL_INFO_INIT \
  { sizeof(epx_moe_prefill_info_t), 0, 0, 0, 0, 0, 0, 0, 0, 0 }

/* epx_moe_prefill_create - a plan for the prefill layer on these groups with these experts. Not
 * collective (no communication); creates streams, events, one handle per group and the cuBLAS
 * handles on the current GPU (the groups' GPU), and with FP8 weights on cuBLASLt copies the
 * weights' block scales into the layout cuBLASLt reads (synchronizes the device: the plan's
 * first call reads what it uploaded).
 *   groups     - [IN] num_groups groups of identical configs with EPX_MODE_NORMAL, BF16 and
 *                config.expand_max_rows >= R x max_tokens_per_rank x min(K, E/R) + 3 x E/R
 *                (room for any routing at the layer's alignment 4; less is refused). Two
 *                groups are needed for overlapped calls; with one, only chain calls run. The
 *                plan keeps them: destroy the plan before them. No other call may use them while
 *                a layer call is in flight.
 *   num_groups - [IN] 1 or 2
 *   experts    - [IN] this rank's L = E/R experts (the weights are referenced, not copied: keep
 *                them alive and unchanged while the plan lives)
 *   config     - [IN] NULL for every default
 *   plan       - [OUT] the new plan; NULL on failure
 * Returns EPX_OK; EPX_ERR_INVALID_ARGUMENT naming the argument; EPX_ERR_INVALID_USAGE (a group
 * without normal mode or expert-major rows); EPX_ERR_UNSUPPORTED (ffn_backend CUBLAS where
 * cuBLAS has no kernel); EPX_ERR_CUDA. */
epx_status_t epx_moe_prefill_create(const epx_group_t *groups, int num_groups,
                                    const epx_experts_t *experts,
                                    const epx_moe_prefill_config_t *config,
                                    epx_moe_prefill_t *plan);

/* epx_moe_prefill_destroy - release the plan (synchronizes its streams first). destroy(NULL)
 * is EPX_OK. Not collective. Destroy it before its groups. Returns EPX_OK, or the first failure
 * of the release (EPX_ERR_CUDA: an asynchronous error surfacing at the streams'
 * synchronization, say); the plan is released either way. After one of its groups' NCCL
 * operations timed out (docs/api.md, "After a fault"), its device resources are left allocated
 * rather than waited for. */
epx_status_t epx_moe_prefill_destroy(epx_moe_prefill_t plan);

/* epx_moe_prefill_get_info - what the plan resolved. Not collective; no GPU work. */
epx_status_t epx_moe_prefill_get_info(epx_moe_prefill_t plan, epx_moe_prefill_info_t *info);

/* epx_moe_prefill_workspace_size - device scratch bytes a call needs: two slots of expert
 * outputs (config.expand_max_rows x H BF16 each), the FFN's intermediate rows, 32 MiB of
 * cuBLAS workspace per GEMM lane, and with FP8 on the wire a chunk's tokens in FP8 with their
 * scales. Not collective; no GPU work. */
epx_status_t epx_moe_prefill_workspace_size(epx_moe_prefill_t plan, size_t *bytes);

typedef struct epx_moe_prefill_args {
  size_t size;                /* sizeof(epx_moe_prefill_args_t); set by EPX_MOE_PREFILL_ARGS_INIT */
  const void *x;              /* [IN] [T, H] BF16, 16-byte aligned */
  const void *topk_idx;       /* [IN] [T, K] expert ids, -1 = empty slot */
  epx_dtype_t topk_idx_dtype; /* EPX_DTYPE_INT64 or EPX_DTYPE_INT32 */
  const float *topk_weights;  /* [IN] [T, K] float32 gate weights, or NULL (all 1) */
  int num_tokens;             /* T: chain, 0..max_tokens_per_rank; overlapped, 0..num_chunks x
                                 max_tokens_per_rank (each chunk at most max_tokens_per_rank) */
  int overlap;                /* EPX_MOE_CHAIN (0, the default): one dispatch, FFN and combine
                                 on group 0, on stream; EPX_MOE_OVERLAP_CHUNKS (1): chunks
                                 pipelined over the plan's two groups; EPX_MOE_OVERLAP_PHASES
                                 (2): one dispatch on group 0, the down projection in phases by
                                 source rank, each phase's rows sent back while the next
                                 computes. The chain is the default because neither overlap
                                 has been measured faster than it beyond the noise (4096
                                 tokens a rank on H200; 2 ranks: chunks 0.85-1.03x, phases
                                 0.93-1.00x; 4 ranks: chunks 0.93-0.98x, phases 0.89-1.01x;
                                 docs/moe.md) */
  void *out;                  /* [OUT] [T, H] BF16, 16-byte aligned */
  void *workspace;            /* device scratch of epx_moe_prefill_workspace_size bytes, 256-byte
                                 aligned; not shared by two calls in flight */
  size_t workspace_bytes;
} epx_moe_prefill_args_t;

/* epx_moe_prefill_args_t.overlap */
#define EPX_MOE_CHAIN 0
#define EPX_MOE_OVERLAP_CHUNKS 1
/* One dispatch of all T <= max_tokens_per_rank tokens on group 0 and gate/up over every row;
 * then, for each source rank s (this rank + 1 first, itself last), the down projection of the
 * rows s sent and their expert-side reduce, after which s's rows go back while the next phase
 * computes: by one copy on the copy engines into s's combine slab (the default; the GEMMs keep
 * every SM, config.gemm_sms does not apply), then one combine after the last phase signals them
 * and sums this rank's tokens (docs/moe.md, "Phases by source"). With the environment's
 * EPX_MOE_PHASES_COPY_ENGINE=0 a combine running beside the phases on config.num_sms SMs sends
 * them instead, which needs at least 16 other SMs. Needs EPX's grouped FP8 GEMM
 * (epx_moe_prefill_info_t.ffn_backend EPX_MOE_FFN_EPX_GROUPED): else EPX_ERR_UNSUPPORTED.
 * Measured (4096 tokens a rank, 2 ranks): with the copy engines 0.94-1.01x the chain at
 * DeepSeek-V3's experts and 1.01-1.03x at Qwen3-30B-A3B's on H200 against a chain whose combine
 * had the group's num_sms blocks (on SMs 0.88-0.93x); with the chain's combine on every SM too,
 * as now, 0.90-0.92x and 0.99x on H100; 2026-11-28 on H200: 0.93-0.99x and 0.97-1.00x at 2 ranks,
 * 0.89-0.90x and 1.01x at 4 (docs/moe.md). */
#define EPX_MOE_OVERLAP_PHASES 2

#define EPX_MOE_PREFILL_ARGS_INIT \
  { sizeof(epx_moe_prefill_args_t), NULL, NULL, EPX_DTYPE_INT64, NULL, 0, 0, NULL, NULL, 0 }

/* epx_moe_prefill - one MoE layer at prefill size: dispatch (expert-major), the local experts'
 * SwiGLU FFN, combine. COLLECTIVE over the plan's groups: every rank calls it (T may be 0) with
 * the same `overlap` and a plan of the same num_chunks, in the same order as the groups' other
 * collectives. Ordered on stream (the plan's streams wait for it and it waits for them); the
 * host waits for each chunk's count exchange (not capturable). Numerics: float32 accumulation
 * (FP8 products: summed on the tensor cores, which keep fewer bits inside a sum);
 * BF16 weights: the gate/up outputs and h are BF16 (cuBLAS's rounding of the GEMM output, then
 * SiLU times up in float32); FP8 weights: x and h quantized per 128 channels (tests/ref/epx_ref.h)
 * and DeepSeek-V3's block scaling; combine as epx_combine_expand (weighted). SMs: a combine
 * beside a chunk's GEMMs takes the group's config.num_sms; one with nothing of the layer beside
 * it (the chain's, an overlapped call's last, the phases') takes every SM of the GPU (its sums
 * are latency-bound; EPX_MOE_ALONE_COMBINE_BLOCKS=N limits it to N, docs/env.md); the chain's and
 * the phases' dispatch fans out DURING the transfer (num_sms sending blocks and about 1.7-2.8 x
 * num_sms more, at most the SMs left; EPX_MOE_ALONE_FAN_OUT, compared at group creation), the
 * chunks' as the group's config.expand_fan_out says. Every argument is checked before anything is
 * queued, identically on every rank for the group's shape, so a refused call leaves no peer
 * waiting; once a dispatch is queued its combine is queued too (a GEMM failure is returned after
 * the combines). That combine's rows go marked not valid: every peer leaves them out of its sums
 * and records EPX_ERR_PEER_DATA (stage COMBINE, naming this rank) in its async error record
 * (docs/api.md, "After a fault"). Returns EPX_OK once queued; EPX_ERR_INVALID_ARGUMENT naming the
 * argument, or a chunk's rows past config.expand_max_rows (as epx_dispatch_expand);
 * EPX_ERR_INVALID_USAGE (overlap with a one-group plan; a stream being captured); EPX_ERR_TIMEOUT
 * as epx_dispatch_expand; EPX_ERR_CUDA (cuBLAS failures are reported as EPX_ERR_CUDA with cuBLAS's
 * status named). */
epx_status_t epx_moe_prefill(epx_moe_prefill_t plan, const epx_moe_prefill_args_t *args,
                             cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* EPX_H_ */

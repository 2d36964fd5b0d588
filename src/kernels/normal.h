/*
 * normal.h - launchers of normal (high-throughput) mode: notify, dispatch, combine.
 */
#ifndef EPX_KERNELS_NORMAL_H_
#define EPX_KERNELS_NORMAL_H_

#include <stdint.h>

#include "epx.h"
#include "kernel_ctx.h"
#include "workspace.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Normal mode. The routing of one dispatch, kept in its handle (device memory). */
typedef struct epx__routing {
  uint8_t *is_token_in_rank;  /* [max_tokens, R] */
  int *token_pos_in_rank;     /* [max_tokens, R] */
  int *num_tokens_per_rank;   /* [R] */
  int *num_tokens_per_expert; /* [E] */
  epx__recv_meta_t *meta;     /* counts after the exchange */
  int num_tokens;
} epx__routing_t;

typedef struct epx__notify_launch_args {
  epx__routing_t routing;
  int num_experts, expert_alignment, max_tokens;
  int *host_counts; /* device alias of mapped host [1 + E/R]: num_recv, per-expert; or NULL */
} epx__notify_launch_args_t;

typedef struct epx__dispatch_launch_args {
  epx__routing_t routing;
  const void *x;
  int x_is_fp8;
  const float *x_scales;
  const void *topk_idx; /* NULL for a cached dispatch: metadata is not resent */
  int idx_is_int64;
  const float *topk_weights;
  int hidden, top_k, num_experts, num_blocks;
} epx__dispatch_launch_args_t;

typedef struct epx__combine_launch_args {
  epx__routing_t routing;
  const void *x; /* [num_recv, H] BF16 */
  const void *topk_idx;
  int idx_is_int64;
  const float *topk_weights; /* NULL = unweighted */
  void *out;                 /* [T, H] BF16 */
  int hidden, top_k, num_experts, max_tokens, num_blocks;
  int send_warps;       /* of each block's 16 warps, 1..15; the others reduce */
  int unit_rows;        /* rows per send unit: a power of two dividing EPX_COMBINE_CHUNK_ROWS */
  int reduce_tokens;    /* tokens per reduce unit, >= 1 */
  int send_bulk;        /* 1: send with bulk copies through shared memory (TMA), 0: loads/stores */
  int send_dynamic;     /* 1: send warps take units from a shared counter, 0: a fixed stride */
  int bulk_stages;      /* bulk sends: 2..8 stages sharing 32 KiB per warp */
  int bulk_lag;         /* bulk sends: 1..6 pieces between a unit's last store and its signal */
  int bulk_store_depth; /* bulk sends: 1..7 stores in flight (at most stages - 1) */
} epx__combine_launch_args_t;

epx_status_t epx__notify_launch(const epx__kernel_ctx_t *ctx, const epx__notify_launch_args_t *args,
                                cudaStream_t stream);
epx_status_t epx__dispatch_launch(const epx__kernel_ctx_t *ctx,
                                  const epx__dispatch_launch_args_t *args, cudaStream_t stream);
epx_status_t epx__combine_launch(const epx__kernel_ctx_t *ctx,
                                 const epx__combine_launch_args_t *args, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* EPX_KERNELS_NORMAL_H_ */

/*
 * ll.h - launchers of low-latency mode: dispatch and combine (ll_dispatch.cu, ll_combine.cu).
 */
#ifndef EPX_KERNELS_LL_H_
#define EPX_KERNELS_LL_H_

#include <stdint.h>

#include "epx.h"
#include "kernel_ctx.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Low-latency mode (src/kernels/ll.cu). phases: EPX_LL_PHASE_SEND | EPX_LL_PHASE_RECV. */
#define EPX_LL_PHASE_SEND 1
#define EPX_LL_PHASE_RECV 2

typedef struct epx__ll_dispatch_launch_args {
  const void *x;        /* [T, H] BF16 */
  const void *topk_idx; /* [T, K] */
  int idx_is_int64;
  const float *topk_weights; /* [T, K] or NULL (weights 1) */
  int num_tokens, hidden, top_k, num_experts, max_tokens;
  int fp8, ue8m0, by_rank, parity, phases, num_blocks;
} epx__ll_dispatch_launch_args_t;

typedef struct epx__ll_combine_launch_args {
  const void *x;  /* [L, R*M, H] BF16 expert outputs */
  void *out;      /* [T, H] BF16 */
  int num_tokens; /* T of the dispatch */
  int hidden, top_k, num_experts, max_tokens;
  int by_rank, parity, phases, num_blocks;
} epx__ll_combine_launch_args_t;

epx_status_t epx__ll_dispatch_launch(const epx__kernel_ctx_t *ctx,
                                     const epx__ll_dispatch_launch_args_t *args,
                                     cudaStream_t stream);
epx_status_t epx__ll_combine_launch(const epx__kernel_ctx_t *ctx,
                                    const epx__ll_combine_launch_args_t *args, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* EPX_KERNELS_LL_H_ */

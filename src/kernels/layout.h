/*
 * layout.h - the layout kernel's launcher (layout.cu): per-rank and per-expert counts, rank
 * membership and positions of one rank's tokens.
 */
#ifndef EPX_KERNELS_LAYOUT_H_
#define EPX_KERNELS_LAYOUT_H_

#include <stdint.h>

#include "epx.h"
#include "kernel_ctx.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct epx__layout_launch_args {
  const void *topk_idx;
  int idx_is_int64;
  int num_tokens, top_k, num_experts, num_ranks;
  int *num_tokens_per_rank;   /* [R] or NULL */
  int *num_tokens_per_expert; /* [E] or NULL */
  uint8_t *is_token_in_rank;  /* [T, R] or NULL */
  int *token_pos_in_rank;     /* [T, R] or NULL */
} epx__layout_launch_args_t;

epx_status_t epx__layout_launch(const epx__kernel_ctx_t *ctx, const epx__layout_launch_args_t *args,
                                cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* EPX_KERNELS_LAYOUT_H_ */

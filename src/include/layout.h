/*
 * layout.h - epx_layout's entry for already-checked arguments (src/layout.c), used by
 * epx_dispatch to fill its handle's routing.
 */
#ifndef EPX_LAYOUT_H_
#define EPX_LAYOUT_H_

#include <stdint.h>

#include "epx.h"

#ifdef __cplusplus
extern "C" {
#endif
epx_status_t epx__layout_enqueue(epx_group_t g, const epx_layout_args_t *args, cudaStream_t stream);
/* The same outputs from a rank mask: in_rank_mask [T, R] (0 / nonzero; NULL only when T = 0)
 * gives the per-rank counts, is_token_in_rank and token_pos_in_rank; in_per_expert [E] is copied
 * into args->num_tokens_per_expert. args->topk_idx is not read. */
epx_status_t epx__layout_mask_enqueue(epx_group_t g, const epx_layout_args_t *args,
                                      const uint8_t *in_rank_mask, const int *in_per_expert,
                                      cudaStream_t stream);
/* epx__layout_enqueue plus the expert-major positions (epx_dispatch_expand): expand_pos
 * [T, K] (the handle's) gets, per slot, the token's position among this rank's tokens listing
 * that expert, -1 for an empty slot. The group must have config.expand_max_rows > 0. */
epx_status_t epx__layout_expand_enqueue(epx_group_t g, const epx_layout_args_t *args,
                                        int *expand_pos, cudaStream_t stream);
#ifdef __cplusplus
}
#endif

#endif /* EPX_LAYOUT_H_ */

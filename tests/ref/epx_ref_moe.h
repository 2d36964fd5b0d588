/*
 * epx_ref_moe.h - the plain-C oracle of epx_moe_decode (the MoE layer at decode), composed
 * from the oracles of its three steps, so that the layer is checked against exactly what its
 * parts promise:
 *   1. every rank d receives one row per distinct (token, expert) (epx_ref_ll_dispatch_layout,
 *      EPX_REF_LL_FIXED: EPX's packed layout holds the same rows, compacted), BF16 or, with
 *      fp8_dispatch, quantized per 128 channels (epx_ref.h's rule, no UE8M0);
 *   2. each rank's experts run on those rows: epx_ref_experts_ffn, BF16 outputs (a row's
 *      output does not depend on where the row sits);
 *   3. src_rank's tokens get the combine of those outputs with their weights
 *      (epx_ref_ll_combine_f64_layout): a token listing an expert twice adds its row twice,
 *      once with each slot's weight.
 */
#ifndef EPX_REF_MOE_H_
#define EPX_REF_MOE_H_

#include <stdint.h>

#include "ref/epx_ref.h"
#include "ref/epx_ref_experts.h"

#ifdef __cplusplus
extern "C" {
#endif

/* epx_ref_moe_decode - the layer's output for src_rank's tokens, float64, not rounded.
 *   world               - [IN]  every rank's x (BF16), topk_idx, topk_weights (NULL: 1)
 *   experts             - [IN]  [R] the experts of each rank (E/R each, hidden = world's)
 *   max_tokens_per_rank - [IN]  M, the group's ll_max_tokens_per_rank (>= every T_s)
 *   fp8_dispatch        - [IN]  1: rows reach the experts in FP8 (FP8 weights only)
 *   src_rank            - [IN]  whose tokens
 *   out                 - [OUT] [T, H] float64
 *   abs_sum             - [OUT] optional [T, H]: sum over the token's slots of |w| x |FFN row|,
 *                               the magnitude the output is a sum of (for tolerances)
 *   y_rms               - [OUT] optional: root mean square of every FFN output row computed
 *   one_step            - [OUT] optional [T, H]: the largest over the token's slots of |w| x
 *                               the most one FP8 step of one h value moves its FFN row
 *                               (epx_ref_experts_ffn_one_step; 0 with BF16 weights): n such
 *                               steps anywhere in the token move it by at most n x this
 * Returns 0, or -1 (message on stderr) on arguments the library refuses. */
int epx_ref_moe_decode(const epx_ref_world_t *world, const epx_ref_experts_t *experts,
                       int max_tokens_per_rank, int fp8_dispatch, int src_rank, double *out,
                       double *abs_sum, double *y_rms, double *one_step);

#ifdef __cplusplus
}
#endif

#endif /* EPX_REF_MOE_H_ */

/*
 * epx_ref_expand.h - the oracle of normal mode's expert-major ("expanded") layout (issue 16,
 * item 1; docs/moe.md, "Expert-major layout"): dispatch delivers one row per (token, local
 * expert), each local expert's rows contiguous and its segment padded to expert_alignment, so a
 * grouped GEMM reads them in place (DeepEP V2's expand, DeepGEMM's contiguous layout); combine
 * takes the experts' outputs in that layout, weights and sums a token's rows on the expert
 * side, and brings one row per (token, rank) home, where the ranks' rows are summed.
 *
 * Defined on top of epx_ref_dispatch (epx_ref.h), whose rows are the same tokens: for dst_rank
 * with L = E/R local experts,
 *   - local expert j's rows are the dispatch rows whose topk_idx holds j, in the dispatch's
 *     order (source rank ascending, then source token ascending): one row per distinct
 *     (token, expert), a token listing j twice included once;
 *   - count[j] = that number (= epx_ref_dispatch's num_recv_per_expert[j]); the segment of j
 *     starts at begin[j] = sum over j' < j of count[j'] rounded up to expert_alignment, and its
 *     rows [begin[j] + count[j], begin[j + 1]) are padding (src_rank -1);
 *   - a row's weight is the sum, in float32 from 0.0f in ascending k, of the token's
 *     topk_weights over the slots k listing j (0.0f when the source has no weights); its slot is
 *     the first such k.
 * Combine of src_rank's token t, from y_d (rank d's expert outputs in d's expanded order):
 *   partial_d = bf16( sum over t's rows on d, in row order (ascending j), of w * float(y_d[row]) )
 *   out[t]    = bf16( sum over ranks d holding a row of t, d ascending, of float(partial_d) )
 * each product and addition rounded to float32 (no fused multiply-add), sums from +0.0f;
 * unweighted: w = 1. The BF16 rounding of partial_d is the row the expert side sends home. A
 * token on no rank gets +0.0. The float64 version sums the same products without any rounding.
 */
#ifndef EPX_REF_EXPAND_H_
#define EPX_REF_EXPAND_H_

#include <stdint.h>

#include "ref/epx_ref.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What dst_rank receives in an expanded dispatch. Allocated by epx_ref_dispatch_expand,
 * released by epx_ref_expand_free. Row i of num_rows (padding included). */
typedef struct epx_ref_expand {
  int num_rows;          /* begin[L]: every segment, padded */
  int num_local_experts; /* L = E/R */
  int *begin;            /* [L + 1]: segment of local expert j is [begin[j], begin[j + 1]) */
  int *count;            /* [L]: real rows of j, at [begin[j], begin[j] + count[j]) */
  uint16_t *x;           /* [num_rows, H] BF16 (payload BF16; padding 0), else NULL */
  uint8_t *x_fp8;        /* [num_rows, H] FP8 (payload FP8; padding 0), else NULL */
  float *x_scales;       /* [num_rows, H/128] float32 (payload FP8; padding 0), else NULL */
  int *src_rank;         /* [num_rows] source rank, -1 on padding */
  int *src_token;        /* [num_rows] source token, -1 on padding */
  int *src_slot;         /* [num_rows] first slot k of the token listing the row's expert, -1 */
  float *weight;         /* [num_rows] the row's weight (above), 0.0f on padding */
} epx_ref_expand_t;

/* epx_ref_dispatch_expand - dst_rank's rows in the expanded layout (defined above).
 *   world            - [IN]  as for epx_ref_dispatch
 *   dst_rank         - [IN]  0..R-1
 *   payload          - [IN]  EPX_REF_PAYLOAD_NONE, _BF16 or _FP8 (copied bit-exactly)
 *   expert_alignment - [IN]  >= 1
 *   out              - [OUT] allocated and filled; release with epx_ref_expand_free (also
 *                            after a failure)
 * Returns 0 or -1 (message on stderr). */
int epx_ref_dispatch_expand(const epx_ref_world_t *world, int dst_rank, epx_ref_payload_t payload,
                            int expert_alignment, epx_ref_expand_t *out);

/* epx_ref_expand_free - release the arrays of e and zero it. NULL is accepted. */
void epx_ref_expand_free(epx_ref_expand_t *e);

/* epx_ref_combine_expand - src_rank's combine from expanded expert outputs (defined above).
 *   world            - [IN]  every rank's topk_idx (and topk_weights when weighted)
 *   src_rank         - [IN]  0..R-1
 *   expert_alignment - [IN]  the dispatch's (it places the rows)
 *   y                - [IN]  [R]: y[d] is [num_rows_d, H] BF16 in d's expanded order (padding
 *                            rows are never read; NULL when d has no rows)
 *   weighted         - [IN]  1: each row times its weight; 0: every row times 1
 *   out              - [OUT] [T_s, H] BF16, or NULL
 *   out_f64          - [OUT] [T_s, H] float64, or NULL
 * Returns 0 or -1. */
int epx_ref_combine_expand(const epx_ref_world_t *world, int src_rank, int expert_alignment,
                           const uint16_t *const *y, int weighted, uint16_t *out, double *out_f64);

#ifdef __cplusplus
}
#endif

#endif /* EPX_REF_EXPAND_H_ */

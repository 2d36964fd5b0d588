/*
 * epx_ref_experts.h - the plain-C oracle of epx_experts_ffn (the experts' SwiGLU FFN), in
 * double precision, with the library's roundings where the library rounds:
 *   BF16 weights: g, u = x W^T (exact products, double sums); h = bf16(silu(g) * u);
 *                 out = bf16(h Wd^T).
 *   FP8 weights:  x quantized per 128 channels (epx_ref.h's rule) unless given in FP8; each
 *                 128-deep block of products scaled by the weight block's scale times the
 *                 row's scale; h = silu(g) * u rounded to float, then quantized per 128
 *                 channels the same way; out = bf16(sum over blocks).
 * Where the GPU sums in another order the results differ by rounding only; tests compare
 * with a tolerance (tests/gpu/test_experts_ffn.c says which).
 */
#ifndef EPX_REF_EXPERTS_H_
#define EPX_REF_EXPERTS_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct epx_ref_experts {
  int num_experts, hidden, intermediate;
  int fp8;                      /* 1: the *_fp8 arrays and scales; 0: the *_bf16 arrays */
  const uint16_t *gate_up_bf16; /* [E, 2I, H] */
  const uint16_t *down_bf16;    /* [E, H, I] */
  const uint8_t *gate_up_fp8;   /* [E, 2I, H] */
  const float *gate_up_scales;  /* [E, 2I/128, H/128] */
  const uint8_t *down_fp8;      /* [E, H, I] */
  const float *down_scales;     /* [E, H/128, I/128] */
} epx_ref_experts_t;

/* The rows of expert e the library processes, by epx.h's rule: count cut to the room
 * (rows_per_expert in the masked layout, num_rows - begin in the contiguous one), negative
 * counts and begins outside [0, num_rows] giving none. begin may be NULL (masked layout).
 * Writes first[e] and rows[e]. */
void epx_ref_experts_rows(int num_experts, int num_rows, const int *count, const int *begin,
                          int rows_per_expert, int *first, int *rows);

/* out rows [first[e], first[e] + rows[e]) of every expert e (first/rows from
 * epx_ref_experts_rows); other rows of out are left as they are.
 *   x        - [num_rows, H] BF16 (x_fp8 = 0) or FP8 E4M3 with x_scales [num_rows, H/128]
 *   out      - [num_rows, H] BF16
 * Returns 0, or -1 (message on stderr) for shapes the library refuses. */
int epx_ref_experts_ffn(const epx_ref_experts_t *w, const void *x, int x_fp8, const float *x_scales,
                        int num_rows, const int *first, const int *rows, uint16_t *out);

/* epx_ref_experts_ffn, and with FP8 weights also one_step [num_rows, H] (the rows it writes):
 * the most that one value of the row's quantized h rounded one FP8 step the other way moves
 * each output, max over j of |w_down[c][j]| x the step of h_j (epx_ref_fp8_step) x their
 * scales. The GPU's gate/up sums differ from these by rounding, so an h value next to a
 * rounding boundary can land one step away: a tolerance adds one_step (0 with BF16 weights,
 * whose h rounds to BF16 with steps far below the tolerances). */
int epx_ref_experts_ffn_one_step(const epx_ref_experts_t *w, const void *x, int x_fp8,
                                 const float *x_scales, int num_rows, const int *first,
                                 const int *rows, uint16_t *out, float *one_step);

#ifdef __cplusplus
}
#endif

#endif /* EPX_REF_EXPERTS_H_ */

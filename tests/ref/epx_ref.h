/*
 * epx_ref.h - the plain-C CPU reference of EPX: layout, normal dispatch/combine, low-latency
 * dispatch/combine, and the BF16 / FP8 E4M3 number formats. It is the oracle of every GPU test.
 *
 * The reference simulates all R ranks in one process: a function takes the inputs of every rank
 * (an epx_ref_world_t) and produces the outputs of one rank. A GPU test on rank r draws every
 * rank's inputs from the shared seed, runs the reference for its own rank and compares.
 *
 * Definitions (docs design.md section 1). R ranks; rank r holds T_r tokens of hidden size H,
 * topk_idx [T_r, K] int64 and topk_weights [T_r, K] float32. E experts, E % R == 0; rank r hosts
 * experts [r*E/R, (r+1)*E/R), local id j = e - r*E/R. A slot is VALID when its id is in [0, E);
 * -1 is an empty slot, and any other id is invalid and treated exactly like an empty slot
 * (epx_ref_layout reports the first one). BF16 values are stored as their uint16_t bits, FP8
 * E4M3 values as their uint8_t bits.
 *
 * Invariants:
 *   - Everything is deterministic and exact: float32 arithmetic is IEEE round-to-nearest-even
 *     with no fused multiply-add and no excess precision (checked at compile time), so the
 *     BF16/FP8 conversions and the FP8 quantization are bit-exact with the GPU definitions
 *     below. Combine sums are exact-order float32 sums; GPU combines that sum in another order
 *     are compared against the float64 versions with a tolerance.
 *   - Receive orders are total: normal dispatch orders rows by (source rank, source token);
 *     low-latency rows of one local expert by (source rank, source token, slot).
 *   - Nothing is written outside the documented output extents.
 *
 * Return codes: the functions that take a world return 0 on success and -1 on invalid
 * arguments or allocation failure, after printing one "epx_ref: ..." line to stderr (unless
 * epx_ref_set_quiet(1)); their outputs are then unspecified (the low-latency dispatch writes
 * nothing).
 */
#ifndef EPX_TESTS_REF_H_
#define EPX_TESTS_REF_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* epx_ref_set_quiet - 1: do not print the "epx_ref: ..." line of a refusal (for tests that
 * expect one); 0: print it (the default). Process-wide, not thread-safe.
 *   quiet - [IN] 0 or 1
 * Returns the previous setting. */
int epx_ref_set_quiet(int quiet);

/* Channels per FP8 scale. */
#define EPX_REF_FP8_GROUP 128
/* Largest finite FP8 E4M3 value (code 0x7e). */
#define EPX_REF_FP8_MAX 448.0f

/* ---------------------------------------------------------------------------------------------
 * Number formats.
 * ------------------------------------------------------------------------------------------- */

/* epx_ref_bf16_from_float - float32 -> BF16, round to nearest even. Overflow rounds to +-inf as
 * IEEE says; infinities stay infinities; a NaN stays a NaN (its sign kept, the quiet bit set).
 *   x - [IN] float32
 * Returns the BF16 bits. */
uint16_t epx_ref_bf16_from_float(float x);

/* epx_ref_bf16_to_float - BF16 -> float32 (exact).
 *   bits - [IN] BF16 bits */
float epx_ref_bf16_to_float(uint16_t bits);

/* epx_ref_fp8_from_float - float32 -> FP8 E4M3 ("e4m3fn": 1 sign, 4 exponent bits of bias 7,
 * 3 mantissa bits; no infinities; NaN = 0x7f/0xff; largest finite 448 = 0x7e; subnormals
 * m * 2^-9, m = 1..7). Round to nearest even, then SATURATE: every |x| >= 448 (infinities
 * included) gives +-448. |x| <= 2^-10 gives a signed zero. NaN gives 0x7f. Equal to CUDA's
 * __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3) (cvt.rn.satfinite.e4m3x2.f32).
 *   x - [IN] float32
 * Returns the FP8 bits. */
uint8_t epx_ref_fp8_from_float(float x);

/* epx_ref_fp8_to_float - FP8 E4M3 -> float32 (exact); 0x7f and 0xff give NaN.
 *   bits - [IN] FP8 bits */
float epx_ref_fp8_to_float(uint8_t bits);

/* epx_ref_fp8_step - the larger distance from the value of `bits` to its neighbours of the same
 * sign (magnitude bits +- 1, within 0..0x7e): how far one rounding step the other way can move
 * it. Exact; NaN for the NaN codes.
 *   bits - [IN] FP8 bits */
float epx_ref_fp8_step(uint8_t bits);

/* ---------------------------------------------------------------------------------------------
 * FP8 per-128-channel quantization, bit-exact with the GPU. For each token t and each group g
 * of 128 channels (c = 128*g .. 128*g+127), all in float32 with IEEE round-to-nearest-even:
 *
 *   amax  = max over the group of |float(x[t][c])|      (x is BF16, converted exactly)
 *   amax  = fmaxf(amax, 1e-4f)
 *   scale = amax / 448.0f                                (division, correctly rounded)
 *   if UE8M0: if the mantissa bits of scale are nonzero, scale = 2^(exponent+1) exactly
 *             (exponent field + 1, mantissa 0: the power of two at or above scale)
 *   inv   = 1.0f / scale                                 (division, correctly rounded)
 *   q[t][c]           = epx_ref_fp8_from_float(float(x[t][c]) * inv)   (one rounded multiply)
 *   scales[t][g]      = scale                            (float32; for UE8M0 a power of two)
 *
 * Dequantization: float(q) * scale, one rounded float32 multiply.
 * ------------------------------------------------------------------------------------------- */

/* epx_ref_fp8_scale - the scale of one group from its amax, as defined above.
 *   amax  - [IN] float32 max |x| of the group (before the 1e-4 floor)
 *   ue8m0 - [IN] 1: round the scale up to a power of two
 * Returns the float32 scale. */
float epx_ref_fp8_scale(float amax, int ue8m0);

/* epx_ref_fp8_quantize - quantize BF16 rows to FP8 with per-128-channel scales.
 *   x          - [IN]  [num_tokens, hidden] BF16
 *   num_tokens - [IN]  T >= 0
 *   hidden     - [IN]  H, a positive multiple of 128
 *   ue8m0      - [IN]  1: power-of-two scales
 *   q          - [OUT] [T, H] FP8 E4M3
 *   scales     - [OUT] [T, H/128] float32
 * Returns 0, or -1 if hidden is not a positive multiple of 128 (nothing written). */
int epx_ref_fp8_quantize(const uint16_t *x, int num_tokens, int hidden, int ue8m0, uint8_t *q,
                         float *scales);

/* epx_ref_fp8_dequantize - float(q) * scale per element.
 *   q, scales  - [IN]  [T, H] FP8 E4M3 and [T, H/128] float32
 *   num_tokens - [IN]  T >= 0
 *   hidden     - [IN]  H, a positive multiple of 128
 *   out        - [OUT] [T, H] float32
 * Returns 0, or -1 if hidden is not a positive multiple of 128 (nothing written). */
int epx_ref_fp8_dequantize(const uint8_t *q, const float *scales, int num_tokens, int hidden,
                           float *out);

/* ---------------------------------------------------------------------------------------------
 * Layout of one rank's tokens.
 * ------------------------------------------------------------------------------------------- */

/* epx_ref_layout - what one rank sends where. Outputs are written in full.
 *   topk_idx              - [IN]  [T, K] int64 expert ids (may be NULL when T == 0)
 *   num_tokens            - [IN]  T >= 0
 *   top_k                 - [IN]  K >= 1
 *   num_experts           - [IN]  E, a multiple of num_ranks
 *   num_ranks             - [IN]  R >= 1
 *   num_tokens_per_rank   - [OUT] [R] int: tokens with at least one valid slot on rank r (the
 *                                 own rank included; a token counts once per rank)
 *   num_tokens_per_expert - [OUT] [E] int: tokens choosing expert e (once per token even if it
 *                                 lists e twice)
 *   is_token_in_rank      - [OUT] [T, R] uint8 0/1
 *   token_pos_in_rank     - [OUT] [T, R] int: position of token t among this rank's tokens
 *                                 sent to rank r, in ascending token order; -1 if not sent
 * Returns the flat index t*top_k+k of the first expert id outside [-1, E) (lowest index), or -1
 * if all are valid. Bad ids are treated as empty slots. Any output pointer may be NULL.
 * Invalid dimensions (or a NULL topk_idx with T > 0) return -2 with a message on stderr. */
long long epx_ref_layout(const int64_t *topk_idx, int num_tokens, int top_k, int num_experts,
                         int num_ranks, int *num_tokens_per_rank /*[R]*/,
                         int *num_tokens_per_expert /*[E]*/, uint8_t *is_token_in_rank /*[T*R]*/,
                         int *token_pos_in_rank /*[T*R]*/);

/* ---------------------------------------------------------------------------------------------
 * The inputs of every rank.
 * ------------------------------------------------------------------------------------------- */

/* One rank's inputs. Pointers a function does not use may be NULL. */
typedef struct epx_ref_rank {
  int num_tokens;            /* T_r >= 0 */
  const int64_t *topk_idx;   /* [T_r, K] int64 expert ids, -1 = empty slot */
  const float *topk_weights; /* [T_r, K] float32, or NULL (received weights are then 0) */
  const uint16_t *x;         /* [T_r, H] BF16 payload, or NULL */
  const uint8_t *x_fp8;      /* [T_r, H] FP8 E4M3 payload, or NULL */
  const float *x_scales;     /* [T_r, H/128] float32 scales of x_fp8, or NULL */
} epx_ref_rank_t;

/* All ranks' inputs. */
typedef struct epx_ref_world {
  int num_ranks;               /* R >= 1 */
  int num_experts;             /* E, a positive multiple of R */
  int top_k;                   /* K >= 1 */
  int hidden;                  /* H >= 1 (a multiple of 128 wherever FP8 is involved) */
  const epx_ref_rank_t *ranks; /* [R] */
} epx_ref_world_t;

/* ---------------------------------------------------------------------------------------------
 * Normal (high-throughput) mode.
 * ------------------------------------------------------------------------------------------- */

/* Which payload a normal dispatch copies. */
typedef enum epx_ref_payload {
  EPX_REF_PAYLOAD_NONE = 0, /* routing only (ids, weights, sources, counts) */
  EPX_REF_PAYLOAD_BF16 = 1, /* ranks[s].x */
  EPX_REF_PAYLOAD_FP8 = 2,  /* ranks[s].x_fp8 and ranks[s].x_scales, copied bit-exactly */
} epx_ref_payload_t;

/* What one rank receives in a normal dispatch. Filled by epx_ref_dispatch (which allocates
 * every array), released by epx_ref_recv_free. Row i is the i-th received token. */
typedef struct epx_ref_recv {
  int num_recv;                     /* rows received */
  int num_local_experts;            /* E/R */
  int *rank_prefix;                 /* [R+1]: rows of source s are [prefix[s], prefix[s+1]) */
  uint16_t *x;                      /* [num_recv, H] BF16 (payload BF16), else NULL */
  uint8_t *x_fp8;                   /* [num_recv, H] FP8 (payload FP8), else NULL */
  float *x_scales;                  /* [num_recv, H/128] float32 (payload FP8), else NULL */
  int64_t *topk_idx;                /* [num_recv, K] local expert id where the slot's expert
                                       lives on this rank, else -1 */
  float *topk_weights;              /* [num_recv, K] the weight where the slot is on this rank,
                                       else 0.0f (0.0f everywhere if the source has no weights) */
  int *src_rank;                    /* [num_recv] */
  int *src_token;                   /* [num_recv] */
  int *num_recv_per_expert;         /* [E/R] rows whose topk_idx contains local expert j (once
                                       per row) */
  int *num_recv_per_expert_aligned; /* [E/R] the same, each rounded up to expert_alignment */
} epx_ref_recv_t;

/* epx_ref_dispatch_num_recv - rows that dst_rank receives in a normal dispatch: the tokens of
 * every rank with at least one valid slot on dst_rank.
 *   world    - [IN] every rank's topk_idx
 *   dst_rank - [IN] 0..R-1
 * Returns the row count, or -1 on invalid arguments. */
int epx_ref_dispatch_num_recv(const epx_ref_world_t *world, int dst_rank);

/* epx_ref_dispatch - what dst_rank receives in a normal dispatch: every token (of every source
 * rank s, its own included) that has a valid slot on dst_rank, exactly once, ordered by source
 * rank ascending then source token ascending. Dispatch never quantizes: an FP8 payload is the
 * caller's x_fp8 + x_scales, copied bit-exactly.
 *   world            - [IN]  every rank's topk_idx, topk_weights (optional) and, per payload, x
 *                            or x_fp8 + x_scales (hidden % 128 == 0 for FP8)
 *   dst_rank         - [IN]  0..R-1
 *   payload          - [IN]  EPX_REF_PAYLOAD_NONE, _BF16 or _FP8
 *   expert_alignment - [IN]  >= 1: num_recv_per_expert_aligned[j] is the least multiple of it
 *                            that is >= num_recv_per_expert[j]
 *   recv             - [OUT] allocated and filled; release with epx_ref_recv_free (also after
 *                            a failure)
 * Returns 0 or -1. */
int epx_ref_dispatch(const epx_ref_world_t *world, int dst_rank, epx_ref_payload_t payload,
                     int expert_alignment, epx_ref_recv_t *recv);

/* epx_ref_recv_free - release the arrays of recv and zero it. NULL is accepted.
 *   recv - [IN/OUT] */
void epx_ref_recv_free(epx_ref_recv_t *recv);

/* epx_ref_combine - normal combine for src_rank: the inverse of epx_ref_dispatch. For each
 * token t of src_rank:
 *
 *   out[t] = bf16( sum over ranks d that received t, d ascending, of factor_d * float(y_d[row]) )
 *
 * where row is the row of (src_rank, t) in d's receive order, the sum starts at +0.0f and each
 * product and each addition is rounded to float32 (no fused multiply-add), and bf16() is
 * epx_ref_bf16_from_float. Unweighted (topk_weights NULL): factor_d = 1. Weighted: factor_d =
 * sum of topk_weights[t][k] over the valid slots k whose expert lives on d, a float32 sum from
 * 0.0f in ascending k. Tokens on no rank get +0.0.
 *   world        - [IN]  every rank's topk_idx (fixes every receive order)
 *   src_rank     - [IN]  0..R-1
 *   y            - [IN]  [R] pointers; y[d] is [num_recv_d, H] BF16 in d's receive order (may
 *                        be NULL when d receives no row)
 *   topk_weights - [IN]  [T_s, K] float32 of src_rank's tokens, or NULL for the unweighted sum
 *   out          - [OUT] [T_s, H] BF16
 * Returns 0 or -1. */
int epx_ref_combine(const epx_ref_world_t *world, int src_rank, const uint16_t *const *y,
                    const float *topk_weights, uint16_t *out);

/* epx_ref_combine_f64 - epx_ref_combine with every operation (the factors included) in
 * float64 and no final rounding: the exact-order float64 sum that GPU results are checked
 * against "within BF16 rounding".
 *   out - [OUT] [T_s, H] float64; other arguments as epx_ref_combine. Returns 0 or -1. */
int epx_ref_combine_f64(const epx_ref_world_t *world, int src_rank, const uint16_t *const *y,
                        const float *topk_weights, double *out);

/* ---------------------------------------------------------------------------------------------
 * Low-latency mode. Every buffer is expert-major with a capacity of R*M rows per local expert
 * (M = max_tokens_per_rank): row i of local expert j is at [j][i], element offset
 * (j*R*M + i)*H (scales: (j*R*M + i)*H/128; per-row ints: j*R*M + i).
 * ------------------------------------------------------------------------------------------- */

/* Outputs of a low-latency dispatch, caller-allocated; any pointer may be NULL to skip it. */
typedef struct epx_ref_ll_recv {
  uint16_t *x;     /* [E/R, R*M, H] BF16 rows (copied from ranks[s].x) */
  uint8_t *x_fp8;  /* [E/R, R*M, H] FP8 rows, quantized from ranks[s].x by the per-128 rule */
  float *x_scales; /* [E/R, R*M, H/128] float32 scales of x_fp8 (with x_fp8) */
  int *count;      /* [E/R] rows of local expert j */
  int *begin;      /* [E/R, R] first row of source rank s in expert j's rows */
  int *num;        /* [E/R, R] rows of source rank s in expert j's rows */
  int *src_rank;   /* [E/R, R*M] source rank of each row */
  int *src_token;  /* [E/R, R*M] source token of each row */
  int *src_slot;   /* [E/R, R*M] source slot k of each row */
} epx_ref_ll_recv_t;

/* epx_ref_ll_dispatch - what dst_rank receives in a low-latency dispatch: one row per (source
 * token t, slot k) whose expert is local expert j of dst_rank (a token listing j twice gives
 * two rows). The rows of j are packed from row 0: all rows of source rank 0 in (t, k)
 * ascending order, then those of source rank 1, and so on; begin[j][s] = sum of num[j][s'] over
 * s' < s. Rows at or beyond count[j] are not written.
 *   world               - [IN]  every rank's topk_idx and, for a payload, x (BF16); each
 *                               T_s <= max_tokens_per_rank; hidden % 128 == 0 for x_fp8
 *   dst_rank            - [IN]  0..R-1
 *   max_tokens_per_rank - [IN]  M >= 1
 *   ue8m0               - [IN]  1: power-of-two FP8 scales (x_fp8 only)
 *   out                 - [OUT] the arrays to fill
 * Returns 0, or -1 on invalid arguments or when some count[j] would exceed R*M (possible only
 * with repeated experts); nothing is written then. */
int epx_ref_ll_dispatch(const epx_ref_world_t *world, int dst_rank, int max_tokens_per_rank,
                        int ue8m0, const epx_ref_ll_recv_t *out);

/* epx_ref_ll_combine - low-latency combine for src_rank. For each token t of src_rank:
 *
 *   out[t] = bf16( sum over valid slots k, k ascending, of w[t][k] * float(y_d[j][row]) )
 *
 * where expert e = topk_idx[t][k] lives on rank d as local expert j, row is the row of
 * (src_rank, t, k) in j's rows on d (as epx_ref_ll_dispatch places it), the sum starts at
 * +0.0f with each product and addition rounded to float32, w = topk_weights (1.0f when NULL).
 * Tokens with no valid slot get +0.0.
 *   world               - [IN]  every rank's topk_idx (fixes every row position)
 *   src_rank            - [IN]  0..R-1
 *   max_tokens_per_rank - [IN]  M >= 1, >= every T_s
 *   y                   - [IN]  [R] pointers; y[d] is [E/R, R*M, H] BF16 expert outputs
 *   topk_weights        - [IN]  [T_s, K] float32 of src_rank's tokens, or NULL (weights 1)
 *   out                 - [OUT] [T_s, H] BF16
 * Returns 0 or -1. */
int epx_ref_ll_combine(const epx_ref_world_t *world, int src_rank, int max_tokens_per_rank,
                       const uint16_t *const *y, const float *topk_weights, uint16_t *out);

/* epx_ref_ll_combine_f64 - epx_ref_ll_combine in float64 with no final rounding.
 *   out - [OUT] [T_s, H] float64; other arguments as epx_ref_ll_combine. Returns 0 or -1. */
int epx_ref_ll_combine_f64(const epx_ref_world_t *world, int src_rank, int max_tokens_per_rank,
                           const uint16_t *const *y, const float *topk_weights, double *out);

/* ---------------------------------------------------------------------------------------------
 * Low-latency mode, EPX's fixed-slot layout (docs/low-latency.md). The functions above pack the
 * rows of a local expert from row 0, one row per (token, slot); EPX instead gives every source
 * rank a fixed slot range, so that a sender computes every address alone:
 *
 *   - one row per DISTINCT (token, expert): a token that lists expert e in several slots sends
 *     one row for e; its src_slot is the first slot naming e;
 *   - the rows of source rank s in local expert j are [j][s*M + i], i = 0 .. num[j][s]-1, in
 *     ascending token order; begin[j][s] = s*M; count[j] = sum over s of num[j][s];
 *   - rows outside those segments are not written. A segment never exceeds M rows (T_s <= M),
 *     so the fixed layout never overflows.
 *
 * Combine (fixed): for each token t of src_rank,
 *   out[t] = bf16( sum over valid slots k, k ascending, of w[t][k] * float(y_d[j][s*M + i]) )
 * where slot k names expert e = d*E/R + j and i is the row of (src_rank, t, e) above: a token
 * listing e twice adds the same row twice, once with each slot's weight.
 * ------------------------------------------------------------------------------------------- */

/* Which layout a low-latency reference call produces. */
typedef enum epx_ref_ll_layout {
  EPX_REF_LL_PACKED = 0, /* epx_ref_ll_dispatch: packed from row 0, one row per (token, slot) */
  EPX_REF_LL_FIXED = 1   /* fixed slots [j][s*M + i], one row per distinct (token, expert) */
} epx_ref_ll_layout_t;

/* epx_ref_ll_row - the row of (src_rank, token, expert) in the local expert's rows on the
 * expert's rank, under the FIXED layout: src_rank*M + the number of src_rank's tokens before
 * `token` that list `expert` in a valid slot.
 *   world - [IN] every rank's topk_idx;  max_tokens_per_rank - [IN] M
 * Returns the row, or -1 if the token does not list the expert (or on invalid arguments). */
int epx_ref_ll_row(const epx_ref_world_t *world, int max_tokens_per_rank, int src_rank, int token,
                   int expert);

/* epx_ref_ll_dispatch_layout - epx_ref_ll_dispatch with a choice of layout; PACKED is exactly
 * epx_ref_ll_dispatch. Arguments and return codes as epx_ref_ll_dispatch (FIXED never
 * overflows). */
int epx_ref_ll_dispatch_layout(const epx_ref_world_t *world, int dst_rank, int max_tokens_per_rank,
                               int ue8m0, epx_ref_ll_layout_t layout, const epx_ref_ll_recv_t *out);

/* epx_ref_ll_combine_layout / epx_ref_ll_combine_f64_layout - the combines of a layout; PACKED
 * is exactly epx_ref_ll_combine / _f64. Arguments as those, y[d] in the layout's rows. */
int epx_ref_ll_combine_layout(const epx_ref_world_t *world, int src_rank, int max_tokens_per_rank,
                              epx_ref_ll_layout_t layout, const uint16_t *const *y,
                              const float *topk_weights, uint16_t *out);
int epx_ref_ll_combine_f64_layout(const epx_ref_world_t *world, int src_rank,
                                  int max_tokens_per_rank, epx_ref_ll_layout_t layout,
                                  const uint16_t *const *y, const float *topk_weights, double *out);

/* ---------------------------------------------------------------------------------------------
 * Normal combine's top-k weight reduction and bias (DeepEP combine's `topk_weights` ->
 * `combined_topk_weights`, and `bias`).
 * ------------------------------------------------------------------------------------------- */

/* What a normal combine returns or adds beyond the sum of rows. Any part may be NULL. */
typedef struct epx_ref_combine_extras {
  const float *const *recv_w; /* [R] pointers: recv_w[d] is [num_recv_d, K] float32, the weights
                                 rank d returns with its rows, in d's receive order (may be NULL
                                 when d receives no row); NULL: no weight reduction */
  float *out_w;               /* [OUT] [T_s, K] float32 (with recv_w, else NULL): out_w[t][k] =
                                 the sum over the ranks d that received t, d ascending, from
                                 +0.0f, of recv_w[d][row][k], each addition rounded to float32
                                 (the same in epx_ref_combine_ex and _f64); 0 for a token on no
                                 rank. Exact when at most one term per k is nonzero, as with a
                                 dispatch's received weights (zeros where the slot is elsewhere) */
  const uint16_t *bias[2];    /* [T_s, H] BF16 each, or NULL */
} epx_ref_combine_extras_t;

/* epx_ref_combine_ex - epx_ref_combine, then for each token t: bias[0][t] and then bias[1][t]
 * (those given, converted exactly) are added to the float32 sum, each addition rounded, before
 * the one BF16 rounding (a token on no rank gets bf16(+0.0f + bias)); and out_w as described
 * above.
 *   extras - [IN/OUT] or NULL (then exactly epx_ref_combine); other arguments as epx_ref_combine.
 * Returns 0 or -1. */
int epx_ref_combine_ex(const epx_ref_world_t *world, int src_rank, const uint16_t *const *y,
                       const float *topk_weights, const epx_ref_combine_extras_t *extras,
                       uint16_t *out);

/* epx_ref_combine_ex_f64 - epx_ref_combine_ex in float64 (the bias added in float64 too) with no
 * final rounding; out_w is still the float32 sum defined above.
 *   out - [OUT] [T_s, H] float64. Returns 0 or -1. */
int epx_ref_combine_ex_f64(const epx_ref_world_t *world, int src_rank, const uint16_t *const *y,
                           const float *topk_weights, const epx_ref_combine_extras_t *extras,
                           double *out);

/* ---------------------------------------------------------------------------------------------
 * DeepEP-parity dispatch options (docs/normal-mode.md): rank-mask routing, the rank prefix
 * matrix, worst-case rows, strided and packed UE8M0 scales.
 * ------------------------------------------------------------------------------------------- */

/* epx_ref_dispatch_mask - what dst_rank receives in a normal dispatch routed by rank masks
 * (epx_dispatch_args_t.is_token_in_rank) instead of expert ids: every token t of every source
 * rank s with masks[s][t*R + dst_rank] != 0, exactly once, ordered by (s, t). Rows carry no ids:
 * topk_idx is -1 and topk_weights 0 everywhere. num_recv_per_expert[j] = sum over s of
 * tokens_per_expert[s][dst_rank*E/R + j] (the callers' counts, exchanged as they are), aligned
 * into num_recv_per_expert_aligned. Payload, rank_prefix, src_rank, src_token as
 * epx_ref_dispatch (world's topk_idx is not read).
 *   masks             - [IN]  [R] pointers, masks[s] is [T_s, R] uint8 (NULL when T_s = 0)
 *   tokens_per_expert - [IN]  [R] pointers, each [E] int
 *   other arguments as epx_ref_dispatch. Returns 0 or -1. */
int epx_ref_dispatch_mask(const epx_ref_world_t *world, const uint8_t *const *masks,
                          const int *const *tokens_per_expert, int dst_rank,
                          epx_ref_payload_t payload, int expert_alignment, epx_ref_recv_t *recv);

/* epx_ref_rank_prefix_matrix - DeepEP's rank_prefix_matrix: out[i*R + j] = tokens that ranks
 * 0..i send to rank j (a token counts once per destination).
 *   world - [IN]  every rank's topk_idx (used when masks is NULL)
 *   masks - [IN]  NULL: route by topk_idx; else [R] rank masks as epx_ref_dispatch_mask
 *   out   - [OUT] [R, R] int
 * Returns 0 or -1. */
int epx_ref_rank_prefix_matrix(const epx_ref_world_t *world, const uint8_t *const *masks, int *out);

/* epx_ref_worst_topk_idx - recv_topk_idx of a dispatch with num_worst_tokens: rows
 * [0, num_recv) are recv->topk_idx, rows [num_recv, num_worst) are -1.
 *   recv      - [IN]  a reference receive
 *   top_k     - [IN]  K
 *   num_worst - [IN]  rows of out
 *   out       - [OUT] [num_worst, K] int64
 * Returns 0, or -1 if num_worst < recv->num_recv (nothing written). */
int epx_ref_worst_topk_idx(const epx_ref_recv_t *recv, int top_k, int num_worst, int64_t *out);

/* epx_ref_scales_strided - FP8 scales [T, G] float32 row-major rewritten at element strides:
 * out[t*stride_token + g*stride_group] = scales[t*G + g]; other elements of out untouched.
 * Column-major [T, G] (DeepEP's tests) is stride_token 1, stride_group T. Works on any 4-byte
 * words (packed UE8M0 scales too, with G their word count).
 * Returns 0, or -1 on a negative dimension or a stride < 1. */
int epx_ref_scales_strided(const void *scales, int num_tokens, int num_groups, int stride_token,
                           int stride_group, void *out);

/* epx_ref_ue8m0_pack - pack float32 scales [T, G] four per int32 word, as DeepGEMM's
 * transpose_and_pack_fp32_into_ue8m0 and DeepEP do: word j of a row holds groups 4j..4j+3, group
 * 4j+i in bits [8i, 8i+8) (little-endian bytes), each byte the scale's biased exponent field
 * (float bits 30..23; exact for positive powers of two, the mantissa is dropped otherwise);
 * bytes past G are 0.
 *   out - [OUT] [T, (G + 3) / 4] int32
 * Returns 0, or -1 on a negative dimension. */
int epx_ref_ue8m0_pack(const float *scales, int num_tokens, int num_groups, int32_t *out);

#ifdef __cplusplus
}
#endif

#endif /* EPX_TESTS_REF_H_ */

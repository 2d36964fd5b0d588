/*
 * api.h - host launchers of EPX's kernels, one section per kernel family (layout.cu,
 * barrier.cu, normal-mode and low-latency files). Each takes the group's kernel context by value
 * plus an args struct, launches on the caller's stream through epx::launch (launch.cuh) and
 * returns the launch's status.
 */
#ifndef EPX_KERNELS_API_H_
#define EPX_KERNELS_API_H_

#include <cuda.h> /* CUtensorMap */
#include <stdint.h>

#include "epx.h"
#include "kernel_ctx.h"
#include "workspace.h"

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
  /* Rank-mask routing (topk_idx NULL): the caller's [T, R] mask and [E] expert counts, which the
   * kernel copies into num_tokens_per_expert. from_mask = 0: route by topk_idx. */
  int from_mask;
  const uint8_t *in_rank_mask;
  const int *in_tokens_per_expert;
  /* Expert-major positions (epx_dispatch_expand; ids only): [T, K], slot k of token t = its
   * position among this rank's tokens listing expert topk[t][k] (-1: empty slot). NULL: off. */
  int *expand_pos;
} epx__layout_launch_args_t;

epx_status_t epx__layout_launch(const epx__kernel_ctx_t *ctx, const epx__layout_launch_args_t *args,
                                cudaStream_t stream);

/* The bounded agreement (agree.cu): all[p * n + i] = rank p's mine[i] for every rank p not in
 * the bit mask skip; outcome[0] = -1, or the first rank that did not come within the budget or
 * gave the agreement up (its words missing), outcome[1] = the mask of all such ranks.
 * n <= EPX_AGREE_MAX_WORDS; device memory. */
epx_status_t epx__agree_launch(const epx__kernel_ctx_t *ctx, const long long *mine, int n,
                               long long *all, unsigned skip, int *outcome, cudaStream_t stream);
/* One-block barrier across all ranks through the control region's inboxes; skip_masked: not
 * the peers in this rank's low-latency peer mask (neither told nor waited for). */
epx_status_t epx__barrier_launch(const epx__kernel_ctx_t *ctx, int skip_masked,
                                 cudaStream_t stream);
/* Clock sync of tracing: `rounds` barrier rounds; out[0] = %globaltimer's step, out[1 + r] =
 * this rank's %globaltimer at the end of round r (0 if it timed out). Device memory. */
epx_status_t epx__clock_sync_launch(const epx__kernel_ctx_t *ctx, unsigned long long *out,
                                    int rounds, cudaStream_t stream);

/* Normal mode (src/kernels/notify.cu, normal_dispatch.cu, normal_combine.cu). The routing of
 * one dispatch, kept in its handle (device memory). */
typedef struct epx__routing {
  uint8_t *is_token_in_rank;  /* [max_tokens, R] */
  int *token_pos_in_rank;     /* [max_tokens, R] */
  int *num_tokens_per_rank;   /* [R] */
  int *num_tokens_per_expert; /* [E] */
  epx__recv_meta_t *meta;     /* counts after the exchange */
  int num_tokens;
} epx__routing_t;

/* Words of a handle's mapped host counts and where each part starts: [0] num_recv, [1, 1 + L)
 * per local expert, [1 + L] an expert-major dispatch's rows; then, expert-major only:
 * [L][R] each local expert's rows from each source, [R] the tokens received from each source,
 * and the group's normal combines completed before this dispatch (the combine slab's parity). */
#define EPX__HOST_COUNTS_BY_SOURCE(E, R) (2 + (E) / (R))
#define EPX__HOST_COUNTS_TOKENS(E, R) (2 + (E) / (R) + (E))
#define EPX__HOST_COUNTS_COMBINES(E, R) (2 + (E) / (R) + (E) + (R))
#define EPX__HOST_COUNTS(E, R) (3 + (E) / (R) + (E) + (R))

typedef struct epx__notify_launch_args {
  epx__routing_t routing;
  int num_experts, expert_alignment, max_tokens;
  int *host_counts; /* device alias of the handle's mapped host counts [EPX__HOST_COUNTS(E, R)]:
                       num_recv, per-expert (expand: the real counts, then the rows, the rows by
                       source, the tokens by source and the combines done); or NULL */
  int expand;       /* 1: epx_dispatch_expand's exchange: all E counts to every rank, and the
                       meta's expand_* fields (notify.cu) */
  int refused;      /* 1: this rank refused its call (too many tokens): it tells every peer it
                       gives up (its abort word, then count words of 0), waits for nothing and
                       marks the meta aborted, so every rank's call fails at once (notify.cu) */
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
  /* Formats (epx_dispatch_args_t): x_scales element (t, g) at t * scale_stride_token +
   * g * scale_stride_group, scale_cols words per row (float32 or packed UE8M0 int32, copied as
   * 4-byte words); scales_strided = 0 when the strides are (scale_cols, 1). */
  int scale_cols, scales_strided, scales_packed;
  long long scale_stride_token, scale_stride_group;
  int write_meta;     /* 1: write recv_topk_idx / weights / src_token (topk_idx NULL: -1 / 0) */
  int recv_idx_int64; /* recv_topk_idx as int64 */
} epx__dispatch_launch_args_t;

/* Expert-major dispatch (expand_dispatch.cu): d's payload, formats, ids and weights as for
 * epx__dispatch_launch (write_meta and recv_idx_int64 unused), plus the layout's positions. */
typedef struct epx__expand_dispatch_launch_args {
  epx__dispatch_launch_args_t d;
  const int *expand_pos; /* [T, K] the handle's: position of t among this rank's tokens listing
                            expert topk[t][k] */
  /* config.expand_fan_out == DURING: d.num_blocks sending blocks, then fan_out_blocks blocks
   * that copy each arrived token to its other rows (expand_dispatch.cu); 0 with AFTER. */
  int fan_out_blocks;
  /* DURING: a sending warp publishes its tokens' ready words every publish_batch tokens (one
   * system-scope fence for the batch), 1..32 (EPX_EXPAND_PUBLISH_BATCH) */
  int publish_batch;
} epx__expand_dispatch_launch_args_t;

/* Expert-major dispatch, receiver side (expand_dispatch.cu): each received token's payload
 * copied from its first row to its other rows (the sender writes it once per rank). */
typedef struct epx__expand_fan_out_launch_args {
  const epx__recv_meta_t *meta; /* the handle's: num_recv, aborted */
  int top_k;
  int row_bytes;  /* H x payload element bytes, a multiple of 16 */
  int scale_cols; /* FP8: 4-byte scale words per row (float32 or packed UE8M0); else 0 */
  int num_blocks;
  int num_local_experts; /* L: the rows' experts, for the arrival counts */
} epx__expand_fan_out_launch_args_t;

/* Expert-major combine, expert side (expand_combine.cu): partial[i] = BF16(sum over received
 * token i's rows r (token_rows, ascending) of w_r * x[r]), w_r = the row's weight or 1. */
typedef struct epx__expand_reduce_launch_args {
  const epx__recv_meta_t *meta; /* num_recv */
  const void *x;                /* [rows, H] BF16 expert outputs, expanded order */
  void *partial;                /* [num_recv, H] BF16 */
  int weighted, hidden, top_k, num_blocks;
  /* 0: x row r is expanded row r. > 0: x is blocked, local expert j's rows at
   * [j * block_rows, j * block_rows + count[j]) (the prefill layer's batched GEMM): expanded row
   * r of segment j (meta->expand_begin) is x row j * block_rows + r - expand_begin[j]. */
  int block_rows, num_local_experts;
  /* one_source = 1: only the tokens received from rank `source` (their plain rows
   * [rank_prefix[source], rank_prefix[source + 1]) of meta; the prefill layer's phases) */
  int one_source, source;
  /* The phases' rows (epx__moe_phase_parts_args_t; NULL: none): expanded row r of part q
   * (parts [num_parts + 1]) is x row part_out[q] + r - parts[q] */
  const int *parts, *part_out;
  int num_parts;
} epx__expand_reduce_launch_args_t;

epx_status_t epx__expand_dispatch_launch(const epx__kernel_ctx_t *ctx,
                                         const epx__expand_dispatch_launch_args_t *args,
                                         cudaStream_t stream);
epx_status_t epx__expand_fan_out_launch(const epx__kernel_ctx_t *ctx,
                                        const epx__expand_fan_out_launch_args_t *args,
                                        cudaStream_t stream);
epx_status_t epx__expand_reduce_launch(const epx__kernel_ctx_t *ctx,
                                       const epx__expand_reduce_launch_args_t *args,
                                       cudaStream_t stream);

/* Rows [num_recv, num_worst) of recv_topk_idx = -1, of recv_topk_weights = 0 (notify.cu); a
 * num_recv above num_worst is raised as EPX_ERR_INVALID_ARGUMENT, stage DISPATCH. */
typedef struct epx__worst_tail_launch_args {
  const epx__recv_meta_t *meta;
  int num_worst, top_k, recv_idx_int64;
} epx__worst_tail_launch_args_t;

typedef struct epx__combine_launch_args {
  epx__routing_t routing;
  const void *x; /* [num_recv, H] BF16 */
  const void *topk_idx;
  int idx_is_int64;
  const float *topk_weights; /* NULL = unweighted */
  void *out;                 /* [T, H] BF16 */
  int hidden, top_k, num_experts, max_tokens, num_blocks;
  int rows_invalid; /* 1: this rank's rows are not valid (a step before the combine failed here):
                       they are sent marked, and every peer leaves them out of its sums and records
                       EPX_ERR_PEER_DATA (stage COMBINE, this rank) */
  /* Gated (the prefill layer's phases, docs/moe.md "Phases by source"): NULL, or this rank's
   * [R] words, written on this GPU while the combine runs. The rows received from source s are
   * sent back (s remote) or summed (s = this rank) only once gate[s]'s low 31 bits equal
   * gate_value (a bounded wait); bit 31 set says they are not valid: they go marked, as with
   * rows_invalid. The send order is then source by source, this rank + 1 first. */
  const unsigned *gate;
  unsigned gate_value;
  /* Gated only: 1 when the rows for every remote source are already in its slab (the prefill
   * layer's phases copied them with the copy engines, before this kernel, into the parity of
   * this call: rows_sent_parity, checked). The send warps then only signal each chunk's rows
   * (marked where the gate says not valid); nothing is loaded or stored. */
  int rows_sent;
  unsigned rows_sent_parity; /* 0 or 1; 2: not known (the rows are all marked anyway) */
} epx__combine_launch_args_t;

/* What a normal combine adds for DeepEP parity (src/kernels/combine_extras.cuh); a separate
 * kernel argument, so that a plain combine's kernel keeps its parameters and registers. */
typedef struct epx__combine_extras {
  const float *recv_topk_weights; /* [num_recv, K] sent back with the rows, or NULL */
  float *out_topk_weights;        /* [T, K] summed over ranks; NULL iff recv_topk_weights is */
  const void *bias[2];            /* [T, H] BF16 each, or NULL */
} epx__combine_extras_t;

epx_status_t epx__notify_launch(const epx__kernel_ctx_t *ctx, const epx__notify_launch_args_t *args,
                                cudaStream_t stream);
epx_status_t epx__dispatch_launch(const epx__kernel_ctx_t *ctx,
                                  const epx__dispatch_launch_args_t *args, cudaStream_t stream);
/* extras: NULL, or all its pointers NULL, for a plain combine. */
epx_status_t epx__combine_launch(const epx__kernel_ctx_t *ctx,
                                 const epx__combine_launch_args_t *args,
                                 const epx__combine_extras_t *extras, cudaStream_t stream);
/* One warp: returns once every peer has finished the combine that last used the slab parity
 * this rank's next combine writes (the wait a combine's send warps make before they store):
 * what the prefill layer's copies into the peers' slabs queue behind. Bounded (raised as
 * EPX_ERR_TIMEOUT, stage COMBINE, naming the peer). */
epx_status_t epx__combine_slab_free_launch(const epx__kernel_ctx_t *ctx, cudaStream_t stream);
epx_status_t epx__worst_tail_launch(const epx__kernel_ctx_t *ctx,
                                    const epx__worst_tail_launch_args_t *args, cudaStream_t stream);

/* Low-latency mode (src/kernels/ll_dispatch.cu, ll_pack.cuh, ll_combine.cu). phases:
 * EPX_LL_PHASE_SEND | EPX_LL_PHASE_RECV. */
#define EPX_LL_PHASE_SEND 1
#define EPX_LL_PHASE_RECV 2

typedef struct epx__ll_dispatch_launch_args {
  const void *x;        /* [T, H] BF16 */
  const void *topk_idx; /* [T, K] */
  int idx_is_int64;
  const float *topk_weights; /* [T, K] or NULL (weights 1) */
  int num_tokens, hidden, top_k, num_experts, max_tokens;
  int fp8, ue8m0, by_rank, parity, phases, num_blocks;
  int packed;              /* packed layout (by_rank only) */
  int pack_scales;         /* FP8 scales as UE8M0 words, four per int32 */
  long long *layout_range; /* [L, R] (begin << 32) | count, packed only; or NULL */
} epx__ll_dispatch_launch_args_t;

typedef struct epx__ll_combine_launch_args {
  const void *x;  /* [L, R*M, H] BF16 expert outputs */
  void *out;      /* [T, H] BF16 */
  int num_tokens; /* T of the dispatch */
  int hidden, top_k, num_experts, max_tokens;
  int by_rank, parity, phases, num_blocks;
  int packed;                /* the dispatch's rows are packed: (j, s) starts at recv_begin[j][s] */
  const float *topk_weights; /* [T, K] combine-time weights, or NULL (the dispatch's, my_w);
                                DIRECT combine only (by_rank = 0) */
  int early_launch;          /* launched early (launch.cuh): may start while the previous
                                kernel of the stream (the experts' down projection) runs */
  int rows_sent;             /* DIRECT: the rows are already in the sources' receive rows (the
                                experts' down projection wrote them there, epx_moe_decode): the
                                send phase only signals */
  int rows_invalid;          /* this rank's rows are not valid (epx_moe_decode's FFN failed): its
                                signals carry the mark; every peer leaves its slots out and records
                                EPX_ERR_PEER_DATA (stage LL_COMBINE, this rank) */
} epx__ll_combine_launch_args_t;

epx_status_t epx__ll_dispatch_launch(const epx__kernel_ctx_t *ctx,
                                     const epx__ll_dispatch_launch_args_t *args,
                                     cudaStream_t stream);
epx_status_t epx__ll_combine_launch(const epx__kernel_ctx_t *ctx,
                                    const epx__ll_combine_launch_args_t *args, cudaStream_t stream);
/* Low-latency peer mask (src/kernels/peer_mask.cu): this rank's ll_peer_mask |= bits. */
epx_status_t epx__peer_mask_launch(const epx__kernel_ctx_t *ctx, unsigned bits,
                                   cudaStream_t stream);

/* Experts' FFN (src/kernels/experts_ffn.cu: BF16, experts_fp8.cu: FP8): group-free, local to one
 * GPU. Expert e's rows of x / out are [begin, begin + count), count read on the device (begin =
 * expert_begin[e], or e * rows_per_expert when expert_begin is NULL), cut to the expert's room. */
/* Where the down projection's rows go instead of `out` when they are sent straight back to
 * their tokens (epx_moe_decode on a DIRECT combine): row r, with src_info[r] = (source s, token
 * t, slot k), to recv[s] + (t * top_k + k) * n BF16 values, as the low-latency combine's send
 * would copy it. Rows of a source in *dead_mask (read once per CTA) are not written. */
typedef struct epx__experts_scatter {
  const int *src_info;       /* [num_rows][4] */
  char *recv[EPX_MAX_RANKS]; /* each rank's combine receive rows, this call's buffer */
  const unsigned *dead_mask; /* the group's low-latency peer mask */
  int num_ranks, top_k, max_tokens;
} epx__experts_scatter_t;

typedef struct epx__experts_gemm_args {
  const void *x;         /* [num_rows, k] BF16, or FP8 E4M3 (fp8) */
  const float *x_scales; /* FP8: [num_rows, k/128] */
  const void *w;         /* [E, n, k] BF16 or FP8 E4M3 */
  const float *w_scales; /* FP8: [E, n/128, k/128] */
  int k, n;              /* multiples of 128; swiglu: n = 2 I */
  int num_experts, num_rows, rows_per_expert;
  const int *expert_count; /* [E] device */
  const int *expert_begin; /* [E] device or NULL */
  int fp8;                 /* FP8 weights and FP8 x, both with scales; else BF16 */
  int swiglu;              /* out = silu(gate) * up: [num_rows, n/2] (BF16, or FP8 with
                              out_scales [num_rows, n/256]); else out = y: [num_rows, n] BF16 */
  void *out;
  float *out_scales;
  int early_launch; /* launched early (launch.cuh): may start while the previous kernel runs */
  int scatter_rows; /* down projection (swiglu = 0, BF16 out): rows go where `scatter` says */
  epx__experts_scatter_t scatter;
} epx__experts_gemm_args_t;

/* Either weight format (fp8 picks the FP8 kernels). */
epx_status_t epx__experts_gemm_launch(const epx__experts_gemm_args_t *args, cudaStream_t stream);
/* The FP8 GEMMs (experts_fp8.cu, wgmma): what epx__experts_gemm_launch runs with fp8 set. */
epx_status_t epx__experts_fp8_gemm_launch(const epx__experts_gemm_args_t *args,
                                          cudaStream_t stream);

/* The FP8 GEMMs' x from BF16 rows: E4M3 codes and one scale per 128 channels
 * (tests/ref/epx_ref.h's rule). FP8 rows are used as they come. */
typedef struct epx__experts_quantize_args {
  const void *x; /* [num_rows, hidden] BF16 */
  void *codes;   /* [num_rows, hidden] FP8 E4M3 */
  float *scales; /* [num_rows, hidden/128] */
  int hidden, num_experts, num_rows, rows_per_expert;
  const int *expert_count;
  const int *expert_begin;
  int early_launch; /* launched early (launch.cuh): may start while the previous kernel runs */
} epx__experts_quantize_args_t;

epx_status_t epx__experts_quantize_x_launch(const epx__experts_quantize_args_t *args,
                                            cudaStream_t stream);

/* The prefill MoE layer's row kernel (src/kernels/moe_prefill.cu), between its cuBLAS GEMMs, over
 * rows [0, num_rows) of the expert-major layout (local expert j's segment [begin[j],
 * begin[j + 1]), its real rows the first count[j]):
 *   swiglu = 1: in is [rows, 2 cols] (gate then up), f = silu(gate) * up in float32;
 *   swiglu = 0: in is [rows, cols], f = in.
 *   quantize = 0: out[r] = BF16(f) ([rows, cols]);
 *   quantize = 1: out[r] = FP8 E4M3 of f per 128 channels (tests/ref/epx_ref.h's rule) and the
 *                 scale of group g of row r at scales[begin[j] * G + g * S + (r - begin[j])],
 *                 G = cols / 128, S = begin[j + 1] - begin[j] (cuBLASLt's 1x128 layout, rows
 *                 contiguous per segment).
 * Padding rows are written as zeros (scales 1). in is float32 (in_fp32) or BF16. */
typedef struct epx__moe_rows_launch_args {
  const void *in;
  int in_fp32, swiglu, quantize;
  void *out;
  float *scales;
  int cols, num_rows, num_experts;
  const int *begin; /* device [num_experts + 1] */
  const int *count; /* device [num_experts] */
  int num_blocks;
  /* NULL, or device [num_experts]: segment j's real rows go to out row out_begin[j] + (r -
   * begin[j]) (the phases' rows, epx__moe_phase_parts_args_t), its scales at out_begin[j] * G +
   * g * S4 + (r - begin[j]), S4 = count[j] rounded up to 4; padding rows are not written */
  const int *out_begin;
} epx__moe_rows_launch_args_t;

epx_status_t epx__moe_rows_launch(const epx__moe_rows_launch_args_t *args, cudaStream_t stream);

/* The prefill layer's FP8 wire (moe_prefill.cu): a chunk's BF16 tokens [num_tokens, hidden]
 * quantized per 128 channels by the row kernel's rule (so the expert side gets the codes and
 * scales it would have made itself): codes [num_tokens, hidden], scales [num_tokens,
 * hidden/128] (row-major: epx_dispatch's contiguous scales). */
typedef struct epx__moe_quantize_tokens_launch_args {
  const void *x;
  void *codes;
  float *scales;
  int num_tokens, hidden, num_blocks;
} epx__moe_quantize_tokens_launch_args_t;

epx_status_t epx__moe_quantize_tokens_launch(const epx__moe_quantize_tokens_launch_args_t *args,
                                             cudaStream_t stream);

/* Received FP8 rows' scales, in [num_rows, groups] row-major (as epx_dispatch_expand delivers
 * them), into the per-segment layout epx__moe_rows_launch writes and the GEMMs read:
 * out[begin[j] * groups + g * S + (r - begin[j])], S = begin[j + 1] - begin[j]; padding rows
 * get 1. */
typedef struct epx__moe_segment_scales_launch_args {
  const float *in;
  float *out;
  int num_rows, groups, num_experts;
  const int *begin; /* device [num_experts + 1] */
  const int *count; /* device [num_experts] */
  int num_blocks;
} epx__moe_segment_scales_launch_args_t;

epx_status_t epx__moe_segment_scales_launch(const epx__moe_segment_scales_launch_args_t *args,
                                            cudaStream_t stream);

/* The prefill layer's grouped FP8 GEMM (moe_gemm_fp8.cu): for every local expert j in
 * [0, num_experts), on its segment [begin[j], begin[j + 1]) of the expert-major rows (device
 * bounds; each segment a multiple of 4 rows starting at a multiple of 4):
 *   y[r][c] = sum over k-blocks b of w_scale_j[c / 128][b] x_scale[r][b] x
 *             sum over k in b of x[r][k] w_j[c][k]
 * x: FP8 E4M3 [rows, k]; x_scales: per-segment, row r of segment j and block b at
 * begin[j] * (k / 128) + b * S_j + (r - begin[j]) (epx__moe_rows_launch's layout); w_j at
 * w + j * w_stride bytes (w_stride = n k: the weights are one [L n, k] matrix), [n, k] FP8; its
 * scales at w_scales + j * ws_stride floats, [n / 128][ws_kb] (ws_kb >= k / 128 and a multiple
 * of 4, both scale arrays 16-byte aligned: they are copied in bulk); y [rows, n] float32 (y_fp32,
 * 8-byte aligned) or BF16 (16-byte aligned). n a multiple of 128 (and under 2^31 / 168: 32-bit
 * offsets in a tile), k of 128 (epx__moe_gemm_fp8_supported). num_ctas persistent CTAs (the SMs the
 * GEMM may use). */
typedef struct epx__moe_gemm_fp8_args {
  /* Set by the launcher (TMA): the weights as one [L n, k] matrix in boxes of tile_w rows; x
   * [x_rows, k] in boxes of tile_x rows (every tile loads tile_x, whatever its rows). */
  CUtensorMap tmap_w, tmap_x;
  const void *w;
  size_t w_stride;
  const float *w_scales;
  size_t ws_stride;
  int ws_kb;
  const void *x;
  const float *x_scales;
  void *y;
  int y_fp32;
  int n, k, num_experts;
  const int *begin; /* device [num_experts + 1] */
  int x_rows;       /* rows x has (reads past them are zeros); 0: nothing to do */
  int num_ctas;
  int tile_x;       /* rows of x of a tile, at most, every tile computing all of them: one of
                       EPX__MOE_TILE_X_WIDTHS, 64 to 160 (moe_tiles.h; at the usual width x's
                       rows are wgmma's M, at the others its N) */
  int tile_w;       /* weight rows of a tile: EPX__MOE_TILE_W (also for 0) or, with tile_x at
                       most EPX__MOE_TILE_X and n a multiple of it, EPX__MOE_TILE_W_TALL */
  int early_launch; /* launched early (launch.cuh): may start while the previous kernel runs */
  /* NULL, or device [4]: CTA 0's clock64 and %globaltimer (ns) where its work starts and ends,
   * from which a benchmark reads the SM clock the launch ran at (epx_moe_gemm_bench) */
  unsigned long long *clock_probe;
} epx__moe_gemm_fp8_args_t;

/* The prefill layer's phases by source (moe_phases.cu). parts [L x R + 1]: part (j, s) of local
 * expert j's segment (rows from source s, expert-major) begins at parts[j R + s] and holds
 * part_count[j R + s] real rows; the last source's part also holds the segment's padding. */
typedef struct epx__moe_phase_parts_args {
  const int *source_counts; /* [L][R] rows of source s for local expert j (the handle's mapped
                               host counts after an expert-major dispatch) */
  const int *begin;         /* device [L + 1] the segment begins */
  int *parts;               /* device [L R + 1] */
  int *part_count;          /* device [L R] */
  /* The phases' rows of h and y ("phase rows"): source s's parts, expert by expert, each at a
   * multiple of 4 rows (the FP8 GEMM copies a segment's scales in 16-byte pieces), sources one
   * after another: part (j, s) at part_out[j R + s]; phase s's segments as a GEMM takes them
   * at phase_begin[s (L + 1) + j], j <= L (the last: where s's rows end). */
  int *part_out;    /* device [L R] */
  int *phase_begin; /* device [R (L + 1)] */
  int num_experts, num_sources;
} epx__moe_phase_parts_args_t;

epx_status_t epx__moe_phase_parts_launch(const epx__moe_phase_parts_args_t *args,
                                         cudaStream_t stream);
/* *gate = value, with release at GPU scope, after everything before it on the stream. */
epx_status_t epx__moe_gate_launch(unsigned *gate, unsigned value, cudaStream_t stream);

int epx__moe_gemm_fp8_supported(int n, int k, int num_experts);
/* The driver gives cuTensorMapEncodeTiled (the launcher's tensor maps need it). */
int epx__moe_gemm_fp8_driver_ok(void);
epx_status_t epx__moe_gemm_fp8_launch(const epx__moe_gemm_fp8_args_t *args, cudaStream_t stream);

/* The prefill layer's batched GEMM (EPX_MOE_FFN_CUBLAS_GROUPED, moe_gemm.c): one cuBLAS call
 * over every local expert j in [0, num_experts), each on a block of block_rows rows; cuBLAS
 * takes the blocks' matrices as device arrays of pointers: ptrs[j] = w + j * w_stride (A: the
 * weights), ptrs[S + j] = x + xr(j) * x_row (B: the rows), ptrs[2 S + j] = y + yr(j) * y_row
 * (C: the outputs), S = array_stride (a multiple of 32 keeps each array 256-byte aligned, as
 * batched cuBLAS calls want). xr(j) = begin[j] (the expert-major rows as dispatched) when
 * x_blocked is 0, else j * block_rows (a blocked scratch); yr(j) likewise with y_blocked. With
 * blocked_begin set, also blocked_begin[j] = j * block_rows for j in [0, num_experts] (the row
 * kernel's segments over the blocked scratch). */
typedef struct epx__moe_group_ptrs_launch_args {
  const char *w;
  size_t w_stride; /* bytes */
  const char *x;
  size_t x_row; /* bytes */
  char *y;
  size_t y_row;     /* bytes */
  const int *begin; /* device [num_experts + 1] */
  int num_experts;
  int block_rows;
  int x_blocked, y_blocked;
  int array_stride;   /* pointers from one array to the next */
  void **ptrs;        /* device [3 x array_stride] */
  int *blocked_begin; /* device [num_experts + 1], or NULL */
} epx__moe_group_ptrs_launch_args_t;

epx_status_t epx__moe_group_ptrs_launch(const epx__moe_group_ptrs_launch_args_t *args,
                                        cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* EPX_KERNELS_API_H_ */

/*
 * moe_prefill.h - the prefill MoE layer's internals (src/moe_prefill.c, src/moe_gemm.c): the
 * plan, its workspace layout and chunk split (pure functions, host-tested), the FFN of one
 * chunk's rows and the plain cuBLAS reference the benchmark compares it with.
 *
 * Invariant: every row the FFN reads is in the expert-major layout of epx_dispatch_expand with
 * expert_alignment EPX__MOE_ALIGN, so every local expert's segment [begin[j], begin[j + 1]) is a
 * multiple of 4 rows and starts at a multiple of 4 (the FP8 scales' per-segment layout below
 * relies on it).
 */
#ifndef EPX_SRC_MOE_PREFILL_H_
#define EPX_SRC_MOE_PREFILL_H_

#include <cublasLt.h>
#include <cublas_v2.h>

#include "epx.h"

#ifdef __cplusplus
extern "C" {
#endif

#define EPX__MOE_ALIGN 4       /* expert_alignment of the layer's dispatches */
#define EPX__MOE_MAX_CHUNKS 16 /* config.num_chunks */
/* SMs the phases' GEMMs and reduces need beside the gated combine when it sends on SMs
 * (args->overlap = EPX_MOE_OVERLAP_PHASES with EPX_MOE_PHASES_COPY_ENGINE=0; fewer is refused:
 * with none they never run and every gate times out) */
#define EPX__MOE_PHASES_MIN_SMS 16
#define EPX__MOE_BLAS_WS (32u << 20) /* cuBLAS / cuBLASLt workspace bytes */
#define EPX__MOE_LT_CACHE 64         /* cached cuBLASLt algorithms */
#define EPX__MOE_MAX_LANES 8         /* config.gemm_lanes */
#define EPX__MOE_AUTO_LANES 4        /* its default */

/* Where each region of a call's workspace starts (bytes, 256-aligned), and the total. */
typedef struct epx__moe_ws_layout {
  size_t y[2];   /* [rows, H] BF16: the experts' outputs of the chunks on group 0 and group 1 */
  size_t gu;     /* [rows, 2I] BF16 or float32 (FP8 cuBLASLt with gate_up_out_fp32) */
  size_t h;      /* [rows, I] BF16 (BF16 weights) or FP8 codes (FP8 weights) */
  size_t hs;     /* FP8: [rows x I/128] float32 scales, per-segment layout (below) */
  size_t xq;     /* FP8: [rows, H] FP8 codes of the received rows */
  size_t xs;     /* FP8: [rows x H/128] float32 scales, per-segment layout */
  size_t send;   /* FP8 on the wire: [send_tokens, H] FP8 codes of a chunk's tokens */
  size_t send_s; /* FP8 on the wire: [H/128, send_tokens] float32 scales (column-major) */
  size_t blas;   /* lanes x EPX__MOE_BLAS_WS bytes for cuBLAS: one slice per GEMM lane */
  size_t ffn;    /* backend EPX: epx_experts_ffn's workspace (the regions gu..blas are unused) */
  size_t total;
} epx__moe_ws_layout_t;

/* The layout for `rows` rows (config.expand_max_rows). backend: EPX_MOE_FFN_CUBLAS or _EPX;
 * lanes: the plan's GEMM lanes (cuBLAS); ffn_bytes: epx_experts_ffn_workspace_size for rows
 * (backend EPX); send_tokens: a chunk's most tokens when they cross NVLink in FP8, else 0.
 * Pure. */
epx__moe_ws_layout_t epx__moe_ws_layout(int backend, int fp8, int gu_fp32, int lanes, size_t rows,
                                        int hidden, int intermediate, size_t ffn_bytes,
                                        size_t send_tokens);

/* The lane of each of L experts for a chunk with these row counts: the least-loaded lane (by
 * rows) in expert order, so a few large experts do not queue behind each other. Pure. */
void epx__moe_assign_lanes(const int *count, int L, int lanes, int *lane);

/* Chunk c of n over T tokens: [*first, *first + *count), sizes differing by at most one, the
 * larger first; the largest is ceil(T / n). Pure. */
void epx__moe_chunk(int T, int n, int c, int *first, int *count);

/* Orders `later` after everything queued on `earlier` so far (ev recorded there, waited for
 * here); where the event cannot be recorded or waited for, `earlier` is drained on the host
 * instead, so the order holds either way (the event's failure is returned). The layer's joins:
 * its streams with the caller's, the GEMM lanes with the compute stream. */
epx_status_t epx__moe_order_after(cudaStream_t later, cudaStream_t earlier, cudaEvent_t ev);

/* EPX_MOE_FFN_AUTO with FP8 weights runs EPX's grouped FP8 GEMM when one expert's gate/up GEMM
 * in a chunk, on the rows a uniform routing of max_tokens_per_rank tokens a rank gives it
 * (max_tokens_per_rank x ranks x top_k / experts / chunks), is under this many floating-point
 * operations; cuBLASLt, one call per expert, otherwise. Such a call costs the host ~11 us; a
 * smaller GEMM leaves the GPU waiting for the host (docs/moe.md, "Which FFN AUTO runs":
 * measured on 2 and 4 H200s, Qwen3-30B-A3B's experts at 1.6e9 and 3.2e9: the grouped GEMM's
 * layer 1.5-1.8x faster; DeepSeek-V3's at 7.5e9: level; at 1.5e10: cuBLASLt's 1.22x faster;
 * all at 4096 tokens a rank and two chunks, so a plan whose calls carry far more or fewer
 * tokens than max_tokens_per_rank, or with more chunks, is extrapolated). Pure: the plan's
 * values, the same on every rank. Not applied without cuBLAS (AUTO keeps EPX's FFN there). */
#define EPX__MOE_GROUPED_FP8_MAX_FLOPS 1e10
int epx__moe_auto_grouped_fp8(long long max_tokens_per_rank, int ranks, int top_k, int experts,
                              int chunks, int hidden, int intermediate);

typedef struct {
  int valid, kind, bucket;
  cublasLtMatmulAlgo_t algo;
} epx__moe_lt_algo_t;

struct epx_moe_prefill {
  epx_group_t groups[2];
  int num_groups;
  epx_handle_t handles[2];
  epx_experts_t experts; /* this rank's weights (referenced) */
  int L, H, I, K, R;
  int num_chunks, backend, gemm_sms, device_sms, gu_fp32;
  int no_blas; /* cuBLAS could not be loaded (blas_lib.h): the EPX backend runs the FFN */
  size_t rows; /* config.expand_max_rows */
  size_t ffn_bytes;
  cudaStream_t comm, compute;
  cudaEvent_t start, comm_done, compute_done;
  cudaEvent_t dispatched[EPX__MOE_MAX_CHUNKS], ffn_done[EPX__MOE_MAX_CHUNKS];
  int lanes;                                    /* GEMM lanes: 1 + the streams below */
  int wire_fp8;                                 /* the dispatches carry FP8 (dispatch_dtype) */
  cudaStream_t lane_stream[EPX__MOE_MAX_LANES]; /* [1, lanes): the plan's; lane 0 is the FFN's */
  cudaEvent_t lane_fork, lane_done[EPX__MOE_MAX_LANES];
  cublasHandle_t blas;
  cublasLtHandle_t lt;
  cublasLtMatmulDesc_t lt_desc[2]; /* FP8: 0 gate/up (float32 or BF16 out), 1 down (BF16 out) */
  float *scales[2]; /* FP8: the block scales repacked for cuBLASLt, [E][n/128][kb4] */
  int scales_kb[2]; /* kb4: k/128 rounded up to a multiple of 4 */
  /* [num_chunks x max_tokens_per_rank x K] 1.0f: the weights of calls without */
  float *ones;
  /* EPX_MOE_FFN_CUBLAS_GROUPED (backend CUBLAS, BF16 weights, one lane): one batched GEMM per
   * projection over blocks of equal rows (moe_ffn.c says when). group_ptrs: device, the
   * blocks' A, B and C arrays, each L pointers at a stride of L rounded up to 32
   * (epx__moe_group_ptrs_launch); blocked_begin: device [L + 1], j x the block's rows.
   * batched_chunks, unbatched_chunks: the chunks run each way so far (the tests read them). */
  int grouped;
  void **group_ptrs;
  int *blocked_begin;
  long long batched_chunks, unbatched_chunks;
  epx__moe_lt_algo_t algos[EPX__MOE_LT_CACHE];
  /* EPX_MOE_FFN_EPX_GROUPED: the FP8 cuBLAS plan (backend CUBLAS: its workspace, repacked
   * scales, FP8 wire) with each projection one launch of EPX's grouped FP8 GEMM
   * (kernels/moe_gemm_fp8.cu) instead of a cuBLASLt call per expert; one lane. */
  int fp8_grouped;
  /* Phases by source (args->overlap = EPX_MOE_OVERLAP_PHASES; docs/moe.md "Phases by source"):
   * phase_parts device: parts [E + 1], part counts [E], part_out [E], phase begins
   * [R (L + 1)] (E = L R; api.h's epx__moe_phase_parts_args_t); gates device [R], this
   * rank's gate word of each source, and the value the next call writes (never 0, 31 bits);
   * phase_up: the compute stream's point where the gated combine may start.
   * With the copy engines (EPX_MOE_PHASES_COPY_ENGINE, the default): copy, the stream of the
   * copies of each remote source's partial rows into its slab; reduced[i], the compute stream
   * after phase i's reduce; copied, the copy stream after the last copy; slab_free, the
   * communication stream once every peer is done with the slab parity the copies write. */
  int *phase_parts;
  unsigned *gates;
  unsigned gate_value;
  cudaEvent_t phase_up;
  cudaStream_t copy;
  cudaEvent_t reduced[EPX_MAX_RANKS], copied, slab_free;
};

/* The workspace layout of a plan's calls (epx__moe_ws_layout with the plan's values). */
epx__moe_ws_layout_t epx__moe_plan_ws_layout(epx_moe_prefill_t p);

/* One chunk's received rows, as epx_dispatch_expand left them (sync_counts = 1). */
typedef struct {
  const void *x;         /* [num_rows, H] BF16 (recv_x), or FP8 codes with x_scales */
  const float *x_scales; /* FP8 rows: [num_rows, H/128] float32, row-major; NULL: BF16 rows */
  int num_rows;          /* begin[L], padding included */
  int x_capacity;        /* rows x has room for (the dispatch's expert-major capacity) */
  const int *count;      /* host [L]: real rows of each local expert */
  const int *begin;      /* host [L + 1] */
  const int *count_dev;  /* device [L] */
  const int *begin_dev;  /* device [L + 1] */
  void *y;               /* [num_rows, H] BF16: the experts' outputs */
  /* Phases by source (num_sources > 0; EPX's grouped FP8 GEMM only): the segments cut into
   * parts, part (j, s) the rows of source s for expert j, and the phases' own row order of h
   * and y (api.h's epx__moe_phase_parts_args_t). The row kernel writes h there; the down
   * projection runs one source's block of it at a time. */
  int num_sources;
  int phase_rows;             /* rows of that order (each part rounded up to 4) */
  const int *phase_begin;     /* host [R (L + 1)] */
  const int *phase_begin_dev; /* device [R (L + 1)] */
  const int *parts_dev;       /* device [L R + 1] */
  const int *part_count_dev;  /* device [L R] */
  const int *part_out_dev;    /* device [L R] */
} epx__moe_rows_t;

/* The FFN of one chunk on stream (src/moe_ffn.c): every local expert on its rows, y written for
 * its real rows; the GEMMs spread over the plan's lanes and joined back into stream.
 * overlapped: the GEMMs target plan->gemm_sms SMs (communication runs beside them).
 * *y_block_rows: 0 when y is in the rows' expert-major order; > 0 when the batched GEMM left it
 * blocked (expert j's rows from j x that), for epx__combine_expand_blocked. */
epx_status_t epx__moe_ffn(epx_moe_prefill_t p, const epx__moe_rows_t *rows, int overlapped,
                          char *ws, size_t ws_bytes, int *y_block_rows, cudaStream_t stream);
/* Blocks of a row kernel (moe_prefill.cu: 256 threads, memory-bound) over sms SMs (0: every SM
 * of the GPU): EPX_MOE_ROW_BLOCKS_PER_SM a SM (docs/env.md). */
int epx__moe_row_blocks(epx_moe_prefill_t p, int sms);
/* The phases' rows (api.h's epx__moe_phase_parts_args_t, as the parts kernel computes them on
 * the device): by_source [L][R] rows of source s for expert j; phase_begin [R (L + 1)] gets
 * source s's segments, each part at a multiple of 4 rows, sources one after another. Returns
 * the rows in all. Pure; host-tested. */
int epx__moe_phase_rows(const int *by_source, int L, int R, int *phase_begin);

/* The FFN in phases by source (rows->num_sources > 0, EPX's grouped FP8 GEMM): _up runs gate/up
 * over every row and the row kernel over the parts, into the phases' rows; _down the down
 * projection of source s's block of them on sm_target SMs (0: all), writing y there. */
epx_status_t epx__moe_ffn_phased_up(epx_moe_prefill_t p, const epx__moe_rows_t *rows, char *ws,
                                    size_t ws_bytes, cudaStream_t stream);
epx_status_t epx__moe_ffn_phased_down(epx_moe_prefill_t p, const epx__moe_rows_t *rows, int source,
                                      int sm_target, char *ws, cudaStream_t stream);

/* The plain cuBLAS reference of the FFN's GEMMs: one gate/up GEMM and one down GEMM of
 * rows->num_rows rows on expert 0's weights (the same shapes in one call each, no SwiGLU, no
 * quantization), reading and writing the workspace's regions. Backend CUBLAS only. */
epx_status_t epx__moe_gemm_reference(epx_moe_prefill_t p, const epx__moe_rows_t *rows, char *ws,
                                     size_t ws_bytes, cudaStream_t stream);

/* cuBLAS (src/moe_gemm.c). y[rows, n] = x[rows, k] w[n, k]^T, row-major, float32 accumulation.
 * BF16: cublasGemmEx, BF16 out. sm_target 0: every SM. blas_ws: EPX__MOE_BLAS_WS bytes that no
 * GEMM on another stream uses meanwhile (a lane's slice). */
epx_status_t epx__moe_gemm_bf16(epx_moe_prefill_t p, const void *w, const void *x, void *y, int n,
                                int k, int rows, int sm_target, void *blas_ws, cudaStream_t stream);
/* BF16, batched (plan->grouped): y_j = x_j w_j^T for every local expert j in one
 * cublasGemmBatchedEx, each x_j and y_j block_rows rows: w_j at w + j * w_stride; x_j at x +
 * begin[j] * x_row (x_blocked 0: the dispatched rows; rows past count[j] are read and give
 * rows nobody reads) or at x + j * block_rows * x_row (x_blocked 1); y_j likewise (y_blocked
 * must be 1 where blocks would overlap another expert's rows: always, in practice). With
 * blocked_begin 1 the pointer kernel also writes plan->blocked_begin. */
typedef struct {
  const char *w;
  size_t w_stride;
  const char *x;
  size_t x_row;
  char *y;
  size_t y_row;
  int n, k, block_rows, x_blocked, y_blocked, blocked_begin;
  const int *begin_dev; /* device [L + 1] */
} epx__moe_batched_gemm_t;
epx_status_t epx__moe_gemm_bf16_batched(epx_moe_prefill_t p, const epx__moe_batched_gemm_t *g,
                                        int sm_target, void *blas_ws, cudaStream_t stream);
/* The rows of every block of a chunk's batched GEMMs: the largest count rounded up to
 * EPX__MOE_BLOCK_ROUND; 0 (run the experts one GEMM each) when no expert has rows, when L
 * blocks pass scratch_rows (the FFN's scratch), when the last block's reads pass input_rows
 * (the dispatch's expert-major capacity), or when the blocks hold more than
 * EPX__MOE_BLOCK_WASTE_PCT percent more rows than the real ones (one expert with most of the
 * rows). Pure host code (tests/host/test_moe_prefill_plan.c). */
#define EPX__MOE_BLOCK_ROUND 16
#define EPX__MOE_BLOCK_WASTE_PCT 50
int epx__moe_block_rows(const int *count, const int *begin, int L, size_t scratch_rows,
                        size_t input_rows);
/* The batched GEMM's device pointer arrays and blocked_begin for L experts (plan->grouped);
 * released by epx__moe_gemm_destroy. */
epx_status_t epx__moe_gemm_batched_alloc(epx_moe_prefill_t p);
/* FP8 (cuBLASLt block scaling): w [n, k] E4M3 with w_scales [n/128][kb4] (128x128 blocks), x
 * [rows, k] E4M3 with x_scales [k/128][rows] (1x128 blocks, rows contiguous; rows a multiple of
 * 4), y float32 (which 0 with gu_fp32) or BF16. which: 0 gate/up, 1 down. */
epx_status_t epx__moe_gemm_fp8(epx_moe_prefill_t p, int which, const void *w, const float *w_scales,
                               const void *x, const float *x_scales, void *y, int n, int k,
                               int rows, int sm_target, void *blas_ws, cudaStream_t stream);
/* FP8: whether cuBLASLt has a kernel for `which` with the plan's output types (a heuristic
 * query on a representative size). */
int epx__moe_lt_supported(epx_moe_prefill_t p, int which);
/* cuBLAS handles and, with FP8 weights, the cuBLASLt descriptors; released by
 * epx__moe_gemm_destroy (NULL-safe on a half-made plan; returns the first failure, every
 * handle released either way). cublasDestroy waits for the device: not with a group's NCCL
 * operation pending (plan_free leaks them then). */
epx_status_t epx__moe_gemm_create(epx_moe_prefill_t p);
epx_status_t epx__moe_gemm_destroy(epx_moe_prefill_t p);

#ifdef __cplusplus
}
#endif

#endif /* EPX_SRC_MOE_PREFILL_H_ */

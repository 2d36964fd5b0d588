/*
 * expand_combine.cu - the expert side of the expert-major combine (epx_combine_expand): for each
 * token this rank received (plain order i in [0, num_recv)), the weighted sum of its rows in the
 * expanded layout, rounded to BF16 once:
 *   partial[i] = BF16( 0 + w_0 * y[r_0] + w_1 * y[r_1] + ... )
 * over its row list r_0 < r_1 < ... (token_rows, written by the dispatch; ascending expert), each
 * product and sum rounded to float32 separately (__fmul_rn, __fadd_rn: no fused multiply-add),
 * w = the row's weight (weighted) or 1. That is tests/ref/epx_ref_expand.c's partial_d bit for
 * bit. The partial rows are then the input of today's normal combine (unweighted), which sends
 * each to the token's home rank and sums the ranks' rows there (normal_combine.cu): the home
 * side's reduction is unchanged, and one row per (token, rank) crosses NVLink.
 *
 * The prefill layer's batched GEMM leaves y blocked (api.h, block_rows), and its phases by source
 * in their own row order (part_out): each row index is mapped there before the loads.
 *
 * Purely local (no peer memory, no waits): num_blocks blocks of kThreads, one warp per
 * received token, grid-strided; lane k < K reads list entry k. Rows past the dispatch's capacity
 * are -1 in the list and skipped. At a2f5d44 (EP4, 4096 tokens, H 7168) this pass took 303 us
 * for about 680 MB of HBM traffic (2.2 TB/s) with one column and one row per load step; it now
 * keeps four 16-byte loads in flight per lane (not yet measured).
 */
#include "checks.h"
#include "kernels/api.h"
#include "kernels/bf16.cuh"
#include "kernels/launch.cuh"
#include "kernels/segment.cuh"
#include "kernels/trace.cuh"

namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;
static_assert(EPX_MAX_TOP_K <= 32, "lane k holds list entry k");

/* Blocked expert outputs (args' block_rows > 0): the x row of expanded row r, in the block of
 * r's segment j (the handle's expand_begin, written by the dispatch before this kernel). */
__device__ __forceinline__ int blocked_row(const epx__expand_reduce_launch_args_t &a, int r) {
  const int *begin = a.meta->expand_begin;
  const int j = epx::segment_of(begin, a.num_local_experts, r);
  return j * a.block_rows + (r - begin[j]);
}

/* The phases' rows (args' part_out): the x row of expanded row r, in its part's place. */
__device__ __forceinline__ int phase_row(const epx__expand_reduce_launch_args_t &a, int r) {
  const int q = epx::segment_of(a.parts, a.num_parts, r);
  return a.part_out[q] + (r - a.parts[q]);
}

}  // namespace

namespace epx::normal {

/* Two blocks per SM (64 registers a thread): the reduce is latency-bound, warps in flight are
 * what it needs. */
__global__ void __launch_bounds__(kThreads, 2)
    expand_reduce(epx__kernel_ctx_t ctx, epx__expand_reduce_launch_args_t a) {
  const int lane = threadIdx.x % 32, K = a.top_k, n16 = a.hidden * 2 / 16;
  const int num_recv = a.meta->aborted ? 0 : a.meta->num_recv;
  /* The tokens [first, last) of the plain order: every one, or one source's */
  const int first = a.one_source ? min(a.meta->rank_prefix[a.source], num_recv) : 0;
  const int last = a.one_source ? min(a.meta->rank_prefix[a.source + 1], num_recv) : num_recv;
  const epx__ws_layout_t &L = ctx.layout;
  const char *base = ctx.peer_base[ctx.rank] + L.normal_offset;
  const int *token_rows = (const int *)(base + L.expand_token_rows_offset);
  const float *weights = (const float *)(base + L.expand_weights_offset);
  const int4 *y = (const int4 *)a.x;
  int4 *partial = (int4 *)a.partial;
  const int warps = gridDim.x * kWarps;
  const uint64_t t_start = epx::trace_begin(ctx);
  /* The warp's token's rows (its list without the -1 entries, in list order) and weights, read
   * by every lane from shared memory (a register copy of all EPX_MAX_TOP_K entries spilled
   * under the two-blocks-per-SM register cap). */
  __shared__ int list_row[kWarps][EPX_MAX_TOP_K];
  __shared__ float list_w[kWarps][EPX_MAX_TOP_K];
  const int warp = threadIdx.x / 32;
  const int4 zero = make_int4(0, 0, 0, 0);
  for (int i = first + blockIdx.x * kWarps + warp; i < last; i += warps) {
    const int row = lane < K ? token_rows[(size_t)i * K + lane] : -1;
    const unsigned valid = __ballot_sync(kFull, row >= 0);
    const int nv = __popc(valid);
    if (row >= 0) {
      const int at = __popc(valid & ((1u << lane) - 1u));
      list_row[warp][at] = a.part_out         ? phase_row(a, row)
                           : a.block_rows > 0 ? blocked_row(a, row)
                                              : row;
      list_w[warp][at] = a.weighted ? weights[row] : 1.f;
    }
    __syncwarp();
    /* Two 16-byte columns per lane (c and c + 32) and two rows per step: four loads in flight
     * before the first add (the pass is bound by memory latency). Each element still sums its
     * rows in list order from +0, one rounded product and one rounded add per row. */
    for (int c = lane; c < n16; c += 64) {
      const bool two = c + 32 < n16;
      float acc0[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      float acc1[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      int k = 0;
      for (; k + 2 <= nv; k += 2) {
        const int r0 = list_row[warp][k], r1 = list_row[warp][k + 1];
        const float w0 = list_w[warp][k], w1 = list_w[warp][k + 1];
        const int4 a0 = y[(size_t)r0 * n16 + c], b0 = y[(size_t)r1 * n16 + c];
        const int4 a1 = two ? y[(size_t)r0 * n16 + c + 32] : zero;
        const int4 b1 = two ? y[(size_t)r1 * n16 + c + 32] : zero;
        epx::acc_bf16x8_rn(a0, w0, acc0);
        epx::acc_bf16x8_rn(b0, w1, acc0);
        epx::acc_bf16x8_rn(a1, w0, acc1);
        epx::acc_bf16x8_rn(b1, w1, acc1);
      }
      if (k < nv) {
        const int r = list_row[warp][k];
        const float w = list_w[warp][k];
        const int4 a0 = y[(size_t)r * n16 + c];
        const int4 a1 = two ? y[(size_t)r * n16 + c + 32] : zero;
        epx::acc_bf16x8_rn(a0, w, acc0);
        epx::acc_bf16x8_rn(a1, w, acc1);
      }
      partial[(size_t)i * n16 + c] = epx::float8_to_bf16x8(acc0);
      if (two) partial[(size_t)i * n16 + c + 32] = epx::float8_to_bf16x8(acc1);
    }
    __syncwarp(); /* every lane is done with this token's list before the next overwrites it */
  }
  if (threadIdx.x == 0) epx::trace_end(ctx, t_start, EPX_TRACE_COMBINE_REDUCE, last - first);
}

}  // namespace epx::normal

extern "C" epx_status_t epx__expand_reduce_launch(const epx__kernel_ctx_t *ctx,
                                                  const epx__expand_reduce_launch_args_t *args,
                                                  cudaStream_t stream) {
  return epx::launch<epx::normal::expand_reduce>(args->num_blocks, kThreads, 0, stream, *ctx,
                                                 *args);
}

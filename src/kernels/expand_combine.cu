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
 * Purely local (no peer memory, no waits): num_blocks blocks of kThreads, one warp per
 * received token, grid-strided; lane k < K holds list entry k. Rows past the dispatch's capacity
 * are -1 in the list and skipped.
 */
#include "checks.h"
#include "kernels/api.h"
#include "kernels/bf16.cuh"
#include "kernels/launch.cuh"
#include "kernels/trace.cuh"

namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;
static_assert(EPX_MAX_TOP_K <= 32, "lane k holds list entry k");

}  // namespace

namespace epx::normal {

/* Two blocks per SM (64 registers a thread): the reduce is latency-bound, warps in flight are
 * what it needs. */
__global__ void __launch_bounds__(kThreads, 2)
    expand_reduce(epx__kernel_ctx_t ctx, epx__expand_reduce_launch_args_t a) {
  const int lane = threadIdx.x % 32, K = a.top_k, n16 = a.hidden * 2 / 16;
  const int num_recv = a.meta->aborted ? 0 : a.meta->num_recv;
  const epx__ws_layout_t &L = ctx.layout;
  const char *base = ctx.peer_base[ctx.rank] + L.normal_offset;
  const int *token_rows = (const int *)(base + L.expand_token_rows_offset);
  const float *weights = (const float *)(base + L.expand_weights_offset);
  const int4 *y = (const int4 *)a.x;
  int4 *partial = (int4 *)a.partial;
  const int warps = gridDim.x * kWarps;
  const uint64_t t_start = epx::trace_begin(ctx);
  /* The warp's token's list and weights, read by every lane from shared memory (a register
   * copy of all EPX_MAX_TOP_K entries spilled under the two-blocks-per-SM register cap). */
  __shared__ int list_row[kWarps][EPX_MAX_TOP_K];
  __shared__ float list_w[kWarps][EPX_MAX_TOP_K];
  const int warp = threadIdx.x / 32;
  for (int i = blockIdx.x * kWarps + warp; i < num_recv; i += warps) {
    if (lane < K) {
      const int row = token_rows[(size_t)i * K + lane];
      list_row[warp][lane] = row;
      list_w[warp][lane] = a.weighted && row >= 0 ? weights[row] : 1.f;
    }
    __syncwarp();
    for (int c = lane; c < n16; c += 32) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
      for (int k = 0; k < K; k++) { /* list entries ascending: rows ascending */
        const int r = list_row[warp][k];
        if (r < 0) continue;
        const float w = list_w[warp][k];
        float f[8];
        epx::bf16x8_to_float(y[(size_t)r * n16 + c], f);
#pragma unroll
        for (int q = 0; q < 8; q++) acc[q] = __fadd_rn(acc[q], __fmul_rn(w, f[q]));
      }
      partial[(size_t)i * n16 + c] = epx::float8_to_bf16x8(acc);
    }
    __syncwarp(); /* every lane is done with this token's list before the next overwrites it */
  }
  if (threadIdx.x == 0) epx::trace_end(ctx, t_start, EPX_TRACE_COMBINE_REDUCE, num_recv);
}

}  // namespace epx::normal

extern "C" epx_status_t epx__expand_reduce_launch(const epx__kernel_ctx_t *ctx,
                                                  const epx__expand_reduce_launch_args_t *args,
                                                  cudaStream_t stream) {
  return epx::launch<epx::normal::expand_reduce>(args->num_blocks, kThreads, 0, stream, *ctx,
                                                 *args);
}

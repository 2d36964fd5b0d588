/*
 * layout.cu - dispatch layout of one rank's tokens: per-rank and per-expert token counts,
 * is_token_in_rank [T, R], and each token's position in each destination rank's stream.
 *
 * One block of 1024 threads (32 warps) walks the tokens in tiles of 1024, one token per thread.
 * Positions are an exclusive scan per destination rank: a warp ballot gives the rank within the
 * warp, R threads scan the per-warp totals into each warp's offset, and rank_base carries the
 * running total from tile to tile. Expert counts are shared-memory atomics (E <= 1024).
 * Invalid expert ids (outside [-1, E)) are skipped as empty slots; the lowest flat position
 * t*K+k of one is kept and raised as EPX_ERR_INVALID_ARGUMENT at the end. Nothing is written
 * outside the caller's arrays.
 */
#include "checks.h"
#include "kernels/api.h"
#include "kernels/timeout.cuh"
#include "kernels/trace.cuh"

namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;

template <typename IdxT>
__global__ void __launch_bounds__(kThreads, 1)
    layout_kernel(epx__kernel_ctx_t ctx, epx__layout_launch_args_t a) {
  __shared__ int expert_count[EPX_MAX_EXPERTS];
  __shared__ int warp_count[kWarps][EPX_MAX_RANKS];
  __shared__ int warp_offset[kWarps][EPX_MAX_RANKS]; /* first position of each warp's tokens */
  __shared__ int rank_base[EPX_MAX_RANKS];
  __shared__ unsigned long long first_bad;

  const uint64_t t_start = epx::trace_begin(ctx);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int T = a.num_tokens, K = a.top_k, E = a.num_experts, R = a.num_ranks;
  const int experts_per_rank = E / R;
  const IdxT *topk = (const IdxT *)a.topk_idx;

  for (int e = tid; e < E; e += kThreads) expert_count[e] = 0;
  if (tid < EPX_MAX_RANKS) rank_base[tid] = 0;
  if (tid == 0) first_bad = ~0ull;
  __syncthreads();

  for (int tile = 0; tile < T; tile += kThreads) {
    const int t = tile + tid;
    /* The token's ids in registers: every loop over k or r below is unrolled to the compile-time
     * maximum, so nothing is indexed at run time (a run-time index put these arrays in local
     * memory and made this kernel 40 us of a 4096-token dispatch). All loads are issued before any
     * check: an atomic between two loads keeps the compiler from overlapping them, and each would
     * cost a full memory latency. */
    long long raw[EPX_MAX_TOP_K];
#pragma unroll
    for (int k = 0; k < EPX_MAX_TOP_K; k++)
      raw[k] = (t < T && k < K) ? (long long)topk[(size_t)t * K + k] : -1;
    int ids[EPX_MAX_TOP_K];
#pragma unroll
    for (int k = 0; k < EPX_MAX_TOP_K; k++) {
      const long long e = raw[k];
      ids[k] = -1;
      if (e < -1 || e >= E)
        atomicMin(&first_bad, (unsigned long long)t * K + k);
      else
        ids[k] = (int)e;
    }
    unsigned rank_mask = 0;
#pragma unroll
    for (int k = 0; k < EPX_MAX_TOP_K; k++) {
      if (ids[k] < 0) continue;
      rank_mask |= 1u << (ids[k] / experts_per_rank);
      bool repeated = false; /* count a token once per expert, even if listed twice */
#pragma unroll
      for (int j = 0; j < k; j++) repeated |= ids[j] == ids[k];
      if (!repeated) atomicAdd(&expert_count[ids[k]], 1);
    }
    int prefix[EPX_MAX_RANKS];
#pragma unroll
    for (int r = 0; r < EPX_MAX_RANKS; r++) {
      const unsigned ballot = __ballot_sync(0xffffffffu, (rank_mask >> r) & 1u);
      prefix[r] = __popc(ballot & ((1u << lane) - 1u));
      if (lane == 0 && r < R) warp_count[warp][r] = __popc(ballot);
    }
    __syncthreads();
    /* Thread r scans the warps' counts of rank r; warp_offset is read only after the next
     * barrier, and rewritten only after the next tile's first one. */
    if (tid < R) {
      int running = rank_base[tid];
      for (int w = 0; w < kWarps; w++) {
        warp_offset[w][tid] = running;
        running += warp_count[w][tid];
      }
      rank_base[tid] = running;
    }
    __syncthreads();
    if (t < T) {
#pragma unroll
      for (int r = 0; r < EPX_MAX_RANKS; r++) {
        if (r >= R) break;
        const bool in_rank = (rank_mask >> r) & 1u;
        if (a.is_token_in_rank) a.is_token_in_rank[(size_t)t * R + r] = in_rank ? 1 : 0;
        if (a.token_pos_in_rank)
          a.token_pos_in_rank[(size_t)t * R + r] = in_rank ? warp_offset[warp][r] + prefix[r] : -1;
      }
    }
  }
  __syncthreads();

  if (a.num_tokens_per_rank && tid < R) a.num_tokens_per_rank[tid] = rank_base[tid];
  if (a.num_tokens_per_expert)
    for (int e = tid; e < E; e += kThreads) a.num_tokens_per_expert[e] = expert_count[e];
  if (tid == 0 && first_bad != ~0ull) {
    const long long pos = (long long)first_bad;
    epx::raise_error(ctx, EPX_ERR_INVALID_ARGUMENT, EPX_STAGE_LAYOUT, -1, pos,
                     (long long)topk[pos]);
  }
  if (tid == 0) epx::trace_end(ctx, t_start, EPX_TRACE_LAYOUT, T);
}

}  // namespace

extern "C" epx_status_t epx__layout_launch(const epx__kernel_ctx_t *ctx,
                                           const epx__layout_launch_args_t *args,
                                           cudaStream_t stream) {
  if (args->idx_is_int64)
    layout_kernel<long long><<<1, kThreads, 0, stream>>>(*ctx, *args);
  else
    layout_kernel<int><<<1, kThreads, 0, stream>>>(*ctx, *args);
  CUDA_CHECK(cudaGetLastError());
  return EPX_OK;
}

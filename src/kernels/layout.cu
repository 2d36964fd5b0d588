/*
 * layout.cu - dispatch layout of one rank's tokens: per-rank and per-expert token counts,
 * is_token_in_rank [T, R], and each token's position in each destination rank's stream.
 *
 * One block of 1024 threads (32 warps) walks the tokens in tiles of 1024, one token per thread.
 * Positions are an exclusive scan per destination rank: a warp ballot gives the rank within the
 * warp, per-warp totals in shared memory give the warp's offset, and rank_base carries the
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
    unsigned rank_mask = 0;
    if (t < T) {
      long long ids[EPX_MAX_TOP_K];
      for (int k = 0; k < K; k++) ids[k] = (long long)topk[(size_t)t * K + k];
      for (int k = 0; k < K; k++) {
        const long long e = ids[k];
        if (e == -1) continue;
        if (e < -1 || e >= E) {
          atomicMin(&first_bad, (unsigned long long)t * K + k);
          continue;
        }
        rank_mask |= 1u << (int)(e / experts_per_rank);
        bool repeated = false; /* count a token once per expert, even if listed twice */
        for (int j = 0; j < k; j++) repeated |= ids[j] == e;
        if (!repeated) atomicAdd(&expert_count[e], 1);
      }
    }
    int prefix[EPX_MAX_RANKS];
    for (int r = 0; r < R; r++) {
      const unsigned ballot = __ballot_sync(0xffffffffu, (rank_mask >> r) & 1u);
      prefix[r] = __popc(ballot & ((1u << lane) - 1u));
      if (lane == 0) warp_count[warp][r] = __popc(ballot);
    }
    __syncthreads();
    if (t < T) {
      for (int r = 0; r < R; r++) {
        const bool in_rank = (rank_mask >> r) & 1u;
        int offset = rank_base[r] + prefix[r];
        for (int w = 0; w < warp; w++) offset += warp_count[w][r];
        if (a.is_token_in_rank) a.is_token_in_rank[(size_t)t * R + r] = in_rank ? 1 : 0;
        if (a.token_pos_in_rank) a.token_pos_in_rank[(size_t)t * R + r] = in_rank ? offset : -1;
      }
    }
    __syncthreads();
    if (tid < R) {
      int total = 0;
      for (int w = 0; w < kWarps; w++) total += warp_count[w][tid];
      rank_base[tid] += total;
    }
    __syncthreads();
  }

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

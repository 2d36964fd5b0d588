/*
 * layout.cu - dispatch layout of one rank's tokens: per-rank and per-expert token counts,
 * is_token_in_rank [T, R], and each token's position in each destination rank's stream.
 *
 * ceil(T / 512) blocks of 512 threads; block b owns the tile of tokens [512 b, 512 b + 512), one
 * token per thread. The work per token (its ids, the expert count once per distinct expert, its
 * rank mask) is a few hundred instructions, so one block walking every tile was compute bound
 * (~7 us per 1024 tokens, 30 us of a 4096-token dispatch); blocks share nothing and never wait
 * for each other:
 *   1. Prefix: block b counts, per destination rank, the tokens before its tile (rank masks only,
 *      no deduplication: tens of instructions per token). The last block thus sees every token
 *      and alone reports the lowest invalid id and writes num_tokens_per_rank.
 *   2. Own tile: a warp ballot gives a token's rank within its warp, the per-warp totals give the
 *      warp's offset, the prefix gives the tile's; expert counts go to shared memory, then one
 *      global atomicAdd per expert touched (the host zeroes num_tokens_per_expert first).
 * Invalid expert ids (outside [-1, E)) are skipped as empty slots; the lowest flat position t*K+k
 * of one is raised as EPX_ERR_INVALID_ARGUMENT. Nothing is written outside the caller's arrays.
 * Every loop over k or r is unrolled to the compile-time maximum, so the per-token arrays stay
 * in registers (indexed at run time they went to local memory).
 * Rank-mask routing (kFromMask, epx_dispatch with is_token_in_rank): the same kernel with each
 * token's rank mask read from the caller's [T, R] mask instead of derived from its ids; no ids,
 * no invalid ids, and the caller's per-expert counts are copied (block 0) instead of counted.
 */
#include "kernels/launch.cuh"
#include "kernels/api.h"
#include "kernels/trace.cuh"
#include "kernels/wait.cuh"

namespace {

constexpr int kThreads = 512; /* = tokens per tile */
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;
static_assert(kThreads % 32 == 0 && kThreads >= EPX_MAX_RANKS,
              "whole warps; thread r < R sums rank r's column of warp_count");
static_assert(EPX_MAX_RANKS <= 32, "a token's ranks are one 32-bit mask");

/* Token t's K ids (invalid ones as -1), all loads issued before any check, and the lowest flat
 * position of an invalid one folded into *first_bad. */
template <typename IdxT>
__device__ __forceinline__ void load_ids(const IdxT *topk, int t, int K, int E, int *ids,
                                         unsigned long long *first_bad) {
  long long raw[EPX_MAX_TOP_K];
#pragma unroll
  for (int k = 0; k < EPX_MAX_TOP_K; k++) raw[k] = k < K ? (long long)topk[(size_t)t * K + k] : -1;
#pragma unroll
  for (int k = 0; k < EPX_MAX_TOP_K; k++) {
    ids[k] = -1;
    if (raw[k] < -1 || raw[k] >= E) {
      const unsigned long long pos = (unsigned long long)t * K + k;
      if (pos < *first_bad) *first_bad = pos;
    } else {
      ids[k] = (int)raw[k];
    }
  }
}

/* Bit r set when one of the ids is an expert of rank r. */
__device__ __forceinline__ unsigned rank_mask_of(const int *ids, int experts_per_rank) {
  unsigned mask = 0;
#pragma unroll
  for (int k = 0; k < EPX_MAX_TOP_K; k++)
    if (ids[k] >= 0) mask |= 1u << (ids[k] / experts_per_rank);
  return mask;
}

/* Rank-mask routing: bit r set when the caller's mask says token t goes to rank r. */
__device__ __forceinline__ unsigned rank_mask_from(const uint8_t *in_rank, int t, int R) {
  unsigned mask = 0;
#pragma unroll
  for (int r = 0; r < EPX_MAX_RANKS; r++)
    if (r < R && in_rank[(size_t)t * R + r]) mask |= 1u << r;
  return mask;
}

template <typename IdxT, bool kFromMask>
__global__ void __launch_bounds__(kThreads, 1)
    layout_kernel(epx__kernel_ctx_t ctx, epx__layout_launch_args_t a) {
  __shared__ int expert_count[EPX_MAX_EXPERTS];
  __shared__ int warp_count[kWarps][EPX_MAX_RANKS];
  __shared__ int tile_base[EPX_MAX_RANKS];
  __shared__ unsigned long long first_bad;

  const uint64_t t_start = epx::trace_begin(ctx);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int T = a.num_tokens, K = a.top_k, E = a.num_experts, R = a.num_ranks;
  const int experts_per_rank = E / R;
  const IdxT *topk = (const IdxT *)a.topk_idx;
  const int tile = blockIdx.x * kThreads;
  const bool last = blockIdx.x == gridDim.x - 1;

  for (int e = tid; e < E; e += kThreads) expert_count[e] = 0;
  if (tid == 0) first_bad = ~0ull;

  /* 1. Tokens of each rank before this tile. */
  unsigned long long my_bad = ~0ull;
  int before[EPX_MAX_RANKS];
#pragma unroll
  for (int r = 0; r < EPX_MAX_RANKS; r++) before[r] = 0;
    /* Only a mask per token: no per-token arrays, so unrolling keeps several tokens' loads in
     * flight (this loop is the last block's critical path: tile / kThreads tokens per thread). */
#pragma unroll 2
  for (int t = tid; t < tile; t += kThreads) {
    unsigned mask = 0;
    if constexpr (kFromMask) mask = rank_mask_from(a.in_rank_mask, t, R);
#pragma unroll 8
    for (int k = 0; k < (kFromMask ? 0 : K); k++) {
      const long long e = (long long)topk[(size_t)t * K + k];
      if (e >= 0 && e < E) {
        mask |= 1u << ((int)e / experts_per_rank);
      } else if (e != -1) {
        const unsigned long long pos = (unsigned long long)t * K + k;
        if (pos < my_bad) my_bad = pos;
      }
    }
#pragma unroll
    for (int r = 0; r < EPX_MAX_RANKS; r++) before[r] += (mask >> r) & 1u;
  }
#pragma unroll
  for (int r = 0; r < EPX_MAX_RANKS; r++) {
    const int sum = __reduce_add_sync(kFull, before[r]);
    if (lane == 0) warp_count[warp][r] = sum;
  }
  __syncthreads();
  if (tid < R) {
    int sum = 0;
    for (int w = 0; w < kWarps; w++) sum += warp_count[w][tid];
    tile_base[tid] = sum;
  }
  __syncthreads(); /* warp_count is rewritten below */

  /* 2. This tile. */
  const int t = tile + tid;
  int ids[EPX_MAX_TOP_K];
#pragma unroll
  for (int k = 0; k < EPX_MAX_TOP_K; k++) ids[k] = -1;
  if (t < T && !kFromMask) load_ids(topk, t, K, E, ids, &my_bad);
  const unsigned rank_mask = kFromMask ? (t < T ? rank_mask_from(a.in_rank_mask, t, R) : 0u)
                                       : rank_mask_of(ids, experts_per_rank);
#pragma unroll
  for (int k = 0; k < EPX_MAX_TOP_K; k++) {
    if (ids[k] < 0) continue;
    bool repeated = false; /* count a token once per expert, even if listed twice */
#pragma unroll
    for (int j = 0; j < k; j++) repeated |= ids[j] == ids[k];
    if (!repeated) atomicAdd(&expert_count[ids[k]], 1);
  }
  if (my_bad != ~0ull) atomicMin(&first_bad, my_bad);
  int prefix[EPX_MAX_RANKS];
#pragma unroll
  for (int r = 0; r < EPX_MAX_RANKS; r++) {
    const unsigned ballot = __ballot_sync(kFull, (rank_mask >> r) & 1u);
    prefix[r] = __popc(ballot & ((1u << lane) - 1u));
    if (lane == 0) warp_count[warp][r] = __popc(ballot);
  }
  __syncthreads();
  if (t < T) {
#pragma unroll
    for (int r = 0; r < EPX_MAX_RANKS; r++) {
      if (r >= R) break;
      const bool in_rank = (rank_mask >> r) & 1u;
      int offset = tile_base[r] + prefix[r];
      for (int w = 0; w < warp; w++) offset += warp_count[w][r];
      if (a.is_token_in_rank) a.is_token_in_rank[(size_t)t * R + r] = in_rank ? 1 : 0;
      if (a.token_pos_in_rank) a.token_pos_in_rank[(size_t)t * R + r] = in_rank ? offset : -1;
    }
  }

  if (kFromMask) { /* the caller's expert counts; block 0 copies them */
    if (blockIdx.x == 0 && a.num_tokens_per_expert)
      for (int e = tid; e < E; e += kThreads)
        a.num_tokens_per_expert[e] = a.in_tokens_per_expert[e];
  } else if (a.num_tokens_per_expert) {
    for (int e = tid; e < E; e += kThreads)
      if (expert_count[e]) atomicAdd(&a.num_tokens_per_expert[e], expert_count[e]);
  }
  if (!last) return;
  /* The last block has seen every token: totals per rank and the lowest invalid id. */
  if (a.num_tokens_per_rank && tid < R) {
    int total = tile_base[tid];
    for (int w = 0; w < kWarps; w++) total += warp_count[w][tid];
    a.num_tokens_per_rank[tid] = total;
  }
  if (tid == 0 && first_bad != ~0ull) {
    const long long pos = (long long)first_bad;
    epx::raise_error(ctx, EPX_ERR_INVALID_ARGUMENT, EPX_STAGE_LAYOUT, -1, pos,
                     (long long)topk[pos]);
  }
  /* One span per call: the last block's, which does the most work. */
  if (tid == 0) epx::trace_end(ctx, t_start, EPX_TRACE_LAYOUT, T);
}

}  // namespace

extern "C" epx_status_t epx__layout_launch(const epx__kernel_ctx_t *ctx,
                                           const epx__layout_launch_args_t *args,
                                           cudaStream_t stream) {
  const int blocks = args->num_tokens > 0 ? (args->num_tokens + kThreads - 1) / kThreads : 1;
  if (args->from_mask) /* no ids: the expert counts are copied, not summed */
    return epx::launch<layout_kernel<int, true>>(blocks, kThreads, 0, stream, *ctx, *args);
  if (args->num_tokens_per_expert)
    CUDA_CHECK(cudaMemsetAsync(args->num_tokens_per_expert, 0,
                               sizeof(int) * (size_t)args->num_experts, stream));
  return EPX_INDEX_SWITCH(args->idx_is_int64, IdxT, [&] {
    return epx::launch<layout_kernel<IdxT, false>>(blocks, kThreads, 0, stream, *ctx, *args);
  });
}

/*
 * normal_dispatch.cu - normal (high-throughput) mode's dispatch over NVLink.
 *
 * Each token is written straight into its final row of every destination's compact receive
 * slab, so there are no queues and no second copy on the receiver:
 *   row of (source s, token t) on rank r = sum_{s' < s} count[s'][r] + token_pos_in_rank[t][r]
 * with the count matrix from notify (notify.cu).
 *
 * Roles: num_blocks blocks of kThreads; block b sends a contiguous share of the tokens, one warp
 * per token (w-strided over its warps); block 0's first warp then waits for every source.
 * Completion signals and the wait: dispatch_common.cuh (shared with expand_dispatch.cu). All
 * ranks launch the same grid (config.num_sms, agreed at group creation).
 * Specialised at compile time on the payload's scale format (none, contiguous, strided), the
 * routing index dtype and the received index dtype (int32 or int64 recv_topk_idx).
 */
#include "checks.h"
#include "kernels/api.h"
#include "kernels/dispatch_common.cuh"
#include "kernels/launch.cuh"
#include "kernels/trace.cuh"
#include "kernels/wait.cuh"
#include "kernels/workspace.cuh"

namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 4; /* 16-byte loads in flight per lane */
static_assert(kThreads % 32 == 0 && kThreads >= EPX_MAX_RANKS, "thread r < R signals rank r");
static_assert(EPX_MAX_RANKS <= 32, "lane r of a token's warp stands for rank r");

/* Copy one row of n16 16-byte words from src to every destination in mask (one warp). */
__device__ __forceinline__ void copy_row_multicast(const int4 *src, int4 *const *dst, unsigned mask,
                                                   int n16, int lane) {
  for (int i0 = lane; i0 < n16; i0 += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; u++)
      if (i0 + u * 32 < n16) v[u] = epx::ld_nc_na_v4(src + i0 + u * 32);
    for (unsigned m = mask; m; m &= m - 1) {
      int4 *d = dst[__ffs(m) - 1];
#pragma unroll
      for (int u = 0; u < kUnroll; u++)
        if (i0 + u * 32 < n16) d[i0 + u * 32] = v[u];
    }
  }
}

/* Scale words of a payload row: none (BF16), contiguous rows, or caller-given strides. */
enum ScaleMode { kNoScales = 0, kContiguousScales = 1, kStridedScales = 2 };

/* Copy token t's scale words (float32 or packed UE8M0, moved as 4-byte words) to its row on
 * every destination in mask (one warp). */
template <int kScales>
__device__ __forceinline__ void copy_scales(const epx__kernel_ctx_t &ctx,
                                            const epx__dispatch_launch_args_t &a, int t,
                                            const int *rows, unsigned mask, int lane) {
  const int num_scales = a.scale_cols;
  const uint32_t *src = (const uint32_t *)a.x_scales;
  for (int i = lane; i < num_scales; i += 32) {
    const uint32_t sc = kScales == kStridedScales
                            ? src[t * a.scale_stride_token + i * a.scale_stride_group]
                            : src[(size_t)t * num_scales + i];
    for (unsigned m = mask; m; m &= m - 1) {
      const int r = __ffs(m) - 1;
      uint32_t *d =
          (uint32_t *)(ctx.peer_base[r] + ctx.layout.normal_offset + ctx.layout.recv_scales_offset);
      d[(size_t)rows[r] * num_scales + i] = sc;
    }
  }
}

}  // namespace

/* The kernel has external linkage so that profilers show it as epx::normal::dispatch
 * (docs/profiling.md, "Kernel names"). */
namespace epx::normal {

template <typename IdxT, typename OutIdxT, int kScales>
__global__ void __launch_bounds__(kThreads, 1)
    dispatch(epx__kernel_ctx_t ctx, epx__dispatch_launch_args_t a) {
  constexpr bool kFp8 = kScales != kNoScales;
  const uint64_t t_send = epx::trace_begin(ctx);
  const int R = ctx.num_ranks, me = ctx.rank, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int H = a.hidden, K = a.top_k, E = a.num_experts, epr = E / R;
  const epx__recv_meta_t *meta = a.routing.meta;
  __shared__ int dest_base[EPX_MAX_RANKS];
  if (tid < R) {
    int base = 0; /* rows of sources before me at rank tid */
    for (int s = 0; s < me; s++) base += meta->count[s][tid];
    dest_base[tid] = base;
  }
  __syncthreads();

  /* Buffer regions (every rank has the same layout):
   *   recv_x        [cap, H] elem       recv_scales [cap, scale_cols] f32 / packed i32
   *   recv_topk_idx [cap, K] OutIdxT    recv_topk_weights [cap, K] f32   recv_src_token [cap] i32
   */
  const epx__ws_layout_t &L = ctx.layout;
  const int elem = kFp8 ? 1 : 2, n16 = H * elem / 16;
  const IdxT *topk = (const IdxT *)a.topk_idx;
  /* A failed count exchange (meta->aborted): send nothing, only the done signals that keep
   * the per-peer counters in step, and wait for nothing (one timeout budget per call, not two). */
  const bool aborted = meta->aborted != 0;
  int begin, end;
  epx::dispatch::block_share(aborted ? 0 : a.routing.num_tokens, &begin, &end);
  for (int t = begin + warp; t < end; t += kWarps) {
    const uint64_t t_token = epx::trace_begin(ctx);
    const bool in_rank = lane < R && a.routing.is_token_in_rank[(size_t)t * R + lane];
    const unsigned mask = __ballot_sync(0xffffffffu, in_rank);
    const int my_row =
        in_rank ? dest_base[lane] + a.routing.token_pos_in_rank[(size_t)t * R + lane] : 0;
    int rows[EPX_MAX_RANKS];
    int4 *dst[EPX_MAX_RANKS];
#pragma unroll
    for (int r = 0; r < EPX_MAX_RANKS; r++) {
      rows[r] = __shfl_sync(0xffffffffu, my_row, r);
      dst[r] = (r < R) ? (int4 *)(ctx.peer_base[r] + L.normal_offset + L.recv_x_offset +
                                  (size_t)rows[r] * H * elem)
                       : nullptr;
    }
    copy_row_multicast((const int4 *)((const char *)a.x + (size_t)t * H * elem), dst, mask, n16,
                       lane);
    if (kFp8) copy_scales<kScales>(ctx, a, t, rows, mask, lane);
    if (a.write_meta) { /* routing metadata; a cached dispatch keeps the earlier values */
      long long e = -1;
      float w = 0.f;
      if (lane < K && topk) { /* rank-mask routing has no ids: -1 / 0 */
        e = (long long)topk[(size_t)t * K + lane];
        if (e < 0 || e >= E) e = -1; /* invalid ids were reported by the layout kernel */
        if (a.topk_weights) w = a.topk_weights[(size_t)t * K + lane];
      }
      for (unsigned m = mask; m; m &= m - 1) {
        const int r = __ffs(m) - 1;
        char *base = ctx.peer_base[r] + L.normal_offset;
        if (lane < K) {
          const bool here = e >= 0 && e / epr == r;
          ((OutIdxT *)(base + L.recv_topk_idx_offset))[(size_t)rows[r] * K + lane] =
              here ? (OutIdxT)(e - (long long)r * epr) : (OutIdxT)-1;
          ((float *)(base + L.recv_topk_weights_offset))[(size_t)rows[r] * K + lane] =
              here ? w : 0.f;
        }
        if (lane == 0) ((int *)(base + L.recv_src_token_offset))[rows[r]] = t;
      }
    }
    if (lane == 0) epx::trace_end(ctx, t_token, EPX_TRACE_DISPATCH_TOKEN, t);
  }

  epx::dispatch::signal_done(ctx);
  if (tid == 0) epx::trace_end(ctx, t_send, EPX_TRACE_DISPATCH_SEND, end - begin);
  epx::dispatch::wait_sources(ctx, meta, aborted);
}

}  // namespace epx::normal

/* One kernel per payload format (BF16; FP8 with contiguous or strided scales), routing index
 * dtype and received index dtype. */
template <int kScales>
epx_status_t launch_scales(const epx__kernel_ctx_t *ctx, const epx__dispatch_launch_args_t *args,
                           cudaStream_t stream) {
  const dim3 grid(args->num_blocks), block(kThreads);
  return EPX_INDEX_SWITCH(args->idx_is_int64, IdxT, [&] {
    return EPX_INDEX_SWITCH(args->recv_idx_int64, OutIdxT, [&] {
      return epx::launch<epx::normal::dispatch<IdxT, OutIdxT, kScales>>(grid, block, 0, stream,
                                                                        *ctx, *args);
    });
  });
}

extern "C" epx_status_t epx__dispatch_launch(const epx__kernel_ctx_t *ctx,
                                             const epx__dispatch_launch_args_t *args,
                                             cudaStream_t stream) {
  if (!args->x_is_fp8) return launch_scales<kNoScales>(ctx, args, stream);
  return EPX_BOOL_SWITCH(args->scales_strided, kStrided, [&] {
    return launch_scales < kStrided ? kStridedScales : kContiguousScales > (ctx, args, stream);
  });
}

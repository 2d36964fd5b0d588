/*
 * notify.cu - normal mode's count exchange: one round trip after which every rank knows the full
 * count matrix count[s][r], its receive prefix per source and its per-expert receive counts.
 *
 * One block of kThreads. Word w of source s in rank r's notify region:
 *   w < R:  count[s][w] (tokens s sends to rank w)      w >= R: tokens of s for r's expert w-R
 * Each thread writes a strided share of the words to the peers, then waits for a strided share
 * of its own inbox; thread 0 writes the prefix. Invariant: every word is (epoch << 32) | value,
 * so a word is valid exactly when it carries this call's epoch: nothing is ever zeroed, there is
 * no separate flag and no ordering between words to get right. Thread i < R x R also writes
 * entry i of the inclusive rank prefix matrix (DeepEP's rank_prefix_matrix).
 *
 * Expert-major variant (kExpand, epx_dispatch_expand): every source sends all E per-expert
 * counts to every rank (words w >= R: tokens of s for global expert w - R; R x (R + E) words, the
 * region's size), so that each rank can place its own rows in every receiver's segments:
 *   begin_d[j]  = sum over j' < j of align(sum over s of count[s][d * L + j'])
 *   base[e]     = begin_{e / L}[e % L] + sum over s < me of count[s][e]
 * (one exclusive scan over the E aligned totals: begin_d[j] = scan[e] - scan[d * L]). The
 * counts go to dynamic shared memory, then into the meta's expand_* fields.
 *
 * worst_tail_kernel (num_worst_tokens only): the -1 / 0 tail of the receive metadata.
 */
#include <type_traits>

#include "checks.h"
#include "kernels/api.h"
#include "kernels/expand_arrival.cuh"
#include "kernels/launch.cuh"
#include "kernels/trace.cuh"
#include "kernels/wait.cuh"
#include "kernels/workspace.cuh"

namespace {

constexpr int kThreads = 512;
constexpr int kTailThreads = 256;
/* Thread i < R x R copies count[i / R][i % R] into the handle's meta. */
static_assert(kThreads >= EPX_MAX_RANKS * EPX_MAX_RANKS, "one thread per count matrix entry");

/* Exclusive prefix sum of a[0, n) in place, n <= EPX_MAX_EXPERTS; every thread of the block
 * calls it (it synchronizes the block, before and after). */
__device__ void block_exclusive_scan(int *a, int n) {
  __shared__ int warp_sum[kThreads / 32];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int per = (n + kThreads - 1) / kThreads, b = min(tid * per, n), e = min(b + per, n);
  __syncthreads();
  int sum = 0;
  for (int i = b; i < e; i++) sum += a[i];
  int incl = sum;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int u = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += u;
  }
  if (lane == 31) warp_sum[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const int v = lane < kThreads / 32 ? warp_sum[lane] : 0;
    int w_incl = v;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int u = __shfl_up_sync(0xffffffffu, w_incl, d);
      if (lane >= d) w_incl += u;
    }
    if (lane < kThreads / 32) warp_sum[lane] = w_incl - v;
  }
  __syncthreads();
  int run = warp_sum[warp] + incl - sum;
  for (int i = b; i < e; i++) {
    const int v = a[i];
    a[i] = run;
    run += v;
  }
  __syncthreads();
}

/* Experts one thread handles in the expert-major placement (e = tid + i * kThreads). */
constexpr int kExpertsPerThread = (EPX_MAX_EXPERTS + kThreads - 1) / kThreads;

/* kExpand: the meta's expand_* fields (and the host counts) from every source's E counts in
 * vals [R][words] (words = R + E). */
__device__ void place_expand(const epx__kernel_ctx_t &ctx, const epx__notify_launch_args_t &a,
                             const int *vals, int *scan, int words, bool timed_out) {
  const int R = ctx.num_ranks, me = ctx.rank, tid = threadIdx.x, E = a.num_experts;
  const int epr = E / R, align = a.expert_alignment > 1 ? a.expert_alignment : 1;
  epx__recv_meta_t *meta = a.routing.meta;
  int total[kExpertsPerThread], below[kExpertsPerThread];
#pragma unroll
  for (int i = 0; i < kExpertsPerThread; i++) {
    const int e = tid + i * kThreads;
    total[i] = below[i] = 0;
    if (e >= E) continue;
    for (int s = 0; s < R && !timed_out; s++) {
      const int v = vals[s * words + R + e];
      total[i] += v;
      if (s < me) below[i] += v;
    }
    scan[e] = (total[i] + align - 1) / align * align;
  }
  block_exclusive_scan(scan, E);
#pragma unroll
  for (int i = 0; i < kExpertsPerThread; i++) {
    const int e = tid + i * kThreads;
    if (e >= E) continue;
    const int d = e / epr, j = e - d * epr, begin = scan[e] - scan[d * epr];
    meta->expand_base[e] = begin + below[i];
    if (d != me) continue;
    meta->expand_begin[j] = begin;
    meta->expand_count[j] = total[i];
    epx::expand::reset_arrival(ctx, epr, j, begin, total[i], timed_out);
    if (a.host_counts) {
      a.host_counts[1 + j] = total[i];
      /* the rows of each source for j (the prefill layer's phases by source), after the rows */
      for (int s = 0; s < R; s++)
        a.host_counts[EPX__HOST_COUNTS_BY_SOURCE(E, R) + j * R + s] =
            timed_out ? 0 : vals[s * words + R + e];
    }
    if (j == epr - 1) { /* the segment end: the rows of this rank */
      const int rows = begin + (total[i] + align - 1) / align * align;
      meta->expand_begin[epr] = rows;
      meta->expand_rows = rows;
      if (a.host_counts) a.host_counts[1 + epr] = rows;
    }
  }
}

template <bool kExpand>
__global__ void __launch_bounds__(kThreads, 1)
    notify_kernel(epx__kernel_ctx_t ctx, epx__notify_launch_args_t a) {
  const uint64_t t_start = epx::trace_begin(ctx);
  const int R = ctx.num_ranks, me = ctx.rank, tid = threadIdx.x;
  /* Words per source: R rank counts, then this rank's E/R expert counts (kExpand: all E). */
  const int epr = a.num_experts / R, words = R + (kExpand ? a.num_experts : epr);
  extern __shared__ int expand_vals[]; /* kExpand: [R][words] counts, then [E] scan */
  __shared__ unsigned epoch;
  __shared__ int count[EPX_MAX_RANKS][EPX_MAX_RANKS];
  __shared__ int expert_sum[EPX_MAX_EXPERTS]; /* E / R experts */
  __shared__ int timed_out;
  epx__control_t *ctrl = epx::control_of(ctx, me);
  if (tid == 0) {
    epoch = ctrl->notify_epoch + 1 == 0 ? 1 : ctrl->notify_epoch + 1; /* 0: "never" (wrap) */
    ctrl->notify_epoch = epoch;
    timed_out = a.refused;
  }
  for (int j = tid; j < epr; j += kThreads) expert_sum[j] = 0;
  /* Refused: the abort word at every peer before any count word (the barrier and the release
   * of each count word order it), so a peer that reads this call's counts sees it gave up. */
  if (a.refused && tid < R && tid != me) {
    *(volatile unsigned int *)&epx::control_of(ctx, tid)->notify_abort[me] = epoch;
    __threadfence_system();
  }
  __syncthreads();

  for (int i = tid; i < R * words; i += kThreads) {
    const int r = i / words, w = i % words;
    const int v = a.refused ? 0
                  : w < R   ? a.routing.num_tokens_per_rank[w]
                            : a.routing.num_tokens_per_expert[kExpand ? w - R : r * epr + (w - R)];
    unsigned long long *dst =
        (unsigned long long *)(ctx.peer_base[r] + ctx.layout.notify_offset) + me * words + w;
    epx::st_release_sys((uint64_t *)dst, ((uint64_t)epoch << 32) | (uint32_t)v);
  }

  const uint64_t *inbox = (const uint64_t *)(ctx.peer_base[me] + ctx.layout.notify_offset);
  const uint64_t t_wait = epx::trace_begin(ctx);
  for (int i = tid; !a.refused && i < R * words; i += kThreads) { /* refused: wait for nothing */
    const int s = i / words, w = i % words;
    uint64_t v;
    const epx::WaitResult waited = epx::wait_until(
        ctx.timeout_ns,
        [&] {
          v = epx::ld_acquire_sys(inbox + i);
          /* stop at this call's word or a newer one (wrap-safe); a newer one fails the call */
          return (int32_t)((uint32_t)(v >> 32) - epoch) >= 0;
        },
        /* Another word's wait failed the call: this word is not needed. Without it a thread
         * whose words come from k dead peers waited k budgets, one after another. */
        [&] { return *(volatile int *)&timed_out != 0; });
    /* A newer call's word: s gave up on this call (its dispatch timed out on this rank, or a
     * call was refused on some ranks only) and went on. Its count is not this call's: fail
     * the call here as a peer's timeout does, never place rows with it. */
    if (waited == epx::WaitResult::kAbandoned) {
      v = 0; /* the call failed already, and the record names why */
    } else if (waited != epx::WaitResult::kReady || (uint32_t)(v >> 32) != epoch) {
      epx::raise_error(ctx, EPX_ERR_TIMEOUT, EPX_STAGE_NOTIFY, s, -1, epoch);
      timed_out = 1;
      v = 0;
    }
    /* Clamp: a count beyond max_tokens can only come from a broken peer; never index past. */
    int value = (int)(uint32_t)v;
    value = value < 0 ? 0 : value > a.max_tokens ? a.max_tokens : value;
    if (kExpand) expand_vals[i] = value;
    if (w < R)
      count[s][w] = value;
    else if (!kExpand)
      atomicAdd(&expert_sum[w - R], value);
    else if ((w - R) / epr == me)
      atomicAdd(&expert_sum[w - R - me * epr], value);
  }
  __syncthreads();
  /* A peer that gave up on this epoch (this rank was late) sends no rows in it: fail here too.
   * The dispatch kernel checks again after its wait, for a peer that gave up only now. */
  if (!timed_out && tid < R && tid != me &&
      *(volatile unsigned int *)&ctrl->notify_abort[tid] == epoch) {
    epx::raise_error(ctx, EPX_ERR_TIMEOUT, EPX_STAGE_NOTIFY, tid, -1, epoch);
    timed_out = 1; /* every writer writes 1 */
  }
  __syncthreads();
  if (timed_out && tid < R && tid != me) { /* tell every peer this rank sends nothing */
    *(volatile unsigned int *)&epx::control_of(ctx, tid)->notify_abort[me] = epoch;
    __threadfence_system();
  }
  if (tid == 0) epx::trace_end(ctx, t_wait, EPX_TRACE_NOTIFY_WAIT, (int)epoch);

  epx__recv_meta_t *meta = a.routing.meta;
  if (tid == 0) {
    int prefix = 0;
    for (int s = 0; s < R; s++) {
      meta->rank_prefix[s] = prefix;
      prefix += timed_out ? 0 : count[s][me];
    }
    meta->rank_prefix[R] = prefix;
    meta->num_recv = prefix;
    meta->epoch = epoch;
    meta->aborted = timed_out;
    if (a.host_counts && kExpand) { /* the prefill layer's phases copy rows by these */
      const int E = a.num_experts;
      for (int s = 0; s < R; s++)
        a.host_counts[EPX__HOST_COUNTS_TOKENS(E, R) + s] = timed_out ? 0 : count[s][me];
      a.host_counts[EPX__HOST_COUNTS_COMBINES(E, R)] = (int)ctrl->combine_calls;
    }
    if (a.host_counts) a.host_counts[0] = timed_out ? -1 : prefix; /* -1: the host's "failed" */
    epx::trace_end(ctx, t_start, EPX_TRACE_NOTIFY, prefix);
  }
  if (tid < R * R) {
    const int i = tid / R, j = tid % R;
    int inclusive = 0; /* DeepEP's rank_prefix_matrix: sources 0..i to rank j */
    for (int s = 0; s <= i; s++) inclusive += count[s][j];
    meta->count[i][j] = timed_out ? 0 : count[i][j];
    meta->rank_prefix_matrix[tid] = timed_out ? 0 : inclusive;
  }
  const int align = a.expert_alignment > 1 ? a.expert_alignment : 1;
  for (int j = tid; j < epr; j += kThreads) {
    const int c = (expert_sum[j] + align - 1) / align * align;
    meta->per_expert[j] = c;
    if (a.host_counts && !kExpand) a.host_counts[1 + j] = c;
  }
  if constexpr (kExpand)
    place_expand(ctx, a, expand_vals, expand_vals + R * words, words, timed_out != 0);
}

/* num_worst_tokens: grid-stride over the [num_worst - num_recv, K] tail of this rank's
 * recv_topk_idx / recv_topk_weights. No peer writes those rows in this call (they hold rows
 * below num_recv), and the previous dispatch's writes are complete (its kernel waited for them),
 * so the tail is written without any wait. Ordered after notify on the stream (meta->num_recv). */
template <typename OutIdxT>
__global__ void __launch_bounds__(kTailThreads)
    worst_tail_kernel(epx__kernel_ctx_t ctx, epx__worst_tail_launch_args_t a) {
  const int num_recv = a.meta->num_recv, K = a.top_k;
  if (num_recv > a.num_worst) {
    if (blockIdx.x == 0 && threadIdx.x == 0)
      epx::raise_error(ctx, EPX_ERR_INVALID_ARGUMENT, EPX_STAGE_DISPATCH, -1, a.num_worst,
                       num_recv);
    return;
  }
  /* Regions (every rank's layout): recv_topk_idx [cap, K] OutIdxT, recv_topk_weights [cap, K]
   * float32, from the normal region of this rank. */
  char *base = ctx.peer_base[ctx.rank] + ctx.layout.normal_offset;
  OutIdxT *idx = (OutIdxT *)(base + ctx.layout.recv_topk_idx_offset) + (size_t)num_recv * K;
  float *w = (float *)(base + ctx.layout.recv_topk_weights_offset) + (size_t)num_recv * K;
  const size_t n = (size_t)(a.num_worst - num_recv) * K;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    idx[i] = (OutIdxT)-1;
    w[i] = 0.f;
  }
}

}  // namespace

extern "C" epx_status_t epx__worst_tail_launch(const epx__kernel_ctx_t *ctx,
                                               const epx__worst_tail_launch_args_t *args,
                                               cudaStream_t stream) {
  const size_t n = (size_t)args->num_worst * args->top_k;
  const int blocks = (int)(n / kTailThreads + 1 < 128 ? n / kTailThreads + 1 : 128);
  return EPX_BOOL_SWITCH(args->recv_idx_int64, kInt64, [&] {
    using OutIdxT = typename std::conditional<kInt64, long long, int>::type;
    return epx::launch<worst_tail_kernel<OutIdxT>>(blocks, kTailThreads, 0, stream, *ctx, *args);
  });
}

extern "C" epx_status_t epx__notify_launch(const epx__kernel_ctx_t *ctx,
                                           const epx__notify_launch_args_t *args,
                                           cudaStream_t stream) {
  if (!args->expand) return epx::launch<notify_kernel<false>>(1, kThreads, 0, stream, *ctx, *args);
  const int R = ctx->num_ranks, E = args->num_experts;
  const size_t smem = ((size_t)R * (R + E) + E) * sizeof(int);
  return epx::launch<notify_kernel<true>>(1, kThreads, smem, stream, *ctx, *args);
}

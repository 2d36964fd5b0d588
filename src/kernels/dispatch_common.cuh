/*
 * dispatch_common.cuh - what the normal-mode dispatch kernels share (normal_dispatch.cu, one
 * row per (token, rank); expand_dispatch.cu, one row per (token, local expert)): the block's
 * share of the tokens, the per-block completion signal and the receiver's wait for every
 * source.
 *
 * Invariant (completion): after its last store to rank r, every sending block adds 1 to r's
 * dispatch_done[me] with release semantics at system scope; r waits (acquire, bounded) until the
 * counter has grown by the number of sending blocks. Counters are monotonic, so nothing is ever
 * reset and a captured graph replays correctly. Both kernels have config.num_sms sending blocks
 * (the expand dispatch's DURING fan-out blocks do not signal), so their calls keep the same
 * counters in step.
 */
#ifndef EPX_KERNELS_DISPATCH_COMMON_CUH_
#define EPX_KERNELS_DISPATCH_COMMON_CUH_

#include "kernels/trace.cuh"
#include "kernels/wait.cuh"
#include "kernels/workspace.cuh"

namespace epx::dispatch {

/* Tell every rank that this block's dispatch stores to it are done. NOTE: __syncthreads orders
 * the block's stores before thread r's fence; the system-scope release makes them visible to r
 * before the counter moves. Needs blockDim.x >= R. */
__device__ __forceinline__ void signal_done(const epx__kernel_ctx_t &ctx) {
  __syncthreads();
  if (threadIdx.x < ctx.num_ranks) {
    __threadfence_system();
    epx::red_release_sys_add(&epx::control_of(ctx, threadIdx.x)->dispatch_done[ctx.rank], 1);
  }
}

/* [begin, end) of block b's share of n items over g blocks. */
__device__ __forceinline__ void block_share(int n, int b, int g, int *begin, int *end) {
  *begin = (int)((long long)n * b / g);
  *end = (int)((long long)n * (b + 1) / g);
}

/* [begin, end) of this block's share of n items over the grid. */
__device__ __forceinline__ void block_share(int n, int *begin, int *end) {
  block_share(n, (int)blockIdx.x, (int)gridDim.x, begin, end);
}

/* Block 0's first warp: wait until every source's blocks have signalled (lane s < R for source
 * s; each source signals once per sending block, `senders` of them, config.num_sms on every
 * rank), then consume the signals. A source that gave this call's exchange up after ours
 * completed sent nothing: raised as a timeout. aborted: our own exchange failed, wait for
 * nothing. Returns, in that warp, whether every source delivered (false: a wait ran out, a
 * source gave up, or aborted); true in every other thread. */
__device__ __forceinline__ bool wait_sources(const epx__kernel_ctx_t &ctx,
                                             const epx__recv_meta_t *meta, bool aborted,
                                             int senders, int block) {
  const int R = ctx.num_ranks, me = ctx.rank, tid = threadIdx.x;
  if (block != 0 || tid >= 32) return true;
  const uint64_t t_wait = epx::trace_begin(ctx);
  bool delivered = !aborted;
  if (tid < R) {
    epx__control_t *ctrl = epx::control_of(ctx, me);
    const unsigned long long expected = ctrl->dispatch_expected[tid] + (unsigned)senders;
    if (!aborted) {
      delivered = epx::wait_geq(ctx, (const uint64_t *)&ctrl->dispatch_done[tid], expected,
                                EPX_STAGE_DISPATCH, tid);
      if (delivered && tid != me &&
          *(volatile unsigned int *)&ctrl->notify_abort[tid] == meta->epoch) {
        /* tid gave up this call's exchange after ours completed: it sent us nothing. Its abort
         * word was written before its done signals, which we have seen. */
        epx::raise_error(ctx, EPX_ERR_TIMEOUT, EPX_STAGE_DISPATCH, tid, -1, meta->epoch);
        delivered = false;
      }
    }
    ctrl->dispatch_expected[tid] = expected;
  }
  epx::trace_end_last(ctx, t_wait, EPX_TRACE_DISPATCH_WAIT, tid < R ? tid : -1);
  return __all_sync(0xffffffffu, delivered);
}

/* The same when every block of the grid sends. */
__device__ __forceinline__ bool wait_sources(const epx__kernel_ctx_t &ctx,
                                             const epx__recv_meta_t *meta, bool aborted) {
  return wait_sources(ctx, meta, aborted, (int)gridDim.x, (int)blockIdx.x);
}

}  // namespace epx::dispatch

#endif  // EPX_KERNELS_DISPATCH_COMMON_CUH_

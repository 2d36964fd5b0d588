/*
 * barrier.cu - a bounded device barrier across all ranks of a group, and the clock sync of
 * tracing, which is the same barrier run several rounds back to back.
 *
 * One block, one warp; lane p talks to rank p. The epoch lives in this rank's control region
 * and is advanced by the kernel itself, so a barrier captured in a CUDA graph stays correct on
 * every replay. Lane p announces the new epoch in rank p's inbox (release, system scope: our
 * earlier writes to p are visible before it), then waits for p's announcement in our inbox.
 * Barriers of one group must be ordered (one stream, or synchronized streams).
 */
#include "kernels/api.h"
#include "kernels/launch.cuh"
#include "kernels/trace.cuh"
#include "kernels/wait.cuh"
#include "kernels/workspace.cuh"

namespace {

/* One round: announce `epoch` to rank `lane` and wait for its announcement. False on timeout
 * (raised as an async error naming the peer). Lanes >= R do nothing. */
__device__ __forceinline__ bool barrier_round(const epx__kernel_ctx_t &ctx, epx__control_t *mine,
                                              int lane, uint64_t epoch) {
  if (lane >= ctx.num_ranks) return true;
  epx::st_release_sys((uint64_t *)&epx::control_of(ctx, lane)->barrier_inbox[ctx.rank], epoch);
  return epx::wait_geq(ctx, (const uint64_t *)&mine->barrier_inbox[lane], epoch, EPX_STAGE_BARRIER,
                       lane);
}

/* The unmasked barrier's round (its own epochs and inboxes): as barrier_round, but the lanes of
 * peers this rank has masked (the low-latency peer mask: DeepEP's shrink mode) do nothing. */
__device__ __forceinline__ void unmasked_round(const epx__kernel_ctx_t &ctx, epx__control_t *mine,
                                               int lane, uint64_t epoch) {
  if (lane >= ctx.num_ranks) return;
  if (lane != ctx.rank && ((*(volatile unsigned *)&mine->ll_peer_mask >> lane) & 1u)) return;
  epx::st_release_sys((uint64_t *)&epx::control_of(ctx, lane)->unmasked_barrier_inbox[ctx.rank],
                      epoch);
  epx::wait_geq(ctx, (const uint64_t *)&mine->unmasked_barrier_inbox[lane], epoch,
                EPX_STAGE_BARRIER, lane);
}

__global__ void barrier_kernel(epx__kernel_ctx_t ctx, int skip_masked) {
  const int lane = threadIdx.x;
  const uint64_t t0 = epx::trace_begin(ctx);
  epx__control_t *mine = epx::control_of(ctx);
  unsigned long long *count = skip_masked ? &mine->unmasked_barrier_epoch : &mine->barrier_epoch;
  const uint64_t epoch = *count + 1;
  __syncwarp();
  if (lane == 0) *count = epoch;
  if (skip_masked)
    unmasked_round(ctx, mine, lane, epoch);
  else
    barrier_round(ctx, mine, lane, epoch);
  epx::trace_end_last(ctx, t0, EPX_TRACE_BARRIER, lane < ctx.num_ranks ? lane : -1);
}

/* The smallest nonzero step of %globaltimer seen in a bounded number of reads (0: none). */
__device__ uint64_t timer_tick_ns() {
  uint64_t prev = epx::globaltimer_ns(), best = 0;
  int changes = 0;
  for (int i = 0; i < (1 << 16) && changes < 4; i++) {
    const uint64_t now = epx::globaltimer_ns();
    if (now != prev) {
      if (best == 0 || now - prev < best) best = now - prev;
      prev = now;
      changes++;
    }
  }
  return best;
}

/* out[0] = the timer's step; out[1 + r] = %globaltimer when round r ended on this rank (after
 * every peer's announcement was seen), 0 if the round timed out. All ranks leave a round within
 * about one flag latency of each other, which is what makes the stamps comparable. */
__global__ void clock_sync_kernel(epx__kernel_ctx_t ctx, unsigned long long *out, int rounds) {
  const int lane = threadIdx.x;
  epx__control_t *mine = epx::control_of(ctx);
  const uint64_t base = mine->barrier_epoch;
  __syncwarp();
  if (lane == 0) {
    mine->barrier_epoch = base + rounds;
    out[0] = timer_tick_ns();
  }
  bool ok = true;
  for (int r = 0; r < rounds; r++) {
    if (ok) ok = barrier_round(ctx, mine, lane, base + 1 + r);
    ok = __all_sync(0xffffffffu, ok);
    if (lane == 0) out[1 + r] = ok ? epx::globaltimer_ns() : 0;
  }
}

}  // namespace

extern "C" epx_status_t epx__barrier_launch(const epx__kernel_ctx_t *ctx, int skip_masked,
                                            cudaStream_t stream) {
  return epx::launch<barrier_kernel>(1, 32, 0, stream, *ctx, skip_masked);
}

extern "C" epx_status_t epx__clock_sync_launch(const epx__kernel_ctx_t *ctx,
                                               unsigned long long *out, int rounds,
                                               cudaStream_t stream) {
  return epx::launch<clock_sync_kernel>(1, 32, 0, stream, *ctx, out, rounds);
}

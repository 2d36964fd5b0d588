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
 * (raised as an async error naming the peer). Lanes >= R do nothing. unmasked: the unmasked
 * barrier's round, on its own inboxes, where the lanes of peers this rank has masked (the
 * low-latency peer mask: DeepEP's shrink mode) do nothing either. */
__device__ __forceinline__ bool barrier_round(const epx__kernel_ctx_t &ctx, epx__control_t *mine,
                                              int lane, uint64_t epoch, bool unmasked = false) {
  if (lane >= ctx.num_ranks) return true;
  if (unmasked && lane != ctx.rank && ((*(volatile unsigned *)&mine->ll_peer_mask >> lane) & 1u))
    return true;
  epx__control_t *theirs = epx::control_of(ctx, lane);
  uint64_t *to = (uint64_t *)(unmasked ? theirs->unmasked_barrier_inbox : theirs->barrier_inbox);
  const uint64_t *from =
      (const uint64_t *)(unmasked ? mine->unmasked_barrier_inbox : mine->barrier_inbox);
  epx::st_release_sys(to + ctx.rank, epoch);
  return epx::wait_geq(ctx, from + lane, epoch, EPX_STAGE_BARRIER, lane);
}

__global__ void barrier_kernel(epx__kernel_ctx_t ctx, int skip_masked) {
  const int lane = threadIdx.x;
  const uint64_t t0 = epx::trace_begin(ctx);
  epx__control_t *mine = epx::control_of(ctx);
  unsigned long long *count = skip_masked ? &mine->unmasked_barrier_epoch : &mine->barrier_epoch;
  const uint64_t epoch = *count + 1;
  __syncwarp();
  if (lane == 0) *count = epoch;
  barrier_round(ctx, mine, lane, epoch, skip_masked != 0);
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

/*
 * wait.cuh - bounded waits and the async-error record.
 *
 * Every spin-wait in EPX is epx::wait_until: it polls a condition and gives up after a budget
 * (normally the group's ctx.timeout_ns, from %globaltimer), or at once when the caller's
 * `abandon` condition says another wait has already given up. What a timeout means (raise an
 * error, mask a peer, abort a combine) is the caller's: wait_until only reports it. The kernel
 * then leaves without trapping, so the CUDA context stays usable.
 */
#ifndef EPX_KERNELS_WAIT_CUH_
#define EPX_KERNELS_WAIT_CUH_

#include "kernel_ctx.h"
#include "kernels/ptx.cuh"
#include "kernels/workspace.cuh"

namespace epx {

enum class WaitResult { kReady, kAbandoned, kTimedOut };

/* Poll ready() until it holds (kReady), abandon() holds (kAbandoned) or budget_ns has passed
 * since the first failed poll (kTimedOut). The first poll costs no timer read. kSleepNs > 0
 * sleeps between polls, leaving issue slots to the other warps of the block. */
template <int kSleepNs = 0, typename Ready, typename Abandon>
__device__ __forceinline__ WaitResult wait_until(uint64_t budget_ns, Ready ready, Abandon abandon) {
  if (ready()) return WaitResult::kReady;
  const uint64_t start = globaltimer_ns();
  for (;;) {
    if (kSleepNs > 0) __nanosleep(kSleepNs);
    if (ready()) return WaitResult::kReady;
    if (abandon()) return WaitResult::kAbandoned;
    if (globaltimer_ns() - start > budget_ns) return WaitResult::kTimedOut;
  }
}

/* The `abandon` of a wait that only a timeout ends. */
struct NeverAbandon {
  __device__ __forceinline__ bool operator()() const { return false; }
};

/* Record the first async error of the group. Only the thread that claims the record writes
 * it; the status goes last, after a system fence, so the host never sees half a record. */
__device__ __forceinline__ void raise_error(const epx__kernel_ctx_t &ctx, int status, int stage,
                                            int peer, long long position, long long value) {
  if (atomicCAS(&control_of(ctx)->error_claim, 0, 1) != 0) return;
  epx__error_record_t *rec = ctx.error;
  rec->stage = stage;
  rec->peer = peer;
  rec->position = position;
  rec->value = value;
  __threadfence_system();
  rec->status = status;
  __threadfence_system();
}

/* Wait until *flag >= target. True on success; false after raising EPX_ERR_TIMEOUT (naming the
 * stage, the peer and the value waited for). */
__device__ __forceinline__ bool wait_geq(const epx__kernel_ctx_t &ctx, const uint64_t *flag,
                                         uint64_t target, int stage, int peer) {
  const WaitResult r = wait_until(
      ctx.timeout_ns, [&] { return ld_acquire_sys(flag) >= target; }, NeverAbandon());
  if (r == WaitResult::kReady) return true;
  raise_error(ctx, EPX_ERR_TIMEOUT, stage, peer, -1, (long long)target);
  return false;
}

}  // namespace epx

#endif  // EPX_KERNELS_WAIT_CUH_

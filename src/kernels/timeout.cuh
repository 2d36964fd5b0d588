/*
 * timeout.cuh - bounded waits and the async-error record.
 *
 * Every spin-wait in EPX goes through wait_geq(): it polls with an acquire load and gives up
 * after the group's budget (ctx.timeout_ns, from %globaltimer). On expiry it raises
 * EPX_ERR_TIMEOUT naming the stage, the peer and the value waited for, and returns false; the
 * kernel then leaves without trapping, so the CUDA context stays usable.
 */
#ifndef EPX_KERNELS_TIMEOUT_CUH_
#define EPX_KERNELS_TIMEOUT_CUH_

#include "group.h"
#include "kernels/ptx.cuh"

namespace epx {

/* Record the first async error of the group. Only the thread that claims the record writes
 * it; the status goes last, after a system fence, so the host never sees half a record. */
__device__ __forceinline__ void raise_error(const epx__kernel_ctx_t &ctx, int status, int stage,
                                            int peer, long long position, long long value) {
  epx__control_t *ctrl = (epx__control_t *)(ctx.peer_base[ctx.rank] + ctx.layout.control_offset);
  if (atomicCAS(&ctrl->error_claim, 0, 1) != 0) return;
  epx__error_record_t *rec = ctx.error;
  rec->stage = stage;
  rec->peer = peer;
  rec->position = position;
  rec->value = value;
  __threadfence_system();
  rec->status = status;
  __threadfence_system();
}

/* Wait until *flag >= target. Returns true on success, false (after raising) on timeout. */
__device__ __forceinline__ bool wait_geq(const epx__kernel_ctx_t &ctx, const uint64_t *flag,
                                         uint64_t target, int stage, int peer) {
  if (ld_acquire_sys(flag) >= target) return true;
  uint64_t start = globaltimer_ns();
  for (;;) {
    if (ld_acquire_sys(flag) >= target) return true;
    if (globaltimer_ns() - start > ctx.timeout_ns) {
      raise_error(ctx, EPX_ERR_TIMEOUT, stage, peer, -1, (long long)target);
      return false;
    }
  }
}

}  // namespace epx

#endif  // EPX_KERNELS_TIMEOUT_CUH_

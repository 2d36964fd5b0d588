/*
 * trace.cuh - recording in-kernel spans (docs/profiling.md; format in src/include/trace_format.h).
 *
 *   const uint64_t t0 = epx::trace_begin(ctx);            // every thread may call it
 *   ... the stage ...
 *   if (lane == 0) epx::trace_end(ctx, t0, EPX_TRACE_X, arg);   // one lane per warp records
 *
 * When the group does not trace, ctx.trace is NULL: both calls are one branch on a kernel
 * parameter (uniform over the grid, so perfectly predicted) and read no timer. Built with
 * TRACE=0 they are empty. A record claims its slot with one atomicAdd on the buffer's counter;
 * past the capacity it writes nothing, and the host counts the overflow as dropped.
 * Timestamps are %globaltimer at the call: when the warp got there, not when its earlier
 * stores landed. Spans recorded by one warp must nest or follow each other (the viewers draw
 * one track per block/warp), so a warp never records two overlapping sibling spans.
 */
#ifndef EPX_KERNELS_TRACE_CUH_
#define EPX_KERNELS_TRACE_CUH_

#include <stdint.h>

#include "kernel_ctx.h"
#include "kernels/ptx.cuh"
#include "trace_format.h"

namespace epx {

/* Start of a span: the time, or 0 when the group does not trace. */
__device__ __forceinline__ uint64_t trace_begin(const epx__kernel_ctx_t &ctx) {
#if EPX_TRACE_COMPILED
  if (ctx.trace != nullptr) return globaltimer_ns();
#endif
  (void)ctx;
  return 0;
}

/* Append one event [t0, t1) from the calling thread (tracing on). */
__device__ __forceinline__ void trace_record(epx__trace_ring_t *ring, uint64_t t0, uint64_t t1,
                                             int tag, int arg) {
  const unsigned long long slot = atomicAdd(&ring->count, 1ull);
  if (slot >= ring->capacity) return; /* full: counted (count > capacity), not written */
  unsigned sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  const uint64_t dur = t1 > t0 ? t1 - t0 : 0;
  epx__trace_event_t ev;
  ev.start_ns = t0;
  ev.dur_ns = dur > 0xffffffffull ? 0xffffffffu : (unsigned)dur;
  ev.arg = arg;
  ev.tag = (unsigned short)tag;
  ev.block = (unsigned short)blockIdx.x;
  ev.warp = (unsigned short)(threadIdx.x / 32);
  ev.sm = (unsigned short)sm;
  epx__trace_events(ring)[slot] = ev;
}

/* End of a span begun at t0 (trace_begin's value): one event from the calling thread. */
__device__ __forceinline__ void trace_end(const epx__kernel_ctx_t &ctx, uint64_t t0, int tag,
                                          int arg) {
#if EPX_TRACE_COMPILED
  if (ctx.trace != nullptr) trace_record(ctx.trace, t0, globaltimer_ns(), tag, arg);
#endif
  (void)ctx, (void)t0, (void)tag, (void)arg;
}

/* End of a wait shared by a warp (lane p waited for peer p): WARP-COLLECTIVE, all 32 lanes
 * call it. Lanes that waited for something pass its id (>= 0), the others -1. Lane 0 records
 * one event from its t0 to the time the last lane finished, with that lane's id as argument:
 * "how long the warp waited, and for whom". */
__device__ __forceinline__ void trace_end_last(const epx__kernel_ctx_t &ctx, uint64_t t0, int tag,
                                               int id) {
#if EPX_TRACE_COMPILED
  if (ctx.trace == nullptr) return;
  uint64_t t1 = id >= 0 ? globaltimer_ns() : 0;
  int who = id;
  /* Butterfly max of (t1, who): every lane ends with the same, latest pair. */
  for (int o = 16; o > 0; o >>= 1) {
    const uint64_t t_other = __shfl_xor_sync(0xffffffffu, t1, o);
    const int who_other = __shfl_xor_sync(0xffffffffu, who, o);
    if (t_other > t1 || (t_other == t1 && who_other > who)) t1 = t_other, who = who_other;
  }
  if ((threadIdx.x & 31) == 0) trace_record(ctx.trace, t0, t1 ? t1 : globaltimer_ns(), tag, who);
#endif
  (void)ctx, (void)t0, (void)tag, (void)id;
}

}  // namespace epx

#endif  // EPX_KERNELS_TRACE_CUH_

/*
 * expand_arrival.cuh - per-expert arrival signals of the expert-major dispatch
 * (epx_dispatch_expand_result_t.expert_ready; docs/moe.md, "Arrival signals").
 *
 * Each rank keeps, for each of its L local experts, two words in its own workspace
 * (layout.expand_arrival_offset; no peer touches them):
 *   arrived[j]  rows of expert j that are complete in this call
 *   ready[j]    1 once all of them are: the rows the expert gets this call below the capacity
 * Notify's expand variant, the kernel before the dispatch on the caller's stream, resets both
 * (ready[j] = 1 at once for an expert with no row, 0 when the count exchange failed); so a
 * consumer must be ordered after that kernel (the result's counts_event).
 * A row is complete once its token's payload has landed and the fan-out has copied it to the
 * token's other rows: then the fan-out warp counts each of the token's rows for its expert.
 * Ordering: the warp's copies, a __syncwarp, then each counting lane's add, an acq_rel atomic
 * at GPU scope (a release of the warp's copies, which the barrier ordered before it, and of the
 * landed payload its acquire saw; an acquire of every earlier add). The add that reaches the
 * expert's rows stores ready[j] = 1 with release semantics, so a kernel that acquire-loads 1
 * (or a stream after cuStreamWaitValue32) reads complete rows.
 */
#ifndef EPX_KERNELS_EXPAND_ARRIVAL_CUH_
#define EPX_KERNELS_EXPAND_ARRIVAL_CUH_

#include "kernels/ptx.cuh"
#include "kernels/trace.cuh"
#include "workspace.h"

namespace epx::expand {

/* This rank's arrived[L] (ready[L] follows at + L). */
__device__ __forceinline__ uint32_t *arrival_words(const epx__kernel_ctx_t &ctx) {
  return (uint32_t *)(ctx.peer_base[ctx.rank] + ctx.layout.normal_offset +
                      ctx.layout.expand_arrival_offset);
}

/* The rows of local expert j that are written in this call: those below the capacity. */
__device__ __forceinline__ int rows_written(int begin, int count, int cap) {
  const int end = begin + count < cap ? begin + count : cap;
  return end > begin ? end - begin : 0;
}

/* Notify's expand variant, the thread of local expert j once its segment is placed. */
__device__ __forceinline__ void reset_arrival(const epx__kernel_ctx_t &ctx, int L, int j, int begin,
                                              int count, bool failed) {
  uint32_t *arrived = arrival_words(ctx);
  arrived[j] = 0;
  arrived[L + j] = !failed && rows_written(begin, count, (int)ctx.layout.expand_rows) == 0;
}

/* The local expert whose segment holds row r: the last j with begin[j] <= r (an empty segment
 * shares its begin with the next one, which is then the last). */
__device__ __forceinline__ int expert_of_row(const epx__recv_meta_t *meta, int L, int r) {
  int lo = 0, hi = L - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (meta->expand_begin[mid] <= r)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

/* One received token's rows are complete: each lane holding one of them (row >= 0, below the
 * capacity) counts it for its expert. WARP-COLLECTIVE (the barrier orders the warp's copies
 * before every lane's add). */
__device__ __forceinline__ void count_token_rows(const epx__kernel_ctx_t &ctx,
                                                 const epx__recv_meta_t *meta, int L, int row) {
  __syncwarp();
  if (row < 0) return;
  uint32_t *arrived = arrival_words(ctx);
  const int j = expert_of_row(meta, L, row);
  const int want =
      rows_written(meta->expand_begin[j], meta->expand_count[j], (int)ctx.layout.expand_rows);
  if (atom_add_acq_rel_gpu_u32(arrived + j, 1) + 1 == (uint32_t)want) {
    st_release_gpu_u32(arrived + L + j, 1);
#if EPX_TRACE_COMPILED
    if (ctx.trace != nullptr) {
      const uint64_t now = globaltimer_ns();
      trace_record(ctx.trace, now, now, EPX_TRACE_EXPAND_EXPERT_READY, j);
    }
#endif
  }
}

}  // namespace epx::expand

#endif /* EPX_KERNELS_EXPAND_ARRIVAL_CUH_ */

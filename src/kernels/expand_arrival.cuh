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
 * token's other rows: then the fan-out warp adds it to a batch (ArrivalBatch), counted after
 * the warp's current set of landed tokens (DURING) or after each token (AFTER). Ordering: the
 * warp's copies, a __syncwarp, then each counting lane's fence (GPU scope) and relaxed add; the
 * add that reaches the expert's rows is followed by a fence and ready[j] = 1: so a kernel that
 * acquire-loads 1 (or a stream after cuStreamWaitValue32) reads complete rows. Counting after
 * every token instead (a fence per token: it waits for the token's copies, so the next token's
 * copies no longer overlap them) made the DURING dispatch kernel 6% slower (4x H200).
 */
#ifndef EPX_KERNELS_EXPAND_ARRIVAL_CUH_
#define EPX_KERNELS_EXPAND_ARRIVAL_CUH_

#include "kernels/ptx.cuh"
#include "kernels/segment.cuh"
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

/* A warp's complete rows not yet counted: lane i holds slot i < n (its row's local expert and
 * that expert's rows in this call). Counting in batches keeps the fence that publishes the
 * warp's copies off the path of every token (a fence waits for the warp's stores in flight). */
struct ArrivalBatch {
  int expert = -1, want = 0;
  int n = 0; /* uniform over the warp */
};

/* Count the batch: each lane holding a slot fences (with the barrier: a release of the warp's
 * copies and of the payloads its lanes acquired; the lanes' fences are one instruction of the
 * warp) and adds 1 to its expert's arrived word; the add that completes an expert fences again
 * (an acquire of the earlier adds, whose lanes fenced the same way) and stores ready = 1.
 * WARP-COLLECTIVE. */
__device__ __forceinline__ void flush_arrivals(const epx__kernel_ctx_t &ctx, int L, ArrivalBatch &b,
                                               int lane) {
  if (b.n == 0) return;
  __syncwarp();
  if (lane < b.n) {
    uint32_t *arrived = arrival_words(ctx);
    fence_acq_rel_gpu();
    if (atom_add_relaxed_gpu_u32(arrived + b.expert, 1) + 1 == (uint32_t)b.want) {
      fence_acq_rel_gpu();
      st_relaxed_gpu_u32(arrived + L + b.expert, 1);
#if EPX_TRACE_COMPILED
      if (ctx.trace != nullptr) {
        const uint64_t now = globaltimer_ns();
        trace_record(ctx.trace, now, now, EPX_TRACE_EXPAND_EXPERT_READY, b.expert);
      }
#endif
    }
  }
  __syncwarp();
  b.expert = -1, b.want = 0, b.n = 0;
}

/* One received token's rows are complete (its payload landed and the fan-out copied it): each
 * lane's row (row >= 0, below the capacity; a token's rows are of distinct experts) joins the
 * batch, which is counted first if they would not fit. WARP-COLLECTIVE. */
__device__ __forceinline__ void add_token_rows(const epx__kernel_ctx_t &ctx,
                                               const epx__recv_meta_t *meta, int L, ArrivalBatch &b,
                                               int row, int lane) {
  const unsigned has = __ballot_sync(0xffffffffu, row >= 0);
  const int c = __popc(has);
  if (c == 0) return;
  if (b.n + c > 32) flush_arrivals(ctx, L, b, lane);
  int j = -1, want = 0;
  if (row >= 0) {
    j = segment_of(meta->expand_begin, L, row); /* written by notify: read-only here */
    want = rows_written(meta->expand_begin[j], meta->expand_count[j], (int)ctx.layout.expand_rows);
  }
  /* slot b.n + r takes the row of the r-th lane holding one */
  const int r = lane - b.n;
  const int src = r >= 0 && r < c ? (int)__fns(has, 0, r + 1) : lane;
  const int j_src = __shfl_sync(0xffffffffu, j, src);
  const int want_src = __shfl_sync(0xffffffffu, want, src);
  if (r >= 0 && r < c) b.expert = j_src, b.want = want_src;
  b.n += c;
}

}  // namespace epx::expand

#endif /* EPX_KERNELS_EXPAND_ARRIVAL_CUH_ */

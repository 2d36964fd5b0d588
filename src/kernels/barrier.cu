/*
 * barrier.cu - a bounded device barrier across all ranks of a group.
 *
 * One block, one warp; lane p talks to rank p. The epoch lives in this rank's control region
 * and is advanced by the kernel itself, so a barrier captured in a CUDA graph stays correct on
 * every replay. Lane p announces the new epoch in rank p's inbox (release, system scope: our
 * earlier writes to p are visible before it), then waits for p's announcement in our inbox.
 * Barriers of one group must be ordered (one stream, or synchronized streams).
 */
#include "kernels/api.h"
#include "kernels/timeout.cuh"
#include "checks.h"

namespace {

__global__ void barrier_kernel(epx__kernel_ctx_t ctx) {
  const int lane = threadIdx.x;
  epx__control_t *mine = (epx__control_t *)(ctx.peer_base[ctx.rank] + ctx.layout.control_offset);
  const uint64_t epoch = mine->barrier_epoch + 1;
  __syncwarp();
  if (lane == 0) mine->barrier_epoch = epoch;
  if (lane < ctx.num_ranks) {
    epx__control_t *peer = (epx__control_t *)(ctx.peer_base[lane] + ctx.layout.control_offset);
    epx::st_release_sys((uint64_t *)&peer->barrier_inbox[ctx.rank], epoch);
    epx::wait_geq(ctx, (const uint64_t *)&mine->barrier_inbox[lane], epoch, EPX_STAGE_BARRIER,
                  lane);
  }
}

}  // namespace

extern "C" epx_status_t epx__barrier_launch(const epx__kernel_ctx_t *ctx, cudaStream_t stream) {
  barrier_kernel<<<1, 32, 0, stream>>>(*ctx);
  CUDA_CHECK(cudaGetLastError());
  return EPX_OK;
}

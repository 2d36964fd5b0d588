/*
 * peer_mask.cu - the manual peer mask of low-latency mode (epx_group_mask_peer): one thread sets
 * peer bits in this rank's control->ll_peer_mask, the word the low-latency kernels read at their
 * start (ll_common.cuh read_mask) and set themselves when a wait on a peer times out.
 *
 * Stream order is the whole contract: a low-latency kernel queued after this one on the same
 * stream starts after it and reads the bit; nothing else is written, so no async error is
 * raised and no epoch moves (epx_group_clear_peer_mask restores the peer, collectively).
 */
#include "kernels/api.h"
#include "kernels/launch.cuh"
#include "kernels/workspace.cuh"

namespace {

__global__ void peer_mask_kernel(epx__kernel_ctx_t ctx, unsigned bits) {
  atomicOr(&epx::control_of(ctx)->ll_peer_mask, bits);
}

}  // namespace

extern "C" epx_status_t epx__peer_mask_launch(const epx__kernel_ctx_t *ctx, unsigned bits,
                                              cudaStream_t stream) {
  return epx::launch<peer_mask_kernel>(1, 1, 0, stream, *ctx, bits);
}

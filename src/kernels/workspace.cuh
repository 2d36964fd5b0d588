/*
 * workspace.cuh - a kernel's view of the symmetric workspace (layout in src/include/workspace.h):
 * the control region of any rank, through the peer base pointers of the kernel context.
 */
#ifndef EPX_KERNELS_WORKSPACE_CUH_
#define EPX_KERNELS_WORKSPACE_CUH_

#include "kernel_ctx.h"

namespace epx {

/* Rank `rank`'s control region as mapped on this GPU. */
__device__ __forceinline__ epx__control_t *control_of(const epx__kernel_ctx_t &ctx, int rank) {
  return (epx__control_t *)(ctx.peer_base[rank] + ctx.layout.control_offset);
}

/* This rank's own control region. */
__device__ __forceinline__ epx__control_t *control_of(const epx__kernel_ctx_t &ctx) {
  return control_of(ctx, ctx.rank);
}

}  // namespace epx

#endif  // EPX_KERNELS_WORKSPACE_CUH_

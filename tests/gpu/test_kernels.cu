/*
 * test_kernels.cu - small kernels the GPU tests use to probe the workspace directly.
 */
#include "gpu/gpu_util.h"
#include "kernels/ptx.cuh"

namespace {

__global__ void write_peer_slots_kernel(epx__kernel_ctx_t ctx, uint64_t value) {
  const int p = threadIdx.x;
  if (p < ctx.num_ranks) {
    uint64_t *slots = (uint64_t *)(ctx.peer_base[p] + ctx.layout.normal_offset);
    slots[ctx.rank] = value;
  }
}

__global__ void count_wrong_slots_kernel(epx__kernel_ctx_t ctx, uint64_t value, int *wrong) {
  const uint64_t *slots = (const uint64_t *)(ctx.peer_base[ctx.rank] + ctx.layout.normal_offset);
  int bad = 0;
  for (int p = 0; p < ctx.num_ranks; p++) bad += epx::ld_acquire_sys(&slots[p]) != value;
  *wrong = bad;
}

__global__ void spin_kernel(uint64_t ns) {
  const uint64_t start = epx::globaltimer_ns();
  while (epx::globaltimer_ns() - start < ns) {
  }
}

}  // namespace

extern "C" cudaError_t test_write_peer_slots(epx_group_t g, uint64_t value, cudaStream_t stream) {
  epx__kernel_ctx_t ctx;
  epx__group_kernel_ctx(g, &ctx);
  write_peer_slots_kernel<<<1, 32, 0, stream>>>(ctx, value);
  return cudaGetLastError();
}

extern "C" cudaError_t test_count_wrong_slots(epx_group_t g, uint64_t value, int *wrong_dev,
                                              cudaStream_t stream) {
  epx__kernel_ctx_t ctx;
  epx__group_kernel_ctx(g, &ctx);
  count_wrong_slots_kernel<<<1, 1, 0, stream>>>(ctx, value, wrong_dev);
  return cudaGetLastError();
}

extern "C" cudaError_t test_spin_ns(uint64_t ns, cudaStream_t stream) {
  spin_kernel<<<1, 1, 0, stream>>>(ns);
  return cudaGetLastError();
}

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

/* Block b takes local experts b, b + gridDim.x, ...: waits (bounded) for expert_ready[j] == 1,
 * then sums the 32-bit words of the expert's rows [begin[j], min(begin[j] + count[j], cap)).
 * late[j]: 1 the wait ran out, 2 the first look saw 0 (the probe overlapped the dispatch). */
__global__ void expert_ready_sums_kernel(const uint32_t *ready, const int *begin, const int *count,
                                         int L, int cap, const uint32_t *x, int row_words,
                                         uint32_t *sums, int *late, uint64_t budget_ns) {
  __shared__ uint32_t part[256];
  __shared__ int waited_out;
  const uint64_t t0 = epx::globaltimer_ns();
  for (int j = blockIdx.x; j < L; j += gridDim.x) {
    if (threadIdx.x == 0) {
      int out = epx::ld_acquire_gpu_u32(ready + j) != 1u ? 2 : 0;
      while (out == 2 && epx::ld_acquire_gpu_u32(ready + j) != 1u)
        if (epx::globaltimer_ns() - t0 > budget_ns) {
          out = 1;
          break;
        }
      waited_out = out;
    }
    __syncthreads();
    uint32_t s = 0;
    const int b = begin[j], e = min(b + count[j], cap);
    if (waited_out != 1)
      for (long long i = (long long)b * row_words + threadIdx.x; i < (long long)e * row_words;
           i += blockDim.x)
        s += x[i];
    part[threadIdx.x] = s;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o /= 2) {
      if ((int)threadIdx.x < o) part[threadIdx.x] += part[threadIdx.x + o];
      __syncthreads();
    }
    if (threadIdx.x == 0) sums[j] = part[0], late[j] = waited_out;
    __syncthreads();
  }
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

extern "C" cudaError_t test_expert_ready_sums(const uint32_t *ready, const int *begin,
                                              const int *count, int L, int cap, const void *x,
                                              int row_bytes, uint32_t *sums, int *late,
                                              uint64_t budget_ns, cudaStream_t stream) {
  const int blocks = L < 16 ? L : 16;
  expert_ready_sums_kernel<<<blocks, 256, 0, stream>>>(
      ready, begin, count, L, cap, (const uint32_t *)x, row_bytes / 4, sums, late, budget_ns);
  return cudaGetLastError();
}

extern "C" cudaError_t test_spin_ns(uint64_t ns, cudaStream_t stream) {
  spin_kernel<<<1, 1, 0, stream>>>(ns);
  return cudaGetLastError();
}

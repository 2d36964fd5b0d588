/*
 * bench_kernels.cu - device helpers of epx_experts_bench: random fills of weights and rows,
 * and the HBM read ceiling the FFN's weight streaming is compared with.
 */
#include <cuda_bf16.h>
#include <stdint.h>

#include "experts/bench_kernels.h"

namespace {

__device__ __forceinline__ uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
/* Uniform in [-1, 1). */
__device__ __forceinline__ float unit(uint64_t seed, size_t i) {
  return (float)(mix(seed + 0x9E3779B97F4A7C15ull * (i + 1)) >> 40) / (float)(1ull << 23) - 1.f;
}

__global__ void fill_bf16_kernel(__nv_bfloat16 *p, size_t n, float amp, uint64_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    p[i] = __float2bfloat16(amp * unit(seed, i));
}

/* Random FP8 E4M3 codes, never the NaN codes 0x7f / 0xff. */
__global__ void fill_fp8_kernel(uint8_t *p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    uint8_t v = (uint8_t)mix(seed + i);
    if ((v & 0x7f) == 0x7f) v ^= 1;
    p[i] = v;
  }
}

__global__ void fill_f32_kernel(float *p, size_t n, float lo, float hi, uint64_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    p[i] = lo + (hi - lo) * 0.5f * (unit(seed, i) + 1.f);
}

/* Reads n16 16-byte words once; the sum keeps the loads alive. */
__global__ void read_kernel(const int4 *p, size_t n16, int *sink) {
  int acc = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n16;
       i += (size_t)gridDim.x * blockDim.x) {
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p + i));
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x7fffffff) *sink = acc; /* practically never: the compiler cannot know */
}

int grid_for(size_t n) {
  size_t b = (n + 255) / 256;
  return (int)(b < 4096 ? (b > 0 ? b : 1) : 4096);
}

}  // namespace

extern "C" cudaError_t bench_fill_bf16(void *p, size_t n, float amp, uint64_t seed) {
  fill_bf16_kernel<<<grid_for(n), 256>>>((__nv_bfloat16 *)p, n, amp, seed);
  return cudaGetLastError();
}
extern "C" cudaError_t bench_fill_fp8(void *p, size_t n, uint64_t seed) {
  fill_fp8_kernel<<<grid_for(n), 256>>>((uint8_t *)p, n, seed);
  return cudaGetLastError();
}
extern "C" cudaError_t bench_fill_f32(float *p, size_t n, float lo, float hi, uint64_t seed) {
  fill_f32_kernel<<<grid_for(n), 256>>>(p, n, lo, hi, seed);
  return cudaGetLastError();
}
extern "C" cudaError_t bench_read(const void *p, size_t bytes, int *sink, cudaStream_t stream) {
  int sms = 132;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  read_kernel<<<sms * 4, 512, 0, stream>>>((const int4 *)p, bytes / 16, sink);
  return cudaGetLastError();
}

/*
 * ptx.cuh - memory-model primitives for cross-GPU flags and fast copies.
 *
 * Flags between GPUs use release stores and acquire loads at system scope: a release store
 * makes every earlier write of this thread (and, after a __syncthreads, of its block) visible
 * to a peer that acquire-loads the flag.
 */
#ifndef EPX_KERNELS_PTX_CUH_
#define EPX_KERNELS_PTX_CUH_

#include <stdint.h>

namespace epx {

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t *p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(uint64_t *p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ int ld_acquire_sys(const int *p) {
  int v;
  asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(int *p, int v) {
  asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

/* Nanoseconds from the GPU's global timer (comparable across SMs of one GPU). */
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

/* 16-byte load that does not allocate in L1: inputs read once. */
__device__ __forceinline__ int4 ld_nc_na_v4(const int4 *p) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

}  // namespace epx

#endif  // EPX_KERNELS_PTX_CUH_

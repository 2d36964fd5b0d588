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

/* 32-bit flags between GPUs: the same semantics as the 64-bit pair above. */
__device__ __forceinline__ uint32_t ld_acquire_sys_u32(const uint32_t *p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys_u32(uint32_t *p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

/* For one fence covering several flag stores (fence, then relaxed stores: each a release), or
 * after a relaxed poll saw its value (relaxed load, then fence: an acquire). */
__device__ __forceinline__ void fence_acq_rel_sys() {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
}

__device__ __forceinline__ uint32_t ld_relaxed_sys_u32(const uint32_t *p) {
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_relaxed_sys_u32(uint32_t *p, uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

/* Flags and counters between blocks and kernels of one GPU (the expand dispatch's per-expert
 * arrivals): the same semantics as the system-scope pair above, at GPU scope. */
__device__ __forceinline__ uint32_t ld_acquire_gpu_u32(const uint32_t *p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void fence_acq_rel_gpu() {
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
}

__device__ __forceinline__ void st_relaxed_gpu_u32(uint32_t *p, uint32_t v) {
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

/* Add, returning the old value; orders nothing else (a fence before or after does). */
__device__ __forceinline__ uint32_t atom_add_relaxed_gpu_u32(uint32_t *p, uint32_t v) {
  uint32_t old;
  asm volatile("atom.relaxed.gpu.global.add.u32 %0, [%1], %2;"
               : "=r"(old)
               : "l"(p), "r"(v)
               : "memory");
  return old;
}

/* Relaxed 64-bit load and store at GPU scope: single-copy atomic, never served from a stale L1
 * line, no ordering of other memory. For words that carry everything their reader needs (the
 * layout kernel's epoch-tagged tile words), between blocks of one GPU. */
__device__ __forceinline__ uint64_t ld_relaxed_gpu(const uint64_t *p) {
  uint64_t v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_relaxed_gpu(uint64_t *p, uint64_t v) {
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

/* *p += v as one release at system scope, without a return value: a monotonic counter that
 * tells a peer how much of this thread's (after a __syncthreads, its block's) writes landed. */
__device__ __forceinline__ void red_release_sys_add(unsigned long long *p, unsigned long long v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

/* Programmatic dependent launch (launch_ex with early = 1): wait until the stream's previous
 * kernel has ended and its writes are visible (a no-op in a kernel not launched early); and let
 * the stream's next kernel, if launched early, start its blocks before this one ends. */
__device__ __forceinline__ void grid_dependency_wait() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}
__device__ __forceinline__ void grid_dependents_may_launch() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
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

/* ---- Bulk copies through shared memory (the TMA engine): copies that cost the issuing warp one
 * instruction, not one load and one store per 16 bytes per lane. Sizes and addresses are
 * multiples of 16 bytes. ---- */
__device__ __forceinline__ uint32_t smem_addr(const void *p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void mbarrier_init(uint64_t *bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count)
               : "memory");
}

/* Make mbarrier inits visible to the async proxy before any bulk copy uses them. */
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

/* Arm the barrier for `bytes` more bytes of asynchronous copies (one arrival). */
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t *bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

/* One arrival on the barrier (no transaction bytes). */
__device__ __forceinline__ void mbarrier_arrive(uint64_t *bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

/* Global -> shared bulk copy (16-byte aligned, a multiple of 16 bytes) that completes `bytes`
 * of a barrier armed elsewhere (mbarrier_arrive_expect_tx). */
__device__ __forceinline__ void bulk_copy(void *smem, const void *gmem, uint32_t bytes,
                                          uint64_t *bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(smem_addr(smem)),
      "l"(gmem), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

/* Global -> shared: arm the barrier for `bytes` and start the copy; it completes the barrier. */
__device__ __forceinline__ void bulk_load(void *smem, const void *gmem, uint32_t bytes,
                                          uint64_t *bar) {
  mbarrier_arrive_expect_tx(bar, bytes);
  bulk_copy(smem, gmem, bytes, bar);
}

/* Global -> shared through a tensor map (2D, the box its encoding fixed) at coordinates
 * (c0 innermost, c1); completes `bytes` of the barrier's transaction count. The map must live
 * in parameter (__grid_constant__), constant or global memory. */
__device__ __forceinline__ void tma_load_2d(void *smem, const void *tensor_map, int c0, int c1,
                                            uint64_t *bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], "
      "[%1, {%2, %3}], [%4];" ::"r"(smem_addr(smem)),
      "l"(tensor_map), "r"(c0), "r"(c1), "r"(smem_addr(bar))
      : "memory");
}

/* Whether the barrier has completed the phase of the given parity. */
__device__ __forceinline__ bool mbarrier_try_wait(uint64_t *bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      " selp.u32 %0, 1, 0, p;\n}"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

/* Move this warpgroup's registers per thread down or up to kRegs (every warp of the warpgroup
 * runs it): a warp-specialized kernel gives its copy warps' registers to its math warps. */
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}

/* Shared -> global (any address this GPU maps, peers' included), as one bulk group. */
__device__ __forceinline__ void bulk_store(void *gmem, const void *smem, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gmem),
               "r"(smem_addr(smem)), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

/* Wait until at most N bulk groups are still reading shared memory (their sources reusable). */
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

/* Order this thread's global-memory accesses across the generic and async proxies: earlier
 * generic reads (an acquire of a flag) before later bulk copies of the data the flag publishes,
 * or completed bulk writes before a later generic release (bulk_wait_done). */
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

/* Wait until at most N bulk groups are incomplete (their writes performed), then order them
 * before this thread's later generic-proxy operations (e.g. a release that signals a peer). */
template <int N>
__device__ __forceinline__ void bulk_wait_done() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
  fence_proxy_async_global();
}

}  // namespace epx

#endif  // EPX_KERNELS_PTX_CUH_

/*
 * launch.cuh - how every EPX kernel is launched, and how run-time values pick a compile-time
 * specialisation.
 *
 *   return epx::launch<my_kernel<IdxT, kFp8>>(grid, block, smem, stream, ctx, args);
 *
 * launch() opts the kernel into more than 48 KiB of shared memory when its static plus dynamic
 * bytes need it (one rule for every kernel), launches with cudaLaunchKernelEx and returns the
 * status of this launch: an older error left on the thread by someone else is not reported as
 * this launch's. launch_ex(early, ...) can also launch it early (programmatic dependent launch).
 *
 * The switches turn a run-time value into a compile-time name inside the lambda they run, one
 * macro per specialisation axis. Each lists its values once; a value outside them returns
 * EPX_ERR_UNSUPPORTED naming it, so nothing falls through to another case silently:
 *   EPX_BOOL_SWITCH(cond, kName, [&] { ... kName ... })            bool constant
 *   EPX_INDEX_SWITCH(is_int64, IdxT, [&] { ... IdxT ... })         long long or int
 *   EPX_RANKS_SWITCH(num_ranks, kRanks, [&] { ... kRanks ... })    2, 4 or 8: the smallest
 *       compiled rank count >= num_ranks (code specialised for kRanks serves fewer ranks)
 */
#ifndef EPX_KERNELS_LAUNCH_CUH_
#define EPX_KERNELS_LAUNCH_CUH_

#include <stdint.h>

#include "checks.h"

namespace epx {

/* Shared memory a kernel may use without opting in. */
constexpr size_t kDefaultSharedBytes = 48 * 1024;

/* early = 1: programmatic dependent launch. The kernel may start before the previous kernel of
 * the stream ends (once that one's blocks all ran grid_dependents_may_launch, ptx.cuh), so it
 * must call grid_dependency_wait before it reads anything the previous kernel wrote. */
template <auto kKernel, typename... Args>
epx_status_t launch_ex(int early, dim3 grid, dim3 block, size_t dynamic_smem, cudaStream_t stream,
                       const Args &...args) {
  if (dynamic_smem > 0) {
    /* Static shared bytes of this kernel, read once (the same on every GPU of one build). */
    static size_t static_bytes = SIZE_MAX;
    if (static_bytes == SIZE_MAX) {
      cudaFuncAttributes fa;
      CUDA_CHECK(cudaFuncGetAttributes(&fa, kKernel));
      static_bytes = fa.sharedSizeBytes;
    }
    if (static_bytes + dynamic_smem > kDefaultSharedBytes)
      CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      (int)dynamic_smem));
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = dynamic_smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1] = {};
  if (early) {
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attr;
    config.numAttrs = 1;
  }
  CUDA_CHECK(cudaLaunchKernelEx(&config, kKernel, args...));
  return EPX_OK;
}

template <auto kKernel, typename... Args>
epx_status_t launch(dim3 grid, dim3 block, size_t dynamic_smem, cudaStream_t stream,
                    const Args &...args) {
  return launch_ex<kKernel>(0, grid, block, dynamic_smem, stream, args...);
}

}  // namespace epx

#define EPX_BOOL_SWITCH(cond, name, ...)  \
  [&] {                                   \
    if (cond) {                           \
      constexpr static bool name = true;  \
      return __VA_ARGS__();               \
    } else {                              \
      constexpr static bool name = false; \
      return __VA_ARGS__();               \
    }                                     \
  }()

#define EPX_INDEX_SWITCH(is_int64, name, ...) \
  [&] {                                       \
    if (is_int64) {                           \
      using name = long long;                 \
      return __VA_ARGS__();                   \
    } else {                                  \
      using name = int;                       \
      return __VA_ARGS__();                   \
    }                                         \
  }()

#define EPX_RANKS_SWITCH(num_ranks, name, ...)                                                 \
  [&]() -> epx_status_t {                                                                      \
    switch (num_ranks) {                                                                       \
      case 1:                                                                                  \
      case 2: {                                                                                \
        constexpr static int name = 2;                                                         \
        return __VA_ARGS__();                                                                  \
      }                                                                                        \
      case 3:                                                                                  \
      case 4: {                                                                                \
        constexpr static int name = 4;                                                         \
        return __VA_ARGS__();                                                                  \
      }                                                                                        \
      case 5:                                                                                  \
      case 6:                                                                                  \
      case 7:                                                                                  \
      case 8: {                                                                                \
        constexpr static int name = 8;                                                         \
        return __VA_ARGS__();                                                                  \
      }                                                                                        \
      default:                                                                                 \
        return epx__set_error(EPX_ERR_UNSUPPORTED, "%s = %d: kernels are compiled for 1 to 8", \
                              #num_ranks, (int)(num_ranks));                                   \
    }                                                                                          \
  }()

#endif  // EPX_KERNELS_LAUNCH_CUH_

/*
 * arg_check.c - the shared argument checks of the public entries (arg_check.h).
 */
#include "arg_check.h"

#include <stdint.h>

#include "checks.h"

epx_status_t epx__check_not_null(const char *fn, const char *arg, const void *p) {
  if (!p) return epx__set_error(EPX_ERR_INVALID_ARGUMENT, "%s: %s is NULL", fn, arg);
  return EPX_OK;
}

epx_status_t epx__check_struct_size(const char *fn, const char *arg, size_t size, size_t expected,
                                    const char *init) {
  if (size != expected)
    return epx__set_error(EPX_ERR_INVALID_ARGUMENT,
                          "%s: %s->size = %zu: must be %zu; initialize it with %s", fn, arg, size,
                          expected, init);
  return EPX_OK;
}

epx_status_t epx__check_index_dtype(const char *fn, const char *arg, epx_dtype_t dtype) {
  if (dtype != EPX_DTYPE_INT64 && dtype != EPX_DTYPE_INT32)
    return epx__set_error(EPX_ERR_INVALID_ARGUMENT,
                          "%s: %s = %d: must be EPX_DTYPE_INT64 or EPX_DTYPE_INT32", fn, arg,
                          (int)dtype);
  return EPX_OK;
}

epx_status_t epx__check_token_count(const char *fn, const char *arg, int n, int max) {
  if (n < 0 || n > max)
    return epx__set_error(EPX_ERR_INVALID_ARGUMENT,
                          "%s: %s = %d: must be in [0, max_tokens_per_rank = %d]", fn, arg, n, max);
  return EPX_OK;
}

epx_status_t epx__check_flag(const char *fn, const char *arg, int value) {
  if (value != 0 && value != 1)
    return epx__set_error(EPX_ERR_INVALID_ARGUMENT, "%s: %s = %d: must be 0 or 1", fn, arg, value);
  return EPX_OK;
}

epx_status_t epx__check_device_ptr(const char *fn, const char *arg, const void *p, size_t align) {
  EPX_CHECK(epx__check_not_null(fn, arg, p));
  if ((uintptr_t)p % align != 0)
    return epx__set_error(EPX_ERR_INVALID_ARGUMENT, "%s: %s = %p: must be %zu-byte aligned", fn,
                          arg, p, align);
  struct cudaPointerAttributes attr;
  cudaError_t e = cudaPointerGetAttributes(&attr, p);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();       /* do not leave the query's error behind for the caller */
    if (e != cudaErrorInvalidValue) /* the context, not the pointer (e.g. a sticky error) */
      return epx__set_error(EPX_ERR_CUDA,
                            "%s: %s = %p: CUDA cannot tell what memory this is (%s); the CUDA "
                            "context is probably unusable after an earlier error",
                            fn, arg, p, cudaGetErrorString(e));
    return epx__set_error(EPX_ERR_INVALID_ARGUMENT, "%s: %s = %p: must be GPU memory (%s)", fn, arg,
                          p, cudaGetErrorString(e));
  }
  if (attr.type == cudaMemoryTypeUnregistered ||
      (attr.type == cudaMemoryTypeHost && !attr.devicePointer))
    return epx__set_error(EPX_ERR_INVALID_ARGUMENT,
                          "%s: %s = %p: must be GPU memory, not host memory the GPU cannot access",
                          fn, arg, p);
  /* Device memory of another GPU would be read over P2P (or fault): always a caller's mistake
   * (e.g. a tensor on cuda:1 given to rank 0's group). */
  int current = -1;
  if (attr.type == cudaMemoryTypeDevice && cudaGetDevice(&current) == cudaSuccess &&
      attr.device != current)
    return epx__set_error(EPX_ERR_INVALID_ARGUMENT,
                          "%s: %s = %p: must be memory of the current GPU (device %d), not of "
                          "device %d",
                          fn, arg, p, current, attr.device);
  return EPX_OK;
}

int epx__stream_is_capturing(cudaStream_t stream) {
  enum cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &st) != cudaSuccess) return 0;
  return st != cudaStreamCaptureStatusNone;
}

/*
 * status.c - status strings, the per-thread last-error message, and translation of CUDA and
 * NCCL failures into EPX statuses.
 */
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <stdarg.h>
#include <stdio.h>

#include "checks.h"
#include "debug.h"
#include "epx.h"

static _Thread_local char last_error[512];

static const char *const status_strings[] = {
#define EPX_STATUS_STRING_(name, value, text) [value] = text,
    EPX_STATUS_MAP(EPX_STATUS_STRING_)
#undef EPX_STATUS_STRING_
};

EPX_EXPORT const char *epx_status_string(epx_status_t status) {
  if ((int)status < 0 || (int)status >= EPX_NUM_STATUS) return "unknown status code";
  return status_strings[status];
}

EPX_EXPORT const char *epx_last_error(void) {
  return last_error;
}

EPX_EXPORT epx_status_t epx_get_version(int *version) {
  if (!version) return epx__set_error(EPX_ERR_INVALID_ARGUMENT, "epx_get_version: version is NULL");
  *version = EPX_VERSION_CODE;
  return EPX_OK;
}

EPX_EXPORT epx_status_t epx_get_nccl_version(int *built, int *loaded) {
  if (!built && !loaded)
    return epx__set_error(EPX_ERR_INVALID_ARGUMENT,
                          "epx_get_nccl_version: built and loaded are NULL");
  if (built) *built = NCCL_VERSION_CODE;
  if (loaded) {
    *loaded = 0;
    const ncclResult_t r = ncclGetVersion(loaded);
    if (r != ncclSuccess)
      return epx__set_error(EPX_ERR_NCCL, "epx_get_nccl_version: ncclGetVersion: %s",
                            ncclGetErrorString(r));
  }
  return EPX_OK;
}

epx_status_t epx__set_error(epx_status_t status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
  EPX_INFO(EPX_SUBSYS_ALL, "%s (%s)", last_error, epx_status_string(status));
  return status;
}

epx_status_t epx__cuda_status(int cuda_error, const char *expr, const char *file, int line) {
  if (cuda_error == cudaSuccess) return EPX_OK;
  EPX_WARN("%s:%d %s: %s", file, line, expr, cudaGetErrorString((cudaError_t)cuda_error));
  return epx__set_error(EPX_ERR_CUDA, "CUDA error in %s: %s", expr,
                        cudaGetErrorString((cudaError_t)cuda_error));
}

epx_status_t epx__nccl_status(int nccl_result, const char *expr, const char *file, int line) {
  if (nccl_result == ncclSuccess) return EPX_OK;
  EPX_WARN("%s:%d %s: %s", file, line, expr, ncclGetErrorString((ncclResult_t)nccl_result));
  return epx__set_error(EPX_ERR_NCCL, "NCCL error in %s: %s", expr,
                        ncclGetErrorString((ncclResult_t)nccl_result));
}

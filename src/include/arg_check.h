/*
 * arg_check.h - the argument checks every public entry shares. Each refuses with
 * EPX_ERR_INVALID_ARGUMENT and one message shape, naming the function and the argument the
 * same way everywhere:  "<function>: <argument> = <value>: <what it must be>"
 * (e.g. "epx_dispatch: args->num_tokens = 9000: must be in [0, max_tokens_per_rank = 4096]").
 * One-off conditions use EPX_ARG_CHECK (checks.h) with the same shape.
 */
#ifndef EPX_ARG_CHECK_H_
#define EPX_ARG_CHECK_H_

#include <stddef.h>

#include "epx.h"

#ifdef __cplusplus
extern "C" {
#endif
/* p != NULL. */
epx_status_t epx__check_not_null(const char *fn, const char *arg, const void *p);
/* size == expected: a struct initialized with its EPX_..._INIT macro (named by `init`). */
epx_status_t epx__check_struct_size(const char *fn, const char *arg, size_t size, size_t expected,
                                    const char *init);
/* EPX_DTYPE_INT64 or EPX_DTYPE_INT32 (top-k expert ids). */
epx_status_t epx__check_index_dtype(const char *fn, const char *arg, epx_dtype_t dtype);
/* 0 <= n <= max (the group's max_tokens_per_rank). */
epx_status_t epx__check_token_count(const char *fn, const char *arg, int n, int max);
/* 0 or 1. */
epx_status_t epx__check_flag(const char *fn, const char *arg, int value);
/* p is non-NULL, `align`-byte aligned, and memory the current GPU can access (not plain host
 * memory). */
epx_status_t epx__check_device_ptr(const char *fn, const char *arg, const void *p, size_t align);
/* 1 when stream is being captured into a CUDA graph (a failed query counts as not). */
int epx__stream_is_capturing(cudaStream_t stream);
/* Bytes of one id of an index dtype that epx__check_index_dtype accepted. */
static inline size_t epx__index_bytes(epx_dtype_t dtype) {
  return dtype == EPX_DTYPE_INT64 ? 8 : 4;
}
#ifdef __cplusplus
}
#endif

#endif /* EPX_ARG_CHECK_H_ */

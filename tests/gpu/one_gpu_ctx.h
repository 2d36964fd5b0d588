/*
 * one_gpu_ctx.h - a kernel context of one GPU with no group (no NCCL, no peers), for the tests
 * and benchmarks that launch a kernel family directly through src/kernels/api.h
 * (EPX_ONE_GPU_TEST, bench/layout/epx_layout_bench.c).
 *
 * It owns what a group would give the kernel: a workspace of one rank laid out by workspace.h
 * with no mode regions (the control region and every region common to all modes), zeroed as a
 * new group's is, and a host-mapped async-error record. Rank 0 of 1; no tracing.
 */
#ifndef EPX_TESTS_ONE_GPU_CTX_H_
#define EPX_TESTS_ONE_GPU_CTX_H_

#include "epx.h"
#include "kernel_ctx.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct one_gpu_ctx {
  epx__kernel_ctx_t ctx;           /* what the launchers take; peer_base[0] = workspace */
  char *workspace;                 /* device, ctx.layout.total_bytes */
  epx__error_record_t *error_host; /* host-mapped; ctx.error is its device alias */
} one_gpu_ctx_t;

/* Allocate and zero a context for calls of up to max_tokens tokens on the current device;
 * timeout_ms bounds each of its kernels' waits. Returns cudaSuccess, or the failing call's error
 * (everything allocated so far released). */
cudaError_t one_gpu_ctx_create(one_gpu_ctx_t *c, int max_tokens, int timeout_ms);
/* The same, with the layout region's expert-major scan columns too (the layout kernel's kExpand
 * variant, which epx_dispatch_expand runs): a normal-mode workspace of one rank with one
 * expert-major row, enough for layout calls with expand_pos. */
cudaError_t one_gpu_ctx_create_expand(one_gpu_ctx_t *c, int max_tokens, int timeout_ms);
/* Release it (synchronizes the device). NULL fields are skipped. */
void one_gpu_ctx_destroy(one_gpu_ctx_t *c);
/* The async error recorded since the last call (out->status 0: none), then rearm the record as
 * epx_group_clear_async_error does. Synchronizes the device first. */
cudaError_t one_gpu_ctx_take_error(one_gpu_ctx_t *c, epx__error_record_t *out);

#ifdef __cplusplus
}
#endif

#endif /* EPX_TESTS_ONE_GPU_CTX_H_ */

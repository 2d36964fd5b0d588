/*
 * one_gpu_ctx.c - a kernel context of one GPU with no group (one_gpu_ctx.h). The workspace is
 * laid out by the library's own epx__ws_layout_init, so every region a kernel finds through
 * ctx.layout is where the kernel expects it; only the mode regions (normal, low-latency) are
 * left out.
 */
#include "gpu/one_gpu_ctx.h"

#include <string.h>

#include "workspace.h"

static cudaError_t create(one_gpu_ctx_t *c, int max_tokens, int timeout_ms, int expand) {
  memset(c, 0, sizeof *c);
  epx__ws_layout_t l;
  /* modes = 0: no normal or low-latency region; the other sizes only shape those. With expand,
   * normal mode and one expert-major row: the layout region gets its expert columns. */
  epx__ws_layout_init(&l, 1, max_tokens, 128, EPX_MAX_EXPERTS, EPX_MAX_TOP_K, EPX_DTYPE_BF16,
                      expand ? EPX_MODE_NORMAL : 0, 1, expand ? 1 : 0);
  cudaError_t e = cudaMalloc((void **)&c->workspace, l.total_bytes);
  if (e == cudaSuccess) e = cudaMemset(c->workspace, 0, l.total_bytes);
  if (e == cudaSuccess)
    e = cudaHostAlloc((void **)&c->error_host, sizeof *c->error_host, cudaHostAllocMapped);
  if (e == cudaSuccess) {
    memset((void *)c->error_host, 0, sizeof *c->error_host);
    e = cudaHostGetDevicePointer((void **)&c->ctx.error, (void *)c->error_host, 0);
  }
  if (e == cudaSuccess) e = cudaDeviceSynchronize(); /* the memset done before any launch */
  if (e != cudaSuccess) {
    one_gpu_ctx_destroy(c);
    return e;
  }
  c->ctx.peer_base[0] = c->workspace;
  c->ctx.rank = 0;
  c->ctx.num_ranks = 1;
  c->ctx.timeout_ns = (unsigned long long)timeout_ms * 1000000ull;
  c->ctx.layout = l;
  c->ctx.trace = NULL;
  return cudaSuccess;
}

cudaError_t one_gpu_ctx_create(one_gpu_ctx_t *c, int max_tokens, int timeout_ms) {
  return create(c, max_tokens, timeout_ms, 0);
}

cudaError_t one_gpu_ctx_create_expand(one_gpu_ctx_t *c, int max_tokens, int timeout_ms) {
  return create(c, max_tokens, timeout_ms, 1);
}

void one_gpu_ctx_destroy(one_gpu_ctx_t *c) {
  (void)cudaDeviceSynchronize();
  if (c->workspace) (void)cudaFree(c->workspace);
  if (c->error_host) (void)cudaFreeHost((void *)c->error_host);
  memset(c, 0, sizeof *c);
}

cudaError_t one_gpu_ctx_take_error(one_gpu_ctx_t *c, epx__error_record_t *out) {
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) return e;
  /* NOTE: the kernel writes status last, after a system fence: read it first. */
  memset(out, 0, sizeof *out);
  out->status = c->error_host->status;
  if (out->status != 0) {
    __sync_synchronize();
    out->stage = c->error_host->stage;
    out->peer = c->error_host->peer;
    out->position = c->error_host->position;
    out->value = c->error_host->value;
  }
  /* Rearm, as epx_group_clear_async_error does: the claim word and the layout scan, then the
   * record. */
  epx__control_t *ctrl = (epx__control_t *)(c->workspace + c->ctx.layout.control_offset);
  e = cudaMemset(&ctrl->error_claim, 0, sizeof ctrl->error_claim);
  if (e == cudaSuccess)
    e = cudaMemset(c->workspace + c->ctx.layout.layout_offset, 0, c->ctx.layout.layout_bytes);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  memset((void *)c->error_host, 0, sizeof *c->error_host);
  return e;
}

/*
 * layout.c - epx_layout: argument checks, then the layout kernel (src/kernels/layout.cu).
 */
#include <stdint.h>
#include <stdio.h>

#include "checks.h"
#include "group.h"
#include "kernels/api.h"

static epx_status_t check_device_ptr(const void *p, size_t align, const char *name) {
  char what[64];
  snprintf(what, sizeof what, "epx_layout: %s", name);
  return epx__check_device_ptr(p, align, what);
}

EPX_EXPORT epx_status_t epx_layout(epx_group_t g, const epx_layout_args_t *args,
                                   cudaStream_t stream) {
  EPX_CHECK(epx__group_check(g));
  EPX_ARG_CHECK(args != NULL, "epx_layout: args is NULL");
  EPX_ARG_CHECK(args->size == sizeof(epx_layout_args_t),
                "epx_layout: args->size = %zu, expected %zu; initialize with EPX_LAYOUT_ARGS_INIT",
                args->size, sizeof(epx_layout_args_t));
  EPX_ARG_CHECK(args->topk_idx_dtype == EPX_DTYPE_INT64 || args->topk_idx_dtype == EPX_DTYPE_INT32,
                "epx_layout: args->topk_idx_dtype = %d: must be EPX_DTYPE_INT64 or EPX_DTYPE_INT32",
                (int)args->topk_idx_dtype);
  EPX_ARG_CHECK(args->num_tokens >= 0 && args->num_tokens <= g->config.max_tokens_per_rank,
                "epx_layout: args->num_tokens = %d: must be in [0, max_tokens_per_rank = %d]",
                args->num_tokens, g->config.max_tokens_per_rank);
  const size_t idx_bytes = args->topk_idx_dtype == EPX_DTYPE_INT64 ? 8 : 4;
  if (args->num_tokens > 0) {
    EPX_ARG_CHECK(args->topk_idx != NULL, "epx_layout: args->topk_idx is NULL");
    EPX_CHECK(check_device_ptr(args->topk_idx, idx_bytes, "args->topk_idx"));
    if (args->is_token_in_rank)
      EPX_CHECK(check_device_ptr(args->is_token_in_rank, 1, "args->is_token_in_rank"));
    if (args->token_pos_in_rank)
      EPX_CHECK(check_device_ptr(args->token_pos_in_rank, 4, "args->token_pos_in_rank"));
  }
  if (args->num_tokens_per_rank)
    EPX_CHECK(check_device_ptr(args->num_tokens_per_rank, 4, "args->num_tokens_per_rank"));
  if (args->num_tokens_per_expert) {
    EPX_CHECK(check_device_ptr(args->num_tokens_per_expert, 4, "args->num_tokens_per_expert"));
    /* The layout zeroes it with a memset before its blocks add their counts: keep it to memory
     * the memset is known to serve (device or managed), not mapped host memory. */
    struct cudaPointerAttributes attr;
    CUDA_CHECK(cudaPointerGetAttributes(&attr, args->num_tokens_per_expert));
    EPX_ARG_CHECK(attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged,
                  "epx_layout: args->num_tokens_per_expert = %p is host memory; pass device memory",
                  (void *)args->num_tokens_per_expert);
  }

  return epx__layout_enqueue(g, args, stream);
}

epx_status_t epx__layout_enqueue(epx_group_t g, const epx_layout_args_t *args,
                                 cudaStream_t stream) {
  epx__kernel_ctx_t ctx;
  epx__group_kernel_ctx(g, &ctx);
  epx__layout_launch_args_t la = {args->topk_idx,
                                  args->topk_idx_dtype == EPX_DTYPE_INT64,
                                  args->num_tokens,
                                  g->config.top_k,
                                  g->config.num_experts,
                                  g->num_ranks,
                                  args->num_tokens_per_rank,
                                  args->num_tokens_per_expert,
                                  args->is_token_in_rank,
                                  args->token_pos_in_rank};
  return epx__layout_launch(&ctx, &la, stream);
}

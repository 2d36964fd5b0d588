/*
 * layout.c - epx_layout: argument checks, then the layout kernel (src/kernels/layout.cu); and
 * the rank-mask variant that epx_dispatch uses with is_token_in_rank.
 */
#include <stdint.h>
#include <stdio.h>

#include "arg_check.h"
#include "checks.h"
#include "group.h"
#include "kernels/api.h"
#include "layout.h"
#include "registry.h"

EPX_EXPORT epx_status_t epx_layout(epx_group_t g, const epx_layout_args_t *args,
                                   cudaStream_t stream) {
  static const char fn[] = "epx_layout";
  EPX_CHECK(epx__group_check(g));
  EPX_CHECK(epx__check_not_null(fn, "args", args));
  EPX_CHECK(epx__check_struct_size(fn, "args", args->size, sizeof(epx_layout_args_t),
                                   "EPX_LAYOUT_ARGS_INIT"));
  EPX_CHECK(epx__check_index_dtype(fn, "args->topk_idx_dtype", args->topk_idx_dtype));
  EPX_CHECK(epx__check_token_count(fn, "args->num_tokens", args->num_tokens,
                                   g->config.max_tokens_per_rank));
  if (args->num_tokens > 0) {
    EPX_CHECK(epx__check_device_ptr(fn, "args->topk_idx", args->topk_idx,
                                    epx__index_bytes(args->topk_idx_dtype)));
    if (args->is_token_in_rank)
      EPX_CHECK(epx__check_device_ptr(fn, "args->is_token_in_rank", args->is_token_in_rank, 1));
    if (args->token_pos_in_rank)
      EPX_CHECK(epx__check_device_ptr(fn, "args->token_pos_in_rank", args->token_pos_in_rank, 4));
  }
  if (args->num_tokens_per_rank)
    EPX_CHECK(epx__check_device_ptr(fn, "args->num_tokens_per_rank", args->num_tokens_per_rank, 4));
  if (args->num_tokens_per_expert) {
    EPX_CHECK(
        epx__check_device_ptr(fn, "args->num_tokens_per_expert", args->num_tokens_per_expert, 4));
    /* The layout zeroes it with a memset before its blocks add their counts: keep it to memory
     * the memset is known to serve (device or managed), not mapped host memory. */
    struct cudaPointerAttributes attr;
    CUDA_CHECK(cudaPointerGetAttributes(&attr, args->num_tokens_per_expert));
    EPX_ARG_CHECK(attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged,
                  "%s: args->num_tokens_per_expert = %p: must be device memory, not host memory",
                  fn, (void *)args->num_tokens_per_expert);
  }

  return epx__layout_enqueue(g, args, stream);
}

/* The launch arguments of args; rank-mask routing when in_rank_mask or in_per_expert is set. */
static epx_status_t enqueue(epx_group_t g, const epx_layout_args_t *args,
                            const uint8_t *in_rank_mask, const int *in_per_expert, int *expand_pos,
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
                                  args->token_pos_in_rank,
                                  in_rank_mask || in_per_expert,
                                  in_rank_mask,
                                  in_per_expert,
                                  expand_pos};
  return epx__layout_launch(&ctx, &la, stream);
}

epx_status_t epx__layout_enqueue(epx_group_t g, const epx_layout_args_t *args,
                                 cudaStream_t stream) {
  return enqueue(g, args, NULL, NULL, NULL, stream);
}

epx_status_t epx__layout_expand_enqueue(epx_group_t g, const epx_layout_args_t *args,
                                        int *expand_pos, cudaStream_t stream) {
  return enqueue(g, args, NULL, NULL, expand_pos, stream);
}

epx_status_t epx__layout_mask_enqueue(epx_group_t g, const epx_layout_args_t *args,
                                      const uint8_t *in_rank_mask, const int *in_per_expert,
                                      cudaStream_t stream) {
  return enqueue(g, args, in_rank_mask, in_per_expert, NULL, stream);
}

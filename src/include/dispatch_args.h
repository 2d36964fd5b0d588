/*
 * dispatch_args.h - the argument checks of epx_dispatch, epx_dispatch_expand, epx_dispatch_cached
 * and epx_dispatch_cached_args (src/dispatch_args.c): payload formats (dtype, scales, strides,
 * packed UE8M0) and the routing options (ids or rank mask, worst-case rows, received index
 * dtype). Each refuses with EPX_ERR_INVALID_ARGUMENT naming the field (arg_check.h's shape).
 */
#ifndef EPX_DISPATCH_ARGS_H_
#define EPX_DISPATCH_ARGS_H_

#include "epx.h"
#include "kernels/api.h"

#ifdef __cplusplus
extern "C" {
#endif
/* The payload fields of a (x, x_dtype, x_scales, x_scales_dtype, x_scales_stride_*) for
 * num_tokens tokens; on success fills the payload fields of d (x, x_is_fp8, x_scales and the
 * scale format). prefix is put before every field name in messages ("args->" or ""). */
epx_status_t epx__dispatch_check_payload(epx_group_t g, const char *fn, const char *prefix,
                                         const epx_dispatch_args_t *a, int num_tokens,
                                         epx__dispatch_launch_args_t *d);
/* Every other field of epx_dispatch's args: token count, routing (topk_idx or is_token_in_rank
 * with num_tokens_per_expert), weights, alignment, sync_counts, num_worst_tokens,
 * recv_topk_idx_dtype. */
epx_status_t epx__dispatch_check_routing(epx_group_t g, const char *fn,
                                         const epx_dispatch_args_t *a);
/* What epx_dispatch and epx_dispatch_expand check first, in this order: the handle, args and
 * result pointers, args->size. */
epx_status_t epx__dispatch_check_call(epx_group_t g, epx_handle_t h, const char *fn,
                                      const epx_dispatch_args_t *a, const void *result);
/* Then (after epx_dispatch_expand's own refusals): routing, the payload (filling d's payload
 * fields, d zeroed first) and sync_counts on a stream being captured. */
epx_status_t epx__dispatch_check_inputs(epx_group_t g, const char *fn, const epx_dispatch_args_t *a,
                                        cudaStream_t stream, epx__dispatch_launch_args_t *d);
/* 1 when a routes by rank mask (is_token_in_rank or num_tokens_per_expert given). */
static inline int epx__dispatch_by_mask(const epx_dispatch_args_t *a) {
  return a->is_token_in_rank != NULL || a->num_tokens_per_expert != NULL;
}
#ifdef __cplusplus
}
#endif

#endif /* EPX_DISPATCH_ARGS_H_ */

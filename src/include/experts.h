/*
 * experts.h - what other modules need from experts.c: the check of a set of experts' weights
 * (the MoE layer, moe.c, checks them before it queues its dispatch).
 */
#ifndef EPX_SRC_EXPERTS_H_
#define EPX_SRC_EXPERTS_H_

#include "epx.h"
#include "kernels/api.h"

/* experts' struct, shape, weight dtype and weight pointers, and that rows of x_dtype can meet
 * them. Messages start with fn. Returns EPX_OK, EPX_ERR_INVALID_ARGUMENT or
 * EPX_ERR_UNSUPPORTED (FP8 x with BF16 weights). */
epx_status_t epx__experts_check(const char *fn, const epx_experts_t *experts, epx_dtype_t x_dtype);

/* That experts are one rank's share of a layer: num_experts = local_experts (the group's
 * num_experts / num_ranks) and hidden = the group's. EPX_ERR_INVALID_ARGUMENT naming the field. */
epx_status_t epx__experts_check_share(const char *fn, const epx_experts_t *experts,
                                      int local_experts, int hidden);

/* epx_experts_ffn (same checks, same messages); send_rows non-NULL: each row of the down
 * projection goes where send_rows says instead of args->out (epx_moe_decode's send of every
 * finished tile to its token's source; args->out must still be valid device memory). early:
 * the first kernel is launched early (kernels/launch.cuh), to start its blocks while the
 * stream's previous kernel ends; the FFN's own kernels always follow each other so. */
epx_status_t epx__experts_ffn_enqueue(const epx_experts_t *experts,
                                      const epx_experts_ffn_args_t *args,
                                      const epx__experts_scatter_t *send_rows, int early,
                                      cudaStream_t stream);

#endif /* EPX_SRC_EXPERTS_H_ */

/*
 * experts.h - what other modules need from experts.c: the check of a set of experts' weights
 * (the MoE layer, moe.c, checks them before it queues its dispatch).
 */
#ifndef EPX_SRC_EXPERTS_H_
#define EPX_SRC_EXPERTS_H_

#include "epx.h"

/* experts' struct, shape, weight dtype and weight pointers, and that rows of x_dtype can meet
 * them. Messages start with fn. Returns EPX_OK, EPX_ERR_INVALID_ARGUMENT or
 * EPX_ERR_UNSUPPORTED (FP8 x with BF16 weights). */
epx_status_t epx__experts_check(const char *fn, const epx_experts_t *experts, epx_dtype_t x_dtype);

/* That experts are one rank's share of a layer: num_experts = local_experts (the group's
 * num_experts / num_ranks) and hidden = the group's. EPX_ERR_INVALID_ARGUMENT naming the field. */
epx_status_t epx__experts_check_share(const char *fn, const epx_experts_t *experts,
                                      int local_experts, int hidden);

#endif /* EPX_SRC_EXPERTS_H_ */

/*
 * ll.h - what the MoE layer (moe.c) needs from the low-latency host side (ll.c) beyond the public
 * calls: the combine whose rows the experts' down projection already sent to their sources.
 */
#ifndef EPX_SRC_LL_H_
#define EPX_SRC_LL_H_

#include "epx.h"
#include "kernels/api.h"

/* The group's low-latency combine without combine-time weights is DIRECT (one row per
 * (token, expert) back to the source): route DISPATCH_BY_RANK or DIRECT. Route BY_RANK sums on
 * the expert side first, so its rows cannot leave as each expert finishes. */
int epx__ll_combine_is_direct(epx_group_t g);

/* Where the DIRECT combine of dispatch d would copy each received row: every rank's combine
 * receive rows of d's buffer, d's src_info, the peer mask. */
void epx__ll_send_targets(epx_group_t g, const epx_ll_dispatch_result_t *d,
                          epx__experts_scatter_t *targets);

/* epx_ll_combine; rows_sent = 1: the rows are already at epx__ll_send_targets (DIRECT route,
 * unsplit, no combine-time weights, else EPX_ERR_INTERNAL), the kernel only signals and sums.
 * early = 1: its kernel is launched early (kernels/launch.cuh): its blocks may be placed while
 * the stream's previous kernel ends; they wait for that end before anything else.
 * rows_invalid = 1: this rank's rows are not valid (epx_moe_decode's FFN failed): the combine
 * still runs, and its signals tell the peers to leave them out (EPX_ERR_PEER_DATA there). */
epx_status_t epx__ll_combine_enqueue(epx_group_t g, const epx_ll_combine_args_t *args,
                                     int rows_sent, int early, int rows_invalid,
                                     cudaStream_t stream);

#endif /* EPX_SRC_LL_H_ */

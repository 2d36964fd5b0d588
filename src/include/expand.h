/*
 * expand.h - epx_dispatch_expand in two halves (src/expand.c), for the prefill layer
 * (src/moe_prefill.c), which queues the next chunk's dispatch before it waits for this chunk's
 * counts: epx_dispatch_expand is epx__dispatch_expand_enqueue, then
 * epx__dispatch_expand_finish on the same group and handle, with no other dispatch on that
 * handle between them (the counts arrive in the handle's host-mapped buffer). And
 * epx_combine_expand of blocked expert outputs (the layer's batched GEMM).
 */
#ifndef EPX_EXPAND_H_
#define EPX_EXPAND_H_

#include <stdint.h>

#include "epx.h"
#include "kernels/api.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What the first half leaves for the second. */
typedef struct {
  epx__dispatch_launch_args_t d; /* the payload's format, for the result's scale pointers */
  int sync_counts;
  int *num_recv_per_expert; /* args->num_recv_per_expert (host), filled by the second half */
} epx__expand_pending_t;

/* Checks every argument (epx_dispatch_expand's refusals, by name; out: the result the second
 * half will fill, checked here, and filled here only by the refusal of too many tokens, which
 * still queues a refused count exchange: handle.h) and queues the layout, notify, dispatch and
 * fan-out on stream;
 * no host wait. local_blocks: the blocks of the fan-out, a local HBM pass (0: two per SM of the
 * GPU, for a dispatch alone on the GPU; the prefill layer passes its communication's share when
 * GEMMs run beside it, so the fan-out does not hold every SM while they wait to start).
 * fan_out: 0 the group's config.expand_fan_out; EPX_EXPAND_FAN_OUT_AFTER or _DURING this call's,
 * one group creation resolved (its alone_fan_out: DURING only where 2 x num_sms blocks fit the
 * GPU). Every rank must pass the same. */
epx_status_t epx__dispatch_expand_enqueue(epx_group_t g, epx_handle_t h,
                                          const epx_dispatch_args_t *a,
                                          epx_dispatch_expand_result_t *out, cudaStream_t stream,
                                          int local_blocks, int fan_out,
                                          epx__expand_pending_t *pending);
/* With sync_counts: waits for this dispatch's count exchange (bounded by the notify's budget,
 * EPX_ERR_TIMEOUT when it ran out) and fills num_recv_per_expert; then fills *out and refuses
 * a row count past the capacity, as epx_dispatch_expand does. */
epx_status_t epx__dispatch_expand_finish(epx_group_t g, epx_handle_t h,
                                         const epx__expand_pending_t *pending,
                                         epx_dispatch_expand_result_t *out);

/* DURING's fan-out blocks beside num_sms sending blocks, at most the SMs those leave:
 * `want` (EPX_EXPAND_FAN_OUT_BLOCKS) when it is 1 or more, else a default that grows with the
 * copies a received token needs (src/expand.c says how it was fitted). Pure; host-tested. */
int epx__expand_fan_out_blocks(int device_sms, int num_sms, int num_ranks, int top_k, int64_t want);
/* Where the prefill layer's dispatch with nothing beside it fans out: `asked`
 * (EPX_MOE_ALONE_FAN_OUT) when it is EPX_EXPAND_FAN_OUT_AFTER or _DURING, else config_fan_out (the
 * group's resolved config.expand_fan_out); DURING only where its 2 x num_sms blocks fit
 * device_sms, else AFTER. Group creation compares the result across ranks. Pure; host-tested. */
int epx__expand_alone_fan_out(int64_t asked, int config_fan_out, int num_sms, int device_sms);
/* DURING's tokens per publish (EPX_EXPAND_PUBLISH_BATCH) clamped to 1..32. Pure; host-tested. */
int epx__expand_publish_batch(int64_t want);

/* epx_combine_expand of expert outputs left blocked by the prefill layer's batched GEMM:
 * block_rows > 0: local expert j's output rows at [j * block_rows, j * block_rows + count[j])
 * of args->x (api.h's epx__expand_reduce_launch_args_t); 0: as epx_combine_expand.
 * local_blocks: the blocks of the expert-side reduce, as epx__dispatch_expand_enqueue's.
 * rows_invalid: 1 where the expert outputs are not valid (the FFN failed here): the combine
 * still runs (the peers wait for it) and its rows go marked, so that the peers leave them out
 * and record EPX_ERR_PEER_DATA; also set when the expert-side reduce cannot be queued.
 * combine_blocks: the combine kernel's blocks (0: the group's num_sms). */
epx_status_t epx__combine_expand_blocked(epx_group_t g, epx_handle_t h,
                                         const epx_combine_expand_args_t *a, int block_rows,
                                         int local_blocks, int rows_invalid, int combine_blocks,
                                         cudaStream_t stream);

/* The prefill layer's phases by source (docs/moe.md, "Phases by source"): the combine, gated by
 * gate[R] (api.h's epx__combine_launch_args_t: source s's partial rows are sent, or for this rank
 * summed, once gate[s] carries gate_value), queued on one stream while the phases' reduces
 * (epx__expand_reduce_source) and gate writes run on another. args->weighted is not read here:
 * the reduces weigh the rows. num_blocks: the combine kernel's blocks (0: the group's num_sms). */
epx_status_t epx__combine_expand_gated(epx_group_t g, epx_handle_t h,
                                       const epx_combine_expand_args_t *a, const unsigned *gate,
                                       unsigned gate_value, int num_blocks, cudaStream_t stream);
/* As epx__combine_expand_gated, for rows already copied into every remote source's combine slab
 * of parity `parity` (epx__combine_copy_rows, ordered before this on `stream`; 2: not known, no
 * row copied): the combine only signals them and sums this rank's tokens (api.h's rows_sent).
 * rows_invalid: every row of this rank goes marked. */
epx_status_t epx__combine_expand_sent(epx_group_t g, epx_handle_t h,
                                      const epx_combine_expand_args_t *a, const unsigned *gate,
                                      unsigned gate_value, unsigned parity, int rows_invalid,
                                      int num_blocks, cudaStream_t stream);
/* The partial rows of the `rows` tokens received from rank `source` (the expert-side reduce's
 * output, from row `first` of the combine input) copied by the copy engines into source's
 * combine slab of parity `parity`, where its combine reads this rank's rows. The caller orders
 * it after that reduce, and after source finished the combine that last used the parity (the
 * prefill layer: epx__combine_slab_free_launch on its communication stream). */
epx_status_t epx__combine_copy_rows(epx_group_t g, int source, int first, int rows, unsigned parity,
                                    cudaStream_t stream);
/* The expert-side reduce of the tokens received from rank `source` into their partial rows
 * (expand_combine.cu): y row r is expanded row r, or with parts (device [E + 1], the layer's
 * parts of the L = E / R segments by source) y row part_out[q] + r - parts[q] for r in part q. */
epx_status_t epx__expand_reduce_source(epx_group_t g, epx_handle_t h, const void *y, int weighted,
                                       int source, const int *parts, const int *part_out,
                                       int local_blocks, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* EPX_EXPAND_H_ */

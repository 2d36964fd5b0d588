/*
 * ll_state.h - host-side bookkeeping of low-latency calls (src/ll.c), kept in the group.
 *
 * Every rank makes the same collective calls, so these evolve identically on every rank; a
 * captured graph replays its calls with the buffers chosen at capture time.
 */
#ifndef EPX_LL_STATE_H_
#define EPX_LL_STATE_H_

typedef struct epx__ll_host {
  unsigned long long seq;            /* low-latency calls issued; call ids are seq values */
  int next_parity;                   /* buffer of the next dispatch */
  unsigned long long dispatch_id[2]; /* call id of the latest dispatch on each buffer */
  int dispatch_tokens[2];            /* its num_tokens */
  int dispatch_fp8[2];               /* its receive dtype is FP8 */
  void *combine_out[2];              /* out of a split combine, for its epx_ll_recv */
  unsigned long long pending[2][2];  /* [0 dispatch, 1 combine][buffer]: hook id of a split call
                                        awaiting epx_ll_recv, or 0 */
  int dispatch_packed[2];            /* its layout is packed (args->packed) */
  int dispatch_pack_scales[2];       /* its scales come out as UE8M0 words (args->ue8m0_packed) */
  long long *layout_range[2];        /* its args->layout_range, for a split receive */
  const float *combine_weights[2];   /* combine-time topk_weights of a split combine (or NULL),
                                        for its epx_ll_recv */
} epx__ll_host_t;

#endif /* EPX_LL_STATE_H_ */

/*
 * workspace.h - the one layout of EPX's symmetric workspace, shared by host and device.
 *
 * Every rank allocates the same number of bytes and registers them as one NCCL symmetric window;
 * a peer's region X lives at peer_base[p] + layout.X_offset. The host uses this code for sizing
 * (epx_workspace_size) and kernels use it for pointers, so the two can never disagree.
 * Invariant: every region starts on a 4096-byte boundary and the total is a multiple of 4096.
 *
 *   control  epx__control_t: barrier inboxes and epochs, the async-error claim word
 *   notify   count exchange: R sources x (R + E/R) epoch-tagged 64-bit words (sized R x (R + E))
 *   normal   (EPX_MODE_NORMAL) receive slab of R x max_tokens rows, one array per field, the
 *            combine slab 2 x [R, max_tokens, H] BF16 and its per-chunk arrival counters
 *   ll       (EPX_MODE_LOW_LATENCY) 2 parity buffers x (dispatch receive + combine receive +
 * signals)
 */
#ifndef EPX_WORKSPACE_H_
#define EPX_WORKSPACE_H_

#include <stddef.h>
#include <stdint.h>

#include "epx.h"

#ifdef __CUDACC__
#define EPX_HD static inline __host__ __device__
#else
#define EPX_HD static inline
#endif

#define EPX_WS_ALIGN 4096

/* The control region. Peers write the inboxes; the other words are the owner's alone. */
typedef struct epx__control {
  /* barrier_inbox[p]: the last barrier epoch rank p announced to this rank (written by p). */
  unsigned long long barrier_inbox[EPX_MAX_RANKS];
  /* barrier_epoch: how many barriers this rank has entered; advanced by the barrier kernel so a
   * captured graph replays correctly without the host. */
  unsigned long long barrier_epoch;
  /* error_claim: 0 until the first kernel that raises an async error claims the record. */
  int error_claim;
  /* notify_epoch: normal-mode count exchanges started by this rank (tags its notify words). */
  unsigned int notify_epoch;
  /* combine_blocks_done: blocks of the running combine that finished; the last one resets it. */
  unsigned int combine_blocks_done;
  /* combine_calls: combines completed by this rank (selects the combine slab parity). */
  unsigned int combine_calls;
  int reserved[28];
  /* dispatch_done[s]: blocks of rank s that finished writing to this rank (added by s with
   * release semantics; monotonic). dispatch_expected[s]: what this rank has consumed. */
  unsigned long long dispatch_done[EPX_MAX_RANKS];
  unsigned long long dispatch_expected[EPX_MAX_RANKS];
  /* combine_finished[s]: combines rank s has completed (stored by s with release semantics).
   * Rank d writes call n into s's slab parity n & 1 only once s has finished call n - 2. */
  unsigned long long combine_finished[EPX_MAX_RANKS];
} epx__control_t;

/* Combine signals: rank d adds, with release semantics, the number of rows it has delivered to
 * each chunk of EPX_COMBINE_CHUNK_ROWS consecutive rows of its segment in this rank's combine
 * slab. The owner reduces a token once the chunks holding its rows are full. */
#define EPX_COMBINE_CHUNK_ROWS 64

typedef struct epx__ws_layout {
  size_t control_offset, control_bytes;
  size_t notify_offset, notify_bytes;
  /* normal: sub-arrays of the receive slab (capacity = R x max_tokens rows) and the combine slab */
  size_t normal_offset, normal_bytes;
  size_t recv_capacity;            /* rows: R x max_tokens */
  size_t recv_x_offset;            /* [capacity, H] payload (BF16: 2 bytes/element, FP8: 1) */
  size_t recv_scales_offset;       /* [capacity, H/128] float32 (FP8) */
  size_t recv_topk_idx_offset;     /* [capacity, K] int32 local expert ids, -1 elsewhere */
  size_t recv_topk_weights_offset; /* [capacity, K] float32 */
  size_t recv_src_token_offset;    /* [capacity] int32 source token index */
  size_t combine_slab_offset;      /* 2 parities x [R, max_tokens, H] BF16: row (d, p) = rank d's
                                      output for the p-th token this rank sent to d */
  size_t combine_slab_bytes;       /* one parity */
  size_t combine_signal_offset;    /* 2 parities x [R, combine_chunks] uint64 row counters */
  size_t combine_chunks; /* chunks per source segment: max_tokens / CHUNK_ROWS, rounded up */
  size_t ll_offset, ll_bytes;
  size_t ll_msg_bytes; /* one (token, expert) row of low-latency dispatch */
  size_t total_bytes;
} epx__ws_layout_t;

/* Counts of one normal dispatch, kept in its handle (device memory), written by notify. */
typedef struct epx__recv_meta {
  int num_recv;                            /* rows received */
  int rank_prefix[EPX_MAX_RANKS + 1];      /* rows from sources < s start at rank_prefix[s] */
  int count[EPX_MAX_RANKS][EPX_MAX_RANKS]; /* count[s][r]: tokens rank s sends to rank r */
  int per_expert[EPX_MAX_EXPERTS];         /* rows per local expert (aligned if asked) */
} epx__recv_meta_t;

EPX_HD size_t epx__align_up(size_t x, size_t a) {
  return (x + a - 1) / a * a;
}

/* Bytes per element of the widest payload the group supports. */
EPX_HD size_t epx__payload_elem_bytes(unsigned dtypes) {
  return (dtypes & EPX_DTYPE_BF16) ? 2 : 1;
}

/* One low-latency row: a 16-byte header (source token, source rank), the payload, the scales. */
EPX_HD size_t epx__ll_msg_bytes(int hidden, unsigned dtypes) {
  size_t payload = (size_t)hidden * 2;
  (void)dtypes; /* BF16 is the widest; FP8 rows fit in the same slot */
  return epx__align_up(16 + payload, 16);
}

/* Fill *l for a resolved config (auto fields already filled in) and R ranks. */
EPX_HD void epx__ws_layout_init(epx__ws_layout_t *l, int num_ranks, int max_tokens, int hidden,
                                int num_experts, int top_k, unsigned dtypes, unsigned modes) {
  size_t off = 0;
  l->control_offset = off;
  l->control_bytes = epx__align_up(sizeof(epx__control_t), EPX_WS_ALIGN);
  off += l->control_bytes;

  /* notify: per source rank, R per-rank counts + E/R per-expert counts, as 64-bit words that
   * carry the call's epoch in the high half (so no separate flag and no zeroing). */
  l->notify_offset = off;
  l->notify_bytes =
      epx__align_up((size_t)num_ranks * (size_t)(num_ranks + num_experts) * 8, EPX_WS_ALIGN);
  off += l->notify_bytes;

  /* normal: a compact receive slab of R x max_tokens rows (the worst case: every source sends
   * every token), split into one array per field so recv_x is a plain [rows, H] matrix; then
   * the combine slab, separate so that a peer's combine never overwrites a dispatch output. */
  const size_t cap = (size_t)num_ranks * max_tokens;
  l->recv_capacity = cap;
  l->normal_offset = off;
  size_t n = 0;
  l->recv_x_offset = n;
  n += epx__align_up(cap * hidden * epx__payload_elem_bytes(dtypes), 256);
  l->recv_scales_offset = n;
  if (dtypes & EPX_DTYPE_FP8_E4M3) n += epx__align_up(cap * (hidden / 128) * 4, 256);
  l->recv_topk_idx_offset = n;
  n += epx__align_up(cap * top_k * 4, 256);
  l->recv_topk_weights_offset = n;
  n += epx__align_up(cap * top_k * 4, 256);
  l->recv_src_token_offset = n;
  n += epx__align_up(cap * 4, 256);
  /* Two parities: consecutive combines alternate, so a peer's next combine never overwrites
   * rows this rank is still reducing. */
  l->combine_slab_offset = n;
  l->combine_slab_bytes = epx__align_up(cap * hidden * 2, 256);
  n += 2 * l->combine_slab_bytes;
  l->combine_chunks = (max_tokens + EPX_COMBINE_CHUNK_ROWS - 1) / EPX_COMBINE_CHUNK_ROWS;
  l->combine_signal_offset = n;
  n += epx__align_up(2 * (size_t)num_ranks * l->combine_chunks * 8, 256);
  l->normal_bytes = (modes & EPX_MODE_NORMAL) ? epx__align_up(n, EPX_WS_ALIGN) : 0;
  off += l->normal_bytes;

  /* ll: 2 parities x (E x max_tokens dispatch rows + max_tokens x top_k combine rows of BF16 +
   * one int64 signal per (expert, source)) */
  l->ll_msg_bytes = epx__ll_msg_bytes(hidden, dtypes);
  l->ll_offset = off;
  l->ll_bytes = 0;
  if (modes & EPX_MODE_LOW_LATENCY) {
    size_t per_parity = (size_t)num_experts * max_tokens * l->ll_msg_bytes +
                        (size_t)max_tokens * top_k * hidden * 2 + (size_t)num_experts * 8;
    l->ll_bytes = epx__align_up(2 * per_parity, EPX_WS_ALIGN);
  }
  off += l->ll_bytes;
  l->total_bytes = off;
}

#endif /* EPX_WORKSPACE_H_ */

/*
 * workspace.h - the one layout of EPX's symmetric workspace, shared by host and device.
 *
 * Every rank allocates the same number of bytes and registers them as one NCCL symmetric window;
 * a peer's region X lives at peer_base[p] + layout.X_offset. The host uses this code for sizing
 * (epx_workspace_size) and kernels use it for pointers, so the two can never disagree.
 * Invariant: every region starts on a 4096-byte boundary and the total is a multiple of 4096.
 *
 *   control  epx__control_t: barrier inboxes and epochs, the async-error claim word
 *   notify   count exchange: 2 parity buffers x R sources x (R + E) int32
 *   normal   (EPX_MODE_NORMAL) receive slab: R sources x max_tokens x normal message bytes
 *   ll       (EPX_MODE_LOW_LATENCY) 2 parity buffers x (dispatch receive + combine receive + signals)
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
  int reserved[31];
} epx__control_t;

typedef struct epx__ws_layout {
  size_t control_offset, control_bytes;
  size_t notify_offset, notify_bytes;
  size_t normal_offset, normal_bytes;
  size_t normal_msg_bytes; /* one token in the normal slab: payload + scales + topk ids/weights */
  size_t ll_offset, ll_bytes;
  size_t ll_msg_bytes; /* one (token, expert) row of low-latency dispatch */
  size_t total_bytes;
} epx__ws_layout_t;

EPX_HD size_t epx__align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

/* Bytes of one token in a normal-mode message: the widest payload the group supports (BF16 is
 * 2 bytes per element; FP8 is 1 plus one float32 scale per 128 elements), then top-k local
 * expert ids (int32) and weights (float32), rounded to 16 bytes for vector copies. */
EPX_HD size_t epx__normal_msg_bytes(int hidden, int top_k, unsigned dtypes) {
  size_t payload = 0;
  if (dtypes & EPX_DTYPE_BF16) payload = (size_t)hidden * 2;
  if (dtypes & EPX_DTYPE_FP8_E4M3) {
    size_t fp8 = (size_t)hidden + (size_t)(hidden / 128) * 4;
    if (fp8 > payload) payload = fp8;
  }
  return epx__align_up(payload + (size_t)top_k * 8, 16);
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

  /* notify: 2 parities x R sources x (R per-rank counts + E per-expert counts) int32 */
  l->notify_offset = off;
  l->notify_bytes =
      epx__align_up((size_t)2 * num_ranks * (size_t)(num_ranks + num_experts) * 4, EPX_WS_ALIGN);
  off += l->notify_bytes;

  /* normal: R sources x max_tokens x msg, the worst case of every source sending every token */
  l->normal_msg_bytes = epx__normal_msg_bytes(hidden, top_k, dtypes);
  l->normal_offset = off;
  l->normal_bytes = 0;
  if (modes & EPX_MODE_NORMAL)
    l->normal_bytes = epx__align_up((size_t)num_ranks * max_tokens * l->normal_msg_bytes, EPX_WS_ALIGN);
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

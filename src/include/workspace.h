/*
 * workspace.h - the one layout of EPX's symmetric workspace, shared by host and device.
 *
 * Every rank allocates the same number of bytes and registers them as one NCCL symmetric window;
 * a peer's region X lives at peer_base[p] + layout.X_offset. The host uses this code for sizing
 * (epx_workspace_size) and kernels use it for pointers, so the two can never disagree.
 * Invariant: every region starts on a 4096-byte boundary and the total is a multiple of 4096.
 *
 *   control  epx__control_t: barrier and agreement inboxes and epochs, the async-error claim
 *            word
 *   notify   count exchange: R sources x (R + E/R) epoch-tagged 64-bit words (sized R x (R + E))
 *   layout   the layout kernel's tile scan, this rank's own (no peer reads it): the ticket word
 *            (epoch << 24 | next tile), then [EPX_MAX_RANKS + 1][layout_tiles] epoch-tagged
 *            64-bit tile words, layout_tiles = ceil(max_tokens / EPX_LAYOUT_TILE_TOKENS); word
 *            formats in src/kernels/layout.cu. Zeroed at creation and by
 *            epx_group_clear_async_error; otherwise never reset (the epochs make stale words
 *            unreadable). With config.expand_max_rows, then [E][layout_tiles] words more: the
 *            per-expert columns of the expert-major positions (same word format)
 *   normal   (EPX_MODE_NORMAL) receive slab of R x max_tokens rows, one array per field, the
 *            combine slab 2 x [R, max_tokens, H] BF16 and its per-chunk arrival counters, then
 *            the combine weights 2 x [R, max_tokens, K] float32 (each returned row's top-k
 *            weights, when a combine asks for them; same parity and chunk counters as the slab);
 *            with config.expand_max_rows = X, the expert-major receive arrays: x [X, H],
 *            scales [X, H/128] (FP8 groups), src_info [X] int4, weights [X] float32, and
 *            token_rows [R x max_tokens, K] int32, the fan-out's ready words and the
 *            per-expert arrival words (epx_dispatch_expand)
 *   ll       (EPX_MODE_LOW_LATENCY) 2 buffers ("parities") of the arrays below, then the
 *            per-block epochs. Per parity, with L = E/R, M = ll_max_tokens, RM = R x M:
 *              x           [L, RM, H] payload (2 bytes/element if BF16 is supported, else 1)
 *              scales      [L, RM, H/128] float32 (FP8 groups only)
 *              src_info    [L, RM] int4: source rank, token, slot, 0
 *              cnt         [L, R] int: rows of (local expert, source), written by the source
 *              recv_count  [L], recv_begin [L, R], recv_num [L, R] int: this rank's outputs
 *              stage       [R, M] rows of (EPX_LL_HEADER_BYTES header, payload, scales):
 *                          BY_RANK dispatch (routes BY_RANK and DISPATCH_BY_RANK); combine
 *                          reads the headers
 *              combine_in  [L, RM, H] BF16: the zero-copy combine input
 *              combine_recv max(2K, 4R) x M x H bytes: rows returned to this rank, DIRECT
 *                          combine [M, K, H] BF16, BY_RANK combine [R, M, H] float32
 *              my_ids, my_w [M, K] int32 / float32: this rank's routing, kept for combine
 *              dflag, cflag [R, EPX_LL_MAX_BLOCKS] u64: dispatch / combine signals, written by
 *                          block b of source s at [s][b]: (epoch << 32) | low word
 *            epochs [2 kinds][2 parities][EPX_LL_MAX_BLOCKS] u32, each advanced by its block
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

/* Words one rank contributes to an agreement of a live group (the trace dump's header is the
 * largest: 4 + 2 x EPX_TRACE_SYNC_ROUNDS). */
#define EPX_AGREE_MAX_WORDS 24

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
  /* ll_peer_mask: bit p set once this rank gave up on peer p in a low-latency call (set by the
   * waiting kernel with atomicOr; cleared by epx_group_clear_peer_mask). */
  unsigned int ll_peer_mask;
  /* combine_next_unit: the running combine's next send unit (dynamic sends); reset by its last
   * block. */
  unsigned int combine_next_unit;
  /* combine_abort: n + 1 once a wait of combine call n timed out, so that the call's other waits
   * give up at once (an older, unrelated async error must not make them stop waiting). */
  unsigned int combine_abort;
  /* notify_abort[s]: the last notify epoch in which rank s gave up its count exchange (written
   * by s into every peer; 0 = never). Rank s then sends no rows in that call, so a rank whose
   * own exchange of that epoch completed (it was late, or s gave up just before its counts
   * landed) must fail the call too instead of returning rows placed with counts s never had. */
  unsigned int notify_abort[EPX_MAX_RANKS];
  int reserved[17];
  /* dispatch_done[s]: blocks of rank s that finished writing to this rank (added by s with
   * release semantics; monotonic). dispatch_expected[s]: what this rank has consumed. */
  unsigned long long dispatch_done[EPX_MAX_RANKS];
  unsigned long long dispatch_expected[EPX_MAX_RANKS];
  /* combine_finished[s]: combines rank s has completed (stored by s with release semantics).
   * Rank d writes call n into s's slab parity n & 1 only once s has finished call n - 2. */
  unsigned long long combine_finished[EPX_MAX_RANKS];
  /* The bounded agreement of a live group (kernels/agree.cu, agree.h), by epoch parity (rank
   * p can start agreement e + 1 before this rank has read e, never e + 2): agree_flag[e & 1][p]
   * is 2e once p's words of agreement e are in agree_words[e & 1][p], 2e + 1 once p gave e up
   * (both written by p); agree_epoch: this rank's agreements so far (the owner's, advanced by
   * the kernel). */
  unsigned long long agree_flag[2][EPX_MAX_RANKS];
  unsigned long long agree_epoch;
  /* expand_ticket: blocks of DURING expand dispatches started on this rank (each takes one on
   * entry; ticket mod the grid size is its role, so the first blocks to run are the senders). */
  unsigned long long expand_ticket;
  long long agree_words[2][EPX_MAX_RANKS][EPX_AGREE_MAX_WORDS];
  /* The barrier over the unmasked ranks (epx_group_barrier_unmasked) counts apart from the
   * ordinary one: a masked rank that is alive misses these, and with shared counts its later
   * ordinary barriers would pass at once on the epochs the others announced here.
   * epx_group_clear_peer_mask moves every rank's unmasked_barrier_epoch to the largest. */
  unsigned long long unmasked_barrier_inbox[EPX_MAX_RANKS];
  unsigned long long unmasked_barrier_epoch;
} epx__control_t;

#ifdef __cplusplus
static_assert(sizeof(epx__control_t) <= EPX_WS_ALIGN, "the control region stays one page");
#else
_Static_assert(sizeof(epx__control_t) <= EPX_WS_ALIGN, "the control region stays one page");
#endif

/* Tokens of one tile of the layout kernel (its block size): the layout region holds one scan
 * word per tile and column. */
#define EPX_LAYOUT_TILE_TOKENS 512

/* Combine signals: rank d adds, with release semantics, the number of rows it has delivered to
 * each chunk of EPX_COMBINE_CHUNK_ROWS consecutive rows of its segment in this rank's combine
 * slab. The owner reduces a token once the chunks holding its rows are full. */
#define EPX_COMBINE_CHUNK_ROWS 64

typedef struct epx__ws_layout {
  size_t control_offset, control_bytes;
  size_t notify_offset, notify_bytes;
  size_t layout_offset, layout_bytes;
  size_t layout_tiles;        /* tiles of the largest call: ceil(max_tokens / TILE_TOKENS) */
  size_t layout_words_offset; /* relative to layout_offset: [EPX_MAX_RANKS + 1][layout_tiles] */
  /* normal: sub-arrays of the receive slab (capacity = R x max_tokens rows) and the combine slab */
  size_t normal_offset, normal_bytes;
  size_t recv_capacity;            /* rows: R x max_tokens */
  size_t recv_x_offset;            /* [capacity, H] payload (BF16: 2 bytes/element, FP8: 1) */
  size_t recv_scales_offset;       /* [capacity, H/128] float32 (FP8) */
  size_t recv_topk_idx_offset;     /* [capacity, K] local expert ids, -1 elsewhere: int32, or
                                      int64 (recv_topk_idx_dtype), so sized at 8 bytes each */
  size_t recv_topk_weights_offset; /* [capacity, K] float32 */
  size_t recv_src_token_offset;    /* [capacity] int32 source token index */
  size_t combine_slab_offset;      /* 2 parities x [R, max_tokens, H] BF16: row (d, p) = rank d's
                                      output for the p-th token this rank sent to d */
  size_t combine_slab_bytes;       /* one parity */
  size_t combine_signal_offset;    /* 2 parities x [R, combine_chunks] uint64 row counters */
  size_t combine_chunks; /* chunks per source segment: max_tokens / CHUNK_ROWS, rounded up */
  /* ll: two parities of ll_parity_bytes from ll_offset, then the epochs. Offsets of the
   * arrays are relative to the start of a parity (see the header comment). */
  size_t ll_offset, ll_bytes;
  size_t ll_parity_bytes;
  size_t ll_rows;       /* rows per local expert: R x ll_max_tokens */
  size_t ll_elem_bytes; /* bytes per element of x and stage payloads: 2 (BF16 supported) or 1 */
  size_t ll_x_offset, ll_scales_offset, ll_src_info_offset, ll_cnt_offset;
  size_t ll_recv_count_offset, ll_recv_begin_offset, ll_recv_num_offset;
  size_t ll_stage_offset, ll_stage_row_bytes;
  size_t ll_combine_in_offset, ll_combine_recv_offset;
  size_t ll_my_ids_offset, ll_my_w_offset;
  size_t ll_dflag_offset, ll_cflag_offset;
  size_t ll_epoch_offset; /* relative to ll_offset */
  size_t total_bytes;
  size_t combine_weights_offset; /* 2 parities x [R, max_tokens, K] float32: row (d, p) = the
                                    top-k weights of the slab's row (d, p) */
  size_t combine_weights_bytes;  /* one parity: R x max_tokens x K x 4, rounded up to 256 */
  /* Expert-major layout (config.expand_max_rows > 0; else expand_rows = 0 and the offsets are
   * unused). Offsets relative to normal_offset, except expand_words_offset (to layout_offset). */
  size_t expand_rows;              /* config.expand_max_rows */
  size_t expand_x_offset;          /* [expand_rows, H] payload */
  size_t expand_scales_offset;     /* [expand_rows, H/128] float32 (FP8) */
  size_t expand_src_info_offset;   /* [expand_rows] int4: rank, token, slot, 0 */
  size_t expand_weights_offset;    /* [expand_rows] float32 */
  size_t expand_token_rows_offset; /* [R x max_tokens, K] int32 */
  size_t expand_ready_offset;      /* [R x max_tokens + 1] uint32 (EPX_EXPAND_FAN_OUT_DURING):
                                      word i, the notify epoch of the last call whose sender
                                      finished plain row i's token here; the last word, the
                                      epoch of a call whose fan-out or whose wait for the
                                      sources gave up */
  size_t expand_words_offset;      /* [E][layout_tiles] scan words, in the layout region */
  size_t expand_arrival_offset;    /* [2][L] uint32, this rank's own (no peer touches them):
                                      arrived[j], rows of local expert j complete in this call,
                                      then ready[j], 1 once they all are (epx_dispatch_expand_
                                      result_t.expert_ready); both reset by notify's expand
                                      variant (src/kernels/expand_arrival.cuh) */
} epx__ws_layout_t;

/* Counts of one normal dispatch, kept in its handle (device memory), written by notify. */
typedef struct epx__recv_meta {
  int num_recv;                            /* rows received */
  int rank_prefix[EPX_MAX_RANKS + 1];      /* rows from sources < s start at rank_prefix[s] */
  int count[EPX_MAX_RANKS][EPX_MAX_RANKS]; /* count[s][r]: tokens rank s sends to rank r */
  int per_expert[EPX_MAX_EXPERTS];         /* rows per local expert (aligned if asked) */
  /* rank_prefix_matrix[i * R + j]: tokens ranks 0..i send to rank j (inclusive over sources) */
  int rank_prefix_matrix[EPX_MAX_RANKS * EPX_MAX_RANKS];
  unsigned int epoch; /* the notify epoch of the dispatch that filled this meta */
  int aborted;        /* 1: that count exchange failed: the dispatch sends nothing, waits for
                         nothing, and the counts above are 0 */
  /* Expert-major dispatch only (notify's expand variant; 0 otherwise, and 0 when aborted). */
  int expand_rows;                       /* this rank's begin[L]: rows, padding included */
  int expand_begin[EPX_MAX_EXPERTS + 1]; /* [L + 1] this rank's segment begins */
  int expand_count[EPX_MAX_EXPERTS];     /* [L] this rank's real rows per local expert */
  int expand_base[EPX_MAX_EXPERTS];      /* [E] row on rank e / L where this rank's rows for
                                            expert e start: begin + rows of earlier sources */
} epx__recv_meta_t;

EPX_HD size_t epx__align_up(size_t x, size_t a) {
  return (x + a - 1) / a * a;
}

/* Bytes per element of the widest payload the group supports. */
EPX_HD size_t epx__payload_elem_bytes(unsigned dtypes) {
  return (dtypes & EPX_DTYPE_BF16) ? 2 : 1;
}

/* Low-latency limits: blocks of one low-latency kernel (signals are sized for this many), the
 * bytes of a staged row's header (epoch, token, entries, 0, then a packed word and a weight per
 * top-k slot: StagedHeader in src/kernels/ll_common.cuh, 144 at top-16), and the shared memory of
 * the per-expert token bitmaps that a low-latency dispatch builds (E x ceil(max_tokens / 32)
 * words). */
#define EPX_LL_MAX_BLOCKS 1024
#define EPX_LL_HEADER_BYTES (16 + 8 * EPX_MAX_TOP_K)
#define EPX_LL_MAX_BITMAP_BYTES (160 * 1024)

EPX_HD size_t epx__ll_bitmap_bytes(int num_experts, int num_tokens) {
  return (size_t)num_experts * (size_t)((num_tokens + 31) / 32) * 4;
}

/* Bytes of one staged row: header, payload (widest supported dtype), FP8 scales if supported. */
EPX_HD size_t epx__ll_stage_row_bytes(int hidden, unsigned dtypes) {
  size_t n = EPX_LL_HEADER_BYTES + (size_t)hidden * epx__payload_elem_bytes(dtypes);
  if (dtypes & EPX_DTYPE_FP8_E4M3) n += (size_t)(hidden / 128) * 4;
  return epx__align_up(n, 16);
}

/* Fill *l for a resolved config (auto fields already filled in) and R ranks: max_tokens sizes
 * the normal region, ll_max_tokens the low-latency one. */
EPX_HD void epx__ws_layout_init(epx__ws_layout_t *l, int num_ranks, int max_tokens, int hidden,
                                int num_experts, int top_k, unsigned dtypes, unsigned modes,
                                int ll_max_tokens, int expand_max_rows) {
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

  /* layout: the ticket word, then one scan word per (column, tile); columns are the R ranks'
   * counts and the lowest invalid position (src/kernels/layout.cu). */
  l->layout_offset = off;
  l->layout_tiles = ((size_t)max_tokens + EPX_LAYOUT_TILE_TOKENS - 1) / EPX_LAYOUT_TILE_TOKENS;
  l->layout_words_offset = 256;
  const int expand = expand_max_rows > 0 && (modes & EPX_MODE_NORMAL);
  l->expand_rows = expand ? (size_t)expand_max_rows : 0;
  l->expand_words_offset =
      l->layout_words_offset + (size_t)(EPX_MAX_RANKS + 1) * l->layout_tiles * 8;
  l->layout_bytes = epx__align_up(
      l->expand_words_offset + (expand ? (size_t)num_experts * l->layout_tiles * 8 : 0),
      EPX_WS_ALIGN);
  off += l->layout_bytes;

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
  n += epx__align_up(cap * top_k * 8, 256); /* room for int64 ids */
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
  l->combine_weights_offset = n;
  l->combine_weights_bytes = epx__align_up(cap * top_k * 4, 256);
  n += 2 * l->combine_weights_bytes;
  /* The expert-major receive arrays (epx_dispatch_expand), sized only when asked for. */
  const size_t xr = l->expand_rows;
  l->expand_x_offset = n;
  n += epx__align_up(xr * hidden * epx__payload_elem_bytes(dtypes), 256);
  l->expand_scales_offset = n;
  if (dtypes & EPX_DTYPE_FP8_E4M3) n += epx__align_up(xr * (hidden / 128) * 4, 256);
  l->expand_src_info_offset = n;
  n += epx__align_up(xr * 16, 256);
  l->expand_weights_offset = n;
  n += epx__align_up(xr * 4, 256);
  l->expand_token_rows_offset = n;
  if (expand) n += epx__align_up(cap * top_k * 4, 256);
  l->expand_ready_offset = n;
  if (expand) n += epx__align_up(cap * 4 + 4, 256);
  l->expand_arrival_offset = n;
  if (expand) n += epx__align_up(2 * (size_t)(num_experts / num_ranks) * 4, 256);
  l->normal_bytes = (modes & EPX_MODE_NORMAL) ? epx__align_up(n, EPX_WS_ALIGN) : 0;
  off += l->normal_bytes;

  /* ll: two parities of the arrays listed at the top, each array 256-byte aligned, then the
   * epochs. Sized only when low-latency mode is asked for. */
  const size_t L = (size_t)(num_experts / num_ranks), R = (size_t)num_ranks;
  const size_t M = (size_t)ll_max_tokens, K = (size_t)top_k, H = (size_t)hidden;
  const size_t rows = R * M, lrows = L * rows;
  l->ll_rows = rows;
  l->ll_elem_bytes = epx__payload_elem_bytes(dtypes);
  l->ll_stage_row_bytes = epx__ll_stage_row_bytes(hidden, dtypes);
  n = 0;
  l->ll_x_offset = n;
  n += epx__align_up(lrows * H * l->ll_elem_bytes, 256);
  l->ll_scales_offset = n;
  if (dtypes & EPX_DTYPE_FP8_E4M3) n += epx__align_up(lrows * (H / 128) * 4, 256);
  l->ll_src_info_offset = n;
  n += epx__align_up(lrows * 16, 256);
  l->ll_cnt_offset = n;
  n += epx__align_up(L * R * 4, 256);
  l->ll_recv_count_offset = n;
  n += epx__align_up(L * 4, 256);
  l->ll_recv_begin_offset = n;
  n += epx__align_up(L * R * 4, 256);
  l->ll_recv_num_offset = n;
  n += epx__align_up(L * R * 4, 256);
  l->ll_stage_offset = n;
  n += epx__align_up(rows * l->ll_stage_row_bytes, 256);
  l->ll_combine_in_offset = n;
  n += epx__align_up(lrows * H * 2, 256);
  l->ll_combine_recv_offset = n;
  /* DIRECT: [M, K] BF16 rows; BY_RANK: [R, M] float32 partials. */
  n += epx__align_up((K * 2 > R * 4 ? K * 2 : R * 4) * M * H, 256);
  l->ll_my_ids_offset = n;
  n += epx__align_up(M * K * 4, 256);
  l->ll_my_w_offset = n;
  n += epx__align_up(M * K * 4, 256);
  l->ll_dflag_offset = n;
  n += epx__align_up(R * EPX_LL_MAX_BLOCKS * 8, 256);
  l->ll_cflag_offset = n;
  n += epx__align_up(R * EPX_LL_MAX_BLOCKS * 8, 256);
  l->ll_parity_bytes = epx__align_up(n, EPX_WS_ALIGN);
  l->ll_epoch_offset = 2 * l->ll_parity_bytes;
  l->ll_offset = off;
  l->ll_bytes = 0;
  if (modes & EPX_MODE_LOW_LATENCY)
    l->ll_bytes = epx__align_up(l->ll_epoch_offset + 2 * 2 * EPX_LL_MAX_BLOCKS * 4, EPX_WS_ALIGN);
  off += l->ll_bytes;
  l->total_bytes = off;
}

#endif /* EPX_WORKSPACE_H_ */

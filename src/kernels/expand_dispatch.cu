/*
 * expand_dispatch.cu - normal mode's expert-major ("expanded") dispatch over NVLink
 * (epx_dispatch_expand; docs/moe.md, "Expert-major layout"; oracle tests/ref/epx_ref_expand.h).
 *
 * Each token's rows are its final rows, one per local expert it lists, so there is no permute
 * pass: on rank d = e / L, for expert e = d * L + j,
 *   row(me, t, e) = begin_d[j] + rows of sources < me for e + position of t among my tokens
 *                   listing e
 *                 = meta->expand_base[e] (notify's expand variant) + expand_pos[t][k] (layout)
 * A token listing e twice gets one row (its first slot's). With each row go (me, t, first slot)
 * and the row's weight: the token's weights over the slots listing e, summed in float32 from 0
 * in ascending slot order. Per (token, rank) the receiver also gets the token's row list
 * (token_rows [plain row, K], ascending expert, -1 padded) at the row epx_dispatch would have
 * used, which the expert-side combine walks.
 * The payload crosses NVLink once per (token, rank), into the row of the token's lowest local
 * expert there (list entry 0), and is copied to the token's other rows in local memory on the
 * receiver (the fan-out). Sending it once per row instead made the dispatch 2.12x the plain one
 * at EP4 (98d7421: about 2.2 rows per (token, rank) for top-8 of 256, and the kernel is
 * NVLink-bound). Where the fan-out runs is config.expand_fan_out:
 *   AFTER:  expand_fan_out, the next kernel on the receiver's stream (113 us of HBM traffic at
 *           EP4, 4096 tokens, H 7168, a2f5d44: most of the expand row's 131 us over the plain).
 *   DURING: the dispatch kernel has fan_out_blocks more blocks (epx__expand_fan_out_blocks:
 *           by the copies a token needs, 48 at EP4 with 24 senders). After a token's stores to
 *           a rank, the sender's warp publishes its plain row there as ready (the call's notify
 *           epoch into expand_ready[row], a system-scope release after a warp barrier; one fence
 *           per publish_batch tokens, EPX_EXPAND_PUBLISH_BATCH, default 2: a warp sends only
 *           about 11 tokens, and at 8 most were published together near its end, 290 against
 *           265 us at EP2); the receiver's fan-out warps copy each token once its ready word is
 *           seen (below), so the copies overlap the NVLink transfer (4x H200, e8d91a5: 544 us
 *           against 518 for the plain dispatch; the last copy ends 4 us after the last
 *           source's rows landed). A rank's own tokens take the same path (their ready words
 *           are local stores). Waits are bounded; a fan-out warp that gives up raises
 *           EPX_ERR_TIMEOUT (stage DISPATCH) and marks the call given up so the others stop at
 *           once; a source that gave up the count exchange is skipped (block 0 raises it, as
 *           for AFTER).
 *
 * Roles as normal_dispatch.cu: num_blocks sending blocks of kThreads, one warp per token over a
 * contiguous share, lane k < K standing for slot k; then every sending block's completion signal
 * and block 0's bounded wait for every source (dispatch_common.cuh, the same counters; the
 * fan-out blocks of DURING do not signal). Before its
 * tokens each block marks a share of this rank's padding rows (src_info -1, weight 0; the
 * payload of a padding row is not written): no peer writes them, and this rank's stream is past
 * every reader of the previous call's rows.
 * Rows at or past the capacity (config.expand_max_rows) are never written (their list entries
 * are -1); block 0 raises EPX_ERR_INVALID_ARGUMENT (stage DISPATCH) when this rank needs more.
 * Specialised at compile time on the scale format and the routing index dtype; the plain
 * dispatch is a separate kernel and is unchanged.
 */
#include "checks.h"
#include "kernels/api.h"
#include "kernels/dispatch_common.cuh"
#include "kernels/expand_arrival.cuh"
#include "kernels/launch.cuh"
#include "kernels/trace.cuh"
#include "kernels/wait.cuh"
#include "kernels/workspace.cuh"

namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 4; /* 16-byte loads in flight per lane */
constexpr unsigned kFull = 0xffffffffu;
static_assert(kThreads % 32 == 0 && kThreads >= EPX_MAX_RANKS, "thread r < R signals rank r");
static_assert(EPX_MAX_TOP_K <= 32, "lane k of a token's warp stands for slot k");

enum ScaleMode { kNoScales = 0, kContiguousScales = 1, kStridedScales = 2 };

/* Copy one row of n16 16-byte words from src to dst[k] for every slot k in mask (one warp).
 * The slot loop is unrolled to the compile-time maximum so dst stays in registers.
 * kLanded: the row was written by a peer while this kernel runs (DURING's fan-out), so the loads
 * go through L2 (ld.global.cg), never the read-only path (.nc); and twice the loads in flight,
 * since the fan-out is bound by them (4x H200, 48 fan-out blocks: 660 -> 638 us). */
template <bool kLanded = false>
__device__ __forceinline__ void copy_row_to_slots(const int4 *src, int4 *const *dst, unsigned mask,
                                                  int n16, int lane) {
  constexpr int kU = kLanded ? 2 * kUnroll : kUnroll;
  for (int i0 = lane; i0 < n16; i0 += 32 * kU) {
    int4 v[kU];
#pragma unroll
    for (int u = 0; u < kU; u++)
      if (i0 + u * 32 < n16)
        v[u] = kLanded ? __ldcg(src + i0 + u * 32) : epx::ld_nc_na_v4(src + i0 + u * 32);
#pragma unroll
    for (int k = 0; k < EPX_MAX_TOP_K; k++) {
      if (!((mask >> k) & 1u)) continue;
#pragma unroll
      for (int u = 0; u < kU; u++)
        if (i0 + u * 32 < n16) dst[k][i0 + u * 32] = v[u];
    }
  }
}

/* The word after this rank's ready words: the notify epoch of a call whose fan-out (DURING) or
 * whose wait for the sources gave up; AFTER's fan-out then counts nothing. */
__device__ __forceinline__ volatile uint32_t *gave_up_word(const epx__kernel_ctx_t &ctx) {
  const epx__ws_layout_t &L = ctx.layout;
  return (volatile uint32_t *)(ctx.peer_base[ctx.rank] + L.normal_offset + L.expand_ready_offset) +
         L.recv_capacity;
}

/* A received token's payload and FP8 scale words from its first row to its other rows (the
 * lanes' rows, others: the lanes holding one, not lane 0). WARP-COLLECTIVE. */
template <bool kLanded>
__device__ __forceinline__ void copy_token_to_rows(int row, unsigned others, int first, int4 *x,
                                                   uint32_t *scales, int n16, int scale_cols,
                                                   int lane) {
  int4 *dst[EPX_MAX_TOP_K];
#pragma unroll
  for (int k = 0; k < EPX_MAX_TOP_K; k++) {
    const int r = __shfl_sync(kFull, row, k);
    dst[k] = r >= 0 ? x + (size_t)r * n16 : nullptr;
  }
  copy_row_to_slots<kLanded>(x + (size_t)first * n16, dst, others, n16, lane);
  for (unsigned m = others; m;) {
    const int k = __ffs(m) - 1;
    m &= m - 1;
    const int r = __shfl_sync(kFull, row, k);
    for (int c = lane; c < scale_cols; c += 32) {
      const uint32_t *from = scales + (size_t)first * scale_cols + c;
      scales[(size_t)r * scale_cols + c] = kLanded ? __ldcg(from) : *from;
    }
  }
}

/* One received token's fan-out (one warp): its payload and FP8 scale words from its first row
 * (list entry 0, where the sender wrote it) to its other rows, then its rows added to the
 * warp's batch of complete rows (expand_arrival.cuh; L: local experts). Rows at or past the
 * capacity are -1 in the list and skipped (a token whose entry 0 is -1 has no row at all: later
 * entries are in higher segments). landed: read through L2 (DURING). */
template <bool kLanded>
__device__ __forceinline__ void fan_out_token(const epx__kernel_ctx_t &ctx,
                                              const epx__recv_meta_t *meta, int L,
                                              epx::expand::ArrivalBatch &batch, const int *list,
                                              int K, int cap, int4 *x, uint32_t *scales, int n16,
                                              int scale_cols, int lane) {
  int row = lane < K ? (kLanded ? __ldcg(list + lane) : list[lane]) : -1;
  if (row >= cap) row = -1; /* never past the buffer, even reading a list a late peer left */
  const int first = __shfl_sync(kFull, row, 0);
  const unsigned others = __ballot_sync(kFull, row >= 0) & ~1u;
  if (first < 0) return;
  if (others != 0)
    copy_token_to_rows<kLanded>(row, others, first, x, scales, n16, scale_cols, lane);
  epx::expand::add_token_rows(ctx, meta, L, batch, row, lane);
}

/* DURING's fan-out blocks (those whose start ticket comes after the sending blocks'). Work order:
 * source s's rows are [rank_prefix[s], rank_prefix[s + 1]); its sending block b covers about the
 * b-th of G equal parts of them and writes its tokens in order, so rows land part by part in
 * parallel. Item (q, s, b), q slowest, is the q-th row of part b of source s, and warp w of the W
 * fan-out warps owns items w, w + W, w + 2W, ... It takes them 32 at a time (lane l stands for
 * the l-th) and copies whichever has landed, not the first in order: the parts' bounds here are
 * only estimates (a sending block's share is so many tokens, of which a varying number come to
 * this rank), so an item can be the previous part's last row, landing at the very end. Waiting
 * for the items in order, a warp whose first item was such a row copied its other eight, long
 * landed, one after another after it: a 35-40 us tail (4x H200, traced). */
__device__ __forceinline__ void fan_out_during(const epx__kernel_ctx_t &ctx,
                                               const epx__expand_dispatch_launch_args_t &xa,
                                               const epx__recv_meta_t *meta, int fan_block, int n16,
                                               int scale_cols) {
  if (meta->aborted) return; /* nothing was sent to us: block 0 says why */
  const int R = ctx.num_ranks, me = ctx.rank, lane = threadIdx.x % 32, K = xa.d.top_k;
  const int G = xa.d.num_blocks;
  const epx__ws_layout_t &L = ctx.layout;
  const int cap = (int)L.expand_rows;
  char *base = ctx.peer_base[me] + L.normal_offset;
  const int *token_rows = (const int *)(base + L.expand_token_rows_offset);
  int4 *x = (int4 *)(base + L.expand_x_offset);
  uint32_t *scales = (uint32_t *)(base + L.expand_scales_offset);
  const uint32_t *ready = (const uint32_t *)(base + L.expand_ready_offset);
  volatile uint32_t *gave_up = gave_up_word(ctx);
  const epx__control_t *ctrl = epx::control_of(ctx, me);
  const uint32_t epoch = meta->epoch;
  const int L_experts = xa.d.num_experts / R;
  epx::expand::ArrivalBatch batch;
  int q_max = 0;
  for (int s = 0; s < R; s++)
    q_max = max(q_max, (meta->rank_prefix[s + 1] - meta->rank_prefix[s] + G - 1) / G);
  const long long items = (long long)q_max * R * G;
  const long long warps = (long long)xa.fan_out_blocks * kWarps;
  /* One budget for the whole fan-out, as block 0's wait for every source has. */
  const uint64_t t0 = epx::globaltimer_ns();
  for (long long first = (long long)fan_block * kWarps + threadIdx.x / 32; first < items;
       first += 32 * warps) {
    /* This lane's item: its row i, or -1 (past the end, or past its part's estimated end). */
    const long long it = first + (long long)lane * warps;
    int i = -1, s = 0;
    if (it < items) {
      const int b = (int)(it % G), q = (int)(it / ((long long)G * R));
      s = (int)((it / G) % R);
      const int p0 = meta->rank_prefix[s], n_s = meta->rank_prefix[s + 1] - p0;
      const int row = p0 + (int)((long long)n_s * b / G) + q;
      if (row < p0 + (int)((long long)n_s * (b + 1) / G)) i = row;
    }
    unsigned pending = __ballot_sync(kFull, i >= 0);
    const uint64_t t_wait = epx::trace_begin(ctx);
    while (pending) {
      unsigned landed = 0, dropped = 0; /* dropped: its source gave up the count exchange */
      bool late = false;
      /* Every lane polls its own item and the ballots make the result the warp's; the budget
       * is checked in `abandon`, alike in every lane (a per-lane timer could split the warp),
       * so wait_until's own budget is never reached. */
      const epx::WaitResult r = epx::wait_until<64>(
          ~0ull,
          [&] {
            const bool mine = (pending >> lane) & 1u;
            const bool is_landed = mine && epx::ld_relaxed_sys_u32(ready + i) == epoch;
            const bool is_dropped = mine && !is_landed &&
                                    *(volatile const unsigned int *)&ctrl->notify_abort[s] == epoch;
            landed = __ballot_sync(kFull, is_landed);
            dropped = __ballot_sync(kFull, is_dropped);
            return (landed | dropped) != 0u;
          },
          [&] {
            late = __any_sync(kFull, epx::globaltimer_ns() - t0 > ctx.timeout_ns);
            return late || __any_sync(kFull, *gave_up == epoch);
          });
      if (r != epx::WaitResult::kReady) {
        if (late && lane == __ffs(pending) - 1) {
          epx::raise_error(ctx, EPX_ERR_TIMEOUT, EPX_STAGE_DISPATCH, s, i, (long long)epoch);
          *gave_up = epoch;
        }
        return; /* this call gave up: the other warps stop at their next poll */
      }
      pending &= ~(landed | dropped);
      /* The poll's acquire: a load, not a fence (a system fence would also wait for this
       * warp's stores of the previous token, serializing the tokens' copies). */
      if ((landed >> lane) & 1u) (void)epx::ld_acquire_sys_u32(ready + i);
      __syncwarp(); /* each landed lane's acquire orders the whole warp's reads below */
      for (unsigned m = landed; m; m &= m - 1) {
        const int row = __shfl_sync(kFull, i, __ffs(m) - 1);
        const uint64_t t_copy = epx::trace_begin(ctx);
        if (lane == 0) epx::trace_end(ctx, t_wait, EPX_TRACE_EXPAND_FAN_OUT_WAIT, row);
        fan_out_token<true>(ctx, meta, L_experts, batch, token_rows + (size_t)row * K, K, cap, x,
                            scales, n16, scale_cols, lane);
        if (lane == 0) epx::trace_end(ctx, t_copy, EPX_TRACE_EXPAND_FAN_OUT_TOKEN, row);
      }
      epx::expand::flush_arrivals(ctx, L_experts, batch, lane); /* this landed set's rows */
    }
  }
}

/* Mark this block's share of this rank's padding rows: (j, i) for local expert j and i in
 * [begin[j] + count[j], begin[j + 1]), below the capacity. */
__device__ __forceinline__ void mark_padding(const epx__kernel_ctx_t &ctx,
                                             const epx__recv_meta_t *meta, int epr, int block,
                                             int senders) {
  const epx__ws_layout_t &L = ctx.layout;
  char *base = ctx.peer_base[ctx.rank] + L.normal_offset;
  int4 *info = (int4 *)(base + L.expand_src_info_offset);
  float *weights = (float *)(base + L.expand_weights_offset);
  const int cap = (int)L.expand_rows;
  for (int j = block; j < epr; j += senders) {
    const int p0 = meta->expand_begin[j] + meta->expand_count[j];
    const int p1 = min(meta->expand_begin[j + 1], cap);
    for (int r = p0 + (int)threadIdx.x; r < p1; r += kThreads) {
      info[r] = make_int4(-1, -1, -1, 0);
      weights[r] = 0.f;
    }
  }
}

}  // namespace

/* External linkage so that profilers show it as epx::normal::dispatch_expand. */
namespace epx::normal {

template <typename IdxT, int kScales>
__global__ void __launch_bounds__(kThreads, 1)
    dispatch_expand(epx__kernel_ctx_t ctx, epx__expand_dispatch_launch_args_t xa) {
  constexpr bool kFp8 = kScales != kNoScales;
  const epx__dispatch_launch_args_t &a = xa.d;
  const int senders = a.num_blocks, during = xa.fan_out_blocks > 0;
  /* The block's role. DURING: by the order blocks start (a ticket), not by blockIdx, so every
   * sending block is running before any fan-out block waits: a fan-out block holding an SM can
   * never keep this rank's senders, and so a peer's fan-out, from starting. */
  __shared__ int role_s;
  int role = blockIdx.x;
  if (during) {
    if (threadIdx.x == 0)
      role_s = (int)(atomicAdd(&epx::control_of(ctx, ctx.rank)->expand_ticket, 1ull) %
                     (unsigned long long)(senders + xa.fan_out_blocks));
    __syncthreads();
    role = role_s;
  }
  if (role >= senders) { /* DURING: a fan-out block */
    fan_out_during(ctx, xa, a.routing.meta, role - senders, a.hidden * (kFp8 ? 1 : 2) / 16,
                   kFp8 ? a.scale_cols : 0);
    return;
  }
  const uint64_t t_send = epx::trace_begin(ctx);
  const int R = ctx.num_ranks, me = ctx.rank, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int H = a.hidden, K = a.top_k, E = a.num_experts, epr = E / R;
  const epx__recv_meta_t *meta = a.routing.meta;
  __shared__ int dest_base[EPX_MAX_RANKS]; /* plain rows of sources before me at each rank */
  if (tid < R) {
    int base = 0;
    for (int s = 0; s < me; s++) base += meta->count[s][tid];
    dest_base[tid] = base;
  }
  __syncthreads();

  /* Regions (every rank's layout, relative to its normal region):
   *   expand_x [cap, H] elem   expand_scales [cap, scale_cols] 4-byte words
   *   expand_src_info [cap] int4   expand_weights [cap] f32   expand_token_rows [R*M, K] i32 */
  const epx__ws_layout_t &L = ctx.layout;
  const int cap = (int)L.expand_rows;
  const int elem = kFp8 ? 1 : 2, n16 = H * elem / 16;
  const IdxT *topk = (const IdxT *)a.topk_idx;
  /* A failed count exchange: send nothing, only the done signals, and wait for nothing. */
  const bool aborted = meta->aborted != 0;
  if (!aborted) {
    if (role == 0 && tid == 0 && meta->expand_rows > cap)
      epx::raise_error(ctx, EPX_ERR_INVALID_ARGUMENT, EPX_STAGE_DISPATCH, -1, cap,
                       meta->expand_rows);
    mark_padding(ctx, meta, epr, role, senders);
  }
  int begin, end;
  epx::dispatch::block_share(aborted ? 0 : a.routing.num_tokens, role, senders, &begin, &end);
  /* DURING: the tokens whose ready words wait for the batch's fence; lane j holds the j-th
   * (its token and the bit mask of the ranks it went to, this one included). */
  int pend_t = -1, npend = 0;
  unsigned pend_ranks = 0;
  for (int t = begin + warp; t < end; t += kWarps) {
    const uint64_t t_token = epx::trace_begin(ctx);
    /* Lane k < K: slot k's expert (invalid ids are empty slots: the layout reported them). */
    int e = -1;
    float w = 0.f;
    if (lane < K) {
      const long long v = (long long)topk[(size_t)t * K + lane];
      if (v >= 0 && v < E) {
        e = (int)v;
        if (a.topk_weights) w = a.topk_weights[(size_t)t * K + lane];
      }
    }
    /* first: no earlier slot lists e. weight: the sum over the slots listing e, ascending. */
    bool first = e >= 0;
    float weight = 0.f;
    for (int k = 0; k < K; k++) {
      const int ek = __shfl_sync(kFull, e, k);
      const float wk = __shfl_sync(kFull, w, k);
      if (e >= 0 && ek == e) {
        if (k < lane) first = false;
        weight = __fadd_rn(weight, wk);
      }
    }
    const unsigned firsts = __ballot_sync(kFull, first);
    const int d = first ? e / epr : -1;
    /* order: the rank of e among the token's distinct experts on d (its list entry). */
    int order = 0;
    for (int k = 0; k < K; k++) {
      const int ek = __shfl_sync(kFull, e, k);
      if (first && ((firsts >> k) & 1u) && ek / epr == d && ek < e) order++;
    }
    const int row = first ? meta->expand_base[e] + xa.expand_pos[(size_t)t * K + lane] : -1;
    const bool writes = first && row >= 0 && row < cap;
    /* The payload crosses NVLink once per rank, into the token's lowest expert row there
     * (order 0); the fan-out copies it to the others on the receiver (this rank's own tokens
     * too). Every row gets its own (source, token, slot) and weight below. */
    const unsigned wmask = __ballot_sync(kFull, writes && order == 0);
    char *peer = writes ? ctx.peer_base[d] + L.normal_offset : nullptr;
    int4 *my_dst = writes ? (int4 *)(peer + L.expand_x_offset + (size_t)row * H * elem) : nullptr;
    int4 *dst[EPX_MAX_TOP_K];
#pragma unroll
    for (int k = 0; k < EPX_MAX_TOP_K; k++)
      dst[k] = (int4 *)__shfl_sync(kFull, (unsigned long long)my_dst, k);
    copy_row_to_slots((const int4 *)((const char *)a.x + (size_t)t * H * elem), dst, wmask, n16,
                      lane);
    if constexpr (kFp8) { /* scale words (float32 or packed UE8M0), moved as 4-byte words */
      const int cols = a.scale_cols;
      uint32_t *my_sdst =
          writes ? (uint32_t *)(peer + L.expand_scales_offset) + (size_t)row * cols : nullptr;
      uint32_t *sdst[EPX_MAX_TOP_K];
#pragma unroll
      for (int k = 0; k < EPX_MAX_TOP_K; k++)
        sdst[k] = (uint32_t *)__shfl_sync(kFull, (unsigned long long)my_sdst, k);
      const uint32_t *src = (const uint32_t *)a.x_scales;
      for (int i = lane; i < cols; i += 32) {
        const uint32_t sc = kScales == kStridedScales
                                ? src[t * a.scale_stride_token + i * a.scale_stride_group]
                                : src[(size_t)t * cols + i];
#pragma unroll
        for (int k = 0; k < EPX_MAX_TOP_K; k++)
          if ((wmask >> k) & 1u) sdst[k][i] = sc;
      }
    }
    if (writes) {
      ((int4 *)(peer + L.expand_src_info_offset))[row] = make_int4(me, t, lane, 0);
      ((float *)(peer + L.expand_weights_offset))[row] = weight;
    }
    /* The token's row list on every rank it goes to, at its plain row there. */
    for (unsigned m = __ballot_sync(kFull, first); m;) {
      const int dd = __shfl_sync(kFull, d, __ffs(m) - 1);
      const unsigned on_d = __ballot_sync(kFull, first && d == dd);
      m &= ~on_d;
      const int n_d = __popc(on_d);
      const int prow = dest_base[dd] + a.routing.token_pos_in_rank[(size_t)t * R + dd];
      int *list = (int *)(ctx.peer_base[dd] + L.normal_offset + L.expand_token_rows_offset) +
                  (size_t)prow * K;
      if (first && d == dd) list[order] = writes ? row : -1;
      if (lane < K && lane >= n_d) list[lane] = -1;
    }
    if (during) { /* publish, per batch: these tokens' rows, scales, infos and lists landed */
      const unsigned ranks = __reduce_or_sync(kFull, first ? 1u << d : 0u);
      if (lane == npend) pend_t = t, pend_ranks = ranks;
      npend++;
      if (npend == xa.publish_batch || t + kWarps >= end) {
        const unsigned any = __reduce_or_sync(kFull, lane < npend ? pend_ranks : 0u);
        __syncwarp();
        if (lane == 0 && any) epx::fence_acq_rel_sys(); /* with the barrier: the warp's stores */
        for (int j = 0; any && j < npend; j++) {
          const int tj = __shfl_sync(kFull, pend_t, j);
          const unsigned pj = __shfl_sync(kFull, pend_ranks, j);
          for (unsigned m = lane == 0 ? pj : 0u; m; m &= m - 1) { /* after lane 0's fence */
            const int dd = __ffs(m) - 1;
            const int prow = dest_base[dd] + a.routing.token_pos_in_rank[(size_t)tj * R + dd];
            epx::st_relaxed_sys_u32(
                (uint32_t *)(ctx.peer_base[dd] + L.normal_offset + L.expand_ready_offset) + prow,
                meta->epoch);
          }
        }
        npend = 0;
      }
    }
    if (lane == 0) epx::trace_end(ctx, t_token, EPX_TRACE_DISPATCH_TOKEN, t);
  }

  epx::dispatch::signal_done(ctx);
  if (tid == 0) epx::trace_end(ctx, t_send, EPX_TRACE_DISPATCH_SEND, end - begin);
  /* A source that did not deliver: mark the call given up (DURING's fan-out stops at once,
   * AFTER's counts no arrival: its rows may be the previous call's). */
  if (!epx::dispatch::wait_sources(ctx, meta, aborted, senders, role) && tid == 0)
    *gave_up_word(ctx) = meta->epoch;
}

/* AFTER's fan-out: for each received token, its payload (and FP8 scale words) from its first
 * row to its other rows. Stream-ordered after dispatch_expand, whose block 0 waited for every
 * source: the rows and lists are complete. One warp per token, grid-strided. */
__global__ void __launch_bounds__(kThreads)
    expand_fan_out(epx__kernel_ctx_t ctx, epx__expand_fan_out_launch_args_t fa) {
  const epx__recv_meta_t *meta = fa.meta;
  const epx__ws_layout_t &L = ctx.layout;
  char *base = ctx.peer_base[ctx.rank] + L.normal_offset;
  /* the dispatch gave up (a source did not deliver): its lists may be the previous call's */
  const int num_recv = meta->aborted || *gave_up_word(ctx) == meta->epoch ? 0 : meta->num_recv;
  const int *token_rows = (const int *)(base + L.expand_token_rows_offset);
  int4 *x = (int4 *)(base + L.expand_x_offset);
  uint32_t *scales = (uint32_t *)(base + L.expand_scales_offset);
  const int warps = gridDim.x * kWarps;
  /* One token's rows counted at once: a batch kept over the loop took 84 registers a thread
   * (one 512-thread block an SM, the grid in two waves) against 64 (two, one wave). */
  for (int i = blockIdx.x * kWarps + threadIdx.x / 32; i < num_recv; i += warps) {
    epx::expand::ArrivalBatch batch;
    fan_out_token<false>(ctx, meta, fa.num_local_experts, batch, token_rows + (size_t)i * fa.top_k,
                         fa.top_k, (int)L.expand_rows, x, scales, fa.row_bytes / 16, fa.scale_cols,
                         threadIdx.x % 32);
    epx::expand::flush_arrivals(ctx, fa.num_local_experts, batch, threadIdx.x % 32);
  }
}

}  // namespace epx::normal

template <int kScales>
static epx_status_t launch_scales(const epx__kernel_ctx_t *ctx,
                                  const epx__expand_dispatch_launch_args_t *args,
                                  cudaStream_t stream) {
  const dim3 grid(args->d.num_blocks + args->fan_out_blocks), block(kThreads);
  return EPX_INDEX_SWITCH(args->d.idx_is_int64, IdxT, [&] {
    return epx::launch<epx::normal::dispatch_expand<IdxT, kScales>>(grid, block, 0, stream, *ctx,
                                                                    *args);
  });
}

extern "C" epx_status_t epx__expand_dispatch_launch(const epx__kernel_ctx_t *ctx,
                                                    const epx__expand_dispatch_launch_args_t *args,
                                                    cudaStream_t stream) {
  if (ctx->layout.expand_rows == 0)
    return epx__set_error(EPX_ERR_INTERNAL, "expand dispatch: the workspace has no expand region");
  if (!args->d.x_is_fp8) return launch_scales<kNoScales>(ctx, args, stream);
  if (args->d.scales_strided) return launch_scales<kStridedScales>(ctx, args, stream);
  return launch_scales<kContiguousScales>(ctx, args, stream);
}

extern "C" epx_status_t epx__expand_fan_out_launch(const epx__kernel_ctx_t *ctx,
                                                   const epx__expand_fan_out_launch_args_t *args,
                                                   cudaStream_t stream) {
  return epx::launch<epx::normal::expand_fan_out>(args->num_blocks, kThreads, 0, stream, *ctx,
                                                  *args);
}

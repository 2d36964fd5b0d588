/*
 * layout.cu - dispatch layout of one rank's tokens: per-rank and per-expert token counts,
 * is_token_in_rank [T, R], and each token's position in each destination rank's stream.
 *
 * One pass, linear in T. ceil(T / 512) blocks of 512 threads, one token per thread: a block
 * handles one tile of 512 tokens. A token's position in rank r's stream counts the earlier tokens
 * going to r: those of its own tile from warp ballots, those before its tile from a scan over
 * tiles by decoupled look-back (Merrill & Garland, "Single-pass Parallel Prefix Scan with
 * Decoupled Look-back"), in the layout region of the workspace (workspace.h). Before, block b
 * re-counted every token before its tile: O(T^2 / 512) in all and O(T) on the last block.
 *   1. Ticket: thread 0 takes the next tile from the ticket word, so tiles are handed out in the
 *      order blocks start. A block waits only for tiles taken before its own, whose blocks are
 *      running and never wait for a later tile: no deadlock, even when the grid does not fit
 *      the GPU at once. The block that takes the call's last ticket moves the word to the next
 *      epoch, tile 0 (every other block of the call holds its ticket by then).
 *   2. Own tile: each token's ids, rank mask, expert counts (shared atomics, a token once per
 *      expert) and lowest invalid position; per-warp per-rank counts from ballots.
 *   3. Scan, one warp per column: column r < R sums rank r's tokens; column EPX_MAX_RANKS takes
 *      the minimum of the invalid flat positions, so that the last tile learns the lowest one
 *      from the scan itself. A column warp publishes its tile's AGGREGATE, then looks back over
 *      the preceding tiles, 32 at a time (a lane each), until a window holds an INCLUSIVE
 *      prefix, and publishes its own INCLUSIVE prefix. Tile 0 publishes its inclusive prefix at
 *      once; the last tile publishes nothing, since no tile reads it.
 *   4. Outputs: a position is the tile's prefix + the warp's + the lane's; then one global
 *      atomicAdd per expert the tile touched (the host zeroes num_tokens_per_expert first).
 *   5. The last tile holds the call's totals: it writes num_tokens_per_rank and raises the
 *      lowest invalid id.
 * A block's work is one tile plus its look-back, usually one window per column: the blocks
 * before it started earlier, so their inclusive prefixes are mostly out. The last block's
 * critical path is its tile, the wait for its predecessors' aggregates, and ceil(tiles / 32)
 * window loads at worst: no longer the whole input.
 *
 * Scan words, 64 bits written whole (so no separate flag and no fence): bits 63..24 the call's
 * epoch, 23..22 the state (0 none, 1 aggregate, 2 inclusive), 21..0 the value. A word of
 * another epoch reads as not published, so nothing is zeroed between calls; a 40-bit epoch
 * repeats after 2^40 calls. The ticket word: epoch << 24 | next tile. The values need no other
 * memory to be ordered, so relaxed GPU-scope loads and stores suffice.
 * Every look-back wait is bounded (epx::wait_until, ctx.timeout_ns). Only a broken scan state
 * makes one wait that long (a call that never finished, or two calls of one group on unordered
 * streams, which the API forbids): it raises EPX_ERR_TIMEOUT (stage LAYOUT, position = the
 * tile waited for, value = the epoch) and counts that tile as empty, so no block waits on. A
 * ticket beyond the call's tiles (such a state again) raises EPX_ERR_INTERNAL.
 * epx_group_clear_async_error zeroes the region.
 *
 * Invalid expert ids (outside [-1, E)) are skipped as empty slots; the lowest flat position t*K+k
 * of one is raised as EPX_ERR_INVALID_ARGUMENT. Nothing is written outside the caller's arrays.
 * Every loop over k or r is unrolled to the compile-time maximum, so the per-token arrays stay
 * in registers (indexed at run time they went to local memory).
 * Rank-mask routing (kFromMask, epx_dispatch with is_token_in_rank): the same kernel with each
 * token's rank mask read from the caller's [T, R] mask instead of derived from its ids; no ids,
 * no invalid ids (no minimum column), and the caller's per-expert counts are copied (tile 0)
 * instead of counted.
 *
 * Expert-major positions (kExpand, epx_dispatch_expand; ids only): also each token's position
 * among this rank's tokens listing each of its experts, written per slot into expand_pos [T, K]
 * (-1 for an empty slot; a repeated expert gets its first slot's value). Within the tile: a
 * lane bitmap per (warp, expert) in dynamic shared memory and the per-expert prefix over warps;
 * across tiles: one more scan column per expert (the expand words of the layout region, same
 * format), each with its own look-back, by one thread rather than a warp (E columns), usually
 * one load since the tile before has published its inclusive prefix by then.
 */
#include "kernels/launch.cuh"
#include "kernels/api.h"
#include "kernels/ptx.cuh"
#include "kernels/trace.cuh"
#include "kernels/wait.cuh"

namespace {

constexpr int kThreads = EPX_LAYOUT_TILE_TOKENS; /* = tokens per tile */
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;
constexpr int kBadCol = EPX_MAX_RANKS; /* the scan column of the lowest invalid position */
static_assert(kThreads % 32 == 0 && kWarps <= 32, "a column's per-warp counts fit one warp");
static_assert(kWarps > kBadCol, "one warp per scan column");
static_assert(EPX_MAX_RANKS <= 32, "a token's ranks are one 32-bit mask");

/* Scan and ticket words (header). */
constexpr int kEpochShift = 24;
constexpr uint64_t kLowBits = (1ull << kEpochShift) - 1; /* ticket: tile; scan word: state, value */
constexpr int kStateShift = 22;
constexpr uint64_t kAggregate = 1, kInclusive = 2;
constexpr unsigned kValueMask = (1u << kStateShift) - 1;
constexpr unsigned kNoBad = kValueMask; /* no invalid id: the identity of the minimum */
static_assert((unsigned long long)EPX_MAX_TOKENS_PER_RANK * EPX_MAX_TOP_K < kNoBad,
              "a flat position and a count fit a word's value");
static_assert(EPX_MAX_TOKENS_PER_RANK / EPX_LAYOUT_TILE_TOKENS < kLowBits, "tiles fit a ticket");

__device__ __forceinline__ unsigned state_of(uint64_t w) {
  return (unsigned)((w >> kStateShift) & 3);
}

/* Token t's K ids (invalid ones as -1), all loads issued before any check, and the lowest flat
 * position of an invalid one folded into *first_bad. */
template <typename IdxT>
__device__ __forceinline__ void load_ids(const IdxT *topk, int t, int K, int E, int *ids,
                                         unsigned long long *first_bad) {
  long long raw[EPX_MAX_TOP_K];
#pragma unroll
  for (int k = 0; k < EPX_MAX_TOP_K; k++) raw[k] = k < K ? (long long)topk[(size_t)t * K + k] : -1;
#pragma unroll
  for (int k = 0; k < EPX_MAX_TOP_K; k++) {
    ids[k] = -1;
    if (raw[k] < -1 || raw[k] >= E) {
      const unsigned long long pos = (unsigned long long)t * K + k;
      if (pos < *first_bad) *first_bad = pos;
    } else {
      ids[k] = (int)raw[k];
    }
  }
}

/* Bit r set when one of the ids is an expert of rank r. */
__device__ __forceinline__ unsigned rank_mask_of(const int *ids, int experts_per_rank) {
  unsigned mask = 0;
#pragma unroll
  for (int k = 0; k < EPX_MAX_TOP_K; k++)
    if (ids[k] >= 0) mask |= 1u << (ids[k] / experts_per_rank);
  return mask;
}

/* Rank-mask routing: bit r set when the caller's mask says token t goes to rank r. */
__device__ __forceinline__ unsigned rank_mask_from(const uint8_t *in_rank, int t, int R) {
  unsigned mask = 0;
#pragma unroll
  for (int r = 0; r < EPX_MAX_RANKS; r++)
    if (r < R && in_rank[(size_t)t * R + r]) mask |= 1u << r;
  return mask;
}

/* The exclusive prefix of `tile` in one summing column, by one thread (kExpand's expert
 * columns): back over the preceding tiles until an inclusive prefix. Bounded as look_back. */
__device__ __forceinline__ unsigned look_back_thread(const epx__kernel_ctx_t &ctx,
                                                     const uint64_t *words, int tile,
                                                     uint64_t tag) {
  unsigned prefix = 0;
  for (int p = tile - 1; p >= 0; p--) {
    uint64_t w = 0;
    const epx::WaitResult r = epx::wait_until(
        ctx.timeout_ns,
        [&] {
          w = epx::ld_relaxed_gpu(words + p);
          return (w & ~kLowBits) == tag && state_of(w) != 0;
        },
        epx::NeverAbandon());
    if (r != epx::WaitResult::kReady) { /* counted as an empty inclusive prefix, as look_back */
      epx::raise_error(ctx, EPX_ERR_TIMEOUT, EPX_STAGE_LAYOUT, -1, p,
                       (long long)(tag >> kEpochShift));
      return prefix;
    }
    prefix += (unsigned)(w & kValueMask);
    if (state_of(w) == kInclusive) return prefix;
  }
  return prefix;
}

/* A token's n values, its row of a [T, n] int array, in 16- or 8-byte stores where n and the
 * row's address allow: a warp's one-int stores at an n-int stride cost about 3 us of the
 * expert-major layout's 16 at 4096 tokens, top-8 (1x H200, epx_layout_bench). */
template <int kMax>
__device__ __forceinline__ void store_token_row(int *row, const int (&v)[kMax], int n) {
  static_assert(kMax % 4 == 0, "whole 16-byte groups");
  const uintptr_t at = (uintptr_t)row;
  if (n % 4 == 0 && at % 16 == 0) {
#pragma unroll
    for (int i = 0; i < kMax; i += 4)
      if (i < n) *(int4 *)(row + i) = make_int4(v[i], v[i + 1], v[i + 2], v[i + 3]);
  } else if (n % 2 == 0 && at % 8 == 0) {
#pragma unroll
    for (int i = 0; i < kMax; i += 2)
      if (i < n) *(int2 *)(row + i) = make_int2(v[i], v[i + 1]);
  } else {
#pragma unroll
    for (int i = 0; i < kMax; i++)
      if (i < n) row[i] = v[i];
  }
}

/* kExpand's dynamic shared memory, for E experts: lane bitmaps [kWarps][E] u32, then the
 * per-warp prefixes [kWarps][E] u16, then the tile's prefix per expert [E] u32. */
__host__ __device__ constexpr size_t expand_smem_bytes(int E) {
  return (size_t)E * (kWarps * 4 + kWarps * 2 + 4);
}

/* A column's operator: the sum of counts, or (kMin) the minimum of positions. */
template <bool kMin>
__device__ __forceinline__ unsigned combine(unsigned x, unsigned y) {
  return kMin ? min(x, y) : x + y;
}

/* The exclusive prefix of `tile` in one column (words: the column's word of every tile), by one
 * warp; every lane returns it. Lane i reads tile end - 1 - i (lane 0 the nearest), a window of
 * 32 tiles at a time, moving back while a window holds only aggregates; the values from the
 * nearest inclusive prefix up to tile - 1 make the result. */
template <bool kMin>
__device__ __forceinline__ unsigned look_back(const epx__kernel_ctx_t &ctx, const uint64_t *words,
                                              int tile, uint64_t tag) {
  const int lane = threadIdx.x % 32;
  const unsigned identity = kMin ? kNoBad : 0u;
  /* Before tile 0, and in place of a tile whose wait timed out: an empty inclusive prefix, so
   * that the look-back ends there. */
  const uint64_t empty = tag | (kInclusive << kStateShift) | identity;
  unsigned prefix = identity;
  for (int end = tile;; end -= 32) {
    const int p = end - 1 - lane;
    uint64_t w = empty;
    if (p >= 0) {
      const epx::WaitResult r = epx::wait_until(
          ctx.timeout_ns,
          [&] {
            w = epx::ld_relaxed_gpu(words + p);
            return (w & ~kLowBits) == tag && state_of(w) != 0;
          },
          epx::NeverAbandon());
      if (r != epx::WaitResult::kReady) {
        epx::raise_error(ctx, EPX_ERR_TIMEOUT, EPX_STAGE_LAYOUT, -1, p,
                         (long long)(tag >> kEpochShift));
        w = empty;
      }
    }
    const unsigned done = __ballot_sync(kFull, state_of(w) == kInclusive);
    const int stop = done ? __ffs(done) - 1 : 31; /* the nearest inclusive prefix */
    const unsigned v = lane <= stop ? (unsigned)(w & kValueMask) : identity;
    prefix =
        combine<kMin>(prefix, kMin ? __reduce_min_sync(kFull, v) : __reduce_add_sync(kFull, v));
    if (done) return prefix;
  }
}

template <typename IdxT, bool kFromMask, bool kExpand>
__global__ void __launch_bounds__(kThreads, 1)
    layout_kernel(epx__kernel_ctx_t ctx, epx__layout_launch_args_t a) {
  static_assert(!(kFromMask && kExpand), "expert-major positions need ids");
  extern __shared__ __align__(16) unsigned char expand_smem[];
  __shared__ int expert_count[EPX_MAX_EXPERTS];
  /* warp_count[w][r]: tokens of warp w going to rank r; after the scan, those of warps < w. */
  __shared__ int warp_count[kWarps][EPX_MAX_RANKS];
  __shared__ unsigned col_prefix[kBadCol + 1]; /* per scan column: the tiles before this one */
  __shared__ unsigned col_total[kBadCol + 1];  /* ... and up to this one included */
  __shared__ unsigned long long first_bad;
  __shared__ unsigned long long ticket;

  const uint64_t t_start = epx::trace_begin(ctx);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int T = a.num_tokens, K = a.top_k, E = a.num_experts, R = a.num_ranks;
  const int experts_per_rank = E / R;
  const IdxT *topk = (const IdxT *)a.topk_idx;
  const int num_tiles = gridDim.x;
  /* The layout region (workspace.h): the ticket word, then [kBadCol + 1][layout_tiles] words. */
  char *region = ctx.peer_base[ctx.rank] + ctx.layout.layout_offset;
  unsigned long long *ticket_word = (unsigned long long *)region;
  uint64_t *scan_words = (uint64_t *)(region + ctx.layout.layout_words_offset);

  /* 1. Ticket. */
  if (tid == 0) {
    const unsigned long long mine = atomicAdd(ticket_word, 1ull);
    if ((mine & kLowBits) == (unsigned long long)num_tiles - 1) /* the call's last ticket */
      atomicExch(ticket_word, (mine | kLowBits) + 1);           /* next epoch, tile 0 */
    ticket = mine;
    first_bad = ~0ull;
  }
  for (int e = tid; e < E; e += kThreads) expert_count[e] = 0;
  unsigned *ex_mask = (unsigned *)expand_smem;                        /* [kWarps][E] */
  unsigned short *ex_warp = (unsigned short *)(ex_mask + kWarps * E); /* [kWarps][E] */
  unsigned *ex_tile = (unsigned *)(ex_warp + kWarps * E);             /* [E] */
  if constexpr (kExpand)
    for (int i = tid; i < kWarps * E; i += kThreads) ex_mask[i] = 0;
  __syncthreads();
  const uint64_t tag = ticket & ~kLowBits;
  const int tile = (int)(ticket & kLowBits);
  const bool last = tile == num_tiles - 1;
  if (tile >= num_tiles) { /* the ticket word was not at tile 0 when the call began */
    if (tid == 0) epx::raise_error(ctx, EPX_ERR_INTERNAL, EPX_STAGE_LAYOUT, -1, tile, num_tiles);
    return;
  }

  /* 2. This tile. */
  const int t = tile * kThreads + tid;
  unsigned long long my_bad = ~0ull;
  int ids[EPX_MAX_TOP_K];
#pragma unroll
  for (int k = 0; k < EPX_MAX_TOP_K; k++) ids[k] = -1;
  if (t < T && !kFromMask) load_ids(topk, t, K, E, ids, &my_bad);
  const unsigned rank_mask = kFromMask ? (t < T ? rank_mask_from(a.in_rank_mask, t, R) : 0u)
                                       : rank_mask_of(ids, experts_per_rank);
#pragma unroll
  for (int k = 0; k < EPX_MAX_TOP_K; k++) {
    if (ids[k] < 0) continue;
    bool repeated = false; /* count a token once per expert, even if listed twice */
#pragma unroll
    for (int j = 0; j < k; j++) repeated |= ids[j] == ids[k];
    if (!repeated) atomicAdd(&expert_count[ids[k]], 1);
    if (kExpand && !repeated) atomicOr(&ex_mask[warp * E + ids[k]], 1u << lane);
  }
  if (my_bad != ~0ull) atomicMin(&first_bad, my_bad);
  int lane_prefix[EPX_MAX_RANKS];
#pragma unroll
  for (int r = 0; r < EPX_MAX_RANKS; r++) {
    const unsigned ballot = __ballot_sync(kFull, (rank_mask >> r) & 1u);
    lane_prefix[r] = __popc(ballot & ((1u << lane) - 1u));
    if (lane == 0) warp_count[warp][r] = __popc(ballot);
  }
  __syncthreads();

  /* 3. Scan across tiles: warp r < R for rank r, warp kBadCol for the lowest invalid position. */
  const bool rank_col = warp < R, bad_col = !kFromMask && warp == kBadCol;
  if (rank_col || bad_col) {
    unsigned aggregate;
    if (rank_col) { /* lane w < kWarps: warp w's count; an inclusive scan over the lanes */
      const unsigned v = lane < kWarps ? warp_count[lane][warp] : 0u;
      unsigned incl = v;
#pragma unroll
      for (int d = 1; d < 32; d *= 2) {
        const unsigned u = __shfl_up_sync(kFull, incl, d);
        if (lane >= d) incl += u;
      }
      if (lane < kWarps) warp_count[lane][warp] = (int)(incl - v);
      aggregate = __shfl_sync(kFull, incl, 31);
    } else {
      aggregate = first_bad < kNoBad ? (unsigned)first_bad : kNoBad;
    }
    uint64_t *words = scan_words + (size_t)warp * ctx.layout.layout_tiles;
    unsigned prefix = rank_col ? 0u : kNoBad;
    if (tile > 0) {
      /* NOTE: the aggregate goes out before this warp waits, so that later tiles never wait
       * for this tile's look-back. */
      if (lane == 0 && !last)
        epx::st_relaxed_gpu(words + tile, tag | (kAggregate << kStateShift) | aggregate);
      prefix = rank_col ? look_back<false>(ctx, words, tile, tag)
                        : look_back<true>(ctx, words, tile, tag);
    }
    const unsigned total = rank_col ? prefix + aggregate : min(prefix, aggregate);
    if (lane == 0) {
      if (!last) epx::st_relaxed_gpu(words + tile, tag | (kInclusive << kStateShift) | total);
      col_prefix[warp] = prefix;
      col_total[warp] = total;
    }
  }
  if constexpr (kExpand) { /* one thread per expert column: within the tile, then across */
    uint64_t *ex_words = (uint64_t *)(region + ctx.layout.expand_words_offset);
    for (int e = tid; e < E; e += kThreads) {
      unsigned run = 0;
      for (int w = 0; w < kWarps; w++) {
        ex_warp[w * E + e] = (unsigned short)run;
        run += __popc(ex_mask[w * E + e]);
      }
      uint64_t *words = ex_words + (size_t)e * ctx.layout.layout_tiles;
      unsigned prefix = 0;
      if (tile > 0) {
        if (!last) epx::st_relaxed_gpu(words + tile, tag | (kAggregate << kStateShift) | run);
        prefix = look_back_thread(ctx, words, tile, tag);
      }
      if (!last)
        epx::st_relaxed_gpu(words + tile, tag | (kInclusive << kStateShift) | (prefix + run));
      ex_tile[e] = prefix;
    }
  }
  __syncthreads();

  /* 4. Outputs. */
  if (t < T) {
    int rank_pos[EPX_MAX_RANKS]; /* ranks past R: not stored */
#pragma unroll
    for (int r = 0; r < EPX_MAX_RANKS; r++) {
      const bool in_rank = r < R && ((rank_mask >> r) & 1u);
      rank_pos[r] = in_rank ? (int)col_prefix[r] + warp_count[warp][r] + lane_prefix[r] : -1;
      if (a.is_token_in_rank && r < R) a.is_token_in_rank[(size_t)t * R + r] = in_rank ? 1 : 0;
    }
    if (a.token_pos_in_rank) store_token_row(a.token_pos_in_rank + (size_t)t * R, rank_pos, R);
    if constexpr (kExpand) {
      const unsigned below = (1u << lane) - 1u;
      int pos[EPX_MAX_TOP_K]; /* slots past K hold -1 and are not stored */
#pragma unroll
      for (int k = 0; k < EPX_MAX_TOP_K; k++) {
        const int e = ids[k];
        pos[k] =
            e >= 0
                ? (int)(ex_tile[e] + ex_warp[warp * E + e] + __popc(ex_mask[warp * E + e] & below))
                : -1;
      }
      store_token_row(a.expand_pos + (size_t)t * K, pos, K);
    }
  }
  if (kFromMask) { /* the caller's expert counts; tile 0 copies them */
    if (tile == 0 && a.num_tokens_per_expert)
      for (int e = tid; e < E; e += kThreads)
        a.num_tokens_per_expert[e] = a.in_tokens_per_expert[e];
  } else if (a.num_tokens_per_expert) {
    for (int e = tid; e < E; e += kThreads)
      if (expert_count[e]) atomicAdd(&a.num_tokens_per_expert[e], expert_count[e]);
  }
  if (!last) return;

  /* 5. The last tile: totals per rank and the lowest invalid id of the call. */
  if (a.num_tokens_per_rank && tid < R) a.num_tokens_per_rank[tid] = (int)col_total[tid];
  if (!kFromMask && tid == 0 && col_total[kBadCol] != kNoBad) {
    const long long pos = (long long)col_total[kBadCol];
    epx::raise_error(ctx, EPX_ERR_INVALID_ARGUMENT, EPX_STAGE_LAYOUT, -1, pos,
                     (long long)topk[pos]);
  }
  /* One span per call: the last tile's, which waits for every other. */
  if (tid == 0) epx::trace_end(ctx, t_start, EPX_TRACE_LAYOUT, T);
}

}  // namespace

extern "C" epx_status_t epx__layout_launch(const epx__kernel_ctx_t *ctx,
                                           const epx__layout_launch_args_t *args,
                                           cudaStream_t stream) {
  const int blocks = args->num_tokens > 0 ? (args->num_tokens + kThreads - 1) / kThreads : 1;
  if ((size_t)blocks > ctx->layout.layout_tiles) /* callers check T <= max_tokens_per_rank */
    return epx__set_error(EPX_ERR_INTERNAL,
                          "layout: %d tokens need %d tiles; the workspace has words for %zu",
                          args->num_tokens, blocks, ctx->layout.layout_tiles);
  if (args->from_mask && args->expand_pos)
    return epx__set_error(EPX_ERR_INTERNAL, "layout: expert-major positions need ids");
  if (args->expand_pos && ctx->layout.expand_rows == 0)
    return epx__set_error(EPX_ERR_INTERNAL, "layout: the workspace has no expert-major columns");
  if (args->from_mask) /* no ids: the expert counts are copied, not summed */
    return epx::launch<layout_kernel<int, true, false>>(blocks, kThreads, 0, stream, *ctx, *args);
  if (args->num_tokens_per_expert)
    CUDA_CHECK(cudaMemsetAsync(args->num_tokens_per_expert, 0,
                               sizeof(int) * (size_t)args->num_experts, stream));
  return EPX_INDEX_SWITCH(args->idx_is_int64, IdxT, [&] {
    if (args->expand_pos)
      return epx::launch<layout_kernel<IdxT, false, true>>(
          blocks, kThreads, expand_smem_bytes(args->num_experts), stream, *ctx, *args);
    return epx::launch<layout_kernel<IdxT, false, false>>(blocks, kThreads, 0, stream, *ctx, *args);
  });
}

/*
 * ll_common.cuh - what the low-latency dispatch (ll_dispatch.cu) and combine (ll_combine.cu)
 * kernels share (design and measurements: docs/low-latency.md): the block shape, the addresses
 * of a rank's two ll buffers, signals and their bounded waits, the staged-row header and the
 * numbering of staged rows, rounds of planned items, number formats.
 *
 * Grid: config.ll_num_sms blocks of kThreads threads, the same on every rank. Block b of a rank
 * handles the tokens t = b, b + G, b + 2G, ... of that rank, so blocks pair up one to one across
 * ranks: a receiver block b needs only the sender blocks b (the DIRECT combine receive excepted).
 *
 * Signals are 64-bit words (epoch << 32) | value: written with a system-scope release after a
 * __syncthreads and a system fence, read with acquire loads in bounded waits. Each block keeps
 * its own epoch per (kind, buffer) in this rank's workspace and advances it once per call, so
 * all blocks of all ranks agree on a call's epoch and nothing is ever zeroed. A wait that runs
 * past the budget masks the peer (control->ll_peer_mask) and raises EPX_ERR_PEER_FAILED; masked
 * peers are neither sent to nor waited for. Data that peers wrote during this kernel is read
 * with ld.global.cg (L2, never a stale L1 line); every index read from a peer is range-checked.
 */
#ifndef EPX_KERNELS_LL_COMMON_CUH_
#define EPX_KERNELS_LL_COMMON_CUH_

#include <stddef.h>
#include <stdint.h>

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "kernel_ctx.h"
#include "workspace.h"
#include "kernels/api.h"
#include "kernels/bf16.cuh"
#include "kernels/fp8.cuh"
#include "kernels/ptx.cuh"
#include "kernels/wait.cuh"
#include "kernels/workspace.cuh"

namespace epx::ll {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = 512; /* channels of one warp unit: 16 per lane */
/* Tokens (send) or staged rows (receive, combine) a block handles per round (in_rounds). */
constexpr int kBatch = 8;
constexpr int kKindDispatch = 0, kKindCombine = 1;
constexpr uint32_t kNoSignal = 0xffffffffu; /* wait_signal: the peer is masked */
/* A combine signal's low word (otherwise 0): the sender's rows are not valid (rows_invalid) */
constexpr uint32_t kRowsInvalid = 1u;
constexpr unsigned kFull = 0xffffffffu;
static_assert(kChunk == 32 * 16,
              "a warp unit is 16 channels per lane (one FP8 int4, two BF16 int4)");
static_assert(kChunk % 128 == 0, "a chunk holds whole FP8 scale groups (8 lanes each)");
static_assert(kBatch <= kWarps, "warp w < kBatch plans item w of a round");
static_assert(kThreads >= EPX_MAX_RANKS && EPX_MAX_RANKS <= 32,
              "thread r signals and waits for rank r; peer masks are 32-bit");
static_assert(EPX_MAX_TOP_K <= 32, "lane k holds slot k of a token");

/* ------------------------------------------------------------------------------------------
 * Addresses and signals
 * ---------------------------------------------------------------------------------------- */
/* Buffer `parity` of rank r's low-latency region (arrays at the layout's ll_*_offset). */
__device__ __forceinline__ char *ll_buf(const epx__kernel_ctx_t &ctx, int r, int parity) {
  return ctx.peer_base[r] + ctx.layout.ll_offset + (size_t)parity * ctx.layout.ll_parity_bytes;
}

/* This rank's epoch of block `block` for (kind, parity). */
__device__ __forceinline__ uint32_t *epoch_slot(const epx__kernel_ctx_t &ctx, int kind, int parity,
                                                int block) {
  uint32_t *epochs =
      (uint32_t *)(ctx.peer_base[ctx.rank] + ctx.layout.ll_offset + ctx.layout.ll_epoch_offset);
  return epochs + (kind * 2 + parity) * EPX_LL_MAX_BLOCKS + block;
}

/* This block's epoch of (kind, its buffer) for this call: advanced by one when the call sends,
 * reused by the receive half of a split call. Thread 0 only. */
__device__ __forceinline__ uint32_t call_epoch(const epx__kernel_ctx_t &ctx, int kind, int parity,
                                               int phases) {
  uint32_t *slot = epoch_slot(ctx, kind, parity, blockIdx.x);
  uint32_t epoch = *slot;
  /* 0 is skipped when the counter wraps (after 2^32 calls of this kind and buffer: a day at
   * 20 us per call): zeroed words that were never written must never match a call's epoch. */
  if (phases & EPX_LL_PHASE_SEND) *slot = epoch = epoch + 1 == 0 ? 1 : epoch + 1;
  return epoch;
}

__device__ __forceinline__ unsigned read_mask(const epx__kernel_ctx_t &ctx) {
  return *(volatile unsigned *)&control_of(ctx)->ll_peer_mask;
}

/* Give up on `peer`: set its mask bit; the first block to do so records the async error. */
__device__ __forceinline__ void mask_peer(const epx__kernel_ctx_t &ctx, int peer, int stage,
                                          uint32_t epoch) {
  const unsigned bit = 1u << peer;
  const unsigned old = atomicOr(&control_of(ctx)->ll_peer_mask, bit);
  if (!(old & bit)) raise_error(ctx, EPX_ERR_PEER_FAILED, stage, peer, -1, (long long)epoch);
}

/* Wait until the signal of block `block` of `peer`, at [peer][block] of the flag array at
 * flag_offset in this rank's buffer `own`, carries `epoch`: its low word, or kNoSignal once the
 * peer is masked (before the wait, meanwhile by another block, or here after the budget). */
__device__ __forceinline__ uint32_t wait_signal(const epx__kernel_ctx_t &ctx, const char *own,
                                                size_t flag_offset, int peer, int block,
                                                uint32_t epoch, int stage) {
  const unsigned bit = 1u << peer;
  if (read_mask(ctx) & bit) return kNoSignal;
  const uint64_t *sig =
      (const uint64_t *)(own + flag_offset) + (size_t)peer * EPX_LL_MAX_BLOCKS + block;
  uint64_t v = 0;
  const WaitResult r = wait_until(
      ctx.timeout_ns,
      [&] {
        v = ld_acquire_sys(sig);
        return (uint32_t)(v >> 32) == epoch;
      },
      [&] { return (read_mask(ctx) & bit) != 0; });
  if (r == WaitResult::kReady) return (uint32_t)v;
  /* This rank's own blocks late (a co-running kernel held the SMs past the budget) is no dead
   * peer: the call gives up on them and says so (TIMEOUT), but a rank never masks itself, which
   * would leave it out of every later call (issue 14). */
  if (r == WaitResult::kTimedOut) {
    if (peer == ctx.rank)
      raise_error(ctx, EPX_ERR_TIMEOUT, stage, peer, -1, (long long)epoch);
    else
      mask_peer(ctx, peer, stage, epoch);
  }
  return kNoSignal;
}

/* Block b's signal to every unmasked rank r, at [me][b] of the flag array at flag_offset in r's
 * buffer `parity`. NOTE: the __syncthreads orders every store of the block before thread r's
 * system fence, and the release store publishes them together with the signal. */
__device__ __forceinline__ void signal_ranks(const epx__kernel_ctx_t &ctx, unsigned mask,
                                             size_t flag_offset, int parity, uint32_t epoch,
                                             uint32_t low) {
  __syncthreads();
  const int r = threadIdx.x;
  if (r < ctx.num_ranks && !((mask >> r) & 1u)) {
    __threadfence_system();
    uint64_t *sig = (uint64_t *)(ll_buf(ctx, r, parity) + flag_offset) +
                    (size_t)ctx.rank * EPX_LL_MAX_BLOCKS + blockIdx.x;
    st_release_sys(sig, ((uint64_t)epoch << 32) | low);
  }
}

/* Tokens t < T with t % G == b: how many. */
__device__ __forceinline__ int tokens_of_block(int T, int b, int G) {
  return T > b ? (T - b + G - 1) / G : 0;
}

/* A block's view of its call, read once at the kernel's start and passed to every phase, which
 * then share these loads, the division and the buffer address (a kernel reads only the fields it
 * uses; the others cost nothing). */
struct Call {
  int tid, lane, warp, b, G; /* thread, lane, warp, block, blocks */
  int R, me;                 /* ranks, this rank */
  int H, K, E, L, M, T;      /* hidden, top-k, experts, local experts (E / R), max tokens, tokens */
  int p, nch;                /* the buffer (parity), kChunk-channel chunks of a row */
  size_t RM;                 /* rows per local expert: R x M */
  char *own;                 /* this rank's buffer `p` */
};

/* Args: epx__ll_dispatch_launch_args_t or epx__ll_combine_launch_args_t. */
template <typename Args>
__device__ __forceinline__ Call load_call(const epx__kernel_ctx_t &ctx, const Args &a) {
  Call c;
  c.tid = threadIdx.x;
  c.lane = c.tid & 31;
  c.warp = c.tid >> 5;
  c.b = blockIdx.x;
  c.G = gridDim.x;
  c.R = ctx.num_ranks;
  c.me = ctx.rank;
  c.H = a.hidden;
  c.K = a.top_k;
  c.E = a.num_experts;
  c.L = c.E / c.R;
  c.M = a.max_tokens;
  c.T = a.num_tokens;
  c.p = a.parity;
  c.nch = (c.H + kChunk - 1) / kChunk;
  c.RM = ctx.layout.ll_rows;
  c.own = ll_buf(ctx, c.me, c.p);
  return c;
}

/* Items [0, n) in rounds of up to kBatch: warp w < kBatch plans item r0 + w of the round
 * (plan(item, w)), then all warps copy the round's (item, chunk) units (copy(r0, nb)), so a round
 * costs one load latency however many items it holds. Every thread of the block calls it. */
template <typename PlanFn, typename CopyFn>
__device__ __forceinline__ void in_rounds(int warp, int n, const PlanFn &plan, const CopyFn &copy) {
  for (int r0 = 0; r0 < n; r0 += kBatch) {
    const int nb = n - r0 < kBatch ? n - r0 : kBatch;
    if (warp < nb) plan(r0 + warp, warp);
    __syncthreads();
    copy(r0, nb);
    __syncthreads(); /* the plans are rewritten in the next round */
  }
}

/* ------------------------------------------------------------------------------------------
 * Staged rows (BY_RANK dispatch): stage[s][t] of rank d holds source s's token t for d's
 * experts: a StagedHeader (EPX_LL_HEADER_BYTES), the payload, FP8 scales. Combine BY_RANK reads
 * the headers again (the own rank's too: the dispatch writes its header, not its row).
 * ---------------------------------------------------------------------------------------- */
/* packed[i] of entry i: position | local expert << 16 | slot << 26. */
constexpr int kPosBits = 16, kExpertBits = 10, kSlotBits = 6;

struct alignas(16) StagedHeader {
  uint32_t epoch; /* the dispatch's: a header of an earlier call never matches */
  int token, entries, reserved;
  uint32_t packed[EPX_MAX_TOP_K]; /* entry i: pack_entry(position, local expert, first slot) */
  float weight[EPX_MAX_TOP_K];    /* entry i: the token's summed weight of that expert */
};

static_assert(sizeof(StagedHeader) == EPX_LL_HEADER_BYTES, "EPX_LL_HEADER_BYTES is the header");
static_assert(offsetof(StagedHeader, packed) == sizeof(int4), "the head is one 16-byte load");
static_assert(kPosBits + kExpertBits + kSlotBits == 32, "an entry is one 32-bit word");
static_assert(EPX_MAX_TOKENS_PER_RANK <= 1 << kPosBits, "a position is < max_tokens_per_rank");
static_assert(EPX_MAX_EXPERTS <= 1 << kExpertBits, "a local expert is < num_experts");
static_assert(EPX_MAX_TOP_K <= 1 << kSlotBits, "a slot is < top_k");

struct StagedEntry {
  int pos, expert, slot; /* position, local expert, the token's first top-k slot naming it */
};

__device__ __forceinline__ uint32_t pack_entry(int pos, int expert, int slot) {
  return (uint32_t)pos | ((uint32_t)expert << kPosBits) |
         ((uint32_t)slot << (kPosBits + kExpertBits));
}

__device__ __forceinline__ StagedEntry unpack_entry(uint32_t packed) {
  StagedEntry en;
  en.pos = (int)(packed & ((1u << kPosBits) - 1u));
  en.expert = (int)((packed >> kPosBits) & ((1u << kExpertBits) - 1u));
  en.slot = (int)(packed >> (kPosBits + kExpertBits));
  return en;
}

/* One lane: the head (epoch, token t, entries n) as one 16-byte store. */
__device__ __forceinline__ void store_head(StagedHeader *h, uint32_t epoch, int t, int n) {
  *(int4 *)h = make_int4((int)epoch, t, n, 0);
}

/* The entries of h (0 unless it carries token t of the dispatch of `epoch`), at most K: one
 * 16-byte load. */
__device__ __forceinline__ int load_entries(const StagedHeader *h, uint32_t epoch, int t, int K) {
  const int4 head = __ldcg((const int4 *)h);
  const int n = ((uint32_t)head.x == epoch && head.y == t) ? head.z : 0;
  return n < 0 ? 0 : n > K ? K : n;
}

/* The rows that blocks b of the sources staged here, numbered source-major: source s holds rows
 * start[s] .. start[s + 1] - 1, row start[s] + i being its token b + i G. */
struct SourceRows {
  int start[EPX_MAX_RANKS + 1];

  /* rows_of(s): the rows of source s. Returns the total. */
  template <typename RowsOf>
  __device__ __forceinline__ int count(int R, RowsOf rows_of) {
    start[0] = 0;
    for (int s = 0; s < R; s++) start[s + 1] = start[s] + rows_of(s);
    return start[R];
  }

  /* The source of row r < total, and its token into *t. */
  __device__ __forceinline__ int source_of(int r, int b, int G, int *t) const {
    int s = 0;
    while (r >= start[s + 1]) s++;
    *t = b + (r - start[s]) * G;
    return s;
  }
};

/* ------------------------------------------------------------------------------------------
 * Number formats (BF16 packs in kernels/bf16.cuh)
 * ---------------------------------------------------------------------------------------- */
using epx::acc_bf16x8;
using epx::bf16x8_to_float;
using epx::float8_to_bf16x8;

/* FP8 E4M3 of 16 channels (kernels/fp8.cuh). */
using epx::quantize16;

}  // namespace epx::ll

#endif  // EPX_KERNELS_LL_COMMON_CUH_

/*
 * normal_combine.cu - normal (high-throughput) mode's combine over NVLink, the mirror image of
 * the dispatch: rank d pushes its p-th row from source s into s's combine slab at (d, p); s then
 * sums, for each token t, the rows (d, token_pos_in_rank[t][d]) in float32 and writes BF16 once.
 * This rank's own rows are read straight from the combine input, never copied.
 *
 * Roles: num_blocks blocks of kThreads; in each, kSendWarps send warps push this rank's received
 * rows back (lane 0 drives a pipeline of bulk copies through shared memory) while the other
 * kReduceWarps reduce warps sum this rank's own tokens as their rows arrive; the last block to
 * finish clears the counters and tells every peer (combine_finish).
 *
 * Send: the rows of each remote source are cut into units of kUnitRows rows; unit u is round
 * u / (R - 1) of source (me + 1 + u % (R - 1)) % R, so every source's segment fills front to back
 * at the same pace; send warps take unit ids from a counter shared by the grid. Invariant: after
 * a unit's stores are complete, its warp adds the unit's row count, with release, to s's counter
 * of that chunk (EPX_COMBINE_CHUNK_ROWS rows; units never straddle one).
 * Reduce: token t needs row pos[t][d] of each rank d holding it; d's chunk of that row is full
 * when its counter reaches min(CHUNK_ROWS, rows from d - chunk start), and only then is it read.
 *
 * kExtras (combine_extras.cuh): the call also returns the rows' top-k weights summed per token
 * and/or adds bias rows; without them the kernel is compiled exactly as before.
 *
 * The work split and the send pipeline are compile-time constants: the winners of a sweep on
 * 4x H200 (docs/performance.md; dev/README.md says how to sweep again).
 */
#include <type_traits>

#include "checks.h"
#include "kernels/api.h"
#include "kernels/bf16.cuh"
#include "kernels/combine_extras.cuh"
#include "kernels/launch.cuh"
#include "kernels/trace.cuh"
#include "kernels/wait.cuh"
#include "kernels/workspace.cuh"

namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kSendWarps = 6; /* of each block's kWarps; the others reduce */
constexpr int kReduceWarps = kWarps - kSendWarps;
constexpr int kUnitRows = 4;     /* rows per send unit */
constexpr int kReduceTokens = 1; /* consecutive tokens per reduce unit */
/* A send warp's pipeline: kStages stages share kWarpStageBytes of shared memory; loads run up to
 * kStages pieces ahead of the stores; a stage is refilled once at most kStoreDepth stores still
 * read shared memory; a unit is signalled kSignalLag pieces after its last store, so the wait
 * for remote completion never drains the pipeline. */
constexpr int kStages = 4;
constexpr int kWarpStageBytes = 32768;
constexpr int kPieceBytes = kWarpStageBytes / kStages; /* one stage, one bulk copy at most */
constexpr int kStoreDepth = 1;
constexpr int kSignalLag = 2;
/* Units ended by a store and not yet signalled: the last kSignalLag stores' and this store's. */
constexpr int kPendingUnits = kSignalLag + 1;
/* Unit ids the load cursor has taken and the store cursor has not reached: at most one per
 * piece in flight (kStages) plus the load cursor's next one. A power of two. */
constexpr int kUnitQueue = 8;
/* Added to a chunk's counter with every unit a rank sends when its rows are not valid
 * (rows_invalid), for the reducer to see. Waits compare the count below it (kCountBits), so a
 * marked chunk is still waited for until all its rows are in: the last block's clearing of the
 * counters (combine_finish) must come after every add of the call, marked or not. No count comes
 * near it (a chunk holds EPX_COMBINE_CHUNK_ROWS rows; call numbers stay far below 2^40). */
constexpr uint64_t kInvalidRows = 1ull << 40;
constexpr uint64_t kCountBits = kInvalidRows - 1;
/* Chunk waits of the reduce warps sleep between polls, leaving issue slots to the send warps. */
constexpr int kChunkPollSleepNs = 128;
/* Shared memory one block may opt into on sm_90. */
constexpr size_t kMaxBlockSharedBytes = 227 * 1024;

/* Dynamic shared memory: each send warp's stages, then its stages' barriers. */
struct SendSmem {
  char stage[kSendWarps][kWarpStageBytes];
  uint64_t bar[kSendWarps][kStages];
};

static_assert(kThreads % 32 == 0 && kThreads > EPX_MAX_RANKS, "thread r <= R reads prefix[r]");
static_assert(EPX_MAX_RANKS <= 32, "lane d of a warp stands for rank d");
static_assert(kSendWarps >= 1 && kSendWarps < kWarps, "every block needs send and reduce warps");
static_assert(kUnitRows >= 1 && (kUnitRows & (kUnitRows - 1)) == 0 &&
                  EPX_COMBINE_CHUNK_ROWS % kUnitRows == 0,
              "unit rows: a power of two dividing the chunk, so a unit never straddles a chunk");
static_assert(kReduceTokens >= 1, "a reduce unit holds at least one token");
static_assert(kStages >= 2 && kWarpStageBytes % kStages == 0 && kPieceBytes % 16 == 0,
              "bulk copies move multiples of 16 bytes between 16-byte aligned stages");
static_assert(kStoreDepth >= 1 && kStoreDepth < kStages,
              "a refill waits for stores up to kStoreDepth back: that stage must be another one");
static_assert(kSignalLag >= 0 && kSignalLag + 1 <= kPendingUnits,
              "pending holds the units of the last kSignalLag stores and of this one");
static_assert(kUnitQueue > kStages + 1 && (kUnitQueue & (kUnitQueue - 1)) == 0,
              "the unit queue holds every unit between the store and the load cursor");
/* 128: the kernel's static shared memory (prefix, last), well under it. */
static_assert(sizeof(SendSmem) == (size_t)kSendWarps * (kWarpStageBytes + kStages * 8) &&
                  sizeof(SendSmem) + 128 <= kMaxBlockSharedBytes,
              "the send warps' stages and barriers, with the static bytes, fit one block");

/* The kernel's extras argument: epx__combine_extras_t with kExtras, else nothing (an empty
 * parameter leaves a plain combine's kernel as it was). */
struct NoExtras {};
template <bool kExtras>
using ExtrasOf = std::conditional_t<kExtras, epx__combine_extras_t, NoExtras>;

template <bool kExtras>
ExtrasOf<kExtras> extras_arg(const epx__combine_extras_t &x) {
  if constexpr (kExtras)
    return x;
  else
    return NoExtras();
}

/* What every warp of the block needs to know about this combine call, computed once by each
 * thread before the roles split. Call n uses parity n mod 2 of the slab and of the counters. */
struct CombineView {
  unsigned call;        /* combines this rank completed before this one */
  size_t slab;          /* workspace offset of this parity's slab [R, max_tokens, H] BF16 */
  size_t signal;        /* workspace offset of this parity's counters [R, chunks] u64 */
  size_t weights;       /* workspace offset of this parity's top-k weights [R, max_tokens, K] */
  size_t row_bytes;     /* H * 2 */
  int n16;              /* 16-byte words per row */
  int experts_per_rank; /* E / R */
};

/* Every wait of a combine call: until ready(), bounded, giving up at once when another wait of
 * this call has already timed out (so a dead peer costs one budget, not one per chunk). On a
 * timeout raises EPX_ERR_TIMEOUT (stage COMBINE, naming peer, position and value) and marks the
 * call aborted. True when ready. */
template <typename Ready>
__device__ __forceinline__ bool combine_wait(const epx__kernel_ctx_t &ctx, const CombineView &cv,
                                             Ready ready, int peer, long long position,
                                             long long value) {
  epx__control_t *ctrl = epx::control_of(ctx);
  const unsigned aborted = cv.call + 1;
  const epx::WaitResult r = epx::wait_until<kChunkPollSleepNs>(ctx.timeout_ns, ready, [&] {
    return *(volatile const unsigned *)&ctrl->combine_abort == aborted;
  });
  if (r == epx::WaitResult::kTimedOut) {
    epx::raise_error(ctx, EPX_ERR_TIMEOUT, EPX_STAGE_COMBINE, peer, position, value);
    atomicExch(&ctrl->combine_abort, aborted);
  }
  return r == epx::WaitResult::kReady;
}

/* Wait until *flag's count (kCountBits) >= target (combine_wait, naming the peer and target). */
__device__ __forceinline__ bool wait_chunk(const epx__kernel_ctx_t &ctx, const CombineView &cv,
                                           const uint64_t *flag, uint64_t target, int peer) {
  return combine_wait(
      ctx, cv, [&] { return (epx::ld_acquire_sys(flag) & kCountBits) >= target; }, peer, -1,
      (long long)target);
}

/* Lane p, a peer: wait until p has finished the combine that last used this call's slab parity
 * (call - 2), as every store into p's slab must (wait_chunk, naming p). True when it has. */
__device__ __forceinline__ bool wait_parity_free(const epx__kernel_ctx_t &ctx,
                                                 const CombineView &cv, int lane) {
  return wait_chunk(ctx, cv, (const uint64_t *)&epx::control_of(ctx)->combine_finished[lane],
                    cv.call - 1, lane);
}

/* Gated combines (a.gate): wait until source s's rows are written on this GPU (combine_wait,
 * naming this rank, s and the gate value: its own FFN never finished). Returns whether they are
 * valid: false for the invalid bit, and after a timeout or another wait's, so that the rows then
 * go marked instead of never, and the peers record EPX_ERR_PEER_DATA, not a timeout. */
__device__ __forceinline__ bool wait_gate(const epx__kernel_ctx_t &ctx,
                                          const epx__combine_launch_args_t &a,
                                          const CombineView &cv, int s) {
  constexpr unsigned kInvalidBit = 1u << 31;
  unsigned v = 0;
  const bool ready = combine_wait(
      ctx, cv,
      [&] {
        v = epx::ld_acquire_gpu_u32((const uint32_t *)a.gate + s);
        return (v & ~kInvalidBit) == a.gate_value;
      },
      ctx.rank, s, (long long)a.gate_value);
  return ready && !(v & kInvalidBit);
}

/* ---- Send ------------------------------------------------------------------------------- */

/* The send list of one combine: unit u is rows [p0, p1) of remote source s (see the top). Its
 * rows are consecutive in the combine input and in s's slab, so a unit is one contiguous span. */
struct SendPlan {
  const char *x; /* combine input */
  char *slab[EPX_MAX_RANKS];
  unsigned long long *signal[EPX_MAX_RANKS]; /* s's counters of my segment */
  const int *prefix;
  unsigned *next_unit;     /* the grid's unit counter */
  unsigned long long mark; /* added to each unit's count: kInvalidRows with rows_invalid, else 0 */
  int me, R;
  size_t row_bytes;
  long long units;
  /* Gated: the units go source by source (units_per_source each, this rank + 1 first), each
   * source's once its gate opens (wait_gate) */
  bool gated;
  long long units_per_source;
};

/* kExtras: the [num_recv, K] top-k weights to send with the rows (NULL: none) and the offset of
 * my segment in every peer's weights region. Empty otherwise, so the plain send keeps its
 * registers and stack. */
template <bool kExtras>
struct SendWeights {};
template <>
struct SendWeights<true> {
  const float *src;
  size_t off;
  int K;
};

struct SendUnit {
  int s, p0, p1;
};

/* Unit u, or false if it is empty (s has fewer rows). */
__device__ __forceinline__ bool send_unit(const SendPlan &plan, long long u, SendUnit *su) {
  const int remote = plan.R - 1;
  const long long phase = plan.gated ? u / plan.units_per_source : u % remote;
  const long long round = plan.gated ? u % plan.units_per_source : u / remote;
  su->s = (plan.me + 1 + (int)phase) % plan.R;
  su->p0 = (int)round * kUnitRows;
  const int rows = plan.prefix[su->s + 1] - plan.prefix[su->s];
  su->p1 = min(su->p0 + kUnitRows, rows);
  return su->p0 < rows;
}

__device__ __forceinline__ const char *unit_src(const SendPlan &plan, const SendUnit &su) {
  return plan.x + (size_t)(plan.prefix[su.s] + su.p0) * plan.row_bytes;
}
__device__ __forceinline__ char *unit_dst(const SendPlan &plan, const SendUnit &su) {
  return plan.slab[su.s] + (size_t)su.p0 * plan.row_bytes;
}

/* The unit's rows are written: add them to s's counter of their chunk. The caller has ordered
 * the unit's writes before this thread (a bulk-group wait). Traced as a span from *mark (the
 * previous unit's signal, or the send's start) to now. */
__device__ __forceinline__ void signal_unit(const epx__kernel_ctx_t &ctx, const SendPlan &plan,
                                            const SendUnit &su, unsigned gate_invalid,
                                            uint64_t *mark) {
  __threadfence_system();
  const unsigned long long invalid = (gate_invalid >> su.s) & 1u ? kInvalidRows : plan.mark;
  epx::red_release_sys_add(plan.signal[su.s] + su.p0 / EPX_COMBINE_CHUNK_ROWS,
                           (unsigned long long)(su.p1 - su.p0) + invalid);
  epx::trace_end(ctx, *mark, EPX_TRACE_COMBINE_UNIT, su.s);
  *mark = epx::trace_begin(ctx);
}

struct PieceCursor {
  long long u;
  SendUnit su;
  size_t off, span; /* bytes into the unit's span, and the span */
  bool valid;
};

/* The load cursor takes units from the grid's counter and queues the non-empty ones (then -1
 * when the list is exhausted); the store cursor, which trails it by at most kStages pieces,
 * follows the queue, so both walk the same units. Unit ids grow, keeping the list's order. */
struct UnitQueue {
  long long id[kUnitQueue];
  int head, tail;
  unsigned gate_open, gate_invalid; /* gated: sources whose gate this lane saw open; not valid */
};

__device__ __forceinline__ void cursor_start(const SendPlan &plan, long long u, PieceCursor *c) {
  c->u = u;
  c->valid = u >= 0;
  if (!c->valid) return;
  send_unit(plan, u, &c->su);
  c->off = 0;
  c->span = (size_t)(c->su.p1 - c->su.p0) * plan.row_bytes;
}

/* Advance the cursor to its next unit: from the grid's counter (the load cursor, which queues
 * it) or from the queue (the store cursor). */
__device__ __forceinline__ void cursor_seek(const SendPlan &plan, UnitQueue *q, bool is_load,
                                            PieceCursor *c) {
  long long u = -1;
  if (is_load) {
    SendUnit su;
    for (;;) {
      const long long v = (long long)atomicAdd(plan.next_unit, 1u);
      if (v >= plan.units) break;
      if (send_unit(plan, v, &su)) {
        u = v;
        break;
      }
    }
    q->id[q->head++ % kUnitQueue] = u;
  } else {
    u = q->id[q->tail++ % kUnitQueue];
  }
  cursor_start(plan, u, c);
}

/* Bytes of the cursor's piece; advances it. *unit_end: the piece was its unit's last. */
__device__ __forceinline__ uint32_t cursor_next(const SendPlan &plan, UnitQueue *q, bool is_load,
                                                PieceCursor *c, size_t *off, bool *unit_end) {
  const uint32_t bytes = (uint32_t)min((size_t)kPieceBytes, c->span - c->off);
  *off = c->off;
  c->off += bytes;
  *unit_end = c->off == c->span;
  if (*unit_end) cursor_seek(plan, q, is_load, c);
  return bytes;
}

/* kExtras: the top-k weights of a unit whose last piece was just stored; the unit's signal,
 * kSignalLag pieces later, publishes them with its rows. */
__device__ __forceinline__ void send_unit_weights(const epx__kernel_ctx_t &ctx,
                                                  const SendPlan &plan, const SendWeights<true> &sw,
                                                  const SendUnit &su) {
  if (!sw.src) return;
  float *dst = (float *)(ctx.peer_base[su.s] + sw.off) + (size_t)su.p0 * sw.K;
  epx::copy_unit_weights(sw.src + (size_t)(plan.prefix[su.s] + su.p0) * sw.K, dst,
                         (su.p1 - su.p0) * sw.K);
}

/* Lane 0 of a send warp: every unit it takes, through `stages` (kStages x kPieceBytes) and
 * their barriers. Returns the number of units sent.
 * Gated: a unit is loaded only once its source's gate is open. While the load cursor's unit waits
 * for its gate, the stores already loaded go on; once none is left, every unit is completed and
 * signalled before the warp waits (so a phase's last rows never wait for the next phase's gate),
 * then the loads start again. */
template <bool kExtras, bool kGated>
__device__ int send_units(const epx__kernel_ctx_t &ctx, const epx__combine_launch_args_t &a,
                          const CombineView &cv, const SendPlan &plan, SendWeights<kExtras> sw,
                          char *stages, uint64_t *bars) {
  PieceCursor load, store;
  UnitQueue queue;
  queue.head = queue.tail = 0;
  queue.gate_open = queue.gate_invalid = 0;
  cursor_seek(plan, &queue, true, &load);
  cursor_seek(plan, &queue, false, &store);
  long long loads = 0, stores = 0;
  /* Units whose last piece is store group `group`, not yet signalled. */
  SendUnit pending[kPendingUnits];
  long long pending_group[kPendingUnits];
  int num_pending = 0, sent = 0;
  uint64_t mark = epx::trace_begin(ctx);
  auto gate_closed = [&]() {
    if constexpr (kGated)
      return load.valid && !((queue.gate_open >> load.su.s) & 1u);
    else
      return false;
  };
  auto issue_load = [&]() {
    size_t off;
    bool end;
    const SendUnit su = load.su;
    const int st = (int)(loads % kStages);
    const uint32_t bytes = cursor_next(plan, &queue, true, &load, &off, &end);
    epx::bulk_load(stages + (size_t)st * kPieceBytes, unit_src(plan, su) + off, bytes, &bars[st]);
    loads++;
  };
  auto signal_pending = [&](long long upto) {
    int kept = 0;
    for (int i = 0; i < num_pending; i++) {
      if (pending_group[i] <= upto)
        signal_unit(ctx, plan, pending[i], queue.gate_invalid, &mark), sent++;
      else
        pending[kept] = pending[i], pending_group[kept++] = pending_group[i];
    }
    num_pending = kept;
  };
  while (load.valid && loads < kStages && !gate_closed()) issue_load();
  while (store.valid) {
    if (kGated && stores == loads) { /* nothing loaded: the load cursor's unit waits for its gate */
      epx::bulk_wait_done<0>();
      signal_pending(stores);
      const int s = load.su.s;
      if (!wait_gate(ctx, a, cv, s)) queue.gate_invalid |= 1u << s;
      queue.gate_open |= 1u << s;
      epx::fence_proxy_async_global(); /* the acquire before the bulk copies of those rows */
      while (load.valid && loads - stores < kStages && !gate_closed()) issue_load();
    }
    const int st = (int)(stores % kStages);
    /* The stage's load has landed: its barrier completed phase `parity` of its use. */
    const uint32_t parity = (uint32_t)((stores / kStages) & 1);
    const epx::WaitResult loaded = epx::wait_until(
        ctx.timeout_ns, [&] { return epx::mbarrier_try_wait(&bars[st], parity); },
        epx::NeverAbandon());
    if (loaded != epx::WaitResult::kReady) {
      epx::raise_error(ctx, EPX_ERR_TIMEOUT, EPX_STAGE_COMBINE, plan.me, -1, stores);
      break;
    }
    size_t off;
    bool end;
    const SendUnit su = store.su;
    const uint32_t bytes = cursor_next(plan, &queue, false, &store, &off, &end); /* = its load's */
    epx::bulk_store(unit_dst(plan, su) + off, stages + (size_t)st * kPieceBytes, bytes);
    if (end) {
      if constexpr (kExtras) send_unit_weights(ctx, plan, sw, su);
      pending[num_pending] = su;
      pending_group[num_pending++] = stores;
    }
    /* Refill the stage of store (loads - kStages) once it has been read: up to kStoreDepth stores
     * stay in flight while the loads run kStages - kStoreDepth pieces ahead. The count, not
     * `stores >= kStoreDepth`: after a gate's wait the loads start again kStages ahead, and the
     * next refill's stage is then the one the store just issued still reads (a review found
     * it; the plain combine refills exactly as before). */
    if (loads - stores <= kStages - kStoreDepth && load.valid && !gate_closed()) {
      epx::bulk_wait_read<kStoreDepth>();
      issue_load();
    }
    if (num_pending && pending_group[0] <= stores - kSignalLag) {
      epx::bulk_wait_done<kSignalLag>();
      signal_pending(stores - kSignalLag);
    }
    stores++;
  }
  epx::bulk_wait_done<0>();
  signal_pending(stores);
  return sent;
}

/* Gated with rows_sent (the rows are in the peers' slabs already: the copy engines wrote them
 * before this kernel started, so stream order publishes them): lane 0 of a send warp takes
 * (source, chunk) pairs from the grid's unit counter, the remote sources in the gated order, and
 * adds each chunk's rows to s's counter with release, as the units' signals would, marked where
 * s's gate says its rows are not valid. Returns the chunks signalled (the COMBINE_SEND trace
 * span's value: chunks here, units in a combine that stores). */
__device__ int signal_sent_rows(const epx__kernel_ctx_t &ctx, const epx__combine_launch_args_t &a,
                                const CombineView &cv, const SendPlan &plan) {
  const size_t per_source = ctx.layout.combine_chunks;
  const long long pairs = (long long)per_source * (plan.R - 1);
  uint64_t mark = epx::trace_begin(ctx);
  int sent = 0;
  for (;;) {
    const long long v = (long long)atomicAdd(plan.next_unit, 1u);
    if (v >= pairs) break;
    const int s = (plan.me + 1 + (int)(v / (long long)per_source)) % plan.R;
    const int c = (int)(v % (long long)per_source);
    const int rows = plan.prefix[s + 1] - plan.prefix[s];
    const int r0 = c * EPX_COMBINE_CHUNK_ROWS;
    if (r0 >= rows) continue;
    SendUnit su;
    su.s = s, su.p0 = r0, su.p1 = min(r0 + EPX_COMBINE_CHUNK_ROWS, rows);
    const unsigned invalid = wait_gate(ctx, a, cv, s) ? 0u : 1u << s;
    signal_unit(ctx, plan, su, invalid, &mark);
    sent++;
  }
  return sent;
}

/* A send warp: once every peer has finished the call that last used this parity (call - 2),
 * lane 0 sends the units it takes into the peers' slabs. */
template <bool kExtras, bool kGated>
__device__ __forceinline__ void combine_send(const epx__kernel_ctx_t &ctx,
                                             const epx__combine_launch_args_t &a,
                                             const ExtrasOf<kExtras> &x, const CombineView &cv,
                                             const int *prefix, int warp, int lane) {
  const int R = ctx.num_ranks, me = ctx.rank;
  const uint64_t t_send = epx::trace_begin(ctx);
  int sent = 0;
  bool ok = true;
  if (cv.call >= 2) {
    const bool waits = lane < R && lane != me;
    const uint64_t t_wait = epx::trace_begin(ctx);
    if (waits) ok = wait_parity_free(ctx, cv, lane);
    epx::trace_end_last(ctx, t_wait, EPX_TRACE_COMBINE_WAIT, waits ? lane : -1);
  }
  if (__all_sync(0xffffffffu, ok) && lane == 0) {
    SendPlan plan;
    plan.x = (const char *)a.x;
    plan.prefix = prefix;
    plan.next_unit = &epx::control_of(ctx)->combine_next_unit;
    plan.me = me, plan.R = R;
    /* rows copied into the other parity than this call's are not where the peers read */
    const bool misplaced =
        kGated && a.rows_sent && a.rows_sent_parity <= 1u && (cv.call & 1u) != a.rows_sent_parity;
    if (misplaced && warp == 0 && blockIdx.x == 0)
      epx::raise_error(ctx, EPX_ERR_INTERNAL, EPX_STAGE_COMBINE, me, (long long)a.rows_sent_parity,
                       (long long)cv.call);
    plan.mark = a.rows_invalid || misplaced ? kInvalidRows : 0;
    plan.row_bytes = cv.row_bytes;
    const size_t chunks = ctx.layout.combine_chunks;
    int most_rows = 0;
    for (int s = 0; s < R; s++) {
      most_rows = max(most_rows, prefix[s + 1] - prefix[s]);
      plan.slab[s] = ctx.peer_base[s] + cv.slab + (size_t)me * a.max_tokens * plan.row_bytes;
      plan.signal[s] = (unsigned long long *)(ctx.peer_base[s] + cv.signal) + (size_t)me * chunks;
    }
    plan.units_per_source = (most_rows + kUnitRows - 1) / kUnitRows;
    plan.units = plan.units_per_source * (R - 1);
    plan.gated = kGated;
    SendWeights<kExtras> sw;
    if constexpr (kExtras) {
      sw.src = x.recv_topk_weights;
      sw.K = a.top_k;
      sw.off = cv.weights + (size_t)me * a.max_tokens * a.top_k * sizeof(float);
    }
    extern __shared__ __align__(128) char dyn_smem[];
    SendSmem *smem = (SendSmem *)dyn_smem;
    for (int i = 0; i < kStages; i++) epx::mbarrier_init(&smem->bar[warp][i], 1);
    epx::fence_mbarrier_init();
    if (kGated && a.rows_sent)
      sent = signal_sent_rows(ctx, a, cv, plan);
    else
      sent = send_units<kExtras, kGated>(ctx, a, cv, plan, sw, smem->stage[warp], smem->bar[warp]);
  }
  if (lane == 0) epx::trace_end(ctx, t_send, EPX_TRACE_COMBINE_SEND, sent);
}

/* ---- Reduce ----------------------------------------------------------------------------- */

/* out[t] = sum over ranks d in mask of factor(t, d) * row(d, pos_d), in float32; lane d holds
 * pos_d in my_pos. kRanks: the rank count as a compile-time constant, so that the row pointers
 * and factors stay in registers and kRanks x kReduceUnroll rows of loads are in flight (more
 * chunks in flight with fewer ranks). kExtras: the bias rows given are loaded with the rows and
 * added after them (combine_extras.cuh). */
template <typename IdxT, int kRanks, bool kExtras>
__device__ __forceinline__ void reduce_token(const epx__kernel_ctx_t &ctx,
                                             const epx__combine_launch_args_t &a,
                                             const ExtrasOf<kExtras> &x, const CombineView &cv,
                                             const int *prefix, const char *slab_base, int t,
                                             unsigned mask, int my_pos, int lane) {
  /* kExtras at 8 ranks: one chunk, or the bias words spill (ptxas -v). */
  constexpr int kReduceUnroll = kRanks <= 4 ? 4 : (kExtras ? 1 : 2);
  const int me = ctx.rank, K = a.top_k, n16 = cv.n16;
  const int epr = cv.experts_per_rank;
  const IdxT *topk = (const IdxT *)a.topk_idx;
  /* Lane k < K: the rank holding the token's k-th expert (-1: none, or an invalid id), and the
   * expert's weight; none without weights, where every rank's factor is 1. */
  int e_rank = -1;
  float w = 0.f;
  if (a.topk_weights && lane < K) {
    const long long e = (long long)topk[(size_t)t * K + lane];
    if (e >= 0 && e < a.num_experts) e_rank = (int)e / epr;
    w = a.topk_weights[(size_t)t * K + lane];
  }
  const float unweighted = a.topk_weights ? 0.f : 1.f;
  /* Row pointers and factors stay in registers: every index below is a compile-time one. */
  const int4 *src[kRanks];
  float factor[kRanks];
#pragma unroll
  for (int r = 0; r < kRanks; r++) {
    const int pos = __shfl_sync(0xffffffffu, my_pos, r);
    src[r] = r == me ? (const int4 *)a.x + (size_t)(prefix[me] + pos) * n16
                     : (const int4 *)(slab_base + ((size_t)r * a.max_tokens + pos) * cv.row_bytes);
    float f = e_rank == r ? w : 0.f;
#pragma unroll
    for (int o = 16; o; o >>= 1) f += __shfl_xor_sync(0xffffffffu, f, o);
    factor[r] = f + unweighted;
  }
  int4 *out = (int4 *)((char *)a.out + (size_t)t * cv.row_bytes);
  /* kReduceUnroll chunks x up to R rows of loads in flight per lane before any arithmetic.
   * NOTE: plain loads, not .nc: peers wrote these rows during this kernel. */
  for (int i0 = lane; i0 < n16; i0 += 32 * kReduceUnroll) {
    int4 v[kReduceUnroll][kRanks];
#pragma unroll
    for (int u = 0; u < kReduceUnroll; u++)
#pragma unroll
      for (int r = 0; r < kRanks; r++)
        if (((mask >> r) & 1u) && i0 + u * 32 < n16) v[u][r] = src[r][i0 + u * 32];
#pragma unroll
    for (int u = 0; u < kReduceUnroll; u++) {
      if (i0 + u * 32 >= n16) break;
      /* kExtras: the bias words are loaded here, one chunk at a time, from the kernel parameter's
       * pointers: loaded with the rows, or with pointers kept in registers, they spill at 4 and 8
       * ranks. */
      int4 b[2];
      if constexpr (kExtras)
        for (int j = 0; j < 2; j++)
          if (x.bias[j]) b[j] = ((const int4 *)x.bias[j])[(size_t)t * n16 + i0 + u * 32];
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
      for (int r = 0; r < kRanks; r++)
        if ((mask >> r) & 1u) epx::acc_bf16x8(v[u][r], factor[r], acc);
      if constexpr (kExtras) epx::add_bias_bf16x8(x.bias, b, acc);
      out[i0 + u * 32] = epx::float8_to_bf16x8(acc);
    }
  }
}

/* Tokens t < T in the units [first + i * stride, + kReduceTokens) of one reduce warp: every
 * unit but the last is whole (stride >= kReduceTokens). Computed at the end rather than
 * counted, which keeps a register free in the reduce loop. */
__device__ __forceinline__ int tokens_in_units(int first, int stride, int T) {
  if (first >= T) return 0;
  const int units = (T - first + stride - 1) / stride, last = first + (units - 1) * stride;
  return (units - 1) * kReduceTokens + min(kReduceTokens, T - last);
}

/* A reduce warp (reduce_warp of the block's kReduceWarps): this rank's tokens in units of
 * kReduceTokens, round-robin over the grid; before a token's rows are read, lane d waits until
 * rank d's chunk holding its row is full (which publishes the row's top-k weights too). A chunk
 * whose count carries kInvalidRows marks rank d's rows not valid (rows_invalid there): every
 * chunk of d carries it, so from then on this warp leaves d out of its sums, and the first lane
 * to see it records EPX_ERR_PEER_DATA naming d. A wait that timed out (or gave up after another
 * one did) does not look for the mark: the TIMEOUT record stands for the call. */
template <typename IdxT, int kRanks, bool kExtras, bool kGated>
__device__ __forceinline__ void combine_reduce(const epx__kernel_ctx_t &ctx,
                                               const epx__combine_launch_args_t &a,
                                               const ExtrasOf<kExtras> &x, const CombineView &cv,
                                               const int *prefix, int reduce_warp, int lane) {
  const int R = ctx.num_ranks, me = ctx.rank, T = a.routing.num_tokens;
  const size_t chunks = ctx.layout.combine_chunks;
  const char *slab_base = ctx.peer_base[me] + cv.slab;
  const uint64_t *my_signal = (const uint64_t *)(ctx.peer_base[me] + cv.signal);
  /* Lane d < R: rows d sends back, and the last chunk of d this warp saw full. */
  const int rows_from_lane = lane < R ? a.routing.meta->count[me][lane] : 0;
  int checked_chunk = -1;
  bool peer_invalid = false; /* lane d: rank d's rows came marked not valid */
  /* Gated: whether this warp waited for this rank's own rows, and they are not valid (left out
   * of the sums: this rank's call returns the failure that made them so) */
  bool own_checked = false, own_invalid = false;
  const int rw = blockIdx.x * kReduceWarps + reduce_warp;
  const uint64_t t_reduce = epx::trace_begin(ctx);
  const int stride = gridDim.x * kReduceWarps * kReduceTokens;
  for (int t0 = rw * kReduceTokens; t0 < T; t0 += stride) {
    for (int t = t0; t < min(t0 + kReduceTokens, T); t++) {
      const uint64_t t_token = epx::trace_begin(ctx);
      const bool in_rank = lane < R && a.routing.is_token_in_rank[(size_t)t * R + lane];
      const unsigned mask = __ballot_sync(0xffffffffu, in_rank);
      const int my_pos = in_rank ? a.routing.token_pos_in_rank[(size_t)t * R + lane] : 0;
      const int chunk = my_pos / EPX_COMBINE_CHUNK_ROWS;
      const bool waits = in_rank && lane != me && chunk > checked_chunk;
      if (__any_sync(0xffffffffu, waits)) {
        const uint64_t t_wait = epx::trace_begin(ctx);
        if (waits) {
          const int full =
              min(EPX_COMBINE_CHUNK_ROWS, rows_from_lane - chunk * EPX_COMBINE_CHUNK_ROWS);
          const uint64_t *count = my_signal + (size_t)lane * chunks + chunk;
          if (wait_chunk(ctx, cv, count, (uint64_t)full, lane) && !peer_invalid &&
              epx::ld_acquire_sys(count) >= kInvalidRows) {
            peer_invalid = true;
            epx::raise_error(ctx, EPX_ERR_PEER_DATA, EPX_STAGE_COMBINE, lane, -1,
                             (long long)cv.call);
          }
          checked_chunk = chunk; /* on failure the error is recorded; go on without waiting */
        }
        epx::trace_end_last(ctx, t_wait, EPX_TRACE_COMBINE_WAIT, waits ? lane : -1);
      }
      /* Gated: this rank's own rows (read in place) once its last phase is written here */
      if (kGated && ((mask >> me) & 1u) && !own_checked) {
        bool ok = true;
        if (lane == 0) ok = wait_gate(ctx, a, cv, me);
        own_invalid = !__shfl_sync(0xffffffffu, ok, 0);
        own_checked = true;
      }
      __syncwarp(); /* orders every lane's acquire before the warp's loads of the rows */
      const unsigned use =
          mask & ~__ballot_sync(0xffffffffu, peer_invalid) & ~(own_invalid ? 1u << me : 0u);
      reduce_token<IdxT, kRanks, kExtras>(ctx, a, x, cv, prefix, slab_base, t, use, my_pos, lane);
      if constexpr (kExtras)
        if (x.out_topk_weights)
          epx::reduce_token_weights<kRanks>(x.recv_topk_weights + (size_t)prefix[me] * a.top_k,
                                            (const float *)(ctx.peer_base[me] + cv.weights), me,
                                            a.max_tokens, a.top_k, use, my_pos, lane,
                                            x.out_topk_weights + (size_t)t * a.top_k);
      if (lane == 0) epx::trace_end(ctx, t_token, EPX_TRACE_COMBINE_TOKEN, t);
    }
  }
  if (lane == 0)
    epx::trace_end(ctx, t_reduce, EPX_TRACE_COMBINE_REDUCE,
                   tokens_in_units(rw * kReduceTokens, stride, T));
}

/* ---- Finish ----------------------------------------------------------------------------- */

/* The last block to finish clears this parity's counters (every chunk is full, and no peer
 * writes this parity again before it sees combine_finished move), then advances the call count
 * and tells every peer. Every block has read the call count by now (they finished). */
__device__ __forceinline__ void combine_finish(const epx__kernel_ctx_t &ctx,
                                               const CombineView &cv) {
  const int R = ctx.num_ranks, me = ctx.rank, tid = threadIdx.x;
  epx__control_t *ctrl = epx::control_of(ctx);
  __shared__ int last;
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    last = atomicAdd(&ctrl->combine_blocks_done, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  uint64_t *counters = (uint64_t *)(ctx.peer_base[me] + cv.signal);
  for (size_t i = tid; i < (size_t)R * ctx.layout.combine_chunks; i += kThreads) counters[i] = 0;
  __syncthreads();
  if (tid == 0) {
    ctrl->combine_blocks_done = 0;
    ctrl->combine_next_unit = 0;
    ctrl->combine_calls = cv.call + 1;
  }
  if (tid < R && tid != me) {
    __threadfence_system();
    epx::st_release_sys((uint64_t *)&epx::control_of(ctx, tid)->combine_finished[me],
                        (uint64_t)cv.call + 1);
  }
}

/* epx__combine_slab_free_launch's kernel: lane p waits for peer p as combine_send's wait. A
 * timeout marks this call aborted (combine_wait), so its combine gives its waits up at once: one
 * budget. Only cv.call is read. */
__global__ void slab_free_kernel(epx__kernel_ctx_t ctx) {
  const int lane = threadIdx.x;
  CombineView cv = {};
  cv.call = *(volatile const unsigned *)&epx::control_of(ctx)->combine_calls;
  if (cv.call < 2 || lane >= ctx.num_ranks || lane == ctx.rank) return;
  wait_parity_free(ctx, cv, lane);
}

}  // namespace

/* The kernel has external linkage so that profilers show it as epx::normal::combine
 * (docs/profiling.md, "Kernel names"). */
namespace epx::normal {

template <typename IdxT, int kRanks, bool kExtras, bool kGated>
__global__ void __launch_bounds__(kThreads, 1)
    combine(epx__kernel_ctx_t ctx, epx__combine_launch_args_t a, ExtrasOf<kExtras> x) {
  const int R = ctx.num_ranks, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  __shared__ int prefix[EPX_MAX_RANKS + 1];
  __shared__ unsigned call;
  CombineView cv;
  if (tid <= R) prefix[tid] = a.routing.meta->rank_prefix[tid];
  if (tid == 0) call = epx::control_of(ctx)->combine_calls;
  __syncthreads();
  const epx__ws_layout_t &L = ctx.layout;
  const unsigned parity = call & 1u;
  cv.call = call;
  cv.slab = L.normal_offset + L.combine_slab_offset + parity * L.combine_slab_bytes;
  cv.signal = L.normal_offset + L.combine_signal_offset + parity * R * L.combine_chunks * 8;
  cv.weights = L.normal_offset + L.combine_weights_offset + parity * L.combine_weights_bytes;
  cv.row_bytes = (size_t)a.hidden * 2;
  cv.n16 = a.hidden * 2 / 16;
  cv.experts_per_rank = a.num_experts / R;
  if (warp < kSendWarps)
    combine_send<kExtras, kGated>(ctx, a, x, cv, prefix, warp, lane);
  else
    combine_reduce<IdxT, kRanks, kExtras, kGated>(ctx, a, x, cv, prefix, warp - kSendWarps, lane);
  combine_finish(ctx, cv);
}

}  // namespace epx::normal

/* The rank count is a specialisation axis: 2, 4 and 8 get their own kernels; 3, 5, 6 and 7 run
 * the next larger one (ranks beyond num_ranks never have their mask bit set). kExtras (top-k
 * weights or bias asked for) is another, so that a plain combine keeps its registers. The
 * dynamic shared memory is the send warps' stages (launch() opts the kernel into more than
 * 48 KiB). */
extern "C" epx_status_t epx__combine_launch(const epx__kernel_ctx_t *ctx,
                                            const epx__combine_launch_args_t *args,
                                            const epx__combine_extras_t *extras,
                                            cudaStream_t stream) {
  const epx__combine_extras_t none = {NULL, NULL, {NULL, NULL}};
  const epx__combine_extras_t &x = extras ? *extras : none;
  const bool any = x.recv_topk_weights || x.bias[0] || x.bias[1];
  if (args->gate) { /* gated (the prefill layer's phases): its own kernels, without extras */
    if (any)
      return epx__set_error(EPX_ERR_INTERNAL,
                            "epx__combine_launch: a gated combine takes no top-k weights or bias");
    return EPX_RANKS_SWITCH(ctx->num_ranks, kRanks, [&] {
      return EPX_INDEX_SWITCH(args->idx_is_int64, IdxT, [&] {
        return epx::launch<epx::normal::combine<IdxT, kRanks, false, true>>(
            args->num_blocks, kThreads, sizeof(SendSmem), stream, *ctx, *args, NoExtras());
      });
    });
  }
  return EPX_RANKS_SWITCH(ctx->num_ranks, kRanks, [&] {
    return EPX_INDEX_SWITCH(args->idx_is_int64, IdxT, [&] {
      return EPX_BOOL_SWITCH(any, kExtras, [&] {
        return epx::launch<epx::normal::combine<IdxT, kRanks, kExtras, false>>(
            args->num_blocks, kThreads, sizeof(SendSmem), stream, *ctx, *args,
            extras_arg<kExtras>(x));
      });
    });
  });
}

extern "C" epx_status_t epx__combine_slab_free_launch(const epx__kernel_ctx_t *ctx,
                                                      cudaStream_t stream) {
  return epx::launch<slab_free_kernel>(1, 32, 0, stream, *ctx);
}

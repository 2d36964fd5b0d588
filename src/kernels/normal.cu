/*
 * normal.cu - normal (high-throughput) mode over NVLink: count exchange, dispatch, combine.
 *
 * Dispatch writes each token straight into its final row of every destination's compact
 * receive slab, so there are no queues and no second copy on the receiver:
 *   row of (source s, token t) on rank r = sum_{s' < s} count[s'][r] + token_pos_in_rank[t][r]
 * The count matrix comes from notify, one round trip of epoch-tagged 64-bit words.
 * Combine is the mirror image: rank d pushes its p-th row from source s into s's combine slab
 * at (d, p); s then sums, for each token t, the rows (d, token_pos_in_rank[t][d]) in float32.
 *
 * Completion: after its last store to rank r, every block adds 1 to r's dispatch_done[me] (or
 * combine_done[me]) with release semantics at system scope; r waits (acquire, bounded) until
 * the counter has grown by the grid size. Counters are monotonic, so nothing is ever reset and
 * a captured graph replays correctly. All ranks launch the same grid (config.num_sms, agreed
 * at group creation).
 *
 * Roles: dispatch and combine blocks first send a contiguous share of the tokens (rows), one
 * warp per token; dispatch block 0 then waits for every source; every combine block waits,
 * then reduces its share of this rank's tokens.
 */
#include <cuda_bf16.h>

#include "checks.h"
#include "kernels/launch.cuh"
#include "kernels/api.h"
#include "kernels/wait.cuh"
#include "kernels/workspace.cuh"
#include "kernels/trace.cuh"

namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 4;

__device__ __forceinline__ void red_release_sys_add(unsigned long long *p, unsigned long long v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

/* Tell every rank that this block's dispatch stores to it are done. NOTE: __syncthreads orders
 * the block's stores before thread r's fence; the system-scope release makes them visible to r
 * before the counter moves. */
__device__ __forceinline__ void signal_dispatch_done(const epx__kernel_ctx_t &ctx) {
  __syncthreads();
  if (threadIdx.x < ctx.num_ranks) {
    __threadfence_system();
    red_release_sys_add(&epx::control_of(ctx, threadIdx.x)->dispatch_done[ctx.rank], 1);
  }
}

/* [begin, end) of this block's share of n items. */
__device__ __forceinline__ void block_share(int n, int *begin, int *end) {
  const long long b = blockIdx.x, g = gridDim.x;
  *begin = (int)(n * b / g);
  *end = (int)(n * (b + 1) / g);
}

/* Copy one row of n16 16-byte words from src to every destination in mask (one warp). */
__device__ __forceinline__ void copy_row_multicast(const int4 *src, int4 *const *dst, unsigned mask,
                                                   int n16, int lane) {
  for (int i0 = lane; i0 < n16; i0 += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; u++)
      if (i0 + u * 32 < n16) v[u] = epx::ld_nc_na_v4(src + i0 + u * 32);
    for (unsigned m = mask; m; m &= m - 1) {
      int4 *d = dst[__ffs(m) - 1];
#pragma unroll
      for (int u = 0; u < kUnroll; u++)
        if (i0 + u * 32 < n16) d[i0 + u * 32] = v[u];
    }
  }
}

/* ------------------------------------------------------------------------------------------
 * notify: one block. Word w of source s in rank r's notify region:
 *   w < R:  count[s][w] (tokens s sends to rank w)      w >= R: tokens of s for r's expert w-R
 * each as (epoch << 32) | value, so a word is valid exactly when it carries this call's epoch.
 * ---------------------------------------------------------------------------------------- */
__global__ void __launch_bounds__(kThreads, 1)
    notify_kernel(epx__kernel_ctx_t ctx, epx__notify_launch_args_t a) {
  const uint64_t t_start = epx::trace_begin(ctx);
  const int R = ctx.num_ranks, me = ctx.rank, tid = threadIdx.x;
  const int epr = a.num_experts / R, words = R + epr;
  __shared__ unsigned epoch;
  __shared__ int count[EPX_MAX_RANKS][EPX_MAX_RANKS];
  __shared__ int expert_sum[EPX_MAX_EXPERTS / 2];
  __shared__ int timed_out;
  epx__control_t *ctrl = epx::control_of(ctx, me);
  if (tid == 0) {
    epoch = ctrl->notify_epoch + 1;
    ctrl->notify_epoch = epoch;
    timed_out = 0;
  }
  for (int j = tid; j < epr; j += kThreads) expert_sum[j] = 0;
  __syncthreads();

  for (int i = tid; i < R * words; i += kThreads) {
    const int r = i / words, w = i % words;
    const int v = w < R ? a.routing.num_tokens_per_rank[w]
                        : a.routing.num_tokens_per_expert[r * epr + (w - R)];
    unsigned long long *dst =
        (unsigned long long *)(ctx.peer_base[r] + ctx.layout.notify_offset) + me * words + w;
    epx::st_release_sys((uint64_t *)dst, ((uint64_t)epoch << 32) | (uint32_t)v);
  }

  const uint64_t *inbox = (const uint64_t *)(ctx.peer_base[me] + ctx.layout.notify_offset);
  const uint64_t t_wait = epx::trace_begin(ctx);
  for (int i = tid; i < R * words; i += kThreads) {
    const int s = i / words, w = i % words;
    uint64_t v = epx::ld_acquire_sys(inbox + i);
    if ((uint32_t)(v >> 32) < epoch) {
      const uint64_t start = epx::globaltimer_ns();
      while ((uint32_t)((v = epx::ld_acquire_sys(inbox + i)) >> 32) < epoch) {
        if (epx::globaltimer_ns() - start > ctx.timeout_ns) {
          epx::raise_error(ctx, EPX_ERR_TIMEOUT, EPX_STAGE_NOTIFY, s, -1, epoch);
          timed_out = 1;
          v = 0;
          break;
        }
      }
    }
    /* Clamp: a count beyond max_tokens can only come from a broken peer; never index past. */
    int value = (int)(uint32_t)v;
    value = value < 0 ? 0 : value > a.max_tokens ? a.max_tokens : value;
    if (w < R)
      count[s][w] = value;
    else
      atomicAdd(&expert_sum[w - R], value);
  }
  __syncthreads();
  if (tid == 0) epx::trace_end(ctx, t_wait, EPX_TRACE_NOTIFY_WAIT, (int)epoch);

  epx__recv_meta_t *meta = a.routing.meta;
  if (tid == 0) {
    int prefix = 0;
    for (int s = 0; s < R; s++) {
      meta->rank_prefix[s] = prefix;
      prefix += timed_out ? 0 : count[s][me];
    }
    meta->rank_prefix[R] = prefix;
    meta->num_recv = prefix;
    if (a.host_counts) a.host_counts[0] = prefix;
    epx::trace_end(ctx, t_start, EPX_TRACE_NOTIFY, prefix);
  }
  if (tid < R * R) meta->count[tid / R][tid % R] = timed_out ? 0 : count[tid / R][tid % R];
  const int align = a.expert_alignment > 1 ? a.expert_alignment : 1;
  for (int j = tid; j < epr; j += kThreads) {
    const int c = (expert_sum[j] + align - 1) / align * align;
    meta->per_expert[j] = c;
    if (a.host_counts) a.host_counts[1 + j] = c;
  }
}

/* ------------------------------------------------------------------------------------------
 * dispatch: kNumBlocks blocks of kThreads; warp w of block b copies tokens b's share, w-strided.
 * ---------------------------------------------------------------------------------------- */
template <typename IdxT, bool kFp8>
__global__ void __launch_bounds__(kThreads, 1)
    dispatch_kernel(epx__kernel_ctx_t ctx, epx__dispatch_launch_args_t a) {
  const uint64_t t_send = epx::trace_begin(ctx);
  const int R = ctx.num_ranks, me = ctx.rank, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int H = a.hidden, K = a.top_k, E = a.num_experts, epr = E / R;
  const epx__recv_meta_t *meta = a.routing.meta;
  __shared__ int dest_base[EPX_MAX_RANKS];
  if (tid < R) {
    int base = 0; /* rows of sources before me at rank tid */
    for (int s = 0; s < me; s++) base += meta->count[s][tid];
    dest_base[tid] = base;
  }
  __syncthreads();

  /* Buffer regions (every rank has the same layout):
   *   recv_x        [cap, H] elem       recv_scales [cap, H/128] f32
   *   recv_topk_idx [cap, K] i32        recv_topk_weights [cap, K] f32   recv_src_token [cap] i32
   */
  const epx__ws_layout_t &L = ctx.layout;
  const int elem = kFp8 ? 1 : 2, n16 = H * elem / 16, num_scales = H / 128;
  const IdxT *topk = (const IdxT *)a.topk_idx;
  int begin, end;
  block_share(a.routing.num_tokens, &begin, &end);
  for (int t = begin + warp; t < end; t += kWarps) {
    const uint64_t t_token = epx::trace_begin(ctx);
    const bool in_rank = lane < R && a.routing.is_token_in_rank[(size_t)t * R + lane];
    const unsigned mask = __ballot_sync(0xffffffffu, in_rank);
    const int my_row =
        in_rank ? dest_base[lane] + a.routing.token_pos_in_rank[(size_t)t * R + lane] : 0;
    int rows[EPX_MAX_RANKS];
    int4 *dst[EPX_MAX_RANKS];
#pragma unroll
    for (int r = 0; r < EPX_MAX_RANKS; r++) {
      rows[r] = __shfl_sync(0xffffffffu, my_row, r);
      dst[r] = (r < R) ? (int4 *)(ctx.peer_base[r] + L.normal_offset + L.recv_x_offset +
                                  (size_t)rows[r] * H * elem)
                       : nullptr;
    }
    copy_row_multicast((const int4 *)((const char *)a.x + (size_t)t * H * elem), dst, mask, n16,
                       lane);
    if (kFp8) {
      for (int i = lane; i < num_scales; i += 32) {
        const float sc = a.x_scales[(size_t)t * num_scales + i];
        for (unsigned m = mask; m; m &= m - 1) {
          const int r = __ffs(m) - 1;
          float *d = (float *)(ctx.peer_base[r] + L.normal_offset + L.recv_scales_offset);
          d[(size_t)rows[r] * num_scales + i] = sc;
        }
      }
    }
    if (topk) { /* routing metadata; a cached dispatch keeps the earlier values */
      long long e = -1;
      float w = 0.f;
      if (lane < K) {
        e = (long long)topk[(size_t)t * K + lane];
        if (e < 0 || e >= E) e = -1; /* invalid ids were reported by the layout kernel */
        if (a.topk_weights) w = a.topk_weights[(size_t)t * K + lane];
      }
      for (unsigned m = mask; m; m &= m - 1) {
        const int r = __ffs(m) - 1;
        char *base = ctx.peer_base[r] + L.normal_offset;
        if (lane < K) {
          const bool here = e >= 0 && e / epr == r;
          ((int *)(base + L.recv_topk_idx_offset))[(size_t)rows[r] * K + lane] =
              here ? (int)(e - (long long)r * epr) : -1;
          ((float *)(base + L.recv_topk_weights_offset))[(size_t)rows[r] * K + lane] =
              here ? w : 0.f;
        }
        if (lane == 0) ((int *)(base + L.recv_src_token_offset))[rows[r]] = t;
      }
    }
    if (lane == 0) epx::trace_end(ctx, t_token, EPX_TRACE_DISPATCH_TOKEN, t);
  }

  signal_dispatch_done(ctx);
  if (tid == 0) epx::trace_end(ctx, t_send, EPX_TRACE_DISPATCH_SEND, end - begin);
  if (blockIdx.x == 0 && warp == 0) {
    const uint64_t t_wait = epx::trace_begin(ctx);
    if (tid < R) {
      epx__control_t *ctrl = epx::control_of(ctx, me);
      const unsigned long long expected = ctrl->dispatch_expected[tid] + gridDim.x;
      epx::wait_geq(ctx, (const uint64_t *)&ctrl->dispatch_done[tid], expected, EPX_STAGE_DISPATCH,
                    tid);
      ctrl->dispatch_expected[tid] = expected;
    }
    epx::trace_end_last(ctx, t_wait, EPX_TRACE_DISPATCH_WAIT, tid < R ? tid : -1);
  }
}

/* ------------------------------------------------------------------------------------------
 * combine: send warps push this rank's received rows back while reduce warps of the same
 * blocks sum this rank's own tokens as their rows arrive.
 *
 * Send: row i (from source s, its p-th token for me) goes to s's slab at (me, p). The rows of
 * each remote source are cut into units of unit_rows rows; unit u is round u / (R - 1) of
 * source (me + 1 + u % (R - 1)) % R, so every source's segment fills front to back at the same
 * pace, and units go round-robin to the grid's send warps. After a unit, the warp adds its row
 * count to s's counter of that chunk (EPX_COMBINE_CHUNK_ROWS rows; units never straddle one).
 * Reduce: token t needs row pos[t][d] of each rank d holding it; rank d's chunk of that row is
 * full when its counter reaches min(CHUNK_ROWS, rows - chunk start). This rank's own rows are
 * read straight from the combine input, never copied.
 * ---------------------------------------------------------------------------------------- */
/* The send list of one combine: unit u is rows [p0, p1) of remote source s (see above). Its rows
 * are consecutive in the combine input and in s's slab, so a unit is one contiguous span. */
struct SendPlan {
  const char *x; /* combine input */
  char *slab[EPX_MAX_RANKS];
  unsigned long long *signal[EPX_MAX_RANKS]; /* s's counters of my segment */
  const int *prefix;
  int me, R, unit_rows;
  size_t row_bytes;
  int stages, lag;      /* bulk sends: pipeline depth, and how many pieces a signal trails */
  int store_depth;      /* bulk sends: stores left reading shared memory when a stage is refilled */
  uint32_t piece_bytes; /* bulk sends: bytes per stage */
  long long units;
};

struct SendUnit {
  int s, p0, p1;
};

/* Where a warp's next unit comes from (one thread asks): a fixed stride over the list, or, when
 * `counter` is set, the grid's shared counter, so a warp that finishes early takes more units
 * and all send warps end together. Ids grow in both cases, keeping the list's order in time. */
struct UnitSource {
  long long next, stride;
  unsigned *counter;
};

__device__ __forceinline__ long long take_unit(UnitSource *src) {
  if (src->counter) return (long long)atomicAdd(src->counter, 1u);
  const long long u = src->next;
  src->next += src->stride;
  return u;
}

/* Unit u, or false if it is empty (s has fewer rows). */
__device__ __forceinline__ bool send_unit(const SendPlan &plan, long long u, SendUnit *su) {
  const int remote = plan.R - 1;
  su->s = (plan.me + 1 + (int)(u % remote)) % plan.R;
  su->p0 = (int)(u / remote) * plan.unit_rows;
  const int rows = plan.prefix[su->s + 1] - plan.prefix[su->s];
  su->p1 = min(su->p0 + plan.unit_rows, rows);
  return su->p0 < rows;
}

__device__ __forceinline__ const char *unit_src(const SendPlan &plan, const SendUnit &su) {
  return plan.x + (size_t)(plan.prefix[su.s] + su.p0) * plan.row_bytes;
}
__device__ __forceinline__ char *unit_dst(const SendPlan &plan, const SendUnit &su) {
  return plan.slab[su.s] + (size_t)su.p0 * plan.row_bytes;
}

/* The unit's rows are written: add them to s's counter of their chunk. Lane-0 work; the caller
 * has ordered the unit's writes before this thread (syncwarp, or a bulk-group wait). Traced as
 * a span from *mark (the previous unit's signal, or the unit's start) to now. */
__device__ __forceinline__ void signal_unit(const epx__kernel_ctx_t &ctx, const SendPlan &plan,
                                            const SendUnit &su, uint64_t *mark) {
  __threadfence_system();
  red_release_sys_add(plan.signal[su.s] + su.p0 / EPX_COMBINE_CHUNK_ROWS,
                      (unsigned long long)(su.p1 - su.p0));
  epx::trace_end(ctx, *mark, EPX_TRACE_COMBINE_UNIT, su.s);
  *mark = epx::trace_begin(ctx);
}

/* Send with the warp's loads and stores: 8 x 16 bytes in flight per lane. */
/* Each returns the number of units sent. */
__device__ __forceinline__ int send_units_lsu(const epx__kernel_ctx_t &ctx, const SendPlan &plan,
                                              UnitSource source, int lane) {
  int sent = 0;
  constexpr int kUnroll = 8;
  const int n16 = (int)(plan.row_bytes / 16);
  SendUnit su;
  for (;;) {
    long long u = lane == 0 ? take_unit(&source) : 0;
    u = __shfl_sync(0xffffffffu, u, 0);
    if (u >= plan.units) break;
    if (!send_unit(plan, u, &su)) continue;
    uint64_t mark = epx::trace_begin(ctx);
    sent++;
    const int4 *src = (const int4 *)unit_src(plan, su);
    int4 *dst = (int4 *)unit_dst(plan, su);
    const int n = (su.p1 - su.p0) * n16;
    for (int i0 = lane; i0 < n; i0 += 32 * kUnroll) {
      int4 v[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; k++)
        if (i0 + k * 32 < n) v[k] = epx::ld_nc_na_v4(src + i0 + k * 32);
#pragma unroll
      for (int k = 0; k < kUnroll; k++)
        if (i0 + k * 32 < n) dst[i0 + k * 32] = v[k];
    }
    __syncwarp();
    if (lane == 0) signal_unit(ctx, plan, su, &mark);
  }
  return sent;
}

/* Send with bulk copies (lane 0 only): each unit's span goes through `stages` shared-memory
 * stages of kTmaWarpBytes / stages bytes, loads running up to `stages` pieces ahead of the
 * stores. A unit is signalled once the store groups up to its last piece are complete, `lag`
 * pieces
 * later, so the wait for remote completion never drains the pipeline. */
constexpr int kTmaWarpBytes = 32768; /* shared memory per send warp */
constexpr int kTmaMaxStages = 8;
constexpr int kMaxSignalLag = 6;

/* cp.async.bulk.wait_group takes an immediate: dispatch run-time depths to it. */
__device__ __forceinline__ void bulk_wait_read_depth(int depth) {
  switch (depth) {
    case 1:
      epx::bulk_wait_read<1>();
      break;
    case 2:
      epx::bulk_wait_read<2>();
      break;
    case 3:
      epx::bulk_wait_read<3>();
      break;
    case 4:
      epx::bulk_wait_read<4>();
      break;
    case 5:
      epx::bulk_wait_read<5>();
      break;
    case 6:
      epx::bulk_wait_read<6>();
      break;
    default:
      epx::bulk_wait_read<7>();
      break;
  }
}

__device__ __forceinline__ void bulk_wait_done_lag(int lag) {
  switch (lag) {
    case 0:
      epx::bulk_wait_done<0>();
      break;
    case 1:
      epx::bulk_wait_done<1>();
      break;
    case 2:
      epx::bulk_wait_done<2>();
      break;
    case 3:
      epx::bulk_wait_done<3>();
      break;
    case 4:
      epx::bulk_wait_done<4>();
      break;
    case 5:
      epx::bulk_wait_done<5>();
      break;
    default:
      epx::bulk_wait_done<6>();
      break;
  }
}

struct PieceCursor {
  long long u;
  SendUnit su;
  size_t off, span; /* bytes into the unit's span, and the span */
  bool valid;
};

/* The load cursor takes units from the source and queues the non-empty ones (then -1 when the
 * list is exhausted); the store cursor, which trails it by at most num_stages pieces, follows
 * the queue, so both walk the same units whether they come from a stride or the counter. */
constexpr int kUnitQueue = 16; /* > kTmaMaxStages + 1 */
struct UnitQueue {
  long long id[kUnitQueue];
  int head, tail;
};

__device__ __forceinline__ void cursor_start(const SendPlan &plan, long long u, PieceCursor *c) {
  c->u = u;
  c->valid = u >= 0;
  if (!c->valid) return;
  send_unit(plan, u, &c->su);
  c->off = 0;
  c->span = (size_t)(c->su.p1 - c->su.p0) * plan.row_bytes;
}

/* Advance the cursor to its next unit: from the source (queue != NULL: the load cursor, which
 * records it) or from the queue (the store cursor). */
__device__ __forceinline__ void cursor_seek(const SendPlan &plan, UnitSource *source, UnitQueue *q,
                                            bool is_load, PieceCursor *c) {
  long long u = -1;
  if (is_load) {
    SendUnit su;
    for (;;) {
      const long long v = take_unit(source);
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
__device__ __forceinline__ uint32_t cursor_next(const SendPlan &plan, UnitSource *source,
                                                UnitQueue *q, bool is_load, PieceCursor *c,
                                                size_t *off, bool *unit_end) {
  const uint32_t bytes = (uint32_t)min((size_t)plan.piece_bytes, c->span - c->off);
  *off = c->off;
  c->off += bytes;
  *unit_end = c->off == c->span;
  if (*unit_end) cursor_seek(plan, source, q, is_load, c);
  return bytes;
}

__device__ int send_units_tma(const epx__kernel_ctx_t &ctx, const SendPlan &plan, UnitSource source,
                              char *stages, uint64_t *bars) {
  PieceCursor load, store;
  UnitQueue queue;
  queue.head = queue.tail = 0;
  cursor_seek(plan, &source, &queue, true, &load);
  cursor_seek(plan, &source, &queue, false, &store);
  long long loads = 0, stores = 0;
  /* Units whose last piece is store group `group`, not yet signalled (at most lag + 1). */
  SendUnit pending[kMaxSignalLag + 1];
  long long pending_group[kMaxSignalLag + 1];
  const int num_stages = plan.stages, lag = plan.lag;
  const size_t piece = plan.piece_bytes;
  int num_pending = 0, sent = 0;
  uint64_t mark = epx::trace_begin(ctx);
  auto issue_load = [&]() {
    size_t off;
    bool end;
    const SendUnit su = load.su;
    const int st = (int)(loads % num_stages);
    const uint32_t bytes = cursor_next(plan, &source, &queue, true, &load, &off, &end);
    epx::bulk_load(stages + (size_t)st * piece, unit_src(plan, su) + off, bytes, &bars[st]);
    loads++;
  };
  while (load.valid && loads < num_stages) issue_load();
  bool ok = true;
  while (store.valid) {
    const int st = (int)(stores % num_stages);
    const uint32_t parity = (uint32_t)((stores / num_stages) & 1);
    if (!epx::mbarrier_try_wait(&bars[st], parity)) {
      const uint64_t start = epx::globaltimer_ns();
      while (!epx::mbarrier_try_wait(&bars[st], parity))
        if (epx::globaltimer_ns() - start > ctx.timeout_ns) {
          epx::raise_error(ctx, EPX_ERR_TIMEOUT, EPX_STAGE_COMBINE, plan.me, -1, stores);
          ok = false;
          break;
        }
      if (!ok) break;
    }
    size_t off;
    bool end;
    const SendUnit su = store.su;
    const uint32_t bytes =
        cursor_next(plan, &source, &queue, false, &store, &off, &end); /* = its load's */
    epx::bulk_store(unit_dst(plan, su) + off, stages + (size_t)st * piece, bytes);
    if (end) {
      pending[num_pending] = su;
      pending_group[num_pending++] = stores;
    }
    /* Refill the stage of store (stores - depth) once it has been read: up to `depth` stores
     * stay in flight while the loads run stages - depth pieces ahead. */
    if (stores >= plan.store_depth && load.valid) {
      bulk_wait_read_depth(plan.store_depth);
      issue_load();
    }
    if (num_pending && pending_group[0] <= stores - lag) {
      bulk_wait_done_lag(lag);
      int kept = 0;
      for (int i = 0; i < num_pending; i++) {
        if (pending_group[i] <= stores - lag)
          signal_unit(ctx, plan, pending[i], &mark), sent++;
        else
          pending[kept] = pending[i], pending_group[kept++] = pending_group[i];
      }
      num_pending = kept;
    }
    stores++;
  }
  epx::bulk_wait_done<0>();
  for (int i = 0; i < num_pending; i++) signal_unit(ctx, plan, pending[i], &mark), sent++;
  return sent;
}

/* Wait until *flag >= target; gives up at once when another wait of this combine call has
 * already timed out (so a dead peer costs one budget, not one per chunk). Sleeps between polls
 * so a waiting warp leaves issue slots to the send warps of its block. */
__device__ __forceinline__ bool wait_chunk(const epx__kernel_ctx_t &ctx, epx__control_t *ctrl,
                                           unsigned call, const uint64_t *flag, uint64_t target,
                                           int peer) {
  if (epx::ld_acquire_sys(flag) >= target) return true;
  const uint64_t start = epx::globaltimer_ns();
  for (;;) {
    __nanosleep(128);
    if (epx::ld_acquire_sys(flag) >= target) return true;
    if (*(volatile const unsigned *)&ctrl->combine_abort == call + 1) return false;
    if (epx::globaltimer_ns() - start > ctx.timeout_ns) {
      epx::raise_error(ctx, EPX_ERR_TIMEOUT, EPX_STAGE_COMBINE, peer, -1, (long long)target);
      atomicExch(&ctrl->combine_abort, call + 1);
      return false;
    }
  }
}

/* kRanks: the rank count as a compile-time constant, so that the reduce keeps kRanks x
 * kReduceUnroll rows of loads in registers (more chunks in flight with fewer ranks). */
template <typename IdxT, int kRanks>
__global__ void __launch_bounds__(kThreads, 1)
    combine_kernel(epx__kernel_ctx_t ctx, epx__combine_launch_args_t a) {
  constexpr int kReduceUnroll = kRanks <= 4 ? 4 : 2;
  const int R = ctx.num_ranks, me = ctx.rank, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int H = a.hidden, K = a.top_k, epr = a.num_experts / R, n16 = H * 2 / 16;
  const int send_warps = a.send_warps, reduce_warps = kWarps - a.send_warps;
  const epx__recv_meta_t *meta = a.routing.meta;
  epx__control_t *ctrl = epx::control_of(ctx, me);
  const epx__ws_layout_t &L = ctx.layout;
  const size_t chunks = L.combine_chunks;
  __shared__ int prefix[EPX_MAX_RANKS + 1];
  __shared__ unsigned call;
  if (tid <= R) prefix[tid] = meta->rank_prefix[tid];
  if (tid == 0) call = ctrl->combine_calls;
  __syncthreads();
  const unsigned parity = call & 1u;
  const size_t slab = L.normal_offset + L.combine_slab_offset + parity * L.combine_slab_bytes;
  const size_t signal = L.normal_offset + L.combine_signal_offset + parity * R * chunks * 8;

  if (warp < send_warps) {
    const uint64_t t_send = epx::trace_begin(ctx);
    int sent = 0;
    /* Peer s may still be reducing call - 2 from this parity: wait until it has finished. */
    bool ok = true;
    if (call >= 2) {
      const bool waits = lane < R && lane != me;
      const uint64_t t_wait = epx::trace_begin(ctx);
      if (waits)
        ok = wait_chunk(ctx, ctrl, call, (const uint64_t *)&ctrl->combine_finished[lane], call - 1,
                        lane);
      epx::trace_end_last(ctx, t_wait, EPX_TRACE_COMBINE_WAIT, waits ? lane : -1);
    }
    if (__all_sync(0xffffffffu, ok)) {
      SendPlan plan;
      plan.x = (const char *)a.x;
      plan.prefix = prefix;
      plan.me = me, plan.R = R, plan.unit_rows = a.unit_rows;
      plan.row_bytes = (size_t)H * 2;
      int most_rows = 0;
      for (int s = 0; s < R; s++) {
        most_rows = max(most_rows, prefix[s + 1] - prefix[s]);
        plan.slab[s] = ctx.peer_base[s] + slab + (size_t)me * a.max_tokens * plan.row_bytes;
        plan.signal[s] = (unsigned long long *)(ctx.peer_base[s] + signal) + (size_t)me * chunks;
      }
      plan.units = (long long)(most_rows + a.unit_rows - 1) / a.unit_rows * (R - 1);
      UnitSource source;
      source.next = (long long)blockIdx.x * send_warps + warp;
      source.stride = (long long)gridDim.x * send_warps;
      source.counter = a.send_dynamic ? &ctrl->combine_next_unit : nullptr;
      if (!a.send_bulk) {
        sent = send_units_lsu(ctx, plan, source, lane);
      } else if (lane == 0) {
        extern __shared__ __align__(128) char dyn_smem[];
        plan.stages = a.bulk_stages;
        plan.piece_bytes = kTmaWarpBytes / a.bulk_stages / 16 * 16;
        plan.lag = a.bulk_lag;
        plan.store_depth = min(a.bulk_store_depth, a.bulk_stages - 1);
        char *stages = dyn_smem + (size_t)warp * kTmaWarpBytes;
        uint64_t *bars =
            (uint64_t *)(dyn_smem + (size_t)send_warps * kTmaWarpBytes) + warp * kTmaMaxStages;
        for (int i = 0; i < plan.stages; i++) epx::mbarrier_init(&bars[i], 1);
        epx::fence_mbarrier_init();
        sent = send_units_tma(ctx, plan, source, stages, bars);
      }
    }
    if (lane == 0) epx::trace_end(ctx, t_send, EPX_TRACE_COMBINE_SEND, sent);
  } else {
    /* out[t] = sum over ranks d holding t of factor(t, d) * row(d, pos[t][d]), in float32. */
    const IdxT *topk = (const IdxT *)a.topk_idx;
    const char *slab_base = ctx.peer_base[me] + slab;
    const uint64_t *my_signal = (const uint64_t *)(ctx.peer_base[me] + signal);
    /* Lane d < R: rows d sends back, and the last chunk of d this warp saw full. */
    const int rows_from_lane = lane < R ? meta->count[me][lane] : 0;
    int checked_chunk = -1;
    const int T = a.routing.num_tokens, V = a.reduce_tokens;
    const int rw = blockIdx.x * reduce_warps + (warp - send_warps);
    const uint64_t t_reduce = epx::trace_begin(ctx);
    int reduced = 0;
    for (int t0 = rw * V; t0 < T; t0 += gridDim.x * reduce_warps * V) {
      for (int t = t0; t < min(t0 + V, T); t++, reduced++) {
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
            wait_chunk(ctx, ctrl, call, my_signal + (size_t)lane * chunks + chunk, (uint64_t)full,
                       lane);
            checked_chunk = chunk; /* on failure the error is recorded; go on without waiting */
          }
          epx::trace_end_last(ctx, t_wait, EPX_TRACE_COMBINE_WAIT, waits ? lane : -1);
        }
        __syncwarp(); /* orders every lane's acquire before the warp's loads of the rows */
        long long e = -1;
        float w = 0.f;
        if (a.topk_weights && lane < K) {
          e = (long long)topk[(size_t)t * K + lane];
          w = a.topk_weights[(size_t)t * K + lane];
        }
        /* Row pointers and factors stay in registers: every index below is a compile-time one. */
        const int4 *src[kRanks];
        float factor[kRanks];
#pragma unroll
        for (int r = 0; r < kRanks; r++) {
          const int pos = __shfl_sync(0xffffffffu, my_pos, r);
          src[r] = r == me ? (const int4 *)a.x + (size_t)(prefix[me] + pos) * n16
                           : (const int4 *)(slab_base + ((size_t)r * a.max_tokens + pos) * H * 2);
          float f = (e >= 0 && e < a.num_experts && e / epr == r) ? w : 0.f;
#pragma unroll
          for (int o = 16; o; o >>= 1) f += __shfl_xor_sync(0xffffffffu, f, o);
          factor[r] = a.topk_weights ? f : 1.f;
        }
        int4 *out = (int4 *)((char *)a.out + (size_t)t * H * 2);
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
            float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
            for (int r = 0; r < kRanks; r++) {
              if (!((mask >> r) & 1u)) continue;
              const __nv_bfloat162 *h2 = (const __nv_bfloat162 *)&v[u][r];
#pragma unroll
              for (int j = 0; j < 4; j++) {
                const float2 f2 = __bfloat1622float2(h2[j]);
                acc[2 * j] += factor[r] * f2.x;
                acc[2 * j + 1] += factor[r] * f2.y;
              }
            }
            int4 o;
            __nv_bfloat162 *oh = (__nv_bfloat162 *)&o;
#pragma unroll
            for (int j = 0; j < 4; j++) oh[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
            out[i0 + u * 32] = o;
          }
        }
        if (lane == 0) epx::trace_end(ctx, t_token, EPX_TRACE_COMBINE_TOKEN, t);
      }
    }
    if (lane == 0) epx::trace_end(ctx, t_reduce, EPX_TRACE_COMBINE_REDUCE, reduced);
  }

  /* The last block to finish clears this parity's counters (every chunk is full, and no peer
   * writes this parity again before it sees combine_finished move), then advances the call
   * count and tells every peer. Every block has read call by now (they finished). */
  __syncthreads();
  __shared__ int last;
  if (tid == 0) {
    __threadfence();
    last = atomicAdd(&ctrl->combine_blocks_done, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (last) {
    __threadfence();
    uint64_t *counters = (uint64_t *)(ctx.peer_base[me] + signal);
    for (size_t i = tid; i < (size_t)R * chunks; i += kThreads) counters[i] = 0;
    __syncthreads();
    if (tid == 0) {
      ctrl->combine_blocks_done = 0;
      ctrl->combine_next_unit = 0;
      ctrl->combine_calls = call + 1;
    }
    if (tid < R && tid != me) {
      __threadfence_system();
      epx::st_release_sys((uint64_t *)&epx::control_of(ctx, tid)->combine_finished[me],
                          (uint64_t)call + 1);
    }
  }
}

}  // namespace

extern "C" epx_status_t epx__notify_launch(const epx__kernel_ctx_t *ctx,
                                           const epx__notify_launch_args_t *args,
                                           cudaStream_t stream) {
  notify_kernel<<<1, kThreads, 0, stream>>>(*ctx, *args);
  CUDA_CHECK(cudaGetLastError());
  return EPX_OK;
}

extern "C" epx_status_t epx__dispatch_launch(const epx__kernel_ctx_t *ctx,
                                             const epx__dispatch_launch_args_t *args,
                                             cudaStream_t stream) {
  const dim3 grid(args->num_blocks), block(kThreads);
  if (args->x_is_fp8) {
    if (args->idx_is_int64)
      dispatch_kernel<long long, true><<<grid, block, 0, stream>>>(*ctx, *args);
    else
      dispatch_kernel<int, true><<<grid, block, 0, stream>>>(*ctx, *args);
  } else {
    if (args->idx_is_int64)
      dispatch_kernel<long long, false><<<grid, block, 0, stream>>>(*ctx, *args);
    else
      dispatch_kernel<int, false><<<grid, block, 0, stream>>>(*ctx, *args);
  }
  CUDA_CHECK(cudaGetLastError());
  return EPX_OK;
}

extern "C" epx_status_t epx__combine_launch(const epx__kernel_ctx_t *ctx,
                                            const epx__combine_launch_args_t *args,
                                            cudaStream_t stream) {
  typedef void (*kernel_t)(epx__kernel_ctx_t, epx__combine_launch_args_t);
  /* The rank count is a specialization axis: 2, 4 and 8 get their own kernels; 3, 5, 6 and 7
   * run the next larger one (ranks beyond num_ranks never have their mask bit set). */
  static const kernel_t kernels[3][2] = {{combine_kernel<int, 2>, combine_kernel<long long, 2>},
                                         {combine_kernel<int, 4>, combine_kernel<long long, 4>},
                                         {combine_kernel<int, 8>, combine_kernel<long long, 8>}};
  const int r = ctx->num_ranks <= 2 ? 0 : ctx->num_ranks <= 4 ? 1 : 2;
  const kernel_t kernel = kernels[r][args->idx_is_int64 ? 1 : 0];
  /* Bulk sends stage through shared memory: kTmaWarpBytes and the stages' barriers per warp. */
  const size_t smem = args->send_bulk ? (size_t)args->send_warps *
                                            (kTmaWarpBytes + kTmaMaxStages * sizeof(uint64_t))
                                      : 0;
  if (smem > 48 * 1024)
    CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  kernel<<<args->num_blocks, kThreads, smem, stream>>>(*ctx, *args);
  CUDA_CHECK(cudaGetLastError());
  return EPX_OK;
}

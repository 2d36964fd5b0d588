/*
 * ll_dispatch.cu - the low-latency dispatch over NVLink (docs/low-latency.md) and its launcher
 * epx__ll_dispatch_launch; what it shares with the combine is in ll_common.cuh.
 *
 * Fixed slots: source s writes its rows of local expert j of rank d at [j][s*M + pos] of d's
 * receive buffer, pos = the rank of the token among s's tokens that chose that expert (one row
 * per distinct (token, expert)). Every sending block first builds, in shared memory, a bitmap of
 * this rank's tokens per expert (E x ceil(T/32) words) from the whole topk_idx, so a position is
 * a popcount and the sender knows every address alone.
 *
 * Send (block b: the tokens t % G == b): in rounds of up to kBatch tokens, warp w plans token w
 * of the round (its distinct experts, their slots, the destinations), then the 16 warps copy the
 * round's tokens in 512-channel chunks (FP8: lane l quantizes channels 16l..16l+15 once per
 * token; BF16: lane l copies channels 8l and 256 + 8l, so each store writes 512 bytes). Route
 * DIRECT writes one row per (token, expert) into its final slot on the expert's rank. Route
 * BY_RANK writes one staged row per (token, destination rank) at stage[s][t] of the destination,
 * after a StagedHeader listing the token's experts there (local id, slot, weight); the own rank's
 * rows are written directly (its header too, for combine). Block b also writes cnt[j][s] on rank
 * d for the experts e % G == b. When all its stores are issued, block b signals every rank r:
 * dflag[me][b] on r = (epoch, T).
 *
 * Receive (block b): waits (thread s for source s) for dflag[s][b] of every source. Route BY_RANK
 * (and DISPATCH_BY_RANK): it fans out the rows those blocks staged, in rounds of up to kBatch
 * rows (warp w reads the header of row w), writing each row's src_info (source, token, first
 * slot) as the DIRECT send does, so that a DIRECT combine can follow. Then it writes the counts
 * of its local experts e % G == b (which sender blocks b wrote).
 */
#include "kernels/api.h"
#include "kernels/launch.cuh"
#include "kernels/ll_common.cuh"
#include "kernels/ll_pack.cuh"
#include "kernels/trace.cuh"

namespace epx::ll {
namespace {

constexpr int kMaxDst = EPX_MAX_TOP_K + EPX_MAX_RANKS;

struct Entry {
  int d, j, pos, k; /* rank, local expert there, slot, the token's first top-k slot naming it */
  float w;          /* sum of the token's weights of that expert (slot order) */
};

/* Where one token's chunks go: payload (and, FP8, scales) of each destination row. */
struct Plan {
  int num_dst;
  char *payload[kMaxDst];
  float *scales[kMaxDst];
};

/* Position of token t among the tokens whose bit is set in bits (ascending token order). */
__device__ __forceinline__ int position(const uint32_t *bits, int t) {
  int n = 0;
  for (int w = 0; w < (t >> 5); w++) n += __popc(bits[w]);
  return n + __popc(bits[t >> 5] & ((1u << (t & 31)) - 1u));
}

/* ------------------------------------------------------------------------------------------
 * Send
 * ---------------------------------------------------------------------------------------- */
/* All threads: bitmap[e][nw] = the tokens that chose expert e. Block 0 also records the first
 * id outside [-1, E) as the async error. */
template <typename IdxT>
__device__ __forceinline__ void build_bitmaps(const epx__kernel_ctx_t &ctx,
                                              const epx__ll_dispatch_launch_args_t &a,
                                              const Call &c, int nw, uint32_t *bitmap,
                                              unsigned long long *first_bad) {
  const int tid = c.tid, b = c.b, K = c.K, E = c.E, T = c.T;
  const IdxT *topk = (const IdxT *)a.topk_idx;
  for (int i = tid; i < E * nw; i += kThreads) bitmap[i] = 0;
  __syncthreads();
  for (int i = tid; i < T * K; i += kThreads) {
    const long long e = (long long)topk[i];
    const int t = i / K;
    if (e >= 0 && e < E)
      atomicOr(&bitmap[(size_t)e * nw + (t >> 5)], 1u << (t & 31));
    else if (e != -1 && b == 0)
      atomicMin(first_bad, (unsigned long long)i);
  }
  __syncthreads();
  if (b == 0 && tid == 0 && *first_bad != ~0ull)
    raise_error(ctx, EPX_ERR_INVALID_ARGUMENT, EPX_STAGE_LL_DISPATCH, -1, (long long)*first_bad,
                (long long)topk[*first_bad]);
}

/* Warp: the distinct valid experts of token t (K slots, E experts, L per rank) on live ranks,
 * one Entry each in the order of their first slots, into ent. Also keeps this rank's routing
 * (for combine). Returns how many. */
template <typename IdxT>
__device__ __forceinline__ int plan_entries(const epx__kernel_ctx_t &ctx,
                                            const epx__ll_dispatch_launch_args_t &a, int K, int E,
                                            int L, const uint32_t *bitmap, int nw, unsigned mask,
                                            int t, Entry *ent) {
  const int lane = threadIdx.x & 31, me = ctx.rank, p = a.parity;
  const epx__ws_layout_t &lay = ctx.layout;
  int e = -1;
  float w = 1.f;
  if (lane < K) {
    const long long v = (long long)((const IdxT *)a.topk_idx)[(size_t)t * K + lane];
    e = (v >= 0 && v < E) ? (int)v : -1; /* bad ids were reported by block 0 */
    if (a.topk_weights) w = a.topk_weights[(size_t)t * K + lane];
    char *own = ll_buf(ctx, me, p);
    ((int *)(own + lay.ll_my_ids_offset))[(size_t)t * K + lane] = e;
    ((float *)(own + lay.ll_my_w_offset))[(size_t)t * K + lane] = w;
  }
  /* First slot naming the expert, and the sum of its slots' weights in slot order. */
  bool first = e >= 0;
  float wsum = 0.f;
  for (int k = 0; k < K; k++) {
    const int ek = __shfl_sync(kFull, e, k);
    const float wk = __shfl_sync(kFull, w, k);
    if (ek == e) {
      if (k < lane) first = false;
      wsum += wk;
    }
  }
  const int d = first ? e / L : 0;
  const bool live = first && !((mask >> d) & 1u);
  const unsigned live_ballot = __ballot_sync(kFull, live);
  const int n = __popc(live_ballot);
  if (live) {
    Entry en;
    en.d = d;
    en.j = e - d * L;
    en.pos = position(bitmap + (size_t)e * nw, t);
    en.k = lane;
    en.w = wsum;
    ent[__popc(live_ballot & ((1u << lane) - 1u))] = en;
  }
  __syncwarp();
  return n;
}

/* Warp, BY_RANK: the staged rows of token t (one per other rank of its n entries; kPacked: the
 * own rank's too) into plan from index num_dst, and their headers, the own rank's included
 * (combine reads it). Returns the new num_dst. */
template <bool kFp8, bool kPacked>
__device__ __forceinline__ int plan_staged(const epx__kernel_ctx_t &ctx, int R, int me, int M,
                                           int H, int p, uint32_t epoch, int t, const Entry *ent,
                                           int n, int num_dst, Plan *plan) {
  const int lane = threadIdx.x & 31;
  const epx__ws_layout_t &lay = ctx.layout;
  const unsigned ranks = __reduce_or_sync(kFull, lane < n ? 1u << ent[lane].d : 0u);
  const bool staged = lane < R && (kPacked || lane != me) && ((ranks >> lane) & 1u);
  const unsigned st_ballot = __ballot_sync(kFull, staged);
  if (staged) {
    char *row = ll_buf(ctx, lane, p) + lay.ll_stage_offset +
                ((size_t)me * M + t) * lay.ll_stage_row_bytes + sizeof(StagedHeader);
    const int i = num_dst + __popc(st_ballot & ((1u << lane) - 1u));
    plan->payload[i] = row;
    plan->scales[i] = kFp8 ? (float *)(row + H) : nullptr;
  }
  num_dst += __popc(st_ballot);
  for (unsigned rest = ranks; rest; rest &= rest - 1) {
    const int r = __ffs(rest) - 1;
    StagedHeader *hdr = (StagedHeader *)(ll_buf(ctx, r, p) + lay.ll_stage_offset +
                                         ((size_t)me * M + t) * lay.ll_stage_row_bytes);
    const bool mine = lane < n && ent[lane].d == r;
    const unsigned mb = __ballot_sync(kFull, mine);
    if (mine) {
      const Entry en = ent[lane];
      const int i = __popc(mb & ((1u << lane) - 1u));
      hdr->packed[i] = pack_entry(en.pos, en.j, en.k);
      hdr->weight[i] = en.w;
    }
    if (lane == 0) store_head(hdr, epoch, t, __popc(mb));
  }
  return num_dst;
}

/* Warp: the send plan of token t. Writes the src_info of rows written in place, the staged
 * headers (BY_RANK) and this rank's routing (for combine); fills *plan. */
template <typename IdxT, bool kFp8, bool kByRank, bool kPacked, bool kPackScales>
__device__ __forceinline__ void plan_token(const epx__kernel_ctx_t &ctx,
                                           const epx__ll_dispatch_launch_args_t &a,
                                           const uint32_t *bitmap, int nw, unsigned mask,
                                           uint32_t epoch, int t, Entry *ent, Plan *plan) {
  const int lane = threadIdx.x & 31, R = ctx.num_ranks, me = ctx.rank;
  const int K = a.top_k, E = a.num_experts, L = E / R, M = a.max_tokens, H = a.hidden;
  const int p = a.parity, elem = kFp8 ? 1 : 2, nsc = H / 128;
  const epx__ws_layout_t &lay = ctx.layout;
  const size_t RM = lay.ll_rows;
  const int n = plan_entries<IdxT>(ctx, a, K, E, L, bitmap, nw, mask, t, ent);

  /* Rows written in place: every entry (DIRECT) or the own rank's (BY_RANK fixed slots; packed
   * rows are placed by the receiver, the own rank's included). */
  const bool in_place = !kPacked && lane < n && (!kByRank || ent[lane].d == me);
  const unsigned ip_ballot = __ballot_sync(kFull, in_place);
  if (in_place) {
    const Entry en = ent[lane];
    char *base = ll_buf(ctx, en.d, p);
    const size_t row = (size_t)en.j * RM + (size_t)me * M + en.pos;
    const int i = __popc(ip_ballot & ((1u << lane) - 1u));
    plan->payload[i] = base + lay.ll_x_offset + row * H * elem;
    plan->scales[i] = kFp8 ? scale_row<kPackScales>(base + lay.ll_scales_offset, row, nsc,
                                                    (H + kChunk - 1) / kChunk)
                           : nullptr;
    ((int4 *)(base + lay.ll_src_info_offset))[row] = make_int4(me, t, en.k, 0);
  }
  int num_dst = __popc(ip_ballot);
  if (kByRank)
    num_dst = plan_staged<kFp8, kPacked>(ctx, R, me, M, H, p, epoch, t, ent, n, num_dst, plan);
  if (lane == 0) plan->num_dst = num_dst;
}

/* All warps: the chunks of the round's tokens t_i = b + (i0 + i) G, i < nb, to every
 * destination of their plans (kPackScales: a chunk's scales as one UE8M0 word, ll_pack.cuh). */
template <bool kFp8, bool kPackScales>
__device__ __forceinline__ void send_tokens(const epx__ll_dispatch_launch_args_t &a, int i0, int nb,
                                            const Plan *plans) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, H = a.hidden;
  const int nch = (H + kChunk - 1) / kChunk, G = gridDim.x;
  for (int u = warp; u < nb * nch; u += kWarps) {
    const int i = u / nch, ch = u % nch, t = blockIdx.x + (i0 + i) * G;
    const Plan *plan = &plans[i];
    const int num_dst = plan->num_dst;
    if (num_dst == 0) continue; /* no valid expert on a live rank (warp-uniform) */
    const int4 *src = (const int4 *)((const char *)a.x + (size_t)t * H * 2);
    if (!kFp8) {
      /* Lane l copies channels 8 l and 256 + 8 l of the chunk, so that each store instruction
       * writes 512 contiguous bytes: 16-byte pieces 32 bytes apart (two int4 per lane) made
       * the BF16 send 1.2-1.6x slower over NVLink (docs/low-latency.md, "Measured"). */
      const int ca = ch * kChunk + lane * 8, cb = ca + 256;
      int4 va = make_int4(0, 0, 0, 0), vb = va;
      if (ca < H) va = ld_nc_na_v4(src + ca / 8);
      if (cb < H) vb = ld_nc_na_v4(src + cb / 8);
      for (int d = 0; d < num_dst; d++) {
        if (ca < H) *(int4 *)(plan->payload[d] + (size_t)ca * 2) = va;
        if (cb < H) *(int4 *)(plan->payload[d] + (size_t)cb * 2) = vb;
      }
      continue;
    }
    const int c0 = ch * kChunk + lane * 16;
    const bool act = c0 < H;
    int4 v0 = make_int4(0, 0, 0, 0), v1 = v0;
    if (act) {
      v0 = ld_nc_na_v4(src + c0 / 8);
      v1 = ld_nc_na_v4(src + c0 / 8 + 1);
    }
    float scale;
    const int4 q = quantize16(v0, v1, a.ue8m0 != 0, &scale);
    /* The chunk's 4 scales (lanes 0, 8, 16, 24) go as one 16-byte store by lane 0 when the
     * chunk is whole and the row's scales are 16-byte aligned: 4-byte remote stores cost an
     * NVLink write each. */
    float sc[4];
#pragma unroll
    for (int g = 0; g < 4; g++) sc[g] = __shfl_sync(kFull, scale, 8 * g);
    const bool whole = ch * kChunk + kChunk <= H;
    if (kPackScales) {
      const uint32_t word = ue8m0_word(sc, ch, H);
      if (act)
        for (int d = 0; d < num_dst; d++) {
          *(int4 *)(plan->payload[d] + c0) = q;
          if (lane == 0) ((uint32_t *)plan->scales[d])[ch] = word;
        }
      continue;
    }
    if (act)
      for (int d = 0; d < num_dst; d++) {
        *(int4 *)(plan->payload[d] + c0) = q;
        float *srow = plan->scales[d] + ch * (kChunk / 128);
        if (whole && ((uintptr_t)srow & 15) == 0) {
          if (lane == 0) *(float4 *)srow = make_float4(sc[0], sc[1], sc[2], sc[3]);
        } else if ((lane & 7) == 0) {
          plan->scales[d][c0 / 128] = scale;
        }
      }
  }
}

/* The send phase of block b: bitmaps, the counts cnt[j][me] of the experts e % G == b on their
 * rank, this block's tokens in rounds, then the signal (epoch, T) to every live rank. */
template <typename IdxT, bool kFp8, bool kByRank, bool kPacked, bool kPackScales>
__device__ __forceinline__ void dispatch_send(const epx__kernel_ctx_t &ctx,
                                              const epx__ll_dispatch_launch_args_t &a,
                                              const Call &c, uint32_t epoch, const unsigned *s_mask,
                                              uint32_t *bitmap, unsigned long long *first_bad,
                                              Entry (*ent)[EPX_MAX_TOP_K], Plan *plans) {
  const int tid = c.tid, b = c.b, G = c.G, R = c.R, me = c.me, E = c.E, L = c.L, T = c.T, p = c.p;
  const uint64_t t_send = trace_begin(ctx);
  const unsigned mask = *s_mask;
  const int nw = (T + 31) / 32;
  build_bitmaps<IdxT>(ctx, a, c, nw, bitmap, first_bad);
  for (int e = b + tid * G; e < E; e += kThreads * G) {
    const int d = e / L;
    if ((mask >> d) & 1u) continue;
    int n = 0;
    for (int w = 0; w < nw; w++) n += __popc(bitmap[(size_t)e * nw + w]);
    ((int *)(ll_buf(ctx, d, p) + ctx.layout.ll_cnt_offset))[(size_t)(e - d * L) * R + me] = n;
  }
  in_rounds(
      c.warp, tokens_of_block(T, b, G),
      [&](int i, int w) {
        plan_token<IdxT, kFp8, kByRank, kPacked, kPackScales>(ctx, a, bitmap, nw, mask, epoch,
                                                              b + i * G, ent[w], &plans[w]);
      },
      [&](int i0, int nb) { send_tokens<kFp8, kPackScales>(a, i0, nb, plans); });
  signal_ranks(ctx, mask, ctx.layout.ll_dflag_offset, p, epoch, (uint32_t)T);
  if (tid == 0) trace_end(ctx, t_send, EPX_TRACE_LL_DISPATCH_SEND, T);
}

/* ------------------------------------------------------------------------------------------
 * Receive
 * ---------------------------------------------------------------------------------------- */
/* Route BY_RANK, receive: fan the rows that blocks b of the other sources staged here out to
 * their experts' slots, in rounds of up to kBatch rows: warp w reads the header of row w of the
 * round (its entries in range become the plan, their src_info is written here), then all warps
 * copy the round's (row, chunk) units. src_tokens[s] is source s's token count (kNoSignal:
 * masked); token t of s is staged for this rank iff the header of stage[s][t] carries this
 * call's epoch. kPacked: the own rank's rows too, each (j, s) from s_begin[j*R + s], an entry
 * past s_cnt[j*R + s] dropped (ll_pack.cuh). */
template <bool kFp8, bool kPacked, bool kPackScales>
__device__ __forceinline__ void fan_out(const epx__kernel_ctx_t &ctx,
                                        const epx__ll_dispatch_launch_args_t &a, uint32_t epoch,
                                        const uint32_t *src_tokens, Plan *plans, const char **srcs,
                                        const int *s_cnt, const int *s_begin) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int R = ctx.num_ranks, me = ctx.rank, G = gridDim.x, b = blockIdx.x;
  const int K = a.top_k, L = a.num_experts / R, M = a.max_tokens, H = a.hidden;
  const int p = a.parity, elem = kFp8 ? 1 : 2, nsc = H / 128, nch = (H + kChunk - 1) / kChunk;
  const epx__ws_layout_t &lay = ctx.layout;
  const size_t RM = lay.ll_rows;
  char *own = ll_buf(ctx, me, p);
  SourceRows rows;
  const int total = rows.count(R, [&](int s) {
    return ((!kPacked && s == me) || src_tokens[s] == kNoSignal)
               ? 0
               : tokens_of_block((int)src_tokens[s], b, G);
  });
  in_rounds(
      warp, total,
      [&](int r, int w) {
        int t;
        const int s = rows.source_of(r, b, G, &t);
        StagedHeader *row = (StagedHeader *)(own + lay.ll_stage_offset +
                                             ((size_t)s * M + t) * lay.ll_stage_row_bytes);
        const int n = load_entries(row, epoch, t, K);
        const StagedEntry en = unpack_entry(lane < n ? __ldcg(&row->packed[lane]) : 0u);
        bool ok = lane < n && en.expert < L && en.pos < M && en.slot < K;
        if (kPacked) ok = ok && en.pos < s_cnt[en.expert * R + s];
        const unsigned ob = __ballot_sync(kFull, ok);
        Plan *plan = &plans[w];
        if (ok) {
          const size_t seg = kPacked ? (size_t)s_begin[en.expert * R + s] : (size_t)s * M;
          const size_t dr = (size_t)en.expert * RM + seg + en.pos;
          const int i = __popc(ob & ((1u << lane) - 1u));
          plan->payload[i] = own + lay.ll_x_offset + dr * H * elem;
          plan->scales[i] =
              kFp8 ? scale_row<kPackScales>(own + lay.ll_scales_offset, dr, nsc, nch) : nullptr;
          ((int4 *)(own + lay.ll_src_info_offset))[dr] = make_int4(s, t, en.slot, 0);
        }
        if (lane == 0) {
          plan->num_dst = __popc(ob);
          srcs[w] = (const char *)(row + 1); /* the payload follows the header */
        }
      },
      [&](int, int nb) {
        for (int u = warp; u < nb * nch; u += kWarps) {
          const int i = u / nch, ch = u % nch, c0 = ch * kChunk + lane * 16;
          const Plan *plan = &plans[i];
          const int num_dst = plan->num_dst;
          if (num_dst == 0 || c0 >= H) continue;
          const char *src = srcs[i];
          if (kFp8 && kPackScales) {
            const int4 v = __ldcg((const int4 *)(src + c0));
            const uint32_t word = lane == 0 ? __ldcg((const uint32_t *)(src + H) + ch) : 0u;
            for (int d = 0; d < num_dst; d++) {
              *(int4 *)(plan->payload[d] + c0) = v;
              if (lane == 0) ((uint32_t *)plan->scales[d])[ch] = word;
            }
          } else if (kFp8) {
            const int4 v = __ldcg((const int4 *)(src + c0));
            const float sc = (lane & 7) == 0 ? __ldcg((const float *)(src + H) + c0 / 128) : 0.f;
            for (int d = 0; d < num_dst; d++) {
              *(int4 *)(plan->payload[d] + c0) = v;
              if ((lane & 7) == 0) plan->scales[d][c0 / 128] = sc;
            }
          } else {
            const int4 v0 = __ldcg((const int4 *)(src + (size_t)c0 * 2));
            const int4 v1 = __ldcg((const int4 *)(src + (size_t)c0 * 2) + 1);
            for (int d = 0; d < num_dst; d++) {
              int4 *dst = (int4 *)(plan->payload[d] + (size_t)c0 * 2);
              dst[0] = v0;
              dst[1] = v1;
            }
          }
        }
      });
}

/* recv_count, recv_begin and recv_num of the local experts e % G == b: sender blocks b wrote
 * their cnt words. */
__device__ __forceinline__ void write_recv_counts(const epx__kernel_ctx_t &ctx, const Call &c,
                                                  const char *own, const uint32_t *src_tokens) {
  const int tid = c.tid, b = c.b, G = c.G, R = c.R, me = c.me, L = c.L, M = c.M;
  const epx__ws_layout_t &lay = ctx.layout;
  const int *cnt = (const int *)(own + lay.ll_cnt_offset);
  int *count = (int *)(own + lay.ll_recv_count_offset);
  int *begin = (int *)(own + lay.ll_recv_begin_offset);
  int *num = (int *)(own + lay.ll_recv_num_offset);
  for (int j = tid; j < L; j += kThreads) {
    if ((me * L + j) % G != b) continue;
    int total = 0;
    for (int s = 0; s < R; s++) {
      int n = 0;
      if (src_tokens[s] != kNoSignal) {
        n = __ldcg(cnt + (size_t)j * R + s);
        n = n < 0 ? 0 : n > M ? M : n;
      }
      num[j * R + s] = n;
      begin[j * R + s] = s * M;
      total += n;
    }
    count[j] = total;
  }
}

/* The receive phase of block b: the signals of blocks b of every source (thread s for source
 * s, all at once; kPacked: of every block, for the counts) give src_tokens; then the fan-out
 * (BY_RANK) and the counts. s_pack: kPacked's shared cnt and begin arrays and dead-source word. */
template <bool kFp8, bool kByRank, bool kPacked, bool kPackScales>
__device__ __forceinline__ void dispatch_recv(const epx__kernel_ctx_t &ctx,
                                              const epx__ll_dispatch_launch_args_t &a,
                                              const Call &c, uint32_t epoch, uint32_t *src_tokens,
                                              Plan *plans, const char **srcs, int *s_cnt,
                                              int *s_begin, unsigned *s_dead) {
  const int tid = c.tid, b = c.b, R = c.R, M = c.M;
  const uint64_t t_wait = trace_begin(ctx);
  char *own = ll_buf(ctx, c.me, c.p);
  if (kPacked) {
    wait_all_sources(ctx, c, epoch, src_tokens, s_dead);
  } else if (tid < R) {
    const int s = tid;
    const uint32_t v =
        wait_signal(ctx, own, ctx.layout.ll_dflag_offset, s, b, epoch, EPX_STAGE_LL_DISPATCH);
    src_tokens[s] = v == kNoSignal ? kNoSignal : (v > (uint32_t)M ? (uint32_t)M : v);
  }
  __syncthreads();
  if (tid == 0) {
    int live = 0;
    for (int s = 0; s < R; s++) live += src_tokens[s] != kNoSignal;
    trace_end(ctx, t_wait, EPX_TRACE_LL_DISPATCH_WAIT, live);
  }
  const uint64_t t_recv = trace_begin(ctx); /* after the wait's end: spans must not overlap */
  if (kPacked) pack_begins(ctx, c, src_tokens, s_cnt, s_begin);
  if (kByRank)
    fan_out<kFp8, kPacked, kPackScales>(ctx, a, epoch, src_tokens, plans, srcs, s_cnt, s_begin);
  if (kPacked)
    write_packed_counts(ctx, c, s_cnt, s_begin, a.layout_range);
  else
    write_recv_counts(ctx, c, own, src_tokens);
  if (tid == 0) trace_end(ctx, t_recv, EPX_TRACE_LL_DISPATCH_RECV, b);
}

}  // namespace

/* The kernel has external linkage so that profilers show it as epx::ll::dispatch
 * (docs/profiling.md, "Kernel names"). */
/* Traced per block by thread 0: send, wait, receive (docs/profiling.md). */
template <typename IdxT, bool kFp8, bool kByRank, bool kPacked, bool kPackScales>
__global__ void __launch_bounds__(kThreads, 1)
    dispatch(epx__kernel_ctx_t ctx, epx__ll_dispatch_launch_args_t a) {
  extern __shared__ uint32_t bitmap[]; /* [E][nw]: bit t of expert e = token t chose e */
  __shared__ uint32_t s_epoch;
  __shared__ unsigned s_mask;
  __shared__ unsigned long long s_first_bad;
  __shared__ Entry s_ent[kBatch][EPX_MAX_TOP_K];
  __shared__ Plan s_plan[kBatch];
  __shared__ const char *s_src[kBatch];
  __shared__ uint32_t s_src_tokens[EPX_MAX_RANKS]; /* per source: T, or kNoSignal */
  /* kPacked: rows and first row of every (local expert, source); L x R = E <= EPX_MAX_EXPERTS */
  __shared__ int s_cnt[kPacked ? EPX_MAX_EXPERTS : 1], s_begin[kPacked ? EPX_MAX_EXPERTS : 1];
  __shared__ unsigned s_dead;

  /* The stream's next kernel, if launched early (epx_moe_decode's FFN), may place its blocks
   * now; it waits for this kernel's end before it reads a row. */
  epx::grid_dependents_may_launch();
  const Call c = load_call(ctx, a);
  if (c.tid == 0) {
    s_epoch = call_epoch(ctx, kKindDispatch, c.p, a.phases);
    s_mask = read_mask(ctx);
    s_first_bad = ~0ull;
  }
  __syncthreads();
  const uint32_t epoch = s_epoch;
  if (a.phases & EPX_LL_PHASE_SEND)
    dispatch_send<IdxT, kFp8, kByRank, kPacked, kPackScales>(ctx, a, c, epoch, &s_mask, bitmap,
                                                             &s_first_bad, s_ent, s_plan);
  if (a.phases & EPX_LL_PHASE_RECV)
    dispatch_recv<kFp8, kByRank, kPacked, kPackScales>(ctx, a, c, epoch, s_src_tokens, s_plan,
                                                       s_src, s_cnt, s_begin, &s_dead);
}

}  // namespace epx::ll

extern "C" epx_status_t epx__ll_dispatch_launch(const epx__kernel_ctx_t *ctx,
                                                const epx__ll_dispatch_launch_args_t *args,
                                                cudaStream_t stream) {
  /* The bitmaps, only where the send phase runs (config.c checks EPX_LL_MAX_BITMAP_BYTES). */
  const size_t smem = (args->phases & EPX_LL_PHASE_SEND)
                          ? epx__ll_bitmap_bytes(args->num_experts, args->num_tokens)
                          : 0;
  return EPX_INDEX_SWITCH(args->idx_is_int64, IdxT, [&] {
    return EPX_BOOL_SWITCH(args->fp8, kFp8, [&] {
      return EPX_BOOL_SWITCH(args->by_rank, kByRank, [&] {
        /* Packed needs BY_RANK, word scales need FP8 (ll.c checks both): the impossible
         * combinations fold onto the possible kernels instead of being compiled. */
        return EPX_BOOL_SWITCH(args->packed && args->by_rank, kPackedArg, [&] {
          return EPX_BOOL_SWITCH(args->pack_scales && args->fp8, kPackScalesArg, [&] {
            constexpr bool kPacked = kByRank && kPackedArg, kPackScales = kFp8 && kPackScalesArg;
            return epx::launch<epx::ll::dispatch<IdxT, kFp8, kByRank, kPacked, kPackScales>>(
                args->num_blocks, epx::ll::kThreads, smem, stream, *ctx, *args);
          });
        });
      });
    });
  });
}

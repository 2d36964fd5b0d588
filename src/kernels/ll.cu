/*
 * ll.cu - low-latency mode over NVLink: dispatch and combine (docs/low-latency.md).
 *
 * Fixed slots: source s writes its rows of local expert j of rank d at [j][s*M + pos] of d's
 * receive buffer, pos = the rank of the token among s's tokens that chose that expert (one row
 * per distinct (token, expert)). Every dispatch block first builds, in shared memory, a bitmap
 * of this rank's tokens per expert (E x ceil(T/32) words) from the whole topk_idx, so a
 * position is a popcount and the sender knows every address alone.
 *
 * Grid: config.ll_num_sms blocks of 512 threads, the same on every rank. Block b of a rank
 * handles the tokens t = b, b + G, b + 2G, ... of that rank.
 *   dispatch send: in rounds of up to 8 tokens, warp w plans token w of the round (its
 *     distinct experts, their slots, the destinations), then the 16 warps copy the round's
 *     tokens in 512-channel chunks (FP8: lane l quantizes channels 16l..16l+15 once per token;
 *     BF16: lane l copies channels 8l and 256 + 8l, so each store writes 512 bytes). Route
 * DIRECT writes one row per (token, expert) into its final slot on the expert's rank. Route BY_RANK
 * writes one staged row per (token, destination rank) at stage[s][t] of the destination, after a
 * header listing the token's experts there (local id, slot, weight); the own rank's rows are
 * written directly (its header too, for combine). Block b also writes cnt[j][s] on rank d for the
 * experts e % G == b. When all its stores are issued, block b signals every rank r: dflag[me][b] on
 * r = (epoch, T). dispatch receive: block b waits (thread s for source s) for dflag[s][b] of every
 * source, so blocks pair up one to one across ranks: receiver block b needs only sender block b.
 *     Route BY_RANK: it fans out the rows those blocks staged, in rounds of up to 8 rows (warp
 *     w reads the header of row w). Then it writes the counts of its local experts e % G == b
 *     (which sender block b wrote).
 *   combine DIRECT: rank d sends each row it received back to combine_recv[t*K + k] on the
 *     source (k = the source's first slot naming the expert); the source waits for every block
 *     of every rank, then sums w[t][k] * row over the token's valid slots.
 *   combine BY_RANK: block b of rank d sums, for each token staged at stage[s][t] (t % G == b;
 *     rounds of up to 8 tokens), w * y over the token's experts on d (from the dispatch header)
 *     and sends one float32 partial to combine_recv[d*M + t] on s; block b of s waits for block b
 *     of every rank and adds the partials of the token's ranks.
 *   Route DISPATCH_BY_RANK (the default) runs the BY_RANK dispatch and the DIRECT combine: the
 *     fan-out writes each row's src_info (source, token, first slot) as the DIRECT dispatch does.
 *
 * Signals are 64-bit words (epoch << 32) | value: written with a system-scope release after a
 * __syncthreads and a system fence, read with acquire loads in bounded waits. Each block keeps
 * its own epoch per (kind, buffer) in this rank's workspace and advances it once per call, so
 * all blocks of all ranks agree on a call's epoch and nothing is ever zeroed. A wait that runs
 * past the budget masks the peer (control->ll_peer_mask) and raises EPX_ERR_PEER_FAILED; masked
 * peers are neither sent to nor waited for. Data that peers wrote during this kernel is read
 * with ld.global.cg (L2, never a stale L1 line); every index read from a peer is range-checked.
 */
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "checks.h"
#include "kernels/launch.cuh"
#include "kernels/api.h"
#include "kernels/wait.cuh"
#include "kernels/workspace.cuh"
#include "kernels/trace.cuh"

namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = 512; /* channels of one warp unit: 16 per lane */
constexpr int kMaxDst = EPX_MAX_TOP_K + EPX_MAX_RANKS;
/* Tokens (send) or staged rows (receive, combine) a block handles per round: warp w < kBatch
 * plans item w, then all warps copy the round's (item, chunk) units, so a round costs one
 * load latency however many items it holds. */
constexpr int kBatch = 8;
constexpr int kKindDispatch = 0, kKindCombine = 1;
constexpr uint32_t kNoSignal = 0xffffffffu; /* wait_signal: the peer is masked */
constexpr unsigned kFull = 0xffffffffu;

/* Staged-row header (EPX_LL_HEADER_BYTES): epoch, token, entries, 0 | packed[16] | weight[16].
 * packed = pos | local expert << 16 | slot << 26. */
constexpr int kHdrPacked = 16, kHdrWeights = 80;

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

__device__ __forceinline__ unsigned read_mask(const epx__kernel_ctx_t &ctx) {
  return *(volatile unsigned *)&epx::control_of(ctx)->ll_peer_mask;
}

/* Give up on `peer`: set its mask bit; the first block to do so records the async error. */
__device__ void mask_peer(const epx__kernel_ctx_t &ctx, int peer, int stage, uint32_t epoch) {
  const unsigned bit = 1u << peer;
  const unsigned old = atomicOr(&epx::control_of(ctx)->ll_peer_mask, bit);
  if (!(old & bit)) epx::raise_error(ctx, EPX_ERR_PEER_FAILED, stage, peer, -1, (long long)epoch);
}

/* Wait until *sig carries `epoch`; its low word, or kNoSignal once the peer is masked (here,
 * after the budget, or meanwhile by another block). */
__device__ uint32_t wait_signal(const epx__kernel_ctx_t &ctx, const uint64_t *sig, uint32_t epoch,
                                int peer, int stage) {
  uint64_t v = epx::ld_acquire_sys(sig);
  if ((uint32_t)(v >> 32) == epoch) return (uint32_t)v;
  const unsigned bit = 1u << peer;
  const uint64_t start = epx::globaltimer_ns();
  for (;;) {
    v = epx::ld_acquire_sys(sig);
    if ((uint32_t)(v >> 32) == epoch) return (uint32_t)v;
    if (read_mask(ctx) & bit) return kNoSignal;
    if (epx::globaltimer_ns() - start > ctx.timeout_ns) {
      mask_peer(ctx, peer, stage, epoch);
      return kNoSignal;
    }
  }
}

/* Block b's signal to every unmasked rank r, at [me][b] of the flag array at flag_offset in r's
 * buffer `parity`. NOTE: the __syncthreads orders every store of the block before thread r's
 * system fence, and the release store publishes them together with the signal. */
__device__ void signal_ranks(const epx__kernel_ctx_t &ctx, unsigned mask, size_t flag_offset,
                             int parity, uint32_t epoch, uint32_t low) {
  __syncthreads();
  const int r = threadIdx.x;
  if (r < ctx.num_ranks && !((mask >> r) & 1u)) {
    __threadfence_system();
    uint64_t *sig = (uint64_t *)(ll_buf(ctx, r, parity) + flag_offset) +
                    (size_t)ctx.rank * EPX_LL_MAX_BLOCKS + blockIdx.x;
    epx::st_release_sys(sig, ((uint64_t)epoch << 32) | low);
  }
}

/* Tokens t < T with t % G == b: how many. */
__device__ __forceinline__ int tokens_of_block(int T, int b, int G) {
  return T > b ? (T - b + G - 1) / G : 0;
}

/* Position of token t among the tokens whose bit is set in bits (ascending token order). */
__device__ __forceinline__ int position(const uint32_t *bits, int t) {
  int n = 0;
  for (int w = 0; w < (t >> 5); w++) n += __popc(bits[w]);
  return n + __popc(bits[t >> 5] & ((1u << (t & 31)) - 1u));
}

/* ------------------------------------------------------------------------------------------
 * Number formats
 * ---------------------------------------------------------------------------------------- */
__device__ __forceinline__ void bf16x8_to_float(const int4 &v, float *f) {
  const __nv_bfloat162 *h = (const __nv_bfloat162 *)&v;
#pragma unroll
  for (int j = 0; j < 4; j++) {
    const float2 t = __bfloat1622float2(h[j]);
    f[2 * j] = t.x;
    f[2 * j + 1] = t.y;
  }
}

__device__ __forceinline__ void acc_bf16x8(const int4 &v, float w, float *acc) {
  const __nv_bfloat162 *h = (const __nv_bfloat162 *)&v;
#pragma unroll
  for (int j = 0; j < 4; j++) {
    const float2 t = __bfloat1622float2(h[j]);
    acc[2 * j] += w * t.x;
    acc[2 * j + 1] += w * t.y;
  }
}

__device__ __forceinline__ int4 float8_to_bf16x8(const float *f) {
  int4 o;
  __nv_bfloat162 *h = (__nv_bfloat162 *)&o;
#pragma unroll
  for (int j = 0; j < 4; j++) h[j] = __floats2bfloat162_rn(f[2 * j], f[2 * j + 1]);
  return o;
}

/* FP8 E4M3 of this lane's 16 channels by the per-128 rule of tests/ref/epx_ref.h, bit for bit:
 * a 128-channel group is 8 consecutive lanes. Every lane of the warp must call it (the group
 * max is a shuffle); lanes past the hidden size pass zeros. */
__device__ __forceinline__ int4 quantize16(const int4 &a, const int4 &b, bool ue8m0,
                                           float *scale_out) {
  float f[16];
  bf16x8_to_float(a, f);
  bf16x8_to_float(b, f + 8);
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 16; i++) amax = fmaxf(amax, fabsf(f[i]));
  amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, 2));
  amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, 4));
  amax = fmaxf(amax, 1e-4f);
  float scale = __fdiv_rn(amax, 448.0f);
  if (ue8m0) {
    uint32_t u = __float_as_uint(scale);
    if (u & 0x7fffffu) u = (u & 0xff800000u) + 0x800000u;
    scale = __uint_as_float(u);
  }
  const float inv = __fdiv_rn(1.0f, scale);
  int4 q;
  __nv_fp8x2_storage_t *q2 = (__nv_fp8x2_storage_t *)&q;
#pragma unroll
  for (int j = 0; j < 8; j++)
    q2[j] = __nv_cvt_float2_to_fp8x2(
        make_float2(__fmul_rn(f[2 * j], inv), __fmul_rn(f[2 * j + 1], inv)), __NV_SATFINITE,
        __NV_E4M3);
  *scale_out = scale;
  return q;
}

/* ------------------------------------------------------------------------------------------
 * Dispatch
 * ---------------------------------------------------------------------------------------- */
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

/* Warp 0: the send plan of token t. Writes the src_info of rows written in place, the staged
 * headers (BY_RANK) and this rank's routing (for combine); fills *plan. */
template <typename IdxT, bool kFp8, bool kByRank>
__device__ void plan_token(const epx__kernel_ctx_t &ctx, const epx__ll_dispatch_launch_args_t &a,
                           const uint32_t *bitmap, int nw, unsigned mask, uint32_t epoch, int t,
                           Entry *ent, Plan *plan) {
  const int lane = threadIdx.x & 31, R = ctx.num_ranks, me = ctx.rank;
  const int K = a.top_k, E = a.num_experts, L = E / R, M = a.max_tokens, H = a.hidden;
  const int p = a.parity, elem = kFp8 ? 1 : 2, nsc = H / 128;
  const epx__ws_layout_t &lay = ctx.layout;
  const size_t RM = lay.ll_rows;

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

  /* Rows written in place: every entry (DIRECT) or the own rank's (BY_RANK). */
  const bool in_place = lane < n && (!kByRank || ent[lane].d == me);
  const unsigned ip_ballot = __ballot_sync(kFull, in_place);
  if (in_place) {
    const Entry en = ent[lane];
    char *base = ll_buf(ctx, en.d, p);
    const size_t row = (size_t)en.j * RM + (size_t)me * M + en.pos;
    const int i = __popc(ip_ballot & ((1u << lane) - 1u));
    plan->payload[i] = base + lay.ll_x_offset + row * H * elem;
    plan->scales[i] = kFp8 ? (float *)(base + lay.ll_scales_offset) + row * nsc : nullptr;
    ((int4 *)(base + lay.ll_src_info_offset))[row] = make_int4(me, t, en.k, 0);
  }
  int num_dst = __popc(ip_ballot);
  if (kByRank) {
    const unsigned ranks = __reduce_or_sync(kFull, lane < n ? 1u << ent[lane].d : 0u);
    /* Staged rows: one per other rank of the token. */
    const bool staged = lane < R && lane != me && ((ranks >> lane) & 1u);
    const unsigned st_ballot = __ballot_sync(kFull, staged);
    if (staged) {
      char *row = ll_buf(ctx, lane, p) + lay.ll_stage_offset +
                  ((size_t)me * M + t) * lay.ll_stage_row_bytes + EPX_LL_HEADER_BYTES;
      const int i = num_dst + __popc(st_ballot & ((1u << lane) - 1u));
      plan->payload[i] = row;
      plan->scales[i] = kFp8 ? (float *)(row + H) : nullptr;
    }
    num_dst += __popc(st_ballot);
    /* Headers, the own rank's included (combine reads it). */
    for (unsigned rest = ranks; rest; rest &= rest - 1) {
      const int r = __ffs(rest) - 1;
      char *hdr =
          ll_buf(ctx, r, p) + lay.ll_stage_offset + ((size_t)me * M + t) * lay.ll_stage_row_bytes;
      const bool mine = lane < n && ent[lane].d == r;
      const unsigned mb = __ballot_sync(kFull, mine);
      if (mine) {
        const Entry en = ent[lane];
        const int i = __popc(mb & ((1u << lane) - 1u));
        ((uint32_t *)(hdr + kHdrPacked))[i] =
            (uint32_t)en.pos | ((uint32_t)en.j << 16) | ((uint32_t)en.k << 26);
        ((float *)(hdr + kHdrWeights))[i] = en.w;
      }
      if (lane == 0) *(int4 *)hdr = make_int4((int)epoch, t, __popc(mb), 0);
    }
  }
  if (lane == 0) plan->num_dst = num_dst;
}

/* All warps: the chunks of the round's tokens t_i = b + (i0 + i) G, i < nb, to every
 * destination of their plans. */
template <bool kFp8>
__device__ void send_tokens(const epx__ll_dispatch_launch_args_t &a, int i0, int nb,
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
      if (ca < H) va = epx::ld_nc_na_v4(src + ca / 8);
      if (cb < H) vb = epx::ld_nc_na_v4(src + cb / 8);
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
      v0 = epx::ld_nc_na_v4(src + c0 / 8);
      v1 = epx::ld_nc_na_v4(src + c0 / 8 + 1);
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

/* Route BY_RANK, receive: fan the rows that blocks b of the other sources staged here out to
 * their experts' slots. src_tokens[s] is source s's token count (kNoSignal: masked); token t of
 * s is staged for this rank iff the header of stage[s][t] carries this call's epoch. */
template <bool kFp8>
__device__ void fan_out(const epx__kernel_ctx_t &ctx, const epx__ll_dispatch_launch_args_t &a,
                        uint32_t epoch, const uint32_t *src_tokens, Plan *plans,
                        const char **srcs) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int R = ctx.num_ranks, me = ctx.rank, G = gridDim.x, b = blockIdx.x;
  const int K = a.top_k, L = a.num_experts / R, M = a.max_tokens, H = a.hidden;
  const int p = a.parity, elem = kFp8 ? 1 : 2, nsc = H / 128, nch = (H + kChunk - 1) / kChunk;
  const epx__ws_layout_t &lay = ctx.layout;
  const size_t RM = lay.ll_rows;
  char *own = ll_buf(ctx, me, p);
  /* This block's rows, source-major: start[s] = rows of the sources before s. */
  int start[EPX_MAX_RANKS + 1];
  start[0] = 0;
  for (int s = 0; s < R; s++)
    start[s + 1] =
        start[s] +
        ((s == me || src_tokens[s] == kNoSignal) ? 0 : tokens_of_block((int)src_tokens[s], b, G));
  const int total = start[R];
  for (int r0 = 0; r0 < total; r0 += kBatch) {
    const int nb = total - r0 < kBatch ? total - r0 : kBatch;
    if (warp < nb) {
      const int r = r0 + warp;
      int s = 0;
      while (r >= start[s + 1]) s++;
      const int t = b + (r - start[s]) * G;
      const char *row = own + lay.ll_stage_offset + ((size_t)s * M + t) * lay.ll_stage_row_bytes;
      const int4 head = __ldcg((const int4 *)row);
      int n = ((uint32_t)head.x == epoch && head.y == t) ? head.z : 0;
      n = n < 0 ? 0 : n > K ? K : n;
      const uint32_t pk = lane < n ? __ldcg((const unsigned *)(row + kHdrPacked) + lane) : 0u;
      const int pos = (int)(pk & 0xffffu), j = (int)((pk >> 16) & 0x3ffu), k = (int)(pk >> 26);
      const bool ok = lane < n && j < L && pos < M && k < K;
      const unsigned ob = __ballot_sync(kFull, ok);
      Plan *plan = &plans[warp];
      if (ok) {
        const size_t dr = (size_t)j * RM + (size_t)s * M + pos;
        const int i = __popc(ob & ((1u << lane) - 1u));
        plan->payload[i] = own + lay.ll_x_offset + dr * H * elem;
        plan->scales[i] = kFp8 ? (float *)(own + lay.ll_scales_offset) + dr * nsc : nullptr;
        ((int4 *)(own + lay.ll_src_info_offset))[dr] = make_int4(s, t, k, 0);
      }
      if (lane == 0) {
        plan->num_dst = __popc(ob);
        srcs[warp] = row + EPX_LL_HEADER_BYTES;
      }
    }
    __syncthreads();
    for (int u = warp; u < nb * nch; u += kWarps) {
      const int i = u / nch, ch = u % nch, c0 = ch * kChunk + lane * 16;
      const Plan *plan = &plans[i];
      const int num_dst = plan->num_dst;
      if (num_dst == 0 || c0 >= H) continue;
      const char *src = srcs[i];
      if (kFp8) {
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
    __syncthreads(); /* the plans are rewritten in the next round */
  }
}

template <typename IdxT, bool kFp8, bool kByRank>
__global__ void __launch_bounds__(kThreads, 1)
    ll_dispatch_kernel(epx__kernel_ctx_t ctx, epx__ll_dispatch_launch_args_t a) {
  extern __shared__ uint32_t bitmap[]; /* [E][nw]: bit t of expert e = token t chose e */
  __shared__ uint32_t s_epoch;
  __shared__ unsigned s_mask;
  __shared__ unsigned long long s_first_bad;
  __shared__ Entry s_ent[kBatch][EPX_MAX_TOP_K];
  __shared__ Plan s_plan[kBatch];
  __shared__ const char *s_src[kBatch];
  __shared__ uint32_t s_src_tokens[EPX_MAX_RANKS]; /* per source: T, or kNoSignal */

  const int tid = threadIdx.x, warp = tid >> 5, b = blockIdx.x, G = gridDim.x;
  const int R = ctx.num_ranks, me = ctx.rank;
  const int K = a.top_k, E = a.num_experts, L = E / R, M = a.max_tokens, T = a.num_tokens;
  const int p = a.parity;
  const epx__ws_layout_t &lay = ctx.layout;

  if (tid == 0) {
    uint32_t *slot = epoch_slot(ctx, kKindDispatch, p, b);
    uint32_t epoch = *slot;
    if (a.phases & EPX_LL_PHASE_SEND) *slot = ++epoch;
    s_epoch = epoch;
    s_mask = read_mask(ctx);
    s_first_bad = ~0ull;
  }
  __syncthreads();
  const uint32_t epoch = s_epoch;

  /* Traced per block by thread 0: send, wait, receive (docs/profiling.md). */
  if (a.phases & EPX_LL_PHASE_SEND) {
    const uint64_t t_send = epx::trace_begin(ctx);
    const unsigned mask = s_mask;
    const int nw = (T + 31) / 32;
    const IdxT *topk = (const IdxT *)a.topk_idx;
    /* 1. Token bitmaps of every expert. Block 0 also finds the first id outside [-1, E). */
    for (int i = tid; i < E * nw; i += kThreads) bitmap[i] = 0;
    __syncthreads();
    for (int i = tid; i < T * K; i += kThreads) {
      const long long e = (long long)topk[i];
      const int t = i / K;
      if (e >= 0 && e < E)
        atomicOr(&bitmap[(size_t)e * nw + (t >> 5)], 1u << (t & 31));
      else if (e != -1 && b == 0)
        atomicMin(&s_first_bad, (unsigned long long)i);
    }
    __syncthreads();
    if (b == 0 && tid == 0 && s_first_bad != ~0ull)
      epx::raise_error(ctx, EPX_ERR_INVALID_ARGUMENT, EPX_STAGE_LL_DISPATCH, -1,
                       (long long)s_first_bad, (long long)topk[s_first_bad]);
    /* 2. Rows of (expert, me) for the experts e % G == b, into cnt[j][me] on their rank. */
    for (int e = b + tid * G; e < E; e += kThreads * G) {
      const int d = e / L;
      if ((mask >> d) & 1u) continue;
      int n = 0;
      for (int w = 0; w < nw; w++) n += __popc(bitmap[(size_t)e * nw + w]);
      ((int *)(ll_buf(ctx, d, p) + lay.ll_cnt_offset))[(size_t)(e - d * L) * R + me] = n;
    }
    /* 3. The tokens of this block, kBatch per round. */
    const int my_tokens = tokens_of_block(T, b, G);
    for (int i0 = 0; i0 < my_tokens; i0 += kBatch) {
      const int nb = my_tokens - i0 < kBatch ? my_tokens - i0 : kBatch;
      if (warp < nb)
        plan_token<IdxT, kFp8, kByRank>(ctx, a, bitmap, nw, mask, epoch, b + (i0 + warp) * G,
                                        s_ent[warp], &s_plan[warp]);
      __syncthreads();
      send_tokens<kFp8>(a, i0, nb, s_plan);
      __syncthreads(); /* the plans are rewritten in the next round */
    }
    /* 4. Everything of this block is issued: tell every rank, with this rank's token count. */
    signal_ranks(ctx, mask, lay.ll_dflag_offset, p, epoch, (uint32_t)T);
    if (tid == 0) epx::trace_end(ctx, t_send, EPX_TRACE_LL_DISPATCH_SEND, T);
  }

  if (a.phases & EPX_LL_PHASE_RECV) {
    const uint64_t t_wait = epx::trace_begin(ctx);
    char *own = ll_buf(ctx, me, p);
    /* Block b of every source, all waited for at once (thread s for source s). */
    if (tid < R) {
      const int s = tid;
      uint32_t v = kNoSignal;
      if (!((read_mask(ctx) >> s) & 1u)) {
        const uint64_t *sig =
            (const uint64_t *)(own + lay.ll_dflag_offset) + (size_t)s * EPX_LL_MAX_BLOCKS + b;
        v = wait_signal(ctx, sig, epoch, s, EPX_STAGE_LL_DISPATCH);
      }
      s_src_tokens[s] = v == kNoSignal ? kNoSignal : (v > (uint32_t)M ? (uint32_t)M : v);
    }
    __syncthreads();
    if (tid == 0) {
      int live = 0;
      for (int s = 0; s < R; s++) live += s_src_tokens[s] != kNoSignal;
      epx::trace_end(ctx, t_wait, EPX_TRACE_LL_DISPATCH_WAIT, live);
    }
    const uint64_t t_recv =
        epx::trace_begin(ctx); /* after the wait's end: spans must not overlap */
    if (kByRank) fan_out<kFp8>(ctx, a, epoch, s_src_tokens, s_plan, s_src);
    /* Counts of the local experts e % G == b: sender blocks b wrote their cnt words. */
    const int *cnt = (const int *)(own + lay.ll_cnt_offset);
    int *count = (int *)(own + lay.ll_recv_count_offset);
    int *begin = (int *)(own + lay.ll_recv_begin_offset);
    int *num = (int *)(own + lay.ll_recv_num_offset);
    for (int j = tid; j < L; j += kThreads) {
      if ((me * L + j) % G != b) continue;
      int total = 0;
      for (int s = 0; s < R; s++) {
        int n = 0;
        if (s_src_tokens[s] != kNoSignal) {
          n = __ldcg(cnt + (size_t)j * R + s);
          n = n < 0 ? 0 : n > M ? M : n;
        }
        num[j * R + s] = n;
        begin[j * R + s] = s * M;
        total += n;
      }
      count[j] = total;
    }
    if (tid == 0) epx::trace_end(ctx, t_recv, EPX_TRACE_LL_DISPATCH_RECV, b);
  }
}

/* ------------------------------------------------------------------------------------------
 * Combine
 * ---------------------------------------------------------------------------------------- */
/* acc[16] += sum over n rows of w_i * row_i[this lane's 16 channels from c0], with 4 rows'
 * loads in flight. n must be the same on every lane and every lane must call it (row_of may
 * shuffle); lanes with act = false load nothing. */
template <typename RowFn>
__device__ __forceinline__ void accumulate_rows(int n, RowFn row_of, int c0, bool act, float *acc) {
  for (int i0 = 0; i0 < n; i0 += 4) {
    int4 v[4][2];
    float w[4];
#pragma unroll
    for (int u = 0; u < 4; u++) {
      w[u] = 0.f;
      v[u][0] = v[u][1] = make_int4(0, 0, 0, 0);
      if (i0 + u < n) {
        const char *row = row_of(i0 + u, &w[u]);
        if (act) {
          const int4 *r = (const int4 *)(row + (size_t)c0 * 2);
          v[u][0] = __ldcg(r);
          v[u][1] = __ldcg(r + 1);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < 4; u++) {
      if (i0 + u >= n) break;
      acc_bf16x8(v[u][0], w[u], acc);
      acc_bf16x8(v[u][1], w[u], acc + 8);
    }
  }
}

__device__ __forceinline__ void store_acc(void *row, int c0, const float *acc) {
  int4 *o = (int4 *)((char *)row + (size_t)c0 * 2);
  o[0] = float8_to_bf16x8(acc);
  o[1] = float8_to_bf16x8(acc + 8);
}

/* BY_RANK partials travel in float32: rounding them to BF16 on the expert side and again after
 * the sum would miss "within BF16 rounding of the float64 sum". WARP-COLLECTIVE: lane l holds
 * channels ch0 + 16 l .. + 15; they go through the warp's 2 KiB of shared memory so that each
 * store instruction writes 512 contiguous bytes to the peer (16-byte pieces 64 bytes apart,
 * written straight from registers, made the partial send 4x slower over NVLink). */
__device__ __forceinline__ void store_acc_f32(char *row, int ch0, int H, const float *acc,
                                              float *warp_smem) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < 16; i++) warp_smem[lane * 16 + ((i + lane) & 15)] = acc[i];
  __syncwarp();
#pragma unroll
  for (int q = 0; q < 4; q++) {
    const int c = (q * 32 + lane) * 4; /* channel offset in the chunk */
    if (ch0 + c < H) {
      const int l = c / 16, i = c % 16; /* lane and first index that hold channel c */
      float4 v;
      v.x = warp_smem[l * 16 + ((i + l) & 15)];
      v.y = warp_smem[l * 16 + ((i + 1 + l) & 15)];
      v.z = warp_smem[l * 16 + ((i + 2 + l) & 15)];
      v.w = warp_smem[l * 16 + ((i + 3 + l) & 15)];
      *(float4 *)(row + (size_t)(ch0 + c) * 4) = v;
    }
  }
  __syncwarp();
}

/* acc += the float32 rows row_of(0..n) at channels c0..c0+15 (all loads of a row in flight). */
template <typename RowFn>
__device__ __forceinline__ void accumulate_rows_f32(int n, RowFn row_of, int c0, bool act,
                                                    float *acc) {
  for (int i = 0; i < n; i++) {
    float w;
    const char *row = row_of(i, &w);
    if (!act) continue;
    const float4 *r = (const float4 *)(row + (size_t)c0 * 4);
    float4 v[4];
#pragma unroll
    for (int q = 0; q < 4; q++) v[q] = __ldcg(r + q);
#pragma unroll
    for (int q = 0; q < 4; q++) {
      acc[4 * q] += v[q].x;
      acc[4 * q + 1] += v[q].y;
      acc[4 * q + 2] += v[q].z;
      acc[4 * q + 3] += v[q].w;
    }
  }
}

/* Exclusive prefix of v[0..n) into prefix[0..n] (n <= 2 * kThreads), all threads. */
__device__ void block_prefix(const int *v, int n, int *prefix, int *warp_sums) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int a0 = 2 * tid < n ? v[2 * tid] : 0, a1 = 2 * tid + 1 < n ? v[2 * tid + 1] : 0;
  int x = a0 + a1;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(kFull, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int s = lane < kWarps ? warp_sums[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(kFull, s, o);
      if (lane >= o) s += y;
    }
    if (lane < kWarps) warp_sums[lane] = s; /* inclusive */
  }
  __syncthreads();
  const int excl = x - a0 - a1 + (warp > 0 ? warp_sums[warp - 1] : 0);
  if (2 * tid < n) prefix[2 * tid] = excl;
  if (2 * tid + 1 < n) prefix[2 * tid + 1] = excl + a0;
  if (tid == 0) prefix[n] = warp_sums[kWarps - 1];
  __syncthreads();
}

struct CombineRows {
  int n;
  const char *src[EPX_MAX_TOP_K]; /* rows of y */
  float w[EPX_MAX_TOP_K];
  char *dst; /* the partial's row on the source rank */
};

template <bool kByRank>
__global__ void __launch_bounds__(kThreads, 1)
    ll_combine_kernel(epx__kernel_ctx_t ctx, epx__ll_combine_launch_args_t a) {
  __shared__ uint32_t s_epoch, s_dispatch_epoch;
  __shared__ unsigned s_mask, s_ok;
  __shared__ int s_prefix[EPX_MAX_EXPERTS + 1];
  __shared__ int s_warp_sums[kWarps];
  __shared__ CombineRows s_rows[kBatch];
  __shared__ int s_count[EPX_MAX_RANKS];
  __shared__ float s_partial[kByRank ? kWarps : 1][kChunk]; /* store_acc_f32's transpose */

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, b = blockIdx.x, G = gridDim.x;
  const int R = ctx.num_ranks, me = ctx.rank;
  const int H = a.hidden, K = a.top_k, L = a.num_experts / R, M = a.max_tokens;
  const int p = a.parity, nch = (H + kChunk - 1) / kChunk;
  const epx__ws_layout_t &lay = ctx.layout;
  const size_t RM = lay.ll_rows;
  char *own = ll_buf(ctx, me, p);

  if (tid == 0) {
    uint32_t *slot = epoch_slot(ctx, kKindCombine, p, b);
    uint32_t epoch = *slot;
    if (a.phases & EPX_LL_PHASE_SEND) *slot = ++epoch;
    s_epoch = epoch;
    s_dispatch_epoch = *epoch_slot(ctx, kKindDispatch, p, b);
    s_mask = read_mask(ctx);
  }
  __syncthreads();
  const uint32_t epoch = s_epoch, dispatch_epoch = s_dispatch_epoch;

  if (a.phases & EPX_LL_PHASE_SEND) {
    const uint64_t t_send = epx::trace_begin(ctx);
    const unsigned mask = s_mask;
    if (kByRank) {
      /* Partials of the tokens that blocks b of the sources staged here in the dispatch, the
       * own rank's included (its headers are in its own stage rows). Rows are source-major;
       * a source that did not reach this rank in the dispatch (its signal does not carry the
       * dispatch's epoch), or is masked now, has none. */
      if (tid < R) {
        const int s = tid;
        const uint64_t f = __ldcg((const unsigned long long *)(own + lay.ll_dflag_offset) +
                                  (size_t)s * EPX_LL_MAX_BLOCKS + b);
        const bool live = !((mask >> s) & 1u) && (uint32_t)(f >> 32) == dispatch_epoch;
        const uint32_t Ts = (uint32_t)f > (uint32_t)M ? (uint32_t)M : (uint32_t)f;
        s_count[s] = live ? tokens_of_block((int)Ts, b, G) : 0;
      }
      __syncthreads();
      int start[EPX_MAX_RANKS + 1];
      start[0] = 0;
      for (int s = 0; s < R; s++) start[s + 1] = start[s] + s_count[s];
      const int total = start[R];
      for (int r0 = 0; r0 < total; r0 += kBatch) {
        const int nb = total - r0 < kBatch ? total - r0 : kBatch;
        if (warp < nb) {
          const int r = r0 + warp;
          int s = 0;
          while (r >= start[s + 1]) s++;
          const int t = b + (r - start[s]) * G;
          const char *hdr =
              own + lay.ll_stage_offset + ((size_t)s * M + t) * lay.ll_stage_row_bytes;
          const int4 head = __ldcg((const int4 *)hdr);
          int n = ((uint32_t)head.x == dispatch_epoch && head.y == t) ? head.z : 0;
          n = n < 0 ? 0 : n > K ? K : n;
          const uint32_t pk = lane < n ? __ldcg((const unsigned *)(hdr + kHdrPacked) + lane) : 0u;
          const float w = lane < n ? __ldcg((const float *)(hdr + kHdrWeights) + lane) : 0.f;
          const int pos = (int)(pk & 0xffffu), j = (int)((pk >> 16) & 0x3ffu);
          const bool ok = lane < n && j < L && pos < M;
          const unsigned ob = __ballot_sync(kFull, ok);
          CombineRows *cr = &s_rows[warp];
          if (ok) {
            const int idx = __popc(ob & ((1u << lane) - 1u));
            cr->src[idx] = (const char *)a.x + ((size_t)j * RM + (size_t)s * M + pos) * H * 2;
            cr->w[idx] = w;
          }
          if (lane == 0) {
            cr->n = __popc(ob);
            cr->dst = ll_buf(ctx, s, p) + lay.ll_combine_recv_offset + ((size_t)me * M + t) * H * 4;
          }
        }
        __syncthreads();
        for (int u = warp; u < nb * nch; u += kWarps) {
          const int i = u / nch, ch = u % nch, c0 = ch * kChunk + lane * 16;
          const CombineRows *cr = &s_rows[i];
          const int n = cr->n;
          if (n == 0) continue; /* not staged for this rank (warp-uniform) */
          float acc[16] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f,
                           0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
          accumulate_rows(
              n,
              [&](int q, float *wq) {
                *wq = cr->w[q];
                return cr->src[q];
              },
              c0, c0 < H, acc);
          store_acc_f32(cr->dst, ch * kChunk, H, acc, s_partial[kByRank ? warp : 0]);
        }
        __syncthreads(); /* the rows are rewritten in the next round */
      }
    } else {
      /* Every row this rank received goes back to its token's slot on the source. Rows are
       * numbered over the (local expert, source) segments; block b takes rows b, b + G, ...,
       * each warp two (row, chunk) units per step with all their loads in flight. */
      const int *num = (const int *)(own + lay.ll_recv_num_offset);
      /* s_prefix first holds the segments' row counts, then (in place) their prefix. */
      for (int i = tid; i < L * R; i += kThreads)
        s_prefix[i] = ((mask >> (i % R)) & 1u) ? 0 : num[i];
      __syncthreads();
      block_prefix(s_prefix, L * R, s_prefix, s_warp_sums);
      const int total = s_prefix[L * R];
      const int4 *info = (const int4 *)(own + lay.ll_src_info_offset);
      for (int u0 = warp;; u0 += 2 * kWarps) {
        int4 src_info[2], x0[2], x1[2];
        size_t row[2];
        int seg_s[2], c0[2];
        bool valid[2];
#pragma unroll
        for (int q = 0; q < 2; q++) {
          const int u = u0 + q * kWarps, g = b + (u / nch) * G;
          c0[q] = (u % nch) * kChunk + lane * 8;
          valid[q] = g < total;
          if (!valid[q]) continue;
          int lo = 0, hi = L * R; /* the segment of row g: prefix[lo] <= g < prefix[lo + 1] */
          while (hi - lo > 1) {
            const int mid = (lo + hi) / 2;
            if (s_prefix[mid] <= g)
              lo = mid;
            else
              hi = mid;
          }
          const int j = lo / R;
          seg_s[q] = lo % R;
          row[q] = (size_t)j * RM + (size_t)seg_s[q] * M + (g - s_prefix[lo]);
          src_info[q] = __ldcg(info + row[q]);
          /* Lane l: channels 8 l and 256 + 8 l of the chunk, 512 contiguous bytes per store
           * instruction (two int4 per lane, 32 bytes apart, made this send 1.3x slower). */
          const int4 *src = (const int4 *)((const char *)a.x + (row[q] * H + c0[q]) * 2);
          if (c0[q] < H) x0[q] = epx::ld_nc_na_v4(src);
          if (c0[q] + 256 < H) x1[q] = epx::ld_nc_na_v4(src + 32);
        }
        if (!valid[0]) break;
#pragma unroll
        for (int q = 0; q < 2; q++) {
          const int t = src_info[q].y, k = src_info[q].z;
          if (!valid[q] || c0[q] >= H || t < 0 || t >= M || k < 0 || k >= K) continue;
          int4 *dst = (int4 *)(ll_buf(ctx, seg_s[q], p) + lay.ll_combine_recv_offset +
                               (((size_t)t * K + k) * H + c0[q]) * 2);
          dst[0] = x0[q];
          if (c0[q] + 256 < H) dst[32] = x1[q];
        }
      }
    }
    signal_ranks(ctx, mask, lay.ll_cflag_offset, p, epoch, 0u);
    if (tid == 0) epx::trace_end(ctx, t_send, EPX_TRACE_LL_COMBINE_SEND, b);
  }

  if (a.phases & EPX_LL_PHASE_RECV) {
    const uint64_t t_wait = epx::trace_begin(ctx);
    const int T = a.num_tokens;
    if (tid == 0) s_ok = (1u << R) - 1u;
    __syncthreads();
    /* BY_RANK: block b of every rank. DIRECT: every block of every rank. */
    const int waits = kByRank ? R : R * G;
    for (int i = tid; i < waits; i += kThreads) {
      const int d = kByRank ? i : i / G, blk = kByRank ? b : i % G;
      uint32_t v = kNoSignal;
      if (!((read_mask(ctx) >> d) & 1u)) {
        const uint64_t *sig =
            (const uint64_t *)(own + lay.ll_cflag_offset) + (size_t)d * EPX_LL_MAX_BLOCKS + blk;
        v = wait_signal(ctx, sig, epoch, d, EPX_STAGE_LL_COMBINE);
      }
      if (v == kNoSignal) atomicAnd(&s_ok, ~(1u << d));
    }
    __syncthreads();
    const unsigned ok = s_ok;
    if (tid == 0) epx::trace_end(ctx, t_wait, EPX_TRACE_LL_COMBINE_WAIT, __popc(ok));
    const uint64_t t_reduce = epx::trace_begin(ctx); /* after the wait's end */
    const int *my_ids = (const int *)(own + lay.ll_my_ids_offset);
    const float *my_w = (const float *)(own + lay.ll_my_w_offset);
    const char *recv = own + lay.ll_combine_recv_offset;
    /* Units (token, chunk): BY_RANK the tokens t % G == b; DIRECT units u % G == b. */
    const int per_block = kByRank ? tokens_of_block(T, b, G) * nch : 0;
    for (int u = kByRank ? warp : b + warp * G;; u += kByRank ? kWarps : kWarps * G) {
      int t, ch;
      if (kByRank) {
        if (u >= per_block) break;
        t = b + (u / nch) * G;
        ch = u % nch;
      } else {
        if (u >= T * nch) break;
        t = u / nch;
        ch = u % nch;
      }
      const int e = lane < K ? my_ids[(size_t)t * K + lane] : -1;
      const float w = lane < K ? my_w[(size_t)t * K + lane] : 0.f;
      const int d = e >= 0 ? e / L : 0;
      const bool valid = e >= 0 && e < a.num_experts && ((ok >> d) & 1u);
      const int c0 = ch * kChunk + lane * 16;
      float acc[16] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f,
                       0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      if (kByRank) {
        /* The partials of the token's ranks, in rank order. */
        const unsigned ranks = __reduce_or_sync(kFull, valid ? 1u << d : 0u);
        accumulate_rows_f32(
            __popc(ranks),
            [&](int i, float *wi) {
              unsigned rest = ranks;
              for (int q = 0; q < i; q++) rest &= rest - 1;
              *wi = 1.f;
              return recv + ((size_t)(__ffs(rest) - 1) * M + t) * H * 4;
            },
            c0, c0 < H, acc);
      } else {
        /* The valid slots in slot order; slot k reads the row of the token's first slot naming
         * the same expert (one row per distinct expert was sent). */
        int first = lane;
        for (int k = K - 1; k >= 0; k--)
          if (__shfl_sync(kFull, e, k) == e && k < lane) first = k;
        const unsigned vb = __ballot_sync(kFull, valid);
        accumulate_rows(
            __popc(vb),
            [&](int i, float *wi) {
              unsigned rest = vb;
              for (int q = 0; q < i; q++) rest &= rest - 1;
              const int k = __ffs(rest) - 1;
              *wi = __shfl_sync(kFull, w, k);
              const int kf = __shfl_sync(kFull, first, k);
              return recv + ((size_t)t * K + kf) * H * 2;
            },
            c0, c0 < H, acc);
      }
      if (c0 < H) store_acc((char *)a.out + (size_t)t * H * 2, c0, acc);
    }
    if (tid == 0) epx::trace_end(ctx, t_reduce, EPX_TRACE_LL_COMBINE_REDUCE, T);
  }
}

template <typename IdxT, bool kFp8, bool kByRank>
epx_status_t launch_dispatch(const epx__kernel_ctx_t *ctx, const epx__ll_dispatch_launch_args_t *a,
                             size_t smem, cudaStream_t stream) {
  auto kernel = ll_dispatch_kernel<IdxT, kFp8, kByRank>;
  /* Beyond 48 KiB of static + dynamic shared memory a kernel needs the opt-in; the static part
   * (~6 KiB) is read once per instantiation. */
  static size_t static_bytes = (size_t)-1;
  if (static_bytes == (size_t)-1) {
    cudaFuncAttributes fa;
    CUDA_CHECK(cudaFuncGetAttributes(&fa, kernel));
    static_bytes = fa.sharedSizeBytes;
  }
  if (smem + static_bytes > 48 * 1024)
    CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  kernel<<<a->num_blocks, kThreads, smem, stream>>>(*ctx, *a);
  CUDA_CHECK(cudaGetLastError());
  return EPX_OK;
}

}  // namespace

extern "C" epx_status_t epx__ll_dispatch_launch(const epx__kernel_ctx_t *ctx,
                                                const epx__ll_dispatch_launch_args_t *args,
                                                cudaStream_t stream) {
  const size_t smem = (args->phases & EPX_LL_PHASE_SEND)
                          ? epx__ll_bitmap_bytes(args->num_experts, args->num_tokens)
                          : 0;
  switch ((args->idx_is_int64 ? 1 : 0) | (args->fp8 ? 2 : 0) | (args->by_rank ? 4 : 0)) {
    case 0:
      return launch_dispatch<int, false, false>(ctx, args, smem, stream);
    case 1:
      return launch_dispatch<long long, false, false>(ctx, args, smem, stream);
    case 2:
      return launch_dispatch<int, true, false>(ctx, args, smem, stream);
    case 3:
      return launch_dispatch<long long, true, false>(ctx, args, smem, stream);
    case 4:
      return launch_dispatch<int, false, true>(ctx, args, smem, stream);
    case 5:
      return launch_dispatch<long long, false, true>(ctx, args, smem, stream);
    case 6:
      return launch_dispatch<int, true, true>(ctx, args, smem, stream);
    default:
      return launch_dispatch<long long, true, true>(ctx, args, smem, stream);
  }
}

extern "C" epx_status_t epx__ll_combine_launch(const epx__kernel_ctx_t *ctx,
                                               const epx__ll_combine_launch_args_t *args,
                                               cudaStream_t stream) {
  if (args->by_rank)
    ll_combine_kernel<true><<<args->num_blocks, kThreads, 0, stream>>>(*ctx, *args);
  else
    ll_combine_kernel<false><<<args->num_blocks, kThreads, 0, stream>>>(*ctx, *args);
  CUDA_CHECK(cudaGetLastError());
  return EPX_OK;
}

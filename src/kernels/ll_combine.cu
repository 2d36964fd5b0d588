/*
 * ll_combine.cu - the low-latency combine over NVLink (docs/low-latency.md) and its launcher
 * epx__ll_combine_launch; what it shares with the dispatch is in ll_common.cuh. A combine runs
 * in its dispatch's buffer and reads what the dispatch left there: src_info, recv_num, this
 * rank's routing (my_ids, my_w) and, BY_RANK, the staged headers.
 *
 * Route DIRECT: rank d sends each row it received back to combine_recv[t*K + k] on the source
 * (k = the source's first slot naming the expert); rows are numbered over the (local expert,
 * source) segments and spread round-robin over the blocks. The source waits for every block of
 * every rank (any block may have sent a row of any token), then sums w[t][k] * row over the
 * token's valid slots, the (token, chunk) units spread over all blocks.
 *
 * Route BY_RANK: block b of rank d sums, for each token staged at stage[s][t] (t % G == b;
 * rounds of up to kBatch tokens), w * y over the token's experts on d (from the dispatch header)
 * and sends one float32 partial to combine_recv[d*M + t] on s; block b of s waits for block b of
 * every rank and adds the partials of the token's ranks.
 *
 * Route DISPATCH_BY_RANK (the default) runs the BY_RANK dispatch and this DIRECT combine; so does
 * route BY_RANK for a combine given weights at combine time (args topk_weights), which only the
 * source can apply: both dispatches write the src_info of every row they deliver. Every
 * block signals every rank when its sends are issued: cflag[me][b] = (epoch, 0). Sums are
 * float32, written once as BF16; a token with no valid slot gets +0.
 *
 * Packed dispatch layout (ll_pack.cuh): the sends read the rows of (j, s) from recv_begin[j][s]
 * instead of s*M (one template flag); nothing else changes.
 */
#include "kernels/api.h"
#include "kernels/launch.cuh"
#include "kernels/ll_common.cuh"
#include "kernels/segment.cuh"
#include "kernels/trace.cuh"

namespace epx::ll {
namespace {

/* ------------------------------------------------------------------------------------------
 * Row sums
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

/* ------------------------------------------------------------------------------------------
 * Send
 * ---------------------------------------------------------------------------------------- */
/* Exclusive prefix of v[0..n) into prefix[0..n] (n <= 2 * kThreads), all threads. */
__device__ __forceinline__ void block_prefix(const int *v, int n, int *prefix, int *warp_sums) {
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

/* Route DIRECT: every row this rank received goes back to its token's slot on the source. Rows
 * are numbered over the (local expert, source) segments; block b takes rows b, b + G, ..., each
 * warp two (row, chunk) units per step with all their loads in flight. s_prefix first holds the
 * segments' row counts, then (in place) their prefix. kPacked: segment (j, s) starts at
 * recv_begin[j][s] of the dispatch instead of s*M. */
template <bool kPacked>
__device__ __forceinline__ void combine_send_direct(const epx__kernel_ctx_t &ctx,
                                                    const epx__ll_combine_launch_args_t &a,
                                                    const Call &c, unsigned mask, int *s_prefix,
                                                    int *s_warp_sums) {
  const int lane = c.lane, b = c.b, G = c.G, R = c.R, H = c.H, K = c.K, L = c.L, M = c.M;
  const int nch = c.nch;
  const epx__ws_layout_t &lay = ctx.layout;
  const int *num = (const int *)(c.own + lay.ll_recv_num_offset);
  const int *begin = (const int *)(c.own + lay.ll_recv_begin_offset);
  for (int i = c.tid; i < L * R; i += kThreads) s_prefix[i] = ((mask >> (i % R)) & 1u) ? 0 : num[i];
  __syncthreads();
  block_prefix(s_prefix, L * R, s_prefix, s_warp_sums);
  const int total = s_prefix[L * R];
  const int4 *info = (const int4 *)(c.own + lay.ll_src_info_offset);
  for (int u0 = c.warp;; u0 += 2 * kWarps) {
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
      const int seg = epx::segment_of_shared(s_prefix, L * R, g);
      const int j = seg / R;
      seg_s[q] = seg % R;
      const size_t seg_row = kPacked ? (size_t)begin[seg] : (size_t)seg_s[q] * M;
      row[q] = (size_t)j * c.RM + seg_row + (g - s_prefix[seg]);
      src_info[q] = __ldcg(info + row[q]);
      /* Lane l: channels 8 l and 256 + 8 l of the chunk, 512 contiguous bytes per store
       * instruction (two int4 per lane, 32 bytes apart, made this send 1.3x slower). */
      const int4 *src = (const int4 *)((const char *)a.x + (row[q] * H + c0[q]) * 2);
      if (c0[q] < H) x0[q] = ld_nc_na_v4(src);
      if (c0[q] + 256 < H) x1[q] = ld_nc_na_v4(src + 32);
    }
    if (!valid[0]) break;
#pragma unroll
    for (int q = 0; q < 2; q++) {
      const int t = src_info[q].y, k = src_info[q].z;
      if (!valid[q] || c0[q] >= H || t < 0 || t >= M || k < 0 || k >= K) continue;
      int4 *dst = (int4 *)(ll_buf(ctx, seg_s[q], c.p) + lay.ll_combine_recv_offset +
                           (((size_t)t * K + k) * H + c0[q]) * 2);
      dst[0] = x0[q];
      if (c0[q] + 256 < H) dst[32] = x1[q];
    }
  }
}

/* The expert rows of one staged token and where its partial goes. */
struct CombineRows {
  int n;
  const char *src[EPX_MAX_TOP_K]; /* rows of y */
  float w[EPX_MAX_TOP_K];
  char *dst; /* the partial's row on the source rank */
};

/* Route BY_RANK: the partials of the tokens that blocks b of the sources staged here in the
 * dispatch, the own rank's included (its headers are in its own stage rows). Rows are
 * source-major, in rounds of up to kBatch: warp w reads the header of row w of the round (the
 * expert rows of its entries on this rank), then all warps sum and send the round's (row,
 * chunk) units. A source that did not reach this rank in the dispatch (its signal does not
 * carry the dispatch's epoch), or is masked now, has no rows. kPacked: the rows of (j, s) start
 * at recv_begin[j][s]. */
template <bool kPacked>
__device__ __forceinline__ void combine_send_by_rank(const epx__kernel_ctx_t &ctx,
                                                     const epx__ll_combine_launch_args_t &a,
                                                     const Call &c, uint32_t dispatch_epoch,
                                                     unsigned mask, int *s_count,
                                                     CombineRows *s_rows,
                                                     float (*s_partial)[kChunk]) {
  const int tid = c.tid, lane = c.lane, warp = c.warp, b = c.b, G = c.G, R = c.R, me = c.me;
  const int H = c.H, K = c.K, L = c.L, M = c.M, p = c.p, nch = c.nch;
  const epx__ws_layout_t &lay = ctx.layout;
  char *own = c.own;
  if (tid < R) {
    const int s = tid;
    const uint64_t f = __ldcg((const unsigned long long *)(own + lay.ll_dflag_offset) +
                              (size_t)s * EPX_LL_MAX_BLOCKS + b);
    const bool live = !((mask >> s) & 1u) && (uint32_t)(f >> 32) == dispatch_epoch;
    const uint32_t Ts = (uint32_t)f > (uint32_t)M ? (uint32_t)M : (uint32_t)f;
    s_count[s] = live ? tokens_of_block((int)Ts, b, G) : 0;
  }
  __syncthreads();
  SourceRows rows;
  const int total = rows.count(R, [&](int s) { return s_count[s]; });
  in_rounds(
      warp, total,
      [&](int r, int w) {
        int t;
        const int s = rows.source_of(r, b, G, &t);
        const StagedHeader *hdr =
            (const StagedHeader *)(own + lay.ll_stage_offset +
                                   ((size_t)s * M + t) * lay.ll_stage_row_bytes);
        const int n = load_entries(hdr, dispatch_epoch, t, K);
        const uint32_t packed = lane < n ? __ldcg(&hdr->packed[lane]) : 0u;
        const float wt = lane < n ? __ldcg(&hdr->weight[lane]) : 0.f;
        const StagedEntry en = unpack_entry(packed);
        const bool ok = lane < n && en.expert < L && en.pos < M;
        const unsigned ob = __ballot_sync(kFull, ok);
        CombineRows *cr = &s_rows[w];
        if (ok) {
          const int idx = __popc(ob & ((1u << lane) - 1u));
          const size_t seg_row =
              kPacked ? (size_t)((const int *)(own + lay.ll_recv_begin_offset))[en.expert * R + s]
                      : (size_t)s * M;
          cr->src[idx] = (const char *)a.x + ((size_t)en.expert * c.RM + seg_row + en.pos) * H * 2;
          cr->w[idx] = wt;
        }
        if (lane == 0) {
          cr->n = __popc(ob);
          cr->dst = ll_buf(ctx, s, p) + lay.ll_combine_recv_offset + ((size_t)me * M + t) * H * 4;
        }
      },
      [&](int, int nb) {
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
          store_acc_f32(cr->dst, ch * kChunk, H, acc, s_partial[warp]);
        }
      });
}

/* ------------------------------------------------------------------------------------------
 * Receive
 * ---------------------------------------------------------------------------------------- */
/* The signals of this call: BY_RANK block b of every rank, DIRECT every block of every rank.
 * Returns the ranks whose signals all arrived, without those that marked their rows not valid
 * (kRowsInvalid in a signal's low word: left out like a masked peer, but alive, so not masked;
 * EPX_ERR_PEER_DATA recorded) (*s_ok: the block's shared word for it). */
template <bool kByRank>
__device__ __forceinline__ unsigned combine_wait(const epx__kernel_ctx_t &ctx, const Call &c,
                                                 uint32_t epoch, unsigned *s_ok) {
  const int b = c.b, G = c.G, R = c.R;
  if (c.tid == 0) *s_ok = (1u << R) - 1u;
  __syncthreads();
  const int waits = kByRank ? R : R * G;
  for (int i = c.tid; i < waits; i += kThreads) {
    const int d = kByRank ? i : i / G, blk = kByRank ? b : i % G;
    const uint32_t v =
        wait_signal(ctx, c.own, ctx.layout.ll_cflag_offset, d, blk, epoch, EPX_STAGE_LL_COMBINE);
    if (v == kNoSignal) {
      atomicAnd(s_ok, ~(1u << d));
    } else if (v & kRowsInvalid) { /* (this rank's own mark too: its call returns the error) */
      atomicAnd(s_ok, ~(1u << d));
      if (d != ctx.rank)
        raise_error(ctx, EPX_ERR_PEER_DATA, EPX_STAGE_LL_COMBINE, d, -1, (long long)epoch);
    }
  }
  __syncthreads();
  return *s_ok;
}

/* Lane k < K: slot k of token t in this rank's routing (my_ids, my_w): its expert e (-1: none),
 * weight w and the expert's rank d; valid when e is an expert of a rank in `ok`. */
struct Slot {
  int e, d;
  float w;
  bool valid;
};

__device__ __forceinline__ Slot load_slot(const int *my_ids, const float *my_w, int K, int E, int L,
                                          int lane, unsigned ok, int t) {
  Slot sl;
  sl.e = lane < K ? my_ids[(size_t)t * K + lane] : -1;
  sl.w = lane < K ? my_w[(size_t)t * K + lane] : 0.f;
  sl.d = sl.e >= 0 ? sl.e / L : 0;
  sl.valid = sl.e >= 0 && sl.e < E && ((ok >> sl.d) & 1u);
  return sl;
}

/* Route BY_RANK: block b sums, for its tokens t % G == b, the partials of the token's ranks in
 * rank order. */
__device__ __forceinline__ void combine_reduce_by_rank(const epx__kernel_ctx_t &ctx,
                                                       const epx__ll_combine_launch_args_t &a,
                                                       const Call &c, unsigned ok) {
  const int lane = c.lane, b = c.b, G = c.G, H = c.H, K = c.K, M = c.M, nch = c.nch;
  const epx__ws_layout_t &lay = ctx.layout;
  const int *my_ids = (const int *)(c.own + lay.ll_my_ids_offset);
  const float *my_w = (const float *)(c.own + lay.ll_my_w_offset);
  const char *recv = c.own + lay.ll_combine_recv_offset;
  const int units = tokens_of_block(a.num_tokens, b, G) * nch;
  for (int u = c.warp; u < units; u += kWarps) {
    const int t = b + (u / nch) * G, ch = u % nch;
    const Slot sl = load_slot(my_ids, my_w, K, a.num_experts, c.L, lane, ok, t);
    const int c0 = ch * kChunk + lane * 16;
    float acc[16] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f,
                     0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    const unsigned ranks = __reduce_or_sync(kFull, sl.valid ? 1u << sl.d : 0u);
    accumulate_rows_f32(
        __popc(ranks),
        [&](int i, float *wi) {
          unsigned rest = ranks;
          for (int q = 0; q < i; q++) rest &= rest - 1;
          *wi = 1.f;
          return recv + ((size_t)(__ffs(rest) - 1) * M + t) * H * 4;
        },
        c0, c0 < H, acc);
    if (c0 < H) store_acc((char *)a.out + (size_t)t * H * 2, c0, acc);
  }
}

/* Route DIRECT: the (token, chunk) units u % G == b; the valid slots of the token in slot
 * order, slot k reading the row of the token's first slot naming the same expert (one row per
 * distinct expert was sent), weighted by the combine-time weights a.topk_weights (kGivenWeights,
 * slot order as my_w) or by this rank's my_w (the dispatch's). */
template <bool kGivenWeights>
__device__ __forceinline__ void combine_reduce_direct(const epx__kernel_ctx_t &ctx,
                                                      const epx__ll_combine_launch_args_t &a,
                                                      const Call &c, unsigned ok) {
  const int lane = c.lane, b = c.b, G = c.G, H = c.H, K = c.K, nch = c.nch;
  const epx__ws_layout_t &lay = ctx.layout;
  const int *my_ids = (const int *)(c.own + lay.ll_my_ids_offset);
  const float *my_w = kGivenWeights ? a.topk_weights : (const float *)(c.own + lay.ll_my_w_offset);
  const char *recv = c.own + lay.ll_combine_recv_offset;
  for (int u = b + c.warp * G; u < a.num_tokens * nch; u += kWarps * G) {
    const int t = u / nch, ch = u % nch;
    const Slot sl = load_slot(my_ids, my_w, K, a.num_experts, c.L, lane, ok, t);
    const int c0 = ch * kChunk + lane * 16;
    float acc[16] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f,
                     0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int first = lane;
    for (int k = K - 1; k >= 0; k--)
      if (__shfl_sync(kFull, sl.e, k) == sl.e && k < lane) first = k;
    const unsigned vb = __ballot_sync(kFull, sl.valid);
    accumulate_rows(
        __popc(vb),
        [&](int i, float *wi) {
          unsigned rest = vb;
          for (int q = 0; q < i; q++) rest &= rest - 1;
          const int k = __ffs(rest) - 1;
          *wi = __shfl_sync(kFull, sl.w, k);
          const int kf = __shfl_sync(kFull, first, k);
          return recv + ((size_t)t * K + kf) * H * 2;
        },
        c0, c0 < H, acc);
    if (c0 < H) store_acc((char *)a.out + (size_t)t * H * 2, c0, acc);
  }
}

}  // namespace

/* The kernel has external linkage so that profilers show it as epx::ll::combine (docs/profiling.md,
 * "Kernel names"). */
/* Traced per block by thread 0: send, wait, reduce (docs/profiling.md). kPacked: the dispatch's
 * rows are packed (segment (j, s) starts at recv_begin[j][s]). kGivenWeights: the DIRECT reduce
 * applies the call's combine-time weights (a specialisation of its own, so the kernel without
 * them is the one it always was). */
template <bool kByRank, bool kPacked, bool kGivenWeights>
__global__ void __launch_bounds__(kThreads, 1)
    combine(epx__kernel_ctx_t ctx, epx__ll_combine_launch_args_t a) {
  __shared__ uint32_t s_epoch, s_dispatch_epoch;
  __shared__ unsigned s_mask, s_ok;
  __shared__ int s_prefix[EPX_MAX_EXPERTS + 1];
  __shared__ int s_warp_sums[kWarps];
  __shared__ CombineRows s_rows[kBatch];
  __shared__ int s_count[EPX_MAX_RANKS];
  __shared__ float s_partial[kByRank ? kWarps : 1][kChunk]; /* store_acc_f32's transpose */

  /* Launched early (early_launch, epx_moe_decode): the expert rows and their sends are the
   * previous kernel's. */
  epx::grid_dependency_wait();
  const Call c = load_call(ctx, a);

  if (c.tid == 0) {
    s_epoch = call_epoch(ctx, kKindCombine, c.p, a.phases);
    s_dispatch_epoch = *epoch_slot(ctx, kKindDispatch, c.p, c.b);
    s_mask = read_mask(ctx);
  }
  __syncthreads();
  const uint32_t epoch = s_epoch, dispatch_epoch = s_dispatch_epoch;

  if (a.phases & EPX_LL_PHASE_SEND) {
    const uint64_t t_send = trace_begin(ctx);
    const unsigned mask = s_mask;
    if (kByRank)
      combine_send_by_rank<kPacked>(ctx, a, c, dispatch_epoch, mask, s_count, s_rows, s_partial);
    else if (!a.rows_sent && !a.rows_invalid) /* rows_sent: the experts' down projection wrote
                                                 them already; rows_invalid: nobody reads them */
      combine_send_direct<kPacked>(ctx, a, c, mask, s_prefix, s_warp_sums);
    signal_ranks(ctx, mask, ctx.layout.ll_cflag_offset, c.p, epoch,
                 a.rows_invalid ? kRowsInvalid : 0u);
    if (c.tid == 0) trace_end(ctx, t_send, EPX_TRACE_LL_COMBINE_SEND, c.b);
  }

  if (a.phases & EPX_LL_PHASE_RECV) {
    const uint64_t t_wait = trace_begin(ctx);
    const unsigned ok = combine_wait<kByRank>(ctx, c, epoch, &s_ok);
    if (c.tid == 0) trace_end(ctx, t_wait, EPX_TRACE_LL_COMBINE_WAIT, __popc(ok));
    const uint64_t t_reduce = trace_begin(ctx); /* after the wait's end */
    if (kByRank)
      combine_reduce_by_rank(ctx, a, c, ok);
    else
      combine_reduce_direct<kGivenWeights>(ctx, a, c, ok);
    if (c.tid == 0) trace_end(ctx, t_reduce, EPX_TRACE_LL_COMBINE_REDUCE, a.num_tokens);
  }
}

}  // namespace epx::ll

extern "C" epx_status_t epx__ll_combine_launch(const epx__kernel_ctx_t *ctx,
                                               const epx__ll_combine_launch_args_t *args,
                                               cudaStream_t stream) {
  using epx::ll::combine;
  const int blocks = args->num_blocks, threads = epx::ll::kThreads;
  return EPX_BOOL_SWITCH(args->packed, kPacked, [&] {
    /* Combine-time weights only reach the DIRECT combine (ll.c): no BY_RANK variant with them. */
    if (args->by_rank)
      return epx::launch_ex<combine<true, kPacked, false>>(args->early_launch, blocks, threads, 0,
                                                           stream, *ctx, *args);
    return EPX_BOOL_SWITCH(args->topk_weights != NULL, kGivenWeights, [&] {
      return epx::launch_ex<combine<false, kPacked, kGivenWeights>>(
          args->early_launch, blocks, threads, 0, stream, *ctx, *args);
    });
  });
}

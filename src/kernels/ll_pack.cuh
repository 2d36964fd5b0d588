/*
 * ll_pack.cuh - the packed low-latency layout and the UE8M0 word scales (docs/low-latency.md,
 * "Packed layout"), used by ll_dispatch.cu (receive half) and ll_combine.cu.
 *
 * Packed: the rows of local expert j are [0, count[j]); source s's rows (distinct (token,
 * expert) pairs in ascending token order, as in the fixed layout) start at begin[j][s] = the
 * sum of cnt[j][s'] over the sources s' < s. Only the BY_RANK dispatch produces it: the sender
 * stages every row (its own rank's too) and the receiver, which holds the cnt words of every
 * source once it has the signals of ALL sender blocks (sender block e % G writes cnt of expert
 * e), computes begin itself and fans each staged row out to begin[j][s] + pos. No count
 * exchange, no second pass over the rows; the price is that receiver block b waits for every
 * sender block instead of block b alone.
 *
 * UE8M0 words: a 512-channel chunk holds 4 scale groups, so its scales become one int32 word:
 * the exponent byte of group 4w + i in bits 8i..8i+7 (DeepEP's and DeepGEMM's byte order on a
 * little-endian GPU: byte i of the word is group 4w + i). Bytes of groups past H are 0.
 */
#ifndef EPX_KERNELS_LL_PACK_CUH_
#define EPX_KERNELS_LL_PACK_CUH_

#include "kernels/ll_common.cuh"

namespace epx::ll {

/* Row `row` of the scales array at `base`: float32 [H/128] per row, or kPackScales: int32 UE8M0
 * words [nch] per row (stored as float * for the plans; written as uint32_t). */
template <bool kPackScales>
__device__ __forceinline__ float *scale_row(char *base, size_t row, int nsc, int nch) {
  if (kPackScales) return (float *)((uint32_t *)base + row * nch);
  return (float *)base + row * nsc;
}

/* The UE8M0 word of one chunk from its 4 power-of-two scales; groups at or past H give 0. */
__device__ __forceinline__ uint32_t ue8m0_word(const float *sc, int ch, int H) {
  uint32_t word = 0;
#pragma unroll
  for (int g = 0; g < 4; g++)
    if (ch * kChunk + g * 128 < H) word |= ((__float_as_uint(sc[g]) >> 23) & 0xffu) << (8 * g);
  return word;
}

/* Packed receive: wait for the signals of every block of every source (thread i for (source
 * i / G, block i % G)). src_tokens[s] = source s's token count (from block b's signal), or
 * kNoSignal when some block of s did not arrive (masked): its cnt words may be missing, so the
 * whole source counts 0 rows. */
__device__ __forceinline__ void wait_all_sources(const epx__kernel_ctx_t &ctx, const Call &c,
                                                 uint32_t epoch, uint32_t *src_tokens,
                                                 unsigned *s_dead) {
  if (c.tid == 0) *s_dead = 0;
  __syncthreads();
  for (int i = c.tid; i < c.R * c.G; i += kThreads) {
    const int s = i / c.G, blk = i % c.G;
    const uint32_t v =
        wait_signal(ctx, c.own, ctx.layout.ll_dflag_offset, s, blk, epoch, EPX_STAGE_LL_DISPATCH);
    if (v == kNoSignal)
      atomicOr(s_dead, 1u << s);
    else if (blk == c.b)
      src_tokens[s] = v > (uint32_t)c.M ? (uint32_t)c.M : v;
  }
  __syncthreads();
  if (c.tid < c.R && ((*s_dead >> c.tid) & 1u)) src_tokens[c.tid] = kNoSignal;
  __syncthreads();
}

/* Packed receive, every block: s_cnt[j*R + s] = rows of (j, s) (cnt, clamped to [0, M]; 0 for
 * a missing source) and s_begin[j*R + s] = their first row. */
__device__ __forceinline__ void pack_begins(const epx__kernel_ctx_t &ctx, const Call &c,
                                            const uint32_t *src_tokens, int *s_cnt, int *s_begin) {
  const int R = c.R, L = c.L, M = c.M;
  const int *cnt = (const int *)(c.own + ctx.layout.ll_cnt_offset);
  for (int i = c.tid; i < L * R; i += kThreads) {
    int n = 0;
    if (src_tokens[i % R] != kNoSignal) {
      n = __ldcg(cnt + i);
      n = n < 0 ? 0 : n > M ? M : n;
    }
    s_cnt[i] = n;
  }
  __syncthreads();
  for (int j = c.tid; j < L; j += kThreads) {
    int acc = 0;
    for (int s = 0; s < R; s++) {
      s_begin[j * R + s] = acc;
      acc += s_cnt[j * R + s];
    }
  }
  __syncthreads();
}

/* Packed receive: recv_count, recv_begin, recv_num (and the optional layout range) of the local
 * experts e % G == b. */
__device__ __forceinline__ void write_packed_counts(const epx__kernel_ctx_t &ctx, const Call &c,
                                                    const int *s_cnt, const int *s_begin,
                                                    long long *layout_range) {
  const int R = c.R, L = c.L;
  const epx__ws_layout_t &lay = ctx.layout;
  int *count = (int *)(c.own + lay.ll_recv_count_offset);
  int *begin = (int *)(c.own + lay.ll_recv_begin_offset);
  int *num = (int *)(c.own + lay.ll_recv_num_offset);
  for (int j = c.tid; j < L; j += kThreads) {
    if ((c.me * L + j) % c.G != c.b) continue;
    for (int s = 0; s < R; s++) {
      const int i = j * R + s;
      num[i] = s_cnt[i];
      begin[i] = s_begin[i];
      if (layout_range) layout_range[i] = ((long long)s_begin[i] << 32) | (long long)s_cnt[i];
    }
    count[j] = s_begin[j * R + R - 1] + s_cnt[j * R + R - 1];
  }
}

}  // namespace epx::ll

#endif  // EPX_KERNELS_LL_PACK_CUH_

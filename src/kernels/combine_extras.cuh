/*
 * combine_extras.cuh - what normal combine does beyond summing rows, for DeepEP parity (its
 * intranode combine's `topk_weights` -> `combined_topk_weights`, and `bias`): the top-k weights
 * of each returned row travel with the row and are summed per source token, and one or two bias
 * rows are added before the one BF16 rounding. Only the kExtras specialisation of
 * normal_combine.cu's kernel includes these paths, so a combine without them runs exactly the
 * code it ran before.
 *
 * Region (workspace.h): combine_weights, 2 parities x [R, max_tokens, K] float32; row (d, p)
 * holds the K weights of the combine slab's row (d, p). Rank d writes them (plain stores) before
 * the system fence and the release add that signal the chunk holding p, so the chunk counter
 * that publishes a row publishes its weights too: the reduce side needs no wait of its own.
 */
#ifndef EPX_KERNELS_COMBINE_EXTRAS_CUH_
#define EPX_KERNELS_COMBINE_EXTRAS_CUH_

#include "kernels/bf16.cuh"

namespace epx {

/* Lane 0 of a send warp, once a unit's last piece is stored: the top-k weights of its rows, n =
 * rows x K floats, contiguous at src (the caller's [num_recv, K] input) and at dst (the peer's
 * region). Loads batched ahead of the stores so that one thread keeps several in flight. */
__device__ __forceinline__ void copy_unit_weights(const float *src, float *dst, int n) {
  constexpr int kBatch = 8;
  for (int i0 = 0; i0 < n; i0 += kBatch) {
    float v[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; j++)
      if (i0 + j < n) v[j] = src[i0 + j];
#pragma unroll
    for (int j = 0; j < kBatch; j++)
      if (i0 + j < n) dst[i0 + j] = v[j];
  }
}

/* A reduce warp, token t: lane k < K writes out[k] = the sum over the ranks r in mask, r
 * ascending, from +0.0f, of the k-th weight of t's row on r (own rows from own_w, a peer's from
 * this rank's region, row (r, pos_r)); lane r holds pos_r in my_pos. Plain float32 additions in
 * the reference's order, so the result is bit-exact with it. NOTE: plain loads: peers wrote the
 * region during this kernel (published by the chunk counters the caller waited for). */
template <int kRanks>
__device__ __forceinline__ void reduce_token_weights(const float *own_w, const float *region,
                                                     int me, int max_tokens, int K, unsigned mask,
                                                     int my_pos, int lane, float *out) {
  float sum = 0.f;
#pragma unroll
  for (int r = 0; r < kRanks; r++) {
    const int pos = __shfl_sync(0xffffffffu, my_pos, r);
    if (((mask >> r) & 1u) && lane < K)
      sum += r == me ? own_w[(size_t)pos * K + lane]
                     : region[((size_t)r * max_tokens + pos) * K + lane];
  }
  if (lane < K) out[lane] = sum;
}

/* acc[0..8) += the 8 BF16 values of each bias row given (bias[0] then bias[1]): b[j] was loaded
 * from bias[j] at the same 16-byte word as the rows. */
__device__ __forceinline__ void add_bias_bf16x8(const void *const *bias, const int4 *b,
                                                float *acc) {
#pragma unroll
  for (int j = 0; j < 2; j++) {
    if (!bias[j]) continue;
    float f[8];
    bf16x8_to_float(b[j], f);
#pragma unroll
    for (int i = 0; i < 8; i++) acc[i] = acc[i] + f[i];
  }
}

}  // namespace epx

#endif  // EPX_KERNELS_COMBINE_EXTRAS_CUH_

/*
 * segment.cuh - which segment of an ascending prefix array an index is in: a row of the
 * expert-major layout (the prefill layer's row kernels, moe_prefill.cu, and the expert-side
 * reduce of the batched GEMM's blocked outputs, expand_combine.cu), and, over prefixes a kernel
 * keeps in shared memory, a received row of the low-latency combine (ll_combine.cu) and a tile
 * of the grouped FP8 GEMM (moe_gemm_fp8.cu).
 */
#ifndef EPX_KERNELS_SEGMENT_CUH_
#define EPX_KERNELS_SEGMENT_CUH_

namespace epx {

/* The segment j holding row r: begin[j] <= r < begin[j + 1] (begin ascending, r < begin[L]); a
 * binary search, at most 8 steps for 256 segments. begin is read-only for the calling kernel. */
__device__ __forceinline__ int segment_of(const int *begin, int L, int r) {
  int lo = 0, hi = L - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (__ldg(begin + mid) <= r)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

/* The same over prefix[0..n] anywhere (plain loads: shared memory too): the last j < n with
 * prefix[j] <= g. Empty segments (equal prefixes) are skipped for the last of them, so for
 * g < prefix[n] the segment found holds g. */
__device__ __forceinline__ int segment_of_shared(const int *prefix, int n, int g) {
  int lo = 0, hi = n;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (prefix[mid] <= g)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

}  // namespace epx

#endif /* EPX_KERNELS_SEGMENT_CUH_ */

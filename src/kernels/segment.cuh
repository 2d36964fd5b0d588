/*
 * segment.cuh - which local expert's segment a row of the expert-major layout is in: the prefill
 * layer's row kernels (moe_prefill.cu) and the expert-side reduce of the batched GEMM's blocked
 * outputs (expand_combine.cu) both map rows so.
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

}  // namespace epx

#endif /* EPX_KERNELS_SEGMENT_CUH_ */

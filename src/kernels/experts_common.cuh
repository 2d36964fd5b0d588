/*
 * experts_common.cuh - what the experts' GEMM kernels share: which rows an expert has, the
 * cp.async copies they stream with, SiLU, and where the sending down projection puts a row.
 * experts_ffn.cu holds the BF16 GEMMs (mma.sync), experts_fp8.cu the FP8 ones (wgmma).
 */
#ifndef EPX_KERNELS_EXPERTS_COMMON_CUH_
#define EPX_KERNELS_EXPERTS_COMMON_CUH_

#include <cuda_bf16.h>

#include "kernels/api.h"
#include "kernels/bf16.cuh"
#include "kernels/ptx.cuh"

namespace epx::experts {

/* Expert e's rows: [*begin, *begin + return), cut to its room (epx.h). */
__device__ __forceinline__ int expert_rows(const int *count, const int *begin_arr,
                                           int rows_per_expert, int num_rows, int e, int *begin) {
  int c = count[e], room;
  if (begin_arr) {
    const int b = begin_arr[e];
    if (b < 0 || b > num_rows) return 0;
    *begin = b;
    room = num_rows - b;
  } else {
    *begin = e * rows_per_expert;
    room = rows_per_expert;
  }
  return max(0, min(c, room));
}

/* A GEMM CTA's start: waits for the previous kernel when launched early (the counts and rows
 * come from it), lets the next one launch, and finds its expert's rows (expert blockIdx.y):
 * returns their count and *begin (0: nothing to do; an idle expert costs no weight traffic)
 * and, for the sending down projection, the peers masked off (*dead, read once per CTA). */
__device__ __forceinline__ int cta_expert_rows(const epx__experts_gemm_args_t &a, int *begin,
                                               unsigned *dead) {
  epx::grid_dependency_wait();
  epx::grid_dependents_may_launch();
  *begin = 0;
  const int count =
      expert_rows(a.expert_count, a.expert_begin, a.rows_per_expert, a.num_rows, blockIdx.y, begin);
  *dead = count > 0 && a.scatter_rows ? *(volatile const unsigned *)a.scatter.dead_mask : 0u;
  return count;
}

/* The GEMM grid: (column tiles, experts). Gate/up (swiglu) CTAs own 128 gate rows and the
 * matching 128 up rows; down CTAs own cta_rows rows. */
inline dim3 gemm_grid(const epx__experts_gemm_args_t &a, int cta_rows) {
  const int col_tiles = a.swiglu ? (a.n / 2) / 128 : (a.n + cta_rows - 1) / cta_rows;
  return dim3(col_tiles, a.num_experts);
}

__device__ __forceinline__ void cp_async_cg16(void *smem, const void *gmem) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(epx::smem_addr(smem)),
               "l"(gmem)
               : "memory");
}
/* 16 bytes, or zeros when src_bytes is 0 (nothing is read then). */
__device__ __forceinline__ void cp_async_ca16_zfill(void *smem, const void *gmem, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;\n" ::"r"(epx::smem_addr(smem)),
               "l"(gmem), "r"(src_bytes)
               : "memory");
}
/* 4 bytes, or zeros when src_bytes is 0. */
__device__ __forceinline__ void cp_async_ca4_zfill(void *smem, const void *gmem, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(epx::smem_addr(smem)),
               "l"(gmem), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ float silu_mul(float gate, float up) {
  return gate / (1.0f + expf(-gate)) * up;
}

/* The down projection's row `row` on its token's source rank (epx__experts_scatter_t), or
 * NULL: a source that is dead or out of range, or a token or slot outside the receive rows. */
__device__ __forceinline__ __nv_bfloat16 *scatter_row(const epx__experts_scatter_t &sc, size_t row,
                                                      int n, unsigned dead) {
  const int4 info = __ldg((const int4 *)sc.src_info + row);
  const int s = info.x, t = info.y, k = info.z;
  if (s < 0 || s >= sc.num_ranks || ((dead >> s) & 1u) || t < 0 || t >= sc.max_tokens || k < 0 ||
      k >= sc.top_k)
    return nullptr;
  return (__nv_bfloat16 *)sc.recv[s] + ((size_t)t * sc.top_k + k) * n;
}

/* The down projection's epilogue: out[row0 + tok][col0 + c] for c < kCols (BF16) from
 * tile[c * stride + tok] (float: weight row c of the CTA, token tok), whole 16-byte pieces;
 * with a.scatter_rows each row goes to its slot on its source rank instead (scatter_row). */
template <int kCols, int kThreadsPerCta>
__device__ __forceinline__ void store_down_rows(const float *tile, int stride,
                                                const epx__experts_gemm_args_t &a, int col0,
                                                size_t row0, int rows, unsigned dead) {
  for (int item = threadIdx.x; item < rows * (kCols / 8); item += kThreadsPerCta) {
    const int tok = item / (kCols / 8), ch = item % (kCols / 8);
    const int col = col0 + 8 * ch;
    if (col >= a.n) continue;
    const size_t row = row0 + tok;
    __nv_bfloat16 *dst = a.scatter_rows ? scatter_row(a.scatter, row, a.n, dead)
                                        : (__nv_bfloat16 *)a.out + row * a.n;
    if (!dst) continue;
    float f[8];
#pragma unroll
    for (int i = 0; i < 8; i++) f[i] = tile[(8 * ch + i) * stride + tok];
    *(int4 *)(dst + col) = epx::float8_to_bf16x8(f);
  }
  /* No fence for the rows sent to peers: the combine that signals them is a later kernel
   * (griddepcontrol.wait or stream order), whose release store at system scope follows this
   * grid's end in causality order, as a later kernel's flag after any earlier kernel's writes. */
}

}  // namespace epx::experts

#endif  // EPX_KERNELS_EXPERTS_COMMON_CUH_

/*
 * bf16.cuh - eight BF16 values packed in one int4 (16 bytes, one vector load or store), to and
 * from float32: what every reduce and quantize of EPX works in.
 */
#ifndef EPX_KERNELS_BF16_CUH_
#define EPX_KERNELS_BF16_CUH_

#include <cuda_bf16.h>

namespace epx {

/* f[0..8) = the 8 BF16 values of v. */
__device__ __forceinline__ void bf16x8_to_float(const int4 &v, float *f) {
  const __nv_bfloat162 *h = (const __nv_bfloat162 *)&v;
#pragma unroll
  for (int j = 0; j < 4; j++) {
    const float2 t = __bfloat1622float2(h[j]);
    f[2 * j] = t.x;
    f[2 * j + 1] = t.y;
  }
}

/* acc[0..8) += w * the 8 BF16 values of v. */
__device__ __forceinline__ void acc_bf16x8(const int4 &v, float w, float *acc) {
  const __nv_bfloat162 *h = (const __nv_bfloat162 *)&v;
#pragma unroll
  for (int j = 0; j < 4; j++) {
    const float2 t = __bfloat1622float2(h[j]);
    acc[2 * j] += w * t.x;
    acc[2 * j + 1] += w * t.y;
  }
}

/* acc[0..8) = acc + w * v, the product and the sum each rounded on its own (no fused
 * multiply-add): the order and roundings the CPU reference models bit for bit. */
__device__ __forceinline__ void acc_bf16x8_rn(const int4 &v, float w, float *acc) {
  float f[8];
  bf16x8_to_float(v, f);
#pragma unroll
  for (int q = 0; q < 8; q++) acc[q] = __fadd_rn(acc[q], __fmul_rn(w, f[q]));
}

/* f[0..8) rounded to BF16 (nearest even), packed. */
__device__ __forceinline__ int4 float8_to_bf16x8(const float *f) {
  int4 o;
  __nv_bfloat162 *h = (__nv_bfloat162 *)&o;
#pragma unroll
  for (int j = 0; j < 4; j++) h[j] = __floats2bfloat162_rn(f[2 * j], f[2 * j + 1]);
  return o;
}

}  // namespace epx

#endif  // EPX_KERNELS_BF16_CUH_

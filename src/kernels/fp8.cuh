/*
 * fp8.cuh - FP8 E4M3 with per-128-channel float32 scales, bit for bit the rule of
 * tests/ref/epx_ref.h: one 128-channel group is 8 consecutive lanes of 16 channels each.
 * Used by low-latency dispatch (BF16 rows quantized on the way out) and by the experts' FFN
 * (its input rows and its SwiGLU output).
 */
#ifndef EPX_KERNELS_FP8_CUH_
#define EPX_KERNELS_FP8_CUH_

#include <cuda_fp8.h>

#include "kernels/bf16.cuh"

namespace epx {

/* FP8 of this lane's 16 float channels f; *scale_out = the group's scale. Every lane of the
 * warp must call it (the group max is a shuffle within 8 lanes); lanes with nothing to
 * quantize pass zeros. */
__device__ __forceinline__ int4 quantize16_float(const float *f, bool ue8m0, float *scale_out) {
  constexpr unsigned kFull = 0xffffffffu;
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

/* The same for 16 BF16 channels, a then b. */
__device__ __forceinline__ int4 quantize16(const int4 &a, const int4 &b, bool ue8m0,
                                           float *scale_out) {
  float f[16];
  bf16x8_to_float(a, f);
  bf16x8_to_float(b, f + 8);
  return quantize16_float(f, ue8m0, scale_out);
}

}  // namespace epx

#endif  // EPX_KERNELS_FP8_CUH_

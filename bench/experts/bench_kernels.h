/*
 * bench_kernels.h - device helpers of epx_experts_bench (bench_kernels.cu).
 */
#ifndef EPX_BENCH_EXPERTS_KERNELS_H_
#define EPX_BENCH_EXPERTS_KERNELS_H_

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif
/* n BF16 values uniform in [-amp, amp). */
cudaError_t bench_fill_bf16(void *p, size_t n, float amp, uint64_t seed);
/* n random FP8 E4M3 codes (no NaN). */
cudaError_t bench_fill_fp8(void *p, size_t n, uint64_t seed);
/* n floats uniform in [lo, hi). */
cudaError_t bench_fill_f32(float *p, size_t n, float lo, float hi, uint64_t seed);
/* Read `bytes` (a multiple of 16) once with every SM. */
cudaError_t bench_read(const void *p, size_t bytes, int *sink, cudaStream_t stream);
#ifdef __cplusplus
}
#endif

#endif /* EPX_BENCH_EXPERTS_KERNELS_H_ */

/*
 * test_experts_fp8_gemm.c - the experts' FP8 GEMM (src/kernels/experts_fp8.cu, wgmma) on data
 * whose every product and sum is exact: codes of -2..2, power-of-two scales. The tensor cores'
 * FP8 sums keep fewer bits than float32 (docs/moe.md, "FP8 on wgmma"), but not fewer than these
 * sums need, so the down projection's BF16 output must equal the CPU's bit for bit: a piece
 * copied to the wrong swizzled place, a scale of the wrong block or row, or a token column
 * mixed up shows as a wrong value, not as rounding. The whole FFN against its oracle, on
 * realistic values, is test_experts_ffn.c.
 *
 *   experts_fp8_gemm_exact_on_small_integers  masked layout, experts with 0, 1, 8, 9, 20 and
 *                              33 rows (wgmma N of 8, 16, 24 and 32, two passes), K of one to
 *                              56 stages, n a multiple of 256 or of 128 only; rows outside the
 *                              experts untouched
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/gpu_util.h"
#include "kernels/api.h"
#include "ref/epx_ref.h"

#define SENTINEL 0x7fbf /* a BF16 NaN the kernel never writes */

typedef struct {
  int n, k;
} shape_t;

/* One shape: E experts of n x k, the masked layout with room rpe, counts given. */
static int run_shape(const shape_t *sh, uint64_t *rng) {
  enum { E = 6, RPE = 40 };
  static const int count[E] = {33, 20, 0, 9, 1, 8};
  const int n = sh->n, k = sh->k, kb = k / 128, rows = E * RPE;
  const size_t wn = (size_t)E * n * k, xn = (size_t)rows * k, on = (size_t)rows * n;
  const size_t wsn = (size_t)E * (n / 128) * kb, xsn = (size_t)rows * kb;
  int8_t *wv = malloc(wn), *xv = malloc(xn);
  uint8_t *w8 = malloc(wn), *x8 = malloc(xn);
  float *ws = malloc(wsn * 4), *xs = malloc(xsn * 4);
  uint16_t *got = malloc(on * 2);
  EXPECT(wv && xv && w8 && x8 && ws && xs && got);
  for (size_t i = 0; i < wn; i++) {
    wv[i] = (int8_t)(epx_test_rand_int(rng, 5) - 2);
    w8[i] = epx_ref_fp8_from_float((float)wv[i]);
  }
  for (size_t i = 0; i < xn; i++) {
    xv[i] = (int8_t)(epx_test_rand_int(rng, 5) - 2);
    x8[i] = epx_ref_fp8_from_float((float)xv[i]);
  }
  for (size_t i = 0; i < wsn; i++) ws[i] = ldexpf(1.f, epx_test_rand_int(rng, 5) - 2);
  for (size_t i = 0; i < xsn; i++) xs[i] = ldexpf(1.f, epx_test_rand_int(rng, 5) - 2);

  void *wd = NULL, *xd = NULL, *out = NULL;
  float *wsd = NULL, *xsd = NULL;
  int *countd = NULL;
  EXPECT_CUDA(cudaMalloc(&wd, wn));
  EXPECT_CUDA(cudaMalloc(&xd, xn));
  EXPECT_CUDA(cudaMalloc(&out, on * 2));
  EXPECT_CUDA(cudaMalloc((void **)&wsd, wsn * 4));
  EXPECT_CUDA(cudaMalloc((void **)&xsd, xsn * 4));
  EXPECT_CUDA(cudaMalloc((void **)&countd, sizeof count));
  EXPECT_CUDA(cudaMemcpy(wd, w8, wn, cudaMemcpyHostToDevice));
  EXPECT_CUDA(cudaMemcpy(xd, x8, xn, cudaMemcpyHostToDevice));
  EXPECT_CUDA(cudaMemcpy(wsd, ws, wsn * 4, cudaMemcpyHostToDevice));
  EXPECT_CUDA(cudaMemcpy(xsd, xs, xsn * 4, cudaMemcpyHostToDevice));
  EXPECT_CUDA(cudaMemcpy(countd, count, sizeof count, cudaMemcpyHostToDevice));
  for (size_t i = 0; i < on; i++) got[i] = SENTINEL;
  EXPECT_CUDA(cudaMemcpy(out, got, on * 2, cudaMemcpyHostToDevice));

  epx__experts_gemm_args_t a;
  memset(&a, 0, sizeof a);
  a.x = xd, a.x_scales = xsd, a.w = wd, a.w_scales = wsd, a.k = k, a.n = n;
  a.num_experts = E, a.num_rows = rows, a.rows_per_expert = RPE, a.expert_count = countd;
  a.fp8 = 1, a.swiglu = 0, a.out = out;
  EXPECT_OK(epx__experts_gemm_launch(&a, 0));
  EXPECT_CUDA(cudaDeviceSynchronize());
  EXPECT_CUDA(cudaMemcpy(got, out, on * 2, cudaMemcpyDeviceToHost));

  int bad = 0;
  for (int e = 0; e < E; e++)
    for (int r = 0; r < RPE; r++) {
      const size_t row = (size_t)e * RPE + r;
      for (int c = 0; c < n; c++) {
        uint16_t want = SENTINEL;
        if (r < count[e]) { /* every product, block sum and scaled sum is exact in float */
          float sum = 0.f;
          for (int b = 0; b < kb; b++) {
            int block = 0;
            const int8_t *wr = wv + ((size_t)e * n + c) * k + b * 128, *xr = xv + row * k + b * 128;
            for (int i = 0; i < 128; i++) block += wr[i] * xr[i];
            sum += (float)block * ws[((size_t)e * (n / 128) + c / 128) * kb + b] * xs[row * kb + b];
          }
          want = epx_ref_bf16_from_float(sum);
        }
        const uint16_t g = got[row * n + c];
        if (g != want && bad++ < 5)
          fprintf(stderr, "  n %d k %d: expert %d row %d (of %d) col %d = 0x%04x, want 0x%04x\n", n,
                  k, e, r, count[e], c, g, want);
      }
    }
  if (bad == 0) printf("  n %d k %d: every value exact\n", n, k);
  cudaFree(wd), cudaFree(xd), cudaFree(out), cudaFree(wsd), cudaFree(xsd), cudaFree(countd);
  free(wv), free(xv), free(w8), free(x8), free(ws), free(xs), free(got);
  EXPECTF(bad == 0, "%d values differ", bad);
  return TEST_PASS;
}

EPX_ONE_GPU_TEST(experts_fp8_gemm_exact_on_small_integers, 120) {
  static const shape_t shapes[] = {{256, 128}, {256, 256}, {384, 384}, {512, 7168}, {2048, 768}};
  uint64_t rng = epx_test_seed();
  for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
    EXPECT(run_shape(&shapes[i], &rng) == TEST_PASS);
  return TEST_PASS;
}

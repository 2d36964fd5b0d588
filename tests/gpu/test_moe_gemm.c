/*
 * test_moe_gemm.c - the prefill layer's FP8 GEMM (src/moe_gemm.c, epx__moe_gemm_fp8: cuBLASLt
 * with 128x128 block scales on the weights and 1x128 scales on the rows) on data whose every
 * product and sum is exact in float32: codes are small integers, scales powers of two. So the
 * GEMM's float32 output must equal the CPU's bit for bit, and a scale read from the wrong
 * place shows as a wrong value, not as rounding. On a mismatch the test also says which other
 * scale layout the GPU's values match (rows' scales per row instead of per block, weight
 * scales transposed or unpadded), to name the misread.
 *
 *   moe_fp8_wire_quantizes_as_expert_side  the sender-side quantization and the scales' move
 *                              of FP8 on the wire give the expert side's codes and scale words
 *   moe_gemm_fp8_block_scales  gate/up form (float32 out) and down form (BF16 out) over shapes
 *                              with k/128 of 1 to 4 and row counts 4 to 260, one algorithm
 *                              cache per shape as in a plan
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/gpu_util.h"
#include "kernels/api.h"
#include "moe_prefill.h"
#include "ref/epx_ref.h"

/* Scale layouts the GPU might have read; LAYOUT_OURS is the one src/moe_gemm.c promises. */
enum { LAYOUT_OURS, LAYOUT_X_ROW_MAJOR, LAYOUT_W_TRANSPOSED, LAYOUT_W_UNPADDED, NUM_LAYOUTS };
static const char *const kLayoutName[NUM_LAYOUTS] = {"as documented", "row scales [rows][k/128]",
                                                     "weight scales [k/128][n/128]",
                                                     "weight scales [n/128][k/128] unpadded"};

typedef struct {
  int n, k, rows, kb4;
  uint8_t *w, *x;   /* host codes [n, k], [rows, k] */
  float *ws, *xs;   /* host scales: [n/128][kb4] and [k/128][rows] */
  float *wsd, *xsd; /* the same on the device */
  uint8_t *wd, *xd; /* codes on the device */
  void *y;          /* device [rows, n] */
  float *want;      /* [NUM_LAYOUTS][rows, n] */
} gemm_case_t;

static uint64_t g_rng;

static float pow2_scale(void) { /* 2^-3 .. 2^3 */
  return ldexpf(1.f, epx_test_rand_int(&g_rng, 7) - 3);
}

/* The weight scale of block (nb, kb) and the row scale of (row r, kb) as layout l reads them
 * from the buffers laid out as documented. */
static float w_scale(const gemm_case_t *c, int layout, int nb, int kb) {
  const int KB = c->k / 128, NB = c->n / 128;
  size_t i = (size_t)nb * c->kb4 + kb;
  if (layout == LAYOUT_W_TRANSPOSED) i = (size_t)kb * NB + nb;
  if (layout == LAYOUT_W_UNPADDED) i = (size_t)nb * KB + kb;
  return c->ws[i];
}

static float x_scale(const gemm_case_t *c, int layout, int r, int kb) {
  const int KB = c->k / 128;
  return layout == LAYOUT_X_ROW_MAJOR ? c->xs[(size_t)r * KB + kb]
                                      : c->xs[(size_t)kb * c->rows + r];
}

static void compute_want(gemm_case_t *c) {
  const int KB = c->k / 128;
  for (int l = 0; l < NUM_LAYOUTS; l++)
    for (int r = 0; r < c->rows; r++)
      for (int j = 0; j < c->n; j++) {
        double sum = 0;
        for (int kb = 0; kb < KB; kb++) {
          double block = 0;
          for (int i = kb * 128; i < kb * 128 + 128; i++)
            block += (double)epx_ref_fp8_to_float(c->w[(size_t)j * c->k + i]) *
                     epx_ref_fp8_to_float(c->x[(size_t)r * c->k + i]);
          sum += block * w_scale(c, l, j / 128, kb) * x_scale(c, l, r, kb);
        }
        c->want[((size_t)l * c->rows + r) * c->n + j] = (float)sum;
      }
}

/* A code of the whole E4M3 range (|v| up to 448), or a small integer (-3 .. 3) in exact mode. */
static uint8_t draw_code(int exact) {
  if (exact) return epx_ref_fp8_from_float((float)(epx_test_rand_int(&g_rng, 7) - 3));
  const float u = (float)epx_test_rand_int(&g_rng, 1 << 20) / (float)(1 << 19) - 1.f;
  return epx_ref_fp8_from_float(u * 448.f);
}

static int case_make(gemm_case_t *c, int n, int k, int rows, int exact) {
  memset(c, 0, sizeof *c);
  c->n = n, c->k = k, c->rows = rows, c->kb4 = (k / 128 + 3) / 4 * 4;
  const size_t nw = (size_t)n * k, nx = (size_t)rows * k;
  const size_t nws = (size_t)(n / 128) * c->kb4, nxs = (size_t)(k / 128) * rows;
  c->w = malloc(nw), c->x = malloc(nx);
  c->ws = calloc(nws, sizeof(float)), c->xs = malloc(nxs * sizeof(float));
  c->want = malloc(sizeof(float) * NUM_LAYOUTS * rows * n);
  EXPECT(c->w && c->x && c->ws && c->xs && c->want);
  /* Codes -3 .. 3: a 128-deep block sums to at most 1152, exact at any accumulator width. */
  for (size_t i = 0; i < nw; i++) c->w[i] = draw_code(exact);
  for (size_t i = 0; i < nx; i++) c->x[i] = draw_code(exact);
  for (int nb = 0; nb < n / 128; nb++)
    for (int kb = 0; kb < k / 128; kb++) c->ws[(size_t)nb * c->kb4 + kb] = pow2_scale();
  for (size_t i = 0; i < nxs; i++) c->xs[i] = pow2_scale();
  compute_want(c);
  EXPECT_CUDA(cudaMalloc((void **)&c->wd, nw));
  EXPECT_CUDA(cudaMalloc((void **)&c->xd, nx));
  EXPECT_CUDA(cudaMalloc((void **)&c->wsd, nws * sizeof(float)));
  EXPECT_CUDA(cudaMalloc((void **)&c->xsd, nxs * sizeof(float)));
  EXPECT_CUDA(cudaMalloc(&c->y, (size_t)rows * n * sizeof(float)));
  EXPECT_CUDA(cudaMemcpy(c->wd, c->w, nw, cudaMemcpyHostToDevice));
  EXPECT_CUDA(cudaMemcpy(c->xd, c->x, nx, cudaMemcpyHostToDevice));
  EXPECT_CUDA(cudaMemcpy(c->wsd, c->ws, nws * sizeof(float), cudaMemcpyHostToDevice));
  EXPECT_CUDA(cudaMemcpy(c->xsd, c->xs, nxs * sizeof(float), cudaMemcpyHostToDevice));
  return TEST_PASS;
}

static void case_free(gemm_case_t *c) {
  free(c->w), free(c->x), free(c->ws), free(c->xs), free(c->want);
  cudaFree(c->wd), cudaFree(c->xd), cudaFree(c->wsd), cudaFree(c->xsd), cudaFree(c->y);
}

/* The layouts whose values equal got (within tol, relative), as a message. */
static void name_matches(const gemm_case_t *c, const float *got, double tol, char *msg,
                         size_t len) {
  size_t used = (size_t)snprintf(msg, len, "the GPU's values match:");
  int any = 0;
  for (int l = 1; l < NUM_LAYOUTS && used < len; l++) {
    const float *want = c->want + (size_t)l * c->rows * c->n;
    int same = 1;
    for (size_t i = 0; i < (size_t)c->rows * c->n && same; i++)
      same = fabs((double)got[i] - want[i]) <= tol * fabs((double)want[i]) + 1e-30;
    if (same) {
      used += (size_t)snprintf(msg + used, len - used, " [%s]", kLayoutName[l]);
      any = 1;
    }
  }
  if (!any) snprintf(msg + used, len - used, " none of the other layouts tried");
}

/* One GEMM of case c in form `which` (0: float32 out, 1: BF16 out), checked. */
static int run_gemm(epx_moe_prefill_t p, gemm_case_t *c, int which, void *blas_ws,
                    cudaStream_t stream) {
  const size_t cells = (size_t)c->rows * c->n;
  EXPECT_CUDA(cudaMemset(c->y, 0xff, cells * sizeof(float)));
  EXPECT_OK(epx__moe_gemm_fp8(p, which, c->wd, c->wsd, c->xd, c->xsd, c->y, c->n, c->k, c->rows, 0,
                              blas_ws, stream));
  EXPECT_CUDA(cudaStreamSynchronize(stream));
  float *got = malloc(cells * sizeof(float));
  uint16_t *raw = malloc(cells * 2 + 2);
  EXPECT(got && raw);
  if (which == 0) {
    EXPECT_CUDA(cudaMemcpy(got, c->y, cells * sizeof(float), cudaMemcpyDeviceToHost));
  } else {
    EXPECT_CUDA(cudaMemcpy(raw, c->y, cells * 2, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < cells; i++) got[i] = epx_ref_bf16_to_float(raw[i]);
  }
  /* float32 out: exact. BF16 out: the one rounding of an exact value (half an ulp, at most 2^-8).
   */
  const double tol = which == 0 ? 0 : ldexp(1.0, -8);
  int rc = TEST_PASS;
  for (size_t i = 0; i < cells; i++) {
    const double want = c->want[i];
    if (!(fabs((double)got[i] - want) <= tol * fabs(want))) { /* NaN: never written */
      char why[256];
      name_matches(c, got, tol, why, sizeof why);
      fprintf(stderr, "  n %d, k %d, rows %d, %s out: y[%zu][%zu] = %.9g, want %.9g exactly; %s\n",
              c->n, c->k, c->rows, which == 0 ? "float32" : "BF16", i / c->n, i % c->n, got[i],
              want, why);
      rc = TEST_FAIL;
      break;
    }
  }
  free(got), free(raw);
  return rc;
}

EPX_ONE_GPU_TEST(moe_gemm_fp8_block_scales, 300) {
  g_rng = 0x6a09e667f3bcc909ull;
  printf("  seed %llu\n", (unsigned long long)g_rng);
  struct epx_moe_prefill plan;
  memset(&plan, 0, sizeof plan);
  epx_moe_prefill_t p = &plan;
  p->experts.weight_dtype = EPX_DTYPE_FP8_E4M3;
  p->gu_fp32 = 1;
  p->H = 256, p->I = 128; /* the probe's shapes (epx__moe_lt_supported) */
  EXPECT_CUDA(cudaMalloc((void **)&p->ones, 4096 * sizeof(float)));
  const epx_status_t created = epx__moe_gemm_create(p);
  EXPECTF(created == EPX_OK, "cuBLAS(Lt) did not load: %s", epx_last_error());
  EXPECTF(epx__moe_lt_supported(p, 0) && epx__moe_lt_supported(p, 1),
          "cuBLASLt has no FP8 block-scaled kernel here: %s", epx_last_error());
  void *blas_ws = NULL;
  cudaStream_t stream;
  EXPECT_CUDA(cudaMalloc(&blas_ws, EPX__MOE_BLAS_WS));
  EXPECT_CUDA(cudaStreamCreate(&stream));
  /* (n, k) with k/128 of 1 to 4 (the weight scales' padding to 4 differs); per shape, row
   * counts in the order a layer's segments could come, each a multiple of 4 as the layer's
   * are, sharing the algorithm cache as one plan's calls do (a bucket's algorithm meets other
   * sizes of its bucket). */
  static const int shapes[][2] = {{256, 128}, {256, 256}, {512, 256}, {256, 384}, {384, 512}};
  static const int rows[] = {64, 36, 40, 4, 8, 128, 132, 260, 100};
  int rc = TEST_PASS;
  for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
    memset(p->algos, 0, sizeof p->algos);
    for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++) {
      gemm_case_t c;
      if (case_make(&c, shapes[s][0], shapes[s][1], rows[r], 1) != TEST_PASS) return TEST_FAIL;
      for (int which = 0; which < 2; which++)
        if (run_gemm(p, &c, which, blas_ws, stream) != TEST_PASS) rc = TEST_FAIL;
      case_free(&c);
    }
  }
  /* Codes over the whole E4M3 range: how far cuBLASLt's float32 result is from the exact one,
   * relative to the sum of the products' magnitudes (the scale an accumulator's rounding
   * works at). FP8 tensor cores accumulate a 128-deep block with fewer bits than float32;
   * the figure printed is what the prefill layer's tolerance (test_moe_prefill.c) allows for. */
  for (int k = 128; k <= 512; k *= 2) {
    memset(p->algos, 0, sizeof p->algos);
    gemm_case_t c;
    if (case_make(&c, 512, k, 64, 0) != TEST_PASS) return TEST_FAIL;
    const size_t cells = (size_t)c.rows * c.n;
    EXPECT_CUDA(cudaMemset(c.y, 0xff, cells * sizeof(float))); /* NaN where nothing is written */
    EXPECT_OK(epx__moe_gemm_fp8(p, 0, c.wd, c.wsd, c.xd, c.xsd, c.y, c.n, c.k, c.rows, 0, blas_ws,
                                stream));
    EXPECT_CUDA(cudaStreamSynchronize(stream));
    float *got = malloc(cells * sizeof(float));
    EXPECT(got);
    EXPECT_CUDA(cudaMemcpy(got, c.y, cells * sizeof(float), cudaMemcpyDeviceToHost));
    double worst = 0, worst_rel_out = 0;
    size_t bad = 0;
    for (int r = 0; r < c.rows; r++)
      for (int j = 0; j < c.n; j++) {
        double mag = 0;
        for (int i = 0; i < c.k; i++)
          mag += fabs((double)epx_ref_fp8_to_float(c.w[(size_t)j * c.k + i]) *
                      epx_ref_fp8_to_float(c.x[(size_t)r * c.k + i])) *
                 w_scale(&c, LAYOUT_OURS, j / 128, i / 128) * x_scale(&c, LAYOUT_OURS, r, i / 128);
        const double want = c.want[(size_t)r * c.n + j];
        const double err = fabs((double)got[(size_t)r * c.n + j] - want);
        if (mag == 0) { /* every product 0: the output must be too */
          if (!(err == 0)) bad++;
          continue;
        }
        /* A misread scale is off by a factor of 2 or more (powers of two): 2^-6 only guards
         * that; NaN (not written) fails too. */
        if (!(err <= mag / 64)) bad++;
        if (err / mag > worst) worst = err / mag;
        if (err / (fabs(want) + 1e-30) > worst_rel_out && fabs(want) > 0.1 * mag)
          worst_rel_out = err / fabs(want);
      }
    printf(
        "  whole-range codes, n 512, k %d, rows 64: worst |err| / sum |products| = %.3g, "
        "worst relative error of outputs above a tenth of that sum = %.3g\n",
        k, worst, worst_rel_out);
    EXPECTF(bad == 0,
            "k %d: %zu outputs off by more than 2^-6 of their products' sum or not written", k,
            bad);
    free(got);
    case_free(&c);
  }
  epx__moe_gemm_destroy(p);
  cudaFree(p->ones), cudaFree(blas_ws);
  EXPECT_CUDA(cudaStreamDestroy(stream));
  return rc;
}

/* FP8 on the wire (src/moe_prefill.c, dispatch_dtype): the sender's quantization of its tokens
 * plus the expert side's scale move give exactly what the expert side's own quantization of the
 * same BF16 rows gave: the codes of every real row byte for byte, and every scale word of the
 * per-segment layout (padding rows' 1 included). Segments of 8, 12 and 8 rows with 5, 12 and 0
 * real rows; H 384 (a 512-channel block half used). */
EPX_ONE_GPU_TEST(moe_fp8_wire_quantizes_as_expert_side, 120) {
  enum { L = 3, ROWS = 28, H = 384, G = H / 128 };
  static const int begin[L + 1] = {0, 8, 20, 28}, count[L] = {5, 12, 0};
  uint64_t rng = 0xbb67ae8584caa73bull;
  uint16_t *x = malloc(sizeof(uint16_t) * ROWS * H);
  EXPECT(x != NULL);
  for (int i = 0; i < ROWS * H; i++) {
    const float u = (float)epx_test_rand_int(&rng, 1 << 20) / (float)(1 << 19) - 1.f;
    x[i] = epx_ref_bf16_from_float(u * (1 + i % 7) * 3.f);
  }
  void *xd, *codes_a, *codes_b;
  float *scales_a, *scales_b, *scales_c;
  int *begin_d, *count_d;
  EXPECT_CUDA(cudaMalloc(&xd, sizeof(uint16_t) * ROWS * H));
  EXPECT_CUDA(cudaMalloc(&codes_a, ROWS * H));
  EXPECT_CUDA(cudaMalloc(&codes_b, ROWS * H));
  EXPECT_CUDA(cudaMalloc((void **)&scales_a, sizeof(float) * ROWS * G));
  EXPECT_CUDA(cudaMalloc((void **)&scales_b, sizeof(float) * ROWS * G));
  EXPECT_CUDA(cudaMalloc((void **)&scales_c, sizeof(float) * ROWS * G));
  EXPECT_CUDA(cudaMalloc((void **)&begin_d, sizeof begin));
  EXPECT_CUDA(cudaMalloc((void **)&count_d, sizeof count));
  EXPECT_CUDA(cudaMemcpy(xd, x, sizeof(uint16_t) * ROWS * H, cudaMemcpyHostToDevice));
  EXPECT_CUDA(cudaMemcpy(begin_d, begin, sizeof begin, cudaMemcpyHostToDevice));
  EXPECT_CUDA(cudaMemcpy(count_d, count, sizeof count, cudaMemcpyHostToDevice));
  EXPECT_CUDA(cudaMemset(scales_c, 0xff, sizeof(float) * ROWS * G)); /* NaN: every word written */

  /* A: the expert side's quantization of the received BF16 rows (epx__moe_ffn before). */
  epx__moe_rows_launch_args_t ra;
  memset(&ra, 0, sizeof ra);
  ra.in = xd, ra.quantize = 1, ra.out = codes_a, ra.scales = scales_a, ra.cols = H;
  ra.num_rows = ROWS, ra.num_experts = L, ra.begin = begin_d, ra.count = count_d;
  ra.num_blocks = 4;
  EXPECT_OK(epx__moe_rows_launch(&ra, 0));
  /* B: the sender's quantization of the same rows as tokens, then the scales' move. */
  const epx__moe_quantize_tokens_launch_args_t qa = {xd, codes_b, scales_b, ROWS, H, 3};
  EXPECT_OK(epx__moe_quantize_tokens_launch(&qa, 0));
  const epx__moe_segment_scales_launch_args_t sa = {scales_b, scales_c, ROWS,    G,
                                                    L,        begin_d,  count_d, 2};
  EXPECT_OK(epx__moe_segment_scales_launch(&sa, 0));
  EXPECT_CUDA(cudaDeviceSynchronize());

  uint8_t *ca = malloc(ROWS * H), *cb = malloc(ROWS * H);
  float *sa_h = malloc(sizeof(float) * ROWS * G), *sc_h = malloc(sizeof(float) * ROWS * G);
  EXPECT(ca && cb && sa_h && sc_h);
  EXPECT_CUDA(cudaMemcpy(ca, codes_a, ROWS * H, cudaMemcpyDeviceToHost));
  EXPECT_CUDA(cudaMemcpy(cb, codes_b, ROWS * H, cudaMemcpyDeviceToHost));
  EXPECT_CUDA(cudaMemcpy(sa_h, scales_a, sizeof(float) * ROWS * G, cudaMemcpyDeviceToHost));
  EXPECT_CUDA(cudaMemcpy(sc_h, scales_c, sizeof(float) * ROWS * G, cudaMemcpyDeviceToHost));
  for (int j = 0; j < L; j++)
    for (int r = begin[j]; r < begin[j] + count[j]; r++)
      EXPECTF(memcmp(ca + (size_t)r * H, cb + (size_t)r * H, H) == 0,
              "row %d (expert %d): the sender's codes differ from the expert side's", r, j);
  for (int i = 0; i < ROWS * G; i++)
    EXPECTF(memcmp(&sa_h[i], &sc_h[i], sizeof(float)) == 0,
            "scale word %d: %.9g after the move, %.9g from the expert side", i, sc_h[i], sa_h[i]);
  free(x), free(ca), free(cb), free(sa_h), free(sc_h);
  cudaFree(xd), cudaFree(codes_a), cudaFree(codes_b), cudaFree(scales_a), cudaFree(scales_b);
  cudaFree(scales_c), cudaFree(begin_d), cudaFree(count_d);
  return TEST_PASS;
}

/* The received scales' move into the per-segment layout (epx__moe_segment_scales_launch, 32 rows
 * at a time through shared memory) against the layout's definition (api.h): row r of segment j,
 * group g at begin[j] * G + g * S_j + (r - begin[j]), the row's scale where r - begin[j] <
 * count[j], else 1. Random segments (empty ones, ones that straddle the 32-row tiles, counts
 * past the segment, 0 and negative), G from 1 to 130 (one pass of 64 groups, two, three), grids
 * of 1 and 64 blocks; every word must be written (NaN before). */
EPX_ONE_GPU_TEST(moe_segment_scales_match_the_layout, 60) {
  enum { L = 9, MAX_ROWS = 9 * 60, MAX_G = 130 };
  static const int groups[] = {1, 3, 16, 56, 64, 73, 130};
  uint64_t rng = epx_test_seed() ^ 0x3c6ef372fe94f82bull;
  float *in_d, *out_d;
  int *begin_d, *count_d;
  EXPECT_CUDA(cudaMalloc((void **)&in_d, sizeof(float) * MAX_ROWS * MAX_G));
  EXPECT_CUDA(cudaMalloc((void **)&out_d, sizeof(float) * MAX_ROWS * MAX_G));
  EXPECT_CUDA(cudaMalloc((void **)&begin_d, sizeof(int) * (L + 1)));
  EXPECT_CUDA(cudaMalloc((void **)&count_d, sizeof(int) * L));
  float *in = malloc(sizeof(float) * MAX_ROWS * MAX_G),
        *got = malloc(sizeof(float) * MAX_ROWS * MAX_G);
  float *want = malloc(sizeof(float) * MAX_ROWS * MAX_G);
  EXPECT(in && got && want);
  for (size_t gi = 0; gi < sizeof groups / sizeof groups[0]; gi++)
    for (int grid = 1; grid <= 64; grid *= 64) {
      const int G = groups[gi];
      int begin[L + 1], count[L];
      begin[0] = 0;
      for (int j = 0; j < L;
           j++) { /* segments of 0 to 60 rows, a multiple of 4 as the dispatch's */
        const int rows = 4 * epx_test_rand_int(&rng, 16);
        begin[j + 1] = begin[j] + rows;
        const int pick = epx_test_rand_int(&rng, 5);
        count[j] = pick == 0   ? 0
                   : pick == 1 ? -3
                   : pick == 2 ? rows + 5
                               : epx_test_rand_int(&rng, rows + 1);
      }
      const int R = begin[L];
      for (int i = 0; i < R * G; i++) in[i] = (float)(i + 1) * 0.5f;
      for (int j = 0; j < L; j++)
        for (int r = begin[j]; r < begin[j + 1]; r++)
          for (int g = 0; g < G; g++)
            want[(size_t)begin[j] * G + (size_t)g * (begin[j + 1] - begin[j]) + (r - begin[j])] =
                r - begin[j] < count[j] ? in[(size_t)r * G + g] : 1.f;
      EXPECT_CUDA(cudaMemcpy(in_d, in, sizeof(float) * R * G, cudaMemcpyHostToDevice));
      EXPECT_CUDA(cudaMemcpy(begin_d, begin, sizeof begin, cudaMemcpyHostToDevice));
      EXPECT_CUDA(cudaMemcpy(count_d, count, sizeof count, cudaMemcpyHostToDevice));
      EXPECT_CUDA(cudaMemset(out_d, 0xff, sizeof(float) * MAX_ROWS * MAX_G));
      const epx__moe_segment_scales_launch_args_t sa = {in_d, out_d,   R,       G,
                                                        L,    begin_d, count_d, grid};
      EXPECT_OK(epx__moe_segment_scales_launch(&sa, 0));
      EXPECT_CUDA(cudaDeviceSynchronize());
      EXPECT_CUDA(cudaMemcpy(got, out_d, sizeof(float) * R * G, cudaMemcpyDeviceToHost));
      int bad = 0;
      for (int i = 0; i < R * G; i++)
        if (memcmp(&got[i], &want[i], sizeof(float)) != 0 && bad++ < 3)
          printf("  G %d, grid %d, %d rows: word %d is %g, want %g\n", G, grid, R, i, got[i],
                 want[i]);
      EXPECTF(bad == 0, "G %d, grid %d: %d of %d scale words wrong or not written", G, grid, bad,
              R * G);
    }
  free(in), free(got), free(want);
  cudaFree(in_d), cudaFree(out_d), cudaFree(begin_d), cudaFree(count_d);
  return TEST_PASS;
}

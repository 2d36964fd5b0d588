/*
 * test_moe_gemm_grouped.c - the prefill layer's grouped FP8 GEMM (src/kernels/moe_gemm_fp8.cu,
 * epx__moe_gemm_fp8_launch): every expert's segment in one launch, bounds read on the device.
 *
 *   moe_gemm_fp8_grouped_exact   codes -3..3 and power-of-two scales, so every product and sum
 *                                is exact in float32: the float32 output must equal the CPU's
 *                                bit for bit (BF16: its one rounding). Segments of 0 to 260
 *                                rows at every tile width (64, 96, 128 and 160; tiles of 4 to
 *                                160 rows, the x box past them) and, where n is a multiple of
 *                                256, the tall tile (64, 96 or 128 x 256 weight rows: two
 *                                weight blocks, each with its own scales; two tall tiles an
 *                                expert at n 512),
 *                                k/128 of 1 to 8, few CTAs (each walks many tiles, the copy
 *                                pipeline running across them) and one per SM; rows outside
 *                                every segment must stay untouched.
 *   moe_gemm_fp8_grouped_range   codes over the whole E4M3 range, one depth per tile shape
 *                                (k 128 to 1024, every width and height): every output within
 *                                2^-6 of its products' magnitude
 *                                (a misread scale is off by 2x or more); prints the worst
 *                                error, the figure the layer's tolerance (test_moe_prefill.c)
 *                                allows for.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/gpu_util.h"
#include "kernels/api.h"
#include "moe_tiles.h"
#include "ref/epx_ref.h"

enum { MAX_SEG = 16 };

typedef struct {
  int n, k, L, kb4, rows; /* rows: the segments' total plus a guard band after them */
  int begin[MAX_SEG + 1];
  uint8_t *w, *x; /* host codes [L][n][k], [rows][k] */
  float *ws, *xs; /* host scales [L][n/128][kb4], per-segment [rows * k/128] */
  uint8_t *wd, *xd;
  float *wsd, *xsd;
  int *begin_d;
  void *y; /* device [rows, n] float32 (room for either output) */
} grouped_case_t;

static uint64_t g_rng;

static uint8_t draw_code(int exact) {
  if (exact) return epx_ref_fp8_from_float((float)(epx_test_rand_int(&g_rng, 7) - 3));
  const float u = (float)epx_test_rand_int(&g_rng, 1 << 20) / (float)(1 << 19) - 1.f;
  return epx_ref_fp8_from_float(u * 448.f);
}

static float pow2_scale(void) {
  return ldexpf(1.f, epx_test_rand_int(&g_rng, 7) - 3);
}

/* The scale of row r (in segment j) for k-block b, in the per-segment layout. */
static float row_scale(const grouped_case_t *c, int j, int r, int b) {
  const int S = c->begin[j + 1] - c->begin[j];
  return c->xs[(size_t)c->begin[j] * (c->k / 128) + (size_t)b * S + (r - c->begin[j])];
}

/* Output (row r of segment j, column col): exact sum of block sums x scales, and the sum of
 * the products' magnitudes. */
static double want_at(const grouped_case_t *c, int j, int r, int col, double *mag) {
  double sum = 0, m = 0;
  const uint8_t *wr = c->w + ((size_t)j * c->n + col) * c->k, *xr = c->x + (size_t)r * c->k;
  for (int b = 0; b < c->k / 128; b++) {
    double block = 0, mb = 0;
    for (int i = b * 128; i < b * 128 + 128; i++) {
      const double p = (double)epx_ref_fp8_to_float(wr[i]) * epx_ref_fp8_to_float(xr[i]);
      block += p, mb += fabs(p);
    }
    const double s =
        (double)c->ws[((size_t)j * (c->n / 128) + col / 128) * c->kb4 + b] * row_scale(c, j, r, b);
    sum += block * s, m += mb * s;
  }
  if (mag) *mag = m;
  return sum;
}

static int case_make(grouped_case_t *c, int n, int k, const int *seg, int L, int exact) {
  memset(c, 0, sizeof *c);
  c->n = n, c->k = k, c->L = L, c->kb4 = (k / 128 + 3) / 4 * 4;
  for (int j = 0; j < L; j++) c->begin[j + 1] = c->begin[j] + seg[j];
  c->rows = c->begin[L] + 8; /* guard rows nobody's segment holds */
  const size_t nw = (size_t)L * n * k, nx = (size_t)c->rows * k;
  /* the row scales exactly as large as the segments need (a read past them faults under
   * compute-sanitizer); the guard rows have codes but no scales */
  const size_t nws = (size_t)L * (n / 128) * c->kb4, nxs = (size_t)c->begin[L] * (k / 128);
  c->w = malloc(nw), c->x = malloc(nx);
  c->ws = calloc(nws, sizeof(float)), c->xs = malloc(nxs * sizeof(float));
  EXPECT(c->w && c->x && c->ws && c->xs);
  for (size_t i = 0; i < nw; i++) c->w[i] = draw_code(exact);
  for (size_t i = 0; i < nx; i++) c->x[i] = draw_code(exact);
  for (int j = 0; j < L; j++)
    for (int nb = 0; nb < n / 128; nb++)
      for (int b = 0; b < k / 128; b++)
        c->ws[((size_t)j * (n / 128) + nb) * c->kb4 + b] = pow2_scale();
  for (size_t i = 0; i < nxs; i++) c->xs[i] = pow2_scale();
  EXPECT_CUDA(cudaMalloc((void **)&c->wd, nw));
  EXPECT_CUDA(cudaMalloc((void **)&c->xd, nx));
  EXPECT_CUDA(cudaMalloc((void **)&c->wsd, nws * sizeof(float)));
  EXPECT_CUDA(cudaMalloc((void **)&c->xsd, nxs * sizeof(float)));
  EXPECT_CUDA(cudaMalloc((void **)&c->begin_d, sizeof(int) * (L + 1)));
  EXPECT_CUDA(cudaMalloc(&c->y, (size_t)c->rows * n * sizeof(float)));
  EXPECT_CUDA(cudaMemcpy(c->wd, c->w, nw, cudaMemcpyHostToDevice));
  EXPECT_CUDA(cudaMemcpy(c->xd, c->x, nx, cudaMemcpyHostToDevice));
  EXPECT_CUDA(cudaMemcpy(c->wsd, c->ws, nws * sizeof(float), cudaMemcpyHostToDevice));
  EXPECT_CUDA(cudaMemcpy(c->xsd, c->xs, nxs * sizeof(float), cudaMemcpyHostToDevice));
  EXPECT_CUDA(cudaMemcpy(c->begin_d, c->begin, sizeof(int) * (L + 1), cudaMemcpyHostToDevice));
  return TEST_PASS;
}

static void case_free(grouped_case_t *c) {
  free(c->w), free(c->x), free(c->ws), free(c->xs);
  cudaFree(c->wd), cudaFree(c->xd), cudaFree(c->wsd), cudaFree(c->xsd), cudaFree(c->begin_d);
  cudaFree(c->y);
}

/* The launch on case c; y filled with 0xff first (NaN in both output types). Returns the
 * output as floats [rows, n] (malloc'd) or NULL. */
static float *run(grouped_case_t *c, int y_fp32, int num_ctas, int tile_x, int tile_w) {
  const size_t cells = (size_t)c->rows * c->n;
  if (cudaMemset(c->y, 0xff, cells * sizeof(float)) != cudaSuccess) return NULL;
  const epx__moe_gemm_fp8_args_t a = {.w = c->wd,
                                      .w_stride = (size_t)c->n * c->k,
                                      .w_scales = c->wsd,
                                      .ws_stride = (size_t)(c->n / 128) * c->kb4,
                                      .ws_kb = c->kb4,
                                      .x = c->xd,
                                      .x_scales = c->xsd,
                                      .y = c->y,
                                      .y_fp32 = y_fp32,
                                      .n = c->n,
                                      .k = c->k,
                                      .num_experts = c->L,
                                      .begin = c->begin_d,
                                      .x_rows = c->begin[c->L],
                                      .num_ctas = num_ctas,
                                      .tile_x = tile_x,
                                      .tile_w = tile_w,
                                      .early_launch = 0};
  if (epx__moe_gemm_fp8_launch(&a, 0) != EPX_OK) {
    fprintf(stderr, "  launch: %s\n", epx_last_error());
    return NULL;
  }
  if (cudaDeviceSynchronize() != cudaSuccess) return NULL;
  float *got = malloc(cells * sizeof(float));
  uint16_t *raw = malloc(cells * 2);
  if (!got || !raw) {
    free(got), free(raw);
    return NULL;
  }
  if (y_fp32) {
    if (cudaMemcpy(got, c->y, cells * sizeof(float), cudaMemcpyDeviceToHost) != cudaSuccess)
      got[0] = NAN; /* reported as a mismatch */
  } else {
    if (cudaMemcpy(raw, c->y, cells * 2, cudaMemcpyDeviceToHost) != cudaSuccess) raw[0] = 0x7fc0;
    for (size_t i = 0; i < cells; i++) got[i] = epx_ref_bf16_to_float(raw[i]);
  }
  free(raw);
  return got;
}

/* Expert j of the row r (within the segments), or -1. */
static int expert_of(const grouped_case_t *c, int r) {
  for (int j = 0; j < c->L; j++)
    if (r >= c->begin[j] && r < c->begin[j + 1]) return j;
  return -1;
}

EPX_ONE_GPU_TEST(moe_gemm_fp8_grouped_exact, 300) {
  g_rng = 0x3c6ef372fe94f82bull;
  printf("  seed %llu\n", (unsigned long long)g_rng);
  int sms = 0;
  EXPECT_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  /* n 512: two tall tiles an expert (the second at weight row 256: its TMA row and the scales of
   * weight blocks 2 and 3) */
  static const int shapes[][2] = {{256, 128}, {384, 384}, {256, 1024}, {128, 512}, {512, 256}};
  /* 0 to 260 rows: token tiles of 4 .. 160 rows at every width (each read as a box of the
   * width: the rows past a tile are the next segment's or past the end, computed and never
   * stored); 132 and 164 rows are two tiles at 128 and one and two at 160, three at 64; 260
   * five at 64 and three at 96 */
  static const int seg[] = {0, 4, 36, 132, 260, 8, 128, 100, 0, 12, 164, 68, 160};
  const int L = (int)(sizeof seg / sizeof seg[0]);
  /* tile shapes (rows of x, weight rows): every width, and the tall tile where n allows it */
  static const int tiles[][2] = {{EPX__MOE_TILE_X, EPX__MOE_TILE_W},
                                 {EPX__MOE_TILE_X_WIDE, EPX__MOE_TILE_W},
                                 {EPX__MOE_TILE_X, EPX__MOE_TILE_W_TALL},
                                 {64, EPX__MOE_TILE_W},
                                 {64, EPX__MOE_TILE_W_TALL},
                                 {96, EPX__MOE_TILE_W},
                                 {96, EPX__MOE_TILE_W_TALL}};
  const int num_runs = 4 * (int)(sizeof tiles / sizeof tiles[0]);
  const int ctas[] = {3, sms};
  int rc = TEST_PASS;
  for (size_t s = 0; s < sizeof shapes / sizeof shapes[0] && rc == TEST_PASS; s++) {
    grouped_case_t c;
    if (case_make(&c, shapes[s][0], shapes[s][1], seg, L, 1) != TEST_PASS) return TEST_FAIL;
    for (int run_i = 0; run_i < num_runs && rc == TEST_PASS; run_i++) {
      const int y_fp32 = run_i & 1, ci = (run_i >> 1) & 1;
      const int tile_x = tiles[run_i >> 2][0], tile_w = tiles[run_i >> 2][1];
      if (!epx__moe_tile_w_fits(tile_w, c.n, tile_x)) continue; /* n 384 and 128: not tall */
      float *got = run(&c, y_fp32, ctas[ci], tile_x, tile_w);
      EXPECTF(got != NULL, "n %d k %d: the launch or its copy failed", c.n, c.k);
      /* float32: exact; BF16: the one rounding of an exact value (2^-8 relative at most) */
      const double tol = y_fp32 ? 0 : ldexp(1.0, -8);
      for (int r = 0; r < c.rows && rc == TEST_PASS; r++) {
        const int j = expert_of(&c, r);
        for (int col = 0; col < c.n; col++) {
          const float v = got[(size_t)r * c.n + col];
          if (j < 0) { /* guard rows: never written, so still NaN */
            if (!isnan(v)) {
              fprintf(stderr,
                      "  n %d k %d ctas %d tile %d x %d: guard row %d col %d written (%g)\n", c.n,
                      c.k, ctas[ci], tile_x, tile_w, r, col, v);
              rc = TEST_FAIL;
              break;
            }
            continue;
          }
          const double want = want_at(&c, j, r, col, NULL);
          if (!(fabs((double)v - want) <= tol * fabs(want))) {
            fprintf(stderr,
                    "  n %d k %d %s ctas %d tile %d x %d: expert %d (rows %d..%d) row %d col %d "
                    "= %.9g, want %.9g exactly\n",
                    c.n, c.k, y_fp32 ? "float32" : "BF16", ctas[ci], tile_x, tile_w, j, c.begin[j],
                    c.begin[j + 1], r, col, v, want);
            rc = TEST_FAIL;
            break;
          }
        }
      }
      free(got);
    }
    case_free(&c);
  }
  return rc;
}

EPX_ONE_GPU_TEST(moe_gemm_fp8_grouped_range, 300) {
  g_rng = 0xa54ff53a5f1d36f1ull;
  printf("  seed %llu\n", (unsigned long long)g_rng);
  static const int seg[] = {64, 132, 8};
  /* (k, width, weight rows): every width and height at a few depths */
  static const int runs[][3] = {{128, EPX__MOE_TILE_X, EPX__MOE_TILE_W},
                                {256, EPX__MOE_TILE_X_WIDE, EPX__MOE_TILE_W},
                                {512, EPX__MOE_TILE_X, EPX__MOE_TILE_W_TALL},
                                {1024, 96, EPX__MOE_TILE_W_TALL},
                                {384, 64, EPX__MOE_TILE_W_TALL},
                                {640, 64, EPX__MOE_TILE_W},
                                {768, 96, EPX__MOE_TILE_W}};
  for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
    const int k = runs[i][0], tile_x = runs[i][1], tile_w = runs[i][2];
    grouped_case_t c;
    if (case_make(&c, 512, k, seg, 3, 0) != TEST_PASS) return TEST_FAIL;
    float *got = run(&c, 1, 7, tile_x, tile_w);
    EXPECTF(got != NULL, "k %d: the launch or its copy failed", k);
    double worst = 0;
    size_t bad = 0;
    for (int r = 0; r < c.begin[c.L]; r++)
      for (int col = 0; col < c.n; col++) {
        double mag;
        const double want = want_at(&c, expert_of(&c, r), r, col, &mag);
        const double err = fabs((double)got[(size_t)r * c.n + col] - want);
        if (!(err <= mag / 64 + 1e-30)) bad++; /* NaN (not written) too */
        if (mag > 0 && err / mag > worst) worst = err / mag;
      }
    printf(
        "  whole-range codes, n 512, k %d, segments 64/132/8, tile %d x %d: worst |err| / sum "
        "|products| = %.3g\n",
        k, tile_x, tile_w, worst);
    free(got);
    case_free(&c);
    EXPECTF(bad == 0, "k %d: %zu outputs off by more than 2^-6 of their products' sum", k, bad);
  }
  return TEST_PASS;
}

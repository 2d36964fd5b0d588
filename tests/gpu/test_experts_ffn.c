/*
 * test_experts_ffn.c - epx_experts_ffn on one GPU against the CPU oracle
 * (tests/ref/epx_ref_experts.h), on fresh random data from the test's seed.
 *
 * Each case fills every row of out with a sentinel, runs the FFN, and checks that (1) every
 * row of every expert matches the oracle within |gpu - ref| <= 0.02 * rms(ref) + 0.02 |ref|
 * (the GPU sums in another order; a wrong row, operand or scale is off by about rms(ref) or
 * more); with FP8 weights 0.06 * rms + 0.03 |ref| plus twice the oracle's one-step allowance
 * (the most one FP8 step of the quantized intermediate h moves the value:
 * epx_ref_experts_ffn_one_step), and the rms of the errors at most 0.01 * rms (check_out says
 * why), and (2) no other row was written.
 * Routings: idle experts, one row, rows past a multiple of 8 and of 32 (several passes), counts
 * past the room (cut), negative counts, begins out of range, a contiguous layout with gaps and
 * experts out of order. Shapes: small, Qwen3-30B-A3B (H 2048, I 768) and a long K (H 7168). BF16
 * and FP8 weights; FP8 x given, and BF16 x with FP8 weights (quantized by the library). Also: a
 * CUDA graph replayed after the counts changed on the device, and the argument checks.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/runner.h"
#include "gpu/experts_data.h"
#include "epx.h"
#include "ref/epx_ref.h"
#include "ref/epx_ref_experts.h"

#define SENTINEL 0x7fc1u /* a BF16 NaN no computation produces */

typedef struct {
  const char *name;
  int E, H, I, fp8, x_fp8;
  int num_rows, rows_per_expert; /* masked layout when begin is NULL */
  const int *count, *begin;      /* host [E] */
} ffn_case_t;

/* Host and device copies of one case's weights and inputs. */
typedef struct {
  experts_data_t w;
  void *x;   /* host x: BF16, or FP8 codes */
  float *xs; /* host FP8 x scales */
  void *x_dev;
  float *xs_dev;
  uint16_t *out_dev;
  int *count_dev, *begin_dev;
  void *ws;
  size_t ws_bytes;
} ffn_data_t;

static int upload(void **dev, const void *host, size_t bytes) {
  EXPECT_CUDA(cudaMalloc(dev, bytes > 0 ? bytes : 16));
  if (bytes) EXPECT_CUDA(cudaMemcpy(*dev, host, bytes, cudaMemcpyHostToDevice));
  return TEST_PASS;
}

static void data_free(ffn_data_t *d) {
  experts_data_free(&d->w);
  free(d->x), free(d->xs);
  cudaFree(d->x_dev), cudaFree(d->xs_dev), cudaFree(d->out_dev);
  cudaFree(d->count_dev), cudaFree(d->begin_dev), cudaFree(d->ws);
  memset(d, 0, sizeof *d);
}

static int data_make(const ffn_case_t *c, uint64_t *s, ffn_data_t *d) {
  memset(d, 0, sizeof *d);
  const size_t E = c->E, H = c->H, rows = c->num_rows;
  EXPECT(experts_data_make(c->E, c->H, c->I, c->fp8, 1, s, &d->w) == TEST_PASS);
  uint16_t *x16 = malloc(rows * H * 2 + 2);
  EXPECT(x16);
  experts_fill_bf16(x16, rows * H, 2.f, s);
  if (c->x_fp8) {
    d->x = malloc(rows * H + 1), d->xs = malloc(rows * (H / 128) * 4 + 4);
    EXPECT(d->x && d->xs);
    EXPECT(epx_ref_fp8_quantize(x16, c->num_rows, c->H, 0, d->x, d->xs) == 0);
    free(x16);
    EXPECT(upload(&d->x_dev, d->x, rows * H) == TEST_PASS);
    EXPECT(upload((void **)&d->xs_dev, d->xs, rows * (H / 128) * 4) == TEST_PASS);
  } else {
    d->x = x16;
    EXPECT(upload(&d->x_dev, d->x, rows * H * 2) == TEST_PASS);
  }
  EXPECT_CUDA(cudaMalloc((void **)&d->out_dev, rows * H * 2 + 16));
  EXPECT(upload((void **)&d->count_dev, c->count, E * 4) == TEST_PASS);
  if (c->begin) EXPECT(upload((void **)&d->begin_dev, c->begin, E * 4) == TEST_PASS);
  EXPECT_OK(epx_experts_ffn_workspace_size(
      &d->w.dev, c->num_rows, c->x_fp8 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16, &d->ws_bytes));
  EXPECT_CUDA(cudaMalloc(&d->ws, d->ws_bytes + 256));
  return TEST_PASS;
}

static epx_experts_ffn_args_t args_of(const ffn_case_t *c, const ffn_data_t *d) {
  epx_experts_ffn_args_t a = EPX_EXPERTS_FFN_ARGS_INIT;
  a.x = d->x_dev;
  a.x_dtype = c->x_fp8 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16;
  a.x_scales = d->xs_dev;
  a.num_rows = c->num_rows;
  a.expert_count = d->count_dev;
  a.expert_begin = c->begin ? d->begin_dev : NULL;
  a.rows_per_expert = c->rows_per_expert;
  a.out = d->out_dev;
  a.workspace = d->ws;
  a.workspace_bytes = d->ws_bytes;
  return a;
}

static int fill_sentinel(const ffn_case_t *c, const ffn_data_t *d) {
  const size_t n = (size_t)c->num_rows * c->H;
  uint16_t *h = malloc(n * 2 + 2);
  EXPECT(h);
  for (size_t i = 0; i < n; i++) h[i] = SENTINEL;
  EXPECT_CUDA(cudaMemcpy(d->out_dev, h, n * 2, cudaMemcpyHostToDevice));
  free(h);
  return TEST_PASS;
}

/* out (device) against the oracle for these counts; rows outside the experts untouched. */
static int check_out(const ffn_case_t *c, const ffn_data_t *d, const int *count, const char *what) {
  const size_t n = (size_t)c->num_rows * c->H;
  uint16_t *got = malloc(n * 2 + 2), *want = malloc(n * 2 + 2);
  float *one_step = calloc(n + 1, sizeof(float));
  int *first = malloc(sizeof(int) * c->E), *rows = malloc(sizeof(int) * c->E);
  char *covered = calloc((size_t)c->num_rows + 1, 1);
  EXPECT(got && want && one_step && first && rows && covered);
  EXPECT_CUDA(cudaMemcpy(got, d->out_dev, n * 2, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < n; i++) want[i] = SENTINEL;
  epx_ref_experts_rows(c->E, c->num_rows, count, c->begin, c->rows_per_expert, first, rows);
  EXPECT(epx_ref_experts_ffn_one_step(&d->w.ref, d->x, c->x_fp8, d->xs, c->num_rows, first, rows,
                                      want, one_step) == 0);
  double sq = 0;
  long long covered_vals = 0;
  for (int e = 0; e < c->E; e++)
    for (int r = first[e]; r < first[e] + rows[e]; r++) {
      covered[r] = 1;
      for (int k = 0; k < c->H; k++) {
        const double v = epx_ref_bf16_to_float(want[(size_t)r * c->H + k]);
        sq += v * v;
        covered_vals++;
      }
    }
  const double rms = covered_vals ? sqrt(sq / (double)covered_vals) : 0;
  double worst = 0, worst_ratio = 0, err_sq = 0, worst_bound = 0;
  long long over = 0, near_step = 0;
  int worst_r = -1, worst_k = -1, rc = TEST_PASS;
  /* FP8 weights: h is quantized to FP8, and an h value that close to a rounding boundary (the
   * GPU's gate/up sums, on the tensor cores, keep fewer bits than float32 inside each 32-deep
   * step) rounds the other way: its row moves by w_down x one FP8 step (up to ~0.2 x rms with
   * these weights; 0.126 x rms seen on 26 values of one row, seed 1802971814290704). The
   * oracle says, per value, the most one such step can move it (one_step); the bound allows
   * two of them on top of 0.06 x rms + 0.03 |ref|, the tensor cores' own rounding. The rms of
   * the errors, at most 0.01 x rms, is what a wrong row, column or scale (errors of the order
   * of rms in every value it touches) breaks first. BF16: 0.02 x rms + 0.02 |ref|. */
  const double per_val = c->fp8 ? 0.03 : 0.02, per_rms = c->fp8 ? 0.06 : 0.02;
  for (int r = 0; r < c->num_rows && rc == TEST_PASS; r++)
    for (int k = 0; k < c->H; k++) {
      const size_t i = (size_t)r * c->H + k;
      if (!covered[r]) {
        if (got[i] != SENTINEL) {
          fprintf(stderr, "  %s %s: row %d (no expert's) written: col %d = 0x%04x\n", c->name, what,
                  r, k, got[i]);
          rc = TEST_FAIL;
          break;
        }
        continue;
      }
      const double g = epx_ref_bf16_to_float(got[i]), w = epx_ref_bf16_to_float(want[i]);
      const double tight = per_rms * rms + per_val * fabs(w);
      const double err = fabs(g - w), bound = tight + 2.0 * one_step[i];
      if (err > worst) worst = err;
      err_sq += err * err;
      if (!(err <= tight)) near_step++; /* inside the bound only by the one-step allowance */
      /* every value is checked, so a failure says how many and how far, not only the first */
      const double ratio = isnan(err) ? INFINITY : bound > 0 ? err / bound : err > 0 ? INFINITY : 0;
      if (!(ratio <= 1.0)) over++;
      if (!(ratio <= worst_ratio))
        worst_ratio = ratio, worst_r = r, worst_k = k, worst_bound = bound;
    }
  if (rc == TEST_PASS && over > 0) {
    const size_t i = (size_t)worst_r * c->H + worst_k;
    fprintf(stderr,
            "  %s %s: %lld value(s) over the bound; worst row %d col %d = %g, want %g "
            "(err / bound %.2f, bound %g of which one step %g, rms %g)\n",
            c->name, what, over, worst_r, worst_k, epx_ref_bf16_to_float(got[i]),
            epx_ref_bf16_to_float(want[i]), worst_ratio, worst_bound, one_step[i], rms);
    rc = TEST_FAIL;
  }
  const double err_rms = covered_vals ? sqrt(err_sq / (double)covered_vals) : 0;
  if (rc == TEST_PASS && !(err_rms <= 0.01 * rms)) {
    fprintf(stderr, "  %s %s: rms of the errors %.3g > 0.01 x rms of out %.3g\n", c->name, what,
            err_rms, rms);
    rc = TEST_FAIL;
  }
  if (rc == TEST_PASS)
    printf(
        "  %s %s: ok, max |err| %.3g (%.3f x rms), worst err / bound %.2f, %lld inside it by "
        "the one-step allowance, rms of errors %.3g (rms of out %.3g)\n",
        c->name, what, worst, rms > 0 ? worst / rms : 0, worst_ratio, near_step, err_rms, rms);
  free(got), free(want), free(one_step), free(first), free(rows), free(covered);
  return rc;
}

static int run_case(const ffn_case_t *c) {
  uint64_t s = epx_test_seed() ^ (uint64_t)(c->E * 131 + c->H * 7 + c->I + c->fp8 * 3 + c->x_fp8);
  ffn_data_t d;
  int rc = data_make(c, &s, &d);
  if (rc == TEST_PASS) rc = fill_sentinel(c, &d);
  if (rc == TEST_PASS) {
    epx_experts_ffn_args_t a = args_of(c, &d);
    epx_status_t st = epx_experts_ffn(&d.w.dev, &a, 0);
    if (st != EPX_OK) {
      fprintf(stderr, "  %s: epx_experts_ffn: %s\n", c->name, epx_last_error());
      rc = TEST_FAIL;
    } else if (cudaDeviceSynchronize() != cudaSuccess) {
      fprintf(stderr, "  %s: kernel failed: %s\n", c->name, cudaGetErrorString(cudaGetLastError()));
      rc = TEST_FAIL;
    }
  }
  if (rc == TEST_PASS) rc = check_out(c, &d, c->count, "");
  data_free(&d);
  return rc;
}

/* Counts of the masked-layout cases, with idle, 1, 8, 9 (past a multiple of 8), 33 and 70
 * rows (several passes), one past the room and one negative. The "many CTAs" cases have more
 * (expert, 256-row tile, pass) items than a GPU has SMs (40 experts, 4 tiles per projection, 0
 * to 2 passes: about 190 items), so a GEMM whose CTAs walk several items each (a persistent
 * kernel) is checked across items too. */
EPX_ONE_GPU_TEST(experts_ffn_masked_matches_reference, 300) {
  static const int count40[40] = {0,  1, 9,  33, 40, 8,  17, 32, 0, 25, 40, 3,  12, 39,
                                  31, 2, 40, 0,  16, 24, 33, 7,  8, 40, 1,  36, 0,  20,
                                  29, 5, 40, 11, 0,  38, 9,  14, 4, 27, 40, 30};
  static const int count6[6] = {0, 1, 9, 33, 70, 8};
  static const int count_cut[6] = {80, -3, 8, 1, 0, 72}; /* room 72: 80 is cut to 72 */
  static const int count3[3] = {8, 32, 5};
  const ffn_case_t cases[] = {
      {"bf16 small", 6, 256, 256, 0, 0, 6 * 72, 72, count6, NULL},
      {"bf16 cut", 6, 256, 128, 0, 0, 6 * 72, 72, count_cut, NULL},
      {"fp8 small (x bf16)", 6, 256, 256, 1, 0, 6 * 72, 72, count6, NULL},
      {"fp8 small (x fp8)", 6, 384, 128, 1, 1, 6 * 72 + 5, 72, count6, NULL},
      {"fp8 cut", 6, 256, 256, 1, 1, 6 * 72, 72, count_cut, NULL},
      {"bf16 qwen3", 3, 2048, 768, 0, 0, 3 * 40, 40, count3, NULL},
      {"fp8 qwen3", 3, 2048, 768, 1, 1, 3 * 40, 40, count3, NULL},
      {"bf16 long K", 3, 7168, 256, 0, 0, 3 * 32, 32, count3, NULL},
      {"fp8 long K", 3, 7168, 256, 1, 0, 3 * 32, 32, count3, NULL},
      {"bf16 many CTAs", 40, 1024, 512, 0, 0, 40 * 40, 40, count40, NULL},
      {"fp8 many CTAs (x fp8)", 40, 1024, 512, 1, 1, 40 * 40, 40, count40, NULL},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
    if (run_case(&cases[i]) != TEST_PASS) return TEST_FAIL;
  return TEST_PASS;
}

/* Contiguous layout: experts out of order with gaps between them, an expert whose begin is
 * num_rows (no rows), one with a begin outside the rows (none), one cut at the end. */
EPX_ONE_GPU_TEST(experts_ffn_contiguous_matches_reference, 300) {
  static const int begin[5] = {100, 3, 200, 60, -7};
  static const int count[5] = {40, 50, 20, 12, 5}; /* 200 + 20 > 210: cut to 10 */
  static const int begin2[4] = {0, 210, 150, 999};
  static const int count2[4] = {33, 4, 60, 8};
  const ffn_case_t cases[] = {
      {"bf16 contiguous", 5, 256, 256, 0, 0, 210, 0, count, begin},
      {"fp8 contiguous (x bf16)", 5, 256, 256, 1, 0, 210, 0, count, begin},
      {"fp8 contiguous (x fp8)", 4, 512, 384, 1, 1, 210, 0, count2, begin2},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
    if (run_case(&cases[i]) != TEST_PASS) return TEST_FAIL;
  return TEST_PASS;
}

/* Captured once, replayed after the counts changed on the device: the graph reads them. */
EPX_ONE_GPU_TEST(experts_ffn_graph_reads_counts_on_device, 120) {
  static const int count_a[4] = {3, 0, 17, 40};
  static const int count_b[4] = {40, 9, 0, 1};
  for (int fp8 = 0; fp8 <= 1; fp8++) {
    const ffn_case_t c = {
        fp8 ? "fp8 graph" : "bf16 graph", 4, 256, 256, fp8, 0, 4 * 40, 40, count_a, NULL};
    uint64_t s = epx_test_seed() + (uint64_t)fp8;
    ffn_data_t d;
    EXPECT(data_make(&c, &s, &d) == TEST_PASS);
    cudaStream_t st;
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    EXPECT_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    epx_experts_ffn_args_t a = args_of(&c, &d);
    EXPECT_CUDA(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    EXPECT_OK(epx_experts_ffn(&d.w.dev, &a, st));
    EXPECT_CUDA(cudaStreamEndCapture(st, &graph));
    EXPECT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    EXPECT(fill_sentinel(&c, &d) == TEST_PASS);
    EXPECT_CUDA(cudaGraphLaunch(exec, st));
    EXPECT_CUDA(cudaStreamSynchronize(st));
    EXPECT(check_out(&c, &d, count_a, "replay 1") == TEST_PASS);
    EXPECT_CUDA(cudaMemcpy(d.count_dev, count_b, sizeof count_b, cudaMemcpyHostToDevice));
    EXPECT(fill_sentinel(&c, &d) == TEST_PASS);
    EXPECT_CUDA(cudaGraphLaunch(exec, st));
    EXPECT_CUDA(cudaStreamSynchronize(st));
    EXPECT(check_out(&c, &d, count_b, "replay 2 (new counts)") == TEST_PASS);
    cudaGraphExecDestroy(exec), cudaGraphDestroy(graph), cudaStreamDestroy(st);
    data_free(&d);
  }
  return TEST_PASS;
}

/* Bad arguments are refused by name, nothing queued. */
EPX_ONE_GPU_TEST(experts_ffn_refuses_bad_arguments, 60) {
  static const int count[2] = {4, 4};
  const ffn_case_t c = {"args", 2, 256, 128, 0, 0, 16, 8, count, NULL};
  uint64_t s = epx_test_seed();
  ffn_data_t d;
  EXPECT(data_make(&c, &s, &d) == TEST_PASS);
  epx_experts_ffn_args_t a = args_of(&c, &d);
  epx_experts_t w = d.w.dev;
  size_t bytes;

  w.hidden = 200;
  EXPECT_STATUS(epx_experts_ffn(&w, &a, 0), EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "experts->hidden"));
  w = d.w.dev, w.size = 8;
  EXPECT_STATUS(epx_experts_ffn(&w, &a, 0), EPX_ERR_INVALID_ARGUMENT);
  w = d.w.dev, w.weight_dtype = EPX_DTYPE_INT32;
  EXPECT_STATUS(epx_experts_ffn(&w, &a, 0), EPX_ERR_INVALID_ARGUMENT);
  w = d.w.dev;
  a.x_dtype = EPX_DTYPE_FP8_E4M3;
  EXPECT_STATUS(epx_experts_ffn(&w, &a, 0), EPX_ERR_UNSUPPORTED);
  EXPECT_STATUS(epx_experts_ffn_workspace_size(&w, 16, EPX_DTYPE_FP8_E4M3, &bytes),
                EPX_ERR_UNSUPPORTED);
  a = args_of(&c, &d), a.rows_per_expert = 9; /* 2 * 9 > 16 rows */
  EXPECT_STATUS(epx_experts_ffn(&w, &a, 0), EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "rows_per_expert"));
  a = args_of(&c, &d), a.workspace_bytes = d.ws_bytes - 1;
  EXPECT_STATUS(epx_experts_ffn(&w, &a, 0), EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "workspace_bytes"));
  a = args_of(&c, &d), a.out = (char *)d.x_dev + 256; /* overlaps x */
  EXPECT_STATUS(epx_experts_ffn(&w, &a, 0), EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "overlaps"));
  a = args_of(&c, &d), a.x = d.x; /* host memory */
  EXPECT_STATUS(epx_experts_ffn(&w, &a, 0), EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "args->x"));
  a = args_of(&c, &d), a.expert_count = NULL;
  EXPECT_STATUS(epx_experts_ffn(&w, &a, 0), EPX_ERR_INVALID_ARGUMENT);
  a = args_of(&c, &d), a.size = 4;
  EXPECT_STATUS(epx_experts_ffn(&w, &a, 0), EPX_ERR_INVALID_ARGUMENT);
  a = args_of(&c, &d), a.num_rows = 0, a.rows_per_expert = 0; /* nothing to do */
  EXPECT_OK(epx_experts_ffn(&w, &a, 0));
  EXPECT_CUDA(cudaDeviceSynchronize());
  data_free(&d);
  return TEST_PASS;
}

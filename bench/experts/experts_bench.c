/*
 * experts_bench.c - epx_experts_bench: the experts' FFN (epx_experts_ffn) on one GPU at decode
 * sizes, against the GPU's measured HBM read rate, since reading the weights is its cost.
 *
 *   build/bin/epx_experts_bench [--ranks 2] [--tokens 1,32,128,512] [--iters 50]
 *                               [--shape deepseek|qwen3|all] [--dtype bf16|fp8|all] [--seed N]
 *                               [--x bf16|fp8]
 *
 * Per shape and dtype, the E/R experts one rank of an R-rank group holds; per token count T,
 * the rows they receive when each of R x T tokens picks top-k distinct experts of E uniformly
 * (the masked layout of epx_ll_dispatch: rows_per_expert = R x T). Each iteration is timed
 * with CUDA events around one call (the whole call: quantize when needed, two GEMMs).
 * Printed per row: median and p99 of the per-call times, the weight bytes of the experts that
 * got rows (what the call must read), that over the median in GB/s, and the fraction of the
 * HBM read rate ("hbm read": the median of reading a 4 GB buffer once with every SM).
 * Shapes: deepseek = DeepSeek-V3 experts (H 7168, I 2048, 256 experts, top-8);
 *         qwen3    = Qwen3-30B-A3B experts (H 2048, I 768, 128 experts, top-8).
 * Weights are random (BF16 of U(-1, 1) / sqrt(K); FP8 codes with block scales), x is BF16.
 * --x fp8: with FP8 weights, x as FP8 codes with per-128-channel scales, as an FP8 dispatch
 * delivers it (no quantize-x kernel in the call); those rows' dtype column reads "fp8x".
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "epx.h"
#include "experts/bench_kernels.h"

typedef struct {
  const char *name;
  int hidden, intermediate, experts, top_k;
} shape_t;

static const shape_t kShapes[] = {{"deepseek", 7168, 2048, 256, 8}, {"qwen3", 2048, 768, 128, 8}};

static uint64_t rng(uint64_t *s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* Rows each of this rank's `local` experts (the first ones) receive from R x T tokens. */
static void draw_counts(const shape_t *sh, int ranks, int tokens, int local, uint64_t *s,
                        int *count) {
  memset(count, 0, sizeof(int) * (size_t)local);
  for (long long t = 0; t < (long long)ranks * tokens; t++) {
    int chosen[64], n = 0;
    while (n < sh->top_k) {
      const int e = (int)(rng(s) % (uint64_t)sh->experts);
      int again = 0;
      for (int j = 0; j < n; j++) again |= chosen[j] == e;
      if (again) continue;
      chosen[n++] = e;
      if (e < local) count[e]++;
    }
  }
}

static int cmp_float(const void *a, const void *b) {
  const float x = *(const float *)a, y = *(const float *)b;
  return (x > y) - (x < y);
}

/* Median and p99 of n per-iteration times (sorted in place). */
static void stats(float *t, int n, float *median, float *p99) {
  qsort(t, (size_t)n, sizeof(float), cmp_float);
  *median = t[n / 2];
  *p99 = t[(int)((n - 1) * 0.99)];
}

/* Returns 0, 2 for bad flags, or -1 after a failed call (reported). */
static int run(int argc, char **argv) {
  int ranks = 2, iters = 50, tokens[16] = {1, 32, 128, 512}, num_tokens = 4;
  const char *shape_sel = "all", *dtype_sel = "all", *x_sel = "bf16";
  uint64_t seed = 1;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--ranks") && i + 1 < argc)
      ranks = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--tokens") && i + 1 < argc) {
      if (bench_parse_list("--tokens", argv[++i], 1, EPX_MAX_TOKENS_PER_RANK, 16, tokens,
                           &num_tokens))
        return 2;
    } else if (!strcmp(argv[i], "--iters") && i + 1 < argc)
      iters = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--shape") && i + 1 < argc)
      shape_sel = argv[++i];
    else if (!strcmp(argv[i], "--dtype") && i + 1 < argc)
      dtype_sel = argv[++i];
    else if (!strcmp(argv[i], "--x") && i + 1 < argc)
      x_sel = argv[++i];
    else if (!strcmp(argv[i], "--seed") && i + 1 < argc)
      seed = strtoull(argv[++i], NULL, 0);
    else {
      fprintf(stderr,
              "usage: %s [--ranks R] [--tokens 1,32,128,512] [--iters N] [--shape "
              "deepseek|qwen3|all] [--dtype bf16|fp8|all] [--seed N] [--x bf16|fp8]\n",
              argv[0]);
      return 2;
    }
  }
  if (strcmp(x_sel, "bf16") && strcmp(x_sel, "fp8")) {
    fprintf(stderr, "epx_experts_bench: --x must be bf16 or fp8\n");
    return 2;
  }
  const int x_fp8 = !strcmp(x_sel, "fp8");
  if (x_fp8 && !strcmp(dtype_sel, "bf16")) {
    fprintf(stderr, "epx_experts_bench: --x fp8 needs FP8 weights (--dtype fp8 or all)\n");
    return 2;
  }
  if (ranks < 1 || iters < 1 || num_tokens < 1) {
    fprintf(stderr, "epx_experts_bench: --ranks, --iters and --tokens must be positive\n");
    return 2;
  }
  int device_count = 0;
  if (cudaGetDeviceCount(&device_count) != cudaSuccess || device_count < 1) {
    printf("epx_experts_bench: no GPU visible; nothing measured\n");
    return 0;
  }
  BENCH_CUDA(cudaSetDevice(0));
  struct cudaDeviceProp prop;
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  printf("epx_experts_bench: %s, %d SMs; R = %d ranks, %d iterations, seed %llu\n", prop.name,
         prop.multiProcessorCount, ranks, iters, (unsigned long long)seed);

  cudaStream_t stream;
  cudaEvent_t ev0, ev1;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  BENCH_CUDA(cudaEventCreate(&ev0));
  BENCH_CUDA(cudaEventCreate(&ev1));
  float *times = malloc(sizeof(float) * (size_t)iters);
  int *sink;
  BENCH_CUDA(cudaMalloc((void **)&sink, sizeof(int)));

  /* The HBM read rate: one read of a 4 GB buffer (80 times L2) with every SM, median. */
  double hbm_gbs;
  {
    const size_t bytes = (size_t)4 << 30;
    void *buf;
    float med, p99;
    BENCH_CUDA(cudaMalloc(&buf, bytes));
    BENCH_CUDA(cudaMemset(buf, 1, bytes));
    for (int it = 0; it < 3; it++) BENCH_CUDA(bench_read(buf, bytes, sink, stream));
    for (int it = 0; it < iters; it++) {
      BENCH_CUDA(cudaEventRecord(ev0, stream));
      BENCH_CUDA(bench_read(buf, bytes, sink, stream));
      BENCH_CUDA(cudaEventRecord(ev1, stream));
      BENCH_CUDA(cudaEventSynchronize(ev1));
      BENCH_CUDA(cudaEventElapsedTime(&times[it], ev0, ev1));
    }
    stats(times, iters, &med, &p99);
    hbm_gbs = (double)bytes / (med * 1e-3) / 1e9;
    printf("hbm read       %8.1f MB  median %9.1f us  p99 %9.1f us  %7.0f GB/s\n", bytes / 1e6,
           med * 1e3, p99 * 1e3, hbm_gbs);
    BENCH_CUDA(cudaFree(buf));
  }

  for (size_t si = 0; si < sizeof kShapes / sizeof kShapes[0]; si++) {
    const shape_t *sh = &kShapes[si];
    if (strcmp(shape_sel, "all") && strcmp(shape_sel, sh->name)) continue;
    const int local = sh->experts / ranks;
    const size_t H = sh->hidden, I = sh->intermediate, E = local;
    for (int fp8 = 0; fp8 <= 1; fp8++) {
      if (strcmp(dtype_sel, "all") && strcmp(dtype_sel, fp8 ? "fp8" : "bf16")) continue;
      if (x_fp8 && !fp8) continue; /* FP8 x needs FP8 weights */
      const size_t elem = fp8 ? 1 : 2;
      const size_t gu_bytes = E * 2 * I * H * elem, dn_bytes = E * H * I * elem;
      epx_experts_t w = EPX_EXPERTS_INIT;
      w.num_experts = local, w.hidden = sh->hidden, w.intermediate = sh->intermediate;
      w.weight_dtype = fp8 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16;
      void *gu, *dn;
      float *gus = NULL, *dns = NULL;
      BENCH_CUDA(cudaMalloc(&gu, gu_bytes));
      BENCH_CUDA(cudaMalloc(&dn, dn_bytes));
      if (fp8) {
        const size_t n_gus = E * (2 * I / 128) * (H / 128), n_dns = E * (H / 128) * (I / 128);
        BENCH_CUDA(cudaMalloc((void **)&gus, n_gus * 4));
        BENCH_CUDA(cudaMalloc((void **)&dns, n_dns * 4));
        BENCH_CUDA(bench_fill_fp8(gu, gu_bytes, seed + 1));
        BENCH_CUDA(bench_fill_fp8(dn, dn_bytes, seed + 2));
        BENCH_CUDA(bench_fill_f32(gus, n_gus, 0.5f / 448.f / 85.f, 1.5f / 448.f / 85.f, seed + 3));
        BENCH_CUDA(bench_fill_f32(dns, n_dns, 0.5f / 448.f / 45.f, 1.5f / 448.f / 45.f, seed + 4));
      } else {
        BENCH_CUDA(bench_fill_bf16(gu, gu_bytes / 2, 1.f / 85.f, seed + 1));
        BENCH_CUDA(bench_fill_bf16(dn, dn_bytes / 2, 1.f / 45.f, seed + 2));
      }
      w.gate_up = gu, w.down = dn, w.gate_up_scales = gus, w.down_scales = dns;

      float med, p99;
      for (int ti = 0; ti < num_tokens; ti++) {
        const int T = tokens[ti], rpe = ranks * T;
        const int num_rows = local * rpe;
        int *count = malloc(sizeof(int) * E), *count_dev;
        uint64_t s = seed * 7919 + (uint64_t)T;
        draw_counts(sh, ranks, T, local, &s, count);
        long long rows = 0;
        int active = 0;
        for (int e = 0; e < local; e++) rows += count[e], active += count[e] > 0;
        BENCH_CUDA(cudaMalloc((void **)&count_dev, sizeof(int) * E));
        BENCH_CUDA(cudaMemcpy(count_dev, count, sizeof(int) * E, cudaMemcpyHostToDevice));
        void *x, *out, *ws;
        float *x_scales = NULL;
        size_t ws_bytes;
        const epx_dtype_t x_dtype = x_fp8 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16;
        BENCH_CUDA(cudaMalloc(&x, (size_t)num_rows * H * (x_fp8 ? 1 : 2)));
        BENCH_CUDA(cudaMalloc(&out, (size_t)num_rows * H * 2));
        if (x_fp8) { /* codes of U(-448, 448)-like spread, scales around 2 / 448 */
          const size_t n_scales = (size_t)num_rows * (H / 128);
          BENCH_CUDA(cudaMalloc((void **)&x_scales, n_scales * 4));
          BENCH_CUDA(bench_fill_fp8(x, (size_t)num_rows * H, seed + 5));
          BENCH_CUDA(bench_fill_f32(x_scales, n_scales, 1.f / 448.f, 3.f / 448.f, seed + 6));
        } else {
          BENCH_CUDA(bench_fill_bf16(x, (size_t)num_rows * H, 2.f, seed + 5));
        }
        BENCH_EPX(epx_experts_ffn_workspace_size(&w, num_rows, x_dtype, &ws_bytes));
        BENCH_CUDA(cudaMalloc(&ws, ws_bytes));
        epx_experts_ffn_args_t a = EPX_EXPERTS_FFN_ARGS_INIT;
        a.x = x, a.x_dtype = x_dtype, a.x_scales = x_scales;
        a.num_rows = num_rows, a.expert_count = count_dev, a.rows_per_expert = rpe;
        a.out = out, a.workspace = ws, a.workspace_bytes = ws_bytes;
        for (int it = 0; it < 3; it++) BENCH_EPX(epx_experts_ffn(&w, &a, stream));
        for (int it = 0; it < iters; it++) {
          BENCH_CUDA(cudaEventRecord(ev0, stream));
          BENCH_EPX(epx_experts_ffn(&w, &a, stream));
          BENCH_CUDA(cudaEventRecord(ev1, stream));
          BENCH_CUDA(cudaEventSynchronize(ev1));
          BENCH_CUDA(cudaEventElapsedTime(&times[it], ev0, ev1));
        }
        stats(times, iters, &med, &p99);
        const double per_expert = (double)(2 * I * H + H * I) * elem;
        const double bytes = per_expert * active;
        const double gbs = bytes / (med * 1e-3) / 1e9;
        printf(
            "experts ffn    %-8s %-4s  T %4d  E %3d  rows %6lld  active %3d  median %9.1f us  "
            "p99 %9.1f us  weights %8.1f MB  %7.0f GB/s  %.2f of hbm\n",
            sh->name, fp8 ? (x_fp8 ? "fp8x" : "fp8") : "bf16", T, local, rows, active, med * 1e3,
            p99 * 1e3, bytes / 1e6, gbs, gbs / hbm_gbs);
        fflush(stdout);
        BENCH_CUDA(cudaFree(x));
        BENCH_CUDA(cudaFree(x_scales)); /* NULL with BF16 x: a no-op */
        BENCH_CUDA(cudaFree(out));
        BENCH_CUDA(cudaFree(ws));
        BENCH_CUDA(cudaFree(count_dev));
        free(count);
      }
      BENCH_CUDA(cudaFree(gu));
      BENCH_CUDA(cudaFree(dn));
      if (fp8) {
        BENCH_CUDA(cudaFree(gus));
        BENCH_CUDA(cudaFree(dns));
      }
    }
  }
  free(times);
  return 0;
}

int main(int argc, char **argv) {
  bench_program = "epx_experts_bench";
  const int r = run(argc, argv);
  return r < 0 ? 1 : r;
}

/*
 * moe_gemm_bench.c - epx_moe_gemm_bench: the prefill layer's grouped FP8 GEMM
 * (epx__moe_gemm_fp8_launch, src/kernels/moe_gemm_fp8.cu) alone on one GPU, in time and in SM
 * cycles (docs/bench.md, "The grouped FP8 GEMM alone").
 *
 *   build/bin/epx_moe_gemm_bench [--shape all|deepseek|qwen3] [--ranks 2,4] [--tokens 4096]
 *                                [--chunks 1,2] [--tile 0] [--tile-w 0] [--gu-out fp32]
 *                                [--iters 20] [--seed 1] [--counts even|routed]
 *
 * Why cycles: under load the GPU's power management moves the SM clock (1.4-2.0 GHz on H200
 * within one process, measured), so two kernels timed one after the other can differ by 20%
 * with the same work per cycle. The kernel stamps CTA 0's clock64 and %globaltimer where its
 * work starts and ends (the launch's clock_probe); each launch's clock is their ratio, and
 * "kcyc" is its time times that clock.
 *
 * A point is one projection of one rank's chunk in the layer of epx_moe_prefill_bench: the
 * E / R experts a rank of R holds, each with S = tokens x R x top_k / (E x chunks) rows (what a
 * uniform routing gives it, rounded up to 4 as the layer pads segments), rows of x in one
 * expert-major array. --counts routed: instead, each expert's rows as epx_moe_prefill_bench's
 * routing gives them (its tokens / chunks first tokens of each of the R ranks, each to top-8
 * distinct experts of E uniformly, moe_route with that bench's seeds; rank 0's experts; each
 * segment rounded up to 4; --seed does not change them), so the tiles split the way they do there:
 * the S column is then the mean, and TFLOPS, f/c/SM and peak count the routed rows only (a tile's
 * padding and its columns past its rows are work the layer pays and that counts nothing).
 * Projections: gate/up (n 2I, k H; float32 out as the layer's grouped FP8 path writes it, BF16 with
 * --gu-out bf16) and down (n H, k I, BF16 out). --tile: a list of widths, 0 (the one the layer
 * picks for these segments, moe_tiles.h), 64, 96, 128 or 160; --tile-w: a list of tile heights, 0
 * (the layer's pick for n and the width), 128 or 256 weight rows (256 only at widths up to 128 and
 * n a multiple of 256: other points are skipped with a note). Random FP8 codes, scales 1/64; one
 * CTA per SM. One warm-up launch, then each launch timed with CUDA events; printed: the medians of
 * time, clock and cycles over --iters launches, and FLOPs per cycle per SM against 8192 (H100 and
 * H200's dense FP8 rate: 1979 TFLOPS at 1.83 GHz on 132 SMs).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "epx.h"
#include "experts/bench_kernels.h"
#include "kernels/api.h"
#include "moe/moe_common.h"
#include "moe_tiles.h"

enum { MAX_LIST = 8, MAX_ITERS = 1000 };
static const double kPeakFlopPerCycleSm = 8192.0;

typedef struct {
  const char *name;
  int hidden, intermediate, experts, top_k;
} shape_t;

static const shape_t kShapes[] = {{"deepseek", 7168, 2048, 256, 8}, {"qwen3", 2048, 768, 128, 8}};

typedef struct {
  int shapes[2], num_shapes;
  int ranks[MAX_LIST], num_ranks;
  int chunks[MAX_LIST], num_chunks;
  int tiles[MAX_LIST], num_tiles;
  int tile_ws[MAX_LIST], num_tile_ws;
  int tokens, iters;
  uint64_t seed;
  int gu_fp32; /* gate/up writes float32 (as the layer; --gu-out bf16: BF16) */
  int routed;  /* --counts routed: each expert's rows as a draw of the routing gives them */
} options_t;

/* One projection's operands on the device. */
typedef struct {
  int n, k, L, S, y_fp32; /* S: rows an expert (--counts routed: the mean, rounded) */
  long long rows, useful; /* the segments' rows (padded to 4 each) and the routed rows */
  void *w, *x, *y;
  float *ws, *xs;
  int *begin;
  int kb4;         /* the weight scales' blocks a row, k / 128 rounded up to 4 */
  int layer_width; /* the tile width the layer picks for these segments (moe_tiles.h) */
} operands_t;

static void operands_free(operands_t *o) {
  cudaFree(o->w), cudaFree(o->x), cudaFree(o->y), cudaFree(o->ws), cudaFree(o->xs);
  cudaFree(o->begin);
  memset(o, 0, sizeof *o);
}

/* counts[j] for j < L: the rows rank 0's expert j gets from the first T tokens of each of R
 * ranks, routed as epx_moe_prefill_bench routes them (moe_route, seed MOE_ROUTE_SEED + rank):
 * that bench's chunk of T tokens a rank. Returns 0, or -1 out of host memory. */
static int routed_counts(int T, int E, int R, int L, int *counts) {
  int64_t *ids = malloc(sizeof(int64_t) * (size_t)T * MOE_TOP_K);
  float *w = malloc(sizeof(float) * (size_t)T * MOE_TOP_K);
  const int ok = ids && w;
  for (int j = 0; j < L; j++) counts[j] = 0;
  for (int r = 0; r < R && ok; r++) {
    moe_route(ids, w, T, E, MOE_ROUTE_SEED + (uint64_t)r);
    for (size_t i = 0; i < (size_t)T * MOE_TOP_K; i++)
      if (ids[i] < L) counts[ids[i]]++;
  }
  free(ids), free(w);
  return ok ? 0 : -1;
}

/* The operands of one projection: L experts with counts[j] rows each (NULL: S each), every
 * segment rounded up to 4 rows. */
static int operands_make(operands_t *o, int n, int k, int L, int S, const int *counts, int y_fp32,
                         uint64_t seed) {
  memset(o, 0, sizeof *o);
  o->n = n, o->k = k, o->L = L, o->y_fp32 = y_fp32, o->kb4 = (k / 128 + 3) / 4 * 4;
  int *begin = malloc(sizeof(int) * (size_t)(L + 1));
  if (!begin) return -1;
  begin[0] = 0;
  for (int j = 0; j < L; j++) {
    const int c = counts ? counts[j] : S;
    begin[j + 1] = begin[j] + (c + 3) / 4 * 4;
    o->useful += c;
  }
  o->rows = begin[L];
  o->S = (int)((o->useful + L / 2) / L);
  const size_t rows = (size_t)o->rows, nw = (size_t)L * n * k, nx = rows * k;
  const size_t nws = (size_t)L * (n / 128) * o->kb4, nxs = rows * (k / 128);
  o->layer_width = epx__moe_pick_tile_x(begin, L);
  int rc = -1;
  do {
    if (cudaMalloc(&o->w, nw) != cudaSuccess || cudaMalloc(&o->x, nx) != cudaSuccess ||
        cudaMalloc(&o->y, rows * n * (y_fp32 ? 4 : 2)) != cudaSuccess ||
        cudaMalloc((void **)&o->ws, nws * sizeof(float)) != cudaSuccess ||
        cudaMalloc((void **)&o->xs, nxs * sizeof(float)) != cudaSuccess ||
        cudaMalloc((void **)&o->begin, sizeof(int) * (size_t)(L + 1)) != cudaSuccess) {
      fprintf(stderr, "%s: out of device memory for n %d k %d, %d experts of %d rows\n",
              bench_program, n, k, L, o->S);
      break;
    }
    cudaError_t e = bench_fill_fp8(o->w, nw, seed);
    if (e == cudaSuccess) e = bench_fill_fp8(o->x, nx, seed + 1);
    if (e == cudaSuccess) e = bench_fill_f32(o->ws, nws, 1.f / 64, 1.f / 64, seed);
    if (e == cudaSuccess) e = bench_fill_f32(o->xs, nxs, 1.f / 64, 1.f / 64, seed);
    if (e == cudaSuccess)
      e = cudaMemcpy(o->begin, begin, sizeof(int) * (size_t)(L + 1), cudaMemcpyHostToDevice);
    /* the fills ran on the legacy stream, the GEMM runs on a non-blocking one */
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
      fprintf(stderr, "%s: filling the operands failed: %s\n", bench_program,
              cudaGetErrorString(e));
      break;
    }
    rc = 0;
  } while (0);
  free(begin);
  if (rc) operands_free(o);
  return rc;
}

static int cmp_double(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof(double), cmp_double);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Times --iters launches of the GEMM on o at tile width tile_x and height tile_w (0: the
 * layer's); prints one row (a note where that tile does not fit). */
static int run_point(const options_t *opt, const char *label, const operands_t *o, int tile_x,
                     int tile_w, int sms, cudaStream_t stream, unsigned long long *probe_d) {
  const int width = tile_x ? tile_x : o->layer_width;
  if (!tile_w) tile_w = epx__moe_pick_tile_w(o->n, width);
  if (!epx__moe_tile_w_fits(tile_w, o->n, width)) {
    printf("# %s: no tile of %d x %d weight rows at n %d (skipped)\n", label, width, tile_w, o->n);
    return 0;
  }
  const epx__moe_gemm_fp8_args_t a = {.w = o->w,
                                      .w_stride = (size_t)o->n * o->k,
                                      .w_scales = o->ws,
                                      .ws_stride = (size_t)(o->n / 128) * o->kb4,
                                      .ws_kb = o->kb4,
                                      .x = o->x,
                                      .x_scales = o->xs,
                                      .y = o->y,
                                      .y_fp32 = o->y_fp32,
                                      .n = o->n,
                                      .k = o->k,
                                      .num_experts = o->L,
                                      .begin = o->begin,
                                      .x_rows = (int)o->rows,
                                      .num_ctas = sms,
                                      .tile_x = width,
                                      .tile_w = tile_w,
                                      .early_launch = 0,
                                      .clock_probe = probe_d};
  cudaEvent_t e0, e1;
  BENCH_CUDA(cudaEventCreate(&e0));
  BENCH_CUDA(cudaEventCreate(&e1));
  BENCH_EPX(epx__moe_gemm_fp8_launch(&a, stream)); /* warm-up */
  BENCH_CUDA(cudaStreamSynchronize(stream));
  double us[MAX_ITERS], ghz[MAX_ITERS], kcyc[MAX_ITERS];
  for (int i = 0; i < opt->iters; i++) {
    unsigned long long p[4];
    BENCH_CUDA(cudaMemsetAsync(probe_d, 0, sizeof p, stream)); /* no stale stamps */
    BENCH_CUDA(cudaEventRecord(e0, stream));
    BENCH_EPX(epx__moe_gemm_fp8_launch(&a, stream));
    BENCH_CUDA(cudaEventRecord(e1, stream));
    BENCH_CUDA(cudaEventSynchronize(e1));
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    BENCH_CUDA(cudaMemcpy(p, probe_d, sizeof p, cudaMemcpyDeviceToHost));
    if (p[3] <= p[1] || p[2] <= p[0]) {
      fprintf(stderr, "%s: %s: the kernel left no clock stamps\n", bench_program, label);
      return -1;
    }
    us[i] = ms * 1e3;
    ghz[i] = (double)(p[2] - p[0]) / (double)(p[3] - p[1]);
    kcyc[i] = us[i] * ghz[i];
  }
  cudaEventDestroy(e0), cudaEventDestroy(e1);
  const double flops = 2.0 * o->n * o->k * (double)o->useful;
  double min_us = us[0];
  for (int i = 1; i < opt->iters; i++) min_us = us[i] < min_us ? us[i] : min_us;
  const double med_us = median(us, opt->iters), med_ghz = median(ghz, opt->iters);
  const double med_kcyc = median(kcyc, opt->iters);
  const double per_cycle_sm = flops / (med_kcyc * 1e3 * sms);
  printf("%-17s %5d %5d %4d %4d %4d %4d %8.1f %8.1f %5.2f %8.0f %7.0f %6.0f %5.1f%%\n", label, o->n,
         o->k, o->L, o->S, width, tile_w, med_us, min_us, med_ghz, med_kcyc, flops / med_us * 1e-6,
         per_cycle_sm, 100.0 * per_cycle_sm / kPeakFlopPerCycleSm);
  return 0;
}

static int run(const options_t *opt) {
  int dev = 0, sms = 0, major = 0, minor = 0;
  BENCH_CUDA(cudaGetDevice(&dev));
  BENCH_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  BENCH_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  BENCH_CUDA(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  if (major != 9 || minor != 0 || !epx__moe_gemm_fp8_driver_ok()) {
    fprintf(stderr,
            "%s: the grouped FP8 GEMM needs compute capability 9.0 and the driver's "
            "tensor-map encoder (this GPU: %d.%d)\n",
            bench_program, major, minor);
    return -1;
  }
  cudaStream_t stream;
  unsigned long long *probe_d = NULL;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  BENCH_CUDA(cudaMalloc((void **)&probe_d, 4 * sizeof(unsigned long long)));
  printf(
      "# epx_moe_gemm_bench: %d SMs, %d tokens a rank, medians of %d launches, gate/up out %s, "
      "rows an expert %s\n",
      sms, opt->tokens, opt->iters, opt->gu_fp32 ? "float32" : "BF16",
      opt->routed ? "as a draw of the routing gives them (S: their mean)" : "even");
  printf("%-17s %5s %5s %4s %4s %4s %4s %8s %8s %5s %8s %7s %6s %6s\n", "point", "n", "k", "L", "S",
         "tile", "tw", "us", "min", "GHz", "kcyc", "TFLOPS", "f/c/SM", "peak");
  fflush(stdout); /* before any error line */
  int rc = 0;
  for (int i = 0; i < opt->num_shapes && !rc; i++) {
    const shape_t *sh = &kShapes[opt->shapes[i]];
    for (int r = 0; r < opt->num_ranks && !rc; r++)
      for (int c = 0; c < opt->num_chunks && !rc; c++) {
        const int R = opt->ranks[r], C = opt->chunks[c], L = sh->experts / R;
        /* rounded up to 4 rows: the kernel copies a segment's row scales 16 bytes at a time
         * (the layer pads its segments alike) */
        const long long share =
            (long long)opt->tokens * R * sh->top_k / ((long long)sh->experts * C);
        const long long rows = (share + 3) / 4 * 4;
        if (sh->experts % R != 0 || rows < 1 || rows > (1 << 20)) {
          fprintf(stderr, "%s: %s at %d ranks, %d chunks: %lld rows an expert; skipped\n",
                  bench_program, sh->name, R, C, rows);
          continue;
        }
        /* --counts routed: one draw for both projections, as the layer's chunk has */
        int *counts = opt->routed ? malloc(sizeof(int) * (size_t)L) : NULL;
        if (opt->routed && (!counts || routed_counts(opt->tokens / C, sh->experts, R, L, counts))) {
          fprintf(stderr, "%s: out of host memory\n", bench_program);
          free(counts);
          rc = -1;
          break;
        }
        for (int p = 0; p < 2 && !rc; p++) { /* gate/up, down */
          operands_t o;
          const int n = p == 0 ? 2 * sh->intermediate : sh->hidden;
          const int k = p == 0 ? sh->hidden : sh->intermediate;
          if (operands_make(&o, n, k, L, (int)rows, counts, p == 0 && opt->gu_fp32,
                            opt->seed + 7 * (uint64_t)p)) {
            rc = -1;
            break;
          }
          char label[64];
          snprintf(label, sizeof label, "%s %s R%d c%d", sh->name, p == 0 ? "gu" : "dn", R, C);
          for (int t = 0; t < opt->num_tiles && !rc; t++)
            for (int w = 0; w < opt->num_tile_ws && !rc; w++)
              rc = run_point(opt, label, &o, opt->tiles[t], opt->tile_ws[w], sms, stream, probe_d);
          operands_free(&o);
        }
        free(counts);
      }
  }
  cudaFree(probe_d);
  cudaStreamDestroy(stream);
  return rc;
}

int main(int argc, char **argv) {
  bench_program = "epx_moe_gemm_bench";
  options_t o = {{0, 1}, 2, {2, 4}, 2, {1, 2}, 2, {0}, 1, {0}, 1, 4096, 20, 1, 1, 0};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    int bad = !v;
    if (v && !strcmp(a, "--shape")) {
      if (!strcmp(v, "all"))
        o.num_shapes = 2, o.shapes[0] = 0, o.shapes[1] = 1;
      else if (!strcmp(v, "deepseek") || !strcmp(v, "qwen3"))
        o.num_shapes = 1, o.shapes[0] = !strcmp(v, "qwen3");
      else
        bad = 1;
    } else if (v && !strcmp(a, "--ranks")) {
      bad = bench_parse_list(a, v, 1, 256, MAX_LIST, o.ranks, &o.num_ranks) != 0;
    } else if (v && !strcmp(a, "--chunks")) {
      bad = bench_parse_list(a, v, 1, 64, MAX_LIST, o.chunks, &o.num_chunks) != 0;
    } else if (v && !strcmp(a, "--tile")) {
      bad = bench_parse_list(a, v, 0, EPX__MOE_TILE_X_WIDE, MAX_LIST, o.tiles, &o.num_tiles) != 0;
      for (int t = 0; t < o.num_tiles && !bad; t++)
        bad = o.tiles[t] != 0 && !epx__moe_tile_x_known(o.tiles[t]);
    } else if (v && !strcmp(a, "--tile-w")) {
      bad =
          bench_parse_list(a, v, 0, EPX__MOE_TILE_W_TALL, MAX_LIST, o.tile_ws, &o.num_tile_ws) != 0;
      for (int t = 0; t < o.num_tile_ws && !bad; t++)
        bad = o.tile_ws[t] != 0 && o.tile_ws[t] != EPX__MOE_TILE_W &&
              o.tile_ws[t] != EPX__MOE_TILE_W_TALL;
    } else if (v && !strcmp(a, "--gu-out")) {
      bad = strcmp(v, "bf16") != 0 && strcmp(v, "fp32") != 0;
      o.gu_fp32 = !strcmp(v, "fp32");
    } else if (v && !strcmp(a, "--counts")) {
      bad = strcmp(v, "even") != 0 && strcmp(v, "routed") != 0;
      o.routed = !strcmp(v, "routed");
    } else if (v && !strcmp(a, "--tokens")) {
      bad = bench_parse_int(a, v, 1, 1 << 20, &o.tokens) != 0;
    } else if (v && !strcmp(a, "--iters")) {
      bad = bench_parse_int(a, v, 1, MAX_ITERS, &o.iters) != 0;
    } else if (v && !strcmp(a, "--seed")) {
      int s = 0;
      bad = bench_parse_int(a, v, 0, 1 << 30, &s) != 0;
      o.seed = (uint64_t)s;
    } else {
      bad = 1;
    }
    if (bad) {
      fprintf(stderr,
              "usage: %s [--shape all|deepseek|qwen3] [--ranks 2,4] [--tokens 4096] "
              "[--chunks 1,2] [--tile 0 (a list of 0: the layer's pick, 64, 96, 128, 160)] "
              "[--tile-w 0 (a list of 0: the layer's pick, 128, 256)] [--gu-out fp32|bf16] "
              "[--iters 20] [--seed 1] [--counts even|routed]\n",
              argv[0]);
      return 2;
    }
    i++;
  }
  return run(&o) ? 1 : 0;
}

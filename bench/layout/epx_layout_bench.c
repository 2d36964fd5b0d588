/*
 * epx_layout_bench.c - the layout kernel alone on one GPU (docs/bench.md, "The layout kernel on
 * one GPU"): no group and no NCCL, a kernel context from tests/gpu/one_gpu_ctx.c.
 *
 *   make layout-bench-bin && build/bin/epx_layout_bench
 *   build/bin/epx_layout_bench --tokens 4096,65536 --ranks 8 --iters 1000
 *
 * For each --tokens x --ranks shape, one line: the time of one layout as epx_layout queues it
 * (epx__layout_launch: the zeroing of num_tokens_per_expert, then the kernel), between two CUDA
 * events, median and p99 over --iters iterations after --warmup. Iterations are queued behind a
 * spin kernel that outlasts the host's queuing, so that the GPU never waits for the host and an
 * iteration's time is the GPU's; a batch in which the GPU caught up is measured again with a
 * longer spin. After timing, every output of the last iteration is compared with the CPU
 * reference (tests/ref): `wrong` counts the entries that differ. Exit code: 0 when every shape
 * ran with nothing wrong, 1 otherwise, 2 for bad flags.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "common/runner.h"
#include "gpu/gpu_util.h"
#include "gpu/one_gpu_ctx.h"
#include "kernels/api.h"
#include "ref/epx_ref.h"

#define MAX_LIST 16
#define BATCH 100                /* iterations queued behind one spin */
#define FIRST_SPIN_NS 2000000ull /* 2 ms: ~100 iterations of host queuing, with margin */
#define MAX_SPIN_NS 512000000ull

typedef struct options {
  int tokens[MAX_LIST], num_tokens;
  int ranks[MAX_LIST], num_ranks;
  int num_experts, top_k, int32_ids, from_mask, expand;
  int iters, warmup, device;
  uint64_t seed;
} options_t;

static void usage(FILE *f) {
  fprintf(f,
          "usage: epx_layout_bench [flags]\n"
          "  --tokens N[,N...]  tokens per rank (default 128,1024,4096,16384,65536)\n"
          "  --ranks R[,R...]   destination ranks (default 2,4,8)\n"
          "  --experts E        experts (default 256)\n"
          "  --topk K           experts per token, distinct (default 8)\n"
          "  --int32            int32 expert ids (default int64)\n"
          "  --mask             the rank-mask variant (epx_dispatch with is_token_in_rank)\n"
          "  --expand           the expert-major variant (epx_dispatch_expand: expand_pos too)\n"
          "  --iters N          timed iterations per shape (default 200)\n"
          "  --warmup N         untimed iterations before them (default 20)\n"
          "  --seed N           routing seed (default 1)\n"
          "  --device D         CUDA device (default 0)\n");
}

/* 0 to run, 1 after --help, 2 for a bad flag. */
static int parse_options(int argc, char **argv, options_t *o) {
  static const int tokens[] = {128, 1024, 4096, 16384, 65536}, ranks[] = {2, 4, 8};
  memset(o, 0, sizeof *o);
  memcpy(o->tokens, tokens, sizeof tokens);
  o->num_tokens = 5;
  memcpy(o->ranks, ranks, sizeof ranks);
  o->num_ranks = 3;
  o->num_experts = 256;
  o->top_k = 8;
  o->iters = 200;
  o->warmup = 20;
  o->seed = 1;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    int bad = 0;
    if (!strcmp(a, "--help")) {
      usage(stdout);
      return 1;
    } else if (!strcmp(a, "--int32")) {
      o->int32_ids = 1;
      continue;
    } else if (!strcmp(a, "--mask")) {
      o->from_mask = 1;
      continue;
    } else if (!strcmp(a, "--expand")) {
      o->expand = 1;
      continue;
    } else if (!v) {
      bad = 1;
    } else if (!strcmp(a, "--tokens")) {
      bad = bench_parse_list(a, v, 0, EPX_MAX_TOKENS_PER_RANK, MAX_LIST, o->tokens, &o->num_tokens);
    } else if (!strcmp(a, "--ranks")) {
      bad = bench_parse_list(a, v, 0, EPX_MAX_TOKENS_PER_RANK, MAX_LIST, o->ranks, &o->num_ranks);
    } else if (!strcmp(a, "--experts")) {
      o->num_experts = atoi(v);
    } else if (!strcmp(a, "--topk")) {
      o->top_k = atoi(v);
    } else if (!strcmp(a, "--iters")) {
      o->iters = atoi(v);
    } else if (!strcmp(a, "--warmup")) {
      o->warmup = atoi(v);
    } else if (!strcmp(a, "--seed")) {
      o->seed = strtoull(v, NULL, 10);
    } else if (!strcmp(a, "--device")) {
      o->device = atoi(v);
    } else {
      bad = 1;
    }
    if (bad) {
      fprintf(stderr, "epx_layout_bench: bad flag %s%s%s\n", a, v ? " " : "", v ? v : "");
      usage(stderr);
      return 2;
    }
    i++;
  }
  if (o->from_mask && o->expand) {
    fprintf(stderr,
            "epx_layout_bench: --mask and --expand exclude each other (expert-major "
            "positions need ids)\n");
    return 2;
  }
  int ok = o->num_experts >= 1 && o->num_experts <= EPX_MAX_EXPERTS && o->top_k >= 1 &&
           o->top_k <= EPX_MAX_TOP_K && o->top_k <= o->num_experts && o->iters >= 1 &&
           o->warmup >= 0;
  for (int i = 0; i < o->num_ranks; i++)
    ok &= o->ranks[i] >= 1 && o->ranks[i] <= EPX_MAX_RANKS && o->num_experts % o->ranks[i] == 0;
  if (!ok) {
    fprintf(stderr,
            "epx_layout_bench: need 1 <= topk <= %d, topk <= experts <= %d, ranks in [1, %d] "
            "dividing experts, iters >= 1\n",
            EPX_MAX_TOP_K, EPX_MAX_EXPERTS, EPX_MAX_RANKS);
    return 2;
  }
  return 0;
}

/* Device buffers sized for the largest shape. */
typedef struct buffers {
  void *idx;          /* [T, K] int64 or int32 */
  uint8_t *mask_in;   /* [T, R] rank mask (--mask) */
  int *per_expert_in; /* [E] (--mask) */
  int *per_rank, *per_expert;
  uint8_t *in_rank;
  int *pos;
  int *expand_pos; /* [T, K] (--expand) */
} buffers_t;

typedef struct shape {
  int T, R;
  const int64_t *idx;    /* host [T, K] */
  const uint8_t *mask;   /* host [T, R] (--mask) */
  const int *per_expert; /* host [E] (--mask) */
} shape_t;

static epx_status_t launch(const options_t *o, one_gpu_ctx_t *c, const buffers_t *b,
                           const shape_t *s, cudaStream_t stream) {
  epx__layout_launch_args_t a;
  memset(&a, 0, sizeof a);
  a.topk_idx = o->from_mask ? NULL : b->idx;
  a.idx_is_int64 = !o->int32_ids;
  a.num_tokens = s->T;
  a.top_k = o->top_k;
  a.num_experts = o->num_experts;
  a.num_ranks = s->R;
  a.num_tokens_per_rank = b->per_rank;
  a.num_tokens_per_expert = b->per_expert;
  a.is_token_in_rank = b->in_rank;
  a.token_pos_in_rank = b->pos;
  a.from_mask = o->from_mask;
  a.in_rank_mask = o->from_mask ? b->mask_in : NULL;
  a.in_tokens_per_expert = o->from_mask ? b->per_expert_in : NULL;
  a.expand_pos = o->expand ? b->expand_pos : NULL;
  return epx__layout_launch(&c->ctx, &a, stream);
}

static int compare_double(const void *x, const void *y) {
  const double a = *(const double *)x, b = *(const double *)y;
  return (a > b) - (a < b);
}

/* Time `iters` iterations into us[0..iters). */
static int time_shape(const options_t *o, one_gpu_ctx_t *c, const buffers_t *b, const shape_t *s,
                      cudaStream_t stream, cudaEvent_t *ev, cudaEvent_t ready, double *us) {
  for (int i = 0; i < o->warmup; i++) BENCH_EPX(launch(o, c, b, s, stream));
  BENCH_CUDA(cudaStreamSynchronize(stream));
  uint64_t spin_ns = FIRST_SPIN_NS;
  for (int done = 0; done < o->iters;) {
    const int n = o->iters - done < BATCH ? o->iters - done : BATCH;
    BENCH_CUDA(test_spin_ns(spin_ns, stream));
    BENCH_CUDA(cudaEventRecord(ready, stream));
    for (int i = 0; i < n; i++) {
      BENCH_CUDA(cudaEventRecord(ev[2 * i], stream));
      BENCH_EPX(launch(o, c, b, s, stream));
      BENCH_CUDA(cudaEventRecord(ev[2 * i + 1], stream));
    }
    /* The spin already over: the GPU may have waited for the host inside this batch. */
    const cudaError_t q = cudaEventQuery(ready);
    if (q != cudaSuccess && q != cudaErrorNotReady) BENCH_CUDA(q);
    (void)cudaGetLastError(); /* cudaErrorNotReady is a status, not an error */
    BENCH_CUDA(cudaStreamSynchronize(stream));
    if (q == cudaSuccess && spin_ns < MAX_SPIN_NS) {
      spin_ns *= 2;
      continue;
    }
    for (int i = 0; i < n; i++) {
      float ms = 0;
      BENCH_CUDA(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
      us[done + i] = 1000.0 * ms;
    }
    done += n;
  }
  return 0;
}

/* --expand: slot k of token t's position among the call's tokens listing its expert, in token
 * order (-1 for an invalid id; a repeated expert gets its first slot's); what the layout kernel
 * writes to expand_pos (src/kernels/layout.cu). Returns the entries of got that differ. */
static long long count_wrong_expand(const int64_t *idx, int T, int K, int E, const int *got) {
  int *next = calloc(E, sizeof(int)), *ref = malloc(sizeof(int) * ((size_t)T * K + 1));
  long long wrong = -1;
  if (next && ref) {
    wrong = 0;
    for (int t = 0; t < T; t++)
      for (int k = 0; k < K; k++) {
        const int64_t e = idx[(size_t)t * K + k];
        int *r = &ref[(size_t)t * K + k];
        *r = -1;
        if (e < 0 || e >= E) continue;
        int first = k;
        for (int j = 0; j < k && first == k; j++)
          if (idx[(size_t)t * K + j] == e) first = j;
        *r = first == k ? next[e]++ : ref[(size_t)t * K + first];
      }
    for (size_t i = 0; i < (size_t)T * K; i++) wrong += got[i] != ref[i];
  }
  free(next), free(ref);
  return wrong;
}

/* Entries of the last iteration's outputs that differ from the reference; -1 on a CUDA error. */
static long long count_wrong(const options_t *o, const buffers_t *b, const shape_t *s) {
  const int T = s->T, R = s->R, E = o->num_experts;
  const size_t TR = (size_t)T * R;
  int *ref_rank = calloc(R, sizeof(int)), *ref_expert = calloc(E, sizeof(int));
  int *got_rank = calloc(R, sizeof(int)), *got_expert = calloc(E, sizeof(int));
  uint8_t *ref_in = calloc(TR + 1, 1), *got_in = calloc(TR + 1, 1);
  int *ref_pos = calloc(TR + 1, sizeof(int)), *got_pos = calloc(TR + 1, sizeof(int));
  long long wrong = -1;
  if (!ref_rank || !ref_expert || !got_rank || !got_expert || !ref_in || !got_in || !ref_pos ||
      !got_pos)
    goto out;
  epx_ref_layout(s->idx, T, o->top_k, E, R, ref_rank, ref_expert, ref_in, ref_pos);
  if (o->from_mask) memcpy(ref_expert, s->per_expert, sizeof(int) * E); /* copied, not counted */
  if (cudaMemcpy(got_rank, b->per_rank, sizeof(int) * R, cudaMemcpyDeviceToHost) != cudaSuccess ||
      cudaMemcpy(got_expert, b->per_expert, sizeof(int) * E, cudaMemcpyDeviceToHost) !=
          cudaSuccess ||
      cudaMemcpy(got_in, b->in_rank, TR, cudaMemcpyDeviceToHost) != cudaSuccess ||
      cudaMemcpy(got_pos, b->pos, sizeof(int) * TR, cudaMemcpyDeviceToHost) != cudaSuccess)
    goto out;
  wrong = 0;
  for (int r = 0; r < R; r++) wrong += got_rank[r] != ref_rank[r];
  for (int e = 0; e < E; e++) wrong += got_expert[e] != ref_expert[e];
  for (size_t i = 0; i < TR; i++) wrong += (got_in[i] != ref_in[i]) + (got_pos[i] != ref_pos[i]);
  if (o->expand) {
    const size_t TK = (size_t)T * o->top_k;
    int *got_x = malloc(sizeof(int) * (TK + 1));
    const long long w = got_x && cudaMemcpy(got_x, b->expand_pos, sizeof(int) * TK,
                                            cudaMemcpyDeviceToHost) == cudaSuccess
                            ? count_wrong_expand(s->idx, T, o->top_k, E, got_x)
                            : -1;
    free(got_x);
    wrong = w < 0 ? -1 : wrong + w;
  }
out:
  free(ref_rank), free(ref_expert), free(got_rank), free(got_expert);
  free(ref_in), free(got_in), free(ref_pos), free(got_pos);
  return wrong;
}

/* K distinct experts per token, uniform; the smaller shapes use a prefix. */
static void make_routing(int64_t *idx, int T, int K, int E, uint64_t seed) {
  uint64_t rng = seed;
  for (int t = 0; t < T; t++)
    for (int k = 0; k < K; k++)
      idx[(size_t)t * K + k] = epx_test_rand_new_expert(&rng, idx + (size_t)t * K, k, E);
}

static int run(const options_t *o) {
  int max_t = 0, max_r = 0;
  for (int i = 0; i < o->num_tokens; i++) max_t = o->tokens[i] > max_t ? o->tokens[i] : max_t;
  for (int i = 0; i < o->num_ranks; i++) max_r = o->ranks[i] > max_r ? o->ranks[i] : max_r;
  const int K = o->top_k, E = o->num_experts;

  BENCH_CUDA(cudaSetDevice(o->device));
  struct cudaDeviceProp prop;
  BENCH_CUDA(cudaGetDeviceProperties(&prop, o->device));
  const char *commit = getenv("EPX_COMMIT");
  printf(
      "# epx_layout_bench: %s, %d SMs%s%s; top-%d of %d experts, %s ids%s; seed %llu; %d "
      "iterations after %d warmup\n",
      prop.name, prop.multiProcessorCount, commit ? ", commit " : "", commit ? commit : "", K, E,
      o->int32_ids ? "int32" : "int64", o->from_mask ? ", rank-mask variant" : "",
      (unsigned long long)o->seed, o->iters, o->warmup);
  printf("# time: one epx__layout_launch (memset of the expert counts + kernel), CUDA events\n");
  printf("%-8s %7s %5s %7s %4s %5s %9s %9s %9s %9s %6s\n", "op", "tokens", "ranks", "experts",
         "topk", "ids", "med_us", "p99_us", "min_us", "max_us", "wrong");

  /* Host routing of the largest shape; the ids the kernel reads, in the chosen width. */
  int64_t *idx = malloc(sizeof(int64_t) * ((size_t)max_t * K + 1));
  int32_t *idx32 = malloc(sizeof(int32_t) * ((size_t)max_t * K + 1));
  uint8_t *mask = malloc((size_t)max_t * max_r + 1);
  int *per_expert = calloc(E, sizeof(int));
  double *us = malloc(sizeof(double) * o->iters);
  cudaEvent_t *ev = malloc(sizeof(cudaEvent_t) * 2 * BATCH);
  if (!idx || !idx32 || !mask || !per_expert || !us || !ev) {
    fprintf(stderr, "epx_layout_bench: out of host memory\n");
    return -1;
  }
  make_routing(idx, max_t, K, E, o->seed);
  for (size_t i = 0; i < (size_t)max_t * K; i++) idx32[i] = (int32_t)idx[i];

  one_gpu_ctx_t c;
  BENCH_CUDA(o->expand ? one_gpu_ctx_create_expand(&c, max_t > 0 ? max_t : 1, 10000)
                       : one_gpu_ctx_create(&c, max_t > 0 ? max_t : 1, 10000));
  buffers_t b;
  memset(&b, 0, sizeof b);
  BENCH_CUDA(cudaMalloc(&b.idx, sizeof(int64_t) * ((size_t)max_t * K + 1)));
  BENCH_CUDA(cudaMalloc((void **)&b.mask_in, (size_t)max_t * max_r + 1));
  BENCH_CUDA(cudaMalloc((void **)&b.per_expert_in, sizeof(int) * E));
  BENCH_CUDA(cudaMalloc((void **)&b.per_rank, sizeof(int) * max_r));
  BENCH_CUDA(cudaMalloc((void **)&b.per_expert, sizeof(int) * E));
  BENCH_CUDA(cudaMalloc((void **)&b.in_rank, (size_t)max_t * max_r + 1));
  BENCH_CUDA(cudaMalloc((void **)&b.pos, sizeof(int) * ((size_t)max_t * max_r + 1)));
  BENCH_CUDA(cudaMalloc((void **)&b.expand_pos, sizeof(int) * ((size_t)max_t * K + 1)));
  if (o->int32_ids)
    BENCH_CUDA(
        cudaMemcpy(b.idx, idx32, sizeof(int32_t) * (size_t)max_t * K, cudaMemcpyHostToDevice));
  else
    BENCH_CUDA(cudaMemcpy(b.idx, idx, sizeof(int64_t) * (size_t)max_t * K, cudaMemcpyHostToDevice));
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (int i = 0; i < 2 * BATCH; i++) BENCH_CUDA(cudaEventCreate(&ev[i]));
  cudaEvent_t ready;
  BENCH_CUDA(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));

  int failed = 0;
  for (int ri = 0; ri < o->num_ranks; ri++) {
    const int R = o->ranks[ri];
    /* --mask: the rank mask and expert counts of the same routing, as epx_dispatch gets them. */
    if (o->from_mask) {
      int *ref_rank = calloc(R, sizeof(int));
      int *pos = malloc(sizeof(int) * ((size_t)max_t * R + 1));
      if (!ref_rank || !pos) return -1;
      epx_ref_layout(idx, max_t, K, E, R, ref_rank, per_expert, mask, pos);
      free(ref_rank), free(pos);
      BENCH_CUDA(cudaMemcpy(b.mask_in, mask, (size_t)max_t * R, cudaMemcpyHostToDevice));
    }
    for (int ti = 0; ti < o->num_tokens; ti++) {
      shape_t s = {o->tokens[ti], R, idx, mask, per_expert};
      if (o->from_mask) {
        /* Expert counts of this prefix of the routing. */
        int *ref_rank = calloc(R, sizeof(int));
        if (!ref_rank) return -1;
        epx_ref_layout(idx, s.T, K, E, R, ref_rank, per_expert, NULL, NULL);
        free(ref_rank);
        BENCH_CUDA(
            cudaMemcpy(b.per_expert_in, per_expert, sizeof(int) * E, cudaMemcpyHostToDevice));
      }
      if (time_shape(o, &c, &b, &s, stream, ev, ready, us)) return -1;
      const long long wrong = count_wrong(o, &b, &s);
      epx__error_record_t err;
      BENCH_CUDA(one_gpu_ctx_take_error(&c, &err));
      if (err.status != 0)
        fprintf(stderr, "  async error %d, stage %d, position %lld, value %lld\n", err.status,
                err.stage, err.position, err.value);
      qsort(us, (size_t)o->iters, sizeof *us, compare_double);
      const int n = o->iters;
      const double med = n % 2 ? us[n / 2] : 0.5 * (us[n / 2 - 1] + us[n / 2]);
      const double p99 = us[(99 * n + 99) / 100 - 1]; /* the ceil(0.99 n)-th smallest */
      printf("%-8s %7d %5d %7d %4d %5s %9.2f %9.2f %9.2f %9.2f %6lld\n",
             o->from_mask ? "layout/m"
             : o->expand  ? "layout/x"
                          : "layout",
             s.T, R, E, K, o->int32_ids ? "int32" : "int64", med, p99, us[0], us[n - 1], wrong);
      fflush(stdout);
      failed |= wrong != 0 || err.status != 0;
    }
  }

  for (int i = 0; i < 2 * BATCH; i++) cudaEventDestroy(ev[i]);
  cudaEventDestroy(ready);
  cudaStreamDestroy(stream);
  cudaFree(b.idx), cudaFree(b.mask_in), cudaFree(b.per_expert_in), cudaFree(b.per_rank);
  cudaFree(b.per_expert), cudaFree(b.in_rank), cudaFree(b.pos), cudaFree(b.expand_pos);
  one_gpu_ctx_destroy(&c);
  free(idx), free(idx32), free(mask), free(per_expert), free(us), free(ev);
  return failed ? 1 : 0;
}

int main(int argc, char **argv) {
  bench_program = "epx_layout_bench";
  options_t o;
  const int p = parse_options(argc, argv, &o);
  if (p == 1) return 0;
  if (p == 2) return 2;
  int num_gpus = 0;
  if (cudaGetDeviceCount(&num_gpus) != cudaSuccess || num_gpus <= o.device) {
    (void)cudaGetLastError();
    printf("skipped: needs a GPU (device %d), %d visible\n", o.device, num_gpus);
    return 0;
  }
  const int r = run(&o);
  return r == 0 ? 0 : 1;
}

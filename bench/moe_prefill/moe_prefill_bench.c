/*
 * moe_prefill_bench.c - epx_moe_prefill_bench: the MoE layer at prefill (epx_moe_prefill)
 * against its parts, on every visible GPU (one rank per GPU), docs/bench.md "MoE layer":
 *
 *   layer   epx_moe_prefill, overlapped (the plan's chunks pipelined over two groups)
 *   chain   epx_moe_prefill, overlap = 0: one dispatch, the FFN, one combine, one after another
 *           on one stream (the same GEMMs as "gemms")
 *   gemms   the FFN alone (the same cuBLAS calls, src/moe_prefill.c's epx__moe_ffn) on the rows
 *           of an earlier dispatch of the same routing, no communication
 *   comm    epx_dispatch_expand (sync_counts = 1) + epx_combine_expand, no expert compute; the
 *           dispatch carries what the layer's do (column "wire": FP8 with FP8 weights on
 *           cuBLAS, the tokens quantized once beforehand, so the layer's per-chunk quantize is
 *           not in this row; else BF16); the combine sums BF16 expert-output rows
 *   cublas  plain cuBLAS on the same GEMM shapes: one gate/up and one down GEMM of all the
 *           rows at once on one expert's weights (epx__moe_gemm_reference)
 *   phases  epx_moe_prefill, overlap = EPX_MOE_OVERLAP_PHASES (EPX's grouped FP8 GEMM only, else
 *           -1): one dispatch, gate/up, then the down projection and the combine by source rank
 *
 * Every variant is timed whole with CUDA events on each rank's stream around the call (the
 * layer waits on the host for each chunk's count exchange, so nothing is graph-captured), after
 * a group barrier; rank 0 prints median and min over --iters (the variants interleaved: each
 * iteration runs each once, in a shuffled order of its own; --sequential: variant after variant;
 * the host waits for each call, or with --host-ahead queues the next one at once). Columns: lay/max
 * = layer / max(gemms, comm) (issue 16's target: <= 1.15), chn/lay = chain / layer (target
 * >= 1.15), cub/gem = cublas / gemms (target >= 0.70), pha/max and chn/pha the same two ratios for
 * phases; after each row a "# host" line: the median host
 * time of each variant's call (gemms: what queueing one FFN costs); ln = the plan's GEMM lanes
 * (--gemm-lanes, a list to compare them in one run); ffn = cublas (per-expert GEMMs,
 * EPX_MOE_FFN_CUBLAS), group
 * (--grouped: BF16 points once more with EPX_MOE_FFN_CUBLAS_GROUPED, one batched GEMM per
 * projection: what auto picks for BF16 weights), egrp (--grouped: FP8 points once more with
 * EPX_MOE_FFN_EPX_GROUPED, EPX's grouped FP8 GEMM; --grouped-only: every point only with its
 * grouped backend) or epx.
 * --gemm-sms N[,M]: the plan's config.gemm_sms, a list to compare in one run; column sms
 * (info.gemm_sms) (cuBLAS's SM target while communication runs beside
 * the GEMMs). --timeline DIR (created if missing): after the timed calls, one call of every
 * variant timed, under CUPTI: every rank's kernels to
 * DIR/<shape>-<dtype>-T<T>-R<R>-<ffn>-ln<lanes>-sms<gemm_sms>-<variant>.csv (.rank<r>.csv past
 * rank 0) and one "# timeline" line each: how long
 * communication kernels ran beside compute kernels. Shapes: DeepSeek-V3's experts (H 7168, I 2048,
 * 256 experts) and Qwen3-30B-A3B's (H 2048, I 768, 128), top-8, uniform routing, --tokens per rank
 * (default 4096); weights BF16, or FP8 with 128x128 block scales. Random values; nothing is checked
 * here (tests/gpu/test_moe_prefill.c does that).
 */
#include <errno.h>
#include <stdio.h>
#include <sys/stat.h>
#include <time.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "common/ranks.h"
#include "epx.h"
#include "experts/bench_kernels.h"
#include "kernels/api.h"
#include "ktime.h"
#include "moe/moe_common.h"
#include "moe_prefill.h"

typedef struct {
  moe_options_t m; /* --tokens, --shape, --dtype, --iters, --ranks */
  int chunks;
  int lanes[MOE_MAX_LIST], num_lanes; /* config.gemm_lanes values to run (0: the plan's default) */
  const char *timeline;               /* --timeline DIR: one call of each variant, its kernels */
  int grouped; /* --grouped: BF16 points also with EPX_MOE_FFN_CUBLAS_GROUPED, FP8 ones with
                  EPX_MOE_FFN_EPX_GROUPED; 2: only those */
  int gemm_sms[MOE_MAX_LIST], num_gemm_sms; /* --gemm-sms: config.gemm_sms values (0: default) */
  int sequential; /* --sequential: each variant's calls back to back (default: interleaved) */
  int host_ahead; /* --host-ahead: no host wait between timed calls (time_call) */
} options_t;

/* The ffn column: which GEMMs ran. */
static const char *ffn_name(int backend) {
  return backend == EPX_MOE_FFN_CUBLAS           ? "cublas"
         : backend == EPX_MOE_FFN_CUBLAS_GROUPED ? "group"
         : backend == EPX_MOE_FFN_EPX_GROUPED    ? "egrp"
                                                 : "epx";
}

enum { V_LAYER, V_CHAIN, V_GEMMS, V_COMM, V_CUBLAS, V_PHASES, NUM_VARIANTS };
static const char *const kVariantNames[NUM_VARIANTS] = {"layer", "chain",  "gemms",
                                                        "comm",  "cublas", "phases"};

typedef struct {
  epx_group_t g[3]; /* two for the plan, one holding the gemms variant's rows */
  epx_handle_t hold_handle, comm_handle;
  epx_moe_prefill_t plan;
  epx_experts_t ex;
  void *x, *ids, *w, *out, *ws;
  void *y0;  /* the workspace's first slot of BF16 expert outputs (the FFN's and combine's rows) */
  void *x8;  /* FP8 on the wire: the tokens' codes, quantized once (comm and held dispatches) */
  float *xs; /* and their scales [T, H/128] */
  size_t ws_bytes;
  int T, L;
  epx_dispatch_expand_result_t held;
  int held_count[EPX_MAX_EXPERTS], held_begin[EPX_MAX_EXPERTS + 1];
} bench_ctx_t;

/* The layer's dispatch of all T tokens: BF16, or FP8 as the plan sends it (dispatch_dtype). */
static epx_dispatch_args_t dispatch_args(const bench_ctx_t *c, int *counts) {
  epx_dispatch_args_t d = EPX_DISPATCH_ARGS_INIT;
  d.x = c->x, d.topk_idx = c->ids, d.topk_weights = c->w, d.num_tokens = c->T;
  d.expert_alignment = EPX__MOE_ALIGN, d.sync_counts = 1, d.num_recv_per_expert = counts;
  if (c->x8) d.x = c->x8, d.x_dtype = EPX_DTYPE_FP8_E4M3, d.x_scales = c->xs;
  return d;
}

static epx__moe_rows_t held_rows(const bench_ctx_t *c) {
  const epx__moe_rows_t r = {.x = c->held.recv_x,
                             .x_scales = c->held.recv_x_scales, /* NULL: BF16 rows */
                             .num_rows = c->held.num_rows,
                             .x_capacity = c->held.capacity,
                             .count = c->held_count,
                             .begin = c->held_begin,
                             .count_dev = c->held.expert_count_device,
                             .begin_dev = c->held.expert_begin_device,
                             .y = c->y0};
  return r;
}

static int run_variant(bench_ctx_t *c, int v, cudaStream_t stream) {
  if (v == V_LAYER || v == V_CHAIN || v == V_PHASES) {
    epx_moe_prefill_args_t a = EPX_MOE_PREFILL_ARGS_INIT;
    a.x = c->x, a.topk_idx = c->ids, a.topk_weights = c->w, a.num_tokens = c->T;
    a.overlap = v == V_LAYER    ? EPX_MOE_OVERLAP_CHUNKS
                : v == V_PHASES ? EPX_MOE_OVERLAP_PHASES
                                : EPX_MOE_CHAIN;
    a.out = c->out, a.workspace = c->ws, a.workspace_bytes = c->ws_bytes;
    BENCH_EPX(epx_moe_prefill(c->plan, &a, stream));
    return 0;
  }
  if (v == V_GEMMS || v == V_CUBLAS) {
    const epx__moe_rows_t r = held_rows(c);
    int y_block_rows = 0; /* the layout y is left in: the gemms variant has no combine */
    if (v == V_GEMMS)
      BENCH_EPX(epx__moe_ffn(c->plan, &r, 0, c->ws, c->ws_bytes, &y_block_rows, stream));
    else
      BENCH_EPX(epx__moe_gemm_reference(c->plan, &r, c->ws, c->ws_bytes, stream));
    return 0;
  }
  int counts[EPX_MAX_EXPERTS];
  const epx_dispatch_args_t d = dispatch_args(c, counts);
  epx_dispatch_expand_result_t r;
  BENCH_EPX(epx_dispatch_expand(c->g[0], c->comm_handle, &d, &r, stream));
  epx_combine_expand_args_t ca = EPX_COMBINE_EXPAND_ARGS_INIT;
  /* BF16 expert outputs as the layer combines (the workspace's first output slot) */
  ca.x = c->y0, ca.out = c->out;
  BENCH_EPX(epx_combine_expand(c->g[0], c->comm_handle, &ca, stream));
  return 0;
}

static double host_now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec * 1e-3;
}

/* One timed call of variant v on stream between the events a and b, after a group barrier: the
 * host time the call took to return in us. Without --host-ahead the host then waits for b and
 * *ms is the event time; with it the host goes on to queue the next call at once (the caller
 * reads the events at the end), so the GPU runs the calls one after another, each after a
 * GPU-side barrier, while the host queues ahead of it as far as the calls' own waits for the GPU
 * (count exchanges) let it, as inside a model where the layer follows other work on its stream.
 * Without it every call starts from a GPU the host has just waited for, and the host's checks
 * and launches before the call's first kernels are in its time. */
static int time_call(bench_ctx_t *c, int v, cudaStream_t stream, cudaEvent_t a, cudaEvent_t b,
                     const options_t *o, float *ms, float *host_us) {
  BENCH_EPX(epx_group_barrier(c->g[0], stream));
  BENCH_CUDA(cudaEventRecord(a, stream));
  const double t0 = host_now_us();
  if (run_variant(c, v, stream)) return -1;
  const double t1 = host_now_us();
  BENCH_CUDA(cudaEventRecord(b, stream));
  *host_us = (float)(t1 - t0);
  if (o->host_ahead) return 0;
  BENCH_CUDA(cudaEventSynchronize(b));
  BENCH_CUDA(cudaEventElapsedTime(ms, a, b));
  return 0;
}

/* 1 if e is cudaSuccess; else the failure reported (as BENCH_CUDA does) and 0. */
static int cuda_ok(cudaError_t e, const char *what, int line) {
  if (e == cudaSuccess) return 1;
  bench_report_failure(__FILE__, line, what, cudaGetErrorString(e));
  return 0;
}

/* Iteration i's order of the variants: a permutation drawn from i alone (a Fisher-Yates shuffle
 * on a hash of (i, position); the same on every rank, as the calls are collective), so that a
 * variant's predecessor changes from one iteration to the next. (A rotation of one fixed order
 * would keep it in all but one iteration of NUM_VARIANTS: phases after the dense cuBLAS GEMM.) */
static void iteration_order(int i, int *order) {
  for (int v = 0; v < NUM_VARIANTS; v++) order[v] = v;
  for (int v = NUM_VARIANTS - 1; v > 0; v--) {
    uint32_t x = (uint32_t)(i * NUM_VARIANTS + v) * 0x9e3779b9u; /* murmur3's finalizer */
    x ^= x >> 16, x *= 0x85ebca6bu, x ^= x >> 13, x *= 0xc2b2ae35u, x ^= x >> 16;
    const int j = (int)(x % (uint32_t)(v + 1)), t = order[v];
    order[v] = order[j], order[j] = t;
  }
}

/* Whole-call times of the variants with run[v] set: median and min over iters, after warmup
 * calls; and the median host time each call took to return (*host: for the gemms variant, what
 * queueing one FFN costs the host, which the layer pays once per chunk after each count wait;
 * the layer, chain and comm variants wait for count exchanges inside the call). Interleaved (the
 * default): each iteration runs every variant once, in an order of its own (iteration_order), so
 * that no variant always runs after the same one and all of them see the same clock and
 * temperature drift (our H200s' SM clocks move 1.4-2.0 GHz with load: docs/bench.md);
 * --sequential: each variant's iterations back to back, variant after variant (the order before
 * session 26). */
static int time_variants(bench_ctx_t *c, const int *run, cudaStream_t stream, const options_t *o,
                         float *median, float *min, float *host) {
  const int n = o->m.warmup + o->m.iters, total = NUM_VARIANTS * n;
  float *ms = calloc((size_t)total, sizeof(float)), *hs = calloc((size_t)total, sizeof(float));
  cudaEvent_t *ev = calloc((size_t)2 * total, sizeof(cudaEvent_t)); /* a, b of each call */
  int made = 0, rc = !ms || !hs || !ev ? -1 : 0, order[NUM_VARIANTS];
  if (rc) bench_report_failure(__FILE__, __LINE__, "time_variants", "out of host memory");
  for (; made < 2 * total && !rc; made++)
    if (!cuda_ok(cudaEventCreate(&ev[made]), "cudaEventCreate", __LINE__)) {
      rc = -1;
      break; /* ev[made] was not created: not destroyed below */
    }
  for (int k = 0; k < total && !rc; k++) {
    const int i = o->sequential ? k % n : k / NUM_VARIANTS;
    if (!o->sequential && k % NUM_VARIANTS == 0) iteration_order(i, order);
    const int v = o->sequential ? k / n : order[k % NUM_VARIANTS], at = v * n + i;
    if (run[v]) rc = time_call(c, v, stream, ev[2 * at], ev[2 * at + 1], o, &ms[at], &hs[at]);
  }
  if (!rc && o->host_ahead) { /* every call queued: read their events now */
    if (!cuda_ok(cudaStreamSynchronize(stream), "cudaStreamSynchronize", __LINE__)) rc = -1;
    for (int at = 0; at < total && !rc; at++)
      if (run[at / n] && !cuda_ok(cudaEventElapsedTime(&ms[at], ev[2 * at], ev[2 * at + 1]),
                                  "cudaEventElapsedTime", __LINE__))
        rc = -1;
  }
  for (int v = 0; v < NUM_VARIANTS && !rc; v++) {
    median[v] = min[v] = host[v] = -1.f;
    if (!run[v]) continue;
    float *t = ms + v * n + o->m.warmup, *h = hs + v * n + o->m.warmup;
    qsort(t, o->m.iters, sizeof(float), moe_cmp_float);
    qsort(h, o->m.iters, sizeof(float), moe_cmp_float);
    median[v] = t[o->m.iters / 2] * 1000.f;
    min[v] = t[0] * 1000.f;
    host[v] = h[o->m.iters / 2];
  }
  for (int e = 0; e < made; e++) cudaEventDestroy(ev[e]);
  free(ms), free(hs), free(ev);
  return rc ? -1 : 0;
}

/* The timeline's two classes: EPX's communication kernels (layout, notify, the normal-mode
 * dispatch, fan-out, reduce and combine) and the expert compute (cuBLAS, the row kernel, EPX's
 * FFN); memsets and copies in neither. */
static int timeline_class(const bench_ktime_activity_t *a) {
  if (a->kind != BENCH_KTIME_KERNEL || !a->name) return -1;
  const char *n = a->name;
  if (!strncmp(n, "normal::", 8) || !strncmp(n, "layout", 6) || !strncmp(n, "notify", 6)) return 0;
  return 1;
}

/* A rank's kernels of one timeline call to DIR/<tag>.csv (rank 0) or DIR/<tag>.rank<r>.csv:
 * kind, name, stream, start and end in us from its first start; one line with that first start
 * in CUPTI's timestamps (which CUPTI gives on one host clock, so the ranks' timelines can be
 * laid side by side: check that the barrier lines them up) and the span. The file's name goes
 * to path. Returns 0 once written. */
static int timeline_write(const options_t *o, const char *tag, int rank,
                          const bench_ktime_activity_t *tl, long n, char *path, size_t path_len) {
  if (rank == 0)
    snprintf(path, path_len, "%s/%s.csv", o->timeline, tag);
  else
    snprintf(path, path_len, "%s/%s.rank%d.csv", o->timeline, tag, rank);
  FILE *f = fopen(path, "w");
  if (!f) return -1;
  fprintf(f, "kind,name,stream,start_us,end_us\n");
  for (long i = 0; i < n; i++)
    fprintf(f, "%s,%s,%u,%.3f,%.3f\n",
            tl[i].kind == BENCH_KTIME_KERNEL   ? "kernel"
            : tl[i].kind == BENCH_KTIME_MEMSET ? "memset"
                                               : "memcpy",
            tl[i].name ? tl[i].name : "", tl[i].stream_id,
            (double)(tl[i].start_ns - tl[0].start_ns) * 1e-3,
            (tl[i].end_ns > tl[0].start_ns ? (double)(tl[i].end_ns - tl[0].start_ns) : 0.0) * 1e-3);
  fclose(f);
  uint64_t end = 0;
  for (long i = 0; i < n; i++) end = tl[i].end_ns > end ? tl[i].end_ns : end;
  printf("# timeline %s rank %d: first start %llu ns (CUPTI clock), span %.1f us; %s\n", tag, rank,
         (unsigned long long)tl[0].start_ns, (double)(end - tl[0].start_ns) * 1e-3, path);
  fflush(stdout);
  return 0;
}

/* One call of variant v under CUPTI: every rank's kernels to a file (timeline_write) and, on rank
 * 0, one line of busy and overlapped time. Every rank makes the barrier and the call whatever
 * CUPTI did here (they are collective); a CUPTI failure is printed and costs only the line. */
static int timeline(bench_ctx_t *c, int v, int rank, const char *tag, const options_t *o,
                    cudaStream_t stream) {
  static uint64_t next_id = 1;
  char why[BENCH_KTIME_REASON_LEN] = "";
  const int recording =
      bench_ktime_open(why, sizeof why) == 0 && bench_ktime_start(why, sizeof why) == 0;
  if (!recording) printf("# timeline %s: rank %d: no CUPTI: %s\n", tag, rank, why);
  BENCH_EPX(epx_group_barrier(c->g[0], stream));
  BENCH_CUDA(cudaStreamSynchronize(stream));
  const uint64_t id = next_id++;
  bench_ktime_call_begin(id);
  const int rc = run_variant(c, v, stream);
  bench_ktime_call_end();
  BENCH_CUDA(cudaDeviceSynchronize());
  if (!recording) return rc;
  if (bench_ktime_stop(why, sizeof why) && rank == 0) printf("# timeline %s: %s\n", tag, why);
  if (rc) return rc;
  bench_ktime_activity_t *tl = NULL;
  const long n = bench_ktime_timeline(id, &tl);
  char path[512];
  if (rank != 0) { /* the other ranks' kernels to DIR/<tag>.rank<r>.csv, one line each */
    if (n > 0) timeline_write(o, tag, rank, tl, n, path, sizeof path);
    free(tl);
    return 0;
  }
  if (n <= 0) {
    printf("# timeline %s: %s\n", tag,
           n < 0 ? "out of host memory" : "no activity recorded (external correlation?)");
    return 0;
  }
  const int f = timeline_write(o, tag, 0, tl, n, path, sizeof path) == 0;
  const bench_ktime_overlap_t ov = bench_ktime_overlap(tl, (size_t)n, timeline_class);
  printf(
      "# timeline %-28s %4ld activities: span %8.1f us, communication busy %8.1f us, "
      "compute busy %8.1f us, both %8.1f us (%.0f%% of communication beside compute)%s%s\n",
      tag, n, ov.span_ns * 1e-3, ov.busy_ns[0] * 1e-3, ov.busy_ns[1] * 1e-3, ov.both_ns * 1e-3,
      ov.busy_ns[0] ? 100.0 * ov.both_ns / ov.busy_ns[0] : 0.0, f ? "; " : "", f ? path : "");
  fflush(stdout);
  free(tl);
  return 0;
}

static int bench_point(ncclComm_t comm, int rank, int R, const moe_shape_t *s, int fp8, int T,
                       int lanes, int gemm_sms, int backend, const options_t *o,
                       cudaStream_t stream) {
  bench_ctx_t c;
  memset(&c, 0, sizeof c);
  c.T = T;
  c.L = s->experts / R;
  epx_group_config_t cfg = EPX_GROUP_CONFIG_INIT;
  cfg.max_tokens_per_rank = T, cfg.hidden = s->hidden, cfg.num_experts = s->experts;
  cfg.top_k = MOE_TOP_K, cfg.modes = EPX_MODE_NORMAL;
  cfg.dtypes = EPX_DTYPE_BF16 | EPX_DTYPE_FP8_E4M3; /* FP8 weights: FP8 crosses NVLink */
  cfg.expand_max_rows = R * T * (MOE_TOP_K < c.L ? MOE_TOP_K : c.L) + 3 * c.L;
  for (int i = 0; i < 3; i++) BENCH_EPX(epx_group_create(comm, &cfg, &c.g[i]));
  if (moe_alloc_experts(s, c.L, fp8, 1000u + (uint64_t)rank, &c.ex)) return -1;
  epx_moe_prefill_config_t pc = EPX_MOE_PREFILL_CONFIG_INIT;
  pc.num_chunks = o->chunks;
  pc.gemm_lanes = lanes;
  pc.gemm_sms = gemm_sms;
  pc.ffn_backend = backend;
  BENCH_EPX(epx_moe_prefill_create(c.g, 2, &c.ex, &pc, &c.plan));
  epx_moe_prefill_info_t info = EPX_MOE_PREFILL_INFO_INIT;
  BENCH_EPX(epx_moe_prefill_get_info(c.plan, &info));
  int64_t *ids = malloc(sizeof(int64_t) * T * MOE_TOP_K);
  float *w = malloc(sizeof(float) * T * MOE_TOP_K);
  moe_route(ids, w, T, s->experts, MOE_ROUTE_SEED + (uint64_t)rank);
  BENCH_CUDA(cudaMalloc(&c.x, (size_t)T * s->hidden * 2 + 16));
  BENCH_CUDA(cudaMalloc(&c.out, (size_t)T * s->hidden * 2 + 16));
  BENCH_CUDA(cudaMalloc(&c.ids, sizeof(int64_t) * T * MOE_TOP_K + 16));
  BENCH_CUDA(cudaMalloc(&c.w, sizeof(float) * T * MOE_TOP_K + 16));
  BENCH_CUDA(bench_fill_bf16(c.x, (size_t)T * s->hidden, 1.f, 5u + (uint64_t)rank));
  BENCH_CUDA(
      cudaDeviceSynchronize()); /* the fill ran on the legacy stream; `stream` does not wait */
  if (info.dispatch_dtype == EPX_DTYPE_FP8_E4M3) { /* the comm and gemms rows as the layer's */
    BENCH_CUDA(cudaMalloc(&c.x8, (size_t)T * s->hidden + 16));
    BENCH_CUDA(cudaMalloc((void **)&c.xs, sizeof(float) * (size_t)T * (s->hidden / 128) + 16));
    const epx__moe_quantize_tokens_launch_args_t qa = {c.x, c.x8, c.xs, T, s->hidden, 264};
    BENCH_EPX(epx__moe_quantize_tokens_launch(&qa, stream));
  }
  BENCH_CUDA(cudaMemcpy(c.ids, ids, sizeof(int64_t) * T * MOE_TOP_K, cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(c.w, w, sizeof(float) * T * MOE_TOP_K, cudaMemcpyHostToDevice));
  free(ids), free(w);
  c.ws_bytes = info.workspace_bytes;
  BENCH_CUDA(cudaMalloc(&c.ws, c.ws_bytes));
  c.y0 = (char *)c.ws + epx__moe_plan_ws_layout(c.plan).y[0];
  BENCH_EPX(epx_handle_create(c.g[2], &c.hold_handle));
  BENCH_EPX(epx_handle_create(c.g[0], &c.comm_handle));
  /* The gemms and cublas variants' rows: one dispatch of the same routing on the third group,
   * held (its counts and rows are what matter). */
  const epx_dispatch_args_t d = dispatch_args(&c, c.held_count);
  BENCH_EPX(epx_dispatch_expand(c.g[2], c.hold_handle, &d, &c.held, stream));
  c.held_begin[0] = 0;
  for (int j = 0; j < c.L; j++)
    c.held_begin[j + 1] = c.held_begin[j] + (c.held_count[j] + 3) / 4 * 4;
  epx_combine_expand_args_t ca = EPX_COMBINE_EXPAND_ARGS_INIT;
  ca.x = c.y0, ca.out = c.out;
  BENCH_EPX(epx_combine_expand(c.g[2], c.hold_handle, &ca, stream));
  BENCH_CUDA(cudaStreamSynchronize(stream));

  /* The cuBLAS reference row needs cuBLAS and, for FP8, cuBLASLt's block-scaled kernels, which
   * EPX's FFN and EPX's grouped FP8 GEMM do not (their plans are made without them). */
  const int reference_ok = info.ffn_backend != EPX_MOE_FFN_EPX && !c.plan->no_blas &&
                           (info.ffn_backend != EPX_MOE_FFN_EPX_GROUPED ||
                            (epx__moe_lt_supported(c.plan, 0) && epx__moe_lt_supported(c.plan, 1)));
  float med[NUM_VARIANTS], mn[NUM_VARIANTS], host[NUM_VARIANTS];
  int run[NUM_VARIANTS];
  for (int v = 0; v < NUM_VARIANTS; v++)
    run[v] = !(v == V_CUBLAS && !reference_ok) &&
             !(v == V_PHASES && info.ffn_backend != EPX_MOE_FFN_EPX_GROUPED); /* (refused) */
  if (time_variants(&c, run, stream, o, med, mn, host)) return -1;
  for (int i = 0; i < 3; i++) {
    epx_async_error_t err;
    BENCH_EPX(epx_group_get_async_error(c.g[i], &err));
    if (err.status != EPX_OK) {
      bench_report_failure(__FILE__, __LINE__, "epx_group_get_async_error", err.message);
      return -1;
    }
  }
  if (rank == 0) {
    const float base = med[V_GEMMS] > med[V_COMM] ? med[V_GEMMS] : med[V_COMM];
    printf("%-9s %-4s %5d %3d %-6s %2d %3d %-4s %6d", s->name, fp8 ? "fp8" : "bf16", T, R,
           ffn_name(info.ffn_backend), info.gemm_lanes, info.gemm_sms,
           info.dispatch_dtype == EPX_DTYPE_FP8_E4M3 ? "fp8" : "bf16", c.held.num_rows);
    for (int v = 0; v < NUM_VARIANTS; v++) printf(" %9.1f %9.1f", med[v], mn[v]);
    printf(" %8.3f %8.3f %8.3f %8.3f %8.3f\n", med[V_LAYER] / base, med[V_CHAIN] / med[V_LAYER],
           med[V_CUBLAS] > 0 ? med[V_CUBLAS] / med[V_GEMMS] : -1.f,
           med[V_PHASES] > 0 ? med[V_PHASES] / base : -1.f,
           med[V_PHASES] > 0 ? med[V_CHAIN] / med[V_PHASES] : -1.f);
    printf(
        "# host us per call (median; layer, chain, phases, comm include their count waits%s): "
        "layer %.1f chain %.1f phases %.1f gemms %.1f comm %.1f\n",
        o->host_ahead ? ", and with --host-ahead the GPU time of the calls queued before" : "",
        host[V_LAYER], host[V_CHAIN], host[V_PHASES], host[V_GEMMS], host[V_COMM]);
    fflush(stdout);
  }
  /* After the row is out: a failure here costs the timelines, not the figures. */
  if (o->timeline)
    for (int v = 0; v < NUM_VARIANTS; v++) {
      if (!run[v]) continue; /* every variant that was timed: the GEMMs' kernels side by side */
      char tag[128];
      snprintf(tag, sizeof tag, "%s-%s-T%d-R%d-%s-ln%d-sms%d-%s", s->name, fp8 ? "fp8" : "bf16", T,
               R, ffn_name(info.ffn_backend), info.gemm_lanes, info.gemm_sms, kVariantNames[v]);
      if (timeline(&c, v, rank, tag, o, stream)) return -1;
    }
  BENCH_EPX(epx_moe_prefill_destroy(c.plan));
  BENCH_EPX(epx_handle_destroy(c.hold_handle));
  BENCH_EPX(epx_handle_destroy(c.comm_handle));
  moe_free_experts(&c.ex);
  cudaFree(c.x), cudaFree(c.out), cudaFree(c.ids), cudaFree(c.w), cudaFree(c.ws);
  cudaFree(c.x8), cudaFree(c.xs);
  for (int i = 0; i < 3; i++) BENCH_EPX(epx_group_destroy(c.g[i]));
  return 0;
}

static int run_rank(int rank, int R, const ncclUniqueId *id, void *arg) {
  const options_t *o = (const options_t *)arg;
  bench_log_rank = rank;
  BENCH_CUDA(cudaSetDevice(rank));
  if (o->timeline) { /* CUPTI's first load and enable here, not just before a collective call */
    char why[BENCH_KTIME_REASON_LEN];
    if (bench_ktime_open(why, sizeof why) == 0 && bench_ktime_start(why, sizeof why) == 0)
      bench_ktime_stop(why, sizeof why);
  }
  ncclComm_t comm;
  if (ncclCommInitRank(&comm, R, *id, rank) != ncclSuccess) {
    bench_report_failure(__FILE__, __LINE__, "ncclCommInitRank", "failed");
    return -1;
  }
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  if (rank == 0) {
    printf(
        "# median and min of %d whole calls (us, events on rank 0), after %d warm-up, the "
        "variants %s, %s; rows = expert-major rows of rank 0\n",
        o->m.iters, o->m.warmup, o->sequential ? "one after another" : "interleaved",
        o->host_ahead ? "the host queueing ahead (no wait between calls)"
                      : "the host waiting for each call");
    printf("%-9s %-4s %5s %3s %-6s %2s %3s %-4s %6s", "shape", "dt", "T", "R", "ffn", "ln", "sms",
           "wire", "rows");
    for (int v = 0; v < NUM_VARIANTS; v++) printf(" %9s %9s", kVariantNames[v], "min");
    printf(" %8s %8s %8s %8s %8s\n", "lay/max", "chn/lay", "cub/gem", "pha/max", "chn/pha");
  }
  int rc = 0;
  for (int i = 0; i < o->m.num_shapes && !rc; i++)
    for (int j = 0; j < o->m.num_dtypes && !rc; j++)
      for (int k = 0; k < o->m.num_tokens && !rc; k++) {
        const moe_shape_t *s = &moe_shapes[o->m.shapes[i]];
        for (int q = 0; q < o->num_gemm_sms && !rc; q++) {
          const int sms = o->gemm_sms[q];
          for (int m = 0; m < o->num_lanes && !rc && o->grouped != 2; m++)
            rc = bench_point(comm, rank, R, s, o->m.fp8[j], o->m.tokens[k], o->lanes[m], sms,
                             EPX_MOE_FFN_CUBLAS, o, stream);
          if (!rc && o->grouped) /* one call per projection (auto lanes) */
            rc = bench_point(comm, rank, R, s, o->m.fp8[j], o->m.tokens[k], 0, sms,
                             o->m.fp8[j] ? EPX_MOE_FFN_EPX_GROUPED : EPX_MOE_FFN_CUBLAS_GROUPED, o,
                             stream);
        }
      }
  cudaStreamDestroy(stream);
  ncclCommDestroy(comm);
  return rc;
}

int main(int argc, char **argv) {
  setenv("NCCL_NVLS_ENABLE", "0", 1); /* NVLink multicast stays off */
  bench_program = "epx_moe_prefill_bench";
  options_t o = {{{4096}, 1, {0, 1}, 2, {0, 1}, 2, 10, 3, 0}, 0, {0}, 1, NULL, 0, {0}, 1, 0, 0};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    const int parsed = moe_parse_option(&o.m, argc, argv, &i, 65536);
    if (parsed < 0) return 2;
    if (parsed > 0) continue;
    if (!strcmp(a, "--chunks") && v) {
      o.chunks = atoi(v), i++;
    } else if (!strcmp(a, "--timeline") && v) {
      o.timeline = v, i++;
    } else if (!strcmp(a, "--grouped")) {
      o.grouped = 1;
    } else if (!strcmp(a, "--grouped-only")) {
      o.grouped = 2;
    } else if (!strcmp(a, "--sequential")) {
      o.sequential = 1;
    } else if (!strcmp(a, "--host-ahead")) {
      o.host_ahead = 1;
    } else if (!strcmp(a, "--gemm-sms") && v) {
      if (bench_parse_list(a, v, 0, 1024, MOE_MAX_LIST, o.gemm_sms, &o.num_gemm_sms)) return 2;
      i++;
    } else if (!strcmp(a, "--gemm-lanes") && v) {
      if (bench_parse_list(a, v, 0, 8, MOE_MAX_LIST, o.lanes, &o.num_lanes)) return 2;
      i++;
    } else {
      fprintf(stderr,
              "usage: %s [--tokens 4096] [--shape deepseek|qwen3] [--dtype bf16|fp8] "
              "[--iters N] [--ranks N] [--chunks N (0 = the plan's default)] "
              "[--gemm-lanes 1,4 (0 = the plan's default)] [--grouped | --grouped-only "
              "(only the grouped backends: no per-expert points)] [--gemm-sms N[,M] (0 = the "
              "plan's default)] "
              "[--timeline DIR] [--sequential (each variant's calls back to back, not "
              "interleaved)] [--host-ahead (no host wait between the timed calls: the host queues "
              "ahead of the GPU)]\n",
              argv[0]);
      return 2;
    }
  }
  if (o.m.iters < 1) return 2;
  if (o.timeline && mkdir(o.timeline, 0777) != 0 && errno != EEXIST) {
    fprintf(stderr, "%s: --timeline %s: %s\n", argv[0], o.timeline, strerror(errno));
    return 2;
  }
  return moe_bench_run("epx_moe_prefill_bench", o.m.ranks, run_rank, &o);
}

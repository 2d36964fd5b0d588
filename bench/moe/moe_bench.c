/*
 * moe_bench.c - epx_moe_bench: the MoE layer at decode (epx_moe_decode) against its parts, on
 * every visible GPU (a one-rank group on one GPU), docs/bench.md "MoE layer":
 *
 *   layer   epx_moe_decode
 *   chain   epx_ll_dispatch (packed) + epx_experts_ffn + epx_ll_combine, the same steps as a
 *           caller would chain them
 *   ffn     epx_experts_ffn alone, on the rows of an earlier dispatch of the same routing
 *   comm    epx_ll_dispatch (packed) + epx_ll_combine, no expert compute
 *
 * Each is captured once in a CUDA graph and replayed (warm-up, then --iters replays, each
 * between two events on rank 0's stream: whole-replay time, median and min). Every rank
 * replays the same graphs in the same order (the replays are collective). Shapes: DeepSeek-V3's
 * experts (H 7168, I 2048, 256 experts) and Qwen3-30B-A3B's (H 2048, I 768, 128 experts), top-8,
 * uniform routing; weights BF16, or FP8 with block scales and FP8 rows on the wire.
 * Values are random (device fills); nothing is checked here (tests/gpu/test_moe.c does that).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "common/ranks.h"
#include "epx.h"
#include "experts/bench_kernels.h"
#include "moe/moe_common.h"

typedef moe_options_t options_t;

/* The graph's replay time on stream: median and min over iters, after warmup replays. */
static int time_graph(cudaGraphExec_t exec, cudaStream_t stream, const options_t *o, float *median,
                      float *min) {
  float *ms = malloc(sizeof(float) * o->iters);
  cudaEvent_t a, b;
  BENCH_CUDA(cudaEventCreate(&a));
  BENCH_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < o->warmup; i++) BENCH_CUDA(cudaGraphLaunch(exec, stream));
  for (int i = 0; i < o->iters; i++) {
    BENCH_CUDA(cudaEventRecord(a, stream));
    BENCH_CUDA(cudaGraphLaunch(exec, stream));
    BENCH_CUDA(cudaEventRecord(b, stream));
    BENCH_CUDA(cudaEventSynchronize(b));
    BENCH_CUDA(cudaEventElapsedTime(&ms[i], a, b));
  }
  qsort(ms, o->iters, sizeof(float), moe_cmp_float);
  *median = ms[o->iters / 2] * 1000.f;
  *min = ms[0] * 1000.f;
  free(ms);
  cudaEventDestroy(a), cudaEventDestroy(b);
  return 0;
}

typedef struct {
  epx_group_t g;
  epx_experts_t ex;
  void *x, *ids, *w, *out, *ws;
  size_t ws_bytes;
  int T, fp8;
  epx_ll_dispatch_result_t held; /* the ffn variant's rows */
} bench_ctx_t;

enum { V_LAYER, V_CHAIN, V_FFN, V_COMM, NUM_VARIANTS };
static const char *const kVariantNames[NUM_VARIANTS] = {"layer", "chain", "ffn", "comm"};

static epx_ll_dispatch_args_t dispatch_args(const bench_ctx_t *c) {
  epx_ll_dispatch_args_t d = EPX_LL_DISPATCH_ARGS_INIT;
  d.x = c->x, d.topk_idx = c->ids, d.topk_weights = c->w, d.num_tokens = c->T;
  d.recv_dtype = c->fp8 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16;
  d.packed = 1;
  return d;
}

static epx_experts_ffn_args_t ffn_args(const bench_ctx_t *c, const epx_ll_dispatch_result_t *r) {
  epx_experts_ffn_args_t f = EPX_EXPERTS_FFN_ARGS_INIT;
  f.x = r->recv_x, f.x_dtype = c->fp8 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16;
  f.x_scales = r->recv_x_scales;
  f.num_rows = r->num_local_experts * r->rows_per_expert;
  f.expert_count = r->recv_count, f.rows_per_expert = r->rows_per_expert;
  f.out = r->combine_input, f.workspace = c->ws, f.workspace_bytes = c->ws_bytes;
  return f;
}

/* Queue one variant on stream (captured by the caller). */
static int queue_variant(bench_ctx_t *c, int v, cudaStream_t stream) {
  if (v == V_LAYER) {
    epx_moe_args_t a = EPX_MOE_ARGS_INIT;
    a.x = c->x, a.topk_idx = c->ids, a.topk_weights = c->w, a.num_tokens = c->T;
    a.dispatch_dtype = c->fp8 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16;
    a.out = c->out, a.workspace = c->ws, a.workspace_bytes = c->ws_bytes;
    BENCH_EPX(epx_moe_decode(c->g, &c->ex, &a, stream));
    return 0;
  }
  if (v == V_FFN) {
    const epx_experts_ffn_args_t f = ffn_args(c, &c->held);
    BENCH_EPX(epx_experts_ffn(&c->ex, &f, stream));
    return 0;
  }
  const epx_ll_dispatch_args_t d = dispatch_args(c);
  epx_ll_dispatch_result_t r;
  BENCH_EPX(epx_ll_dispatch(c->g, &d, &r, stream));
  if (v == V_CHAIN) {
    const epx_experts_ffn_args_t f = ffn_args(c, &r);
    BENCH_EPX(epx_experts_ffn(&c->ex, &f, stream));
  }
  epx_ll_combine_args_t ca = EPX_LL_COMBINE_ARGS_INIT;
  ca.dispatch = &r, ca.out = c->out;
  BENCH_EPX(epx_ll_combine(c->g, &ca, stream));
  return 0;
}

/* Every variant of one (shape, dtype, T) on this rank; rank 0 prints the row. */
static int bench_point(ncclComm_t comm, int rank, int R, const moe_shape_t *s, int fp8, int T,
                       const options_t *o, cudaStream_t stream) {
  bench_ctx_t c;
  memset(&c, 0, sizeof c);
  c.T = T, c.fp8 = fp8;
  epx_group_config_t cfg = EPX_GROUP_CONFIG_INIT;
  cfg.max_tokens_per_rank = T, cfg.hidden = s->hidden, cfg.num_experts = s->experts;
  cfg.top_k = MOE_TOP_K, cfg.modes = EPX_MODE_LOW_LATENCY;
  cfg.dtypes = EPX_DTYPE_BF16 | EPX_DTYPE_FP8_E4M3;
  BENCH_EPX(epx_group_create(comm, &cfg, &c.g));
  const int L = s->experts / R;
  if (moe_alloc_experts(s, L, fp8, 1000u + (uint64_t)rank, &c.ex)) return -1;
  int64_t *ids = malloc(sizeof(int64_t) * T * MOE_TOP_K);
  float *w = malloc(sizeof(float) * T * MOE_TOP_K);
  moe_route(ids, w, T, s->experts, 77u + (uint64_t)rank);
  BENCH_CUDA(cudaMalloc(&c.x, (size_t)T * s->hidden * 2 + 16));
  BENCH_CUDA(cudaMalloc(&c.out, (size_t)T * s->hidden * 2 + 16));
  BENCH_CUDA(cudaMalloc(&c.ids, sizeof(int64_t) * T * MOE_TOP_K + 16));
  BENCH_CUDA(cudaMalloc(&c.w, sizeof(float) * T * MOE_TOP_K + 16));
  BENCH_CUDA(bench_fill_bf16(c.x, (size_t)T * s->hidden, 1.f, 5u + (uint64_t)rank));
  BENCH_CUDA(cudaMemcpy(c.ids, ids, sizeof(int64_t) * T * MOE_TOP_K, cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(c.w, w, sizeof(float) * T * MOE_TOP_K, cudaMemcpyHostToDevice));
  free(ids), free(w);
  BENCH_EPX(
      epx_moe_workspace_size(c.g, &c.ex, fp8 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16, &c.ws_bytes));
  BENCH_CUDA(cudaMalloc(&c.ws, c.ws_bytes));
  /* The ffn variant's rows: a dispatch of the same routing (its counts are what matter). */
  const epx_ll_dispatch_args_t d = dispatch_args(&c);
  BENCH_EPX(epx_ll_dispatch(c.g, &d, &c.held, stream));
  epx_ll_combine_args_t ca = EPX_LL_COMBINE_ARGS_INIT;
  ca.dispatch = &c.held, ca.out = c.out;
  BENCH_EPX(epx_ll_combine(c.g, &ca, stream));
  BENCH_CUDA(cudaStreamSynchronize(stream));

  float med[NUM_VARIANTS], mn[NUM_VARIANTS];
  for (int v = 0; v < NUM_VARIANTS; v++) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    BENCH_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    if (queue_variant(&c, v, stream)) return -1;
    BENCH_CUDA(cudaStreamEndCapture(stream, &graph));
    BENCH_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    BENCH_EPX(epx_group_barrier(c.g, stream));
    if (time_graph(exec, stream, o, &med[v], &mn[v])) return -1;
    cudaGraphExecDestroy(exec), cudaGraphDestroy(graph);
  }
  epx_async_error_t err;
  BENCH_EPX(epx_group_get_async_error(c.g, &err));
  if (err.status != EPX_OK) {
    bench_report_failure(__FILE__, __LINE__, "epx_group_get_async_error", err.message);
    return -1;
  }
  if (rank == 0) {
    const float base = med[V_FFN] > med[V_COMM] ? med[V_FFN] : med[V_COMM];
    printf("%-9s %-4s %5d %3d", s->name, fp8 ? "fp8" : "bf16", T, R);
    for (int v = 0; v < NUM_VARIANTS; v++) printf(" %9.1f %9.1f", med[v], mn[v]);
    printf(" %8.3f %8.3f\n", med[V_LAYER] / base, med[V_CHAIN] / med[V_LAYER]);
    fflush(stdout);
  }
  moe_free_experts(&c.ex);
  cudaFree(c.x), cudaFree(c.out), cudaFree(c.ids), cudaFree(c.w), cudaFree(c.ws);
  BENCH_EPX(epx_group_destroy(c.g));
  return 0;
}

static int run_rank(int rank, int R, const ncclUniqueId *id, void *arg) {
  const options_t *o = (const options_t *)arg;
  bench_log_rank = rank;
  BENCH_CUDA(cudaSetDevice(rank));
  ncclComm_t comm;
  if (ncclCommInitRank(&comm, R, *id, rank) != ncclSuccess) {
    bench_report_failure(__FILE__, __LINE__, "ncclCommInitRank", "failed");
    return -1;
  }
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  if (rank == 0) {
    printf("# median and min of %d graph replays (us, events on rank 0), after %d warm-up\n",
           o->iters, o->warmup);
    printf("%-9s %-4s %5s %3s", "shape", "dt", "T", "R");
    for (int v = 0; v < NUM_VARIANTS; v++) printf(" %9s %9s", kVariantNames[v], "min");
    printf(" %8s %8s\n", "lay/max", "chn/lay");
  }
  int rc = 0;
  for (int i = 0; i < o->num_shapes && !rc; i++)
    for (int j = 0; j < o->num_dtypes && !rc; j++)
      for (int k = 0; k < o->num_tokens && !rc; k++)
        rc = bench_point(comm, rank, R, &moe_shapes[o->shapes[i]], o->fp8[j], o->tokens[k], o,
                         stream);
  cudaStreamDestroy(stream);
  ncclCommDestroy(comm);
  return rc;
}

int main(int argc, char **argv) {
  setenv("NCCL_NVLS_ENABLE", "0", 1); /* NVLink multicast stays off */
  bench_program = "epx_moe_bench";
  options_t o = {{128}, 1, {0, 1}, 2, {0, 1}, 2, 20, 3, 0};
  for (int i = 1; i < argc; i++) {
    const int parsed = moe_parse_option(&o, argc, argv, &i, 4096);
    if (parsed < 0) return 2;
    if (parsed == 0) {
      fprintf(stderr,
              "usage: %s [--tokens 1,8,128] [--shape deepseek|qwen3] [--dtype bf16|fp8] "
              "[--iters N] [--ranks N]\n",
              argv[0]);
      return 2;
    }
  }
  if (o.iters < 1) return 2;
  return moe_bench_run("epx_moe_bench", o.ranks, run_rank, &o);
}

/*
 * ll_rows.c - EPX's low-latency rows in epx_bench for one workload (its token count): one group
 * per route (DIRECT, BY_RANK, and "mixed" = DISPATCH_BY_RANK: combine rows only, its dispatch
 * is BY_RANK's), each with config.ll_num_sms = auto (every SM of the GPU).
 *
 * Rows (docs/bench.md), each named "<op> <route>":
 *   ll dispatch fp8         epx_ll_dispatch: FP8 quantized on the fly, per-128 scales; one kernel
 *   ll dispatch bf16        the same with BF16 rows
 *   ll combine              epx_ll_combine of the BF16 dispatch's rows read in place (x = recv_x)
 *   ll dispatch send fp8    split mode: the send call alone ...
 *   ll dispatch recv fp8    ... and epx_ll_recv, queued after ~50 us of other GPU work, alone
 *   ll combine send / recv  the same for combine
 *   ... packed              the same with args.packed = 1 (DeepEP's packed layout; BY_RANK
 *                           dispatch only): "ll dispatch fp8 packed", "ll dispatch send packed"
 *                           / "recv packed" (FP8), "ll combine packed" (+ send / recv) of a
 *                           packed BF16 dispatch; by-rank and mixed groups
 * Bytes per rank as DeepEP counts them (every (token, expert) copy, the own rank's included):
 *   dispatch: the rows this rank receives (sum of recv_count) x (FP8: H + H/128 x 4; BF16: 2H)
 *   combine:  this rank's (token, expert) pairs x 2H
 * Checked: combine (weights 1 on each token's first slot, 0 on the others, so out[t] must be
 * x[t] bit for bit whatever the route sums first); dispatch rows are checked by the tests.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"

#define SPLIT_GAP_NS 50000 /* GPU work between the two halves of a split call */

typedef struct {
  bench_rank_t *b;
  epx_group_t group;
  bench_workload_t *w;
  const float *weights; /* device [T, K]: 1 on slot 0, 0 elsewhere */
  epx_dtype_t dtype;
  epx_ll_dispatch_result_t result; /* of the latest dispatch */
  void *out;                       /* device [T, H] BF16 */
  int packed;                      /* dispatch with args.packed */
} ll_op_t;

static int dispatch_call(ll_op_t *op, int split, cudaStream_t stream) {
  epx_ll_dispatch_args_t a = EPX_LL_DISPATCH_ARGS_INIT;
  a.x = op->w->x;
  a.topk_idx = op->w->topk_idx;
  a.topk_weights = op->weights;
  a.num_tokens = op->w->num_tokens;
  a.recv_dtype = op->dtype;
  a.split = split;
  a.packed = op->packed;
  BENCH_EPX(epx_ll_dispatch(op->group, &a, &op->result, stream));
  return 0;
}

static int combine_call(ll_op_t *op, int split, epx_ll_hook_t *hook, cudaStream_t stream) {
  epx_ll_combine_args_t c = EPX_LL_COMBINE_ARGS_INIT;
  c.x = op->result.recv_x;
  c.dispatch = &op->result;
  c.out = op->out;
  c.split = split;
  c.hook = hook;
  BENCH_EPX(epx_ll_combine(op->group, &c, stream));
  return 0;
}

static int dispatch_iter(void *arg, cudaStream_t stream) {
  return dispatch_call((ll_op_t *)arg, 0, stream);
}

static int combine_iter(void *arg, cudaStream_t stream) {
  return combine_call((ll_op_t *)arg, 0, NULL, stream);
}

/* bench_time checks the bench's own group; low-latency errors are recorded in op->group. */
static int check_errors(ll_op_t *op) {
  epx_async_error_t err;
  BENCH_CUDA(cudaStreamSynchronize(op->b->stream));
  BENCH_EPX(epx_group_get_async_error(op->group, &err));
  if (err.status == EPX_OK) return 0;
  bench_report_failure(__FILE__, __LINE__, "epx_group_get_async_error", err.message);
  return -1;
}

/* One pass of split calls: `warmup` untimed iterations, then n, each a device barrier, the send
 * (ev[4i], ev[4i + 1]), ~50 us of other GPU work, the receive (ev[4i + 2], ev[4i + 3]); us[i]
 * and us[n + i] are iteration i's send and receive times. profile: the send of iteration i is
 * bracketed as call i of kernel-time series 0, its receive as call i of series 1 (the gap's
 * spin kernel is in neither). */
static int split_pass(ll_op_t *op, int combine, int warmup, int n, int profile, cudaEvent_t *ev,
                      double *us) {
  bench_rank_t *b = op->b;
  int rc = 0;
  for (int i = 0; rc == 0 && i < warmup + n; i++) {
    const int timed = i >= warmup, t = i - warmup;
    cudaEvent_t *e = ev + 4 * t;
    epx_ll_hook_t hook = {0};
    epx_ll_hook_t *h = combine ? &hook : &op->result.hook;
    rc = epx_group_barrier(op->group, b->stream) == EPX_OK ? 0 : -1;
    if (rc == 0 && timed) rc = cudaEventRecord(e[0], b->stream) == cudaSuccess ? 0 : -1;
    const int send_bracket = rc == 0 && timed && profile;
    if (send_bracket) bench_ktime_call_begin(bench_kernel_call_id(0, t, n));
    if (rc == 0)
      rc = combine ? combine_call(op, 1, &hook, b->stream) : dispatch_call(op, 1, b->stream);
    if (send_bracket) bench_ktime_call_end();
    if (rc == 0 && timed) rc = cudaEventRecord(e[1], b->stream) == cudaSuccess ? 0 : -1;
    if (rc == 0) rc = bench_spin_launch(SPLIT_GAP_NS, b->stream) == cudaSuccess ? 0 : -1;
    if (rc == 0 && timed) rc = cudaEventRecord(e[2], b->stream) == cudaSuccess ? 0 : -1;
    const int recv_bracket = rc == 0 && timed && profile;
    if (recv_bracket) bench_ktime_call_begin(bench_kernel_call_id(1, t, n));
    if (rc == 0) rc = epx_ll_recv(op->group, h, b->stream) == EPX_OK ? 0 : -1;
    if (recv_bracket) bench_ktime_call_end();
    if (rc == 0 && timed) rc = cudaEventRecord(e[3], b->stream) == cudaSuccess ? 0 : -1;
    if (rc) bench_report_failure(__FILE__, __LINE__, "split iteration", epx_last_error());
  }
  if (rc == 0 && cudaStreamSynchronize(b->stream) != cudaSuccess) {
    bench_report_failure(__FILE__, __LINE__, "cudaStreamSynchronize", "failed");
    rc = -1;
  }
  for (int i = 0; rc == 0 && i < n; i++) {
    float a = 0, c = 0;
    if (cudaEventElapsedTime(&a, ev[4 * i], ev[4 * i + 1]) != cudaSuccess ||
        cudaEventElapsedTime(&c, ev[4 * i + 2], ev[4 * i + 3]) != cudaSuccess) {
      bench_report_failure(__FILE__, __LINE__, "cudaEventElapsedTime", "failed");
      rc = -1;
    }
    us[i] = a * 1e3;
    us[n + i] = c * 1e3;
  }
  return rc;
}

/* Split calls: the timed pass, then (kernel time on, every rank alike: the calls are
 * collective) the profiled pass, into send and recv. */
static int time_split(ll_op_t *op, int combine, bench_stats_t *send, bench_stats_t *recv) {
  bench_rank_t *b = op->b;
  const int n = b->opt->iters, k = b->opt->kernel_iters, m = n > k ? n : k;
  cudaEvent_t *ev = (cudaEvent_t *)calloc(4 * (size_t)m, sizeof *ev);
  double *us = (double *)calloc(2 * (size_t)m, sizeof *us);
  int rc = ev && us ? 0 : -1, created = 0;
  if (rc) bench_report_failure(__FILE__, __LINE__, "calloc", "out of host memory");
  for (; rc == 0 && created < 4 * m; created++) {
    const cudaError_t e = cudaEventCreate(&ev[created]);
    if (e != cudaSuccess) {
      bench_report_failure(__FILE__, __LINE__, "cudaEventCreate", cudaGetErrorString(e));
      rc = -1;
      break;
    }
  }
  if (rc == 0) rc = split_pass(op, combine, b->opt->warmup, n, 0, ev, us);
  if (rc == 0) {
    *send = bench_summarize(us, n);
    *recv = bench_summarize(us + n, n);
  }
  if (rc == 0 && b->ktime_pass) {
    bench_ktime_summary_t kt[2] = {bench_ktime_none(), bench_ktime_none()};
    const int recording = bench_kernel_pass_start(b);
    rc = split_pass(op, combine, 0, k, recording, ev, us);
    if (rc == 0 && recording) rc = bench_kernel_pass_finish(b, k, 2, kt);
    if (rc == 0 && kt[0].num_calls) kt[0].event_us = bench_summarize(us, k).median_us;
    if (rc == 0 && kt[1].num_calls) kt[1].event_us = bench_summarize(us + k, k).median_us;
    if (rc == 0) send->kt = kt[0], recv->kt = kt[1];
  }
  for (int i = 0; i < created; i++) {
    const cudaError_t e = cudaEventDestroy(ev[i]);
    if (e != cudaSuccess && rc == 0) {
      bench_report_failure(__FILE__, __LINE__, "cudaEventDestroy", cudaGetErrorString(e));
      rc = -1;
    }
  }
  free(ev);
  free(us);
  return rc == 0 ? check_errors(op) : rc;
}

/* Rows this rank received in op->result (sum of the device recv_count). */
static int received_rows(ll_op_t *op, long long *rows) {
  const int L = op->result.num_local_experts;
  int *count = (int *)malloc(sizeof(int) * (size_t)L);
  if (!count) return -1;
  BENCH_CUDA(cudaStreamSynchronize(op->b->stream));
  BENCH_CUDA(cudaMemcpy(count, op->result.recv_count, sizeof(int) * L, cudaMemcpyDeviceToHost));
  *rows = 0;
  for (int j = 0; j < L; j++) *rows += count[j];
  free(count);
  return check_errors(op);
}

/* The row's name: "<op> <route>". */
static void row_name(const char *op_name, const char *route, char *name, size_t len) {
  snprintf(name, len, "%s %s", op_name, route);
}

/* --trace: one traced iteration of an op timed by bench_time (split rows are not traced). */
static int trace(ll_op_t *op, const char *op_name, const char *route, int sms, bench_iter_fn fn,
                 const bench_stats_t *st) {
  char name[32];
  row_name(op_name, route, name, sizeof name);
  return bench_trace_row(op->b, op->group, name, fn, op, op->w->num_tokens, sms, st);
}

static int emit(ll_op_t *op, const char *op_name, const char *route, int sms,
                const bench_stats_t *st, double bytes, long long wrong) {
  char name[32];
  row_name(op_name, route, name, sizeof name);
  bench_row_t row = bench_workload_row(op->b, name, op->w->num_tokens);
  row.sms = sms;
  BENCH_TRY(bench_finish_row(op->b, st, wrong, bytes, &row));
  row.ratio_ceiling = row.gbps / bench_table_best_ceiling(&op->b->table);
  return bench_emit_row(op->b, &row);
}

/* The combine rows of op's latest BF16 dispatch ("<combine_name>", its split halves
 * "<combine_name> send/recv" or "<split_name> send/recv"), checked. */
static int combine_rows(ll_op_t *op, const char *rname, int sms, const char *combine_name,
                        const char *send_name, const char *recv_name, const int *ones) {
  bench_rank_t *b = op->b;
  const bench_options_t *opt = b->opt;
  const int H = opt->hidden;
  const double pairs = (double)op->w->num_tokens * opt->top_k; /* distinct, all valid */
  bench_stats_t st, st2;
  BENCH_CUDA(cudaMemsetAsync(op->out, 0xff, (size_t)op->w->max_tokens * H * 2, b->stream));
  BENCH_TRY(bench_time(b, combine_iter, op, &st));
  BENCH_TRY(trace(op, combine_name, rname, sms, combine_iter, &st)); /* before the check */
  BENCH_CUDA(cudaMemsetAsync(op->w->wrong_dev, 0, sizeof *op->w->wrong_dev, b->stream));
  BENCH_CUDA(bench_check_scaled_launch(op->out, ones, op->w->num_tokens, H, opt->seed, b->rank,
                                       op->w->wrong_dev, b->stream));
  unsigned long long count = 0;
  BENCH_CUDA(
      cudaMemcpyAsync(&count, op->w->wrong_dev, sizeof count, cudaMemcpyDeviceToHost, b->stream));
  BENCH_CUDA(cudaStreamSynchronize(b->stream));
  BENCH_TRY(emit(op, combine_name, rname, sms, &st, pairs * 2.0 * H, (long long)count));
  BENCH_TRY(time_split(op, 1, &st, &st2));
  BENCH_TRY(emit(op, send_name, rname, sms, &st, pairs * 2.0 * H, -1));
  BENCH_TRY(emit(op, recv_name, rname, sms, &st2, pairs * 2.0 * H, -1));
  return 0;
}

/* The packed rows of a BY_RANK or mixed group: FP8 dispatch (by-rank only: mixed runs the same
 * dispatch kernel) and the combine of a packed BF16 dispatch. */
static int packed_rows(ll_op_t *op, int route, const char *rname, int sms, const int *ones) {
  const double fp8_row = (double)op->b->opt->hidden + (double)(op->b->opt->hidden / 128) * 4;
  bench_stats_t st, st2;
  long long rows = 0;
  op->packed = 1;
  if (route == EPX_LL_ROUTE_BY_RANK) {
    op->dtype = EPX_DTYPE_FP8_E4M3;
    BENCH_TRY(bench_time(op->b, dispatch_iter, op, &st));
    BENCH_TRY(trace(op, "ll dispatch fp8 packed", rname, sms, dispatch_iter, &st));
    BENCH_TRY(received_rows(op, &rows));
    BENCH_TRY(emit(op, "ll dispatch fp8 packed", rname, sms, &st, rows * fp8_row, -1));
    BENCH_TRY(time_split(op, 0, &st, &st2));
    BENCH_TRY(emit(op, "ll dispatch send packed", rname, sms, &st, rows * fp8_row, -1));
    BENCH_TRY(emit(op, "ll dispatch recv packed", rname, sms, &st2, rows * fp8_row, -1));
  }
  op->dtype = EPX_DTYPE_BF16;
  BENCH_TRY(dispatch_iter(op, op->b->stream)); /* the packed rows its combine returns */
  BENCH_TRY(check_errors(op));
  BENCH_TRY(combine_rows(op, rname, sms, "ll combine packed", "ll combine send packed",
                         "ll combine recv packed", ones));
  op->packed = 0;
  return 0;
}

/* Every row of one route. */
static int route_rows(bench_rank_t *b, bench_workload_t *w, int route, const float *weights,
                      void *out, const int *ones) {
  const bench_options_t *opt = b->opt;
  const int H = opt->hidden;
  const double fp8_row = (double)H + (double)(H / 128) * 4, bf16_row = 2.0 * H;
  const char *rname = route == EPX_LL_ROUTE_DIRECT    ? "direct"
                      : route == EPX_LL_ROUTE_BY_RANK ? "by-rank"
                                                      : "mixed";
  int max_tokens = 0;
  for (int i = 0; i < opt->num_ll_tokens; i++)
    if (opt->ll_tokens[i] > max_tokens) max_tokens = opt->ll_tokens[i];
  epx_group_config_t cfg = bench_group_config(opt);
  cfg.max_tokens_per_rank = max_tokens;
  cfg.modes = EPX_MODE_LOW_LATENCY;
  cfg.ll_route = route;
  ll_op_t op;
  memset(&op, 0, sizeof op);
  op.b = b;
  op.w = w;
  op.weights = weights;
  op.out = out;
  BENCH_EPX(epx_group_create(b->comm, &cfg, &op.group));
  epx_group_config_t got;
  BENCH_EPX(epx_group_get_config(op.group, &got));
  const int sms = got.ll_num_sms;
  bench_stats_t st, st2;
  long long rows = 0;

  /* The mixed route's dispatch is BY_RANK's kernel: its rows would repeat the by-rank ones. */
  if (route != EPX_LL_ROUTE_DISPATCH_BY_RANK) {
    op.dtype = EPX_DTYPE_FP8_E4M3;
    BENCH_TRY(bench_time(b, dispatch_iter, &op, &st));
    BENCH_TRY(trace(&op, "ll dispatch fp8", rname, sms, dispatch_iter, &st));
    BENCH_TRY(received_rows(&op, &rows));
    BENCH_TRY(emit(&op, "ll dispatch fp8", rname, sms, &st, rows * fp8_row, -1));
    BENCH_TRY(time_split(&op, 0, &st, &st2));
    BENCH_TRY(emit(&op, "ll dispatch send fp8", rname, sms, &st, rows * fp8_row, -1));
    BENCH_TRY(emit(&op, "ll dispatch recv fp8", rname, sms, &st2, rows * fp8_row, -1));
  }

  op.dtype = EPX_DTYPE_BF16;
  if (route != EPX_LL_ROUTE_DISPATCH_BY_RANK) {
    BENCH_TRY(bench_time(b, dispatch_iter, &op, &st));
    BENCH_TRY(trace(&op, "ll dispatch bf16", rname, sms, dispatch_iter, &st));
    BENCH_TRY(received_rows(&op, &rows));
    BENCH_TRY(emit(&op, "ll dispatch bf16", rname, sms, &st, rows * bf16_row, -1));
  } else {
    BENCH_TRY(dispatch_iter(&op, b->stream)); /* the rows its combine returns */
    BENCH_TRY(check_errors(&op));
  }

  /* Combine the latest BF16 dispatch, its rows read in place. */
  BENCH_TRY(
      combine_rows(&op, rname, sms, "ll combine", "ll combine send", "ll combine recv", ones));
  if (route != EPX_LL_ROUTE_DIRECT) BENCH_TRY(packed_rows(&op, route, rname, sms, ones));

  BENCH_CUDA(cudaStreamSynchronize(b->stream));
  BENCH_EPX(epx_group_destroy(op.group));
  return 0;
}

int bench_ll_rows(bench_rank_t *b, bench_workload_t *w) {
  const bench_options_t *opt = b->opt;
  const int T = w->num_tokens, K = opt->top_k, H = opt->hidden;
  float *weights_host = (float *)calloc((size_t)T * K + 1, sizeof(float));
  int *ones_host = (int *)malloc(sizeof(int) * ((size_t)T + 1));
  if (!weights_host || !ones_host) {
    free(weights_host);
    free(ones_host);
    bench_report_failure(__FILE__, __LINE__, "calloc", "out of host memory");
    return -1;
  }
  for (int t = 0; t < T; t++) weights_host[(size_t)t * K] = 1.0f, ones_host[t] = 1;
  float *weights = NULL;
  int *ones = NULL;
  void *out = NULL;
  BENCH_CUDA(cudaMalloc((void **)&weights, ((size_t)T * K + 1) * sizeof(float)));
  BENCH_CUDA(cudaMalloc((void **)&ones, ((size_t)T + 1) * sizeof(int)));
  BENCH_CUDA(cudaMalloc(&out, ((size_t)w->max_tokens + 1) * H * 2));
  BENCH_CUDA(cudaMemcpyAsync(weights, weights_host, (size_t)T * K * sizeof(float),
                             cudaMemcpyHostToDevice, b->stream));
  BENCH_CUDA(
      cudaMemcpyAsync(ones, ones_host, (size_t)T * sizeof(int), cudaMemcpyHostToDevice, b->stream));
  BENCH_CUDA(cudaStreamSynchronize(b->stream));
  free(weights_host);
  free(ones_host);
  for (int route = EPX_LL_ROUTE_DIRECT; route <= EPX_LL_ROUTE_DISPATCH_BY_RANK; route++)
    BENCH_TRY(route_rows(b, w, route, weights, out, ones));
  BENCH_CUDA(cudaFree(weights));
  BENCH_CUDA(cudaFree(ones));
  BENCH_CUDA(cudaFree(out));
  return 0;
}

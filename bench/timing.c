/*
 * timing.c - how epx_bench times an operation and turns per-rank times into one row.
 *
 * Each iteration is: epx_group_barrier (a device barrier, so every rank starts together),
 * start event, the operation, stop event; all on the rank's stream. Warmup iterations run the
 * same way untimed. A rank's figure is the median of its iterations; a row reports the MAX
 * over ranks of those medians (the collective is as slow as its slowest rank), plus the
 * smallest and largest single iteration seen on any rank.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"

static int compare_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

bench_stats_t bench_summarize(double *us, int n) {
  qsort(us, (size_t)n, sizeof *us, compare_double);
  bench_stats_t s;
  s.median_us = n % 2 ? us[n / 2] : 0.5 * (us[n / 2 - 1] + us[n / 2]);
  s.min_us = us[0];
  s.max_us = us[n - 1];
  const int k = (99 * n + 99) / 100; /* ceil(0.99 n), 1..n */
  s.p99_us = us[k - 1];
  return s;
}

/* Fail if a kernel of the group recorded an async error (e.g. a barrier that timed out).
 * The caller has synchronized the stream. */
static int check_async_error(bench_rank_t *b) {
  epx_async_error_t err;
  BENCH_EPX(epx_group_get_async_error(b->group, &err));
  if (err.status == EPX_OK) return 0;
  bench_report_failure(__FILE__, __LINE__, "epx_group_get_async_error", err.message);
  return -1;
}

/* The timed loop proper, with events already created: ev[2i] and ev[2i + 1] bound iteration i. */
static int timed_loop(bench_rank_t *b, bench_iter_fn fn, void *arg, cudaEvent_t *ev, double *us) {
  const int n = b->opt->iters;
  for (int i = 0; i < b->opt->warmup; i++) {
    BENCH_EPX(epx_group_barrier(b->group, b->stream));
    BENCH_TRY(fn(arg, b->stream));
  }
  double host_ns = 0;
  for (int i = 0; i < n; i++) {
    BENCH_EPX(epx_group_barrier(b->group, b->stream));
    BENCH_CUDA(cudaEventRecord(ev[2 * i], b->stream));
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    BENCH_TRY(fn(arg, b->stream));
    clock_gettime(CLOCK_MONOTONIC, &t1);
    host_ns += (t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec);
    BENCH_CUDA(cudaEventRecord(ev[2 * i + 1], b->stream));
  }
  if (getenv("EPX_BENCH_HOST_US") && b->rank == 0)
    printf("# host: %.2f us per call (rank 0, mean of %d)\n", host_ns / n / 1e3, n);
  BENCH_CUDA(cudaStreamSynchronize(b->stream));
  BENCH_TRY(check_async_error(b));
  for (int i = 0; i < n; i++) {
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
    us[i] = ms * 1e3;
  }
  return 0;
}

int bench_time(bench_rank_t *b, bench_iter_fn fn, void *arg, bench_stats_t *stats) {
  const int n = b->opt->iters;
  cudaEvent_t *ev = (cudaEvent_t *)calloc(2 * (size_t)n, sizeof *ev);
  double *us = (double *)calloc((size_t)n, sizeof *us);
  int rc = ev && us ? 0 : -1, created = 0;
  if (rc) bench_report_failure(__FILE__, __LINE__, "calloc", "out of host memory");
  for (; rc == 0 && created < 2 * n; created++) {
    cudaError_t e = cudaEventCreate(&ev[created]);
    if (e != cudaSuccess) {
      bench_report_failure(__FILE__, __LINE__, "cudaEventCreate", cudaGetErrorString(e));
      rc = -1;
      break;
    }
  }
  if (rc == 0) rc = timed_loop(b, fn, arg, ev, us);
  if (rc == 0) *stats = bench_summarize(us, n);
  for (int i = 0; i < created; i++) {
    cudaError_t e = cudaEventDestroy(ev[i]);
    if (e != cudaSuccess && rc == 0) {
      bench_report_failure(__FILE__, __LINE__, "cudaEventDestroy", cudaGetErrorString(e));
      rc = -1;
    }
  }
  free(ev);
  free(us);
  return rc;
}

int bench_trace_iteration(bench_rank_t *b, epx_group_t group, bench_iter_fn fn, void *arg,
                          const char *path, double *us, epx_trace_summary_t *summary) {
  cudaEvent_t ev[2] = {NULL, NULL};
  BENCH_CUDA(cudaEventCreate(&ev[0]));
  BENCH_CUDA(cudaEventCreate(&ev[1]));
  BENCH_EPX(epx_trace_start(group, 0, b->stream));
  BENCH_EPX(epx_group_barrier(group, b->stream)); /* traced too: shows how aligned ranks start */
  BENCH_CUDA(cudaEventRecord(ev[0], b->stream));
  BENCH_TRY(fn(arg, b->stream));
  BENCH_CUDA(cudaEventRecord(ev[1], b->stream));
  BENCH_EPX(epx_trace_dump(group, path, summary, b->stream)); /* synchronizes the stream */
  float ms = 0;
  BENCH_CUDA(cudaEventElapsedTime(&ms, ev[0], ev[1]));
  *us = ms * 1e3;
  BENCH_CUDA(cudaEventDestroy(ev[0]));
  BENCH_CUDA(cudaEventDestroy(ev[1]));
  epx_async_error_t err; /* the traced group's own kernels, then the bench group's */
  BENCH_EPX(epx_group_get_async_error(group, &err));
  if (err.status != EPX_OK) {
    bench_report_failure(__FILE__, __LINE__, "epx_group_get_async_error", err.message);
    return -1;
  }
  return check_async_error(b);
}

/* --trace: FILE with "-<op>-<T>t-<S>sms" before its extension, op without "epx " and with
 * '_' for spaces: out/t.json -> out/t-dispatch_bf16-4096t-24sms.json. */
static void trace_file(const char *base, const char *op, int tokens, int sms, char *out,
                       size_t len) {
  char slug[48];
  snprintf(slug, sizeof slug, "%s", strncmp(op, "epx ", 4) ? op : op + 4);
  for (char *c = slug; *c; c++)
    if (*c == ' ') *c = '_';
  const char *dot = strrchr(base, '.'), *slash = strrchr(base, '/');
  if (!dot || (slash && dot < slash)) dot = base + strlen(base);
  snprintf(out, len, "%.*s-%s-%dt-%dsms%s", (int)(dot - base), base, slug, tokens, sms, dot);
}

int bench_trace_row(bench_rank_t *b, epx_group_t group, const char *name, bench_iter_fn fn,
                    void *arg, int tokens, int sms, const bench_stats_t *st) {
  const bench_options_t *opt = b->opt;
  if (!opt->trace_path || (opt->trace_op && !strstr(name, opt->trace_op))) return 0;
  char path[1024];
  trace_file(opt->trace_path, name, tokens, sms, path, sizeof path);
  double us = 0;
  epx_trace_summary_t sum;
  BENCH_TRY(bench_trace_iteration(b, group, fn, arg, path, &us, &sum));
  if (b->rank == 0)
    printf(
        "# trace %s: %lld events (%lld dropped); traced iteration %.1f us, untraced median "
        "%.1f us (rank 0); clock spread %lld ns, timer step %lld ns\n",
        path, sum.num_events, sum.num_dropped, us, st->median_us, sum.clock_spread_ns,
        sum.timer_tick_ns);
  return 0;
}

/* all[q * BENCH_GATHER_FIELDS + f] = field f of rank q, through b->gather_dev. */
static int gather(bench_rank_t *b, const double *mine, double *all) {
  const size_t one = BENCH_GATHER_FIELDS * sizeof(double);
  double *send = b->gather_dev + (size_t)b->num_ranks * BENCH_GATHER_FIELDS;
  BENCH_CUDA(cudaMemcpyAsync(send, mine, one, cudaMemcpyHostToDevice, b->stream));
  BENCH_NCCL(
      ncclAllGather(send, b->gather_dev, BENCH_GATHER_FIELDS, ncclFloat64, b->comm, b->stream));
  BENCH_CUDA(
      cudaMemcpyAsync(all, b->gather_dev, one * b->num_ranks, cudaMemcpyDeviceToHost, b->stream));
  BENCH_CUDA(cudaStreamSynchronize(b->stream));
  return 0;
}

int bench_finish_row(bench_rank_t *b, const bench_stats_t *stats, long long wrong, double bytes,
                     bench_row_t *row) {
  enum { MEDIAN, MIN, MAX, WRONG, BYTES, P99 };
  const double mine[BENCH_GATHER_FIELDS] = {stats->median_us, stats->min_us, stats->max_us,
                                            (double)wrong,    bytes,         stats->p99_us};
  double all[EPX_MAX_RANKS * BENCH_GATHER_FIELDS];
  BENCH_TRY(gather(b, mine, all));
  row->median_us = row->max_us = row->p99_us = 0;
  row->min_us = INFINITY;
  row->bytes = 0;
  row->wrong = 0;
  for (int q = 0; q < b->num_ranks; q++) {
    const double *f = &all[q * BENCH_GATHER_FIELDS];
    row->median_us = fmax(row->median_us, f[MEDIAN]);
    row->p99_us = fmax(row->p99_us, f[P99]);
    row->min_us = fmin(row->min_us, f[MIN]);
    row->max_us = fmax(row->max_us, f[MAX]);
    row->bytes += f[BYTES] / b->num_ranks;
    /* one rank that did not check makes the row unchecked */
    if (row->wrong >= 0) row->wrong = f[WRONG] < 0 ? -1 : row->wrong + (long long)f[WRONG];
  }
  /* bytes / (us * 1e-6) / 1e9 */
  row->gbps = row->bytes / row->median_us * 1e-3;
  return 0;
}

int bench_emit_row(bench_rank_t *b, const bench_row_t *row) {
  if (b->rank == 0) bench_print_row(stdout, row);
  return bench_table_add(&b->table, row);
}

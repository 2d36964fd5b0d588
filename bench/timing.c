/*
 * timing.c - how epx_bench times an operation and turns per-rank times into one row.
 *
 * Each iteration is: epx_group_barrier (a device barrier, so every rank starts together),
 * start event, the operation, stop event; all on the rank's stream. Warmup iterations run the
 * same way untimed. A rank's figure is the median of its iterations; a row reports the MAX
 * over ranks of those medians (the collective is as slow as its slowest rank), plus the
 * smallest and largest single iteration seen on any rank.
 *
 * Kernel time (ktime.h) comes from a pass of its own after the timed iterations: the same
 * iterations with CUPTI recording and each call bracketed, so recording never touches the event
 * times. A rank's figures are the mean and median over its profiled calls of the call's summed
 * kernel durations; a row reports the MAX over ranks of each, like the event time. CUPTI never
 * fails a run: its first failure is printed once by rank 0 and kernel time stays off after it.
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
  s.kt = bench_ktime_none();
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

/* Kernel time is off from now on; rank 0 says why, once (later passes do not start). */
static void ktime_fail(bench_rank_t *b, const char *why) {
  if (b->ktime_ok && b->rank == 0) printf("# kernel time: unavailable (%s)\n", why);
  b->ktime_ok = 0;
}

int bench_kernel_pass_start(bench_rank_t *b) {
  if (!b->ktime_pass || !b->ktime_ok) return 0;
  char why[BENCH_KTIME_REASON_LEN];
  if (bench_ktime_start(why, sizeof why) == 0) return 1;
  ktime_fail(b, why);
  return 0;
}

uint64_t bench_kernel_call_id(int series, int call, int calls_per_series) {
  return 1 + (uint64_t)series * (uint64_t)calls_per_series + (uint64_t)call; /* 0: no call */
}

int bench_kernel_pass_finish(bench_rank_t *b, int calls_per_series, int num_series,
                             bench_ktime_summary_t *out) {
  for (int s = 0; s < num_series; s++) out[s] = bench_ktime_none();
  /* NOTE: CUPTI's flush hands back only completed records: every launch of the pass, on any
   * stream, must have finished. */
  BENCH_CUDA(cudaDeviceSynchronize());
  char why[BENCH_KTIME_REASON_LEN];
  if (bench_ktime_stop(why, sizeof why)) {
    ktime_fail(b, why);
    return 0;
  }
  for (int s = 0; s < num_series; s++)
    if (bench_ktime_summarize(bench_kernel_call_id(s, 0, calls_per_series), calls_per_series,
                              &out[s])) {
      ktime_fail(b, "out of host memory");
      for (int t = 0; t < num_series; t++) out[t] = bench_ktime_none();
      return 0;
    }
  return 0;
}

/* n iterations after `warmup` untimed ones: ev[2i] and ev[2i + 1] bound iteration i, us[i] its
 * time. profiled: the kernel-time pass, whose calls are bracketed as first_id + i when
 * first_id > 0 (this rank records) and whose host time is not printed (EPX_BENCH_HOST_US is
 * the timed pass's). */
static int run_loop(bench_rank_t *b, bench_iter_fn fn, void *arg, int warmup, int n, int profiled,
                    uint64_t first_id, cudaEvent_t *ev, double *us) {
  for (int i = 0; i < warmup; i++) {
    BENCH_EPX(epx_group_barrier(b->group, b->stream));
    BENCH_TRY(fn(arg, b->stream));
  }
  double host_ns = 0;
  for (int i = 0; i < n; i++) {
    BENCH_EPX(epx_group_barrier(b->group, b->stream));
    BENCH_CUDA(cudaEventRecord(ev[2 * i], b->stream));
    struct timespec t0, t1;
    if (first_id) bench_ktime_call_begin(first_id + (uint64_t)i);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    const int rc = fn(arg, b->stream);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (first_id) bench_ktime_call_end();
    BENCH_TRY(rc);
    host_ns += (t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec);
    BENCH_CUDA(cudaEventRecord(ev[2 * i + 1], b->stream));
  }
  if (!profiled && getenv("EPX_BENCH_HOST_US") && b->rank == 0)
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

/* The timed iterations, then the profiled ones when kernel time is on (on every rank alike:
 * the calls are collective, even where this rank's CUPTI failed and nothing is recorded). */
static int timed_loop(bench_rank_t *b, bench_iter_fn fn, void *arg, cudaEvent_t *ev, double *us,
                      bench_stats_t *stats) {
  const int n = b->opt->iters, k = b->opt->kernel_iters;
  BENCH_TRY(run_loop(b, fn, arg, b->opt->warmup, n, 0, 0, ev, us));
  *stats = bench_summarize(us, n);
  if (!b->ktime_pass) return 0;
  const int recording = bench_kernel_pass_start(b);
  const uint64_t first_id = recording ? bench_kernel_call_id(0, 0, k) : 0;
  BENCH_TRY(run_loop(b, fn, arg, 0, k, 1, first_id, ev, us));
  if (!recording) return 0;
  BENCH_TRY(bench_kernel_pass_finish(b, k, 1, &stats->kt));
  if (stats->kt.num_calls) stats->kt.event_us = bench_summarize(us, k).median_us;
  return 0;
}

int bench_time(bench_rank_t *b, bench_iter_fn fn, void *arg, bench_stats_t *stats) {
  /* events and times for the longer of the two passes */
  const int n = b->opt->iters > b->opt->kernel_iters ? b->opt->iters : b->opt->kernel_iters;
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
  if (rc == 0) rc = timed_loop(b, fn, arg, ev, us, stats);
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

int bench_kernel_agree(bench_rank_t *b, const char *why) {
  b->ktime_pass = 0;
  if (b->opt->kernel_iters <= 0) return 0; /* the same flags on every rank: nothing to agree */
  double mine[BENCH_GATHER_FIELDS] = {b->ktime_ok};
  double all[EPX_MAX_RANKS * BENCH_GATHER_FIELDS];
  BENCH_TRY(gather(b, mine, all));
  int failed = -1; /* the first rank without CUPTI */
  for (int q = b->num_ranks - 1; q >= 0; q--)
    if (all[q * BENCH_GATHER_FIELDS] == 0) failed = q;
  b->ktime_pass = failed < 0;
  if (b->rank == 0 && failed < 0)
    printf(
        "# kernel time: %s; kernel_us / kmed_us = max over ranks of the mean / median sum of a "
        "call's kernel durations, over %d profiled calls after the timed ones (memsets and "
        "memcpys apart: JSON copy_us)\n",
        bench_ktime_library(), b->opt->kernel_iters);
  else if (b->rank == 0 && failed == 0)
    printf("# kernel time: unavailable (%s)\n", why);
  else if (b->rank == 0)
    printf("# kernel time: unavailable (CUPTI failed on rank %d: its stderr says why)\n", failed);
  else if (b->rank == failed && all[0] != 0)
    fprintf(stderr, "epx_bench rank %d: kernel time: unavailable (%s)\n", b->rank, why);
  if (!b->ktime_pass) b->ktime_ok = 0;
  return 0;
}

int bench_finish_row(bench_rank_t *b, const bench_stats_t *stats, long long wrong, double bytes,
                     bench_row_t *row) {
  enum { MEDIAN, MIN, MAX, WRONG, BYTES, P99, KMEAN, KMEDIAN, KCOPY };
  const bench_ktime_summary_t *kt = &stats->kt;
  const double mine[BENCH_GATHER_FIELDS] = {stats->median_us, stats->min_us, stats->max_us,
                                            (double)wrong,    bytes,         stats->p99_us,
                                            kt->mean_us,      kt->median_us, kt->copy_us};
  double all[EPX_MAX_RANKS * BENCH_GATHER_FIELDS];
  BENCH_TRY(gather(b, mine, all));
  row->median_us = row->max_us = row->p99_us = 0;
  row->min_us = INFINITY;
  row->bytes = 0;
  row->wrong = 0;
  row->kernel_us = row->kernel_median_us = row->copy_us = 0;
  int without_ktime = -1; /* a rank that has no kernel time */
  for (int q = 0; q < b->num_ranks; q++) {
    const double *f = &all[q * BENCH_GATHER_FIELDS];
    row->median_us = fmax(row->median_us, f[MEDIAN]);
    row->p99_us = fmax(row->p99_us, f[P99]);
    row->min_us = fmin(row->min_us, f[MIN]);
    row->max_us = fmax(row->max_us, f[MAX]);
    row->bytes += f[BYTES] / b->num_ranks;
    /* one rank that did not check makes the row unchecked */
    if (row->wrong >= 0) row->wrong = f[WRONG] < 0 ? -1 : row->wrong + (long long)f[WRONG];
    if (isnan(f[KMEAN])) without_ktime = q;
    row->kernel_us = fmax(row->kernel_us, f[KMEAN]);
    row->kernel_median_us = fmax(row->kernel_median_us, f[KMEDIAN]);
    row->copy_us = fmax(row->copy_us, f[KCOPY]);
  }
  /* a maximum over ranks is a figure only if every rank has one */
  if (without_ktime >= 0) {
    if (b->rank == 0 && !isnan(kt->mean_us) && !b->ktime_noted)
      printf("# kernel time: none from rank %d (its CUPTI failed); such rows show -\n",
             without_ktime);
    b->ktime_noted |= !isnan(kt->mean_us);
    row->kernel_us = row->kernel_median_us = row->copy_us = NAN;
  }
  row->ktime = *kt;
  /* bytes / (us * 1e-6) / 1e9 */
  row->gbps = row->bytes / row->median_us * 1e-3;
  return 0;
}

int bench_emit_row(bench_rank_t *b, const bench_row_t *row) {
  if (b->rank == 0) bench_print_row(stdout, row);
  if (b->rank == 0 && b->opt->list_kernels && row->ktime.num_calls > 0) {
    char text[1024], tokens[16] = "", sms[16] = "";
    bench_ktime_format(&row->ktime, text, sizeof text);
    if (row->tokens >= 0) snprintf(tokens, sizeof tokens, " %dt", row->tokens);
    if (row->sms >= 0) snprintf(sms, sizeof sms, " %dsms", row->sms);
    printf("# kernels %s%s%s (rank 0): %s\n", row->op, tokens, sms, text);
    fflush(stdout);
  }
  return bench_table_add(&b->table, row);
}

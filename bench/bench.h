/*
 * bench.h - shared declarations of epx_bench (docs/bench.md): options, the per-rank context,
 * result rows and their table, the timing harness, the EP workload, and the extern "C"
 * launchers of bench_kernels.cu. Kernel time (CUPTI) has its own header, ktime.h.
 *
 * Process model: the parent never touches CUDA; it forks one process per GPU
 * (tests/common/ranks.c, shared with the test runner), each of which measures, gathers its
 * figures across ranks, and fills the same table. Only rank 0 prints. Every reported time is the
 * maximum over ranks of each rank's figure (event median; kernel time's mean and median).
 */
#ifndef EPX_BENCH_H_
#define EPX_BENCH_H_

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "check.h"
#include "epx.h"
#include "ktime.h"

#ifdef __cplusplus
extern "C" {
#endif

#define BENCH_MAX_LIST 16 /* entries of --tokens and --sms */

/* ---------------------------------------------------------------------------------------------
 * Options (options.c)
 * ------------------------------------------------------------------------------------------- */
typedef struct bench_options {
  int tokens[BENCH_MAX_LIST]; /* --tokens: tokens per rank, one workload each */
  int num_tokens;
  int sms[BENCH_MAX_LIST]; /* --sms: SM counts of the ceiling sweep */
  int num_sms;
  int epx_sms[BENCH_MAX_LIST]; /* --epx-sms: SM budgets of the EPX rows (one group each) */
  int num_epx_sms;
  int ll_tokens[BENCH_MAX_LIST]; /* --ll-tokens: tokens per rank of the low-latency rows */
  int num_ll_tokens;
  int run_normal, run_ll; /* --rows all|normal|ll */
  int hidden, top_k, num_experts;
  int iters, warmup;
  int kernel_iters; /* --kernel-iters: profiled calls per row after the timed ones; 0 = none */
  int list_kernels; /* --kernels: print each row's per-kernel breakdown */
  int ranks;        /* --ranks: 0 = every visible GPU (at most EPX_MAX_RANKS) */
  int timeout_s;    /* --timeout: the whole run, after which the ranks are killed */
  uint64_t seed;
  const char *json_path;  /* --json, or NULL */
  const char *trace_path; /* --trace: in-kernel trace of one iteration per EPX row, or NULL */
  const char *trace_op;   /* --trace-op: only rows whose op contains this, or NULL = all */
} bench_options_t;

/* Parse argv. Returns 0 to run, 1 after printing --help, 2 after printing a bad flag. */
int bench_parse_options(int argc, char **argv, bench_options_t *opt);
/* The group config of a run: the flags' sizes, normal mode, max tokens = the largest --tokens. */
epx_group_config_t bench_group_config(const bench_options_t *opt);

/* ---------------------------------------------------------------------------------------------
 * Error checks of rank code (check.h): BENCH_CUDA, BENCH_NCCL, BENCH_EPX print the failing call
 * with the rank, then return -1.
 * ------------------------------------------------------------------------------------------- */
/* A bench function that already reported its failure. */
#define BENCH_TRY(call)         \
  do {                          \
    if ((call) != 0) return -1; \
  } while (0)

/* ---------------------------------------------------------------------------------------------
 * Result rows (report.c). Integer fields are -1 where they do not apply, doubles NAN.
 * ------------------------------------------------------------------------------------------- */
#define BENCH_OP_CEILING "ceiling push"
#define BENCH_OP_NCCL_DISPATCH "nccl dispatch (full path)"
#define BENCH_OP_NCCL_A2A "nccl a2a only"
#define BENCH_OP_NCCL_COMBINE "nccl combine"

typedef struct bench_row {
  char op[32];
  int tokens, hidden, top_k, experts, ranks, sms;
  double median_us;     /* max over ranks of each rank's median */
  double p99_us;        /* max over ranks of each rank's 99th percentile */
  double min_us;        /* min over ranks and iterations */
  double max_us;        /* max over ranks and iterations */
  double bytes;         /* logical bytes per rank, mean over ranks (docs/bench.md) */
  double gbps;          /* logical GB/s: bytes / median_us */
  double push_gbps;     /* ceiling rows: bytes leaving each GPU / median_us */
  double ratio_ceiling; /* gbps over the logical ceiling (same SM count, or the best) */
  double ratio_nccl;    /* gbps over NCCL's on the same workload (EPX rows) */
  long long wrong;      /* wrong rows summed over ranks; -1 = not checked */
  /* Kernel time (docs/bench.md, "Timing"): max over ranks of each rank's mean (median) sum of
   * the call's kernel durations, and of its memset + memcpy durations; NAN when a rank has
   * none. */
  double kernel_us, kernel_median_us, copy_us;
  bench_ktime_summary_t ktime; /* this rank's own, with the per-kernel breakdown */
} bench_row_t;

typedef struct bench_table {
  bench_row_t *rows;
  int num_rows, capacity;
} bench_table_t;

/* A row with every field "not applicable" and the given op name. */
bench_row_t bench_row_init(const char *op);
/* Append a copy of row. Returns 0, or -1 when out of host memory. */
int bench_table_add(bench_table_t *t, const bench_row_t *row);
void bench_table_free(bench_table_t *t);
/* Logical GB/s of the ceiling row measured with `sms` SMs, or of the best one; NAN if none. */
double bench_table_ceiling(const bench_table_t *t, int sms);
double bench_table_best_ceiling(const bench_table_t *t);
/* Table lines: the column header, and one row. */
void bench_print_columns(FILE *f);
void bench_print_row(FILE *f, const bench_row_t *row);
/* Every row as a JSON array of objects. Returns 0, or -1 after printing why. */
int bench_write_json(const bench_table_t *t, const char *path);

/* ---------------------------------------------------------------------------------------------
 * One rank's context (epx_bench.c) and the timing harness (timing.c).
 * ------------------------------------------------------------------------------------------- */
typedef struct bench_rank {
  const bench_options_t *opt;
  int rank, num_ranks, device_sms;
  ncclComm_t comm;
  cudaStream_t stream; /* every measured operation runs here */
  epx_group_t group;
  double *gather_dev; /* [(R + 1) x BENCH_GATHER_FIELDS] for bench_finish_row */
  bench_table_t table;
  /* Kernel time. The profiled passes run the operation's collective calls, so whether they run
   * at all is decided alike on every rank (bench_kernel_agree); recording is each rank's own. */
  int ktime_pass;  /* profiled passes run (every rank alike) */
  int ktime_ok;    /* this rank records: CUPTI loaded, no failure yet */
  int ktime_noted; /* rank 0 said once that another rank has no kernel time */
} bench_rank_t;

/* median, min, max, wrong, bytes, p99, kernel mean, kernel median, copy */
#define BENCH_GATHER_FIELDS 9

/* One rank's times of one operation, in microseconds: events, and kernel time (kt). */
typedef struct bench_stats {
  double median_us, min_us, max_us, p99_us;
  bench_ktime_summary_t kt; /* no figure (num_calls = 0) unless a profiled pass ran */
} bench_stats_t;

/* Median, min, max and 99th percentile (the ceil(0.99 n)-th smallest) of n > 0 samples, sorted
 * in place; no kernel time. */
bench_stats_t bench_summarize(double *us, int n);

/* One iteration of an operation, queued on stream (it may synchronize the host). Returns 0, or
 * -1 after reporting the failure. */
typedef int (*bench_iter_fn)(void *arg, cudaStream_t stream);

/* Run opt->warmup then opt->iters iterations of fn, each preceded by epx_group_barrier so that
 * all ranks start together, timed with CUDA events recorded after the barrier and after fn.
 * Then, when kernel time is on, opt->kernel_iters more iterations run the same way with CUPTI
 * recording, each call bracketed (bench_kernel_pass_*), into stats->kt: the timed iterations
 * never run with CUPTI recording. Fails if the group recorded an async error (e.g. a barrier
 * timeout); never because of CUPTI. */
int bench_time(bench_rank_t *b, bench_iter_fn fn, void *arg, bench_stats_t *stats);

/* Kernel time, collectively at setup: every rank tells whether it loaded CUPTI (ktime_ok, why
 * it did not); profiled passes run only if every rank did (ktime_pass), so that all ranks make
 * the same calls. Rank 0 prints the verdict; a rank whose failure rank 0 cannot name prints
 * its own to stderr. */
int bench_kernel_agree(bench_rank_t *b, const char *why);

/* Kernel time of loops of their own (the split rows). When b->ktime_pass, run
 * opt->kernel_iters more iterations after the timed ones; bench_kernel_pass_start before them
 * returns 1 when this rank records (then bracket each call i of series s with
 * bench_ktime_call_begin(bench_kernel_call_id(s, i, n)) / bench_ktime_call_end), 0 when it
 * does not (CUPTI failed: rank 0 printed why, once); the pass runs either way. */
int bench_kernel_pass_start(bench_rank_t *b);
uint64_t bench_kernel_call_id(int series, int call, int calls_per_series);
/* End a pass that records: synchronize the device, then out[s] = the summary of series s's
 * calls_per_series calls (no figure if CUPTI failed: rank 0 prints why, once, and this rank
 * records no more). Returns 0, or -1 if the device synchronization failed. */
int bench_kernel_pass_finish(bench_rank_t *b, int calls_per_series, int num_series,
                             bench_ktime_summary_t *out);

/* One more iteration of fn, run and timed like a timed one (barrier, events, fn, events) but
 * with `group` traced (epx_trace_start / epx_trace_dump): the trace goes to path (rank 0
 * writes it). *us is this rank's time of that iteration. Collective. The timed iterations
 * are never traced, so the row's figures do not include tracing. */
int bench_trace_iteration(bench_rank_t *b, epx_group_t group, bench_iter_fn fn, void *arg,
                          const char *path, double *us, epx_trace_summary_t *summary);

/* --trace: when opt->trace_path is set and the row's name contains opt->trace_op (if given),
 * one traced iteration of fn (bench_trace_iteration) written to the trace path with
 * "-<op>-<tokens>t-<sms>sms" before its extension; rank 0 prints a line about it. Otherwise
 * nothing. Collective. */
int bench_trace_row(bench_rank_t *b, epx_group_t group, const char *name, bench_iter_fn fn,
                    void *arg, int tokens, int sms, const bench_stats_t *st);

/* Gather every rank's stats, wrong rows (-1 = not checked) and logical bytes, and fill row's
 * median_us, min_us, max_us, bytes, gbps, wrong, kernel time (kernel_us, kernel_median_us,
 * copy_us; ktime = this rank's breakdown). Collective. */
int bench_finish_row(bench_rank_t *b, const bench_stats_t *stats, long long wrong, double bytes,
                     bench_row_t *row);

/* bench_row_init plus the workload columns (tokens, hidden, top-k, experts, ranks) of a run. */
bench_row_t bench_workload_row(const bench_rank_t *b, const char *op, int tokens);

/* Rank 0 prints the row (with --kernels, its kernel breakdown on the next line) and every rank
 * appends it to its table. */
int bench_emit_row(bench_rank_t *b, const bench_row_t *row);

/* ---------------------------------------------------------------------------------------------
 * The EP workload of one token count (workload.c): routing, payload, and what to expect.
 * ------------------------------------------------------------------------------------------- */
typedef struct bench_workload {
  int max_tokens, num_tokens;
  int64_t *topk_idx;     /* device [T, K]: K distinct experts per token, uniform, seeded */
  void *x;               /* device [T, H] BF16: x[t][h] = bench value of (seed, rank, t, h) */
  int *ranks_per_token;  /* device [T]: distinct ranks each token goes to (combine check) */
  int32_t *expected_src; /* device [R x max_tokens, 2]: (source rank, source token) of each
                            row this rank should receive, source-rank then token order */
  int expected_recv[EPX_MAX_RANKS]; /* rows this rank should receive from each source */
  unsigned long long *wrong_dev;    /* device counter of the check kernels */
} bench_workload_t;

int bench_workload_create(bench_rank_t *b, int max_tokens, bench_workload_t *w);
/* New routing and payload for num_tokens tokens (deterministic in seed, rank, token). */
int bench_workload_fill(bench_rank_t *b, bench_workload_t *w, int num_tokens);
int bench_workload_destroy(bench_workload_t *w);
/* Received rows [sum of recv_counts, H] BF16, recv_counts[s] rows from source s in source
 * order, compared with what every source must have sent; missing or extra rows count as
 * wrong. Synchronizes the stream. */
int bench_check_dispatch(bench_rank_t *b, const bench_workload_t *w, const void *recv_x,
                         const int *recv_counts, long long *wrong);
/* out [T, H] BF16 of a combine that returned every dispatched row unchanged: out[t] must be
 * ranks_per_token[t] * x[t] (exact in float32). Synchronizes the stream. */
int bench_check_combine(bench_rank_t *b, const bench_workload_t *w, const void *out,
                        long long *wrong);

/* ---------------------------------------------------------------------------------------------
 * Row producers.
 * ------------------------------------------------------------------------------------------- */
/* ceiling.c: one "ceiling push" row per --sms entry. */
int bench_ceiling_rows(bench_rank_t *b);

/* nccl_ep.c: the NCCL baseline of one workload: dispatch (full path), a2a only, combine. */
typedef struct bench_nccl bench_nccl_t;
int bench_nccl_create(bench_rank_t *b, int max_tokens, bench_nccl_t **n);
int bench_nccl_rows(bench_nccl_t *n, bench_workload_t *w);
int bench_nccl_destroy(bench_nccl_t *n);

/* epx_rows.c: EPX's normal-mode rows of one workload, for every --epx-sms entry. */
int bench_epx_rows(bench_rank_t *b, bench_workload_t *w);

/* expand_rows.c: EPX's expert-major rows of one workload, for every --epx-sms entry. */
int bench_expand_rows(bench_rank_t *b, bench_workload_t *w);

/* ll_rows.c: EPX's low-latency rows of one workload (its num_tokens), both routes. */
int bench_ll_rows(bench_rank_t *b, bench_workload_t *w);

/* ---------------------------------------------------------------------------------------------
 * Kernels (bench_kernels.cu). Each launcher returns the launch's cudaError_t.
 * ------------------------------------------------------------------------------------------- */
typedef struct bench_push_args {
  const void *src[EPX_MAX_RANKS - 1]; /* [bytes_per_pair] source of the j-th peer */
  void *dst[EPX_MAX_RANKS - 1];       /* [bytes_per_pair] in the j-th peer's memory */
  int num_peers;
  size_t bytes_per_pair; /* a multiple of BENCH_PUSH_UNIT_BYTES */
  int num_blocks;        /* = SMs used */
} bench_push_args_t;

#define BENCH_PUSH_UNIT_BYTES 4096 /* one warp's step: 32 lanes x 8 x 16 bytes */

typedef struct bench_rows_args {
  void *rows;                   /* [.., H] BF16, in blocks by rank */
  int prefix[EPX_MAX_RANKS];    /* first row of each rank's block in rows */
  const int *token_pos_in_rank; /* [T, R] from epx_layout; -1 = not sent */
  void *x;                      /* pack: [IN] [T, H]; reduce: [OUT] [T, H] */
  int num_tokens, hidden, num_ranks;
} bench_rows_args_t;

cudaError_t bench_push_launch(const bench_push_args_t *a, cudaStream_t stream);
/* Keep the GPU busy for about ns nanoseconds (the "other work" between split halves). */
cudaError_t bench_spin_launch(uint64_t ns, cudaStream_t stream);
/* x[t][h] = bench value of (seed, rank, t, h), t < num_tokens. */
cudaError_t bench_fill_x_launch(void *x, int num_tokens, int hidden, uint64_t seed, int rank,
                                cudaStream_t stream);
/* rows[prefix[r] + pos[t][r]] = x[t] for every (t, r) with pos[t][r] >= 0. */
cudaError_t bench_pack_launch(const bench_rows_args_t *a, cudaStream_t stream);
/* x[t] = BF16(sum over r with pos[t][r] >= 0 of rows[prefix[r] + pos[t][r]]), in float32. */
cudaError_t bench_reduce_launch(const bench_rows_args_t *a, cudaStream_t stream);
/* Adds to *wrong the rows of rows [num_rows, H] that differ from x of (seed, expected[2i],
 * expected[2i + 1]). */
cudaError_t bench_check_rows_launch(const void *rows, const int32_t *expected, int num_rows,
                                    int hidden, uint64_t seed, unsigned long long *wrong,
                                    cudaStream_t stream);
/* Adds to *wrong the tokens t of out [T, H] that differ from BF16(mult[t] * x(seed, rank, t)). */
cudaError_t bench_check_scaled_launch(const void *out, const int *mult, int num_tokens, int hidden,
                                      uint64_t seed, int rank, unsigned long long *wrong,
                                      cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* EPX_BENCH_H_ */

/*
 * epx_bench.c - EPX's benchmark: main, and one rank's whole run (docs/bench.md).
 *
 * The parent sets NCCL_NVLS_ENABLE=0 (NVLink multicast stays off), parses the flags, counts
 * the GPUs in a child, validates the group config for the rank count and forks one process
 * per GPU (tests/common/ranks.c, shared with the test runner: rank 0's NCCL unique id relayed
 * through pipes, ranks killed at --timeout, or 30 s after one of them failed); it never
 * initializes CUDA nor loads CUPTI. Each rank creates its NCCL communicator and an EPX group,
 * loads CUPTI for kernel time (unless --kernel-iters 0; without it the run goes on, kernel_us
 * "-"), then measures, in order:
 *   1. the machine's ceiling: SM-driven all-to-all push, one row per --sms entry (ceiling.c);
 *   2. for each --tokens entry, on one seeded workload (workload.c):
 *      the NCCL baseline rows (nccl_ep.c), then the EPX rows (epx_rows.c), per --epx-sms;
 *   3. for each --ll-tokens entry, the low-latency rows of every route (ll_rows.c).
 * --rows normal / ll keeps only the normal (2.) or the low-latency (3.) rows.
 * Every rank keeps the same table; rank 0 prints it as rows are measured and writes --json.
 * On a failure a rank returns at once without tearing anything down: its peers may be stuck
 * in a collective, so nothing collective is attempted, and process exit releases the rest.
 */
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "common/ranks.h"

#define COUNT_TIMEOUT_S 60 /* counting the GPUs in a child */
#define FAILURE_GRACE_S 30 /* the other ranks' time to finish once one has failed */

static void print_header(const bench_rank_t *b, const struct cudaDeviceProp *prop, int nccl_version,
                         int epx_version) {
  const bench_options_t *o = b->opt;
  const char *commit = getenv("EPX_COMMIT");
  printf("# epx_bench: EPX %d.%d.%d, NCCL %d.%d.%d%s%s\n", epx_version / 10000,
         epx_version / 100 % 100, epx_version % 100, nccl_version / 10000, nccl_version / 100 % 100,
         nccl_version % 100, commit ? ", commit " : "", commit ? commit : "");
  printf("# machine: %d x %s, %d SMs each\n", b->num_ranks, prop->name, prop->multiProcessorCount);
  printf("# workload: hidden %d, top-%d of %d experts, tokens per rank", o->hidden, o->top_k,
         o->num_experts);
  for (int i = 0; i < o->num_tokens; i++) printf("%s%d", i ? "," : " ", o->tokens[i]);
  printf("; low-latency tokens per rank");
  for (int i = 0; i < o->num_ll_tokens; i++) printf("%s%d", i ? "," : " ", o->ll_tokens[i]);
  printf("; seed %llu; %d iterations after %d warmup\n", (unsigned long long)o->seed, o->iters,
         o->warmup);
  printf(
      "# times: max over ranks of each rank's median (min/max: any rank, any iteration);"
      " GB/s = logical bytes per rank / time (docs/bench.md)\n");
}

/* Rank 0 prints the header (kernel time's line and the columns follow: rank_main). */
static int print_preamble(const bench_rank_t *b) {
  struct cudaDeviceProp prop;
  int nccl_version = 0, epx_version = 0;
  BENCH_CUDA(cudaGetDeviceProperties(&prop, b->rank));
  BENCH_NCCL(ncclGetVersion(&nccl_version));
  BENCH_EPX(epx_get_version(&epx_version));
  print_header(b, &prop, nccl_version, epx_version);
  if (b->opt->kernel_iters == 0) printf("# kernel time: off (--kernel-iters 0)\n");
  fflush(stdout);
  return 0;
}

/* Kernel time: load CUPTI in this rank's process; never fails the run (why says what went
 * wrong). */
static void setup_ktime(bench_rank_t *b, char *why, size_t len) {
  why[0] = '\0';
  b->ktime_ok = b->opt->kernel_iters > 0 && bench_ktime_open(why, len) == 0;
}

static int setup(bench_rank_t *b, const ncclUniqueId *id) {
  const epx_group_config_t config = bench_group_config(b->opt);
  BENCH_CUDA(cudaSetDevice(b->rank));
  BENCH_CUDA(cudaDeviceGetAttribute(&b->device_sms, cudaDevAttrMultiProcessorCount, b->rank));
  BENCH_NCCL(ncclCommInitRank(&b->comm, b->num_ranks, *id, b->rank));
  BENCH_CUDA(cudaStreamCreateWithFlags(&b->stream, cudaStreamNonBlocking));
  BENCH_EPX(epx_group_create(b->comm, &config, &b->group));
  BENCH_CUDA(cudaMalloc((void **)&b->gather_dev,
                        (size_t)(b->num_ranks + 1) * BENCH_GATHER_FIELDS * sizeof(double)));
  return 0;
}

static int teardown(bench_rank_t *b) {
  BENCH_CUDA(cudaStreamSynchronize(b->stream));
  BENCH_CUDA(cudaFree(b->gather_dev));
  BENCH_EPX(epx_group_destroy(b->group));
  BENCH_CUDA(cudaStreamDestroy(b->stream));
  BENCH_NCCL(ncclCommDestroy(b->comm));
  return 0;
}

/* Every row of one token count. */
static int run_workload(bench_rank_t *b, bench_workload_t *w, bench_nccl_t *nccl, int tokens) {
  BENCH_TRY(bench_workload_fill(b, w, tokens));
  BENCH_TRY(bench_nccl_rows(nccl, w));
  BENCH_TRY(bench_epx_rows(b, w));    /* epx_rows.c */
  BENCH_TRY(bench_expand_rows(b, w)); /* expand_rows.c */
  return 0;
}

/* The low-latency rows (ll_rows.c), one workload per --ll-tokens entry. */
static int run_ll(bench_rank_t *b) {
  int max_tokens = 0;
  for (int i = 0; i < b->opt->num_ll_tokens; i++)
    if (b->opt->ll_tokens[i] > max_tokens) max_tokens = b->opt->ll_tokens[i];
  bench_workload_t w;
  BENCH_TRY(bench_workload_create(b, max_tokens, &w));
  for (int i = 0; i < b->opt->num_ll_tokens; i++) {
    BENCH_TRY(bench_workload_fill(b, &w, b->opt->ll_tokens[i]));
    BENCH_TRY(bench_ll_rows(b, &w));
  }
  return bench_workload_destroy(&w);
}

static int run_all(bench_rank_t *b) {
  const int max_tokens = bench_group_config(b->opt).max_tokens_per_rank;
  BENCH_TRY(bench_ceiling_rows(b));
  if (b->opt->run_normal) {
    bench_workload_t w;
    bench_nccl_t *nccl = NULL;
    BENCH_TRY(bench_workload_create(b, max_tokens, &w));
    BENCH_TRY(bench_nccl_create(b, max_tokens, &nccl));
    for (int i = 0; i < b->opt->num_tokens; i++)
      BENCH_TRY(run_workload(b, &w, nccl, b->opt->tokens[i]));
    BENCH_TRY(bench_nccl_destroy(nccl));
    BENCH_TRY(bench_workload_destroy(&w));
  }
  if (b->opt->run_ll) BENCH_TRY(run_ll(b));
  return 0;
}

/* Rank 0's verdict on the results: rows with wrong results fail the run. */
static int count_wrong_rows(const bench_table_t *t) {
  int bad = 0;
  for (int i = 0; i < t->num_rows; i++)
    if (t->rows[i].wrong > 0) {
      fprintf(stderr, "epx_bench: %s at %d tokens: %lld wrong rows\n", t->rows[i].op,
              t->rows[i].tokens, t->rows[i].wrong);
      bad++;
    }
  return bad;
}

/* One rank's process (a ranks_fn; arg is the options). */
static int rank_main(int rank, int num_ranks, const ncclUniqueId *id, void *arg) {
  const bench_options_t *opt = (const bench_options_t *)arg;
  bench_log_rank = rank;
  bench_rank_t b;
  memset(&b, 0, sizeof b);
  b.opt = opt;
  b.rank = rank;
  b.num_ranks = num_ranks;
  char ktime_why[BENCH_KTIME_REASON_LEN];
  int rc = setup(&b, id);
  if (rc == 0) setup_ktime(&b, ktime_why, sizeof ktime_why);
  if (rc == 0 && rank == 0) rc = print_preamble(&b);
  if (rc == 0) rc = bench_kernel_agree(&b, ktime_why); /* collective; rank 0 prints a line */
  if (rc == 0 && rank == 0) {
    bench_print_columns(stdout);
    fflush(stdout);
  }
  if (rc == 0) rc = run_all(&b);
  if (rc == 0) rc = teardown(&b); /* collective: before anything that could fail alone */
  if (rank == 0 && opt->json_path && bench_write_json(&b.table, opt->json_path)) rc = -1;
  if (rc == 0 && rank == 0) {
    const int bad = count_wrong_rows(&b.table);
    printf("# %d rows, %d with wrong results%s%s\n", b.table.num_rows, bad,
           opt->json_path ? "; JSON: " : "", opt->json_path ? opt->json_path : "");
    if (bad) rc = -1;
  }
  bench_table_free(&b.table);
  return rc ? 1 : 0;
}

int main(int argc, char **argv) {
  /* NVLink multicast must stay off, whatever the caller's environment says. */
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  bench_options_t opt;
  const int parsed = bench_parse_options(argc, argv, &opt);
  if (parsed) return parsed == 1 ? 0 : 2;

  const int visible = ranks_count_gpus("epx_bench", COUNT_TIMEOUT_S);
  if (visible < 2) {
    printf("epx_bench: %d GPU(s) visible\nskipped: needs 2 GPUs\n", visible);
    return 0;
  }
  int num_ranks = visible < EPX_MAX_RANKS ? visible : EPX_MAX_RANKS;
  if (opt.ranks) {
    if (opt.ranks > visible) {
      printf("epx_bench: --ranks %d but %d GPUs visible\nskipped: needs %d GPUs\n", opt.ranks,
             visible, opt.ranks);
      return 0;
    }
    num_ranks = opt.ranks;
  }
  const epx_group_config_t config = bench_group_config(&opt);
  if (epx_config_validate(&config, num_ranks) != EPX_OK) {
    fprintf(stderr, "epx_bench: at %d ranks: %s\n", num_ranks, epx_last_error());
    return 2;
  }
  const ranks_config_t rc = {"epx_bench", opt.timeout_s, FAILURE_GRACE_S, 0, "--timeout", 0};
  return ranks_run(&rc, num_ranks, rank_main, &opt, NULL) ? 1 : 0;
}

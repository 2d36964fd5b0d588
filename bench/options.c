/*
 * options.c - epx_bench's flags (nccl-tests style: "--flag value"; --kernels and --help take
 * none), their defaults and checks.
 * Checks here are the bench's own (list lengths, ranges); the group config is validated by
 * epx_config_validate once the rank count is known (epx_bench.c).
 */
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"

static const char usage[] =
    "usage: epx_bench [flags]\n"
    "  --tokens N[,N...]  tokens per rank, one workload each (default 4096)\n"
    "  --ll-tokens N[,N...] tokens per rank of the low-latency rows (default 1,32,128,256,512)\n"
    "  --rows WHICH       all, normal or ll: which EPX rows to measure (default all)\n"
    "  --hidden H         elements per token (default 7168)\n"
    "  --topk K           experts per token (default 8)\n"
    "  --experts E        experts in total, a multiple of the rank count (default 256)\n"
    "  --iters N          timed iterations per row (default 20)\n"
    "  --warmup N         untimed iterations before them (default 5)\n"
    "  --kernel-iters N   profiled iterations per row after the timed ones, for kernel time\n"
    "                     (CUPTI; default 10; 0 = no kernel time, CUPTI never loaded)\n"
    "  --kernels          print each row's kernels: name, time per call, launches per call\n"
    "  --sms N[,N...]     SM counts of the ceiling sweep (default 8,16,24,32,48,64,96)\n"
    "  --epx-sms N[,N...] SM budgets of the EPX rows, one group each (default 24)\n"
    "  --ranks N          use N GPUs (default: every visible GPU, at most 8)\n"
    "  --seed N           seed of routing and payload (default 1)\n"
    "  --json FILE        also write every row as a JSON array of objects\n"
    "  --trace FILE       in-kernel trace of one extra iteration of each EPX row, one file per\n"
    "                     row: FILE with -<op>-<T>t-<S>sms before .json (docs/profiling.md)\n"
    "  --trace-op TEXT    trace only the EPX rows whose op contains TEXT (e.g. combine)\n"
    "  --timeout S        kill the run after S seconds (default 1200)\n"
    "  --help             this text\n"
    "CUPTI is looked for in $EPX_CUPTI_LIBRARY, $CUDA_HOME, /usr/local/cuda and PyTorch's\n"
    "nvidia/*/lib; without it kernel_us is - and the run goes on.\n"
    "Rows, formulas and timing methods: docs/bench.md.\n";

static void set_defaults(bench_options_t *opt) {
  static const int default_sms[] = {8, 16, 24, 32, 48, 64, 96};
  memset(opt, 0, sizeof *opt);
  static const int default_ll_tokens[] = {1, 32, 128, 256, 512};
  opt->tokens[0] = 4096;
  opt->num_tokens = 1;
  opt->num_ll_tokens = (int)(sizeof default_ll_tokens / sizeof default_ll_tokens[0]);
  memcpy(opt->ll_tokens, default_ll_tokens, sizeof default_ll_tokens);
  opt->run_normal = opt->run_ll = 1;
  opt->num_sms = (int)(sizeof default_sms / sizeof default_sms[0]);
  memcpy(opt->sms, default_sms, sizeof default_sms);
  opt->epx_sms[0] = 24;
  opt->num_epx_sms = 1;
  opt->hidden = 7168;
  opt->top_k = 8;
  opt->num_experts = 256;
  opt->iters = 20;
  opt->warmup = 5;
  opt->kernel_iters = 10;
  opt->timeout_s = 1200;
  opt->seed = 1;
}

static int parse_seed(const char *s, uint64_t *out) {
  char *end;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 0);
  if (errno || end == s || *end) {
    fprintf(stderr, "epx_bench: --seed %s: expected an unsigned integer\n", s);
    return -1;
  }
  *out = v;
  return 0;
}

/* One "--flag value" pair. Returns 0, or -1 after printing why. */
static int parse_flag(bench_options_t *o, const char *flag, const char *v) {
  if (!strcmp(flag, "--tokens"))
    return bench_parse_list(flag, v, 1, EPX_MAX_TOKENS_PER_RANK, BENCH_MAX_LIST, o->tokens,
                            &o->num_tokens);
  if (!strcmp(flag, "--ll-tokens"))
    return bench_parse_list(flag, v, 1, EPX_MAX_TOKENS_PER_RANK, BENCH_MAX_LIST, o->ll_tokens,
                            &o->num_ll_tokens);
  if (!strcmp(flag, "--rows")) {
    o->run_normal = !strcmp(v, "all") || !strcmp(v, "normal");
    o->run_ll = !strcmp(v, "all") || !strcmp(v, "ll");
    if (o->run_normal || o->run_ll) return 0;
    fprintf(stderr, "epx_bench: --rows %s: expected all, normal or ll\n", v);
    return -1;
  }
  if (!strcmp(flag, "--sms"))
    return bench_parse_list(flag, v, 1, 1024, BENCH_MAX_LIST, o->sms, &o->num_sms);
  if (!strcmp(flag, "--epx-sms"))
    return bench_parse_list(flag, v, 1, 1024, BENCH_MAX_LIST, o->epx_sms, &o->num_epx_sms);
  if (!strcmp(flag, "--hidden")) return bench_parse_int(flag, v, 8, EPX_MAX_HIDDEN, &o->hidden);
  if (!strcmp(flag, "--topk")) return bench_parse_int(flag, v, 1, EPX_MAX_TOP_K, &o->top_k);
  if (!strcmp(flag, "--experts"))
    return bench_parse_int(flag, v, 1, EPX_MAX_EXPERTS, &o->num_experts);
  if (!strcmp(flag, "--iters")) return bench_parse_int(flag, v, 1, 100000, &o->iters);
  if (!strcmp(flag, "--warmup")) return bench_parse_int(flag, v, 0, 100000, &o->warmup);
  if (!strcmp(flag, "--kernel-iters")) return bench_parse_int(flag, v, 0, 100000, &o->kernel_iters);
  if (!strcmp(flag, "--ranks")) return bench_parse_int(flag, v, 2, EPX_MAX_RANKS, &o->ranks);
  if (!strcmp(flag, "--timeout")) return bench_parse_int(flag, v, 1, INT_MAX, &o->timeout_s);
  if (!strcmp(flag, "--seed")) return parse_seed(v, &o->seed);
  if (!strcmp(flag, "--json")) {
    o->json_path = v;
    return 0;
  }
  if (!strcmp(flag, "--trace")) {
    o->trace_path = v;
    return 0;
  }
  if (!strcmp(flag, "--trace-op")) {
    o->trace_op = v;
    return 0;
  }
  fprintf(stderr, "epx_bench: unknown flag %s\n%s", flag, usage);
  return -1;
}

int bench_parse_options(int argc, char **argv, bench_options_t *opt) {
  set_defaults(opt);
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
      fputs(usage, stdout);
      return 1;
    }
    if (!strcmp(argv[i], "--kernels")) {
      opt->list_kernels = 1;
      continue;
    }
    if (i + 1 >= argc) {
      fprintf(stderr, "epx_bench: %s needs a value\n%s", argv[i], usage);
      return 2;
    }
    if (parse_flag(opt, argv[i], argv[i + 1])) return 2;
    i++;
  }
  if (opt->trace_op && !opt->trace_path) {
    fprintf(stderr, "epx_bench: --trace-op needs --trace FILE\n");
    return 2;
  }
  if (opt->list_kernels && opt->kernel_iters == 0) {
    fprintf(stderr, "epx_bench: --kernels needs --kernel-iters > 0\n");
    return 2;
  }
  if (opt->top_k > opt->num_experts) {
    fprintf(stderr, "epx_bench: --topk %d: more than --experts %d\n", opt->top_k, opt->num_experts);
    return 2;
  }
  return 0;
}

epx_group_config_t bench_group_config(const bench_options_t *opt) {
  epx_group_config_t c = EPX_GROUP_CONFIG_INIT;
  int max_tokens = 0;
  for (int i = 0; i < opt->num_tokens; i++)
    if (opt->tokens[i] > max_tokens) max_tokens = opt->tokens[i];
  c.max_tokens_per_rank = max_tokens;
  c.hidden = opt->hidden;
  c.num_experts = opt->num_experts;
  c.top_k = opt->top_k;
  c.modes = EPX_MODE_NORMAL; /* the ceiling writes into the normal receive region */
  /* NOTE: generous, so that NCCL's lazy connection setup on one rank cannot time out a peer's
   * barrier; a real hang still ends as an async error long before --timeout. */
  c.timeout_ms = 60000;
  return c;
}

/*
 * soak.c - epx_soak: a long run of mixed normal and low-latency iterations with changing
 * shapes, routings and options, every result compared with the CPU reference, device and host
 * memory watched (docs/testing.md, "Soak").
 *
 * Usage: epx_soak [--iters N] [--start I] [--ranks R] [--seed S] [--timeout-s T] [--stall-s T]
 *                 [--check-every K] [--report-every M] [--max-device-growth-mib X]
 *                 [--max-rss-growth-mib X] [--print-plan]
 *
 * The parent counts the GPUs in a child and forks one process per GPU (tests/common/ranks.c,
 * shared with the tests and the benchmark); it never initializes CUDA. Each rank creates its
 * NCCL communicator, then for every iteration computes the plan (plan.h: the same on every
 * rank, from the seed), recreates the group when the plan's epoch changes shape, and runs the
 * iteration (soak_normal.c, soak_ll.c). Every --report-every iterations the ranks all-reduce
 * their counters and rank 0 prints a line; at the end it prints the summary line, last.
 *
 * Memory (device: cudaMemGetInfo's free bytes; host: resident pages of /proc/self/statm) is
 * measured at group boundaries (no group alive) and at report points. The baseline is the first
 * group boundary after the warm-up (SOAK_WARMUP_ITERS: every shape visited). Device growth at a
 * report point subtracts the live group's own footprint, measured when it was created, so that
 * shapes of different sizes compare. Growth past the tolerances fails the run.
 *
 * Every wait is bounded: EPX's own (the group's timeout_ms), the run's deadline (--timeout-s:
 * ranks.c kills every rank) and a per-rank stall alarm (--stall-s: a rank that makes no
 * progress exits, and ranks.c kills the others after a grace period).
 */
#include <errno.h>
#include <fcntl.h>
#include <malloc.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/ranks.h"
#include "soak/soak.h"

#define COUNT_TIMEOUT_S 60 /* counting the GPUs in a child */
#define FAILURE_GRACE_S 30 /* the other ranks' time to finish once one has failed */
#define GROUP_TIMEOUT_MS 5000
#define MIB (1024.0 * 1024.0)

/* Exit codes of a rank: 0 passed, 1 the verdict failed (summary printed), 3 a fatal error
 * (message printed, no summary), 4 the stall alarm. */
#define EXIT_VERDICT 1
#define EXIT_FATAL 3
#define EXIT_STALL 4

/* ---------------------------------------------------------------------------------------------
 * Messages and results
 * ------------------------------------------------------------------------------------------- */

void soak_mute(soak_rank_t *s) {
  if (s->muted_fd >= 0) return;
  fflush(stderr);
  const int null_fd = open("/dev/null", O_WRONLY);
  if (null_fd < 0) return;
  s->muted_fd = dup(STDERR_FILENO);
  if (s->muted_fd >= 0) dup2(null_fd, STDERR_FILENO);
  close(null_fd);
}

void soak_unmute(soak_rank_t *s) {
  if (s->muted_fd < 0) return;
  fflush(stderr);
  dup2(s->muted_fd, STDERR_FILENO);
  close(s->muted_fd);
  s->muted_fd = -1;
}

void soak_result(soak_rank_t *s, int check_result, const char *what) {
  if (check_result == TEST_PASS) return;
  s->wrong++;
  if (s->wrong > SOAK_PRINT_WRONG) return;
  char plan[512];
  soak_plan_describe(s->plan, &s->epoch, plan, sizeof plan);
  fprintf(s->msg,
          "epx_soak rank %d: WRONG #%lld: %s at iteration %lld (seed %llu, %d ranks): %s\n"
          "  the same inputs again: epx_soak --seed %llu --start %lld --iters 1 --ranks %d\n",
          s->rank, s->wrong, what, s->plan->iter, (unsigned long long)s->opt->seed, s->R, plan,
          (unsigned long long)s->opt->seed, s->plan->iter, s->R);
  if (s->wrong == SOAK_PRINT_WRONG)
    fprintf(s->msg, "epx_soak rank %d: %d wrong results; only counting from here on\n", s->rank,
            SOAK_PRINT_WRONG);
}

int soak_check_async(soak_rank_t *s, const world_t *w, int stage) {
  epx_async_error_t err;
  if (epx_group_get_async_error(s->g, &err) != EPX_OK) {
    fprintf(s->msg, "epx_soak rank %d: epx_group_get_async_error: %s\n", s->rank, epx_last_error());
    return -1;
  }
  const long long bad = w ? world_first_bad_id(w, s->rank) : -1;
  const long long value = bad >= 0 ? (long long)w->idx[s->rank][bad] : 0;
  const int quiet = s->wrong >= SOAK_PRINT_WRONG;
  if (err.status == EPX_OK) {
    if (bad < 0) return 0;
    if (!quiet)
      fprintf(s->msg,
              "  topk_idx[%lld] = %lld is outside [-1, %d) but no async error is on record\n", bad,
              value, w->E);
    soak_result(s, TEST_FAIL, "the async error of a bad expert id");
    return 0;
  }
  if (bad >= 0 && err.status == EPX_ERR_INVALID_ARGUMENT && (int)err.stage == stage) {
    if (err.position == bad && err.value == value) {
      s->expected_errors++;
    } else {
      if (!quiet)
        fprintf(s->msg, "  the first bad id is topk_idx[%lld] = %lld, the record says: %s\n", bad,
                value, err.message);
      soak_result(s, TEST_FAIL, "the async error of a bad expert id");
    }
  } else {
    s->unexpected_errors++;
    if (s->unexpected_errors <= SOAK_PRINT_WRONG)
      fprintf(s->msg, "epx_soak rank %d: iteration %lld: unexpected async error: %s\n", s->rank,
              s->plan->iter, err.message);
    if (err.status == EPX_ERR_TIMEOUT || err.status == EPX_ERR_PEER_FAILED) {
      fprintf(s->msg, "epx_soak rank %d: the group's state is in doubt after it; stopping\n",
              s->rank);
      return -1;
    }
  }
  SOAK_EPX(s, epx_group_clear_async_error(s->g));
  return 0;
}

/* ---------------------------------------------------------------------------------------------
 * The stall alarm: a rank without progress for --stall-s seconds says where it was and exits.
 * ------------------------------------------------------------------------------------------- */

static volatile long long stall_iter = -1;
static volatile int stall_rank, stall_s;

static size_t put_num(char *p, long long v) {
  char tmp[24];
  size_t n = 0, out = 0;
  if (v < 0) p[out++] = '-', v = -v;
  do tmp[n++] = (char)('0' + v % 10), v /= 10;
  while (v);
  while (n) p[out++] = tmp[--n];
  return out;
}

static void on_stall(int sig) {
  (void)sig;
  char line[160];
  size_t n = 0;
  const char *a = "epx_soak rank ", *b = ": no progress for ", *c = " s (iteration ",
             *e = "); stopping\n";
  memcpy(line + n, a, strlen(a)), n += strlen(a);
  n += put_num(line + n, stall_rank);
  memcpy(line + n, b, strlen(b)), n += strlen(b);
  n += put_num(line + n, stall_s);
  memcpy(line + n, c, strlen(c)), n += strlen(c);
  n += put_num(line + n, stall_iter);
  memcpy(line + n, e, strlen(e)), n += strlen(e);
  if (write(STDERR_FILENO, line, n) < 0) { /* nothing more to do */
  }
  _exit(EXIT_STALL);
}

static void progress(long long it) {
  stall_iter = it;
  if (stall_s > 0) alarm((unsigned)stall_s);
}

/* ---------------------------------------------------------------------------------------------
 * Memory
 * ------------------------------------------------------------------------------------------- */

static long long rss_bytes(void) {
  long long pages = 0, resident = 0;
  FILE *f = fopen("/proc/self/statm", "r");
  if (!f) return -1;
  if (fscanf(f, "%lld %lld", &pages, &resident) != 2) resident = -1;
  fclose(f);
  return resident < 0 ? -1 : resident * sysconf(_SC_PAGESIZE);
}

static long long device_free_bytes(void) {
  size_t free_b = 0, total_b = 0;
  return cudaMemGetInfo(&free_b, &total_b) == cudaSuccess ? (long long)free_b : -1;
}

/* Growth is "memory in use now minus in use at the baseline", excluding the live group. */
typedef struct {
  int have_base; /* the baseline was taken */
  long long base_free, base_rss;
  long long before_create;      /* free bytes at the live group's creation, before it */
  long long after_create;       /* ... and after it (its handle and first calls' buffers too) */
  long long points;             /* measurements after the baseline */
  long long dev_now, rss_now;   /* the latest growth */
  long long dev_peak, rss_peak; /* the largest growth */
} memory_t;

static void measure(memory_t *m, int group_alive) {
  if (!m->have_base) return;
  const long long free_now = device_free_bytes();
  m->dev_now = group_alive ? (m->base_free - m->before_create) + (m->after_create - free_now)
                           : m->base_free - free_now;
  m->rss_now = rss_bytes() - m->base_rss;
  if (m->points == 0 || m->dev_now > m->dev_peak) m->dev_peak = m->dev_now;
  if (m->points == 0 || m->rss_now > m->rss_peak) m->rss_peak = m->rss_now;
  m->points++;
}

/* ---------------------------------------------------------------------------------------------
 * Groups
 * ------------------------------------------------------------------------------------------- */

static epx_group_config_t group_config(const soak_epoch_t *e, int R) {
  const soak_shape_t *sh = &soak_shapes[e->shape];
  const int E = sh->experts_per_rank * R;
  epx_group_config_t cfg =
      gpu_test_config(sh->max_tokens, sh->hidden, E, sh->top_k < E ? sh->top_k : E);
  cfg.modes = EPX_MODE_NORMAL | EPX_MODE_LOW_LATENCY;
  cfg.ll_max_tokens_per_rank = sh->ll_max_tokens;
  cfg.ll_route = e->ll_route;
  cfg.timeout_ms = GROUP_TIMEOUT_MS;
  return cfg;
}

static int close_group(soak_rank_t *s) {
  if (!s->g) return 0;
  SOAK_CUDA(s, cudaStreamSynchronize(s->t.stream));
  SOAK_EPX(s, epx_handle_destroy(s->h));
  SOAK_EPX(s, epx_group_destroy(s->g));
  s->g = NULL, s->h = NULL;
  return 0;
}

/* Between groups: the baseline (once past the warm-up), else a measurement. */
static void at_boundary(soak_rank_t *s, memory_t *m, long long it) {
  if (!m->have_base && it >= SOAK_WARMUP_ITERS && it > s->opt->start) {
    m->have_base = 1;
    m->base_free = device_free_bytes();
    m->base_rss = rss_bytes();
  } else {
    measure(m, 0);
  }
}

static int open_group(soak_rank_t *s, memory_t *m, long long it) {
  soak_epoch_of(s->opt->seed, it, &s->epoch);
  const epx_group_config_t cfg = group_config(&s->epoch, s->R);
  m->before_create = device_free_bytes();
  SOAK_EPX(s, epx_group_create(s->t.comm, &cfg, &s->g));
  SOAK_EPX(s, epx_handle_create(s->g, &s->h));
  m->after_create = device_free_bytes();
  s->H = cfg.hidden, s->E = cfg.num_experts, s->K = cfg.top_k;
  s->M = cfg.max_tokens_per_rank, s->Mll = cfg.ll_max_tokens_per_rank;
  return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Reports: every rank's counters all-reduced (a collective at the same iterations everywhere).
 * ------------------------------------------------------------------------------------------- */

enum { SUM_WRONG, SUM_UNEXPECTED, SUM_EXPECTED, NUM_SUMS };
enum { MAX_DEV_NOW, MAX_RSS_NOW, MAX_DEV_PEAK, MAX_RSS_PEAK, MAX_POINTS, NUM_MAXES };

typedef struct {
  long long sums[NUM_SUMS], maxes[NUM_MAXES];
} totals_t;

static int all_reduce(soak_rank_t *s, long long *v, int n, ncclRedOp_t op) {
  cudaStream_t st = s->t.stream;
  SOAK_CUDA(s, cudaMemcpyAsync(s->stats_dev, v, sizeof(long long) * n, cudaMemcpyHostToDevice, st));
  if (ncclAllReduce(s->stats_dev, s->stats_dev, n, ncclInt64, op, s->t.comm, st) != ncclSuccess) {
    fprintf(s->msg, "epx_soak rank %d: ncclAllReduce failed\n", s->rank);
    return -1;
  }
  SOAK_CUDA(s, cudaMemcpyAsync(v, s->stats_dev, sizeof(long long) * n, cudaMemcpyDeviceToHost, st));
  SOAK_CUDA(s, cudaStreamSynchronize(st));
  return 0;
}

/* Every rank's group destroyed before any rank reads its free memory. A rank's workspace is
 * mapped by its peers too, and its pages return to the free pool only when the last peer has
 * unmapped them: read before a slower peer's destroy, free memory is short by the old
 * workspace (seen at 4 ranks: 38 MiB short before a creation, 32 MiB back after it). */
static int all_closed(soak_rank_t *s) {
  long long one = 1;
  return all_reduce(s, &one, 1, ncclSum);
}

static int gather(soak_rank_t *s, const memory_t *m, totals_t *t) {
  t->sums[SUM_WRONG] = s->wrong;
  t->sums[SUM_UNEXPECTED] = s->unexpected_errors;
  t->sums[SUM_EXPECTED] = s->expected_errors;
  t->maxes[MAX_DEV_NOW] = m->dev_now;
  t->maxes[MAX_RSS_NOW] = m->rss_now;
  t->maxes[MAX_DEV_PEAK] = m->dev_peak;
  t->maxes[MAX_RSS_PEAK] = m->rss_peak;
  t->maxes[MAX_POINTS] = m->have_base ? m->points : -1;
  if (all_reduce(s, t->sums, NUM_SUMS, ncclSum)) return -1;
  return all_reduce(s, t->maxes, NUM_MAXES, ncclMax);
}

static void format_bytes(long long b, char *buf, size_t size) {
  const double a = b < 0 ? -(double)b : (double)b;
  if (a >= MIB)
    snprintf(buf, size, "%+.1f MiB", (double)b / MIB);
  else if (a >= 1024)
    snprintf(buf, size, "%+.1f KiB", (double)b / 1024);
  else
    snprintf(buf, size, "%+lld B", b);
}

static void format_duration(double secs, char *buf, size_t size) {
  const long long t = (long long)(secs + 0.5);
  if (t >= 3600)
    snprintf(buf, size, "%lldh%02lldm", t / 3600, t / 60 % 60);
  else
    snprintf(buf, size, "%lldm%02llds", t / 60, t % 60);
}

typedef struct {
  double t0;     /* the loop's start */
  double last_t; /* the previous report */
  long long last_done, last_calls;
} clock_state_t;

static void report_line(const soak_rank_t *s, const totals_t *t, long long done, clock_state_t *c) {
  const double now = epx_test_now_s();
  const double dt = now - c->last_t, all = now - c->t0;
  const double rate = dt > 0 ? (double)(done - c->last_done) / dt : 0;
  const double calls = dt > 0 ? (double)(s->calls - c->last_calls) / dt : 0;
  const double overall = all > 0 ? (double)done / all : 0;
  char dev[32], rss[32], eta[32];
  format_duration(overall > 0 ? (double)(s->opt->iters - done) / overall : 0, eta, sizeof eta);
  if (t->maxes[MAX_POINTS] < 0) {
    snprintf(dev, sizeof dev, "n/a (warm-up)");
    snprintf(rss, sizeof rss, "n/a");
  } else {
    format_bytes(t->maxes[MAX_DEV_NOW], dev, sizeof dev);
    format_bytes(t->maxes[MAX_RSS_NOW], rss, sizeof rss);
  }
  printf(
      "soak: iteration %lld/%lld (normal %lld, low-latency %lld), %lld wrong, async errors "
      "%lld expected %lld unexpected, device memory %s, host RSS %s, %.0f it/s, %.0f calls/s, "
      "ETA %s (group %d: shape %d, route %d)\n",
      done, s->opt->iters, s->normal_iters, s->ll_iters, t->sums[SUM_WRONG], t->sums[SUM_EXPECTED],
      t->sums[SUM_UNEXPECTED], dev, rss, rate, calls, eta, s->epoch.index, s->epoch.shape,
      s->epoch.ll_route);
  fflush(stdout);
  c->last_t = now, c->last_done = done, c->last_calls = s->calls;
}

/* ---------------------------------------------------------------------------------------------
 * One rank's run
 * ------------------------------------------------------------------------------------------- */

/* Device buffers for every shape of the plan at R ranks, and the bias pool. */
static int alloc_buffers(soak_rank_t *s) {
  int max_tokens = 0, max_hidden = 0, max_k = 0, max_e = 0;
  size_t y_elems = 0, bias_elems = 0;
  for (int i = 0; i < soak_num_shapes; i++) {
    const soak_shape_t *sh = &soak_shapes[i];
    const int E = sh->experts_per_rank * s->R, M = sh->max_tokens, H = sh->hidden;
    if (M > max_tokens) max_tokens = M;
    if (H > max_hidden) max_hidden = H;
    if (sh->top_k > max_k) max_k = sh->top_k;
    if (E > max_e) max_e = E;
    const size_t normal_y = (size_t)s->R * M * H, ll_y = (size_t)E * sh->ll_max_tokens * H;
    if (normal_y > y_elems) y_elems = normal_y;
    if (ll_y > y_elems) y_elems = ll_y;
    if ((size_t)2 * M * H > bias_elems) bias_elems = (size_t)2 * M * H;
  }
  world_t shape; /* only what world_dev_alloc reads */
  memset(&shape, 0, sizeof shape);
  shape.M = max_tokens, shape.H = max_hidden, shape.K = max_k, shape.payload = WORLD_NORMAL;
  if (world_dev_alloc(&shape, y_elems / max_hidden + 1, &s->d) != TEST_PASS) return -1;
  s->bias_elems = bias_elems;
  s->bias_host = malloc(bias_elems * 2);
  uint64_t rng = soak_mix(s->opt->seed ^ (0xB1A5B1A5ull + (uint64_t)s->rank));
  for (size_t i = 0; i < bias_elems; i++)
    s->bias_host[i] = epx_ref_bf16_from_float(2.f * epx_test_rand_unit(&rng) - 1.f);
  SOAK_CUDA(s, cudaMalloc(&s->bias_dev, bias_elems * 2));
  SOAK_CUDA(s, cudaMemcpy(s->bias_dev, s->bias_host, bias_elems * 2, cudaMemcpyHostToDevice));
  SOAK_CUDA(s, cudaMalloc((void **)&s->out_w_dev, (size_t)max_tokens * max_k * 4 + 16));
  SOAK_CUDA(s, cudaMalloc((void **)&s->cw_dev, (size_t)max_tokens * max_k * 4 + 16));
  SOAK_CUDA(s, cudaMalloc((void **)&s->range_dev, (size_t)max_e * 8 + 16));
  SOAK_CUDA(s, cudaMalloc((void **)&s->stats_dev, 16 * sizeof(long long)));
  SOAK_CUDA(s, cudaDeviceSynchronize());
  return 0;
}

static void free_buffers(soak_rank_t *s) {
  world_dev_free(&s->d);
  cudaFree(s->bias_dev), cudaFree(s->out_w_dev), cudaFree(s->cw_dev), cudaFree(s->range_dev);
  cudaFree(s->stats_dev);
  free(s->bias_host);
}

static void print_header(const soak_rank_t *s) {
  const soak_options_t *o = s->opt;
  printf(
      "soak: %d ranks, seed %llu, iterations [%lld, %lld), results checked every %d, report "
      "every %d; warm-up %d iterations (every shape), then a new shape every %d-%d; "
      "tolerances: device %.1f MiB, host RSS %.1f MiB; CUDA_MODULE_LOADING=%s\n",
      s->R, (unsigned long long)o->seed, o->start, o->start + o->iters, o->check_every,
      o->report_every, SOAK_WARMUP_ITERS, SOAK_EPOCH_MIN_ITERS, SOAK_EPOCH_MAX_ITERS,
      o->max_device_growth_mib, o->max_rss_growth_mib,
      getenv("CUDA_MODULE_LOADING") ? getenv("CUDA_MODULE_LOADING") : "(unset)");
  for (int i = 0; i < soak_num_shapes; i++) {
    const soak_shape_t *sh = &soak_shapes[i];
    printf("soak: shape %d: hidden %d, max tokens %d (low-latency %d), %d experts, top-%d\n", i,
           sh->hidden, sh->max_tokens, sh->ll_max_tokens, sh->experts_per_rank * s->R, sh->top_k);
  }
  fflush(stdout);
}

/* The verdict and the summary line (rank 0 prints; every rank returns the same code). */
static int summary(const soak_rank_t *s, const totals_t *t, double secs) {
  const soak_options_t *o = s->opt;
  const long long wrong = t->sums[SUM_WRONG], unexpected = t->sums[SUM_UNEXPECTED];
  const int judged = t->maxes[MAX_POINTS] > 0;
  const long long dev = t->maxes[MAX_DEV_PEAK], rss = t->maxes[MAX_RSS_PEAK];
  const int dev_bad = judged && (double)dev > o->max_device_growth_mib * MIB;
  const int rss_bad = judged && (double)rss > o->max_rss_growth_mib * MIB;
  const int failed = wrong > 0 || unexpected > 0 || dev_bad || rss_bad;
  if (s->rank == 0) {
    char dev_s[64], rss_s[64], reasons[256] = "";
    if (judged) {
      snprintf(dev_s, sizeof dev_s, "%lld bytes", dev);
      snprintf(rss_s, sizeof rss_s, "%lld bytes", rss);
    } else {
      snprintf(dev_s, sizeof dev_s, "n/a");
      snprintf(rss_s, sizeof rss_s, "n/a");
    }
    if (wrong) strcat(reasons, " wrong results;");
    if (unexpected) strcat(reasons, " unexpected async errors;");
    if (dev_bad) strcat(reasons, " device memory grew;");
    if (rss_bad) strcat(reasons, " host memory grew;");
    printf(
        "soak: async errors: %lld expected (bad ids: reported, then cleared), %lld unexpected; "
        "memory %s (peak growth after the warm-up, max over ranks; tolerances device %.1f "
        "MiB, host RSS %.1f MiB); %lld EPX calls per rank\n",
        t->sums[SUM_EXPECTED], unexpected,
        judged ? "judged" : "not judged (no measurement after the warm-up's group boundary)",
        o->max_device_growth_mib, o->max_rss_growth_mib, s->calls);
    printf(
        "soak: %lld iterations (normal %lld, low-latency %lld), %lld wrong, device memory delta "
        "%s, host RSS delta %s, %.0f s: %s%s\n",
        s->normal_iters + s->ll_iters, s->normal_iters, s->ll_iters, wrong, dev_s, rss_s, secs,
        failed ? "FAILED:" : "passed", reasons);
    fflush(stdout);
  }
  return failed ? EXIT_VERDICT : 0;
}

static int run_loop(soak_rank_t *s) {
  const soak_options_t *o = s->opt;
  memory_t m;
  memset(&m, 0, sizeof m);
  clock_state_t c = {epx_test_now_s(), 0, 0, 0};
  c.last_t = c.t0;
  totals_t t;
  const long long end = o->start + o->iters;
  for (long long it = o->start; it < end; it++) {
    progress(it);
    if (!s->g || it >= s->epoch.end) {
      if (close_group(s) || all_closed(s)) return EXIT_FATAL;
      at_boundary(s, &m, it);
      if (open_group(s, &m, it)) return EXIT_FATAL;
    }
    soak_iter_t p;
    soak_plan(o->seed, it, &s->epoch, s->R, &p);
    s->plan = &p;
    const int check = (it - o->start) % o->check_every == 0;
    if (s->wrong >= SOAK_PRINT_WRONG) soak_mute(s);
    const int rc = p.mode == SOAK_MODE_LL ? soak_ll_iteration(s, &p, check)
                                          : soak_normal_iteration(s, &p, check);
    soak_unmute(s);
    s->plan = NULL;
    if (rc) return EXIT_FATAL;
    const long long done = it - o->start + 1;
    if (done % o->report_every == 0 && it + 1 < end) {
      measure(&m, 1);
      if (m.have_base && (double)m.dev_now > o->max_device_growth_mib * MIB)
        /* Which rank, and the readings behind it: a device reading that comes and goes with
         * a group (seen at 4 ranks, docs/testing.md) is still unexplained. */
        fprintf(s->msg,
                "epx_soak rank %d: iteration %lld: device growth %lld bytes (free at the baseline "
                "%lld, before this group's creation %lld, after it %lld, now %lld; group %d, "
                "shape %d, route %d)\n",
                s->rank, it, m.dev_now, m.base_free, m.before_create, m.after_create,
                device_free_bytes(), s->epoch.index, s->epoch.shape, s->epoch.ll_route);
      if (gather(s, &m, &t)) return EXIT_FATAL;
      if (s->rank == 0) report_line(s, &t, done, &c);
    }
  }
  progress(end);
  if (close_group(s) || all_closed(s)) return EXIT_FATAL;
  at_boundary(s, &m, end);
  if (gather(s, &m, &t)) return EXIT_FATAL;
  if (s->rank == 0) report_line(s, &t, o->iters, &c);
  return summary(s, &t, epx_test_now_s() - c.t0);
}

/* One rank's process (a ranks_fn; arg is the options). */
static int rank_main(int rank, int num_ranks, const ncclUniqueId *id, void *arg) {
  soak_rank_t s;
  memset(&s, 0, sizeof s);
  s.opt = (const soak_options_t *)arg;
  s.rank = rank, s.R = num_ranks;
  s.muted_fd = -1;
  s.msg = stderr;
  s.t.rank = rank, s.t.num_ranks = num_ranks, s.t.seed = s.opt->seed;
  stall_rank = rank, stall_s = s.opt->stall_s;
  signal(SIGALRM, on_stall);
  progress(-1);
  /* Freed memory stays in the heap (no trimming, no per-block mmap below 32 MiB): resident
   * memory is then the heap's high-water mark, which only a leak keeps raising once every
   * shape has been seen, and the references' large arrays cost no page faults each time. */
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  /* The check helpers print to stderr, which is muted after a few wrong results; our own
   * messages go to a copy of it. */
  const int msg_fd = dup(STDERR_FILENO);
  FILE *msg = msg_fd >= 0 ? fdopen(msg_fd, "w") : NULL;
  if (msg) setvbuf(msg, NULL, _IONBF, 0), s.msg = msg;

  if (cudaSetDevice(rank) != cudaSuccess) return EXIT_FATAL;
  const ncclResult_t nr = ncclCommInitRank(&s.t.comm, num_ranks, *id, rank);
  if (nr != ncclSuccess) {
    fprintf(s.msg, "epx_soak rank %d: ncclCommInitRank: %s\n", rank, ncclGetErrorString(nr));
    return EXIT_FATAL;
  }
  if (cudaStreamCreateWithFlags(&s.t.stream, cudaStreamNonBlocking) != cudaSuccess)
    return EXIT_FATAL;
  if (alloc_buffers(&s)) return EXIT_FATAL;
  /* One all-reduce before the loop: NCCL's lazy setup of the collective is not a leak. */
  long long one = 1;
  if (all_reduce(&s, &one, 1, ncclSum)) return EXIT_FATAL;
  if (rank == 0) print_header(&s);

  const int code = run_loop(&s);
  alarm(0);
  if (code == EXIT_FATAL) {
    /* Peers may wait for this rank in a collective: leave without waiting for them. */
    ncclCommAbort(s.t.comm);
    return code;
  }
  free_buffers(&s);
  cudaStreamDestroy(s.t.stream);
  ncclCommDestroy(s.t.comm);
  if (msg) fclose(msg);
  return code;
}

/* ---------------------------------------------------------------------------------------------
 * main
 * ------------------------------------------------------------------------------------------- */

static void usage(FILE *f) {
  fprintf(f,
          "usage: epx_soak [--iters N] [--start I] [--ranks R] [--seed S] [--timeout-s T]\n"
          "                [--stall-s T] [--check-every K] [--report-every M]\n"
          "                [--max-device-growth-mib X] [--max-rss-growth-mib X] [--print-plan]\n"
          "  --iters N        iterations to run (default 100000), [I, I + N)\n"
          "  --start I        first iteration (default 0): --start I --iters 1 reruns the\n"
          "                   inputs and options of iteration I\n"
          "  --ranks R        ranks, one GPU each (default: every visible GPU, at most 8)\n"
          "  --seed S         the plan's seed (default: from the clock, printed)\n"
          "  --timeout-s T    the whole run, then every rank is killed (default 300 + 0.03 s\n"
          "                   per iteration)\n"
          "  --stall-s T      a rank with no progress this long exits (default 300; 0: never)\n"
          "  --check-every K  check the results of every K-th iteration (default 1: all)\n"
          "  --report-every M a report line every M iterations (default 1000)\n"
          "  --max-device-growth-mib X, --max-rss-growth-mib X  memory tolerances after the\n"
          "                   warm-up (default 8 and 16)\n"
          "  --print-plan     print what each iteration does (at --ranks, default 2) and exit;\n"
          "                   needs no GPU\n");
}

static int parse_ll(const char *s, long long min, long long *out) {
  char *end = NULL;
  errno = 0;
  const long long v = strtoll(s, &end, 0);
  if (errno || !end || *end || v < min) return -1;
  *out = v;
  return 0;
}

/* 0: parsed; 1: --help; 2: bad usage. */
static int parse_options(int argc, char **argv, soak_options_t *o) {
  memset(o, 0, sizeof *o);
  o->iters = 100000;
  o->stall_s = 300;
  o->check_every = 1;
  o->report_every = 1000;
  o->max_device_growth_mib = 8;
  o->max_rss_growth_mib = 16;
  int have_seed = 0, have_timeout = 0;
  for (int i = 1; i < argc; i++) {
    const char *f = argv[i];
    if (!strcmp(f, "--help") || !strcmp(f, "-h")) {
      usage(stdout);
      return 1;
    }
    if (!strcmp(f, "--print-plan")) {
      o->print_plan = 1;
      continue;
    }
    if (i + 1 >= argc) {
      fprintf(stderr, "epx_soak: %s needs a value\n", f);
      return 2;
    }
    const char *v = argv[++i];
    long long n = 0;
    int bad = 0;
    if (!strcmp(f, "--iters")) {
      bad = parse_ll(v, 1, &o->iters);
    } else if (!strcmp(f, "--start")) {
      bad = parse_ll(v, 0, &o->start);
    } else if (!strcmp(f, "--ranks")) {
      bad = parse_ll(v, 2, &n) || n > EPX_MAX_RANKS, o->ranks = (int)n;
    } else if (!strcmp(f, "--seed")) {
      char *end = NULL;
      o->seed = strtoull(v, &end, 0), bad = !end || *end, have_seed = 1;
    } else if (!strcmp(f, "--timeout-s")) {
      bad = parse_ll(v, 1, &n) || n > 1000000, o->timeout_s = (int)n, have_timeout = 1;
    } else if (!strcmp(f, "--stall-s")) {
      bad = parse_ll(v, 0, &n) || n > 1000000, o->stall_s = (int)n;
    } else if (!strcmp(f, "--check-every")) {
      bad = parse_ll(v, 1, &n) || n > 1000000000, o->check_every = (int)n;
    } else if (!strcmp(f, "--report-every")) {
      bad = parse_ll(v, 1, &n) || n > 1000000000, o->report_every = (int)n;
    } else if (!strcmp(f, "--max-device-growth-mib")) {
      char *end = NULL;
      o->max_device_growth_mib = strtod(v, &end), bad = !end || *end;
    } else if (!strcmp(f, "--max-rss-growth-mib")) {
      char *end = NULL;
      o->max_rss_growth_mib = strtod(v, &end), bad = !end || *end;
    } else {
      fprintf(stderr, "epx_soak: unknown flag %s\n", f);
      usage(stderr);
      return 2;
    }
    if (bad) {
      fprintf(stderr, "epx_soak: bad value for %s: %s\n", f, v);
      return 2;
    }
  }
  if (!have_seed) {
    const char *env = getenv("EPX_TEST_SEED");
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    o->seed = env && *env ? strtoull(env, NULL, 0)
                          : (uint64_t)ts.tv_sec * 1000003u ^ (uint64_t)ts.tv_nsec;
  }
  if (!have_timeout) {
    const double t = 300 + 0.03 * (double)o->iters;
    o->timeout_s = t > 1000000 ? 1000000 : (int)t;
  }
  return 0;
}

/* --print-plan: every iteration's plan, one line each; no GPU. */
static void print_plan(const soak_options_t *o) {
  const int R = o->ranks ? o->ranks : 2;
  soak_epoch_t e = {0, 0, -1, 0, 0};
  for (long long it = o->start; it < o->start + o->iters; it++) {
    if (it >= e.end || e.index < 0) {
      soak_epoch_of(o->seed, it, &e);
      printf("soak: epoch %d: iterations [%lld, %lld), shape %d, low-latency route %d\n", e.index,
             e.begin, e.end, e.shape, e.ll_route);
    }
    soak_iter_t p;
    char line[512];
    soak_plan(o->seed, it, &e, R, &p);
    soak_plan_describe(&p, &e, line, sizeof line);
    printf("soak: iteration %lld: %s\n", it, line);
  }
}

int main(int argc, char **argv) {
  /* NVLink multicast stays off on our machines, whatever the caller's environment says. */
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  /* Every kernel loaded when CUDA starts: a kernel first used late in the run would otherwise
   * load then and take device memory that is no leak. The caller's choice wins. */
  setenv("CUDA_MODULE_LOADING", "EAGER", 0);
  soak_options_t opt;
  const int parsed = parse_options(argc, argv, &opt);
  if (parsed) return parsed == 1 ? 0 : 2;
  if (opt.print_plan) {
    print_plan(&opt);
    return 0;
  }

  const int visible = ranks_count_gpus("epx_soak", COUNT_TIMEOUT_S);
  const int want = opt.ranks ? opt.ranks : visible < EPX_MAX_RANKS ? visible : EPX_MAX_RANKS;
  if (visible < 2 || want > visible) {
    printf("soak: skipped, %d GPUs visible%s\n", visible,
           opt.ranks > visible ? " (--ranks asks for more)" : "");
    return 0;
  }
  opt.ranks = want;
  for (int i = 0; i < soak_num_shapes; i++) {
    soak_epoch_t e = {0, 1, 0, i, EPX_LL_ROUTE_DIRECT};
    const epx_group_config_t cfg = group_config(&e, want);
    if (epx_config_validate(&cfg, want) != EPX_OK) {
      fprintf(stderr, "epx_soak: shape %d at %d ranks: %s\n", i, want, epx_last_error());
      return 2;
    }
  }
  const ranks_config_t rc = {"epx_soak", opt.timeout_s, FAILURE_GRACE_S, 0, "--timeout-s", 0};
  int codes[EPX_MAX_RANKS];
  const int failed = ranks_run(&rc, want, rank_main, &opt, codes);
  int summarized = 1;
  for (int r = 0; r < want; r++) summarized &= codes[r] == 0 || codes[r] == EXIT_VERDICT;
  if (!summarized)
    printf(
        "soak: FAILED before the summary (seed %llu, %d ranks): a rank exited with code 3 (an "
        "EPX or CUDA call failed, or the group broke), 4 (no progress for --stall-s) or was "
        "killed (--timeout-s, or a peer failed); see the messages above\n",
        (unsigned long long)opt.seed, want);
  return failed ? 1 : 0;
}

/*
 * runner.c - the test runner's main: registry, process isolation, timeouts, GPU rank trees.
 *
 * Usage: epx_test [--filter SUBSTR] [--ranks 2,4] [--seed N] [--shard I/N] [--list]
 * --shard I/N runs every N-th of the selected (test, rank count) runs from the I-th on, so N
 * calls with I = 0 .. N-1 run the whole selection once (a machine's per-call time limit).
 * Process tree of a GPU test: runner -> leader (own process group) -> R rank processes. The
 * runner kills the whole group when the test's timeout expires, so a hung kernel or a stuck
 * NCCL call ends as a failure, never as a hang of the suite. Forking the ranks and relaying
 * rank 0's NCCL unique id is tests/common/ranks.c, shared with the benchmark.
 */
#include "common/runner.h"

#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/ranks.h"

#define MAX_TESTS 256

typedef struct {
  const char *name;
  epx_host_test_fn host_fn;
  epx_gpu_test_fn gpu_fn;
  int timeout_s;
  int one_gpu;        /* host_fn needs one GPU: run once, in its own process, when one is visible */
  int min_ranks;      /* a GPU test's smallest meaningful rank count (2: it needs a peer) */
  int last_rank_dies; /* EPX_DYING_PEER_TEST: its last rank kills itself (epx_test_die) */
} test_entry_t;

static test_entry_t tests[MAX_TESTS];
static int num_tests;
static uint64_t current_seed;

static void add_test(const char *name, epx_host_test_fn h, epx_gpu_test_fn g, int timeout_s,
                     int one_gpu, int min_ranks, int last_rank_dies) {
  if (num_tests == MAX_TESTS) {
    fprintf(stderr, "runner: more than %d tests; raise MAX_TESTS\n", MAX_TESTS);
    exit(2);
  }
  tests[num_tests++] = (test_entry_t){
      name, h, g, timeout_s > 0 ? timeout_s : 60, one_gpu, min_ranks, last_rank_dies};
}
void epx_test_register_host(const char *name, epx_host_test_fn fn, int timeout_s) {
  add_test(name, fn, NULL, timeout_s, 0, 0, 0);
}
void epx_test_register_one_gpu(const char *name, epx_host_test_fn fn, int timeout_s) {
  add_test(name, fn, NULL, timeout_s, 1, 0, 0);
}
void epx_test_register_gpu(const char *name, epx_gpu_test_fn fn, int timeout_s, int min_ranks) {
  add_test(name, NULL, fn, timeout_s, 0, min_ranks, 0);
}
void epx_test_register_dying_peer(const char *name, epx_gpu_test_fn fn, int timeout_s) {
  add_test(name, NULL, fn, timeout_s, 0, 2, 1);
}
void epx_test_die(void) {
  fflush(stdout);
  fflush(stderr);
  kill(getpid(), SIGKILL);
  for (;;) pause();
}
uint64_t epx_test_seed(void) {
  return current_seed;
}

/* Wait for the test's process up to timeout_s; kill its process group on expiry. Returns the
 * exit code, or -1 for a timeout, or 128+signal. */
static int wait_with_timeout(pid_t pid, int timeout_s) {
  int status = 0;
  const int r = ranks_wait(pid, timeout_s, &status);
  if (r == -1) return -1;
  if (r != 0) return TEST_FAIL;
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return TEST_FAIL;
}

/* One rank process (a ranks_fn; arg is the test): NCCL communicator, the test, teardown. */
static int run_rank(int rank, int num_ranks, const ncclUniqueId *id, void *arg) {
  const test_entry_t *t = (const test_entry_t *)arg;
  epx_test_rank_t ctx = {rank, num_ranks, NULL, NULL, current_seed};
  if (cudaSetDevice(rank) != cudaSuccess) return TEST_FAIL;
  ncclResult_t nr = ncclCommInitRank(&ctx.comm, num_ranks, *id, rank);
  if (nr != ncclSuccess) {
    fprintf(stderr, "  rank %d: ncclCommInitRank: %s\n", rank, ncclGetErrorString(nr));
    return TEST_FAIL;
  }
  if (cudaStreamCreateWithFlags(&ctx.stream, cudaStreamNonBlocking) != cudaSuccess)
    return TEST_FAIL;
  int code = t->gpu_fn(&ctx);
  if (code != TEST_PASS)
    fprintf(stderr, "  rank %d: %s\n", rank, code == TEST_SKIP ? "skipped" : "failed");
  if (code == TEST_FAIL || t->last_rank_dies) {
    /* Peers may be waiting for this rank in a collective, or a peer is dead on purpose: leave
     * without waiting for them (ncclCommDestroy or a stream sync could hang until the test's
     * timeout); aborting is what an application does after a peer died. */
    ncclCommAbort(ctx.comm);
    return code;
  }
  cudaStreamSynchronize(ctx.stream);
  cudaStreamDestroy(ctx.stream);
  ncclCommDestroy(ctx.comm);
  return code;
}

/* The leader: forks the ranks, relays the unique id (tests/common/ranks.c), folds their exit
 * codes. No deadline of its own: the runner kills the whole process group at the timeout. */
static int run_leader(const test_entry_t *t, int num_ranks) {
  /* Once a rank has failed, the others get 20 s (they may wait for it in a collective). */
  const ranks_config_t config = {"epx_test", 0, 20, TEST_SKIP, NULL, t->last_rank_dies};
  int codes[EPX_MAX_RANKS];
  if (ranks_run(&config, num_ranks, run_rank, (void *)t, codes) != 0) return TEST_FAIL;
  for (int r = 0; r < num_ranks; r++)
    if (codes[r] == TEST_SKIP) return TEST_SKIP;
  return TEST_PASS;
}

static int run_isolated(const test_entry_t *t, int num_ranks) {
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  if (pid < 0) return TEST_FAIL;
  if (pid == 0) {
    setpgid(0, 0);
    int code = t->host_fn ? t->host_fn() : run_leader(t, num_ranks);
    fflush(stdout); /* _exit does not flush stdio */
    fflush(stderr);
    _exit(code);
  }
  setpgid(pid, pid);
  return wait_with_timeout(pid, t->timeout_s);
}

int epx_test_case_selected(const char *name) {
  const char *words = getenv("EPX_TEST_CASES");
  if (!words || !*words) return 1;
  char buf[512];
  snprintf(buf, sizeof buf, "%s", words);
  for (char *save = NULL, *w = strtok_r(buf, ",", &save); w; w = strtok_r(NULL, ",", &save))
    if (*w && strstr(name, w)) return 1;
  return 0;
}

static uint64_t initial_seed(uint64_t given, int have_given) {
  if (have_given) return given;
  const char *env = getenv("EPX_TEST_SEED");
  if (env && *env) return strtoull(env, NULL, 0);
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (uint64_t)ts.tv_sec * 1000003u ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)getpid() << 32);
}

int main(int argc, char **argv) {
  const char *filter = NULL;
  int rank_list[8] = {1, 2, 4}, num_rank_list = 3, list_only = 0, have_seed = 0;
  int shard = 0, shards = 1, selected = 0;
  uint64_t seed = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--filter") && i + 1 < argc) {
      filter = argv[++i];
    } else if (!strcmp(argv[i], "--seed") && i + 1 < argc) {
      seed = strtoull(argv[++i], NULL, 0);
      have_seed = 1;
    } else if (!strcmp(argv[i], "--ranks") && i + 1 < argc) {
      num_rank_list = 0;
      for (char *tok = strtok(argv[++i], ","); tok && num_rank_list < 8; tok = strtok(NULL, ","))
        rank_list[num_rank_list++] = atoi(tok);
    } else if (!strcmp(argv[i], "--list")) {
      list_only = 1;
    } else if (!strcmp(argv[i], "--shard") && i + 1 < argc &&
               sscanf(argv[i + 1], "%d/%d", &shard, &shards) == 2 && shards >= 1 && shard >= 0 &&
               shard < shards) {
      i++;
    } else {
      fprintf(stderr,
              "usage: %s [--filter SUBSTR] [--ranks 1,2,4] [--seed N] [--shard I/N (0 <= I < N)] "
              "[--list]\n",
              argv[0]);
      return 2;
    }
  }
  /* NVLink multicast stays off on our machines, whatever the caller's environment says. */
  setenv("NCCL_NVLS_ENABLE", "0", 1);

  seed = initial_seed(seed, have_seed);
  int num_gpus = -1; /* counted on first GPU test */
  int passed = 0, failed = 0, skipped = 0;
  printf("epx_test: seed %llu (rerun with --seed %llu)\n", (unsigned long long)seed,
         (unsigned long long)seed);
  for (int i = 0; i < num_tests; i++) {
    const test_entry_t *t = &tests[i];
    if (filter && !strstr(t->name, filter)) continue;
    int variants = t->host_fn ? 1 : num_rank_list;
    for (int v = 0; v < variants; v++) {
      int ranks = t->host_fn ? 0 : rank_list[v];
      if (selected++ % shards != shard) continue;
      char label[160];
      if (t->host_fn)
        snprintf(label, sizeof label, t->one_gpu ? "%s [1 GPU]" : "%s", t->name);
      else
        snprintf(label, sizeof label, "%s [%d ranks]", t->name, ranks);
      if (list_only) {
        printf("%s\n", label);
        continue;
      }
      /* Each test gets its own seed derived from the run's seed, printed with the result. */
      uint64_t s = seed ^ (0x9E3779B97F4A7C15ull * (uint64_t)(i * 16 + v + 1));
      current_seed = s;
      if ((t->one_gpu || !t->host_fn) && num_gpus < 0) num_gpus = ranks_count_gpus("epx_test", 60);
      if (t->one_gpu) {
        if (num_gpus < 1) {
          printf("[ SKIP ] %s: needs 1 GPU, %d visible\n", label, num_gpus);
          skipped++;
          continue;
        }
      } else if (!t->host_fn) {
        if (ranks < 1 || ranks > EPX_MAX_RANKS || ranks > num_gpus) {
          printf("[ SKIP ] %s: needs %d GPUs, %d visible\n", label, ranks, num_gpus);
          skipped++;
          continue;
        }
        if (ranks < t->min_ranks) {
          printf("[ SKIP ] %s: needs a peer (%d+ ranks)\n", label, t->min_ranks);
          skipped++;
          continue;
        }
      }
      printf("[ RUN  ] %s (seed %llu)\n", label, (unsigned long long)s);
      fflush(stdout);
      double t0 = epx_test_now_s();
      int code = run_isolated(t, ranks);
      double dt = epx_test_now_s() - t0;
      if (code == TEST_PASS) {
        printf("[ PASS ] %s (%.2f s)\n", label, dt);
        passed++;
      } else if (code == TEST_SKIP) {
        printf("[ SKIP ] %s (%.2f s)\n", label, dt);
        skipped++;
      } else if (code == -1) {
        printf("[ FAIL ] %s: timed out after %d s (seed %llu)\n", label, t->timeout_s,
               (unsigned long long)s);
        failed++;
      } else {
        printf("[ FAIL ] %s: exit code %d (seed %llu)\n", label, code, (unsigned long long)s);
        failed++;
      }
      fflush(stdout);
    }
  }
  if (list_only) return 0;
  printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
  return failed ? 1 : 0;
}

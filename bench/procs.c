/*
 * procs.c - epx_bench's processes: counting GPUs and running one process per rank.
 *
 * The parent never initializes CUDA (a forked child of a CUDA process cannot use CUDA): GPUs
 * are counted in a short-lived child, and each rank is a child that sets up CUDA itself.
 * Bootstrap: rank 0 calls ncclGetUniqueId and writes the id into a pipe; the parent relays it
 * to every other rank through one pipe each. Every pipe end a process does not use is closed,
 * so a rank that dies before writing shows up as end-of-file, never as a hang.
 * Supervision: the parent polls its children until all have exited or --timeout expires; once
 * one rank has failed, the others get a short grace period (they may be stuck in a collective
 * waiting for it). Children still running then are killed (by pid, only our own children).
 */
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"

#define COUNT_TIMEOUT_S 60
#define FAILURE_GRACE_S 30

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int write_all(int fd, const void *buf, size_t n) {
  const char *p = (const char *)buf;
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return -1;
    p += w;
    n -= (size_t)w;
  }
  return 0;
}

/* Read exactly n bytes before the deadline (CLOCK_MONOTONIC seconds). */
static int read_all(int fd, void *buf, size_t n, double deadline) {
  char *p = (char *)buf;
  while (n > 0) {
    int wait_ms = (int)((deadline - now_s()) * 1000);
    if (wait_ms <= 0) return -1;
    struct pollfd pfd = {fd, POLLIN, 0};
    int ready = poll(&pfd, 1, wait_ms);
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) return -1;
    ssize_t r = read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return -1;
    p += r;
    n -= (size_t)r;
  }
  return 0;
}

/* Exit code of pid, waiting at most timeout_s, then killing it: -1 if killed or abnormal. */
static int wait_one(pid_t pid, int timeout_s) {
  double deadline = now_s() + timeout_s;
  for (;;) {
    int status;
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    if (r < 0 && errno != EINTR) return -1;
    if (now_s() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -1;
    }
    usleep(2000);
  }
}

int bench_count_gpus(void) {
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  if (pid < 0) {
    perror("epx_bench: fork");
    return 0;
  }
  if (pid == 0) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
      fprintf(stderr, "epx_bench: cudaGetDeviceCount: %s\n", cudaGetErrorString(e));
      n = 0;
    }
    fflush(stderr);
    _exit(n > 100 ? 100 : n);
  }
  int code = wait_one(pid, COUNT_TIMEOUT_S);
  return code < 0 ? 0 : code;
}

typedef struct launch {
  int num_ranks;
  int up[2];                  /* rank 0 -> parent: the unique id */
  int down[EPX_MAX_RANKS][2]; /* parent -> rank r: the unique id */
  pid_t pids[EPX_MAX_RANKS];
} launch_t;

/* The child of rank r: keep only its own pipe ends, bootstrap the id, run. Never returns. */
static void run_child(launch_t *l, int r, const bench_options_t *opt, bench_rank_fn fn) {
  close(l->up[0]);
  if (r != 0) close(l->up[1]);
  for (int q = 0; q < l->num_ranks; q++) {
    close(l->down[q][1]);
    if (q != r || r == 0) close(l->down[q][0]);
  }
  bench_log_rank = r;
  ncclUniqueId id;
  int code = 1;
  if (r == 0) {
    ncclResult_t nr = ncclGetUniqueId(&id);
    if (nr != ncclSuccess)
      fprintf(stderr, "epx_bench rank 0: ncclGetUniqueId: %s\n", ncclGetErrorString(nr));
    else if (write_all(l->up[1], &id, sizeof id))
      perror("epx_bench rank 0: sending the NCCL id");
    else
      code = 0;
    close(l->up[1]);
  } else {
    /* The parent closes this pipe if rank 0 fails; the deadline only guards a lost parent. */
    code = read_all(l->down[r][0], &id, sizeof id, now_s() + opt->timeout_s) ? 1 : 0;
    if (code) fprintf(stderr, "epx_bench rank %d: no NCCL id from rank 0\n", r);
    close(l->down[r][0]);
  }
  if (code == 0) code = fn(opt, r, l->num_ranks, &id);
  fflush(stdout); /* _exit does not flush stdio */
  fflush(stderr);
  _exit(code);
}

/* Parent: relay rank 0's id to the others, then close every pipe end. */
static void relay_id(launch_t *l, double deadline) {
  ncclUniqueId id;
  if (read_all(l->up[0], &id, sizeof id, deadline) == 0) {
    for (int r = 1; r < l->num_ranks; r++)
      if (write_all(l->down[r][1], &id, sizeof id))
        fprintf(stderr, "epx_bench: could not send the NCCL id to rank %d\n", r);
  } else {
    fprintf(stderr, "epx_bench: rank 0 sent no NCCL id\n");
  }
  close(l->up[0]);
  for (int r = 0; r < l->num_ranks; r++) close(l->down[r][1]);
}

/* Wait for every rank; kill the rest at the deadline. Returns 0 if all exited with 0. */
static int wait_ranks(launch_t *l, double deadline, int timeout_s) {
  int done[EPX_MAX_RANKS] = {0}, remaining = l->num_ranks, failed = 0;
  while (remaining > 0) {
    for (int r = 0; r < l->num_ranks; r++) {
      int status;
      if (done[r] || waitpid(l->pids[r], &status, WNOHANG) != l->pids[r]) continue;
      done[r] = 1;
      remaining--;
      if (WIFEXITED(status) && WEXITSTATUS(status) == 0) continue;
      if (WIFEXITED(status))
        fprintf(stderr, "epx_bench: rank %d exited with code %d\n", r, WEXITSTATUS(status));
      else if (WIFSIGNALED(status))
        fprintf(stderr, "epx_bench: rank %d killed by signal %d\n", r, WTERMSIG(status));
      if (!failed && remaining > 0 && deadline > now_s() + FAILURE_GRACE_S)
        deadline = now_s() + FAILURE_GRACE_S;
      failed = 1;
    }
    if (remaining > 0 && now_s() > deadline) {
      if (failed)
        fprintf(stderr, "epx_bench: killing %d rank(s) still running after a failure\n", remaining);
      else
        fprintf(stderr, "epx_bench: killing %d rank(s): the run exceeded --timeout %d s\n",
                remaining, timeout_s);
      for (int r = 0; r < l->num_ranks; r++) {
        if (done[r]) continue;
        kill(l->pids[r], SIGKILL);
        waitpid(l->pids[r], NULL, 0);
      }
      return 1;
    }
    if (remaining > 0) usleep(10000);
  }
  return failed;
}

int bench_launch(const bench_options_t *opt, int num_ranks, bench_rank_fn fn) {
  launch_t l;
  memset(&l, 0, sizeof l);
  l.num_ranks = num_ranks;
  if (pipe(l.up)) {
    perror("epx_bench: pipe");
    return 1;
  }
  for (int r = 0; r < num_ranks; r++) {
    if (pipe(l.down[r])) {
      perror("epx_bench: pipe");
      return 1;
    }
  }
  const double deadline = now_s() + opt->timeout_s;
  fflush(stdout); /* or the children would print the parent's buffered output again */
  fflush(stderr);
  int forked = 0;
  for (; forked < num_ranks; forked++) {
    l.pids[forked] = fork();
    if (l.pids[forked] < 0) break;
    if (l.pids[forked] == 0) run_child(&l, forked, opt, fn);
  }
  /* NOTE: from here on a write to a dead rank's pipe must fail with EPIPE, not kill us. */
  signal(SIGPIPE, SIG_IGN);
  close(l.up[1]);
  for (int r = 0; r < num_ranks; r++) close(l.down[r][0]);
  if (forked < num_ranks) {
    perror("epx_bench: fork");
    l.num_ranks = forked; /* the pipes' closing ends the forked ones; reap them */
    for (int r = 0; r < num_ranks; r++) close(l.down[r][1]);
    close(l.up[0]);
    wait_ranks(&l, deadline, opt->timeout_s);
    return 1;
  }
  relay_id(&l, deadline);
  return wait_ranks(&l, deadline, opt->timeout_s);
}

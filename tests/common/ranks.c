/*
 * ranks.c - one process per GPU for the test runner and the benchmark (see ranks.h): counting
 * GPUs in a child, forking the ranks, relaying rank 0's NCCL unique id through pipes, and
 * supervising the ranks under a deadline with a grace period after the first failure.
 */
#include "common/ranks.h"

#include <errno.h>
#include <execinfo.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* A deadline (CLOCK_MONOTONIC seconds) timeout_s from now; HUGE_VAL when timeout_s is 0. */
static double deadline_in(int timeout_s) {
  return timeout_s > 0 ? now_s() + timeout_s : HUGE_VAL;
}

/* Milliseconds left until deadline, for poll(): -1 for no deadline, 0 once it has passed. */
static int ms_until(double deadline) {
  if (deadline == HUGE_VAL) return -1;
  const double ms = (deadline - now_s()) * 1000;
  return ms <= 0 ? 0 : ms >= INT_MAX ? INT_MAX : (int)ms;
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

/* Read exactly n bytes before the deadline. */
static int read_all(int fd, void *buf, size_t n, double deadline) {
  char *p = (char *)buf;
  while (n > 0) {
    const int wait_ms = ms_until(deadline);
    if (wait_ms == 0) return -1;
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

int ranks_wait(pid_t pid, int timeout_s, int *status) {
  const double deadline = deadline_in(timeout_s);
  for (;;) {
    pid_t r = waitpid(pid, status, WNOHANG);
    if (r == pid) return 0;
    if (r < 0 && errno != EINTR) return -2;
    if (now_s() > deadline) {
      kill(-pid, SIGKILL); /* its process group, if it leads one (the runner's tests do) */
      kill(pid, SIGKILL);
      waitpid(pid, status, 0);
      return -1;
    }
    usleep(2000);
  }
}

int ranks_count_gpus(const char *name, int timeout_s) {
  fflush(stdout); /* or the child would print the parent's buffered output again */
  fflush(stderr);
  pid_t pid = fork();
  if (pid < 0) {
    fprintf(stderr, "%s: fork: %s\n", name, strerror(errno));
    return 0;
  }
  if (pid == 0) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
      fprintf(stderr, "%s: cudaGetDeviceCount: %s\n", name, cudaGetErrorString(e));
      n = 0;
    }
    fflush(stderr);
    _exit(n > 100 ? 100 : n);
  }
  int status = 0;
  if (ranks_wait(pid, timeout_s, &status) != 0 || !WIFEXITED(status)) return 0;
  return WEXITSTATUS(status);
}

typedef struct launch {
  const ranks_config_t *config;
  int num_ranks;
  int up[2];                  /* rank 0 -> parent: the unique id */
  int down[EPX_MAX_RANKS][2]; /* parent -> rank r: the unique id */
  pid_t pids[EPX_MAX_RANKS];
} launch_t;

/* The child of rank r: keep only its own pipe ends, bootstrap the id, run. Never returns. */
/* A rank that crashes prints its stack (binary+offset per frame: `addr2line -f -C -e BINARY
 * OFFSET` names the line) before dying of the same signal. */
static void print_stack_and_die(int sig) {
  void *frames[48];
  const int n = backtrace(frames, 48);
  static const char head[] = "rank crashed; stack:\n";
  if (write(STDERR_FILENO, head, sizeof head - 1) < 0) { /* nothing more to do */
  }
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
  signal(sig, SIG_DFL);
  raise(sig);
}

static void run_child(launch_t *l, int r, double deadline, ranks_fn fn, void *arg) {
  signal(SIGSEGV, print_stack_and_die);
  signal(SIGBUS, print_stack_and_die);
  signal(SIGFPE, print_stack_and_die);
  signal(SIGABRT, print_stack_and_die);
  const char *name = l->config->name;
  close(l->up[0]);
  if (r != 0) close(l->up[1]);
  for (int q = 0; q < l->num_ranks; q++) {
    close(l->down[q][1]);
    if (q != r || r == 0) close(l->down[q][0]);
  }
  ncclUniqueId id;
  int code = 1;
  if (r == 0) {
    ncclResult_t nr = ncclGetUniqueId(&id);
    if (nr != ncclSuccess)
      fprintf(stderr, "%s rank 0: ncclGetUniqueId: %s\n", name, ncclGetErrorString(nr));
    else if (write_all(l->up[1], &id, sizeof id))
      fprintf(stderr, "%s rank 0: sending the NCCL id: %s\n", name, strerror(errno));
    else
      code = 0;
    close(l->up[1]);
  } else {
    /* The parent closes this pipe if rank 0 fails; the deadline only guards a lost parent. */
    code = read_all(l->down[r][0], &id, sizeof id, deadline) ? 1 : 0;
    if (code) fprintf(stderr, "%s rank %d: no NCCL id from rank 0\n", name, r);
    close(l->down[r][0]);
  }
  if (code == 0) code = fn(r, l->num_ranks, &id, arg);
  fflush(stdout); /* _exit does not flush stdio */
  fflush(stderr);
  _exit(code);
}

/* Parent: relay rank 0's id to the others, then close every pipe end. */
static void relay_id(launch_t *l, double deadline) {
  const char *name = l->config->name;
  ncclUniqueId id;
  if (read_all(l->up[0], &id, sizeof id, deadline) == 0) {
    for (int r = 1; r < l->num_ranks; r++)
      if (write_all(l->down[r][1], &id, sizeof id))
        fprintf(stderr, "%s: could not send the NCCL id to rank %d\n", name, r);
  } else {
    fprintf(stderr, "%s: rank 0 sent no NCCL id\n", name);
  }
  close(l->up[0]);
  for (int r = 0; r < l->num_ranks; r++) close(l->down[r][1]);
}

/* Wait for every rank; kill the rest at the deadline. Fills codes[0, num_ranks) and returns the
 * number of ranks that failed. */
static int wait_ranks(launch_t *l, double deadline, int *codes) {
  const ranks_config_t *c = l->config;
  int done[EPX_MAX_RANKS] = {0}, remaining = l->num_ranks, failed = 0;
  while (remaining > 0) {
    for (int r = 0; r < l->num_ranks; r++) {
      int status;
      if (done[r] || waitpid(l->pids[r], &status, WNOHANG) != l->pids[r]) continue;
      done[r] = 1;
      remaining--;
      codes[r] = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      if (c->killed_rank_ok && r == l->num_ranks - 1 && WIFSIGNALED(status) &&
          WTERMSIG(status) == SIGKILL)
        codes[r] = 0; /* it was meant to die */
      if (codes[r] == 0 || (c->quiet_code && codes[r] == c->quiet_code)) continue;
      if (WIFEXITED(status))
        fprintf(stderr, "%s: rank %d exited with code %d\n", c->name, r, codes[r]);
      else if (WIFSIGNALED(status))
        fprintf(stderr, "%s: rank %d killed by signal %d\n", c->name, r, WTERMSIG(status));
      if (!failed && remaining > 0 && c->grace_s > 0 && deadline > now_s() + c->grace_s)
        deadline = now_s() + c->grace_s;
      failed++;
    }
    if (remaining > 0 && now_s() > deadline) {
      if (failed)
        fprintf(stderr, "%s: killing %d rank(s) still running after a failure\n", c->name,
                remaining);
      else
        fprintf(stderr, "%s: killing %d rank(s): the run exceeded %s %d s\n", c->name, remaining,
                c->limit_name ? c->limit_name : "its limit of", c->timeout_s);
      for (int r = 0; r < l->num_ranks; r++) {
        if (done[r]) continue;
        kill(l->pids[r], SIGKILL);
        waitpid(l->pids[r], NULL, 0);
        codes[r] = -1;
      }
      return failed + remaining;
    }
    if (remaining > 0) usleep(10000);
  }
  return failed;
}

int ranks_run(const ranks_config_t *config, int num_ranks, ranks_fn fn, void *arg, int *codes) {
  int own_codes[EPX_MAX_RANKS];
  if (!codes) codes = own_codes;
  if (num_ranks < 1 || num_ranks > EPX_MAX_RANKS) {
    fprintf(stderr, "%s: %d ranks: expected 1 to %d\n", config->name, num_ranks, EPX_MAX_RANKS);
    return 1;
  }
  for (int r = 0; r < num_ranks; r++) codes[r] = -1;
  launch_t l;
  memset(&l, 0, sizeof l);
  l.config = config;
  l.num_ranks = num_ranks;
  int pipes = 0; /* pipes created: up, then down[0 .. pipes-2] */
  for (; pipes <= num_ranks; pipes++)
    if (pipe(pipes == 0 ? l.up : l.down[pipes - 1])) break;
  if (pipes <= num_ranks) {
    fprintf(stderr, "%s: pipe: %s\n", config->name, strerror(errno));
    for (int p = 0; p < pipes; p++) {
      int *fds = p == 0 ? l.up : l.down[p - 1];
      close(fds[0]), close(fds[1]);
    }
    return num_ranks;
  }
  const double deadline = deadline_in(config->timeout_s);
  fflush(stdout); /* or the children would print the parent's buffered output again */
  fflush(stderr);
  int forked = 0, fork_errno = 0;
  for (; forked < num_ranks; forked++) {
    l.pids[forked] = fork();
    if (l.pids[forked] < 0) {
      fork_errno = errno;
      break;
    }
    if (l.pids[forked] == 0) run_child(&l, forked, deadline, fn, arg);
  }
  /* NOTE: from here on a write to a dead rank's pipe must fail with EPIPE, not kill us. */
  signal(SIGPIPE, SIG_IGN);
  close(l.up[1]);
  for (int r = 0; r < num_ranks; r++) close(l.down[r][0]);
  if (forked < num_ranks) {
    fprintf(stderr, "%s: fork: %s\n", config->name, strerror(fork_errno));
    l.num_ranks = forked; /* the pipes' closing ends the forked ones; reap them */
    for (int r = 0; r < num_ranks; r++) close(l.down[r][1]);
    close(l.up[0]);
    return wait_ranks(&l, deadline, codes) + (num_ranks - forked);
  }
  relay_id(&l, deadline);
  return wait_ranks(&l, deadline, codes);
}

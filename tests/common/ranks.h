/*
 * ranks.h - one process per GPU, shared by the test runner (runner.c) and the benchmark
 * (bench/epx_bench.c): counting GPUs, forking the rank processes, bootstrapping their NCCL
 * unique id, and waiting for them under a deadline.
 *
 * The calling process never initializes CUDA (a forked child of a CUDA process cannot use it):
 * GPUs are counted in a short-lived child, and each rank is a child that sets up CUDA itself.
 * Bootstrap: rank 0 calls ncclGetUniqueId and writes the id into a pipe; the parent relays it to
 * every other rank through one pipe each. Every pipe end a process does not use is closed, so a
 * rank that dies before writing shows up as end-of-file, never as a hang. Supervision: the
 * parent polls its children until all have exited or the deadline passes; once one rank has
 * failed, the others get a grace period (they may be stuck in a collective waiting for it).
 * Children still running then are killed (by pid: only our own children).
 *
 * It lives in tests/common because tests and the benchmark both see tests/ (-Itests) and the
 * library never does; bench links this one object.
 */
#ifndef EPX_TESTS_RANKS_H_
#define EPX_TESTS_RANKS_H_

#include <sys/types.h>

#include "epx.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One rank's whole run, in its own process once the id has arrived; returns its exit code. */
typedef int (*ranks_fn)(int rank, int num_ranks, const ncclUniqueId *id, void *arg);

typedef struct ranks_config {
  const char *name;       /* first word of every message: "epx_bench", "epx_test" */
  int timeout_s;          /* ranks still running this long after the start are killed; 0: never */
  int grace_s;            /* once a rank has failed, the others are killed after this; 0: never */
  int quiet_code;         /* an exit code that is no failure and not reported (TEST_SKIP), or 0 */
  const char *limit_name; /* how the timeout is named in the message of its expiry ("--timeout") */
  int killed_rank_ok;     /* 1: the last rank ending by SIGKILL is no failure (a test that kills
                             it on purpose, epx_test_die); 0: every signal is one */
} ranks_config_t;

/* ranks_count_gpus - GPUs visible to a forked child (the caller never touches CUDA).
 *   name      - [IN] prefix of the message printed when CUDA cannot start
 *   timeout_s - [IN] the child is killed after this long
 * Returns the count (at most 100), or 0 if CUDA cannot start or the child does not answer. */
int ranks_count_gpus(const char *name, int timeout_s);

/* ranks_run - fork num_ranks processes, relay rank 0's NCCL unique id to the others, run
 * fn(rank, num_ranks, &id, arg) in each, and wait for all of them as config says. stdout and
 * stderr are flushed before forking. SIGPIPE is ignored in the caller from then on.
 *   config    - [IN]  name, limits, quiet exit code
 *   num_ranks - [IN]  1..EPX_MAX_RANKS
 *   fn, arg   - [IN]  each rank's run
 *   codes     - [OUT] [num_ranks] each rank's exit code, -1 if it was killed, ended by a signal
 *                     or never started; may be NULL
 * Returns the number of ranks that failed (exit code other than 0 and quiet_code, killed,
 * signalled, not started): 0 when all succeeded. A nonzero exit code other than quiet_code and
 * every signal are reported on stderr as "<name>: rank R ...". */
int ranks_run(const ranks_config_t *config, int num_ranks, ranks_fn fn, void *arg, int *codes);

/* ranks_wait - wait for child pid at most timeout_s seconds; on expiry kill its process group
 * (when it leads one) and it, and reap it.
 *   status - [OUT] waitpid's status of the child
 * Returns 0 when it ended by itself, -1 when it was killed at expiry, -2 if waitpid failed. */
int ranks_wait(pid_t pid, int timeout_s, int *status);

#ifdef __cplusplus
}
#endif

#endif /* EPX_TESTS_RANKS_H_ */

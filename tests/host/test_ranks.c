/*
 * test_ranks.c - the rank-process plumbing that the runner and the benchmark share
 * (tests/common/ranks.c), without GPUs: each rank process reports what it got through a pipe.
 *
 *   test                                    what
 *   ranks_relay_one_id_and_fold_exit_codes  every rank runs once and gets rank 0's NCCL unique
 *                                           id; the quiet code is no failure, another nonzero
 *                                           code is; a rank past the deadline is killed, and so
 *                                           is one still running a grace period after a failure;
 *                                           a rank killed by SIGKILL fails the run unless it is
 *                                           the last one and its death is planned
 *   test_cases_selected_by_env              EPX_TEST_CASES (the runner's case filter): unset or
 *                                           empty runs every case; else a case runs if its
 *                                           name contains one of the comma-separated words
 */
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/ranks.h"
#include "common/runner.h"

#define NUM_RANKS 4

typedef struct {
  int fd;                 /* write end of the report pipe */
  int code_of[NUM_RANKS]; /* each rank's exit code */
  int hang_rank;          /* a rank that sleeps instead of returning, or -1 */
  int die_rank;           /* a rank that kills itself (SIGKILL) after reporting, or -1 */
} plan_t;

typedef struct {
  int rank, num_ranks;
  ncclUniqueId id;
} report_t;

/* A ranks_fn: report (rank, num_ranks, id), then return the planned code or hang. */
static int report_rank(int rank, int num_ranks, const ncclUniqueId *id, void *arg) {
  const plan_t *p = (const plan_t *)arg;
  report_t r;
  memset(&r, 0, sizeof r);
  r.rank = rank, r.num_ranks = num_ranks, r.id = *id;
  if (write(p->fd, &r, sizeof r) != (ssize_t)sizeof r) return 1; /* < PIPE_BUF: atomic */
  if (rank == p->hang_rank) sleep(60);
  if (rank == p->die_rank) kill(getpid(), SIGKILL);
  return p->code_of[rank];
}

/* The reports of one run: every rank exactly once, all with one id. */
static int check_reports(int fd) {
  report_t got[NUM_RANKS];
  unsigned seen = 0;
  for (int i = 0; i < NUM_RANKS; i++) {
    struct pollfd pfd = {fd, POLLIN, 0};
    EXPECTF(poll(&pfd, 1, 5000) == 1, "only %d of %d ranks reported", i, NUM_RANKS);
    EXPECT(read(fd, &got[i], sizeof got[i]) == (ssize_t)sizeof got[i]);
    EXPECT_EQ_INT(got[i].num_ranks, NUM_RANKS);
    EXPECTF(got[i].rank >= 0 && got[i].rank < NUM_RANKS && !(seen >> got[i].rank & 1),
            "rank %d reported twice or out of range", got[i].rank);
    seen |= 1u << got[i].rank;
    EXPECTF(memcmp(&got[i].id, &got[0].id, sizeof got[0].id) == 0,
            "rank %d got another NCCL id than rank %d", got[i].rank, got[0].rank);
  }
  return TEST_PASS;
}

EPX_HOST_TEST(ranks_relay_one_id_and_fold_exit_codes, 60) {
  ncclUniqueId probe;
  if (ncclGetUniqueId(&probe) != ncclSuccess) {
    printf("  ncclGetUniqueId fails on this machine (no network interface?)\n");
    return TEST_SKIP;
  }
  int fds[2];
  EXPECT(pipe(fds) == 0);
  plan_t p = {fds[1], {0, TEST_SKIP, 0, 0}, -1, -1};
  ranks_config_t c = {"ranks test (expected)", 0, 0, TEST_SKIP, NULL, 0};
  int codes[NUM_RANKS];

  /* All succeed or report the quiet code: no failure. */
  EXPECT_EQ_INT(ranks_run(&c, NUM_RANKS, report_rank, &p, codes), 0);
  for (int r = 0; r < NUM_RANKS; r++) EXPECT_EQ_INT(codes[r], p.code_of[r]);
  if (check_reports(fds[0]) != TEST_PASS) return TEST_FAIL;

  /* Another nonzero code is a failure. */
  p.code_of[2] = 3;
  EXPECT_EQ_INT(ranks_run(&c, NUM_RANKS, report_rank, &p, codes), 1);
  EXPECT_EQ_INT(codes[2], 3);
  if (check_reports(fds[0]) != TEST_PASS) return TEST_FAIL;

  /* A rank past the deadline is killed (and counted). */
  p.code_of[2] = 0, p.hang_rank = 3, c.timeout_s = 1;
  double t0 = epx_test_now_s();
  EXPECT_EQ_INT(ranks_run(&c, NUM_RANKS, report_rank, &p, codes), 1);
  EXPECT_EQ_INT(codes[3], -1);
  EXPECTF(epx_test_now_s() - t0 < 10, "the run took %.1f s with a 1 s deadline",
          epx_test_now_s() - t0);
  if (check_reports(fds[0]) != TEST_PASS) return TEST_FAIL;

  /* No deadline, but a grace period: once rank 0 failed, the hanging rank is killed. */
  p.code_of[0] = 5, c.timeout_s = 0, c.grace_s = 1;
  t0 = epx_test_now_s();
  EXPECT_EQ_INT(ranks_run(&c, NUM_RANKS, report_rank, &p, codes), 2);
  EXPECT_EQ_INT(codes[0], 5);
  EXPECT_EQ_INT(codes[3], -1);
  EXPECTF(epx_test_now_s() - t0 < 10, "the run took %.1f s with a 1 s grace period",
          epx_test_now_s() - t0);
  if (check_reports(fds[0]) != TEST_PASS) return TEST_FAIL;

  /* A rank killed by SIGKILL is a failure, unless it is the last one and the config says that
   * its death is planned (EPX_DYING_PEER_TEST). */
  p.code_of[0] = 0, p.hang_rank = -1, c.grace_s = 0;
  for (int die = NUM_RANKS - 2; die < NUM_RANKS; die++)
    for (int planned = 0; planned < 2; planned++) {
      p.die_rank = die, c.killed_rank_ok = planned;
      const int expect_failed = !(planned && die == NUM_RANKS - 1);
      EXPECTF(ranks_run(&c, NUM_RANKS, report_rank, &p, codes) == expect_failed,
              "rank %d killed, killed_rank_ok %d", die, planned);
      EXPECT_EQ_INT(codes[die], expect_failed ? -1 : 0);
      if (check_reports(fds[0]) != TEST_PASS) return TEST_FAIL;
    }
  close(fds[0]), close(fds[1]);
  return TEST_PASS;
}

EPX_HOST_TEST(test_cases_selected_by_env, 10) {
  const char *was = getenv("EPX_TEST_CASES");
  char *saved = was ? strdup(was) : NULL;
  unsetenv("EPX_TEST_CASES");
  EXPECT(epx_test_case_selected("fp8_holes"));
  setenv("EPX_TEST_CASES", "", 1);
  EXPECT(epx_test_case_selected("fp8_holes"));
  setenv("EPX_TEST_CASES", "egrp,holes", 1);
  const int holes = epx_test_case_selected("fp8_holes");
  const int egrp = epx_test_case_selected("fp8_egrp_one_expert");
  const int other = epx_test_case_selected("bf16_uniform");
  setenv("EPX_TEST_CASES", ",,", 1);
  const int commas = epx_test_case_selected("bf16_uniform");
  if (saved)
    setenv("EPX_TEST_CASES", saved, 1);
  else
    unsetenv("EPX_TEST_CASES");
  free(saved);
  EXPECT(holes && egrp && !other && !commas);
  return TEST_PASS;
}

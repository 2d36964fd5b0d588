/*
 * runner.h - EPX's test runner: every test runs in its own process tree under a timeout.
 *
 * Host tests are plain functions; one-GPU tests (EPX_ONE_GPU_TEST) are plain functions that
 * need a GPU but no group. GPU tests run once per rank in R forked processes (one per
 * GPU), each with its own NCCL communicator bootstrapped from a unique id that rank 0 creates
 * and the runner relays through pipes; CUDA is never touched before fork. A GPU test runs at
 * every rank count of --ranks (default 1,2,4) that the machine has GPUs for; otherwise it is
 * reported as skipped, never as passed. The last line is "N passed, N failed, N skipped".
 *
 * A test returns TEST_PASS, TEST_FAIL or TEST_SKIP; the EXPECT macros print both sides and
 * return TEST_FAIL, and stay on in every build.
 */
#ifndef EPX_TESTS_RUNNER_H_
#define EPX_TESTS_RUNNER_H_

#include <stdint.h>
#include <stdio.h>
#include <time.h>

#include "epx.h"

#define TEST_PASS 0
#define TEST_FAIL 1
#define TEST_SKIP 77

typedef struct epx_test_rank {
  int rank, num_ranks;
  ncclComm_t comm;
  cudaStream_t stream;
  uint64_t seed; /* the same on every rank of a run; printed by the runner */
} epx_test_rank_t;

typedef int (*epx_host_test_fn)(void);
typedef int (*epx_gpu_test_fn)(epx_test_rank_t *t);

void epx_test_register_host(const char *name, epx_host_test_fn fn, int timeout_s);
void epx_test_register_gpu(const char *name, epx_gpu_test_fn fn, int timeout_s, int min_ranks);
void epx_test_register_one_gpu(const char *name, epx_host_test_fn fn, int timeout_s);
void epx_test_register_dying_peer(const char *name, epx_gpu_test_fn fn, int timeout_s);
/* The calling rank process ends now by SIGKILL (no cleanup, no flush by CUDA or NCCL), as a
 * crashed one does. Only for EPX_DYING_PEER_TEST's last rank. */
void epx_test_die(void) __attribute__((noreturn));
/* Seed of the current test (host tests too). */
uint64_t epx_test_seed(void);
/* Whether a test with a table of cases runs the case `name`: every case unless EPX_TEST_CASES
 * is set, then those whose name contains one of its comma-separated words. A case skipped
 * draws nothing from the test's generator, so the cases after it get other data than in a
 * whole run with the same seed. */
int epx_test_case_selected(const char *name);

#define EPX_HOST_TEST(name, timeout_s)                             \
  static int name(void);                                           \
  __attribute__((constructor)) static void register_##name(void) { \
    epx_test_register_host(#name, name, (timeout_s));              \
  }                                                                \
  static int name(void)

#define EPX_GPU_TEST_MIN_RANKS(name, min_ranks, timeout_s)         \
  static int name(epx_test_rank_t *t);                             \
  __attribute__((constructor)) static void register_##name(void) { \
    epx_test_register_gpu(#name, name, (timeout_s), (min_ranks));  \
  }                                                                \
  static int name(epx_test_rank_t *t)

/* A group test: runs at every rank count of --ranks (1 included: a one-rank group). */
#define EPX_GPU_TEST(name, timeout_s) EPX_GPU_TEST_MIN_RANKS(name, 1, timeout_s)
/* A group test about what peers do to each other (a missing, late or mismatched peer): it
 * means nothing in a one-rank group, where it is skipped. */
#define EPX_PEER_TEST(name, timeout_s) EPX_GPU_TEST_MIN_RANKS(name, 2, timeout_s)

/* A group test in which the last rank dies on purpose (epx_test_die: SIGKILL, as a crashed or
 * OOM-killed process) and the others must get errors within the budget, never hang. Its death
 * is no failure; the survivors' communicator is aborted after the test, as an application
 * would after a peer died. Needs 2+ ranks. */
#define EPX_DYING_PEER_TEST(name, timeout_s)                       \
  static int name(epx_test_rank_t *t);                             \
  __attribute__((constructor)) static void register_##name(void) { \
    epx_test_register_dying_peer(#name, name, (timeout_s));        \
  }                                                                \
  static int name(epx_test_rank_t *t)

/* A test of one GPU's kernels (no group, no NCCL): runs once, in its own process, when a GPU
 * is visible, whatever --ranks says; skipped otherwise. */
#define EPX_ONE_GPU_TEST(name, timeout_s)                          \
  static int name(void);                                           \
  __attribute__((constructor)) static void register_##name(void) { \
    epx_test_register_one_gpu(#name, name, (timeout_s));           \
  }                                                                \
  static int name(void)

#define EXPECT(cond)                                                      \
  do {                                                                    \
    if (!(cond)) {                                                        \
      fprintf(stderr, "  FAILED %s:%d: %s\n", __FILE__, __LINE__, #cond); \
      return TEST_FAIL;                                                   \
    }                                                                     \
  } while (0)

#define EXPECTF(cond, ...)                                                \
  do {                                                                    \
    if (!(cond)) {                                                        \
      fprintf(stderr, "  FAILED %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                       \
      fputc('\n', stderr);                                                \
      return TEST_FAIL;                                                   \
    }                                                                     \
  } while (0)

#define EXPECT_EQ_INT(a, b)                                                                       \
  do {                                                                                            \
    long long a_ = (long long)(a), b_ = (long long)(b);                                           \
    if (a_ != b_) {                                                                               \
      fprintf(stderr, "  FAILED %s:%d: %s == %s: %lld vs %lld\n", __FILE__, __LINE__, #a, #b, a_, \
              b_);                                                                                \
      return TEST_FAIL;                                                                           \
    }                                                                                             \
  } while (0)

/* An EPX call must return `want`; prints the status names and epx_last_error() if not. */
#define EXPECT_STATUS(call, want)                                                                  \
  do {                                                                                             \
    epx_status_t got_ = (call);                                                                    \
    if (got_ != (want)) {                                                                          \
      fprintf(stderr, "  FAILED %s:%d: %s returned %d (%s), want %d; last error: %s\n", __FILE__,  \
              __LINE__, #call, (int)got_, epx_status_string(got_), (int)(want), epx_last_error()); \
      return TEST_FAIL;                                                                            \
    }                                                                                              \
  } while (0)
#define EXPECT_OK(call) EXPECT_STATUS(call, EPX_OK)

#define EXPECT_CUDA(call)                                                    \
  do {                                                                       \
    cudaError_t e_ = (call);                                                 \
    if (e_ != cudaSuccess) {                                                 \
      fprintf(stderr, "  FAILED %s:%d: %s: %s\n", __FILE__, __LINE__, #call, \
              cudaGetErrorString(e_));                                       \
      return TEST_FAIL;                                                      \
    }                                                                        \
  } while (0)

#define EXPECT_NCCL(call)                                                    \
  do {                                                                       \
    ncclResult_t r_ = (call);                                                \
    if (r_ != ncclSuccess) {                                                 \
      fprintf(stderr, "  FAILED %s:%d: %s: %s\n", __FILE__, __LINE__, #call, \
              ncclGetErrorString(r_));                                       \
      return TEST_FAIL;                                                      \
    }                                                                        \
  } while (0)

/* Seconds on the monotonic clock, for measuring how long something took. */
static inline double epx_test_now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Deterministic random numbers for tests (splitmix64). */
static inline uint64_t epx_test_rand(uint64_t *state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
static inline int epx_test_rand_int(uint64_t *state, int n) {
  return (int)(epx_test_rand(state) % (uint64_t)n);
}
/* Uniform in [0, 1) with 24 bits. */
static inline float epx_test_rand_unit(uint64_t *state) {
  return (float)(epx_test_rand(state) >> 40) / (float)(1ull << 24);
}
/* An expert in [0, range) that none of ids[0..k) names, or -1 after 100 draws that all did. */
static inline int64_t epx_test_rand_new_expert(uint64_t *state, const int64_t *ids, int k,
                                               int range) {
  for (int tries = 0; tries < 100; tries++) {
    const int64_t e = epx_test_rand_int(state, range);
    int again = 0;
    for (int j = 0; j < k; j++) again |= ids[j] == e;
    if (!again) return e;
  }
  return -1;
}

#endif /* EPX_TESTS_RUNNER_H_ */

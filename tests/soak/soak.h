/*
 * soak.h - what the soak's files share (soak.c: main, the rank loop, groups, memory, reports;
 * soak_normal.c and soak_ll.c: one iteration of each mode). docs/testing.md, "Soak".
 *
 * One rank's iteration returns 0 when the run can go on (wrong results are counted, never
 * fatal) and -1 when it cannot (an EPX or CUDA call failed, or an async error says the group's
 * state is in doubt); the message is printed and the rank leaves without anything collective.
 */
#ifndef EPX_TESTS_SOAK_SOAK_H_
#define EPX_TESTS_SOAK_SOAK_H_

#include <stdint.h>
#include <stdio.h>

#include "gpu/world.h"
#include "soak/plan.h"

/* Wrong results printed in full per rank; the check helpers are muted after that. */
#define SOAK_PRINT_WRONG 10

typedef struct {
  long long iters, start; /* iterations [start, start + iters) */
  int ranks;              /* 0: every visible GPU */
  uint64_t seed;
  int timeout_s;    /* the whole run (tests/common/ranks.c kills every rank after it) */
  int stall_s;      /* a rank without progress this long exits (SIGALRM); 0: never */
  int check_every;  /* check every K-th iteration's results (1: all) */
  int report_every; /* a report line every M iterations */
  double max_device_growth_mib, max_rss_growth_mib; /* tolerances after the warm-up */
  int print_plan;                                   /* print the plan and exit */
} soak_options_t;

/* One rank's state. */
typedef struct {
  const soak_options_t *opt;
  int rank, R;
  epx_test_rank_t t; /* rank, ranks, comm, stream, seed: what the tests' helpers take */
  FILE *msg;         /* stderr, even while the check helpers are muted */
  int muted_fd;      /* stderr saved while muted, else -1 */
  /* The live group and its shape (E = experts_per_rank x R, K <= E). */
  epx_group_t g;
  epx_handle_t h;
  soak_epoch_t epoch;
  int H, E, K, M, Mll;
  /* Device buffers sized once for every shape. */
  world_dev_t d;       /* inputs, expert outputs (y) and combine output */
  uint16_t *bias_host; /* a pool of BF16 bias values; a bias is a window of it */
  void *bias_dev;
  size_t bias_elems;
  float *out_w_dev;     /* [max tokens, max top-k] */
  float *cw_dev;        /* combine-time weights, [max tokens, max top-k] */
  long long *range_dev; /* packed layout range, [max experts] */
  long long *stats_dev; /* report all-reduces */
  /* The iteration being run (for messages). */
  const soak_iter_t *plan;
  /* Counters of this rank. */
  long long normal_iters, ll_iters, wrong, unexpected_errors, expected_errors, calls;
} soak_rank_t;

/* One iteration of each mode: plan p on the live group; check = compare every result. */
int soak_normal_iteration(soak_rank_t *s, const soak_iter_t *p, int check);
int soak_ll_iteration(soak_rank_t *s, const soak_iter_t *p, int check);

/* A check's result: TEST_FAIL counts one wrong result and prints it (the first few). */
void soak_result(soak_rank_t *s, int check_result, const char *what);
/* Mute the check helpers' own messages (once SOAK_PRINT_WRONG results were wrong) / unmute. */
void soak_mute(soak_rank_t *s);
void soak_unmute(soak_rank_t *s);

/* The async error record after an iteration's calls of `stage` (EPX_STAGE_LAYOUT for normal
 * dispatch, EPX_STAGE_LL_DISPATCH): an id outside [-1, E) among this rank's tokens of w must be
 * reported (first position, value), then it is cleared; nothing else may be on record. Returns
 * -1 if the record says the group is broken (a timeout, a masked peer). w NULL: none expected. */
int soak_check_async(soak_rank_t *s, const world_t *w, int stage);

/* An EPX call that must succeed; on failure print it and return -1 from the caller. */
#define SOAK_EPX(s, call)                                                            \
  do {                                                                               \
    (s)->calls++;                                                                    \
    const epx_status_t st_ = (call);                                                 \
    if (st_ != EPX_OK) {                                                             \
      fprintf((s)->msg, "epx_soak rank %d: iteration %lld: %s: %s: %s\n", (s)->rank, \
              (s)->plan ? (s)->plan->iter : -1LL, #call, epx_status_string(st_),     \
              epx_last_error());                                                     \
      return -1;                                                                     \
    }                                                                                \
  } while (0)

/* A step of the harness that must succeed (an upload, a reference computation). */
#define SOAK_TRY(s, ok, what)                                                       \
  do {                                                                              \
    if (!(ok)) {                                                                    \
      fprintf((s)->msg, "epx_soak rank %d: iteration %lld: %s failed\n", (s)->rank, \
              (s)->plan ? (s)->plan->iter : -1LL, (what));                          \
      return -1;                                                                    \
    }                                                                               \
  } while (0)

/* A CUDA call that must succeed. */
#define SOAK_CUDA(s, call)                                                        \
  do {                                                                            \
    const cudaError_t e_ = (call);                                                \
    if (e_ != cudaSuccess) {                                                      \
      fprintf((s)->msg, "epx_soak rank %d: iteration %lld: %s: %s\n", (s)->rank,  \
              (s)->plan ? (s)->plan->iter : -1LL, #call, cudaGetErrorString(e_)); \
      return -1;                                                                  \
    }                                                                             \
  } while (0)

#endif /* EPX_TESTS_SOAK_SOAK_H_ */

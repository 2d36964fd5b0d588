/*
 * plan.h - the soak's iteration plan (tests/soak/soak.c, docs/testing.md "Soak"): which group
 * shape is live at each iteration, and what each iteration does (mode, routing, token counts,
 * payload format, options). Pure CPU, no GPU: tests/host/test_soak_plan.c checks it.
 *
 * Invariant: everything here is a pure function of (seed, iteration, rank count). Every rank
 * computes the same plan without talking to the others, so the ranks stay in step (the same
 * collectives in the same order), and any iteration can be rerun alone (--start I --iters 1).
 * Epochs do not depend on the rank count or on how many iterations a run makes.
 */
#ifndef EPX_TESTS_SOAK_PLAN_H_
#define EPX_TESTS_SOAK_PLAN_H_

#include <stdint.h>

#include "gpu/world.h"

/* The first iterations visit every shape, a few iterations each, the first two of every
 * shape with full token counts: after them every allocation size the run makes has been made,
 * and memory is measured against the state at their end. */
#define SOAK_WARMUP_ITERS 100
/* After the warm-up a group lives for this many iterations (drawn in [min, max]). */
#define SOAK_EPOCH_MIN_ITERS 2000
#define SOAK_EPOCH_MAX_ITERS 5000

/* A group shape; E = experts_per_rank x R (a multiple of R at every rank count). */
typedef struct {
  int hidden;           /* multiple of 128: FP8 groups and low-latency mode need it */
  int max_tokens;       /* normal mode's max_tokens_per_rank */
  int ll_max_tokens;    /* ll_max_tokens_per_rank */
  int experts_per_rank; /* E / R */
  int top_k;            /* at most 2 x experts_per_rank, so <= E at 2 ranks and more */
} soak_shape_t;

extern const soak_shape_t soak_shapes[];
extern const int soak_num_shapes;

/* One group's life: iterations [begin, end) on shape `shape` with low-latency route `ll_route`
 * (EPX_LL_ROUTE_DIRECT, _BY_RANK or _DISPATCH_BY_RANK). */
typedef struct {
  long long begin, end;
  int index; /* 0, 1, ...: the epoch's number */
  int shape;
  int ll_route;
} soak_epoch_t;

/* The epoch that holds iteration `it` (>= 0) of the run with this seed. */
void soak_epoch_of(uint64_t seed, long long it, soak_epoch_t *epoch);

typedef enum { SOAK_MODE_NORMAL = 0, SOAK_MODE_LL = 1 } soak_mode_t;

/* How a normal dispatch learns its receive count. */
typedef enum {
  SOAK_COUNTS_SYNC = 0,  /* sync_counts = 1: num_recv and per-expert counts on the host */
  SOAK_COUNTS_ASYNC = 1, /* sync_counts = 0: counts only on the device, num_recv = -1 */
  SOAK_COUNTS_WORST = 2  /* num_worst_tokens (sync_counts = 0) */
} soak_counts_t;

/* Which num_worst_tokens (every rank passes the same one). */
typedef enum {
  SOAK_WORST_CAPACITY = 0, /* R x max_tokens */
  SOAK_WORST_TIGHT = 1,    /* the largest real receive count of any rank (at least 1) */
  SOAK_WORST_BETWEEN = 2   /* a third of the way from that to the capacity */
} soak_worst_t;

/* Normal combine's expert outputs. */
typedef enum {
  SOAK_EXPERTS_SCALED = 0,  /* y_d = received rows x (1 + d/4) (normal_expert_output) */
  SOAK_EXPERTS_IDENTITY = 1 /* the received rows in place (combine x = recv_x; BF16 only) */
} soak_experts_t;

/* One normal combine. */
typedef struct {
  int experts;        /* soak_experts_t */
  int weighted;       /* topk_idx + topk_weights factors */
  int reduce_weights; /* recv_topk_weights (the dispatch's) -> out_topk_weights */
  int num_bias;       /* 0, 1 or 2 bias rows */
} soak_combine_t;

/* What one iteration does. Options of the other mode are 0. */
typedef struct {
  long long iter;
  int mode;       /* soak_mode_t */
  route_t route;  /* world.h routing, ROUTE_BAD occasionally */
  int tokens;     /* world_spec_t.tokens: -1 uneven in [0, max], else every rank's count */
  int empty_rank; /* a rank with no tokens, or -1 */
  int fp8;        /* normal: FP8 payload with scales; low-latency: FP8 receive */
  uint64_t rng;   /* the shared draws of the iteration's world and payloads start here */
  /* normal mode */
  int counts;                    /* soak_counts_t */
  int worst;                     /* soak_worst_t (counts = WORST) */
  int expert_alignment;          /* 0, 1, 4 or 128 */
  int dispatch_weights;          /* 0: topk_weights NULL (received weights 0) */
  soak_combine_t combine;        /* after the dispatch */
  int cached;                    /* then a cached dispatch of fresh payload ... */
  soak_combine_t cached_combine; /* ... and a combine of it */
  /* low-latency mode */
  int ue8m0;           /* FP8 scales rounded up to powers of two */
  int ue8m0_packed;    /* ... and returned as int32 words of four exponents */
  int packed;          /* DeepEP's packed layout (routes BY_RANK, DISPATCH_BY_RANK only) */
  int layout_range;    /* packed: also the [L, R] layout range */
  int split;           /* dispatch and combine return after the sends; epx_ll_recv completes */
  int zero_copy;       /* combine x = NULL: the expert outputs written into combine_input */
  int ll_weights;      /* dispatch-time topk_weights (else NULL: weights 1) */
  int combine_weights; /* combine-time topk_weights (override the dispatch's) */
} soak_iter_t;

/* The plan of iteration `it` (inside `epoch`) at num_ranks ranks. */
void soak_plan(uint64_t seed, long long it, const soak_epoch_t *epoch, int num_ranks,
               soak_iter_t *plan);

/* One line describing the plan, for messages (route names, options set). */
void soak_plan_describe(const soak_iter_t *plan, const soak_epoch_t *epoch, char *buf, size_t size);

/* splitmix64 of a key: the seed of an independent stream of draws. */
uint64_t soak_mix(uint64_t key);

#endif /* EPX_TESTS_SOAK_PLAN_H_ */

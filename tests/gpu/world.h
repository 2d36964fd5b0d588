/*
 * world.h - the harness of the dispatch/combine GPU tests (test_normal.c, test_trace.c,
 * test_ll.c): a random "world" (every rank's tokens, routing, weights and payload, drawn
 * identically on every rank from the test seed, so that each rank can compute with tests/ref
 * what it must receive and what combine must return), and the device copies of one rank's
 * inputs. The checks of each mode live beside its tests: normal_checks.{h,c}, ll_checks.{h,c}.
 *
 * Invariant: a world is a pure function of (R, spec, payload, rng state); every rank draws the
 * whole world, so the rng state stays the same on every rank.
 */
#ifndef EPX_TESTS_WORLD_H_
#define EPX_TESTS_WORLD_H_

#include <stddef.h>
#include <stdint.h>

#include "gpu/gpu_util.h"
#include "ref/epx_ref.h"

/* How tokens choose their K experts. */
typedef enum {
  ROUTE_UNIFORM,    /* distinct experts, uniform */
  ROUTE_ONE_EXPERT, /* every slot names expert E/2 (a token lists it K times) */
  ROUTE_EMPTY,      /* every slot -1 */
  ROUTE_HOLES,      /* distinct, a quarter of the slots -1 */
  ROUTE_ONE_RANK,   /* distinct experts of rank 0 only */
  ROUTE_DUPLICATES, /* uniform with repeats: a third of the slots copy an earlier slot */
  ROUTE_BAD         /* uniform, ~6% of the slots outside [-1, E) */
} route_t;

/* What the payload and weights are drawn from (each mode keeps the draws its cases had). */
typedef enum {
  /* Normal mode: weights in [0, 1); BF16 x in [-2, 2) and, drawn with it, an FP8 copy (no NaN
   * codes) with scales in [0.01, 1.01): normal dispatch sends FP8 as the caller gives it. */
  WORLD_NORMAL,
  /* Low-latency mode: weights in [0.01, 1.01); BF16 x in [-2, 2) with 1/64 of the values times
   * 300 and 1/64 times 1e-5, so that FP8 groups quantized on the fly get varied scales. */
  WORLD_LL
} world_payload_t;

/* The columns every case table shares. */
typedef struct {
  int max_tokens, hidden, experts, top_k; /* experts 0: = R */
  route_t route;
  int tokens;     /* -1: random in [0, max] per rank (uneven); else for every rank */
  int empty_rank; /* a rank with 0 tokens, or -1 */
} world_spec_t;

/* The world: every rank's inputs, generated identically on every rank. */
typedef struct {
  int R, E, K, H;
  int M, L; /* max tokens per rank; local experts E/R */
  world_payload_t payload;
  epx_ref_rank_t ranks[EPX_MAX_RANKS]; /* x_fp8, x_scales set with WORLD_NORMAL only */
  int64_t *idx[EPX_MAX_RANKS];         /* [T_s, K] */
  float *w[EPX_MAX_RANKS];             /* [T_s, K] */
  uint16_t *x[EPX_MAX_RANKS];          /* [T_s, H] BF16 */
  uint8_t *x8[EPX_MAX_RANKS];          /* [T_s, H] FP8, WORLD_NORMAL only (else NULL) */
  float *sc[EPX_MAX_RANKS];            /* [T_s, H/128], WORLD_NORMAL only (else NULL) */
  epx_ref_world_t ref;                 /* ref.ranks = ranks: a copy must repoint it */
} world_t;

/* Device copies of one rank's inputs, room for M tokens, and the expert outputs y. */
typedef struct {
  void *x, *x8, *idx, *w, *sc, *y, *out; /* x8, sc: WORLD_NORMAL only */
} world_dev_t;

/* Draw the K expert ids of one token into ids[0, K). */
void world_route_token(int64_t *ids, int K, int E, int R, route_t route, uint64_t *rng);
/* The world of spec at R ranks; free with world_free. */
void world_make(world_t *w, int R, const world_spec_t *spec, world_payload_t payload,
                uint64_t *rng);
void world_free(world_t *w);
/* The flat position of rank s's first id outside [-1, E), or -1: where a dispatch's async error
 * must point, and whether there must be one (ROUTE_BAD may draw none for a rank with few tokens).
 */
long long world_first_bad_id(const world_t *w, int s);

/* Device buffers for any world of w's shape: M tokens of inputs and output, y_rows rows of
 * expert output. */
int world_dev_alloc(const world_t *w, size_t y_rows, world_dev_t *d);
/* Rank me's inputs into d. NOTE: cudaMemcpy runs on the legacy stream, which does not order
 * with the tests' non-blocking streams: this finishes it (cudaDeviceSynchronize) before any
 * kernel reads the inputs. */
int world_upload(const world_t *w, int me, const world_dev_t *d);
/* world_dev_alloc, then world_upload of rank me's inputs. */
int world_dev_make(const world_t *w, int me, size_t y_rows, world_dev_t *d);
void world_dev_free(world_dev_t *d);

#endif /* EPX_TESTS_WORLD_H_ */

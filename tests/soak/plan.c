/*
 * plan.c - the soak's group shapes, epochs and per-iteration plans (see plan.h).
 *
 * Every iteration draws from its own stream, seeded by (seed, iteration), and every epoch of the
 * post-warm-up chain from one stream seeded by the seed alone: so the plan of iteration I is the
 * same whether the run started at 0 or at I, and on every rank.
 */
#include "soak/plan.h"

#include <stdio.h>
#include <string.h>

/*   hidden  max_tokens  ll_max_tokens  experts_per_rank  top_k
 * Small enough that drawing a world and its reference costs a few ms per rank (docs/testing.md,
 * "Soak"): max_tokens x hidden <= 131072. */
const soak_shape_t soak_shapes[] = {
    {128, 512, 128, 1, 1},  /* E = R, top-1: each token goes to exactly one rank */
    {256, 256, 64, 8, 4},   /* */
    {512, 256, 32, 16, 8},  /* */
    {640, 192, 48, 32, 16}, /* five FP8 groups (a UE8M0 word row is two words), top-16 */
    {1024, 128, 32, 4, 6},  /* few experts, a token often lists several of one rank */
    {2048, 64, 16, 32, 8},  /* 256 experts at 8 ranks (DeepEP's), the widest rows */
};
const int soak_num_shapes = (int)(sizeof soak_shapes / sizeof soak_shapes[0]);

uint64_t soak_mix(uint64_t key) {
  uint64_t state = key;
  return epx_test_rand(&state);
}

static int chance(uint64_t *rng, int percent) {
  return epx_test_rand_int(rng, 100) < percent;
}

static int route_of_warmup(int k) {
  return EPX_LL_ROUTE_DIRECT + k % 3;
}

void soak_epoch_of(uint64_t seed, long long it, soak_epoch_t *e) {
  const int S = soak_num_shapes;
  memset(e, 0, sizeof *e);
  if (it < SOAK_WARMUP_ITERS) { /* shape k for iterations [k W / S, (k+1) W / S) */
    for (int k = 0; k < S; k++) {
      e->begin = (long long)k * SOAK_WARMUP_ITERS / S;
      e->end = (long long)(k + 1) * SOAK_WARMUP_ITERS / S;
      e->index = k, e->shape = k, e->ll_route = route_of_warmup(k);
      if (it < e->end) return;
    }
  }
  uint64_t rng = soak_mix(seed ^ 0x50A4E90C45ull);
  soak_epoch_t next = {SOAK_WARMUP_ITERS, SOAK_WARMUP_ITERS, S - 1, S - 1, route_of_warmup(S - 1)};
  do {
    const int span = SOAK_EPOCH_MAX_ITERS - SOAK_EPOCH_MIN_ITERS + 1;
    next.begin = next.end;
    next.end = next.begin + SOAK_EPOCH_MIN_ITERS + epx_test_rand_int(&rng, span);
    next.index++;
    next.shape = (next.shape + 1 + epx_test_rand_int(&rng, S - 1)) % S; /* another shape */
    next.ll_route = EPX_LL_ROUTE_DIRECT + epx_test_rand_int(&rng, 3);
  } while (it >= next.end);
  *e = next;
}

static route_t draw_route(uint64_t *rng) {
  const int r = epx_test_rand_int(rng, 100);
  return r < 44   ? ROUTE_UNIFORM
         : r < 59 ? ROUTE_HOLES
         : r < 74 ? ROUTE_DUPLICATES
         : r < 82 ? ROUTE_ONE_EXPERT
         : r < 92 ? ROUTE_ONE_RANK
         : r < 97 ? ROUTE_EMPTY
                  : ROUTE_BAD; /* the async error path, then cleared */
}

static void draw_combine(uint64_t *rng, int fp8, soak_combine_t *c) {
  c->experts = !fp8 && chance(rng, 50) ? SOAK_EXPERTS_IDENTITY : SOAK_EXPERTS_SCALED;
  c->weighted = chance(rng, 50);
  c->reduce_weights = chance(rng, 50);
  c->num_bias = epx_test_rand_int(rng, 3);
}

/* The first two iterations of a warm-up epoch: one of each mode with every rank at the maximum
 * and the options that allocate the most (the memory baseline must have seen them). */
static void warmup_plan(const soak_shape_t *shape, const soak_epoch_t *e, int second,
                        soak_iter_t *p) {
  p->route = ROUTE_UNIFORM;
  p->empty_rank = -1;
  p->fp8 = 1;
  if (!second) {
    p->mode = SOAK_MODE_NORMAL;
    p->tokens = shape->max_tokens;
    p->counts = SOAK_COUNTS_SYNC;
    p->expert_alignment = 4;
    p->dispatch_weights = 1;
    p->combine = (soak_combine_t){SOAK_EXPERTS_SCALED, 1, 1, 2};
    p->cached = 1;
    p->cached_combine = (soak_combine_t){SOAK_EXPERTS_SCALED, 1, 1, 2};
  } else {
    p->mode = SOAK_MODE_LL;
    p->tokens = shape->ll_max_tokens;
    p->ue8m0 = 1;
    p->packed = e->ll_route != EPX_LL_ROUTE_DIRECT;
    p->layout_range = p->packed;
    p->split = 1;
    p->ll_weights = 1;
    p->combine_weights = 1;
  }
}

void soak_plan(uint64_t seed, long long it, const soak_epoch_t *e, int num_ranks, soak_iter_t *p) {
  const soak_shape_t *shape = &soak_shapes[e->shape];
  uint64_t rng = soak_mix(seed ^ soak_mix((uint64_t)it * 2 + 1));
  memset(p, 0, sizeof *p);
  p->iter = it;
  p->rng = soak_mix(rng ^ 0x3D0A1D5ull);
  if (it < SOAK_WARMUP_ITERS && it - e->begin < 2) {
    warmup_plan(shape, e, it - e->begin == 1, p);
    return;
  }
  p->mode = chance(&rng, 50) ? SOAK_MODE_LL : SOAK_MODE_NORMAL;
  const int max = p->mode == SOAK_MODE_LL ? shape->ll_max_tokens : shape->max_tokens;
  p->route = draw_route(&rng);
  const int t = epx_test_rand_int(&rng, 100);
  p->tokens = t < 80 ? -1 : t < 90 ? max : t < 95 ? 1 : 0;
  p->empty_rank = chance(&rng, 15) ? epx_test_rand_int(&rng, num_ranks) : -1;
  p->fp8 = chance(&rng, 50);
  /* The options: every combination of them equally likely (the constraints aside), so that
   * each one comes up many times in a run (tests/host/test_soak_plan.c). */
  if (p->mode == SOAK_MODE_NORMAL) {
    p->counts = epx_test_rand_int(&rng, 3);
    p->worst = p->counts == SOAK_COUNTS_WORST ? epx_test_rand_int(&rng, 3) : 0;
    static const int aligns[4] = {0, 1, 4, 128};
    p->expert_alignment = aligns[epx_test_rand_int(&rng, 4)];
    p->dispatch_weights = chance(&rng, 85);
    draw_combine(&rng, p->fp8, &p->combine);
    p->cached = chance(&rng, 33);
    if (p->cached) draw_combine(&rng, p->fp8, &p->cached_combine);
  } else {
    p->ue8m0 = p->fp8 && chance(&rng, 50);
    p->ue8m0_packed = p->ue8m0 && chance(&rng, 50);
    p->packed = e->ll_route != EPX_LL_ROUTE_DIRECT && chance(&rng, 50);
    p->layout_range = p->packed && chance(&rng, 50);
    p->split = chance(&rng, 50);
    p->zero_copy = chance(&rng, 50);
    p->ll_weights = chance(&rng, 50);
    p->combine_weights = chance(&rng, 50);
  }
}

static const char *route_name(route_t r) {
  static const char *const names[] = {"uniform",  "one-expert", "empty",  "holes",
                                      "one-rank", "duplicates", "BAD ids"};
  return (int)r >= 0 && (int)r < 7 ? names[r] : "?";
}

static const char *ll_route_name(int route) {
  return route == EPX_LL_ROUTE_DIRECT    ? "direct"
         : route == EPX_LL_ROUTE_BY_RANK ? "by-rank"
                                         : "dispatch-by-rank";
}

static int describe_combine(const soak_combine_t *c, char *buf, size_t size) {
  return snprintf(buf, size, "%s%s%s, %d bias", c->experts ? "identity" : "scaled",
                  c->weighted ? " weighted" : "", c->reduce_weights ? " weight-reduction" : "",
                  c->num_bias);
}

void soak_plan_describe(const soak_iter_t *p, const soak_epoch_t *e, char *buf, size_t size) {
  const soak_shape_t *s = &soak_shapes[e->shape];
  char tokens[48] = "uneven", combine[2][64];
  if (p->tokens >= 0) snprintf(tokens, sizeof tokens, "%d each", p->tokens);
  if (p->empty_rank >= 0)
    snprintf(tokens + strlen(tokens), sizeof tokens - strlen(tokens), ", rank %d empty",
             p->empty_rank);
  int n = snprintf(buf, size, "shape %d (H %d, max %d/%d, E/R %d, top-%d), ", e->shape, s->hidden,
                   s->max_tokens, s->ll_max_tokens, s->experts_per_rank, s->top_k);
  if (n < 0 || (size_t)n >= size) return;
  buf += n, size -= (size_t)n;
  if (p->mode == SOAK_MODE_NORMAL) {
    static const char *const counts[3] = {"sync counts", "async counts", "num_worst_tokens"};
    static const char *const worst[3] = {" (capacity)", " (tight)", " (between)"};
    describe_combine(&p->combine, combine[0], sizeof combine[0]);
    describe_combine(&p->cached_combine, combine[1], sizeof combine[1]);
    snprintf(buf, size, "normal: %s, tokens %s, %s, %s%s, align %d%s; combine %s%s%s",
             route_name(p->route), tokens, p->fp8 ? "FP8" : "BF16", counts[p->counts],
             p->counts == SOAK_COUNTS_WORST ? worst[p->worst] : "", p->expert_alignment,
             p->dispatch_weights ? "" : ", no weights", combine[0],
             p->cached ? "; cached dispatch, combine " : "", p->cached ? combine[1] : "");
  } else {
    snprintf(buf, size, "low-latency (%s): %s, tokens %s, %s%s%s%s%s%s%s%s%s",
             ll_route_name(e->ll_route), route_name(p->route), tokens, p->fp8 ? "FP8" : "BF16",
             p->ue8m0 ? " ue8m0" : "", p->ue8m0_packed ? " words" : "",
             p->packed ? ", packed" : ", fixed slots", p->layout_range ? " + range" : "",
             p->split ? ", split" : "", p->zero_copy ? ", zero copy" : "",
             p->ll_weights ? "" : ", no dispatch weights",
             p->combine_weights ? ", combine-time weights" : "");
  }
}

/*
 * test_soak_plan.c - the soak's plan (tests/soak/plan.h) without GPUs: what every rank of
 * epx_soak computes alone must be the same on every rank and reach every option.
 *
 *   test                             what
 *   soak_plan_same_from_the_seed     the plan of an iteration is a function of (seed, iteration,
 *                                    ranks): the same computed in the loop's order, backwards or
 *                                    alone; another seed gives other plans
 *   soak_epochs_visit_every_shape    the warm-up visits every shape (at least two iterations
 *                                    each, the first two at full token counts), then epochs of
 *                                    2000-5000 iterations follow back to back, each another
 *                                    shape than the last; every shape and route comes again;
 *                                    every shape is a valid config at 2, 4 and 8 ranks
 *   soak_plan_reaches_every_option   in the first 100,000 iterations (the default run), at 2
 *                                    and 4 ranks and for several seeds: every combination of
 *                                    each mode's options, every routing (bad ids included) and
 *                                    token pattern in both modes; no plan breaks a constraint
 *                                    (UE8M0 only with FP8, packed never on route DIRECT, ...)
 */
#include <string.h>

#include "common/runner.h"
#include "soak/plan.h"

static const uint64_t seeds[] = {1, 0xDEADBEEFull, 12345678901234567ull};
#define NUM_SEEDS (int)(sizeof seeds / sizeof seeds[0])

/* The plans of iterations [0, n) as the soak's loop computes them (epoch by epoch). */
static void plans_in_order(uint64_t seed, int R, long long n, soak_iter_t *out) {
  soak_epoch_t e;
  soak_epoch_of(seed, 0, &e);
  for (long long it = 0; it < n; it++) {
    if (it >= e.end) soak_epoch_of(seed, it, &e);
    soak_plan(seed, it, &e, R, &out[it]);
  }
}

static int same_plan(const soak_iter_t *a, const soak_iter_t *b) {
  return memcmp(a, b, sizeof *a) == 0; /* soak_plan zeroes the whole struct first */
}

EPX_HOST_TEST(soak_plan_same_from_the_seed, 60) {
  enum { N = 12000 };
  static soak_iter_t in_order[N], other[N];
  for (int i = 0; i < NUM_SEEDS; i++)
    for (int R = 2; R <= 4; R += 2) {
      const uint64_t seed = seeds[i];
      plans_in_order(seed, R, N, in_order);
      for (long long it = N - 1; it >= 0; it--) { /* backwards, each epoch looked up alone */
        soak_epoch_t e;
        soak_epoch_of(seed, it, &e);
        EXPECTF(e.begin <= it && it < e.end, "iteration %lld outside its epoch [%lld, %lld)", it,
                e.begin, e.end);
        soak_iter_t p;
        soak_plan(seed, it, &e, R, &p);
        EXPECTF(same_plan(&p, &in_order[it]), "seed %llu, %d ranks: iteration %lld differs",
                (unsigned long long)seed, R, it);
      }
      plans_in_order(seed, R, N, other); /* again: nothing kept between calls */
      EXPECT(memcmp(in_order, other, sizeof in_order) == 0);
      plans_in_order(seed + 1, R, N, other);
      int differ = 0;
      for (int it = SOAK_WARMUP_ITERS; it < N; it++)
        differ += !same_plan(&in_order[it], &other[it]);
      EXPECTF(differ > N / 2, "seed %llu and the next: only %d of %d plans differ",
              (unsigned long long)seed, differ, N);
      for (int it = 1; it < N; it++)
        EXPECTF(in_order[it].rng != in_order[it - 1].rng, "iterations %d and %d draw alike", it - 1,
                it);
    }
  return TEST_PASS;
}

EPX_HOST_TEST(soak_epochs_visit_every_shape, 60) {
  const int S = soak_num_shapes;
  for (int i = 0; i < S; i++) {
    const soak_shape_t *sh = &soak_shapes[i];
    EXPECTF(sh->hidden % 128 == 0 && sh->hidden <= 2048, "shape %d: hidden %d", i, sh->hidden);
    EXPECTF(sh->max_tokens <= 512 && sh->ll_max_tokens <= sh->max_tokens,
            "shape %d: max tokens %d, low-latency %d", i, sh->max_tokens, sh->ll_max_tokens);
    EXPECTF(sh->top_k >= 1 && sh->top_k <= 2 * sh->experts_per_rank, "shape %d: top-%d of %d/rank",
            i, sh->top_k, sh->experts_per_rank);
    for (int R = 2; R <= 8; R *= 2) {
      epx_group_config_t c = EPX_GROUP_CONFIG_INIT;
      c.max_tokens_per_rank = sh->max_tokens, c.hidden = sh->hidden, c.top_k = sh->top_k;
      c.num_experts = sh->experts_per_rank * R;
      c.modes = EPX_MODE_NORMAL | EPX_MODE_LOW_LATENCY;
      c.ll_max_tokens_per_rank = sh->ll_max_tokens;
      EXPECTF(epx_config_validate(&c, R) == EPX_OK, "shape %d at %d ranks: %s", i, R,
              epx_last_error());
    }
  }
  for (int i = 0; i < NUM_SEEDS; i++) {
    const uint64_t seed = seeds[i];
    soak_epoch_t prev, e;
    soak_epoch_of(seed, 0, &prev);
    EXPECT(prev.begin == 0 && prev.index == 0);
    int shapes_after = 0, routes_after = 0, warm_shapes = 1 << prev.shape;
    for (long long it = 1; it < 200000; it++) {
      soak_epoch_of(seed, it, &e);
      if (it < prev.end) {
        EXPECTF(memcmp(&e, &prev, sizeof e) == 0, "iteration %lld: another epoch", it);
        continue;
      }
      EXPECTF(e.begin == prev.end && e.index == prev.index + 1 && e.shape != prev.shape,
              "epoch %d [%lld, %lld) shape %d after [%lld, %lld) shape %d", e.index, e.begin, e.end,
              e.shape, prev.begin, prev.end, prev.shape);
      EXPECT(e.ll_route >= EPX_LL_ROUTE_DIRECT && e.ll_route <= EPX_LL_ROUTE_DISPATCH_BY_RANK);
      EXPECT(e.shape >= 0 && e.shape < S);
      if (e.begin < SOAK_WARMUP_ITERS) {
        warm_shapes |= 1 << e.shape;
        EXPECT(e.end <= SOAK_WARMUP_ITERS && e.end - e.begin >= 2);
      } else {
        EXPECTF(e.end - e.begin >= SOAK_EPOCH_MIN_ITERS && e.end - e.begin <= SOAK_EPOCH_MAX_ITERS,
                "epoch %d: %lld iterations", e.index, e.end - e.begin);
        if (e.begin < 100000) shapes_after |= 1 << e.shape, routes_after |= 1 << e.ll_route;
      }
      if (e.begin == SOAK_WARMUP_ITERS) EXPECT_EQ_INT(warm_shapes, (1 << S) - 1);
      prev = e;
    }
    EXPECTF(shapes_after == (1 << S) - 1, "seed %llu: shapes after the warm-up 0x%x",
            (unsigned long long)seed, shapes_after);
    EXPECTF(routes_after == 0xE, "seed %llu: routes after the warm-up 0x%x",
            (unsigned long long)seed, routes_after);
    /* The first two iterations of each warm-up epoch: both modes at full token counts. */
    for (int k = 0; k < S; k++) {
      soak_epoch_of(seed, (long long)k * SOAK_WARMUP_ITERS / S, &e);
      soak_iter_t p[2];
      for (int j = 0; j < 2; j++) soak_plan(seed, e.begin + j, &e, 4, &p[j]);
      EXPECT(p[0].mode == SOAK_MODE_NORMAL && p[0].tokens == soak_shapes[e.shape].max_tokens);
      EXPECT(p[1].mode == SOAK_MODE_LL && p[1].tokens == soak_shapes[e.shape].ll_max_tokens);
    }
  }
  return TEST_PASS;
}

/* Index of a normal plan's option combination: fp8 x counts x combine x cached. */
static int normal_combo(const soak_iter_t *p) {
  const soak_combine_t *c = &p->combine;
  int i = p->fp8;
  i = i * 3 + p->counts;
  i = i * 2 + c->experts;
  i = i * 2 + c->weighted;
  i = i * 2 + c->reduce_weights;
  i = i * 3 + c->num_bias;
  return i * 2 + p->cached;
}
#define NORMAL_COMBOS (2 * 3 * 2 * 2 * 2 * 3 * 2)

/* Index of a low-latency plan's: receive format x layout x split x zero copy x weights. */
static int ll_combo(const soak_iter_t *p) {
  int i = p->fp8 + p->ue8m0 + p->ue8m0_packed; /* BF16, FP8, UE8M0, UE8M0 words */
  i = i * 3 + p->packed + p->layout_range;     /* fixed, packed, packed + range */
  i = i * 2 + p->split;
  i = i * 2 + p->zero_copy;
  i = i * 2 + p->ll_weights;
  return i * 2 + p->combine_weights;
}
#define LL_COMBOS (4 * 3 * 2 * 2 * 2 * 2)

/* The constraints of one plan; returns a description of the first broken one, or NULL. */
static const char *broken(const soak_iter_t *p, const soak_epoch_t *e, int R) {
  const soak_shape_t *sh = &soak_shapes[e->shape];
  const int max = p->mode == SOAK_MODE_LL ? sh->ll_max_tokens : sh->max_tokens;
  if (!(p->tokens == -1 || p->tokens == 0 || p->tokens == 1 || p->tokens == max)) return "tokens";
  if (p->empty_rank < -1 || p->empty_rank >= R) return "empty rank";
  if (p->mode == SOAK_MODE_NORMAL) {
    if (p->ue8m0 || p->packed || p->split || p->zero_copy || p->combine_weights || p->ll_weights)
      return "low-latency options in a normal plan";
    if (p->fp8 && (p->combine.experts || p->cached_combine.experts))
      return "identity experts (BF16 received rows) with FP8";
    if (p->counts != SOAK_COUNTS_WORST && p->worst) return "worst kind without num_worst_tokens";
    if (!p->cached &&
        memcmp(&p->cached_combine, &(soak_combine_t){0, 0, 0, 0}, sizeof(soak_combine_t)))
      return "cached combine without a cached dispatch";
  } else {
    if (p->counts || p->worst || p->expert_alignment || p->dispatch_weights || p->cached ||
        p->combine.weighted || p->combine.num_bias)
      return "normal options in a low-latency plan";
    if (p->ue8m0 && !p->fp8) return "UE8M0 without FP8";
    if (p->ue8m0_packed && !p->ue8m0) return "UE8M0 words without UE8M0";
    if (p->packed && e->ll_route == EPX_LL_ROUTE_DIRECT) return "packed layout on route DIRECT";
    if (p->layout_range && !p->packed) return "layout range without the packed layout";
  }
  return NULL;
}

EPX_HOST_TEST(soak_plan_reaches_every_option, 120) {
  enum { N = 100000 };
  for (int i = 0; i < NUM_SEEDS; i++)
    for (int R = 2; R <= 4; R += 2) {
      const uint64_t seed = seeds[i];
      static unsigned char normal_seen[NORMAL_COMBOS], ll_seen[LL_COMBOS];
      int routes[2] = {0, 0}, token_kinds[2] = {0, 0}, empty = 0, worst = 0, aligns = 0,
          no_weights = 0, cached_combines = 0;
      memset(normal_seen, 0, sizeof normal_seen), memset(ll_seen, 0, sizeof ll_seen);
      soak_epoch_t e;
      soak_epoch_of(seed, 0, &e);
      for (long long it = 0; it < N; it++) {
        if (it >= e.end) soak_epoch_of(seed, it, &e);
        soak_iter_t p;
        soak_plan(seed, it, &e, R, &p);
        const char *why = broken(&p, &e, R);
        EXPECTF(why == NULL, "seed %llu, %d ranks, iteration %lld: %s", (unsigned long long)seed, R,
                it, why);
        routes[p.mode] |= 1 << p.route;
        token_kinds[p.mode] |= p.tokens < 0 ? 1 : p.tokens == 0 ? 2 : p.tokens == 1 ? 4 : 8;
        if (p.empty_rank >= 0) empty |= 1 << p.empty_rank;
        if (p.mode == SOAK_MODE_NORMAL) {
          normal_seen[normal_combo(&p)] = 1;
          if (p.counts == SOAK_COUNTS_WORST) worst |= 1 << p.worst;
          aligns |= p.expert_alignment == 0 ? 1 : p.expert_alignment == 1 ? 2 : 4;
          aligns |= p.expert_alignment == 128 ? 8 : 0;
          no_weights |= 1 << p.dispatch_weights;
          if (p.cached)
            cached_combines |= 1 << (p.cached_combine.experts * 2 + p.cached_combine.weighted);
        } else {
          ll_seen[ll_combo(&p)] = 1;
        }
      }
      for (int c = 0; c < NORMAL_COMBOS; c++) {
        const int fp8 = c / (NORMAL_COMBOS / 2), identity = c / 24 % 2;
        if (fp8 && identity) continue; /* identity experts read BF16 rows */
        EXPECTF(normal_seen[c], "seed %llu, %d ranks: normal option combination %d never drawn",
                (unsigned long long)seed, R, c);
      }
      for (int c = 0; c < LL_COMBOS; c++)
        EXPECTF(ll_seen[c], "seed %llu, %d ranks: low-latency option combination %d never drawn",
                (unsigned long long)seed, R, c);
      for (int m = 0; m < 2; m++) {
        EXPECTF(routes[m] == 0x7f, "mode %d: routings 0x%x", m, routes[m]);
        EXPECTF(token_kinds[m] == 0xf, "mode %d: token patterns 0x%x", m, token_kinds[m]);
      }
      EXPECT_EQ_INT(empty, (1 << R) - 1);
      EXPECT_EQ_INT(worst, 7);
      EXPECT_EQ_INT(aligns, 15);
      EXPECT_EQ_INT(no_weights, 3);
      EXPECT_EQ_INT(cached_combines, 15);
    }
  return TEST_PASS;
}

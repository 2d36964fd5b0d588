/*
 * moe_common.h - what the MoE-layer benches share (bench/moe/moe_bench.c at decode,
 * bench/moe_prefill/moe_prefill_bench.c at prefill): the two expert shapes, the routing, random
 * expert weights, the float comparison their medians sort with, their common options, and
 * running the ranks.
 */
#ifndef EPX_BENCH_MOE_COMMON_H_
#define EPX_BENCH_MOE_COMMON_H_

#include <stdint.h>

#include "common/ranks.h"
#include "epx.h"

#define MOE_TOP_K 8

typedef struct {
  const char *name;
  int hidden, intermediate, experts;
} moe_shape_t;

/* DeepSeek-V3's experts and Qwen3-30B-A3B's, the MoE issue's two shapes. */
extern const moe_shape_t moe_shapes[2];

/* qsort's comparison of floats, ascending. */
int moe_cmp_float(const void *a, const void *b);

/* MOE_TOP_K distinct uniform experts per token and their weights, from an LCG seeded with seed
 * (ids [T, MOE_TOP_K] of E experts, w [T, MOE_TOP_K]). The prefill benches route rank r's tokens
 * with seed MOE_ROUTE_SEED + r. */
#define MOE_ROUTE_SEED 77u
void moe_route(int64_t *ids, float *w, int T, int E, uint64_t seed);

/* L experts of shape s on the current GPU, random: BF16 weights, or FP8 with 128x128 float32
 * block scales. 0, or -1 after printing the failing call. Free with moe_free_experts. */
int moe_alloc_experts(const moe_shape_t *s, int L, int fp8, uint64_t seed, epx_experts_t *ex);
void moe_free_experts(epx_experts_t *ex);

/* The options both benches take: --tokens (a list), --shape deepseek|qwen3 (else both), --dtype
 * bf16|fp8 (else both), --iters, --ranks (0: every visible GPU); warmup is the bench's own. */
#define MOE_MAX_LIST 8
typedef struct {
  int tokens[MOE_MAX_LIST], num_tokens;
  int shapes[2], num_shapes;
  int fp8[2], num_dtypes;
  int iters, warmup, ranks;
} moe_options_t;

/* If argv[*i] is one of those options with a value after it: sets it, moves *i past the value
 * and returns 1; a --tokens list out of [1, max_tokens] (said on stderr): -1; another
 * argument: 0. */
int moe_parse_option(moe_options_t *o, int argc, char **argv, int *i, int max_tokens);

/* fn on one rank process per visible GPU (at most EPX_MAX_RANKS; ranks > 0: at most that many),
 * under the bench's own 1200 s limit; without a GPU, prints "skipped" and returns 0. The
 * bench's exit code: 0, or 1 when a rank failed. */
int moe_bench_run(const char *name, int ranks, ranks_fn fn, void *arg);

#endif /* EPX_BENCH_MOE_COMMON_H_ */

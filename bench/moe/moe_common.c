/*
 * moe_common.c - the MoE-layer benches' shared pieces (moe_common.h).
 */
#include "moe/moe_common.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "experts/bench_kernels.h"

const moe_shape_t moe_shapes[2] = {{"deepseek", 7168, 2048, 256}, {"qwen3", 2048, 768, 128}};

int moe_cmp_float(const void *a, const void *b) {
  const float x = *(const float *)a, y = *(const float *)b;
  return (x > y) - (x < y);
}

void moe_route(int64_t *ids, float *w, int T, int E, uint64_t seed) {
  uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
  for (int t = 0; t < T; t++)
    for (int k = 0; k < MOE_TOP_K; k++) {
      int e, dup;
      do {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        e = (int)((s >> 33) % (uint64_t)E);
        dup = 0;
        for (int j = 0; j < k; j++) dup |= ids[t * MOE_TOP_K + j] == e;
      } while (dup);
      ids[t * MOE_TOP_K + k] = e;
      w[t * MOE_TOP_K + k] = 0.05f + (float)((s >> 40) & 1023) / 8192.f;
    }
}
int moe_alloc_experts(const moe_shape_t *s, int L, int fp8, uint64_t seed, epx_experts_t *ex) {
  const size_t H = s->hidden, I = s->intermediate, n_gu = (size_t)L * 2 * I * H,
               n_dn = (size_t)L * H * I, elem = fp8 ? 1 : 2;
  void *gu, *dn;
  BENCH_CUDA(cudaMalloc(&gu, n_gu * elem));
  BENCH_CUDA(cudaMalloc(&dn, n_dn * elem));
  *ex = (epx_experts_t)EPX_EXPERTS_INIT;
  ex->num_experts = L, ex->hidden = s->hidden, ex->intermediate = s->intermediate;
  ex->weight_dtype = fp8 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16;
  ex->gate_up = gu, ex->down = dn;
  if (!fp8) {
    BENCH_CUDA(bench_fill_bf16(gu, n_gu, 0.02f, seed));
    BENCH_CUDA(bench_fill_bf16(dn, n_dn, 0.02f, seed + 1));
    return 0;
  }
  float *gus, *dns;
  const size_t s_gu = (size_t)L * (2 * I / 128) * (H / 128),
               s_dn = (size_t)L * (H / 128) * (I / 128);
  BENCH_CUDA(cudaMalloc((void **)&gus, s_gu * 4));
  BENCH_CUDA(cudaMalloc((void **)&dns, s_dn * 4));
  BENCH_CUDA(bench_fill_fp8(gu, n_gu, seed));
  BENCH_CUDA(bench_fill_fp8(dn, n_dn, seed + 1));
  BENCH_CUDA(bench_fill_f32(gus, s_gu, 1e-4f, 2e-4f, seed + 2));
  BENCH_CUDA(bench_fill_f32(dns, s_dn, 1e-4f, 2e-4f, seed + 3));
  ex->gate_up_scales = gus, ex->down_scales = dns;
  return 0;
}

void moe_free_experts(epx_experts_t *ex) {
  cudaFree((void *)ex->gate_up), cudaFree((void *)ex->down);
  cudaFree((void *)ex->gate_up_scales), cudaFree((void *)ex->down_scales);
}

int moe_parse_option(moe_options_t *o, int argc, char **argv, int *i, int max_tokens) {
  const char *a = argv[*i], *v = *i + 1 < argc ? argv[*i + 1] : NULL;
  if (!v) return 0;
  if (!strcmp(a, "--tokens")) {
    if (bench_parse_list(a, v, 1, max_tokens, MOE_MAX_LIST, o->tokens, &o->num_tokens)) return -1;
  } else if (!strcmp(a, "--shape")) {
    o->num_shapes = 1, o->shapes[0] = !strcmp(v, "qwen3");
  } else if (!strcmp(a, "--dtype")) {
    o->num_dtypes = 1, o->fp8[0] = !strcmp(v, "fp8");
  } else if (!strcmp(a, "--iters")) {
    o->iters = atoi(v);
  } else if (!strcmp(a, "--ranks")) {
    o->ranks = atoi(v);
  } else {
    return 0;
  }
  (*i)++;
  return 1;
}

int moe_bench_run(const char *name, int ranks, ranks_fn fn, void *arg) {
  const int visible = ranks_count_gpus(name, 60);
  if (visible < 1) {
    printf("%s: no GPU visible\nskipped\n", name);
    return 0;
  }
  int R = visible < EPX_MAX_RANKS ? visible : EPX_MAX_RANKS;
  if (ranks > 0) R = ranks < R ? ranks : R;
  const ranks_config_t cfg = {name, 1200, 30, 0, "the bench's own limit", 0};
  return ranks_run(&cfg, R, fn, arg, NULL) ? 1 : 0;
}

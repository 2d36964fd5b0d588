/*
 * workload.c - the EP workload every row of one token count shares, and its correctness checks.
 *
 * Routing: for each token, top-K DISTINCT experts drawn uniformly (splitmix64 seeded with
 * --seed and the rank; token t's draws do not depend on T, so a smaller T is a prefix).
 * Payload: x[t][h] is a BF16 value hashed from (seed, rank, t, h) on the GPU
 * (bench_kernels.cu). Because both are pure functions of the seed, every rank recomputes on
 * the host what each source must send it, in the normal-mode receive order (source rank
 * ascending, then source token ascending), and the check kernels recompute the payload: no
 * data has to be trusted or exchanged to verify a result.
 */
#include <stdlib.h>
#include <string.h>

#include "bench.h"

static uint64_t splitmix64(uint64_t *state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* topk[T][K] of rank `rank`: K distinct experts per token, uniform over [0, E). K <= E. */
static void make_routing(uint64_t seed, int rank, int num_tokens, int top_k, int num_experts,
                         int64_t *topk) {
  uint64_t state = seed ^ (0xD1B54A32D192ED03ull * (uint64_t)(rank + 1));
  for (int t = 0; t < num_tokens; t++) {
    int64_t *row = topk + (size_t)t * top_k;
    for (int k = 0; k < top_k;) {
      const int64_t e = (int64_t)(splitmix64(&state) % (uint64_t)num_experts);
      int repeated = 0;
      for (int j = 0; j < k; j++) repeated |= row[j] == e;
      if (!repeated) row[k++] = e;
    }
  }
}

/* Bit mask of the ranks token `row` goes to. */
static unsigned token_ranks(const int64_t *row, int top_k, int experts_per_rank) {
  unsigned mask = 0;
  for (int k = 0; k < top_k; k++) mask |= 1u << (int)(row[k] / experts_per_rank);
  return mask;
}

int bench_workload_create(bench_rank_t *b, int max_tokens, bench_workload_t *w) {
  const bench_options_t *o = b->opt;
  memset(w, 0, sizeof *w);
  w->max_tokens = max_tokens;
  BENCH_CUDA(cudaMalloc((void **)&w->topk_idx, (size_t)max_tokens * o->top_k * sizeof(int64_t)));
  BENCH_CUDA(cudaMalloc(&w->x, (size_t)max_tokens * o->hidden * 2));
  BENCH_CUDA(cudaMalloc((void **)&w->ranks_per_token, (size_t)max_tokens * sizeof(int)));
  BENCH_CUDA(cudaMalloc((void **)&w->expected_src,
                        (size_t)b->num_ranks * max_tokens * 2 * sizeof(int32_t)));
  BENCH_CUDA(cudaMalloc((void **)&w->wrong_dev, sizeof *w->wrong_dev));
  return 0;
}

int bench_workload_destroy(bench_workload_t *w) {
  BENCH_CUDA(cudaFree(w->topk_idx));
  BENCH_CUDA(cudaFree(w->x));
  BENCH_CUDA(cudaFree(w->ranks_per_token));
  BENCH_CUDA(cudaFree(w->expected_src));
  BENCH_CUDA(cudaFree(w->wrong_dev));
  memset(w, 0, sizeof *w);
  return 0;
}

/* From every source's routing: what this rank receives (expected_src, expected_recv), and
 * from its own routing: how many ranks each of its tokens goes to. Host arrays sized by the
 * caller: expected [R * T * 2], ranks_per_token [T], topk scratch [T * K]. */
static void expectations(const bench_rank_t *b, int num_tokens, int64_t *topk, int32_t *expected,
                         int *expected_recv, int *ranks_per_token) {
  const bench_options_t *o = b->opt;
  const int experts_per_rank = o->num_experts / b->num_ranks;
  int rows = 0;
  for (int s = 0; s < b->num_ranks; s++) {
    make_routing(o->seed, s, num_tokens, o->top_k, o->num_experts, topk);
    expected_recv[s] = 0;
    for (int t = 0; t < num_tokens; t++) {
      const unsigned mask = token_ranks(topk + (size_t)t * o->top_k, o->top_k, experts_per_rank);
      if (s == b->rank) ranks_per_token[t] = __builtin_popcount(mask);
      if (!(mask >> b->rank & 1u)) continue;
      expected[2 * rows] = s;
      expected[2 * rows + 1] = t;
      rows++;
      expected_recv[s]++;
    }
  }
}

/* Copy the host arrays to w (ordered on the rank's stream, finished before returning, so the
 * caller may free them) and generate x. */
static int upload(bench_rank_t *b, bench_workload_t *w, const int64_t *topk,
                  const int32_t *expected, int rows, const int *ranks_per_token) {
  const bench_options_t *o = b->opt;
  const int T = w->num_tokens;
  BENCH_CUDA(cudaMemcpyAsync(w->topk_idx, topk, (size_t)T * o->top_k * sizeof(int64_t),
                             cudaMemcpyHostToDevice, b->stream));
  BENCH_CUDA(cudaMemcpyAsync(w->expected_src, expected, (size_t)rows * 2 * sizeof(int32_t),
                             cudaMemcpyHostToDevice, b->stream));
  BENCH_CUDA(cudaMemcpyAsync(w->ranks_per_token, ranks_per_token, (size_t)T * sizeof(int),
                             cudaMemcpyHostToDevice, b->stream));
  BENCH_CUDA(bench_fill_x_launch(w->x, T, o->hidden, o->seed, b->rank, b->stream));
  BENCH_CUDA(cudaStreamSynchronize(b->stream));
  return 0;
}

int bench_workload_fill(bench_rank_t *b, bench_workload_t *w, int num_tokens) {
  const bench_options_t *o = b->opt;
  int64_t *topk = (int64_t *)malloc((size_t)num_tokens * o->top_k * sizeof(int64_t));
  int32_t *expected = (int32_t *)malloc((size_t)b->num_ranks * num_tokens * 2 * sizeof(int32_t));
  int *ranks_per_token = (int *)malloc((size_t)num_tokens * sizeof(int));
  int rc = -1;
  if (topk && expected && ranks_per_token) {
    expectations(b, num_tokens, topk, expected, w->expected_recv, ranks_per_token);
    int rows = 0;
    for (int s = 0; s < b->num_ranks; s++) rows += w->expected_recv[s];
    make_routing(o->seed, b->rank, num_tokens, o->top_k, o->num_experts, topk); /* our own */
    w->num_tokens = num_tokens;
    rc = upload(b, w, topk, expected, rows, ranks_per_token);
  } else {
    bench_report_failure(__FILE__, __LINE__, "malloc", "out of host memory");
  }
  free(topk);
  free(expected);
  free(ranks_per_token);
  return rc;
}

/* *wrong = the check kernels' count, read back after the stream's work. */
static int read_wrong(bench_rank_t *b, const bench_workload_t *w, long long *wrong) {
  unsigned long long count = 0;
  BENCH_CUDA(
      cudaMemcpyAsync(&count, w->wrong_dev, sizeof count, cudaMemcpyDeviceToHost, b->stream));
  BENCH_CUDA(cudaStreamSynchronize(b->stream));
  *wrong = (long long)count;
  return 0;
}

int bench_check_dispatch(bench_rank_t *b, const bench_workload_t *w, const void *recv_x,
                         const int *recv_counts, long long *wrong) {
  const size_t row_bytes = (size_t)b->opt->hidden * 2;
  long long missing_or_extra = 0;
  int got_row = 0, expected_row = 0;
  BENCH_CUDA(cudaMemsetAsync(w->wrong_dev, 0, sizeof *w->wrong_dev, b->stream));
  for (int s = 0; s < b->num_ranks; s++) {
    const int got = recv_counts[s], expected = w->expected_recv[s];
    const int common = got < expected ? got : expected;
    missing_or_extra += got > expected ? got - expected : expected - got;
    if (common > 0)
      BENCH_CUDA(bench_check_rows_launch((const char *)recv_x + (size_t)got_row * row_bytes,
                                         w->expected_src + 2 * (size_t)expected_row, common,
                                         b->opt->hidden, b->opt->seed, w->wrong_dev, b->stream));
    got_row += got;
    expected_row += expected;
  }
  BENCH_TRY(read_wrong(b, w, wrong));
  *wrong += missing_or_extra;
  return 0;
}

int bench_check_combine(bench_rank_t *b, const bench_workload_t *w, const void *out,
                        long long *wrong) {
  BENCH_CUDA(cudaMemsetAsync(w->wrong_dev, 0, sizeof *w->wrong_dev, b->stream));
  BENCH_CUDA(bench_check_scaled_launch(out, w->ranks_per_token, w->num_tokens, b->opt->hidden,
                                       b->opt->seed, b->rank, w->wrong_dev, b->stream));
  return read_wrong(b, w, wrong);
}

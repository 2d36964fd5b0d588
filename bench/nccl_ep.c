/*
 * nccl_ep.c - the NCCL baseline: the same EP workload done the way a user without EPX would,
 * in BF16, with plain NCCL point-to-point calls.
 *
 *   "nccl dispatch (full path)"  epx_layout (per-destination counts and positions on the GPU),
 *       count exchange with ncclAlltoAll, counts copied to the host and the stream synchronized,
 *       a pack kernel (token t goes to row send_prefix[r] + token_pos_in_rank[t][r] for each
 *       rank r it chose), then one grouped ncclSend/ncclRecv per peer (self included).
 *   "nccl a2a only"   the grouped send/recv alone, with the counts of the full path.
 *   "nccl combine"    the received rows go back unchanged (the reverse send/recv), then a kernel
 *       sums, for each token, the rows that came back from each rank in float32 and writes
 *       BF16 [T, H] (unweighted).
 * Logical bytes of a row: rows this rank receives in that operation x hidden x 2 (own tokens
 * included). Every row is checked against the seed (workload.c); outputs are poisoned with
 * NaNs before each row so that a stale result cannot pass.
 */
#include <stdlib.h>
#include <string.h>

#include "bench.h"

struct bench_nccl {
  bench_rank_t *b;
  bench_workload_t *w;             /* the workload being measured */
  size_t row_bytes, capacity_rows; /* capacity: R x max_tokens rows per buffer */
  /* counts_dev [2R]: [0, R) tokens this rank sends to each rank (epx_layout), [R, 2R) tokens
   * it receives from each (the all-to-all); counts_host: pinned copy of both halves. */
  int *counts_dev, *counts_host;
  int *token_pos_in_rank; /* device [max_tokens, R] */
  int send_prefix[EPX_MAX_RANKS + 1], recv_prefix[EPX_MAX_RANKS + 1];
  void *send_rows; /* [capacity, H] packed by destination rank */
  void *recv_rows; /* [capacity, H] dispatch output, by source rank */
  void *back_rows; /* [capacity, H] combine: rows returned to this rank, by destination rank */
  void *out;       /* [max_tokens, H] combine output */
};

int bench_nccl_create(bench_rank_t *b, int max_tokens, bench_nccl_t **out) {
  bench_nccl_t *n = (bench_nccl_t *)calloc(1, sizeof *n);
  if (!n) {
    bench_report_failure(__FILE__, __LINE__, "calloc", "out of host memory");
    return -1;
  }
  *out = n;
  const int R = b->num_ranks;
  n->b = b;
  n->row_bytes = (size_t)b->opt->hidden * 2;
  n->capacity_rows = (size_t)R * max_tokens;
  BENCH_CUDA(cudaMalloc((void **)&n->counts_dev, 2 * R * sizeof(int)));
  BENCH_CUDA(cudaMallocHost((void **)&n->counts_host, 2 * R * sizeof(int)));
  BENCH_CUDA(cudaMalloc((void **)&n->token_pos_in_rank, (size_t)max_tokens * R * sizeof(int)));
  BENCH_CUDA(cudaMalloc(&n->send_rows, n->capacity_rows * n->row_bytes));
  BENCH_CUDA(cudaMalloc(&n->recv_rows, n->capacity_rows * n->row_bytes));
  BENCH_CUDA(cudaMalloc(&n->back_rows, n->capacity_rows * n->row_bytes));
  BENCH_CUDA(cudaMalloc(&n->out, (size_t)max_tokens * n->row_bytes));
  return 0;
}

int bench_nccl_destroy(bench_nccl_t *n) {
  if (!n) return 0;
  BENCH_CUDA(cudaFree(n->counts_dev));
  BENCH_CUDA(cudaFreeHost(n->counts_host));
  BENCH_CUDA(cudaFree(n->token_pos_in_rank));
  BENCH_CUDA(cudaFree(n->send_rows));
  BENCH_CUDA(cudaFree(n->recv_rows));
  BENCH_CUDA(cudaFree(n->back_rows));
  BENCH_CUDA(cudaFree(n->out));
  free(n);
  return 0;
}

/* Prefix sums of the host counts; refuses counts that would overrun the buffers. */
static int make_prefixes(bench_nccl_t *n) {
  const int R = n->b->num_ranks, T = n->w->num_tokens;
  for (int r = 0; r < R; r++) {
    const int sent = n->counts_host[r], received = n->counts_host[R + r];
    if (sent < 0 || sent > T || received < 0 || received > T) {
      bench_report_failure(__FILE__, __LINE__, "count exchange", "a count is out of range");
      return -1;
    }
    n->send_prefix[r + 1] = n->send_prefix[r] + sent;
    n->recv_prefix[r + 1] = n->recv_prefix[r] + received;
  }
  return 0;
}

/* Layout on the GPU, count exchange, counts on the host (the path's host synchronization). */
static int exchange_counts(bench_nccl_t *n, cudaStream_t stream) {
  const bench_rank_t *b = n->b;
  const int R = b->num_ranks;
  epx_layout_args_t la = EPX_LAYOUT_ARGS_INIT;
  la.topk_idx = n->w->topk_idx;
  la.topk_idx_dtype = EPX_DTYPE_INT64;
  la.num_tokens = n->w->num_tokens;
  la.num_tokens_per_rank = n->counts_dev;
  la.token_pos_in_rank = n->token_pos_in_rank;
  BENCH_EPX(epx_layout(b->group, &la, stream));
  BENCH_NCCL(ncclAlltoAll(n->counts_dev, n->counts_dev + R, 1, ncclInt32, b->comm, stream));
  BENCH_CUDA(cudaMemcpyAsync(n->counts_host, n->counts_dev, 2 * R * sizeof(int),
                             cudaMemcpyDeviceToHost, stream));
  BENCH_CUDA(cudaStreamSynchronize(stream));
  return make_prefixes(n);
}

/* One grouped send/recv: counts[p] rows from send + prefix[p] rows go to peer p, and
 * recv_counts[p] rows from peer p land at recv + recv_prefix[p] rows. */
static int send_recv_rows(bench_nccl_t *n, const void *send, const int *send_counts,
                          const int *send_prefix, void *recv, const int *recv_counts,
                          const int *recv_prefix, cudaStream_t stream) {
  const bench_rank_t *b = n->b;
  const size_t hidden = (size_t)b->opt->hidden;
  BENCH_NCCL(ncclGroupStart());
  for (int p = 0; p < b->num_ranks; p++) {
    BENCH_NCCL(ncclSend((const char *)send + send_prefix[p] * n->row_bytes,
                        (size_t)send_counts[p] * hidden, ncclBfloat16, p, b->comm, stream));
    BENCH_NCCL(ncclRecv((char *)recv + recv_prefix[p] * n->row_bytes,
                        (size_t)recv_counts[p] * hidden, ncclBfloat16, p, b->comm, stream));
  }
  BENCH_NCCL(ncclGroupEnd());
  return 0;
}

static int a2a_iter(void *arg, cudaStream_t stream) {
  bench_nccl_t *n = (bench_nccl_t *)arg;
  const int R = n->b->num_ranks;
  return send_recv_rows(n, n->send_rows, n->counts_host, n->send_prefix, n->recv_rows,
                        n->counts_host + R, n->recv_prefix, stream);
}

/* Arguments of the pack and reduce kernels: rows grouped by destination rank. */
static bench_rows_args_t rows_by_destination(const bench_nccl_t *n, void *rows, void *x) {
  bench_rows_args_t a;
  memset(&a, 0, sizeof a);
  a.rows = rows;
  memcpy(a.prefix, n->send_prefix, sizeof a.prefix);
  a.token_pos_in_rank = n->token_pos_in_rank;
  a.x = x;
  a.num_tokens = n->w->num_tokens;
  a.hidden = n->b->opt->hidden;
  a.num_ranks = n->b->num_ranks;
  return a;
}

static int dispatch_iter(void *arg, cudaStream_t stream) {
  bench_nccl_t *n = (bench_nccl_t *)arg;
  BENCH_TRY(exchange_counts(n, stream));
  const bench_rows_args_t pack = rows_by_destination(n, n->send_rows, n->w->x);
  BENCH_CUDA(bench_pack_launch(&pack, stream));
  return a2a_iter(n, stream);
}

static int combine_iter(void *arg, cudaStream_t stream) {
  bench_nccl_t *n = (bench_nccl_t *)arg;
  const int R = n->b->num_ranks;
  BENCH_TRY(send_recv_rows(n, n->recv_rows, n->counts_host + R, n->recv_prefix, n->back_rows,
                           n->counts_host, n->send_prefix, stream));
  const bench_rows_args_t reduce = rows_by_destination(n, n->back_rows, n->out);
  BENCH_CUDA(bench_reduce_launch(&reduce, stream));
  return 0;
}

/* NaN (0xFFFF in BF16) everywhere in buf: the workload never produces one. */
static int poison(bench_nccl_t *n, void *buf, size_t rows) {
  BENCH_CUDA(cudaMemsetAsync(buf, 0xff, rows * n->row_bytes, n->b->stream));
  return 0;
}

static int emit(bench_nccl_t *n, const char *op, const bench_stats_t *stats, long long wrong,
                int rows_received) {
  bench_rank_t *b = n->b;
  bench_row_t row = bench_workload_row(b, op, n->w->num_tokens);
  BENCH_TRY(bench_finish_row(b, stats, wrong, (double)rows_received * n->row_bytes, &row));
  row.ratio_ceiling = row.gbps / bench_table_best_ceiling(&b->table);
  return bench_emit_row(b, &row);
}

int bench_nccl_rows(bench_nccl_t *n, bench_workload_t *w) {
  bench_rank_t *b = n->b;
  const int R = b->num_ranks;
  bench_stats_t stats;
  long long wrong;
  n->w = w;

  BENCH_TRY(poison(n, n->recv_rows, n->capacity_rows));
  BENCH_TRY(bench_time(b, dispatch_iter, n, &stats));
  BENCH_TRY(bench_check_dispatch(b, w, n->recv_rows, n->counts_host + R, &wrong));
  BENCH_TRY(emit(n, BENCH_OP_NCCL_DISPATCH, &stats, wrong, n->recv_prefix[R]));

  BENCH_TRY(poison(n, n->recv_rows, n->capacity_rows));
  BENCH_TRY(bench_time(b, a2a_iter, n, &stats));
  BENCH_TRY(bench_check_dispatch(b, w, n->recv_rows, n->counts_host + R, &wrong));
  BENCH_TRY(emit(n, BENCH_OP_NCCL_A2A, &stats, wrong, n->recv_prefix[R]));

  BENCH_TRY(poison(n, n->back_rows, n->capacity_rows));
  BENCH_TRY(poison(n, n->out, (size_t)w->max_tokens));
  BENCH_TRY(bench_time(b, combine_iter, n, &stats));
  BENCH_TRY(bench_check_combine(b, w, n->out, &wrong));
  return emit(n, BENCH_OP_NCCL_COMBINE, &stats, wrong, n->send_prefix[R]);
}

/*
 * epx_rows.c - EPX's own rows in epx_bench: normal-mode dispatch (BF16 and FP8), dispatch
 * without host synchronization, cached dispatch and combine, on the same workload as the NCCL
 * rows, for every SM count of --epx-sms (one group each: the SM budget is a group setting).
 *
 * Rows (docs/bench.md):
 *   epx dispatch bf16      epx_dispatch as a user calls it: layout + count exchange + the one
 *                          host wait for the receive counts + the data
 *   epx dispatch nosync    the same with sync_counts = 0 (capturable; counts on the device)
 *   epx dispatch fp8       FP8 payload + per-128 float32 scales, with host sync
 *   epx cached dispatch    the routing of the handle again: data only
 *   epx combine            every received row sent back unchanged and summed (unweighted)
 *   epx combine +weights   the same, each row's K float32 top-k weights sent back with it and
 *                          summed per token too (DeepEP combine's topk_weights); the cost of
 *                          the weight reduction is this row minus the one above
 * Logical bytes per rank = rows received (own tokens included) x row bytes, where a BF16 row is
 * H x 2 bytes and an FP8 row H + H/128 x 4 bytes (DeepEP's accounting).
 * BF16 dispatch and combine results are checked (wrong rows); FP8 payload is not (the tests
 * check it bit-exactly against the reference), so its row says -1.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "bench.h"

typedef struct {
  bench_rank_t *b;
  epx_group_t group;
  epx_handle_t handle;
  bench_workload_t *w;
  const void *x;
  epx_dtype_t dtype;
  const float *scales;
  int sync_counts;
  epx_dispatch_result_t result;
  void *out;
  float *out_w; /* combine +weights: [T, K] */
} epx_op_t;

static int dispatch_iter(void *arg, cudaStream_t stream) {
  epx_op_t *op = (epx_op_t *)arg;
  epx_dispatch_args_t a = EPX_DISPATCH_ARGS_INIT;
  a.x = op->x;
  a.x_dtype = op->dtype;
  a.x_scales = op->scales;
  a.topk_idx = op->w->topk_idx;
  a.num_tokens = op->w->num_tokens;
  a.sync_counts = op->sync_counts;
  BENCH_EPX(epx_dispatch(op->group, op->handle, &a, &op->result, stream));
  return 0;
}

static int cached_iter(void *arg, cudaStream_t stream) {
  epx_op_t *op = (epx_op_t *)arg;
  BENCH_EPX(epx_dispatch_cached(op->group, op->handle, op->x, op->dtype, op->scales, &op->result,
                                stream));
  return 0;
}

static int combine_iter(void *arg, cudaStream_t stream) {
  epx_op_t *op = (epx_op_t *)arg;
  epx_combine_args_t c = EPX_COMBINE_ARGS_INIT;
  c.x = op->result.recv_x;
  c.out = op->out;
  if (op->out_w) c.recv_topk_weights = op->result.recv_topk_weights, c.out_topk_weights = op->out_w;
  BENCH_EPX(epx_combine(op->group, op->handle, &c, stream));
  return 0;
}

/* GB/s of the NCCL row of this op and token count in the table; NAN if none. */
static double nccl_gbps(const bench_table_t *t, const char *op, int tokens) {
  for (int i = 0; i < t->num_rows; i++)
    if (!strcmp(t->rows[i].op, op) && t->rows[i].tokens == tokens) return t->rows[i].gbps;
  return NAN;
}

/* Time one op, check it, gather across ranks and emit its row. */
static int emit(epx_op_t *op, const char *name, bench_iter_fn fn, int sms, double row_bytes,
                const char *nccl_op, int check) {
  bench_rank_t *b = op->b;
  bench_stats_t st;
  BENCH_TRY(bench_time(b, fn, op, &st));
  /* Before the check: it checks the traced iteration too. */
  BENCH_TRY(bench_trace_row(b, op->group, name, fn, op, op->w->num_tokens, sms, &st));
  /* Rows received by this rank, from the device prefix (valid in every mode). */
  int prefix[EPX_MAX_RANKS + 1], counts[EPX_MAX_RANKS];
  BENCH_CUDA(cudaStreamSynchronize(b->stream));
  BENCH_CUDA(cudaMemcpy(prefix, op->result.recv_rank_prefix, sizeof(int) * (b->num_ranks + 1),
                        cudaMemcpyDeviceToHost));
  for (int s = 0; s < b->num_ranks; s++) counts[s] = prefix[s + 1] - prefix[s];
  long long wrong = -1;
  if (check == 1) BENCH_TRY(bench_check_dispatch(b, op->w, op->result.recv_x, counts, &wrong));
  if (check == 2) BENCH_TRY(bench_check_combine(b, op->w, op->out, &wrong));
  bench_row_t row = bench_workload_row(b, name, op->w->num_tokens);
  row.sms = sms;
  BENCH_TRY(bench_finish_row(b, &st, wrong, (double)prefix[b->num_ranks] * row_bytes, &row));
  row.ratio_ceiling = row.gbps / bench_table_ceiling(&b->table, sms);
  row.ratio_nccl = nccl_op ? row.gbps / nccl_gbps(&b->table, nccl_op, row.tokens) : NAN;
  return bench_emit_row(b, &row);
}

int bench_epx_rows(bench_rank_t *b, bench_workload_t *w) {
  const bench_options_t *opt = b->opt;
  const int H = opt->hidden;
  const double bf16_row = (double)H * 2, fp8_row = (double)H + (double)(H / 128) * 4;
  /* FP8 payload for timing: the BF16 buffer's bytes read as E4M3 (the copy is bit-exact
   * whatever the codes), scales from a small device buffer. */
  float *scales = NULL;
  void *out = NULL;
  const int can_fp8 = H % 128 == 0;
  BENCH_CUDA(cudaMalloc((void **)&scales, (size_t)w->max_tokens * (H / 128 + 1) * sizeof(float)));
  BENCH_CUDA(cudaMemset(scales, 0x3c, (size_t)w->max_tokens * (H / 128 + 1) * sizeof(float)));
  BENCH_CUDA(cudaMalloc(&out, (size_t)w->max_tokens * H * 2));
  float *out_w = NULL;
  BENCH_CUDA(cudaMalloc((void **)&out_w, (size_t)w->max_tokens * opt->top_k * sizeof(float)));
  BENCH_CUDA(cudaDeviceSynchronize());

  for (int i = 0; i < opt->num_epx_sms; i++) {
    const int sms = opt->epx_sms[i];
    if (sms > b->device_sms) continue;
    epx_group_config_t cfg = bench_group_config(opt);
    cfg.num_sms = sms;
    epx_op_t op;
    memset(&op, 0, sizeof op);
    op.b = b;
    op.w = w;
    op.out = out;
    BENCH_EPX(epx_group_create(b->comm, &cfg, &op.group));
    BENCH_EPX(epx_handle_create(op.group, &op.handle));

    op.x = w->x, op.dtype = EPX_DTYPE_BF16, op.scales = NULL, op.sync_counts = 1;
    BENCH_TRY(
        emit(&op, "epx dispatch bf16", dispatch_iter, sms, bf16_row, BENCH_OP_NCCL_DISPATCH, 1));
    op.sync_counts = 0;
    BENCH_TRY(
        emit(&op, "epx dispatch nosync", dispatch_iter, sms, bf16_row, BENCH_OP_NCCL_DISPATCH, 1));
    BENCH_TRY(emit(&op, "epx cached dispatch", cached_iter, sms, bf16_row, BENCH_OP_NCCL_A2A, 1));
    /* The handle now holds this routing and recv_x the BF16 rows: combine sends them back. */
    BENCH_TRY(emit(&op, "epx combine", combine_iter, sms, bf16_row, BENCH_OP_NCCL_COMBINE, 2));
    /* Its rows are checked as above; the weights the tests check bit-exactly. */
    op.out_w = out_w;
    BENCH_TRY(
        emit(&op, "epx combine +weights", combine_iter, sms, bf16_row, BENCH_OP_NCCL_COMBINE, 2));
    op.out_w = NULL;
    if (can_fp8) {
      op.dtype = EPX_DTYPE_FP8_E4M3, op.scales = scales, op.sync_counts = 1;
      BENCH_TRY(emit(&op, "epx dispatch fp8", dispatch_iter, sms, fp8_row, NULL, 0));
    }
    BENCH_EPX(epx_handle_destroy(op.handle));
    BENCH_EPX(epx_group_destroy(op.group));
  }
  BENCH_CUDA(cudaFree(scales));
  BENCH_CUDA(cudaFree(out));
  BENCH_CUDA(cudaFree(out_w));
  return 0;
}

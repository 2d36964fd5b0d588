/*
 * expand_rows.c - epx_bench's expert-major rows (epx_dispatch_expand, epx_combine_expand;
 * docs/moe.md, "Expert-major layout") on the same workload as the plain rows, for every SM
 * count of --epx-sms (one group each, with an expert-major buffer).
 *
 * Rows (docs/bench.md):
 *   epx dispatch expand    epx_dispatch_expand as a user calls it (sync_counts = 1): layout with
 *                          per-expert positions + the all-E count exchange + the host wait +
 *                          one row per (token, local expert), the payload sent once per
 *                          (token, rank) and fanned out after the dispatch (expand_fan_out
 *                          AFTER, the default)
 *   epx dispatch expand during  the same with expand_fan_out DURING (the fan-out inside the
 *                          dispatch kernel as rows land; its own group)
 *   epx combine expand     epx_combine_expand, weighted (the workload has no top-k weights, so
 *                          every row's weight is 0: the same arithmetic): the expert-side
 *                          reduce of each token's rows + today's combine, one row per
 *                          (token, rank)
 * Logical bytes per rank are the plain rows' (tokens received x H x 2), so a row's GB/s
 * compares with "epx dispatch bf16" / "epx combine" directly and the time ratio is the cost of
 * the layout (the MoE issue's target: expand dispatch <= 1.1 x plain dispatch). Results are not
 * checked here (wrong = -1): tests/gpu/test_expand.c checks them bit for bit.
 */
#include <stdio.h>
#include <string.h>

#include "bench.h"

typedef struct {
  epx_group_t group;
  epx_handle_t handle;
  bench_workload_t *w;
  epx_dispatch_expand_result_t result;
  void *out;
} expand_op_t;

static int dispatch_iter(void *arg, cudaStream_t stream) {
  expand_op_t *op = (expand_op_t *)arg;
  epx_dispatch_args_t a = EPX_DISPATCH_ARGS_INIT;
  a.x = op->w->x;
  a.topk_idx = op->w->topk_idx;
  a.num_tokens = op->w->num_tokens;
  a.sync_counts = 1;
  BENCH_EPX(epx_dispatch_expand(op->group, op->handle, &a, &op->result, stream));
  return 0;
}

static int combine_iter(void *arg, cudaStream_t stream) {
  expand_op_t *op = (expand_op_t *)arg;
  epx_combine_expand_args_t c = EPX_COMBINE_EXPAND_ARGS_INIT;
  c.x = op->result.recv_x;
  c.out = op->out;
  BENCH_EPX(epx_combine_expand(op->group, op->handle, &c, stream));
  return 0;
}

static int emit(bench_rank_t *b, expand_op_t *op, const char *name, bench_iter_fn fn, int sms) {
  bench_stats_t st;
  BENCH_TRY(bench_time(b, fn, op, &st));
  BENCH_TRY(bench_trace_row(b, op->group, name, fn, op, op->w->num_tokens, sms, &st));
  BENCH_CUDA(cudaStreamSynchronize(b->stream));
  int prefix[EPX_MAX_RANKS + 1];
  BENCH_CUDA(cudaMemcpy(prefix, op->result.recv_rank_prefix, sizeof(int) * (b->num_ranks + 1),
                        cudaMemcpyDeviceToHost));
  bench_row_t row = bench_workload_row(b, name, op->w->num_tokens);
  row.sms = sms;
  const double bytes = (double)prefix[b->num_ranks] * b->opt->hidden * 2;
  BENCH_TRY(bench_finish_row(b, &st, -1, bytes, &row));
  row.ratio_ceiling = row.gbps / bench_table_ceiling(&b->table, sms);
  return bench_emit_row(b, &row);
}

int bench_expand_rows(bench_rank_t *b, bench_workload_t *w) {
  const bench_options_t *opt = b->opt;
  const int R = b->num_ranks, L = opt->num_experts / R;
  void *out = NULL;
  BENCH_CUDA(cudaMalloc(&out, (size_t)w->max_tokens * opt->hidden * 2));
  for (int i = 0; i < opt->num_epx_sms; i++)
    for (int during = 0; during < 2; during++) {
      const int sms = opt->epx_sms[i];
      if (sms > b->device_sms) continue;
      if (during && 2 * sms > b->device_sms) continue; /* DURING needs 2 x sms SMs */
      epx_group_config_t cfg = bench_group_config(opt);
      cfg.num_sms = sms;
      cfg.expand_fan_out = during ? EPX_EXPAND_FAN_OUT_DURING : EPX_EXPAND_FAN_OUT_AFTER;
      /* Room for the worst case: every token of every source on min(K, L) experts here. */
      const long long rows =
          (long long)R * cfg.max_tokens_per_rank * (opt->top_k < L ? opt->top_k : L);
      cfg.expand_max_rows = rows < EPX_MAX_EXPAND_ROWS ? (int)rows : EPX_MAX_EXPAND_ROWS;
      expand_op_t op;
      memset(&op, 0, sizeof op);
      op.w = w;
      op.out = out;
      BENCH_EPX(epx_group_create(b->comm, &cfg, &op.group));
      BENCH_EPX(epx_handle_create(op.group, &op.handle));
      if (during) {
        BENCH_TRY(emit(b, &op, "epx dispatch expand during", dispatch_iter, sms));
      } else {
        BENCH_TRY(emit(b, &op, "epx dispatch expand", dispatch_iter, sms));
        BENCH_TRY(emit(b, &op, "epx combine expand", combine_iter, sms));
      }
      BENCH_EPX(epx_handle_destroy(op.handle));
      BENCH_EPX(epx_group_destroy(op.group));
    }
  BENCH_CUDA(cudaFree(out));
  return 0;
}

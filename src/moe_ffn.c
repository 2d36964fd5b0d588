/*
 * moe_ffn.c - the prefill layer's FFN of one chunk (epx__moe_ffn, src/include/moe_prefill.h):
 * each local expert's GEMMs on its segment of the expert-major rows, the row kernel between
 * them (SwiGLU, and the FP8 quantization with FP8 weights), or EPX's own epx_experts_ffn.
 *
 * Lanes: an expert's GEMM at prefill has a few hundred rows (4096 tokens x top-8 over 256
 * experts: about 500, half that per chunk), so its tiles do not cover the GPU and one GEMM
 * after another leaves SMs idle at every GEMM's tail. The plan's lanes are streams that run
 * several experts' GEMMs at once: the FFN's stream forks into them for each projection and
 * joins them before the row kernel and at the end. Each lane has its own cuBLAS workspace
 * slice. Experts go to the least-loaded lane by rows (epx__moe_assign_lanes). Once forked, the
 * join is queued whatever fails, so the FFN's stream never runs ahead of a lane's GEMMs.
 * Batched (EPX_MOE_FFN_CUBLAS_GROUPED): one cublasGemmBatchedEx per projection for every expert,
 * on the FFN's stream (lanes only for the fallback below): two host calls per chunk where the
 * lanes make two per expert
 * (the per-GEMM host cost bounded the layer: docs/moe.md). A batched GEMM takes one size, so
 * every expert gets a block of the largest expert's rows (rounded up): gate/up reads each
 * expert's block from its dispatched rows (rows past its count belong to the next experts or
 * to nobody, and give output rows nobody reads) and writes a blocked scratch; the row kernel
 * runs over the blocks (blocked_begin: its segments), and down writes y blocked too, which the
 * combine maps back (epx__combine_expand_blocked). A chunk where blocks would cost too much
 * (epx__moe_block_rows: one expert with most rows) runs one GEMM per expert instead.
 * EPX's grouped FP8 GEMM (EPX_MOE_FFN_EPX_GROUPED, plan->fp8_grouped): each projection of FP8
 * weights is one launch over every expert's segment, its bounds read on the device; no lanes.
 */
#include <string.h>

#include "checks.h"
#include "experts.h"
#include "kernels/api.h"
#include "moe_prefill.h"
#include "moe_tiles.h"
#include "param.h"

void epx__moe_assign_lanes(const int *count, int L, int lanes, int *lane) {
  long long load[EPX__MOE_MAX_LANES] = {0};
  if (lanes < 1) lanes = 1;
  if (lanes > EPX__MOE_MAX_LANES) lanes = EPX__MOE_MAX_LANES;
  for (int j = 0; j < L; j++) {
    int best = 0;
    for (int i = 1; i < lanes; i++)
      if (load[i] < load[best]) best = i;
    lane[j] = best;
    load[best] += count[j] > 0 ? count[j] : 0;
  }
}

int epx__moe_phase_rows(const int *by_source, int L, int R, int *phase_begin) {
  int row = 0;
  for (int s = 0; s < R; s++) {
    for (int j = 0; j < L; j++) {
      phase_begin[s * (L + 1) + j] = row;
      const int n = by_source[j * R + s];
      row += n > 0 ? (n + 3) / 4 * 4 : 0;
    }
    phase_begin[s * (L + 1) + L] = row;
  }
  return row;
}

int epx__moe_block_rows(const int *count, const int *begin, int L, size_t scratch_rows,
                        size_t input_rows) {
  long long real = 0;
  int largest = 0;
  for (int j = 0; j < L; j++) {
    if (count[j] > largest) largest = count[j];
    if (count[j] > 0) real += count[j];
  }
  if (largest == 0 || L <= 0) return 0;
  const long long block =
      ((long long)largest + EPX__MOE_BLOCK_ROUND - 1) / EPX__MOE_BLOCK_ROUND * EPX__MOE_BLOCK_ROUND;
  if ((unsigned long long)(block * L) > scratch_rows) return 0;
  if ((unsigned long long)(begin[L - 1] + block) > input_rows) return 0;
  if (block * L * 100 > real * (100 + EPX__MOE_BLOCK_WASTE_PCT)) return 0;
  return (int)block;
}

/* Lanes 1.. wait for everything queued on stream so far. */
static epx_status_t fork_lanes(epx_moe_prefill_t p, cudaStream_t stream) {
  if (p->lanes <= 1) return EPX_OK;
  CUDA_CHECK(cudaEventRecord(p->lane_fork, stream));
  for (int i = 1; i < p->lanes; i++)
    CUDA_CHECK(cudaStreamWaitEvent(p->lane_stream[i], p->lane_fork, 0));
  return EPX_OK;
}

/* stream waits for everything queued on lanes 1.. so far; every lane is joined even if one
 * step fails (the first failure is returned), a lane whose event fails drained on the host, so
 * stream never runs ahead of its GEMMs. */
static epx_status_t join_lanes(epx_moe_prefill_t p, cudaStream_t stream) {
  epx_status_t first = EPX_OK;
  for (int i = 1; i < p->lanes; i++) {
    const epx_status_t st = epx__moe_order_after(stream, p->lane_stream[i], p->lane_done[i]);
    if (first == EPX_OK) first = st;
  }
  return first;
}

/* One projection of every expert: w_j [n, k] on the rows of segment j. */
typedef struct {
  int which;             /* 0 gate/up, 1 down */
  const char *w;         /* expert 0's weights; expert j's at w + j * w_stride */
  size_t w_stride;       /* bytes */
  const float *w_scales; /* FP8: expert 0's repacked scales; expert j's at + j * ws_stride */
  size_t ws_stride;      /* floats */
  const char *x;         /* row 0's input; row r's at x + r * x_row */
  size_t x_row;          /* bytes */
  const float *x_scales; /* FP8: per-segment scales, segment j's at + begin[j] * xs_row */
  size_t xs_row;         /* floats per row (k / 128) */
  char *y;               /* row 0's output; row r's at y + r * y_row */
  size_t y_row;          /* bytes */
  int n, k, fp8, sm_target;
} projection_t;

static epx_status_t project(epx_moe_prefill_t p, const projection_t *g, const epx__moe_rows_t *rows,
                            const int *lane, char *blas_ws, cudaStream_t stream) {
  if (g->fp8 && p->fp8_grouped) { /* every expert in one launch, bounds read on the device */
    const int tile_x = epx__moe_pick_tile_x(rows->begin, p->L);
    const epx__moe_gemm_fp8_args_t ga = {.w = g->w,
                                         .w_stride = g->w_stride,
                                         .w_scales = g->w_scales,
                                         .ws_stride = g->ws_stride,
                                         .ws_kb = p->scales_kb[g->which],
                                         .x = g->x,
                                         .x_scales = g->x_scales,
                                         .y = g->y,
                                         .y_fp32 = g->which == 0 && p->gu_fp32,
                                         .n = g->n,
                                         .k = g->k,
                                         .num_experts = p->L,
                                         .begin = rows->begin_dev,
                                         .x_rows = rows->num_rows,
                                         .num_ctas = g->sm_target ? g->sm_target : p->device_sms,
                                         .tile_x = tile_x,
                                         .tile_w = epx__moe_pick_tile_w(g->n, tile_x),
                                         .early_launch = 0};
    return epx__moe_gemm_fp8_launch(&ga, stream);
  }
  EPX_CHECK(fork_lanes(p, stream));
  epx_status_t st = EPX_OK;
  for (int j = 0; j < p->L && st == EPX_OK; j++) {
    const int b = rows->begin[j];
    cudaStream_t s = lane[j] == 0 ? stream : p->lane_stream[lane[j]];
    char *lane_ws = blas_ws + (size_t)lane[j] * EPX__MOE_BLAS_WS;
    if (g->fp8) /* the whole segment: its rows are a multiple of 4, the scales' stride */
      st = epx__moe_gemm_fp8(p, g->which, g->w + j * g->w_stride, g->w_scales + j * g->ws_stride,
                             g->x + b * g->x_row, g->x_scales + (size_t)b * g->xs_row,
                             g->y + b * g->y_row, g->n, g->k, rows->begin[j + 1] - b, g->sm_target,
                             lane_ws, s);
    else
      st = epx__moe_gemm_bf16(p, g->w + j * g->w_stride, g->x + b * g->x_row, g->y + b * g->y_row,
                              g->n, g->k, rows->count[j], g->sm_target, lane_ws, s);
  }
  const epx_status_t joined = join_lanes(p, stream);
  return st != EPX_OK ? st : joined;
}

/* BF16 weights, batched: gate/up, SwiGLU, down over blocks of block_rows rows (above). */
static epx_status_t ffn_batched(epx_moe_prefill_t p, const epx__moe_rows_t *rows, int block_rows,
                                int sm_target, char *ws, const epx__moe_ws_layout_t *l,
                                cudaStream_t stream) {
  const epx_experts_t *w = &p->experts;
  const int H = p->H, I = p->I, L = p->L;
  const epx__moe_batched_gemm_t gu = {.w = (const char *)w->gate_up,
                                      .w_stride = (size_t)2 * I * H * 2,
                                      .x = (const char *)rows->x,
                                      .x_row = (size_t)H * 2,
                                      .y = ws + l->gu,
                                      .y_row = (size_t)2 * I * 2,
                                      .n = 2 * I,
                                      .k = H,
                                      .block_rows = block_rows,
                                      .x_blocked = 0,
                                      .y_blocked = 1,
                                      .blocked_begin = 1,
                                      .begin_dev = rows->begin_dev};
  EPX_CHECK(epx__moe_gemm_bf16_batched(p, &gu, sm_target, ws + l->blas, stream));
  epx__moe_rows_launch_args_t ra;
  memset(&ra, 0, sizeof ra);
  ra.in = ws + l->gu;
  ra.swiglu = 1;
  ra.out = ws + l->h;
  ra.cols = I;
  ra.num_rows = L * block_rows;
  ra.num_experts = L;
  ra.begin = p->blocked_begin; /* the blocks, written by the gate/up pointer kernel */
  ra.count = rows->count_dev;
  ra.num_blocks = epx__moe_row_blocks(p, sm_target);
  EPX_CHECK(epx__moe_rows_launch(&ra, stream));
  const epx__moe_batched_gemm_t dn = {.w = (const char *)w->down,
                                      .w_stride = (size_t)H * I * 2,
                                      .x = ws + l->h,
                                      .x_row = (size_t)I * 2,
                                      .y = (char *)rows->y,
                                      .y_row = (size_t)H * 2,
                                      .n = H,
                                      .k = I,
                                      .block_rows = block_rows,
                                      .x_blocked = 1,
                                      .y_blocked = 1,
                                      .blocked_begin = 0,
                                      .begin_dev = rows->begin_dev};
  /* down on every SM: by the time it runs, the communication beside gate/up (the next chunk's
   * dispatch, the previous chunk's combine) has mostly ended. Measured on 4x H200 (an
   * environment knob at 63b73d8, 2 chunks): Qwen3 BF16 layer 1083 -> 1050 us, DeepSeek BF16
   * 6734 -> 6724 (docs/moe.md, "Why the layer does not overlap yet"). */
  return epx__moe_gemm_bf16_batched(p, &dn, 0, ws + l->blas, stream);
}

int epx__moe_row_blocks(epx_moe_prefill_t p, int sms) {
  const int64_t per_sm = epx__param_MoeRowBlocksPerSm();
  return (per_sm >= 1 && per_sm <= 8 ? (int)per_sm : 4) * (sms ? sms : p->device_sms);
}

/* The workspace check every FFN entry makes. */
static epx_status_t ffn_layout(epx_moe_prefill_t p, size_t ws_bytes, epx__moe_ws_layout_t *l) {
  *l = epx__moe_plan_ws_layout(p);
  if (ws_bytes < l->total)
    return epx__set_error(EPX_ERR_INTERNAL, "epx__moe_ffn: workspace of %zu bytes, %zu needed",
                          ws_bytes, l->total);
  return EPX_OK;
}

/* The row kernel's launch over a chunk's segments (or, in phases, its parts); each use sets what
 * it does. */
static epx__moe_rows_launch_args_t rows_args(epx_moe_prefill_t p, const epx__moe_rows_t *rows,
                                             int sms) {
  epx__moe_rows_launch_args_t ra;
  memset(&ra, 0, sizeof ra);
  ra.num_rows = rows->num_rows;
  ra.num_experts = p->L;
  ra.begin = rows->begin_dev;
  ra.count = rows->count_dev;
  ra.num_blocks = epx__moe_row_blocks(p, sms);
  return ra;
}

/* The down projection (h -> y [rows, H] BF16). */
static projection_t down_projection(epx_moe_prefill_t p, const epx__moe_rows_t *rows, int sms,
                                    char *ws, const epx__moe_ws_layout_t *l) {
  const epx_experts_t *w = &p->experts;
  const int H = p->H, I = p->I, fp8 = w->weight_dtype == EPX_DTYPE_FP8_E4M3;
  const size_t elem = fp8 ? 1 : 2;
  const projection_t dn = {.which = 1,
                           .w = (const char *)w->down,
                           .w_stride = (size_t)H * I * elem,
                           .w_scales = fp8 ? p->scales[1] : NULL,
                           .ws_stride = fp8 ? (size_t)(H / 128) * p->scales_kb[1] : 0,
                           .x = ws + l->h,
                           .x_row = (size_t)I * elem,
                           .x_scales = fp8 ? (const float *)(ws + l->hs) : NULL,
                           .xs_row = (size_t)I / 128,
                           .y = (char *)rows->y,
                           .y_row = (size_t)H * 2,
                           .n = H,
                           .k = I,
                           .fp8 = fp8,
                           .sm_target = sms};
  return dn;
}

/* x's FP8 form where the weights are FP8, gate/up, then SwiGLU into h (over the parts in
 * phases: h's FP8 scales are then laid out per part, as each phase's down projection reads). */
static epx_status_t ffn_up(epx_moe_prefill_t p, const epx__moe_rows_t *rows, int sms, char *ws,
                           const epx__moe_ws_layout_t *l, const int *lane, cudaStream_t stream) {
  const epx_experts_t *w = &p->experts;
  const int H = p->H, I = p->I;
  const int fp8 = w->weight_dtype == EPX_DTYPE_FP8_E4M3;
  const size_t gu_elem = fp8 && p->gu_fp32 ? 4 : 2, w_elem = fp8 ? 1 : 2;
  epx__moe_rows_launch_args_t ra = rows_args(p, rows, sms);

  /* gate/up: x (BF16 rows, or their FP8 quantization) -> gu [rows, 2I] */
  const int x_fp8 = rows->x_scales != NULL; /* FP8 came over the wire: codes as they are */
  if (x_fp8 && !fp8)
    return epx__set_error(EPX_ERR_INTERNAL, "epx__moe_ffn: FP8 rows with BF16 weights");
  if (fp8 && x_fp8) { /* only the scales move, into the per-segment layout */
    const epx__moe_segment_scales_launch_args_t sa = {
        rows->x_scales, (float *)(ws + l->xs), rows->num_rows,  H / 128,
        p->L,           rows->begin_dev,       rows->count_dev, ra.num_blocks};
    EPX_CHECK(epx__moe_segment_scales_launch(&sa, stream));
  } else if (fp8) { /* x quantized per 128 channels into the per-segment scale layout */
    ra.in = rows->x;
    ra.quantize = 1;
    ra.out = ws + l->xq;
    ra.scales = (float *)(ws + l->xs);
    ra.cols = H;
    EPX_CHECK(epx__moe_rows_launch(&ra, stream));
  }
  const projection_t gu = {.which = 0,
                           .w = (const char *)w->gate_up,
                           .w_stride = (size_t)2 * I * H * w_elem,
                           .w_scales = fp8 ? p->scales[0] : NULL,
                           .ws_stride = fp8 ? (size_t)(2 * I / 128) * p->scales_kb[0] : 0,
                           .x = fp8 && !x_fp8 ? ws + l->xq : (const char *)rows->x,
                           .x_row = (size_t)H * w_elem, /* FP8 codes or BF16, as the weights */
                           .x_scales = fp8 ? (const float *)(ws + l->xs) : NULL,
                           .xs_row = (size_t)H / 128,
                           .y = ws + l->gu,
                           .y_row = (size_t)2 * I * gu_elem,
                           .n = 2 * I,
                           .k = H,
                           .fp8 = fp8,
                           .sm_target = sms};
  EPX_CHECK(project(p, &gu, rows, lane, ws + l->blas, stream));

  /* SwiGLU: gu -> h [rows, I] (BF16, or FP8 with per-segment, or per-part, scales) */
  ra.in = ws + l->gu;
  ra.in_fp32 = fp8 && p->gu_fp32;
  ra.swiglu = 1;
  ra.quantize = fp8;
  ra.out = ws + l->h;
  ra.scales = fp8 ? (float *)(ws + l->hs) : NULL;
  ra.cols = I;
  if (rows->num_sources > 0) { /* h in the phases' rows */
    ra.num_experts = p->L * rows->num_sources;
    ra.begin = rows->parts_dev;
    ra.count = rows->part_count_dev;
    ra.out_begin = rows->part_out_dev;
  }
  return epx__moe_rows_launch(&ra, stream);
}

epx_status_t epx__moe_ffn(epx_moe_prefill_t p, const epx__moe_rows_t *rows, int overlapped,
                          char *ws, size_t ws_bytes, int *y_block_rows, cudaStream_t stream) {
  *y_block_rows = 0;
  if (rows->num_rows <= 0) return EPX_OK;
  epx__moe_ws_layout_t l;
  EPX_CHECK(ffn_layout(p, ws_bytes, &l));
  const epx_experts_t *w = &p->experts;
  if (p->backend == EPX_MOE_FFN_EPX) {
    epx_experts_ffn_args_t f = EPX_EXPERTS_FFN_ARGS_INIT;
    f.x = rows->x;
    f.x_dtype = EPX_DTYPE_BF16;
    f.num_rows = rows->num_rows;
    f.expert_count = rows->count_dev;
    f.expert_begin = rows->begin_dev;
    f.out = rows->y;
    f.workspace = ws + l.ffn;
    f.workspace_bytes = p->ffn_bytes;
    return epx_experts_ffn(w, &f, stream);
  }
  const int sms = overlapped ? p->gemm_sms : 0;
  if (p->grouped) { /* BF16 weights (the plan checked) */
    const int block =
        epx__moe_block_rows(rows->count, rows->begin, p->L, p->rows, (size_t)rows->x_capacity);
    if (block > 0) {
      *y_block_rows = block;
      EPX_CHECK(ffn_batched(p, rows, block, sms, ws, &l, stream));
      p->batched_chunks++;
      return EPX_OK;
    }
    p->unbatched_chunks++;
  }
  int lane[EPX_MAX_EXPERTS];
  epx__moe_assign_lanes(rows->count, p->L, p->lanes, lane);
  EPX_CHECK(ffn_up(p, rows, sms, ws, &l, lane, stream));
  const projection_t dn = down_projection(p, rows, sms, ws, &l);
  return project(p, &dn, rows, lane, ws + l.blas, stream);
}

/* Phases need one launch per projection over every expert: EPX's grouped FP8 GEMM (no lanes). */
static epx_status_t check_phased(epx_moe_prefill_t p, const epx__moe_rows_t *rows) {
  if (!p->fp8_grouped || rows->num_sources <= 0)
    return epx__set_error(EPX_ERR_INTERNAL,
                          "epx__moe_ffn_phased: needs EPX's grouped FP8 GEMM and the parts");
  return EPX_OK;
}

epx_status_t epx__moe_ffn_phased_up(epx_moe_prefill_t p, const epx__moe_rows_t *rows, char *ws,
                                    size_t ws_bytes, cudaStream_t stream) {
  EPX_CHECK(check_phased(p, rows));
  if (rows->num_rows <= 0) return EPX_OK;
  epx__moe_ws_layout_t l;
  EPX_CHECK(ffn_layout(p, ws_bytes, &l));
  int lane[EPX_MAX_EXPERTS] = {0}; /* (one launch a projection: no lanes) */
  return ffn_up(p, rows, 0, ws, &l, lane, stream);
}

epx_status_t epx__moe_ffn_phased_down(epx_moe_prefill_t p, const epx__moe_rows_t *rows, int source,
                                      int sm_target, char *ws, cudaStream_t stream) {
  EPX_CHECK(check_phased(p, rows));
  if (rows->num_rows <= 0) return EPX_OK;
  const epx__moe_ws_layout_t l = epx__moe_plan_ws_layout(p); /* (checked by _up) */
  /* source's block of the phases' rows: its parts of every expert, end to end */
  epx__moe_rows_t phase = *rows;
  const int *begin = rows->phase_begin + (size_t)source * (p->L + 1);
  if (begin[p->L] == begin[0]) return EPX_OK; /* no rows from source */
  phase.begin = begin;
  phase.begin_dev = rows->phase_begin_dev + (size_t)source * (p->L + 1);
  phase.num_rows = rows->phase_rows;
  int lane[EPX_MAX_EXPERTS] = {0};
  const projection_t dn = down_projection(p, &phase, sm_target, ws, &l);
  return project(p, &dn, &phase, lane, ws + l.blas, stream);
}

epx_status_t epx__moe_gemm_reference(epx_moe_prefill_t p, const epx__moe_rows_t *rows, char *ws,
                                     size_t ws_bytes, cudaStream_t stream) {
  const epx__moe_ws_layout_t l = epx__moe_plan_ws_layout(p);
  if (p->backend != EPX_MOE_FFN_CUBLAS || p->no_blas || ws_bytes < l.total)
    return epx__set_error(EPX_ERR_INVALID_USAGE,
                          "epx__moe_gemm_reference: needs the cuBLAS backend and the workspace");
  const epx_experts_t *w = &p->experts;
  const int H = p->H, I = p->I, n = rows->num_rows;
  if (w->weight_dtype != EPX_DTYPE_FP8_E4M3) {
    EPX_CHECK(
        epx__moe_gemm_bf16(p, w->gate_up, rows->x, ws + l.gu, 2 * I, H, n, 0, ws + l.blas, stream));
    return epx__moe_gemm_bf16(p, w->down, ws + l.h, rows->y, H, I, n, 0, ws + l.blas, stream);
  }
  /* the rows' codes: received as they are (FP8 on the wire), else the FFN's quantized copy */
  const void *xq = rows->x_scales ? rows->x : (const void *)(ws + l.xq);
  EPX_CHECK(epx__moe_gemm_fp8(p, 0, w->gate_up, p->scales[0], xq, (const float *)(ws + l.xs),
                              ws + l.gu, 2 * I, H, n, 0, ws + l.blas, stream));
  return epx__moe_gemm_fp8(p, 1, w->down, p->scales[1], ws + l.h, (const float *)(ws + l.hs),
                           rows->y, H, I, n, 0, ws + l.blas, stream);
}

/*
 * soak_ll.c - one low-latency iteration of the soak (see soak.h): a dispatch of a fresh world
 * (WORLD_LL) with the plan's receive format (BF16, FP8, UE8M0 scales, UE8M0 words), layout
 * (fixed slots or packed, with the layout range) and split, then its combine (expert outputs in
 * a buffer or written into combine_input, dispatch-time or combine-time weights, split); every
 * result compared with the CPU reference through ll_checks.h.
 *
 * Before the dispatch both buffers' receive arrays and returned-rows areas are poisoned (0xff)
 * on the stream, then a group barrier on the stream: no peer writes this rank's buffers before
 * the poison is done (a dispatch may use the buffer of the one before last, which peers reach
 * without waiting for this rank).
 */
#include <stdlib.h>
#include <string.h>

#include "gpu/ll_checks.h"
#include "soak/soak.h"

/* Spin between a split call's send and its receive: other work, as a caller would queue. */
#define SPLIT_GAP_NS 20000

static int poison_ll(soak_rank_t *s) {
  const epx__ws_layout_t *l = &s->g->layout;
  const size_t begin[2] = {l->ll_x_offset, l->ll_combine_recv_offset};
  const size_t end[2] = {l->ll_stage_offset, l->ll_my_ids_offset};
  for (int i = 0; i < 4; i++) {
    char *buf = s->g->workspace + l->ll_offset + (size_t)(i >> 1) * l->ll_parity_bytes;
    SOAK_CUDA(s, cudaMemsetAsync(buf + begin[i & 1], 0xff, end[i & 1] - begin[i & 1], s->t.stream));
  }
  SOAK_EPX(s, epx_group_barrier(s->g, s->t.stream));
  return 0;
}

int soak_ll_iteration(soak_rank_t *s, const soak_iter_t *p, int check) {
  const int R = s->R, me = s->rank;
  uint64_t rng = p->rng, local = soak_mix(p->rng ^ (0xC0DEull + (uint64_t)me));
  const world_spec_t spec = {s->Mll, s->H, s->E, s->K, p->route, p->tokens, p->empty_rank};
  world_t w;
  world_make(&w, R, &spec, WORLD_LL, &rng);
  SOAK_TRY(s, world_upload(&w, me, &s->d) == TEST_PASS, "uploading the inputs");
  const int T = w.ranks[me].num_tokens, K = w.K;
  float *cw = p->combine_weights ? ll_draw_combine_weights(&w, me, &local) : NULL;
  const size_t cw_bytes = (size_t)T * K * sizeof(float);
  cudaStream_t st = s->t.stream;

  if (poison_ll(s)) return -1;
  epx_ll_dispatch_args_t a = EPX_LL_DISPATCH_ARGS_INIT;
  a.x = s->d.x;
  a.topk_idx = s->d.idx;
  a.topk_weights = p->ll_weights ? (const float *)s->d.w : NULL;
  a.num_tokens = T;
  a.recv_dtype = p->fp8 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16;
  a.ue8m0 = p->ue8m0;
  a.ue8m0_packed = p->ue8m0_packed;
  a.packed = p->packed;
  a.layout_range = p->layout_range ? s->range_dev : NULL;
  a.split = p->split;
  epx_ll_dispatch_result_t res;
  SOAK_EPX(s, epx_ll_dispatch(s->g, &a, &res, st));
  if (p->split) {
    SOAK_CUDA(s, test_spin_ns(SPLIT_GAP_NS, st));
    SOAK_EPX(s, epx_ll_recv(s->g, &res.hook, st));
  }
  SOAK_CUDA(s, cudaStreamSynchronize(st));
  if (check) {
    const int layout_checks = p->packed || p->ue8m0_packed;
    int r = res.packed == p->packed ? TEST_PASS : TEST_FAIL;
    if (r != TEST_PASS) fprintf(stderr, "  dispatch: result.packed = %d\n", res.packed);
    if (r == TEST_PASS)
      r = layout_checks
              ? ll_check_dispatch_layout(&w, me, &res, p->fp8, p->ue8m0, p->ue8m0_packed,
                                         p->layout_range ? s->range_dev : NULL, "dispatch")
              : ll_check_dispatch(&w, me, &res, p->fp8, p->ue8m0, "dispatch");
    soak_result(s, r, "low-latency dispatch");
  }
  if (soak_check_async(s, &w, EPX_STAGE_LL_DISPATCH)) return -1;

  /* Expert outputs: every rank's for the reference; this rank's uploaded into its layout's rows
   * (unchecked iterations combine whatever the buffer holds). */
  uint16_t *y[EPX_MAX_RANKS] = {NULL};
  void *dst = p->zero_copy ? res.combine_input : s->d.y;
  if (check) {
    SOAK_TRY(s, ll_expert_outputs(&w, y) == TEST_PASS, "the reference expert outputs");
    const int up =
        res.packed ? ll_upload_outputs_packed(&w, me, y, dst) : ll_upload_outputs(&w, me, y, dst);
    SOAK_TRY(s, up == TEST_PASS, "uploading the expert outputs");
  }
  SOAK_CUDA(s, cudaMemsetAsync(s->d.out, 0xff, (size_t)T * w.H * 2, st));
  if (cw) {
    SOAK_CUDA(s, cudaMemsetAsync(s->cw_dev, 0xff, (size_t)w.M * K * sizeof(float), st));
    if (!p->split)
      SOAK_CUDA(s, cudaMemcpyAsync(s->cw_dev, cw, cw_bytes, cudaMemcpyHostToDevice, st));
  }
  epx_ll_hook_t hook = {0};
  epx_ll_combine_args_t ca = EPX_LL_COMBINE_ARGS_INIT;
  ca.dispatch = &res;
  ca.x = p->zero_copy ? NULL : s->d.y;
  ca.out = s->d.out;
  ca.topk_weights = cw ? s->cw_dev : NULL;
  ca.split = p->split;
  ca.hook = &hook;
  SOAK_EPX(s, epx_ll_combine(s->g, &ca, st));
  if (p->split) {
    /* The receive half reads the combine-time weights: they may arrive after the send. */
    if (cw) SOAK_CUDA(s, cudaMemcpyAsync(s->cw_dev, cw, cw_bytes, cudaMemcpyHostToDevice, st));
    SOAK_CUDA(s, test_spin_ns(SPLIT_GAP_NS / 2, st));
    SOAK_EPX(s, epx_ll_recv(s->g, &hook, st));
  }
  SOAK_CUDA(s, cudaStreamSynchronize(st));
  if (check) {
    world_t wc = w; /* the reference with the weights this combine applies */
    wc.ranks[me].topk_weights = cw ? cw : p->ll_weights ? w.w[me] : NULL;
    wc.ref.ranks = wc.ranks;
    soak_result(s, ll_check_combine(&wc, me, s->d.out, y, "combine"), "low-latency combine");
  }
  for (int d = 0; d < R; d++) free(y[d]);
  free(cw);
  if (soak_check_async(s, NULL, EPX_STAGE_NONE)) return -1;
  world_free(&w);
  s->ll_iters++;
  return 0;
}

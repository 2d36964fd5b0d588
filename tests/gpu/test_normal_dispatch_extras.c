/*
 * test_normal_dispatch_extras.c - the DeepEP-parity options of normal dispatch on 2 and 4 GPUs
 * against the CPU reference (tests/ref, last section): rank-mask routing, worst-case rows,
 * int64 received ids, strided and packed UE8M0 scales, the rank prefix matrix.
 *
 * Every rank draws the whole world from the test seed (world.h) and computes what it must
 * receive. The receive region is poisoned (0x5A bytes: positive ids, nonzero weights) before
 * each call, so rows and tails the call must write are seen to be written.
 *
 *   test                                 what
 *   normal_dispatch_rank_mask            is_token_in_rank + num_tokens_per_expert (no ids):
 *                                        rows, counts, -1/0 metadata, prefix matrix, then an
 *                                        unweighted combine and a cached dispatch; routings
 *                                        below (one expert, empty slots, empty rank, one rank,
 *                                        uneven counts), mask values other than 1
 *   normal_dispatch_worst_tokens         num_worst_tokens, sync_counts = 0: host num_recv, the
 *                                        device count, the -1 / 0 tail, int32 and int64 ids;
 *                                        too few worst rows: async INVALID_ARGUMENT, group fine
 *   normal_dispatch_scale_formats        FP8 with column-major scales, packed UE8M0 (row- and
 *                                        column-major), each also through
 *                                        epx_dispatch_cached_args with fresh payload
 *   normal_dispatch_extras_bad_arguments inconsistent options refused by name, nothing sent,
 *                                        then a dispatch that is checked
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/normal_checks.h"

/* Every rank's routing as rank masks and expert counts (epx_ref_layout of its ids); mask
 * values are `one` where the token goes (any nonzero value means sent). */
typedef struct {
  uint8_t *mask[EPX_MAX_RANKS];
  int *tpe[EPX_MAX_RANKS];
} masks_t;

static void masks_make(const world_t *w, uint8_t one, masks_t *m) {
  for (int s = 0; s < w->R; s++) {
    const int T = w->ranks[s].num_tokens;
    m->mask[s] = malloc((size_t)T * w->R + 1);
    m->tpe[s] = malloc(sizeof(int) * w->E);
    epx_ref_layout(w->idx[s], T, w->K, w->E, w->R, NULL, m->tpe[s], m->mask[s], NULL);
    for (int i = 0; i < T * w->R; i++) m->mask[s][i] *= one;
  }
}

static void masks_free(masks_t *m, int R) {
  for (int s = 0; s < R; s++) free(m->mask[s]), free(m->tpe[s]);
}

/* Fill this rank's receive arrays (everything before the combine slab) with 0x5A bytes. */
static int poison_recv(epx_group_t g, cudaStream_t stream) {
  EXPECT_CUDA(cudaMemsetAsync(g->workspace + g->layout.normal_offset, 0x5A,
                              g->layout.combine_slab_offset, stream));
  return TEST_PASS;
}

/* recv_topk_idx (int32 or int64) rows [0, rows) against want [rows, K], weights against wantw
 * (NULL: all 0), source tokens of the first n rows against ref. */
static int check_meta(const world_t *w, const epx_dispatch_result_t *res, int rows,
                      const int64_t *want, const float *wantw, const epx_ref_recv_t *ref,
                      const char *label) {
  const size_t nk = (size_t)rows * w->K;
  int64_t *idx = malloc(nk * 8 + 8);
  float *wt = malloc(nk * 4 + 4);
  int *src = malloc((size_t)ref->num_recv * 4 + 4);
  if (res->recv_topk_idx_int64) {
    EXPECT(res->recv_topk_idx == NULL);
    EXPECT_CUDA(cudaMemcpy(idx, res->recv_topk_idx_int64, nk * 8, cudaMemcpyDeviceToHost));
  } else {
    int *i32 = malloc(nk * 4 + 4);
    EXPECT_CUDA(cudaMemcpy(i32, res->recv_topk_idx, nk * 4, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < nk; i++) idx[i] = i32[i];
    free(i32);
  }
  EXPECT_CUDA(cudaMemcpy(wt, res->recv_topk_weights, nk * 4, cudaMemcpyDeviceToHost));
  EXPECT_CUDA(
      cudaMemcpy(src, res->recv_src_token, (size_t)ref->num_recv * 4, cudaMemcpyDeviceToHost));
  long long bad = -1;
  for (size_t i = 0; i < nk && bad < 0; i++)
    if (idx[i] != want[i] || wt[i] != (wantw && i < (size_t)ref->num_recv * w->K ? wantw[i] : 0.f))
      bad = (long long)i;
  for (int i = 0; i < ref->num_recv && bad < 0; i++)
    if (src[i] != ref->src_token[i]) bad = (long long)i * w->K;
  if (bad >= 0)
    fprintf(stderr, "  %s: row %lld slot %lld: id %lld (want %lld), weight %g\n", label, bad / w->K,
            bad % w->K, (long long)idx[bad], (long long)want[bad], wt[bad]);
  free(idx), free(wt), free(src);
  return bad < 0 ? TEST_PASS : TEST_FAIL;
}

/* rank_prefix_matrix_device against the reference (masks NULL: routing by ids). */
static int check_prefix_matrix(const world_t *w, const epx_dispatch_result_t *res,
                               const uint8_t *const *masks, const char *label) {
  int got[EPX_MAX_RANKS * EPX_MAX_RANKS], want[EPX_MAX_RANKS * EPX_MAX_RANKS];
  EXPECT(epx_ref_rank_prefix_matrix(&w->ref, masks, want) == 0);
  EXPECT_CUDA(cudaMemcpy(got, res->rank_prefix_matrix_device, sizeof(int) * w->R * w->R,
                         cudaMemcpyDeviceToHost));
  for (int i = 0; i < w->R * w->R; i++)
    EXPECTF(got[i] == want[i], "%s: rank_prefix_matrix[%d][%d] = %d, ref %d", label, i / w->R,
            i % w->R, got[i], want[i]);
  return TEST_PASS;
}

/* FP8 payload and scales (float32 or packed UE8M0 words) received vs the reference. */
static int check_fp8_recv(const world_t *w, const epx_dispatch_result_t *res, int packed,
                          const epx_ref_recv_t *ref, const char *label) {
  const int n = ref->num_recv, G = w->H / 128, cols = packed ? (G + 3) / 4 : G;
  uint8_t *x = malloc((size_t)n * w->H + 1);
  uint32_t *sc = malloc((size_t)n * cols * 4 + 4), *want = malloc((size_t)n * cols * 4 + 4);
  EXPECT_CUDA(cudaMemcpy(x, res->recv_x, (size_t)n * w->H, cudaMemcpyDeviceToHost));
  EXPECTF(memcmp(x, ref->x_fp8, (size_t)n * w->H) == 0, "%s: recv_x differs", label);
  EXPECT((packed ? (void *)res->recv_x_scales_packed : (void *)res->recv_x_scales) != NULL);
  EXPECT((packed ? (void *)res->recv_x_scales : (void *)res->recv_x_scales_packed) == NULL);
  EXPECT_CUDA(cudaMemcpy(sc,
                         packed ? (void *)res->recv_x_scales_packed : (void *)res->recv_x_scales,
                         (size_t)n * cols * 4, cudaMemcpyDeviceToHost));
  if (packed)
    epx_ref_ue8m0_pack(ref->x_scales, n, G, (int32_t *)want);
  else
    memcpy(want, ref->x_scales, (size_t)n * cols * 4);
  int bad = -1;
  for (int i = 0; i < n * cols && bad < 0; i++)
    if (sc[i] != want[i]) bad = i;
  if (bad >= 0)
    fprintf(stderr, "  %s: scale word %d of row %d = 0x%08x, ref 0x%08x\n", label, bad % cols,
            bad / cols, sc[bad], want[bad]);
  free(x), free(sc), free(want);
  return bad < 0 ? TEST_PASS : TEST_FAIL;
}

static int *upload_ints(const void *host, size_t bytes) {
  void *d = NULL;
  if (cudaMalloc(&d, bytes + 16) != cudaSuccess) return NULL;
  if (bytes && cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice) != cudaSuccess) return NULL;
  return d;
}

/* The shared fixture (normal_checks.h), with no async error on record at the end. */
typedef normal_fixture_t setup_t;

static int setup_make(epx_test_rank_t *t, const world_spec_t *spec, uint64_t *rng, setup_t *s) {
  return normal_fixture_make(t, spec, 0, rng, s);
}

static int setup_free(setup_t *s, const char *label) {
  EXPECT_NO_ASYNC_ERROR(s->g, label);
  return normal_fixture_free(s, label);
}

typedef struct {
  const char *name;
  world_spec_t world;
  int fp8, idx64;
  uint8_t one; /* mask value for "sent" */
} mask_case_t;

static int run_mask_case(epx_test_rank_t *t, const mask_case_t *c, uint64_t *rng) {
  const int R = t->num_ranks, me = t->rank;
  setup_t su;
  if (setup_make(t, &c->world, rng, &su) != TEST_PASS) return TEST_FAIL;
  world_t *const w = &su.w; /* in place: its ref.ranks points at su.w.ranks */
  const epx_group_t g = su.g;
  const epx_handle_t h = su.h;
  const world_dev_t d = su.d;
  masks_t m;
  masks_make(w, c->one, &m);
  const int T = w->ranks[me].num_tokens, align = 1 + 3 * (c->fp8 != 0);
  uint8_t *d_mask = (uint8_t *)upload_ints(m.mask[me], (size_t)T * R);
  int *d_tpe = upload_ints(m.tpe[me], sizeof(int) * w->E);
  EXPECT(d_mask && d_tpe);
  if (poison_recv(g, t->stream) != TEST_PASS) return TEST_FAIL;

  epx_dispatch_args_t a = EPX_DISPATCH_ARGS_INIT;
  a.x = c->fp8 ? d.x8 : d.x;
  a.x_dtype = c->fp8 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16;
  a.x_scales = c->fp8 ? (const float *)d.sc : NULL;
  a.topk_idx = NULL;
  a.is_token_in_rank = d_mask;
  a.num_tokens_per_expert = d_tpe;
  a.num_tokens = T;
  a.expert_alignment = align;
  a.recv_topk_idx_dtype = c->idx64 ? EPX_DTYPE_INT64 : EPX_DTYPE_INT32;
  int per_expert[EPX_MAX_EXPERTS];
  a.num_recv_per_expert = per_expert;
  epx_dispatch_result_t res;
  EXPECT_OK(epx_dispatch(g, h, &a, &res, t->stream));
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));

  epx_ref_recv_t ref;
  EXPECT(epx_ref_dispatch_mask(&w->ref, (const uint8_t *const *)m.mask, (const int *const *)m.tpe,
                               me, c->fp8 ? EPX_REF_PAYLOAD_FP8 : EPX_REF_PAYLOAD_BF16, align,
                               &ref) == 0);
  EXPECT_EQ_INT(res.num_recv, ref.num_recv);
  for (int j = 0; j < w->L; j++)
    EXPECTF(per_expert[j] == ref.num_recv_per_expert_aligned[j], "%s: per-expert[%d] = %d, ref %d",
            c->name, j, per_expert[j], ref.num_recv_per_expert_aligned[j]);
  if (normal_check_recv(w, me, &res, c->fp8, 0, &ref, c->name) != TEST_PASS) return TEST_FAIL;
  if (check_meta(w, &res, ref.num_recv, ref.topk_idx, NULL, &ref, c->name) != TEST_PASS)
    return TEST_FAIL;
  if (check_prefix_matrix(w, &res, (const uint8_t *const *)m.mask, c->name) != TEST_PASS)
    return TEST_FAIL;
  char label[96];
  snprintf(label, sizeof label, "%s (combine after a rank-mask dispatch)", c->name);
  if (!c->fp8 && normal_combine_and_check(t, &su, label) != TEST_PASS) return TEST_FAIL;

  /* Cached dispatch of the same payload through epx_dispatch_cached_args. */
  if (poison_recv(g, t->stream) != TEST_PASS) return TEST_FAIL;
  epx_dispatch_args_t ca = EPX_DISPATCH_ARGS_INIT;
  ca.x = a.x, ca.x_dtype = a.x_dtype, ca.x_scales = a.x_scales, ca.num_tokens = T;
  EXPECT_OK(epx_dispatch_cached_args(g, h, &ca, &res, t->stream));
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  snprintf(label, sizeof label, "%s (cached)", c->name);
  if (normal_check_recv(w, me, &res, c->fp8, 0, &ref, label) != TEST_PASS) return TEST_FAIL;
  epx_ref_recv_free(&ref);

  cudaFree(d_mask), cudaFree(d_tpe);
  masks_free(&m, R);
  return setup_free(&su, c->name);
}

/*   name  {T_max  H  E  K  routing  T  empty_rank}  fp8  idx64  mask value */
static const mask_case_t mask_cases[] = {
    {"mask_uniform", {256, 512, 32, 4, ROUTE_UNIFORM, -1, -1}, 0, 0, 1},
    {"mask_one_expert_fp8", {256, 512, 32, 4, ROUTE_ONE_EXPERT, 256, -1}, 1, 1, 1},
    {"mask_holes_empty_rank", {256, 512, 32, 4, ROUTE_HOLES, -1, 1}, 0, 1, 7},
    {"mask_one_rank_gets_all", {256, 512, 32, 4, ROUTE_ONE_RANK, 256, -1}, 0, 0, 255},
    {"mask_all_empty", {128, 256, 16, 2, ROUTE_EMPTY, 128, -1}, 0, 0, 1},
    {"mask_duplicates_fp8", {512, 1024, 64, 8, ROUTE_DUPLICATES, -1, -1}, 1, 0, 3},
};

EPX_GPU_TEST(normal_dispatch_rank_mask, 300) {
  uint64_t rng = t->seed;
  for (size_t i = 0; i < sizeof mask_cases / sizeof mask_cases[0]; i++)
    if (run_mask_case(t, &mask_cases[i], &rng) != TEST_PASS) {
      fprintf(stderr, "  rank %d: case %s failed\n", t->rank, mask_cases[i].name);
      return TEST_FAIL;
    }
  return TEST_PASS;
}

/* One dispatch by ids with num_worst_tokens = worst (sync_counts = 0), checked against ref. */
static int run_worst(epx_test_rank_t *t, const world_t *w, epx_group_t g, epx_handle_t h,
                     const world_dev_t *d, int worst, int idx64, const epx_ref_recv_t *ref,
                     const char *label) {
  if (poison_recv(g, t->stream) != TEST_PASS) return TEST_FAIL;
  epx_dispatch_args_t a = EPX_DISPATCH_ARGS_INIT;
  a.x = d->x;
  a.topk_idx = d->idx;
  a.topk_weights = (const float *)d->w;
  a.num_tokens = w->ranks[t->rank].num_tokens;
  a.sync_counts = 0;
  a.num_worst_tokens = worst;
  a.recv_topk_idx_dtype = idx64 ? EPX_DTYPE_INT64 : EPX_DTYPE_INT32;
  epx_dispatch_result_t res;
  EXPECT_OK(epx_dispatch(g, h, &a, &res, t->stream));
  EXPECT_EQ_INT(res.num_recv, worst); /* known on the host at once, no sync */
  EXPECT(idx64 ? res.recv_topk_idx == NULL : res.recv_topk_idx_int64 == NULL);
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  if (normal_check_recv(w, t->rank, &res, 0, 0, ref, label) != TEST_PASS) return TEST_FAIL;
  if (worst < ref->num_recv) return TEST_PASS; /* the caller expects the async error */
  int64_t *want = malloc(sizeof(int64_t) * ((size_t)worst * w->K + 1));
  EXPECT(epx_ref_worst_topk_idx(ref, w->K, worst, want) == 0);
  const int ok = check_meta(w, &res, worst, want, ref->topk_weights, ref, label);
  free(want);
  if (ok != TEST_PASS) return TEST_FAIL;
  return check_prefix_matrix(w, &res, NULL, label);
}

/* Worst-case rows: the whole capacity, just the real count, something between; int32 and int64
 * ids; then fewer worst rows than received (async INVALID_ARGUMENT) and the group still works. */
EPX_GPU_TEST(normal_dispatch_worst_tokens, 300) {
  const int R = t->num_ranks, me = t->rank;
  uint64_t rng = t->seed;
  const world_spec_t specs[] = {{256, 512, 32, 4, ROUTE_UNIFORM, -1, -1},
                                {256, 512, 32, 4, ROUTE_ONE_EXPERT, 256, -1},
                                {256, 512, 32, 4, ROUTE_HOLES, -1, R - 1},
                                {128, 256, 16, 2, ROUTE_EMPTY, 128, -1}};
  for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++) {
    setup_t su;
    if (setup_make(t, &specs[i], &rng, &su) != TEST_PASS) return TEST_FAIL;
    world_t *const w = &su.w;
    const epx_group_t g = su.g;
    const epx_handle_t h = su.h;
    const world_dev_t d = su.d;
    epx_ref_recv_t ref;
    EXPECT(epx_ref_dispatch(&w->ref, me, EPX_REF_PAYLOAD_BF16, 1, &ref) == 0);
    const int cap = R * w->M, n = ref.num_recv;
    const int worsts[3] = {cap, n > 0 ? n : 1,
                           n + (cap - n) / 3 + 1 > cap ? cap : n + (cap - n) / 3 + 1};
    for (int k = 0; k < 3; k++) {
      char label[96];
      snprintf(label, sizeof label, "worst case %zu, num_worst_tokens %d (received %d)", i,
               worsts[k], n);
      if (run_worst(t, w, g, h, &d, worsts[k], k % 2, &ref, label) != TEST_PASS) return TEST_FAIL;
    }
    /* Too few worst rows on ranks that receive 2 or more: reported, nothing out of bounds. */
    if (run_worst(t, w, g, h, &d, n >= 2 ? n - 1 : cap, 0, &ref, "too few rows") != TEST_PASS)
      return TEST_FAIL;
    epx_async_error_t err;
    EXPECT_OK(epx_group_get_async_error(g, &err));
    if (n >= 2) {
      EXPECT_EQ_INT(err.status, EPX_ERR_INVALID_ARGUMENT);
      EXPECT_EQ_INT(err.stage, EPX_STAGE_DISPATCH);
      EXPECT_EQ_INT((int)err.value, n);
      EXPECT_OK(epx_group_clear_async_error(g));
    } else {
      EXPECTF(err.status == EPX_OK, "case %zu: async error %s", i, err.message);
    }
    if (run_worst(t, w, g, h, &d, cap, 1, &ref, "after too few rows") != TEST_PASS)
      return TEST_FAIL;
    if (normal_combine_and_check(t, &su, "combine after a worst-case dispatch") != TEST_PASS)
      return TEST_FAIL;
    epx_ref_recv_free(&ref);
    if (setup_free(&su, "worst tokens") != TEST_PASS) return TEST_FAIL;
  }
  return TEST_PASS;
}

/* This rank's scales in the asked format: packed words or float32, column-major or rows. */
static void *scales_in_format(const world_t *w, int me, int packed, int colmajor, int *stride_t,
                              int *stride_g) {
  const int T = w->ranks[me].num_tokens, G = w->H / 128, cols = packed ? (G + 3) / 4 : G;
  uint32_t *rows = malloc((size_t)T * cols * 4 + 4), *out = malloc((size_t)T * cols * 4 + 4);
  if (packed)
    epx_ref_ue8m0_pack(w->sc[me], T, G, (int32_t *)rows);
  else
    memcpy(rows, w->sc[me], (size_t)T * G * 4);
  *stride_t = colmajor ? 1 : 0;
  *stride_g = colmajor ? (T > 0 ? T : 1) : 0;
  if (colmajor)
    epx_ref_scales_strided(rows, T, cols, 1, *stride_g, out);
  else
    memcpy(out, rows, (size_t)T * cols * 4);
  void *dev = upload_ints(out, (size_t)T * cols * 4);
  free(rows), free(out);
  return dev;
}

/* FP8 with {column-major float32, packed rows, packed column-major} scales, by epx_dispatch and
 * then by epx_dispatch_cached_args with fresh payload in the same format. H = 640: five groups,
 * so a packed row is two words, the second with three zero bytes. */
EPX_GPU_TEST(normal_dispatch_scale_formats, 300) {
  const int R = t->num_ranks, me = t->rank;
  uint64_t rng = t->seed;
  const int formats[3][2] = {{0, 1}, {1, 0}, {1, 1}}; /* packed, column-major */
  for (int f = 0; f < 3; f++) {
    const int packed = formats[f][0], colmajor = formats[f][1];
    const world_spec_t spec = {
        192, 640, 8 * R, 4, f == 2 ? ROUTE_HOLES : ROUTE_UNIFORM, -1, f == 1 ? 0 : -1};
    setup_t su;
    if (setup_make(t, &spec, &rng, &su) != TEST_PASS) return TEST_FAIL;
    world_t *const w = &su.w;
    const epx_group_t g = su.g;
    const epx_handle_t h = su.h;
    const world_dev_t d = su.d;
    for (int pass = 0; pass < 2; pass++) { /* 0: epx_dispatch, 1: cached with new payload */
      if (pass == 1) {
        for (int s = 0; s < R; s++)
          for (int i = 0; i < w->ranks[s].num_tokens * w->H; i++)
            w->x8[s][i] = (uint8_t)epx_test_rand_int(&rng, 256);
        EXPECT_CUDA(cudaMemcpy(d.x8, w->x8[me], (size_t)w->ranks[me].num_tokens * w->H,
                               cudaMemcpyHostToDevice));
      }
      int st = 0, sg = 0;
      void *dsc = scales_in_format(w, me, packed, colmajor, &st, &sg);
      EXPECT(dsc != NULL);
      EXPECT_CUDA(cudaDeviceSynchronize()); /* legacy-stream copies before the test stream */
      if (poison_recv(g, t->stream) != TEST_PASS) return TEST_FAIL;
      epx_dispatch_args_t a = EPX_DISPATCH_ARGS_INIT;
      a.x = d.x8;
      a.x_dtype = EPX_DTYPE_FP8_E4M3;
      a.x_scales = (const float *)dsc;
      a.x_scales_dtype = packed ? EPX_DTYPE_INT32 : EPX_DTYPE_FLOAT32;
      a.x_scales_stride_token = st;
      a.x_scales_stride_group = sg;
      a.num_tokens = w->ranks[me].num_tokens;
      epx_dispatch_result_t res;
      if (pass == 0) {
        a.topk_idx = d.idx;
        a.topk_weights = (const float *)d.w;
        EXPECT_OK(epx_dispatch(g, h, &a, &res, t->stream));
      } else {
        EXPECT_OK(epx_dispatch_cached_args(g, h, &a, &res, t->stream));
      }
      EXPECT_CUDA(cudaStreamSynchronize(t->stream));
      epx_ref_recv_t ref;
      EXPECT(epx_ref_dispatch(&w->ref, me, EPX_REF_PAYLOAD_FP8, 1, &ref) == 0);
      char label[96];
      snprintf(label, sizeof label, "%s%s scales, %s", packed ? "packed UE8M0" : "float32",
               colmajor ? " column-major" : "", pass ? "cached" : "dispatch");
      if (check_fp8_recv(w, &res, packed, &ref, label) != TEST_PASS) return TEST_FAIL;
      epx_ref_recv_free(&ref);
      cudaFree(dsc);
    }
    if (setup_free(&su, "scale formats") != TEST_PASS) return TEST_FAIL;
  }
  return TEST_PASS;
}

/* epx_dispatch(args) is refused with EPX_ERR_INVALID_ARGUMENT and a message naming `must`. */
static int expect_refused(epx_test_rank_t *t, epx_group_t g, epx_handle_t h,
                          epx_dispatch_args_t args, const char *must) {
  epx_dispatch_result_t res;
  const epx_status_t s = epx_dispatch(g, h, &args, &res, t->stream);
  EXPECTF(s == EPX_ERR_INVALID_ARGUMENT && strstr(epx_last_error(), must) != NULL,
          "a refusal naming %s: got %s, '%s'", must, epx_status_string(s), epx_last_error());
  return TEST_PASS;
}

/* The options' refusals, each a field change of a valid dispatch (a, or its rank-mask or FP8
 * version) and the name the message must carry. */
static int refuse_all(epx_test_rank_t *t, epx_group_t g, epx_handle_t h, epx_dispatch_args_t a,
                      epx_dispatch_args_t mask, epx_dispatch_args_t fp8, const void *ids,
                      const uint8_t *host_mask) {
  int bad = 0;
  epx_dispatch_args_t b;
  b = mask, b.topk_idx = ids, bad |= expect_refused(t, g, h, b, "topk_idx");
  b = mask, b.num_tokens_per_expert = NULL, bad |= expect_refused(t, g, h, b, "num_tokens_per_e");
  b = mask, b.is_token_in_rank = NULL, bad |= expect_refused(t, g, h, b, "is_token_in_rank");
  b = mask, b.topk_weights = a.topk_weights, bad |= expect_refused(t, g, h, b, "topk_weights");
  b = mask, b.is_token_in_rank = host_mask, bad |= expect_refused(t, g, h, b, "is_token_in_rank");
  b = a, b.num_worst_tokens = 8, bad |= expect_refused(t, g, h, b, "num_worst_tokens");
  b = a, b.sync_counts = 0, b.num_worst_tokens = -1;
  bad |= expect_refused(t, g, h, b, "num_worst_tokens");
  b = a, b.sync_counts = 0, b.num_worst_tokens = t->num_ranks * 64 + 1;
  bad |= expect_refused(t, g, h, b, "num_worst_tokens");
  b = a, b.recv_topk_idx_dtype = EPX_DTYPE_FLOAT32;
  bad |= expect_refused(t, g, h, b, "recv_topk_idx_dtype");
  b = fp8, b.x_scales_dtype = EPX_DTYPE_BF16, bad |= expect_refused(t, g, h, b, "x_scales_dtype");
  b = fp8, b.x_scales_stride_token = 1, bad |= expect_refused(t, g, h, b, "x_scales_stride");
  b = a, b.x_scales_dtype = EPX_DTYPE_INT32, bad |= expect_refused(t, g, h, b, "x_scales_dtype");
  b = a, b.x_scales_stride_token = 1, b.x_scales_stride_group = 64;
  bad |= expect_refused(t, g, h, b, "x_scales_stride");
  return bad ? TEST_FAIL : TEST_PASS;
}

/* Inconsistent combinations of the new options are refused by name before anything is sent;
 * a rank-mask dispatch right after is checked, then cached dispatches refused by name. */
EPX_GPU_TEST(normal_dispatch_extras_bad_arguments, 120) {
  const int R = t->num_ranks, me = t->rank;
  uint64_t rng = t->seed;
  const world_spec_t spec = {64, 512, 4 * R, 2, ROUTE_UNIFORM, 64, -1};
  setup_t su;
  if (setup_make(t, &spec, &rng, &su) != TEST_PASS) return TEST_FAIL;
  masks_t m;
  masks_make(&su.w, 1, &m);
  uint8_t *d_mask = (uint8_t *)upload_ints(m.mask[me], (size_t)64 * R);
  int *d_tpe = upload_ints(m.tpe[me], sizeof(int) * su.w.E);
  EXPECT(d_mask && d_tpe);
  epx_dispatch_args_t a = EPX_DISPATCH_ARGS_INIT;
  a.x = su.d.x;
  a.topk_idx = su.d.idx;
  a.topk_weights = (const float *)su.d.w;
  a.num_tokens = 64;
  epx_dispatch_args_t mask = a, fp8 = a;
  mask.topk_idx = NULL, mask.topk_weights = NULL;
  mask.is_token_in_rank = d_mask, mask.num_tokens_per_expert = d_tpe;
  fp8.x = su.d.x8, fp8.x_dtype = EPX_DTYPE_FP8_E4M3, fp8.x_scales = (const float *)su.d.sc;
  if (refuse_all(t, su.g, su.h, a, mask, fp8, su.d.idx, m.mask[me]) != TEST_PASS) return TEST_FAIL;
  epx_dispatch_result_t res;
  EXPECT_STATUS(epx_dispatch_cached_args(su.g, su.h, &a, &res, t->stream), EPX_ERR_INVALID_USAGE);

  EXPECT_OK(epx_dispatch(su.g, su.h, &mask, &res, t->stream));
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  epx_ref_recv_t ref;
  EXPECT(epx_ref_dispatch_mask(&su.w.ref, (const uint8_t *const *)m.mask, (const int *const *)m.tpe,
                               me, EPX_REF_PAYLOAD_BF16, 1, &ref) == 0);
  if (normal_check_recv(&su.w, me, &res, 0, 0, &ref, "after bad arguments") != TEST_PASS)
    return TEST_FAIL;
  epx_ref_recv_free(&ref);
  epx_dispatch_args_t c = EPX_DISPATCH_ARGS_INIT;
  c.x = su.d.x, c.num_tokens = 63;
  EXPECT_STATUS(epx_dispatch_cached_args(su.g, su.h, &c, &res, t->stream),
                EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "num_tokens") != NULL);
  c.num_tokens = 64, c.topk_idx = su.d.idx;
  EXPECT_STATUS(epx_dispatch_cached_args(su.g, su.h, &c, &res, t->stream),
                EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "topk_idx") != NULL);
  cudaFree(d_mask), cudaFree(d_tpe);
  masks_free(&m, R);
  return setup_free(&su, __func__);
}

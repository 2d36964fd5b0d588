/*
 * test_normal_combine_extras.c - normal combine's top-k weight reduction and bias (DeepEP
 * combine's `topk_weights` -> `combined_topk_weights`, and `bias`) on 2 and 4 GPUs against the
 * CPU reference (epx_ref_combine_ex in tests/ref).
 *
 * Every rank builds the whole world from the test seed (world.h, WORLD_NORMAL), dispatches with
 * weights, then runs several combines on the same routing, each with its outputs poisoned (NaN)
 * first. Numeric contract:
 *   - out_topk_weights: BIT-EXACT. Kernel and reference both add the returned weights of a token
 *     as float32, rank ascending, from +0.0f (plain additions, no reordering), so the result is
 *     the same bits whatever the values; with the dispatch's received weights every sum has at
 *     most one nonzero term per slot and is exact anyway.
 *   - out: within BF16 rounding of the float64 reference (|got - ref| <= |ref|/256 + 1e-4, as
 *     normal_check_combine): the kernel may fuse multiply-adds; the bias is added in float32
 *     after the rows, before the one rounding, as in the reference.
 *
 *   test                                 what
 *   normal_combine_extras_cases          per routing below, five combines on one dispatch:
 *                                        dispatch's weights; dense caller weights + one bias;
 *                                        dense weights + two biases + weighted combine; two
 *                                        biases alone; a plain combine after them (unchanged)
 *   normal_combine_extras_bad_arguments  named INVALID_ARGUMENT errors, nothing sent; the group
 *                                        still works (a checked combine with extras after them)
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/normal_checks.h"

/* Device buffers of the extras, room for M tokens and R*M received rows. */
typedef struct {
  uint16_t *bias_host[2]; /* [M, H] BF16 */
  void *bias[2];          /* [M, H] BF16 */
  float *out_w;           /* [M, K] */
  float *dense;           /* [R*M, K]: this rank's dense returned weights */
} extras_dev_t;

/* The dense weight of row i, slot k, returned by rank d: distinct small dyadic values. */
static float dense_weight(int d, int i, int k) {
  return 0.5f * (float)(d + 1) + 0.25f * (float)(i % 7) + 0.125f * (float)k;
}

static int extras_alloc(const world_t *w, int me, uint64_t *rng, extras_dev_t *x) {
  const size_t M = (size_t)w->M, H = (size_t)w->H, K = (size_t)w->K, R = (size_t)w->R;
  memset(x, 0, sizeof *x);
  for (int j = 0; j < 2; j++) {
    x->bias_host[j] = malloc(M * H * 2 + 2);
    for (size_t i = 0; i < M * H; i++)
      x->bias_host[j][i] = epx_ref_bf16_from_float(2.f * epx_test_rand_unit(rng) - 1.f);
    EXPECT_CUDA(cudaMalloc(&x->bias[j], M * H * 2 + 16));
    EXPECT_CUDA(cudaMemcpy(x->bias[j], x->bias_host[j], M * H * 2, cudaMemcpyHostToDevice));
  }
  EXPECT_CUDA(cudaMalloc((void **)&x->out_w, M * K * 4 + 16));
  float *dense = malloc(R * M * K * 4 + 4);
  for (size_t i = 0; i < R * M; i++)
    for (size_t k = 0; k < K; k++) dense[i * K + k] = dense_weight(me, (int)i, (int)k);
  EXPECT_CUDA(cudaMalloc((void **)&x->dense, R * M * K * 4 + 16));
  EXPECT_CUDA(cudaMemcpy(x->dense, dense, R * M * K * 4, cudaMemcpyHostToDevice));
  free(dense);
  EXPECT_CUDA(cudaDeviceSynchronize()); /* legacy-stream copies before the test stream's work */
  return TEST_PASS;
}

static void extras_free(extras_dev_t *x) {
  for (int j = 0; j < 2; j++) free(x->bias_host[j]), cudaFree(x->bias[j]);
  cudaFree(x->out_w), cudaFree(x->dense);
  memset(x, 0, sizeof *x);
}

/* Which extras one combine call uses. */
typedef struct {
  const char *name;
  int weights;  /* 0 none, 1 the dispatch's received weights, 2 dense caller weights */
  int num_bias; /* 0, 1 or 2 */
  int weighted; /* 1: topk_idx + topk_weights factors as well */
} extras_mode_t;

/* The reference of one combine call for rank me: out (float64) and out_w (float32). */
static int extras_reference(const world_t *w, int me, const extras_mode_t *m, const extras_dev_t *x,
                            double *out, float *out_w) {
  const int R = w->R;
  uint16_t *y[EPX_MAX_RANKS] = {NULL};
  float *recv_w[EPX_MAX_RANKS] = {NULL};
  int ok = 1;
  for (int d = 0; d < R; d++) {
    int n = 0;
    y[d] = normal_expert_output(w, d, &n);
    recv_w[d] = malloc((size_t)n * w->K * 4 + 4);
    if (m->weights == 1) {
      epx_ref_recv_t r;
      memset(&r, 0, sizeof r);
      ok &= epx_ref_dispatch(&w->ref, d, EPX_REF_PAYLOAD_NONE, 1, &r) == 0;
      memcpy(recv_w[d], r.topk_weights, (size_t)n * w->K * 4);
      epx_ref_recv_free(&r);
    } else {
      for (int i = 0; i < n; i++)
        for (int k = 0; k < w->K; k++) recv_w[d][(size_t)i * w->K + k] = dense_weight(d, i, k);
    }
  }
  epx_ref_combine_extras_t ex = {NULL, NULL, {NULL, NULL}};
  if (m->weights) ex.recv_w = (const float *const *)recv_w, ex.out_w = out_w;
  for (int j = 0; j < m->num_bias; j++) ex.bias[j] = x->bias_host[j];
  ok &= epx_ref_combine_ex_f64(&w->ref, me, (const uint16_t *const *)y,
                               m->weighted ? w->w[me] : NULL, &ex, out) == 0;
  for (int d = 0; d < R; d++) free(y[d]), free(recv_w[d]);
  EXPECTF(ok, "%s: the reference failed", m->name);
  return TEST_PASS;
}

/* One routing dispatched (with weights) and its expert outputs in place: what every combine of
 * a case starts from. */
typedef struct {
  world_t w;
  epx_group_t g;
  epx_handle_t h;
  world_dev_t d;
  extras_dev_t x;
  epx_dispatch_result_t res;
} fixture_t;

static int fixture_make(epx_test_rank_t *t, const world_spec_t *spec, uint64_t *rng, fixture_t *f) {
  const int R = t->num_ranks, me = t->rank;
  memset(f, 0, sizeof *f);
  world_make(&f->w, R, spec, WORLD_NORMAL, rng);
  const world_t *w = &f->w;
  epx_group_config_t cfg = gpu_test_config(w->M, w->H, w->E, w->K);
  cfg.modes = EPX_MODE_NORMAL;
  EXPECT_OK(epx_group_create(t->comm, &cfg, &f->g));
  EXPECT_OK(epx_handle_create(f->g, &f->h));
  if (world_dev_make(w, me, (size_t)R * w->M, &f->d) != TEST_PASS) return TEST_FAIL;
  if (extras_alloc(w, me, rng, &f->x) != TEST_PASS) return TEST_FAIL;
  epx_dispatch_args_t a = EPX_DISPATCH_ARGS_INIT;
  a.x = f->d.x;
  a.topk_idx = f->d.idx;
  a.topk_weights = (const float *)f->d.w;
  a.num_tokens = w->ranks[me].num_tokens;
  EXPECT_OK(epx_dispatch(f->g, f->h, &a, &f->res, t->stream));
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  int nrecv = 0;
  uint16_t *y = normal_expert_output(w, me, &nrecv);
  EXPECT_EQ_INT(nrecv, f->res.num_recv);
  EXPECT_CUDA(cudaMemcpy(f->d.y, y, (size_t)nrecv * w->H * 2, cudaMemcpyHostToDevice));
  EXPECT_CUDA(cudaDeviceSynchronize()); /* legacy-stream copy before the test stream's work */
  free(y);
  return TEST_PASS;
}

/* No async error on record, then everything released. */
static int fixture_free(fixture_t *f, const char *label) {
  EXPECT_NO_ASYNC_ERROR(f->g, label);
  extras_free(&f->x);
  world_dev_free(&f->d);
  world_free(&f->w);
  EXPECT_OK(epx_handle_destroy(f->h));
  EXPECT_OK(epx_group_destroy(f->g));
  return TEST_PASS;
}

/* One combine with mode m on the dispatched routing, outputs poisoned first, checked. */
static int run_mode(epx_test_rank_t *t, const fixture_t *f, const extras_mode_t *m,
                    const char *case_name) {
  const world_t *w = &f->w;
  const world_dev_t *d = &f->d;
  const extras_dev_t *x = &f->x;
  const int me = t->rank, T = w->ranks[me].num_tokens, H = w->H, K = w->K;
  char label[128];
  snprintf(label, sizeof label, "%s (%s)", case_name, m->name);
  EXPECT_CUDA(cudaMemsetAsync(d->out, 0xFF, (size_t)w->M * H * 2, t->stream)); /* NaN */
  EXPECT_CUDA(cudaMemsetAsync(x->out_w, 0xFF, (size_t)w->M * K * 4, t->stream));
  epx_combine_args_t ca = EPX_COMBINE_ARGS_INIT;
  ca.x = d->y;
  ca.out = d->out;
  if (m->weighted) ca.topk_idx = d->idx, ca.topk_weights = (const float *)d->w;
  if (m->weights) {
    ca.recv_topk_weights = m->weights == 1 ? f->res.recv_topk_weights : x->dense;
    ca.out_topk_weights = x->out_w;
  }
  for (int j = 0; j < m->num_bias; j++) ca.bias[j] = x->bias[j];
  EXPECT_OK(epx_combine(f->g, f->h, &ca, t->stream));
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));

  double *ref = malloc(sizeof(double) * ((size_t)T * H + 1));
  float *ref_w = malloc(sizeof(float) * ((size_t)T * K + 1));
  uint16_t *got = malloc((size_t)T * H * 2 + 2);
  float *got_w = malloc((size_t)T * K * 4 + 4);
  if (extras_reference(w, me, m, x, ref, ref_w) != TEST_PASS) return TEST_FAIL;
  EXPECT_CUDA(cudaMemcpy(got, d->out, (size_t)T * H * 2, cudaMemcpyDeviceToHost));
  EXPECT_CUDA(cudaMemcpy(got_w, x->out_w, (size_t)T * K * 4, cudaMemcpyDeviceToHost));
  long long bad = -1, bad_w = -1;
  for (size_t i = 0; i < (size_t)T * H && bad < 0; i++) {
    const double gv = epx_ref_bf16_to_float(got[i]), r = ref[i];
    if (!(fabs(gv - r) <= fabs(r) * (1.0 / 256) + 1e-4)) bad = (long long)i;
  }
  for (size_t i = 0; m->weights && i < (size_t)T * K && bad_w < 0; i++)
    if (memcmp(&got_w[i], &ref_w[i], 4) != 0) bad_w = (long long)i;
  if (bad >= 0)
    fprintf(stderr, "  rank %d %s: out[%lld][%lld] = %g, float64 reference %.8g\n", me, label,
            bad / H, bad % H, epx_ref_bf16_to_float(got[bad]), ref[bad]);
  if (bad_w >= 0)
    fprintf(stderr, "  rank %d %s: out_topk_weights[%lld][%lld] = %.9g, reference %.9g\n", me,
            label, bad_w / K, bad_w % K, got_w[bad_w], ref_w[bad_w]);
  free(ref), free(ref_w), free(got), free(got_w);
  return bad < 0 && bad_w < 0 ? TEST_PASS : TEST_FAIL;
}

static const extras_mode_t modes[] = {
    {"dispatch weights", 1, 0, 0},
    {"dense weights + bias", 2, 1, 0},
    {"dense weights + 2 biases, weighted", 2, 2, 1},
    {"2 biases only", 0, 2, 0},
};

static int run_case(epx_test_rank_t *t, const normal_case_t *c, uint64_t *rng) {
  fixture_t f;
  if (fixture_make(t, &c->world, rng, &f) != TEST_PASS) return TEST_FAIL;
  for (size_t i = 0; i < sizeof modes / sizeof modes[0]; i++)
    if (run_mode(t, &f, &modes[i], c->name) != TEST_PASS) return TEST_FAIL;
  /* A plain combine after them still does what it did (the other kernel specialisation). */
  EXPECT_CUDA(cudaMemsetAsync(f.d.out, 0xFF, (size_t)f.w.M * f.w.H * 2, t->stream));
  epx_combine_args_t ca = EPX_COMBINE_ARGS_INIT;
  ca.x = f.d.y;
  ca.out = f.d.out;
  EXPECT_OK(epx_combine(f.g, f.h, &ca, t->stream));
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  char label[96];
  snprintf(label, sizeof label, "%s (plain after extras)", c->name);
  if (normal_check_combine(&f.w, t->rank, f.d.out, NULL, label) != TEST_PASS) return TEST_FAIL;
  return fixture_free(&f, c->name);
}

/*   name  {T_max  H  E  K  routing  T  empty_rank} (the world_spec_t)  fp8 (unused: 0) */
static const normal_case_t cases[] = {
    {"random_uneven", {512, 1024, 64, 8, ROUTE_UNIFORM, -1, -1}, 0},
    {"one_expert", {256, 512, 32, 4, ROUTE_ONE_EXPERT, 256, -1}, 0},
    {"holes_empty_rank", {256, 512, 32, 4, ROUTE_HOLES, -1, 1}, 0},
    {"all_empty", {128, 512, 32, 4, ROUTE_EMPTY, 128, -1}, 0},
    {"one_rank_gets_all", {256, 512, 32, 4, ROUTE_ONE_RANK, 256, -1}, 0},
    {"duplicates", {256, 512, 32, 6, ROUTE_DUPLICATES, -1, -1}, 0},
    {"e_equals_r_top1", {256, 264, 0, 1, ROUTE_UNIFORM, -1, -1}, 0},
    {"top16_e1024", {128, 512, 1024, 16, ROUTE_HOLES, -1, -1}, 0},
    {"deepep_shape", {2048, 7168, 256, 8, ROUTE_UNIFORM, 2048, -1}, 0},
};

EPX_GPU_TEST(normal_combine_extras_cases, 600) {
  uint64_t rng = t->seed; /* the same on every rank: the world is shared */
  int failed = -1;
  for (int i = 0; i < (int)(sizeof cases / sizeof cases[0]) && failed < 0; i++)
    if (run_case(t, &cases[i], &rng) != TEST_PASS) failed = i;
  if (failed >= 0)
    fprintf(stderr, "  rank %d: extras case %s failed\n", t->rank, cases[failed].name);
  return failed < 0 ? TEST_PASS : TEST_FAIL;
}

/* The refused calls: each spoils one field of a good call with extras (spoil() below); the
 * message must name `must`. */
static const struct {
  const char *name, *must;
} refused[] = {
    {"weights without output", "out_topk_weights"},
    {"output without weights", "recv_topk_weights"},
    {"host weights", "recv_topk_weights"},
    {"misaligned weights", "aligned"},
    {"host output weights", "out_topk_weights"},
    {"misaligned bias", "bias[0]"},
    {"host bias", "bias[1]"},
};

static void spoil(epx_combine_args_t *a, int which, const extras_dev_t *x, void *host) {
  switch (which) {
    case 0:
      a->out_topk_weights = NULL;
      break;
    case 1:
      a->recv_topk_weights = NULL;
      break;
    case 2:
      a->recv_topk_weights = (const float *)host;
      break;
    case 3:
      a->recv_topk_weights = (const float *)((const char *)x->dense + 2);
      break;
    case 4:
      a->out_topk_weights = (float *)host;
      break;
    case 5:
      a->bias[0] = (const char *)x->bias[0] + 8;
      break;
    default:
      a->bias[1] = host;
      break;
  }
}

/* Bad extras are refused with a named error before anything is sent (every rank refuses the
 * same call, so none is left waiting); the group still works. */
EPX_GPU_TEST(normal_combine_extras_bad_arguments, 120) {
  uint64_t rng = t->seed;
  const world_spec_t spec = {64, 512, 4 * t->num_ranks, 2, ROUTE_UNIFORM, 64, -1};
  fixture_t f;
  if (fixture_make(t, &spec, &rng, &f) != TEST_PASS) return TEST_FAIL;
  void *host = malloc((size_t)64 * 512 * 2 + 16); /* plain host memory, for every pointer */
  for (int i = 0; i < (int)(sizeof refused / sizeof refused[0]); i++) {
    epx_combine_args_t a = EPX_COMBINE_ARGS_INIT;
    a.x = f.d.y;
    a.out = f.d.out;
    a.recv_topk_weights = f.x.dense;
    a.out_topk_weights = f.x.out_w;
    a.bias[0] = f.x.bias[0];
    a.bias[1] = f.x.bias[1];
    spoil(&a, i, &f.x, host);
    const epx_status_t s = epx_combine(f.g, f.h, &a, t->stream);
    EXPECTF(s == EPX_ERR_INVALID_ARGUMENT, "%s: got %s", refused[i].name, epx_status_string(s));
    EXPECTF(strstr(epx_last_error(), refused[i].must) != NULL, "%s: message '%s' does not name %s",
            refused[i].name, epx_last_error(), refused[i].must);
  }
  free(host);
  /* The group still works: the full call, checked. */
  const extras_mode_t m = {"after bad arguments", 2, 2, 0};
  if (run_mode(t, &f, &m, "extras_args") != TEST_PASS) return TEST_FAIL;
  return fixture_free(&f, __func__);
}

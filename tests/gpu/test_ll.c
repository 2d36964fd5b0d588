/*
 * test_ll.c - low-latency dispatch/combine on 2 and 4 GPUs against the CPU reference in its
 * fixed-slot layout (tests/ref/epx_ref.h, EPX_REF_LL_FIXED).
 *
 * Every rank builds the whole world (all ranks' tokens, routing, weights, payload) from the test
 * seed, so it can compute with tests/ref what it must receive and what combine must return.
 * Expert outputs are a per-rank, per-expert affine map of the received rows, so rows of one
 * token differ from expert to expert and from rank to rank.
 *
 *   test                          what
 *   ll_dispatch_combine_cases     every route x the table below: BF16 bit-exact; FP8 payload and
 *                                 scales bit-exact (plain and UE8M0); counts, segments, sources;
 *                                 weighted combine within BF16 rounding of float64; split and
 *                                 zero-copy variants; random and adversarial routings
 *   ll_split_two_microbatches     two split dispatches in flight, receives in order, two split
 *                                 combines; reusing a pending buffer is refused
 *   ll_graph_replay               dispatch + combine captured once (plain, and split), replayed
 *                                 with new payload and routing before every replay
 *   ll_loop_10000                 10,000 iterations of dispatch then combine, T, routing and
 *                                 dtype changing every iteration, everything checked
 *   ll_refuses_bad_arguments      named errors, nothing sent, the group still works
 *   ll_bad_expert_ids             ids outside [-1, E): async INVALID_ARGUMENT (first position),
 *                                 treated as empty slots
 *   ll_peer_masking               the last rank stops answering: the others finish within the
 *                                 budget, report PEER_FAILED and the mask, keep serving; after
 *                                 epx_group_clear_peer_mask every rank works again
 *   ll_traced_cycle               every route, traced (docs/profiling.md): results still match;
 *                                 the file holds each block's send, wait and receive spans of
 *                                 dispatch and combine on every rank
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/json.h"
#include "common/trace_check.h"
#include "gpu/gpu_util.h"
#include "ref/epx_ref.h"
#include "trace.h"

typedef enum {
  ROUTE_UNIFORM,    /* distinct experts, uniform */
  ROUTE_ONE_EXPERT, /* every slot names expert E/2 (a token lists it K times) */
  ROUTE_EMPTY,      /* every slot -1 */
  ROUTE_HOLES,      /* distinct, a quarter of the slots -1 */
  ROUTE_ONE_RANK,   /* distinct experts of rank 0 only */
  ROUTE_DUPLICATES, /* uniform with repeats: a third of the slots copy an earlier slot */
  ROUTE_BAD         /* uniform, ~6% of the slots outside [-1, E) */
} route_t;

typedef struct {
  const char *name;
  int max_tokens, hidden, experts, top_k; /* experts 0: = R */
  route_t route;
  int tokens;     /* -1: random in [0, max] per rank (uneven); else for every rank */
  int empty_rank; /* a rank with 0 tokens, or -1 */
  int fp8, ue8m0, split, zero_copy, no_weights;
} ll_case_t;

/* ---------------------------------------------------------------------------------------------
 * The world: every rank's inputs, generated identically on every rank.
 * ------------------------------------------------------------------------------------------- */
typedef struct {
  int R, E, K, H, M, L;
  epx_ref_rank_t ranks[EPX_MAX_RANKS];
  int64_t *idx[EPX_MAX_RANKS];
  float *w[EPX_MAX_RANKS];
  uint16_t *x[EPX_MAX_RANKS];
  epx_ref_world_t ref;
} world_t;

static void route_token(int64_t *ids, int K, int E, int R, route_t route, uint64_t *rng) {
  for (int k = 0; k < K; k++) {
    int64_t e = -1;
    if (route == ROUTE_ONE_EXPERT) {
      e = E / 2;
    } else if (route == ROUTE_DUPLICATES) {
      e = (k > 0 && epx_test_rand_int(rng, 3) == 0) ? ids[epx_test_rand_int(rng, k)]
                                                    : epx_test_rand_int(rng, E);
    } else if (route != ROUTE_EMPTY) {
      const int range = route == ROUTE_ONE_RANK ? E / R : E;
      e = epx_test_rand_new_expert(rng, ids, k, range);
      if (e < 0 || (route == ROUTE_HOLES && epx_test_rand_int(rng, 4) == 0)) e = -1;
      if (route == ROUTE_BAD && epx_test_rand_int(rng, 16) == 0) {
        const int64_t bad[3] = {E, -2, 1 << 20};
        e = bad[epx_test_rand_int(rng, 3)];
      }
    }
    ids[k] = e;
  }
}

static void world_free(world_t *w) {
  for (int s = 0; s < w->R; s++) free(w->idx[s]), free(w->w[s]), free(w->x[s]);
  memset(w, 0, sizeof *w);
}

static void world_make(world_t *w, int R, const ll_case_t *c, uint64_t *rng) {
  memset(w, 0, sizeof *w);
  w->R = R;
  w->E = c->experts ? c->experts : R;
  w->K = c->top_k > w->E ? w->E : c->top_k;
  w->H = c->hidden;
  w->M = c->max_tokens;
  w->L = w->E / R;
  for (int s = 0; s < R; s++) {
    int T = c->tokens >= 0 ? c->tokens : epx_test_rand_int(rng, c->max_tokens + 1);
    if (s == c->empty_rank) T = 0;
    const size_t TK = (size_t)T * w->K, TH = (size_t)T * w->H;
    w->idx[s] = malloc(sizeof(int64_t) * (TK + 1));
    w->w[s] = malloc(sizeof(float) * (TK + 1));
    w->x[s] = malloc(sizeof(uint16_t) * (TH + 1));
    for (int t = 0; t < T; t++)
      route_token(w->idx[s] + (size_t)t * w->K, w->K, w->E, R, c->route, rng);
    for (size_t i = 0; i < TK; i++) w->w[s][i] = epx_test_rand_unit(rng) + 0.01f;
    for (size_t i = 0; i < TH; i++) {
      /* Mostly [-2, 2); a few large and tiny values so FP8 groups have varied scales. */
      float v = 4.f * epx_test_rand_unit(rng) - 2.f;
      const int kind = epx_test_rand_int(rng, 64);
      if (kind == 0) v *= 300.f;
      if (kind == 1) v *= 1e-5f;
      w->x[s][i] = epx_ref_bf16_from_float(v);
    }
    w->ranks[s] =
        (epx_ref_rank_t){T, w->idx[s], c->no_weights ? NULL : w->w[s], w->x[s], NULL, NULL};
  }
  w->ref = (epx_ref_world_t){R, w->E, w->K, w->H, w->ranks};
}

/* The world as the live ranks see it once `dead` is masked: the dead rank sends nothing, and
 * slots naming its experts are empty. Shares the payload and weights of w. */
static void world_without(const world_t *w, int dead, world_t *out) {
  *out = *w;
  for (int s = 0; s < w->R; s++) {
    const size_t TK = (size_t)w->ranks[s].num_tokens * w->K;
    out->idx[s] = malloc(sizeof(int64_t) * (TK + 1));
    for (size_t i = 0; i < TK; i++) {
      const int64_t e = w->idx[s][i];
      out->idx[s][i] = (e >= 0 && e < w->E && e / w->L == dead) ? -1 : e;
    }
    out->ranks[s].topk_idx = out->idx[s];
    if (s == dead) out->ranks[s].num_tokens = 0;
  }
  out->ref.ranks = out->ranks;
}

static void world_without_free(world_t *w) {
  for (int s = 0; s < w->R; s++) free(w->idx[s]);
}

/* ---------------------------------------------------------------------------------------------
 * What the reference says each rank receives, and the expert outputs.
 * ------------------------------------------------------------------------------------------- */
typedef struct {
  uint16_t *x;       /* [L, R*M, H] (only segment rows written) */
  uint8_t *q;        /* [L, R*M, H] FP8 */
  float *sc;         /* [L, R*M, H/128] */
  int *count;        /* [L] */
  int *begin;        /* [L, R] */
  int *num;          /* [L, R] */
  int *sr, *st, *sk; /* [L, R*M] */
} ref_recv_t;

static void ref_recv_free(ref_recv_t *r) {
  free(r->x), free(r->q), free(r->sc), free(r->count), free(r->begin), free(r->num);
  free(r->sr), free(r->st), free(r->sk);
  memset(r, 0, sizeof *r);
}

/* NOTE: malloc without touching: the reference writes only the rows of the segments. */
static int ref_recv(const world_t *w, int d, int fp8, int ue8m0, ref_recv_t *r) {
  const size_t rows = (size_t)w->L * w->R * w->M, H = (size_t)w->H;
  memset(r, 0, sizeof *r);
  r->x = malloc(rows * H * 2 + 2);
  r->q = fp8 ? malloc(rows * H + 1) : NULL;
  r->sc = fp8 ? malloc(rows * (H / 128) * 4 + 4) : NULL;
  r->count = malloc(sizeof(int) * w->L);
  r->begin = malloc(sizeof(int) * w->L * w->R);
  r->num = malloc(sizeof(int) * w->L * w->R);
  r->sr = malloc(sizeof(int) * rows);
  r->st = malloc(sizeof(int) * rows);
  r->sk = malloc(sizeof(int) * rows);
  epx_ref_ll_recv_t out = {r->x, r->q, r->sc, r->count, r->begin, r->num, r->sr, r->st, r->sk};
  EXPECT(epx_ref_ll_dispatch_layout(&w->ref, d, w->M, ue8m0, EPX_REF_LL_FIXED, &out) == 0);
  return TEST_PASS;
}

/* Expert output of rank d, local expert j, from a received BF16 value. */
static uint16_t expert_fn(uint16_t v, int d, int j) {
  return epx_ref_bf16_from_float(epx_ref_bf16_to_float(v) * (0.5f + 0.25f * (float)d) +
                                 0.015625f * (float)(j + 1));
}

/* y[d] = [L, R*M, H] BF16 expert outputs of every rank (only segment rows set). */
static int make_outputs(const world_t *w, uint16_t **y) {
  const size_t RM = (size_t)w->R * w->M, H = (size_t)w->H;
  for (int d = 0; d < w->R; d++) {
    ref_recv_t r;
    if (ref_recv(w, d, 0, 0, &r) != TEST_PASS) return TEST_FAIL;
    y[d] = malloc((size_t)w->L * RM * H * 2 + 2);
    for (int j = 0; j < w->L; j++)
      for (int s = 0; s < w->R; s++)
        for (int i = 0; i < r.num[j * w->R + s]; i++) {
          const size_t row = (size_t)j * RM + (size_t)s * w->M + i;
          for (size_t c = 0; c < H; c++) y[d][row * H + c] = expert_fn(r.x[row * H + c], d, j);
        }
    ref_recv_free(&r);
  }
  return TEST_PASS;
}

/* ---------------------------------------------------------------------------------------------
 * Device buffers of one rank and the checks.
 * ------------------------------------------------------------------------------------------- */
typedef struct {
  void *x, *idx, *w, *y, *out;
  size_t y_bytes;
} ll_dev_t;

static int dev_alloc(const world_t *w, ll_dev_t *d) {
  memset(d, 0, sizeof *d);
  const size_t M = (size_t)w->M, H = (size_t)w->H, K = (size_t)w->K;
  d->y_bytes = (size_t)w->L * w->R * M * H * 2;
  EXPECT_CUDA(cudaMalloc(&d->x, M * H * 2 + 16));
  EXPECT_CUDA(cudaMalloc(&d->idx, M * K * 8 + 16));
  EXPECT_CUDA(cudaMalloc(&d->w, M * K * 4 + 16));
  EXPECT_CUDA(cudaMalloc(&d->y, d->y_bytes + 16));
  EXPECT_CUDA(cudaMalloc(&d->out, M * H * 2 + 16));
  return TEST_PASS;
}

static void dev_free(ll_dev_t *d) {
  cudaFree(d->x), cudaFree(d->idx), cudaFree(d->w), cudaFree(d->y), cudaFree(d->out);
}

/* This rank's inputs to the device. NOTE: cudaMemcpy runs on the legacy stream, which does not
 * order with the tests' non-blocking streams: finish it before any kernel reads the inputs. */
static int upload(const world_t *w, int me, const ll_dev_t *d) {
  const size_t T = (size_t)w->ranks[me].num_tokens;
  EXPECT_CUDA(cudaMemcpy(d->x, w->x[me], T * w->H * 2, cudaMemcpyHostToDevice));
  EXPECT_CUDA(cudaMemcpy(d->idx, w->idx[me], T * w->K * 8, cudaMemcpyHostToDevice));
  EXPECT_CUDA(cudaMemcpy(d->w, w->w[me], T * w->K * 4, cudaMemcpyHostToDevice));
  EXPECT_CUDA(cudaDeviceSynchronize());
  return TEST_PASS;
}

/* Poison both buffers' receive arrays (payload, scales, sources, counts), then a device barrier
 * so that no peer writes before every rank has poisoned. Call with nothing in flight. */
static int poison(epx_test_rank_t *t, epx_group_t g) {
  const epx__ws_layout_t *l = &g->layout;
  for (int p = 0; p < 2; p++) {
    char *base = g->workspace + l->ll_offset + (size_t)p * l->ll_parity_bytes;
    EXPECT_CUDA(cudaMemset(base + l->ll_x_offset, 0xff, l->ll_stage_offset - l->ll_x_offset));
  }
  EXPECT_CUDA(cudaDeviceSynchronize());
  EXPECT_OK(epx_group_barrier(g, t->stream));
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  return TEST_PASS;
}

/* Every rank meets on the host (NCCL), nothing of EPX in flight afterwards. */
static int host_barrier(epx_test_rank_t *t) {
  int *one = NULL;
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  EXPECT_CUDA(cudaMalloc((void **)&one, sizeof(int)));
  EXPECT_NCCL(ncclAllReduce(one, one, 1, ncclInt32, ncclSum, t->comm, t->stream));
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  EXPECT_CUDA(cudaFree(one));
  return TEST_PASS;
}

/* The GPU's receive arrays against the reference, segment by segment. */
static int check_dispatch(const world_t *w, int me, const epx_ll_dispatch_result_t *res, int fp8,
                          int ue8m0, const char *label) {
  const int L = w->L, R = w->R, M = w->M, H = w->H, G = H / 128;
  const size_t RM = (size_t)R * M;
  ref_recv_t ref;
  if (ref_recv(w, me, fp8, ue8m0, &ref) != TEST_PASS) return TEST_FAIL;
  EXPECT_EQ_INT(res->num_local_experts, L);
  EXPECT_EQ_INT(res->rows_per_expert, (int)RM);
  EXPECT_EQ_INT(res->num_tokens, w->ranks[me].num_tokens);
  int *count = malloc(sizeof(int) * L), *begin = malloc(sizeof(int) * L * R),
      *num = malloc(sizeof(int) * L * R);
  EXPECT_CUDA(cudaMemcpy(count, res->recv_count, sizeof(int) * L, cudaMemcpyDeviceToHost));
  EXPECT_CUDA(cudaMemcpy(begin, res->recv_begin, sizeof(int) * L * R, cudaMemcpyDeviceToHost));
  EXPECT_CUDA(cudaMemcpy(num, res->recv_num, sizeof(int) * L * R, cudaMemcpyDeviceToHost));
  const size_t row_bytes = (size_t)H * (fp8 ? 1 : 2);
  char *rows = malloc((size_t)M * row_bytes + 16);
  float *sc = malloc(sizeof(float) * (size_t)M * G + 4);
  int *info = malloc(sizeof(int) * 4 * (size_t)M + 4);
  int bad = 0;
  for (int j = 0; j < L && !bad; j++) {
    EXPECTF(count[j] == ref.count[j], "%s: recv_count[%d] = %d, reference %d", label, j, count[j],
            ref.count[j]);
    for (int s = 0; s < R && !bad; s++) {
      const int n = num[j * R + s];
      EXPECTF(begin[j * R + s] == s * M, "%s: recv_begin[%d][%d] = %d", label, j, s,
              begin[j * R + s]);
      EXPECTF(n == ref.num[j * R + s], "%s: recv_num[%d][%d] = %d, reference %d", label, j, s, n,
              ref.num[j * R + s]);
      if (n == 0) continue;
      const size_t row0 = (size_t)j * RM + (size_t)s * M;
      EXPECT_CUDA(cudaMemcpy(rows, (const char *)res->recv_x + row0 * row_bytes, n * row_bytes,
                             cudaMemcpyDeviceToHost));
      EXPECT_CUDA(cudaMemcpy(info, res->recv_src_info + row0 * 4, sizeof(int) * 4 * n,
                             cudaMemcpyDeviceToHost));
      if (fp8)
        EXPECT_CUDA(cudaMemcpy(sc, res->recv_x_scales + row0 * G, sizeof(float) * G * n,
                               cudaMemcpyDeviceToHost));
      for (int i = 0; i < n && !bad; i++) {
        const size_t r = row0 + i;
        const void *want = fp8 ? (const void *)(ref.q + r * H) : (const void *)(ref.x + r * H);
        if (info[4 * i] != ref.sr[r] || info[4 * i + 1] != ref.st[r] ||
            info[4 * i + 2] != ref.sk[r] || info[4 * i + 3] != 0) {
          fprintf(stderr,
                  "  %s: expert %d row %zu: src_info (%d,%d,%d,%d), reference (%d,%d,%d,0)\n",
                  label, j, (size_t)s * M + i, info[4 * i], info[4 * i + 1], info[4 * i + 2],
                  info[4 * i + 3], ref.sr[r], ref.st[r], ref.sk[r]);
          bad = 1;
        } else if (memcmp(rows + i * row_bytes, want, row_bytes)) {
          fprintf(stderr, "  %s: expert %d row %zu (source %d token %d): %s payload differs\n",
                  label, j, (size_t)s * M + i, ref.sr[r], ref.st[r], fp8 ? "FP8" : "BF16");
          bad = 1;
        } else if (fp8 && memcmp(sc + (size_t)i * G, ref.sc + r * G, sizeof(float) * G)) {
          fprintf(stderr, "  %s: expert %d row %zu: FP8 scales differ (%g vs %g)\n", label, j,
                  (size_t)s * M + i, sc[(size_t)i * G], ref.sc[r * G]);
          bad = 1;
        }
      }
    }
  }
  free(count), free(begin), free(num), free(rows), free(sc), free(info);
  ref_recv_free(&ref);
  return bad ? TEST_FAIL : TEST_PASS;
}

/* Upload this rank's expert outputs (segment rows) to dst [L, R*M, H] BF16. */
static int upload_outputs(const world_t *w, int me, const int *ref_num, uint16_t *const *y,
                          void *dst) {
  const size_t RM = (size_t)w->R * w->M, H = (size_t)w->H;
  for (int j = 0; j < w->L; j++)
    for (int s = 0; s < w->R; s++) {
      const int n = ref_num[j * w->R + s];
      const size_t row0 = (size_t)j * RM + (size_t)s * w->M;
      if (n > 0)
        EXPECT_CUDA(cudaMemcpy((char *)dst + row0 * H * 2, y[me] + row0 * H, n * H * 2,
                               cudaMemcpyHostToDevice));
    }
  EXPECT_CUDA(cudaDeviceSynchronize());
  return TEST_PASS;
}

/* out (BF16, on the GPU) within BF16 rounding of the float64 reference: |got - ref| <= A/256
 * + 1e-6, A = sum over the token's valid slots of |w| * |y| (covers the rounding of partial sums
 * to BF16 on the expert side and of the result). */
static int check_combine(const world_t *w, int me, const void *out_dev, uint16_t *const *y,
                         const char *label) {
  const int T = w->ranks[me].num_tokens, H = w->H, K = w->K;
  const size_t RM = (size_t)w->R * w->M;
  const float *weights = w->ranks[me].topk_weights;
  double *ref = malloc(sizeof(double) * ((size_t)T * H + 1));
  EXPECT(epx_ref_ll_combine_f64_layout(&w->ref, me, w->M, EPX_REF_LL_FIXED,
                                       (const uint16_t *const *)y, weights, ref) == 0);
  uint16_t *got = malloc((size_t)T * H * 2 + 2);
  EXPECT_CUDA(cudaMemcpy(got, out_dev, (size_t)T * H * 2, cudaMemcpyDeviceToHost));
  double *absum = calloc((size_t)H, sizeof(double));
  int ok = 1;
  for (int t = 0; t < T && ok; t++) {
    memset(absum, 0, sizeof(double) * H);
    for (int k = 0; k < K; k++) {
      const int64_t e = w->ranks[me].topk_idx[(size_t)t * K + k];
      if (e < 0 || e >= w->E) continue;
      const int d = (int)(e / w->L), j = (int)(e % w->L);
      const int row = epx_ref_ll_row(&w->ref, w->M, me, t, (int)e);
      const double wk = weights ? fabs((double)weights[(size_t)t * K + k]) : 1.0;
      const uint16_t *yr = y[d] + ((size_t)j * RM + row) * H;
      for (int c = 0; c < H; c++) absum[c] += wk * fabs((double)epx_ref_bf16_to_float(yr[c]));
    }
    for (int c = 0; c < H && ok; c++) {
      const double g = epx_ref_bf16_to_float(got[(size_t)t * H + c]), r = ref[(size_t)t * H + c];
      if (!(fabs(g - r) <= absum[c] / 256 + 1e-6)) {
        fprintf(stderr, "  %s: combine out[%d][%d] = %.8g, float64 reference %.8g (|w*y| %g)\n",
                label, t, c, g, r, absum[c]);
        ok = 0;
      }
    }
  }
  free(ref), free(got), free(absum);
  return ok ? TEST_PASS : TEST_FAIL;
}

/* One dispatch then one combine of world w, everything checked. split / zero_copy / fp8 as in c.
 * The expert outputs are uploaded to the workspace's combine input (zero copy) or to d->y. */
static int run_cycle(epx_test_rank_t *t, epx_group_t g, const world_t *w, const ll_case_t *c,
                     const ll_dev_t *d, const char *label) {
  const int me = t->rank;
  if (upload(w, me, d) != TEST_PASS) return TEST_FAIL;
  if (poison(t, g) != TEST_PASS) return TEST_FAIL;
  epx_ll_dispatch_args_t a = EPX_LL_DISPATCH_ARGS_INIT;
  a.x = d->x;
  a.topk_idx = d->idx;
  a.topk_weights = c->no_weights ? NULL : (const float *)d->w;
  a.num_tokens = w->ranks[me].num_tokens;
  a.recv_dtype = c->fp8 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16;
  a.ue8m0 = c->ue8m0;
  a.split = c->split;
  epx_ll_dispatch_result_t res;
  EXPECT_OK(epx_ll_dispatch(g, &a, &res, t->stream));
  if (c->split) {
    EXPECT(res.hook.id != 0);
    EXPECT_CUDA(test_spin_ns(200000, t->stream)); /* "other work" between send and receive */
    EXPECT_OK(epx_ll_recv(g, &res.hook, t->stream));
    EXPECT(res.hook.id == 0);
  } else {
    EXPECT(res.hook.id == 0);
  }
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  if (check_dispatch(w, me, &res, c->fp8, c->ue8m0, label) != TEST_PASS) return TEST_FAIL;

  uint16_t *y[EPX_MAX_RANKS];
  if (make_outputs(w, y) != TEST_PASS) return TEST_FAIL;
  ref_recv_t ref;
  if (ref_recv(w, me, 0, 0, &ref) != TEST_PASS) return TEST_FAIL;
  if (upload_outputs(w, me, ref.num, y, c->zero_copy ? res.combine_input : d->y) != TEST_PASS)
    return TEST_FAIL;
  ref_recv_free(&ref);
  EXPECT_CUDA(cudaMemset(d->out, 0xff, (size_t)w->M * w->H * 2)); /* NaN */
  EXPECT_CUDA(cudaDeviceSynchronize());
  epx_ll_combine_args_t ca = EPX_LL_COMBINE_ARGS_INIT;
  ca.x = c->zero_copy ? NULL : d->y;
  ca.dispatch = &res;
  ca.out = d->out;
  ca.split = c->split;
  epx_ll_hook_t hook = {0};
  ca.hook = &hook;
  EXPECT_OK(epx_ll_combine(g, &ca, t->stream));
  if (c->split) {
    EXPECT(hook.id != 0);
    EXPECT_CUDA(test_spin_ns(100000, t->stream));
    EXPECT_OK(epx_ll_recv(g, &hook, t->stream));
  }
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  const int r = check_combine(w, me, d->out, y, label);
  for (int q = 0; q < w->R; q++) free(y[q]);
  return r;
}

static epx_group_config_t ll_config(const world_t *w, int route) {
  epx_group_config_t cfg = gpu_test_config(w->M, w->H, w->E, w->K);
  cfg.modes = EPX_MODE_LOW_LATENCY;
  cfg.ll_route = route;
  return cfg;
}

static const char *route_name(int route) {
  return route == EPX_LL_ROUTE_DIRECT    ? "direct"
         : route == EPX_LL_ROUTE_BY_RANK ? "by-rank"
                                         : "mixed";
}

/* ---------------------------------------------------------------------------------------------
 * Tests.
 * ------------------------------------------------------------------------------------------- */

/*   name                M    H     E    K   routing           T    empty fp8 ue8m0 split zc noW */
static const ll_case_t cases[] = {
    {"random_bf16", 64, 640, 32, 8, ROUTE_UNIFORM, -1, -1, 0, 0, 0, 0, 0},
    {"random_fp8_zero_copy", 64, 640, 32, 8, ROUTE_UNIFORM, -1, -1, 1, 0, 0, 1, 0},
    {"fp8_ue8m0_split", 48, 384, 16, 4, ROUTE_HOLES, -1, -1, 1, 1, 1, 0, 0},
    {"bf16_split_zero_copy_unweighted", 48, 384, 16, 4, ROUTE_UNIFORM, -1, -1, 0, 0, 1, 1, 1},
    {"one_expert", 64, 256, 16, 4, ROUTE_ONE_EXPERT, 64, -1, 1, 0, 0, 0, 0},
    {"all_empty", 64, 256, 16, 4, ROUTE_EMPTY, 64, -1, 0, 0, 0, 1, 0},
    {"one_rank_gets_all", 64, 256, 16, 4, ROUTE_ONE_RANK, 64, -1, 0, 0, 0, 0, 0},
    {"duplicate_experts", 64, 256, 16, 6, ROUTE_DUPLICATES, -1, -1, 1, 0, 0, 0, 0},
    {"empty_rank_split", 64, 256, 16, 4, ROUTE_HOLES, -1, 1, 0, 0, 1, 0, 0},
    {"no_tokens", 32, 128, 8, 2, ROUTE_UNIFORM, 0, -1, 1, 0, 0, 0, 0},
    {"one_token", 32, 1024, 32, 8, ROUTE_UNIFORM, 1, -1, 1, 0, 0, 0, 1},
    {"top16_e64_ue8m0", 32, 256, 64, 16, ROUTE_HOLES, -1, -1, 1, 1, 0, 1, 0},
    {"e_equals_r_top1", 32, 128, 0, 1, ROUTE_UNIFORM, -1, -1, 0, 0, 0, 0, 0},
    {"max_tokens", 128, 2048, 64, 8, ROUTE_UNIFORM, 128, -1, 1, 0, 0, 0, 0},
    {"deepep_shape_fp8", 128, 7168, 256, 8, ROUTE_UNIFORM, 128, -1, 1, 0, 0, 1, 0},
    {"deepep_shape_bf16_split", 128, 7168, 256, 8, ROUTE_UNIFORM, 128, -1, 0, 0, 1, 0, 0},
};

EPX_GPU_TEST(ll_dispatch_combine_cases, 900) {
  for (int route = EPX_LL_ROUTE_DIRECT; route <= EPX_LL_ROUTE_DISPATCH_BY_RANK; route++) {
    uint64_t rng = t->seed; /* the same on every rank: the world is shared */
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
      const ll_case_t *c = &cases[i];
      world_t w;
      world_make(&w, t->num_ranks, c, &rng);
      epx_group_config_t cfg = ll_config(&w, route);
      epx_group_t g = NULL;
      EXPECT_OK(epx_group_create(t->comm, &cfg, &g));
      ll_dev_t d;
      if (dev_alloc(&w, &d) != TEST_PASS) return TEST_FAIL;
      char label[128];
      snprintf(label, sizeof label, "%s (%s)", c->name, route_name(route));
      /* Twice: the second call uses the other buffer and the next epochs. */
      for (int rep = 0; rep < 2; rep++) {
        if (run_cycle(t, g, &w, c, &d, label) != TEST_PASS) {
          fprintf(stderr, "  rank %d: case %s failed (call %d)\n", t->rank, label, rep);
          return TEST_FAIL;
        }
      }
      epx_async_error_t err;
      EXPECT_OK(epx_group_get_async_error(g, &err));
      EXPECTF(err.status == EPX_OK, "%s: async error: %s", label, err.message);
      unsigned mask = 99;
      EXPECT_OK(epx_group_get_peer_mask(g, &mask));
      EXPECT_EQ_INT(mask, 0);
      dev_free(&d);
      world_free(&w);
      EXPECT_OK(epx_group_destroy(g));
    }
  }
  return TEST_PASS;
}

/* Two micro-batches: both dispatches sent before either is received, then both combines. */
EPX_GPU_TEST(ll_split_two_microbatches, 300) {
  const int me = t->rank;
  for (int route = EPX_LL_ROUTE_DIRECT; route <= EPX_LL_ROUTE_DISPATCH_BY_RANK; route++) {
    uint64_t rng = t->seed;
    const ll_case_t c = {"mb", 64, 512, 8 * t->num_ranks, 6, ROUTE_HOLES, -1, -1, 1, 0, 1, 0, 0};
    world_t w[2];
    world_make(&w[0], t->num_ranks, &c, &rng);
    world_make(&w[1], t->num_ranks, &c, &rng);
    epx_group_config_t cfg = ll_config(&w[0], route);
    epx_group_t g = NULL;
    EXPECT_OK(epx_group_create(t->comm, &cfg, &g));
    ll_dev_t d[2];
    for (int m = 0; m < 2; m++) {
      if (dev_alloc(&w[m], &d[m]) != TEST_PASS) return TEST_FAIL;
      if (upload(&w[m], me, &d[m]) != TEST_PASS) return TEST_FAIL;
    }
    if (poison(t, g) != TEST_PASS) return TEST_FAIL;
    epx_ll_dispatch_result_t res[2];
    for (int m = 0; m < 2; m++) {
      epx_ll_dispatch_args_t a = EPX_LL_DISPATCH_ARGS_INIT;
      a.x = d[m].x;
      a.topk_idx = d[m].idx;
      a.topk_weights = (const float *)d[m].w;
      a.num_tokens = w[m].ranks[me].num_tokens;
      a.recv_dtype = EPX_DTYPE_FP8_E4M3;
      a.split = 1;
      EXPECT_OK(epx_ll_dispatch(g, &a, &res[m], t->stream));
      EXPECT(res[m].buffer == m);
    }
    /* A third dispatch would reuse buffer 0, whose receive is pending: refused, nothing sent. */
    {
      epx_ll_dispatch_args_t a = EPX_LL_DISPATCH_ARGS_INIT;
      epx_ll_dispatch_result_t r3;
      EXPECT_STATUS(epx_ll_dispatch(g, &a, &r3, t->stream), EPX_ERR_INVALID_USAGE);
      EXPECT(strstr(epx_last_error(), "epx_ll_recv") != NULL);
      epx_ll_combine_args_t ca = EPX_LL_COMBINE_ARGS_INIT;
      ca.dispatch = &res[0];
      ca.out = d[0].out;
      EXPECT_STATUS(epx_ll_combine(g, &ca, t->stream), EPX_ERR_INVALID_USAGE);
    }
    EXPECT_CUDA(test_spin_ns(300000, t->stream));
    for (int m = 0; m < 2; m++) EXPECT_OK(epx_ll_recv(g, &res[m].hook, t->stream));
    EXPECT_STATUS(epx_ll_recv(g, &res[0].hook, t->stream), EPX_ERR_INVALID_USAGE); /* done */
    EXPECT_CUDA(cudaStreamSynchronize(t->stream));
    uint16_t *y[2][EPX_MAX_RANKS];
    for (int m = 0; m < 2; m++) {
      char label[64];
      snprintf(label, sizeof label, "micro-batch %d (%s)", m, route_name(route));
      if (check_dispatch(&w[m], me, &res[m], 1, 0, label) != TEST_PASS) return TEST_FAIL;
      if (make_outputs(&w[m], y[m]) != TEST_PASS) return TEST_FAIL;
      ref_recv_t ref;
      if (ref_recv(&w[m], me, 0, 0, &ref) != TEST_PASS) return TEST_FAIL;
      if (upload_outputs(&w[m], me, ref.num, y[m], res[m].combine_input) != TEST_PASS)
        return TEST_FAIL;
      ref_recv_free(&ref);
    }
    epx_ll_hook_t hooks[2];
    for (int m = 0; m < 2; m++) {
      epx_ll_combine_args_t ca = EPX_LL_COMBINE_ARGS_INIT;
      ca.dispatch = &res[m];
      ca.out = d[m].out;
      ca.split = 1;
      ca.hook = &hooks[m];
      EXPECT_OK(epx_ll_combine(g, &ca, t->stream));
    }
    EXPECT_CUDA(test_spin_ns(300000, t->stream));
    for (int m = 0; m < 2; m++) EXPECT_OK(epx_ll_recv(g, &hooks[m], t->stream));
    EXPECT_CUDA(cudaStreamSynchronize(t->stream));
    for (int m = 0; m < 2; m++) {
      char label[64];
      snprintf(label, sizeof label, "micro-batch %d combine (%s)", m, route_name(route));
      if (check_combine(&w[m], me, d[m].out, y[m], label) != TEST_PASS) return TEST_FAIL;
      for (int q = 0; q < t->num_ranks; q++) free(y[m][q]);
      dev_free(&d[m]);
      world_free(&w[m]);
    }
    epx_async_error_t err;
    EXPECT_OK(epx_group_get_async_error(g, &err));
    EXPECTF(err.status == EPX_OK, "async error: %s", err.message);
    EXPECT_OK(epx_group_destroy(g));
  }
  return TEST_PASS;
}

/* Fill new routing, weights and payload into w keeping every rank's T (for graph replays). */
static void world_refill(world_t *w, const ll_case_t *c, uint64_t *rng) {
  for (int s = 0; s < w->R; s++) {
    const int T = w->ranks[s].num_tokens;
    for (int t = 0; t < T; t++)
      route_token(w->idx[s] + (size_t)t * w->K, w->K, w->E, w->R, c->route, rng);
    for (size_t i = 0; i < (size_t)T * w->K; i++) w->w[s][i] = epx_test_rand_unit(rng) + 0.01f;
    for (size_t i = 0; i < (size_t)T * w->H; i++)
      w->x[s][i] = epx_ref_bf16_from_float(4.f * epx_test_rand_unit(rng) - 2.f);
  }
}

/* Identity experts: y_d = the BF16 rows d received, so combine sums w * x over valid slots. */
static int identity_outputs(const world_t *w, uint16_t **y) {
  for (int d = 0; d < w->R; d++) {
    ref_recv_t r;
    if (ref_recv(w, d, 0, 0, &r) != TEST_PASS) return TEST_FAIL;
    y[d] = r.x;
    r.x = NULL;
    ref_recv_free(&r);
  }
  return TEST_PASS;
}

/* dispatch (BF16) + combine of the received rows, captured once; before each replay the
 * routing, weights and payload change (same T); every replay is checked. Plain and split. */
EPX_GPU_TEST(ll_graph_replay, 600) {
  const int me = t->rank;
  for (int route = EPX_LL_ROUTE_DIRECT; route <= EPX_LL_ROUTE_DISPATCH_BY_RANK; route++) {
    for (int split = 0; split < 2; split++) {
      uint64_t rng = t->seed + (uint64_t)split;
      const ll_case_t c = {"graph", 64, 512, 8 * t->num_ranks, 4, ROUTE_DUPLICATES, -1, -1, 0, 0,
                           split,   0,  0};
      world_t w;
      world_make(&w, t->num_ranks, &c, &rng);
      epx_group_config_t cfg = ll_config(&w, route);
      epx_group_t g = NULL;
      EXPECT_OK(epx_group_create(t->comm, &cfg, &g));
      ll_dev_t d;
      if (dev_alloc(&w, &d) != TEST_PASS) return TEST_FAIL;
      if (upload(&w, me, &d) != TEST_PASS) return TEST_FAIL;

      cudaGraph_t graph;
      cudaGraphExec_t exec;
      epx_ll_dispatch_result_t res;
      EXPECT_CUDA(cudaStreamBeginCapture(t->stream, cudaStreamCaptureModeThreadLocal));
      epx_ll_dispatch_args_t a = EPX_LL_DISPATCH_ARGS_INIT;
      a.x = d.x;
      a.topk_idx = d.idx;
      a.topk_weights = (const float *)d.w;
      a.num_tokens = w.ranks[me].num_tokens;
      a.split = split;
      EXPECT_OK(epx_ll_dispatch(g, &a, &res, t->stream));
      if (split) EXPECT_OK(epx_ll_recv(g, &res.hook, t->stream));
      epx_ll_combine_args_t ca = EPX_LL_COMBINE_ARGS_INIT;
      ca.x = res.recv_x; /* identity experts, read in place */
      ca.dispatch = &res;
      ca.out = d.out;
      ca.split = split;
      epx_ll_hook_t hook = {0};
      ca.hook = &hook;
      EXPECT_OK(epx_ll_combine(g, &ca, t->stream));
      if (split) EXPECT_OK(epx_ll_recv(g, &hook, t->stream));
      EXPECT_CUDA(cudaStreamEndCapture(t->stream, &graph));
      EXPECT_CUDA(cudaGraphInstantiate(&exec, graph, 0));

      for (int replay = 0; replay < 40; replay++) {
        if (replay > 0) {
          world_refill(&w, &c, &rng);
          if (upload(&w, me, &d) != TEST_PASS) return TEST_FAIL;
        }
        EXPECT_CUDA(cudaMemset(d.out, 0xff, (size_t)w.M * w.H * 2));
        EXPECT_CUDA(cudaDeviceSynchronize());
        EXPECT_CUDA(cudaGraphLaunch(exec, t->stream));
        EXPECT_CUDA(cudaStreamSynchronize(t->stream));
        char label[96];
        snprintf(label, sizeof label, "replay %d (%s%s)", replay, route_name(route),
                 split ? ", split" : "");
        if (check_dispatch(&w, me, &res, 0, 0, label) != TEST_PASS) return TEST_FAIL;
        uint16_t *y[EPX_MAX_RANKS];
        if (identity_outputs(&w, y) != TEST_PASS) return TEST_FAIL;
        if (check_combine(&w, me, d.out, y, label) != TEST_PASS) return TEST_FAIL;
        for (int q = 0; q < w.R; q++) free(y[q]);
        /* The graph always uses the same buffer: no rank may start the next replay while a
         * peer still reads this one's rows on the host. */
        if (host_barrier(t) != TEST_PASS) return TEST_FAIL;
      }
      epx_async_error_t err;
      EXPECT_OK(epx_group_get_async_error(g, &err));
      EXPECTF(err.status == EPX_OK, "async error: %s", err.message);
      EXPECT_CUDA(cudaGraphExecDestroy(exec));
      EXPECT_CUDA(cudaGraphDestroy(graph));
      dev_free(&d);
      world_free(&w);
      EXPECT_OK(epx_group_destroy(g));
    }
  }
  return TEST_PASS;
}

/* 10,000 iterations: dispatch then combine, new T (0..max per rank), routing and dtype each
 * time, on one group; both outputs checked every iteration. */
EPX_GPU_TEST(ll_loop_10000, 900) {
  const int me = t->rank, R = t->num_ranks;
  uint64_t rng = t->seed;
  const int M = 16, H = 128, E = 4 * R, K = 4;
  epx_group_config_t cfg = gpu_test_config(M, H, E, K);
  cfg.modes = EPX_MODE_LOW_LATENCY;
  epx_group_t g = NULL;
  EXPECT_OK(epx_group_create(t->comm, &cfg, &g));
  epx_group_config_t got;
  EXPECT_OK(epx_group_get_config(g, &got));
  printf("  rank %d: route %s, %d blocks\n", me, route_name(got.ll_route), got.ll_num_sms);
  const route_t routes[] = {ROUTE_UNIFORM, ROUTE_HOLES, ROUTE_DUPLICATES, ROUTE_ONE_RANK,
                            ROUTE_ONE_EXPERT};
  ll_dev_t d;
  {
    const ll_case_t c0 = {"loop", M, H, E, K, ROUTE_UNIFORM, 0, -1, 0, 0, 0, 0, 0};
    world_t w0;
    world_make(&w0, R, &c0, &rng);
    if (dev_alloc(&w0, &d) != TEST_PASS) return TEST_FAIL;
    world_free(&w0);
  }
  for (int it = 0; it < 10000; it++) {
    ll_case_t c = {"loop", M, H, E, K, routes[it % 5], -1, -1, 0, 0, 0, 0, 0};
    c.empty_rank = it % 9 == 4 ? it % R : -1;
    c.fp8 = it % 2;
    c.ue8m0 = it % 4 == 1;
    c.split = it % 3 == 2;
    c.zero_copy = it % 5 == 3;
    c.no_weights = it % 7 == 6;
    world_t w;
    world_make(&w, R, &c, &rng);
    char label[64];
    snprintf(label, sizeof label, "iteration %d", it);
    if (run_cycle(t, g, &w, &c, &d, label) != TEST_PASS) {
      fprintf(stderr, "  rank %d: %s failed\n", me, label);
      return TEST_FAIL;
    }
    world_free(&w);
  }
  epx_async_error_t err;
  EXPECT_OK(epx_group_get_async_error(g, &err));
  EXPECTF(err.status == EPX_OK, "async error: %s", err.message);
  dev_free(&d);
  EXPECT_OK(epx_group_destroy(g));
  return TEST_PASS;
}

typedef struct {
  const char *name;
  epx_ll_dispatch_args_t args;
  const char *must_name; /* the message must contain this */
} bad_args_t;

/* Bad arguments are refused with a named error before anything is sent; the group still works
 * (a checked dispatch + combine follows). */
EPX_GPU_TEST(ll_refuses_bad_arguments, 300) {
  const int me = t->rank, R = t->num_ranks;
  uint64_t rng = t->seed;
  const ll_case_t c = {"args", 32, 256, 4 * R, 2, ROUTE_UNIFORM, 32, -1, 0, 0, 0, 0, 0};
  world_t w;
  world_make(&w, R, &c, &rng);
  epx_group_config_t cfg = ll_config(&w, EPX_LL_ROUTE_AUTO);
  cfg.dtypes = EPX_DTYPE_BF16;
  epx_group_t g = NULL, normal = NULL;
  EXPECT_OK(epx_group_create(t->comm, &cfg, &g));
  epx_group_config_t ncfg = gpu_test_config(32, 256, 4 * R, 2);
  EXPECT_OK(epx_group_create(t->comm, &ncfg, &normal));
  ll_dev_t d;
  if (dev_alloc(&w, &d) != TEST_PASS) return TEST_FAIL;
  if (upload(&w, me, &d) != TEST_PASS) return TEST_FAIL;
  epx_ll_dispatch_args_t a = EPX_LL_DISPATCH_ARGS_INIT;
  a.x = d.x;
  a.topk_idx = d.idx;
  a.topk_weights = (const float *)d.w;
  a.num_tokens = 32;
  epx_ll_dispatch_result_t res;
  bad_args_t bad[16];
  int nb = 0;
#define BAD(label, field, value, name)      \
  do {                                      \
    bad[nb] = (bad_args_t){label, a, name}; \
    bad[nb++].args.field = value;           \
  } while (0)
  BAD("bad size", size, 3, "size");
  BAD("too many tokens", num_tokens, 33, "num_tokens");
  BAD("negative tokens", num_tokens, -1, "num_tokens");
  BAD("bad idx dtype", topk_idx_dtype, EPX_DTYPE_BF16, "topk_idx_dtype");
  BAD("bad recv dtype", recv_dtype, EPX_DTYPE_INT32, "recv_dtype");
  BAD("fp8 on a bf16 group", recv_dtype, EPX_DTYPE_FP8_E4M3, "recv_dtype");
  BAD("ue8m0 with bf16", ue8m0, 1, "ue8m0");
  BAD("bad split", split, 2, "split");
  BAD("null x", x, NULL, "x");
  BAD("misaligned x", x, (char *)d.x + 8, "aligned");
  BAD("host topk_idx", topk_idx, w.idx[me], "topk_idx");
  BAD("misaligned weights", topk_weights, (const float *)((char *)d.w + 2), "topk_weights");
#undef BAD
  for (int i = 0; i < nb; i++) {
    const epx_status_t s = epx_ll_dispatch(g, &bad[i].args, &res, t->stream);
    EXPECTF(s == EPX_ERR_INVALID_ARGUMENT, "%s: got %s", bad[i].name, epx_status_string(s));
    EXPECTF(strstr(epx_last_error(), bad[i].must_name) != NULL, "%s: message '%s' does not name %s",
            bad[i].name, epx_last_error(), bad[i].must_name);
  }
  EXPECT_STATUS(epx_ll_dispatch(g, NULL, &res, t->stream), EPX_ERR_INVALID_ARGUMENT);
  EXPECT_STATUS(epx_ll_dispatch(g, &a, NULL, t->stream), EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "result") != NULL);
  EXPECT_STATUS(epx_ll_dispatch(NULL, &a, &res, t->stream), EPX_ERR_INVALID_ARGUMENT);
  EXPECT_STATUS(epx_ll_dispatch(normal, &a, &res, t->stream), EPX_ERR_INVALID_USAGE);
  EXPECT(strstr(epx_last_error(), "EPX_MODE_LOW_LATENCY") != NULL);
  unsigned mask = 7;
  EXPECT_STATUS(epx_group_get_peer_mask(g, NULL), EPX_ERR_INVALID_ARGUMENT);
  EXPECT_OK(epx_group_get_peer_mask(normal, &mask));
  EXPECT_EQ_INT(mask, 0);
  epx_ll_hook_t hook = {12345};
  EXPECT_STATUS(epx_ll_recv(g, &hook, t->stream), EPX_ERR_INVALID_USAGE);
  EXPECT_STATUS(epx_ll_recv(g, NULL, t->stream), EPX_ERR_INVALID_ARGUMENT);
  epx_ll_combine_args_t ca = EPX_LL_COMBINE_ARGS_INIT;
  ca.out = d.out;
  EXPECT_STATUS(epx_ll_combine(g, &ca, t->stream), EPX_ERR_INVALID_ARGUMENT); /* no dispatch */
  EXPECT(strstr(epx_last_error(), "dispatch") != NULL);
  EXPECT_STATUS(epx_ll_combine(g, NULL, t->stream), EPX_ERR_INVALID_ARGUMENT);
  epx_ll_dispatch_result_t never;
  memset(&never, 0, sizeof never);
  ca.dispatch = &never;
  EXPECT_STATUS(epx_ll_combine(g, &ca, t->stream), EPX_ERR_INVALID_USAGE); /* never dispatched */

  /* The group still works: a full, checked cycle. */
  if (run_cycle(t, g, &w, &c, &d, "after bad arguments") != TEST_PASS) return TEST_FAIL;

  /* Combine argument checks against a real dispatch. */
  EXPECT_OK(epx_ll_dispatch(g, &a, &res, t->stream));
  ca.dispatch = &res;
  ca.out = NULL;
  EXPECT_STATUS(epx_ll_combine(g, &ca, t->stream), EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "out") != NULL);
  ca.out = d.out;
  ca.x = (char *)d.y + 4;
  EXPECT_STATUS(epx_ll_combine(g, &ca, t->stream), EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "x") != NULL);
  ca.x = NULL;
  ca.split = 1;
  ca.hook = NULL;
  EXPECT_STATUS(epx_ll_combine(g, &ca, t->stream), EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "hook") != NULL);
  ca.split = 0;
  /* Two more dispatches reuse res's buffer: combining it then is refused. */
  epx_ll_dispatch_result_t r2, r3;
  EXPECT_OK(epx_ll_combine(g, &ca, t->stream));
  EXPECT_OK(epx_ll_dispatch(g, &a, &r2, t->stream));
  ca.dispatch = &r2;
  EXPECT_OK(epx_ll_combine(g, &ca, t->stream));
  EXPECT_OK(epx_ll_dispatch(g, &a, &r3, t->stream));
  ca.dispatch = &res;
  EXPECT_STATUS(epx_ll_combine(g, &ca, t->stream), EPX_ERR_INVALID_USAGE);
  EXPECT(strstr(epx_last_error(), "reused") != NULL);
  ca.dispatch = &r3;
  EXPECT_OK(epx_ll_combine(g, &ca, t->stream));
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  epx_async_error_t err;
  EXPECT_OK(epx_group_get_async_error(g, &err));
  EXPECTF(err.status == EPX_OK, "async error: %s", err.message);
  dev_free(&d);
  world_free(&w);
  EXPECT_OK(epx_group_destroy(normal));
  EXPECT_OK(epx_group_destroy(g));
  EXPECT_STATUS(epx_ll_dispatch(g, &a, &res, t->stream), EPX_ERR_INVALID_USAGE); /* destroyed */
  return TEST_PASS;
}

/* Ids outside [-1, E) are reported asynchronously (the lowest flat position of this rank) and
 * treated as empty slots: both outputs match the reference, which treats them the same way. */
EPX_GPU_TEST(ll_bad_expert_ids, 300) {
  const int me = t->rank;
  for (int route = EPX_LL_ROUTE_DIRECT; route <= EPX_LL_ROUTE_DISPATCH_BY_RANK; route++) {
    uint64_t rng = t->seed;
    const ll_case_t c = {"bad_ids", 64, 256, 8 * t->num_ranks, 8, ROUTE_BAD, 64, -1, 1, 0, 0, 0, 0};
    world_t w;
    world_make(&w, t->num_ranks, &c, &rng);
    epx_group_config_t cfg = ll_config(&w, route);
    epx_group_t g = NULL;
    EXPECT_OK(epx_group_create(t->comm, &cfg, &g));
    ll_dev_t d;
    if (dev_alloc(&w, &d) != TEST_PASS) return TEST_FAIL;
    if (run_cycle(t, g, &w, &c, &d, route_name(route)) != TEST_PASS) return TEST_FAIL;
    long long first = -1;
    for (long long i = 0; i < (long long)w.ranks[me].num_tokens * w.K && first < 0; i++)
      if (w.idx[me][i] < -1 || w.idx[me][i] >= w.E) first = i;
    epx_async_error_t err;
    EXPECT_OK(epx_group_get_async_error(g, &err));
    if (first < 0) {
      EXPECTF(err.status == EPX_OK, "no bad id here, but: %s", err.message);
    } else {
      printf("  rank %d (%s): %s\n", me, route_name(route), err.message);
      EXPECT_EQ_INT(err.status, EPX_ERR_INVALID_ARGUMENT);
      EXPECT_EQ_INT(err.stage, EPX_STAGE_LL_DISPATCH);
      EXPECT_EQ_INT(err.position, first);
      EXPECT_EQ_INT(err.value, w.idx[me][first]);
    }
    dev_free(&d);
    world_free(&w);
    EXPECT_OK(epx_group_destroy(g));
  }
  return TEST_PASS;
}

static double wall_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* The last rank stops answering after 3 iterations. The others: the first call without it
 * returns within the budget + 1 s with PEER_FAILED naming it and the mask set; the next calls
 * take no time waiting; every result equals the reference without the dead rank. Then every
 * rank (the dead one back) clears the mask, and full calls work again. */
EPX_GPU_TEST(ll_peer_masking, 300) {
  const int me = t->rank, R = t->num_ranks, dead = R - 1;
  const int budget_ms = 1000;
  for (int route = EPX_LL_ROUTE_DIRECT; route <= EPX_LL_ROUTE_DISPATCH_BY_RANK; route++) {
    uint64_t rng = t->seed;
    const ll_case_t c = {"mask", 32, 256, 4 * R, 4, ROUTE_HOLES, -1, -1, 1, 0, 0, 1, 0};
    world_t w;
    world_make(&w, R, &c, &rng);
    epx_group_config_t cfg = ll_config(&w, route);
    cfg.timeout_ms = budget_ms;
    epx_group_t g = NULL;
    EXPECT_OK(epx_group_create(t->comm, &cfg, &g));
    ll_dev_t d;
    if (dev_alloc(&w, &d) != TEST_PASS) return TEST_FAIL;
    for (int it = 0; it < 9; it++) {
      char label[96];
      snprintf(label, sizeof label, "%s iteration %d", route_name(route), it);
      world_free(&w);
      world_make(&w, R, &c, &rng);
      if (it < 3 || it >= 6) {
        if (run_cycle(t, g, &w, &c, &d, label) != TEST_PASS) return TEST_FAIL;
      } else if (me != dead) {
        /* The dead rank is silent: no poison/barrier here (it would wait for it). */
        world_t live;
        world_without(&w, dead, &live);
        if (upload(&w, me, &d) != TEST_PASS) return TEST_FAIL;
        const double t0 = wall_s();
        epx_ll_dispatch_args_t a = EPX_LL_DISPATCH_ARGS_INIT;
        a.x = d.x;
        a.topk_idx = d.idx; /* the real ids, experts of the dead rank included */
        a.topk_weights = (const float *)d.w;
        a.num_tokens = w.ranks[me].num_tokens;
        a.recv_dtype = EPX_DTYPE_FP8_E4M3;
        epx_ll_dispatch_result_t res;
        EXPECT_OK(epx_ll_dispatch(g, &a, &res, t->stream));
        EXPECT_CUDA(cudaStreamSynchronize(t->stream));
        if (check_dispatch(&live, me, &res, 1, 0, label) != TEST_PASS) return TEST_FAIL;
        uint16_t *y[EPX_MAX_RANKS];
        if (make_outputs(&live, y) != TEST_PASS) return TEST_FAIL;
        ref_recv_t ref;
        if (ref_recv(&live, me, 0, 0, &ref) != TEST_PASS) return TEST_FAIL;
        if (upload_outputs(&live, me, ref.num, y, d.y) != TEST_PASS) return TEST_FAIL;
        ref_recv_free(&ref);
        const double t1 = wall_s();
        epx_ll_combine_args_t ca = EPX_LL_COMBINE_ARGS_INIT;
        ca.x = d.y;
        ca.dispatch = &res;
        ca.out = d.out;
        EXPECT_OK(epx_ll_combine(g, &ca, t->stream));
        EXPECT_CUDA(cudaStreamSynchronize(t->stream));
        const double t2 = wall_s();
        if (check_combine(&live, me, d.out, y, label) != TEST_PASS) return TEST_FAIL;
        for (int q = 0; q < R; q++) free(y[q]);
        world_without_free(&live);
        printf("  rank %d: %s: dispatch %.3f s, combine %.3f s\n", me, label, t1 - t0, t2 - t1);
        if (it == 3) {
          EXPECTF(t2 - t0 < budget_ms * 1e-3 + 1.0, "%s: %.3f s with a %d ms budget", label,
                  t2 - t0, budget_ms);
          epx_async_error_t err;
          EXPECT_OK(epx_group_get_async_error(g, &err));
          printf("  rank %d: %s\n", me, err.message);
          EXPECT_EQ_INT(err.status, EPX_ERR_PEER_FAILED);
          EXPECT_EQ_INT(err.peer, dead);
          EXPECT(err.stage == EPX_STAGE_LL_DISPATCH || err.stage == EPX_STAGE_LL_COMBINE);
          unsigned mask = 0;
          EXPECT_OK(epx_group_get_peer_mask(g, &mask));
          EXPECT_EQ_INT(mask, 1u << dead);
        } else {
          /* Masked: nobody waits for the dead rank any more. */
          EXPECTF(t2 - t0 < budget_ms * 1e-3 / 2, "%s: %.3f s although the peer is masked", label,
                  t2 - t0);
        }
      }
      if (it == 5) {
        /* Recovery: every rank, the dead one included, meets in the collective clear. */
        EXPECT_OK(epx_group_clear_peer_mask(g));
        EXPECT_OK(epx_group_clear_async_error(g));
        unsigned mask = 99;
        EXPECT_OK(epx_group_get_peer_mask(g, &mask));
        EXPECT_EQ_INT(mask, 0);
      }
    }
    epx_async_error_t err;
    EXPECT_OK(epx_group_get_async_error(g, &err));
    EXPECTF(err.status == EPX_OK, "after recovery: %s", err.message);
    if (host_barrier(t) != TEST_PASS) return TEST_FAIL;
    dev_free(&d);
    world_free(&w);
    EXPECT_OK(epx_group_destroy(g));
  }
  return TEST_PASS;
}

/* One traced dispatch + combine per route: the results are an untraced run's, and every rank
 * recorded one span of each low-latency stage per block. */
EPX_GPU_TEST(ll_traced_cycle, 300) {
  if (!EPX_TRACE_COMPILED) return TEST_SKIP; /* a TRACE=0 build */
  static const char *const stages[] = {"ll dispatch send", "ll dispatch wait", "ll dispatch recv",
                                       "ll combine send",  "ll combine wait",  "ll combine reduce"};
  for (int route = EPX_LL_ROUTE_DIRECT; route <= EPX_LL_ROUTE_DISPATCH_BY_RANK; route++) {
    uint64_t rng = t->seed;
    const ll_case_t *c = &cases[0];
    world_t w;
    world_make(&w, t->num_ranks, c, &rng);
    epx_group_config_t cfg = ll_config(&w, route);
    epx_group_t g = NULL;
    EXPECT_OK(epx_group_create(t->comm, &cfg, &g));
    epx_group_config_t resolved;
    EXPECT_OK(epx_group_get_config(g, &resolved));
    ll_dev_t d;
    if (dev_alloc(&w, &d) != TEST_PASS) return TEST_FAIL;
    char label[64], path[128];
    snprintf(label, sizeof label, "traced %s", route_name(route));
    snprintf(path, sizeof path, "/tmp/epx_test_ll_trace_%d_%d.json", (int)getppid(), route);
    EXPECT_OK(epx_trace_start(g, 0, t->stream));
    if (run_cycle(t, g, &w, c, &d, label) != TEST_PASS) return TEST_FAIL;
    epx_trace_summary_t sum;
    EXPECT_OK(epx_trace_dump(g, path, &sum, t->stream));
    EXPECT_EQ_INT(sum.num_dropped, 0);
    if (t->rank == 0) {
      char why[512];
      json_value_t *root = json_parse_file(path, why, sizeof why);
      EXPECTF(root != NULL, "%s: %s", path, why);
      trace_facts_t facts;
      EXPECTF(trace_check(root, &facts, why, sizeof why) == 0, "%s: %s", path, why);
      for (int q = 0; q < t->num_ranks; q++)
        for (size_t i = 0; i < sizeof stages / sizeof stages[0]; i++)
          EXPECTF(trace_count_spans(root, q, stages[i]) == resolved.ll_num_sms,
                  "%s: rank %d has %lld '%s' spans, expected one per block (%d)", label, q,
                  trace_count_spans(root, q, stages[i]), stages[i], resolved.ll_num_sms);
      json_free(root);
      unlink(path);
    }
    dev_free(&d);
    world_free(&w);
    EXPECT_OK(epx_group_destroy(g));
  }
  return TEST_PASS;
}

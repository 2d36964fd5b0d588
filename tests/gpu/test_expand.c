/*
 * test_expand.c - normal mode's expert-major layout (epx_dispatch_expand, epx_combine_expand)
 * against its oracle, tests/ref/epx_ref_expand.h, at every rank count of --ranks.
 *
 * Every rank draws the whole world from the test seed (world.h, WORLD_NORMAL), so each can
 * compute what it must receive (epx_ref_dispatch_expand) and what combine must return
 * (epx_ref_combine_expand, which needs every rank's expert outputs: they are a pure function of
 * (rank, row, channel), expert_output below).
 *
 *   test                        what
 *   expand_cases                rows bit for bit (payload BF16 or FP8 + scales: float32
 *                               contiguous or column-major, or packed UE8M0; source rank,
 *                               token, slot, weight), padding rows (-1, weight 0), segment
 *                               begins and counts (device and host), num_rows, each received
 *                               token's row list; combine weighted and unweighted bit for bit;
 *                               random and adversarial routings (table below), alignments
 *                               0, 1, 4, 128 drawn per case; the arrival signals
 *                               (expert_ready): a consumer on another stream, ordered as
 *                               epx.h says, sums each expert's rows at its signal, and the
 *                               sums must equal those of the final rows (every expand call of
 *                               these tests)
 *   expand_loop                 one group, new worlds of random sizes: expand and plain
 *                               dispatches and combines interleaved (epochs, combine parity)
 *   expand_refuses_bad_arguments  named errors, nothing sent, the group still works
 *   expand_capacity_exceeded    expand_max_rows too small: EPX_ERR_INVALID_ARGUMENT (sync
 *                               counts) and an async INVALID_ARGUMENT, no row past the capacity
 *   expand_during_after_peer_killed  DURING, the last rank killed after a good call: the
 *                               next call times out within about a budget, naming the peer
 *   expand_two_absent_ranks_cost_one_budget  (4 ranks or more) two ranks skip a call: the
 *                               others' count exchange fails within one budget, not two
 *   expand_too_many_tokens_fails_every_rank  one rank over max_tokens_per_rank: it gets
 *                               INVALID_ARGUMENT, the others TIMEOUT naming it at once; then
 *                               the group works (both fan-out modes)
 * expand_cases, expand_loop and expand_capacity_exceeded run with both fan-out modes
 * (config.expand_fan_out AFTER and DURING). `epx_test --filter expand` runs them; passed on
 * 4x H200 at 2 and 4 ranks with both modes (b7d616d, docs/results/b7d616d-4xH200-expand-during-
 * default-blocks.txt; and in the whole suite at 1d8e399; before DURING existed, at 7e1d87d).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/normal_checks.h"
#include "ref/epx_ref_expand.h"

typedef struct {
  const char *name;
  world_spec_t world;
  int fp8;
  int no_weights; /* dispatch without topk_weights: every row's weight is 0 */
} expand_case_t;

/* The largest alignment the cases draw. */
#define MAX_ALIGN 128

/* Rows a world of this shape can need on one rank: every token of every source to min(K, L)
 * local experts, plus the padding. */
static int worst_rows(int R, int M, int E, int K) {
  const int L = E / R;
  return R * M * (K < L ? K : L) + L * (MAX_ALIGN - 1);
}

/* A normal-mode group of this shape with rows expert-major rows (worst_rows when 0) and the
 * fan-out mode, and its handle; timeout_ms 0: the tests' default. */
static int expand_group_make(epx_test_rank_t *t, int M, int H, int E, int K, int rows, int fan_out,
                             int timeout_ms, epx_group_t *g, epx_handle_t *h) {
  epx_group_config_t cfg = gpu_test_config(M, H, E, K);
  cfg.modes = EPX_MODE_NORMAL;
  cfg.expand_max_rows = rows ? rows : worst_rows(t->num_ranks, M, E, K);
  cfg.expand_fan_out = fan_out;
  if (timeout_ms) cfg.timeout_ms = timeout_ms;
  *g = NULL, *h = NULL;
  EXPECT_OK(epx_group_create(t->comm, &cfg, g));
  EXPECT_OK(epx_handle_create(*g, h));
  return TEST_PASS;
}

/* Expert output of rank d, row i, channel c: BF16 of a value in [-2, 2), from (d, i, c) alone. */
static uint16_t expert_output(int d, int i, int c) {
  uint64_t s = ((uint64_t)d << 56) ^ ((uint64_t)i << 20) ^ (uint64_t)c;
  return epx_ref_bf16_from_float(4.f * epx_test_rand_unit(&s) - 2.f);
}

/* y[d] = rank d's expert outputs for its rows (padding rows NaN: they must not be read). */
static int make_outputs(const world_t *w, int align, uint16_t **y, int *rows) {
  for (int d = 0; d < w->R; d++) {
    epx_ref_expand_t e;
    EXPECT(epx_ref_dispatch_expand(&w->ref, d, EPX_REF_PAYLOAD_NONE, align, &e) == 0);
    rows[d] = e.num_rows;
    y[d] = malloc(sizeof(uint16_t) * ((size_t)e.num_rows * w->H + 1));
    EXPECT(y[d] != NULL);
    for (int i = 0; i < e.num_rows; i++)
      for (int c = 0; c < w->H; c++)
        y[d][(size_t)i * w->H + c] = e.src_rank[i] < 0 ? 0xFFFF : expert_output(d, i, c);
    epx_ref_expand_free(&e);
  }
  return TEST_PASS;
}

/* Copy n elements of `bytes` each from the device. */
static void *fetch(const void *dev, size_t n, size_t bytes) {
  void *h = malloc(n * bytes + 1);
  if (!h) {
    fprintf(stderr, "  fetch: malloc of %zu bytes failed\n", n * bytes + 1);
    return NULL;
  }
  const cudaError_t e = n ? cudaMemcpy(h, dev, n * bytes, cudaMemcpyDeviceToHost) : cudaSuccess;
  if (e != cudaSuccess) {
    fprintf(stderr, "  fetch: %zu x %zu bytes from %p: %s\n", n, bytes, dev, cudaGetErrorString(e));
    free(h);
    return NULL;
  }
  return h;
}

/* Every received token's row list, from the oracle: its rows ascending, then -1. Plain order
 * (source rank, then token) as epx_ref_dispatch's. */
static int check_token_rows(const world_t *w, int me, const epx_ref_expand_t *ref,
                            const epx_dispatch_expand_result_t *res, const char *label) {
  const int K = w->K;
  epx_ref_recv_t r;
  EXPECT(epx_ref_dispatch(&w->ref, me, EPX_REF_PAYLOAD_NONE, 1, &r) == 0);
  EXPECT_EQ_INT(res->num_recv, r.num_recv);
  int *want = malloc(sizeof(int) * ((size_t)r.num_recv * K + 1));
  int *fill = calloc((size_t)r.num_recv + 1, sizeof(int));
  int *first = malloc(sizeof(int) * (EPX_MAX_RANKS + 1)); /* plain row of (s, 0) */
  EXPECT(want && fill && first);
  for (size_t i = 0; i < (size_t)r.num_recv * K; i++) want[i] = -1;
  for (int s = 0; s <= w->R; s++) first[s] = r.rank_prefix[s];
  for (int row = 0; row < ref->num_rows; row++) {
    if (ref->src_rank[row] < 0) continue;
    /* The plain row of (src_rank, src_token): tokens of a source are ascending there. */
    int i = -1;
    for (int p = first[ref->src_rank[row]]; p < first[ref->src_rank[row] + 1]; p++)
      if (r.src_token[p] == ref->src_token[row]) i = p;
    EXPECTF(i >= 0, "%s: row %d's token is not received", label, row);
    want[(size_t)i * K + fill[i]++] = row;
  }
  int *got = fetch(res->token_rows, (size_t)r.num_recv * K, sizeof(int));
  EXPECT(got != NULL);
  for (size_t i = 0; i < (size_t)r.num_recv * K; i++)
    EXPECTF(got[i] == want[i], "%s: token_rows[%zu][%zu] = %d, want %d", label, i / K, i % K,
            got[i], want[i]);
  free(got), free(want), free(fill), free(first);
  epx_ref_recv_free(&r);
  return TEST_PASS;
}

/* What the GPU received vs the oracle, field by field; the first mismatch is printed. */
static int check_expand_recv(const world_t *w, int me, const epx_dispatch_expand_result_t *res,
                             int fp8, int align, const int *host_counts, int counts_synced,
                             const char *label) {
  const int H = w->H, G = H / 128, L = w->L;
  epx_ref_expand_t ref;
  EXPECT(epx_ref_dispatch_expand(&w->ref, me, fp8 ? EPX_REF_PAYLOAD_FP8 : EPX_REF_PAYLOAD_BF16,
                                 align, &ref) == 0);
  const int n = ref.num_rows;
  if (counts_synced) {
    EXPECTF(res->num_rows == n, "%s: num_rows %d, want %d", label, res->num_rows, n);
    for (int j = 0; j < L; j++)
      EXPECTF(host_counts[j] == ref.count[j], "%s: host count[%d] = %d, want %d", label, j,
              host_counts[j], ref.count[j]);
  }
  int dev_rows = -1;
  EXPECT_CUDA(cudaMemcpy(&dev_rows, res->num_rows_device, sizeof(int), cudaMemcpyDeviceToHost));
  EXPECT_EQ_INT(dev_rows, n);
  int *begin = fetch(res->expert_begin_device, (size_t)L + 1, sizeof(int));
  int *count = fetch(res->expert_count_device, (size_t)L, sizeof(int));
  EXPECT(begin && count);
  for (int j = 0; j <= L; j++)
    EXPECTF(begin[j] == ref.begin[j], "%s: begin[%d] = %d, want %d", label, j, begin[j],
            ref.begin[j]);
  for (int j = 0; j < L; j++)
    EXPECTF(count[j] == ref.count[j], "%s: count[%d] = %d, want %d", label, j, count[j],
            ref.count[j]);
  int *info = fetch(res->recv_src_info, (size_t)n * 4, sizeof(int));
  float *weight = fetch(res->recv_weights, (size_t)n, sizeof(float));
  uint8_t *x = fetch(res->recv_x, (size_t)n * H, fp8 ? 1 : 2);
  /* fp8 3: the sender's scales were packed UE8M0 words, delivered as such (cols words a row) */
  const int packed = fp8 == 3, cols = packed ? (G + 3) / 4 : G;
  float *sc = fp8 ? fetch(packed ? (void *)res->recv_x_scales_packed : (void *)res->recv_x_scales,
                          (size_t)n * cols, sizeof(float))
                  : NULL;
  EXPECT(info && weight && x && (!fp8 || sc));
  for (int i = 0; i < n; i++) {
    const int *g = info + (size_t)i * 4;
    EXPECTF(g[0] == ref.src_rank[i] && g[1] == ref.src_token[i] && g[2] == ref.src_slot[i],
            "%s: row %d from (%d, %d, slot %d), want (%d, %d, slot %d)", label, i, g[0], g[1], g[2],
            ref.src_rank[i], ref.src_token[i], ref.src_slot[i]);
    EXPECTF(memcmp(&weight[i], &ref.weight[i], sizeof(float)) == 0,
            "%s: row %d weight %.9g, want %.9g", label, i, weight[i], ref.weight[i]);
    if (ref.src_rank[i] < 0) continue; /* padding payload is not written */
    if (fp8) {
      EXPECTF(memcmp(x + (size_t)i * H, ref.x_fp8 + (size_t)i * H, (size_t)H) == 0,
              "%s: row %d FP8 payload differs", label, i);
      int32_t want_words[EPX_MAX_HIDDEN / 128];
      if (packed) epx_ref_ue8m0_pack(ref.x_scales + (size_t)i * G, 1, G, want_words);
      const void *want =
          packed ? (const void *)want_words : (const void *)(ref.x_scales + (size_t)i * G);
      EXPECTF(memcmp(sc + (size_t)i * cols, want, sizeof(float) * cols) == 0,
              "%s: row %d scales differ", label, i);
    } else {
      EXPECTF(memcmp(x + (size_t)i * H * 2, ref.x + (size_t)i * H, (size_t)H * 2) == 0,
              "%s: row %d BF16 payload differs", label, i);
    }
  }
  free(begin), free(count), free(info), free(weight), free(x), free(sc);
  const int res_rows = check_token_rows(w, me, &ref, res, label);
  epx_ref_expand_free(&ref);
  return res_rows;
}

/* Combine the expert outputs (expert_output) weighted and unweighted into a poisoned out: bit for
 * bit the oracle's. */
static int combine_and_check(epx_test_rank_t *t, epx_group_t g, epx_handle_t h, const world_t *w,
                             const world_dev_t *d, int align, const char *label) {
  const int R = w->R, me = t->rank, T = w->ranks[me].num_tokens, H = w->H;
  uint16_t *y[EPX_MAX_RANKS] = {0};
  int rows[EPX_MAX_RANKS] = {0};
  if (make_outputs(w, align, y, rows) != TEST_PASS) return TEST_FAIL;
  EXPECT_CUDA(cudaMemcpy(d->y, y[me], (size_t)rows[me] * H * 2, cudaMemcpyHostToDevice));
  uint16_t *want = malloc(sizeof(uint16_t) * ((size_t)T * H + 1));
  uint16_t *got = malloc(sizeof(uint16_t) * ((size_t)T * H + 1));
  EXPECT(want && got);
  for (int weighted = 1; weighted >= 0; weighted--) {
    /* The CPU oracles between collective calls take seconds at DeepSeek's size, more on a rank
     * with more rows: meet first, or an early rank's waits run out on a late one. */
    if (gpu_host_barrier(t) != TEST_PASS) return TEST_FAIL;
    EXPECT_CUDA(cudaMemsetAsync(d->out, 0xFF, (size_t)T * H * 2, t->stream)); /* NaN */
    epx_combine_expand_args_t ca = EPX_COMBINE_EXPAND_ARGS_INIT;
    ca.x = d->y;
    ca.out = d->out;
    ca.weighted = weighted;
    EXPECT_OK(epx_combine_expand(g, h, &ca, t->stream));
    EXPECT_CUDA(cudaStreamSynchronize(t->stream));
    EXPECT(epx_ref_combine_expand(&w->ref, me, align, (const uint16_t *const *)y, weighted, want,
                                  NULL) == 0);
    EXPECT_CUDA(cudaMemcpy(got, d->out, (size_t)T * H * 2, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < (size_t)T * H; i++)
      EXPECTF(got[i] == want[i], "%s (%s combine): out[%zu][%zu] = 0x%04x, want 0x%04x", label,
              weighted ? "weighted" : "unweighted", i / H, i % H, got[i], want[i]);
  }
  for (int s = 0; s < R; s++) free(y[s]);
  free(want), free(got);
  return TEST_PASS;
}

/* After a checked call: this rank's expert-major receive arrays all 0xff (rows NaN, infos and
 * lists -1, weights NaN), so the next call must write every row, info, weight and list entry
 * itself, and a fan-out that copied a row before it landed copies 0xff. Safe without a
 * barrier: peers write here only after this rank's next count exchange, which this rank's
 * stream queues after these memsets; its own readers (the combine) are done (synchronized). */
static int poison_receive(const world_t *w, const epx_dispatch_expand_result_t *res) {
  const size_t cap = (size_t)res->capacity, H = (size_t)w->H, G = H / 128;
  /* the payload area holds BF16 rows (expand needs BF16 in config.dtypes): all of it */
  EXPECT_CUDA(cudaMemset(res->recv_x, 0xff, cap * H * 2));
  EXPECT_CUDA(cudaMemset(res->recv_src_info, 0xff, cap * 16));
  EXPECT_CUDA(cudaMemset(res->recv_weights, 0xff, cap * 4));
  EXPECT_CUDA(cudaMemset((void *)res->token_rows, 0xff, (size_t)w->R * w->M * w->K * 4));
  void *scales =
      res->recv_x_scales ? (void *)res->recv_x_scales : (void *)res->recv_x_scales_packed;
  if (scales) EXPECT_CUDA(cudaMemset(scales, 0xff, cap * G * 4));
  EXPECT_CUDA(cudaDeviceSynchronize());
  return TEST_PASS;
}

/* The arrival signals' consumer (result.expert_ready): launched on its own stream while the
 * dispatch runs, ordered after the count exchange as epx.h says (nothing more with sync
 * counts, counts_event without), it sums each expert's rows as soon as the expert is ready.
 * Its stream and buffers are made before the dispatch, so it starts as soon as it can. */
typedef struct {
  cudaStream_t stream;
  uint32_t *sums; /* device [L] */
  int *late;      /* device [L] */
} ready_probe_t;

/* Experts the probes saw not yet ready at their first look, and all they looked at: evidence
 * that a probe ran beside its dispatch (printed by expand_cases; an early signal is caught only
 * then). */
static long long g_probe_pending, g_probe_experts;

static int ready_probe_make(int L, ready_probe_t *p) {
  memset(p, 0, sizeof *p);
  EXPECT_CUDA(cudaStreamCreateWithFlags(&p->stream, cudaStreamNonBlocking));
  EXPECT_CUDA(cudaMalloc((void **)&p->sums, sizeof(uint32_t) * L));
  EXPECT_CUDA(cudaMalloc((void **)&p->late, sizeof(int) * L));
  return TEST_PASS;
}

static int ready_probe_start(const epx_dispatch_expand_result_t *res, int row_bytes, int sync,
                             ready_probe_t *p) {
  if (!sync) EXPECT_CUDA(cudaStreamWaitEvent(p->stream, res->counts_event, 0));
  EXPECT_CUDA(test_expert_ready_sums(
      res->expert_ready, res->expert_begin_device, res->expert_count_device, res->num_local_experts,
      res->capacity, res->recv_x, row_bytes, p->sums, p->late, 10000000000ull, p->stream));
  return TEST_PASS;
}

/* After both streams: every expert ready, no wait ran out, and each sum taken at the signal
 * equal to the sum of the rows as the dispatch left them (a signal raised before an expert's
 * last row landed or was fanned out would have summed poisoned or stale words). */
static int ready_probe_check(const epx_dispatch_expand_result_t *res, int row_bytes,
                             ready_probe_t *p, const char *label) {
  const int L = res->num_local_experts;
  EXPECT_CUDA(cudaStreamSynchronize(p->stream));
  uint32_t *sums = fetch(p->sums, (size_t)L, sizeof(uint32_t));
  int *late = fetch(p->late, (size_t)L, sizeof(int));
  uint32_t *ready = fetch(res->expert_ready, (size_t)L, sizeof(uint32_t));
  int *begin = fetch(res->expert_begin_device, (size_t)L + 1, sizeof(int));
  int *count = fetch(res->expert_count_device, (size_t)L, sizeof(int));
  EXPECT(sums && late && ready && begin && count);
  const int rows = begin[L] < res->capacity ? begin[L] : res->capacity;
  uint32_t *x = fetch(res->recv_x, (size_t)rows * row_bytes / 4, sizeof(uint32_t));
  EXPECT(x != NULL || rows == 0);
  for (int j = 0; j < L; j++) {
    EXPECTF(ready[j] == 1u && late[j] != 1, "%s: expert %d: ready word %u, consumer's wait %s",
            label, j, ready[j], late[j] == 1 ? "ran out" : "ended");
    g_probe_pending += late[j] == 2;
    g_probe_experts++;
    const int e = begin[j] + count[j] < res->capacity ? begin[j] + count[j] : res->capacity;
    uint32_t want = 0;
    for (size_t i = (size_t)begin[j] * row_bytes / 4; i < (size_t)e * row_bytes / 4; i++)
      want += x[i];
    EXPECTF(sums[j] == want,
            "%s: expert %d: its rows summed at its ready signal to %08x, after the dispatch to "
            "%08x: the signal came before the rows",
            label, j, sums[j], want);
  }
  free(sums), free(late), free(ready), free(begin), free(count), free(x);
  return TEST_PASS;
}

static void ready_probe_free(ready_probe_t *p) {
  if (p->stream) cudaStreamSynchronize(p->stream), cudaStreamDestroy(p->stream);
  cudaFree(p->sums);
  cudaFree(p->late);
  memset(p, 0, sizeof *p);
}

/* One expert-major dispatch of w's tokens on (g, h), checked, then its combines. */
/* poison: fill the receive arrays with 0xff afterwards (poison_receive); 0 where the caller
 * combines this dispatch's rows again. */
static int expand_once(epx_test_rank_t *t, epx_group_t g, epx_handle_t h, const world_t *w,
                       const world_dev_t *d, int fp8, int no_weights, int align, int sync,
                       int poison, const char *label) {
  const int me = t->rank;
  epx_dispatch_args_t a = EPX_DISPATCH_ARGS_INIT;
  a.x = fp8 ? d->x8 : d->x;
  a.x_dtype = fp8 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16;
  a.x_scales = fp8 ? (const float *)d->sc : NULL;
  a.topk_idx = d->idx;
  a.topk_weights = no_weights ? NULL : (const float *)d->w;
  a.num_tokens = w->ranks[me].num_tokens;
  a.expert_alignment = align;
  a.sync_counts = sync;
  int counts[EPX_MAX_EXPERTS];
  a.num_recv_per_expert = sync ? counts : NULL;
  /* fp8 2: the same scales column-major ([H/128, T], strides 1 and T): the strided path of the
   * sender and the receiver's fan-out of the scale words it delivered. */
  float *sc_cm = NULL;
  /* A rank with no tokens passes the same scale format as the others all the same: the format
   * of what it receives follows its own call (T1: one row allocated, none read). */
  const int T = w->ranks[me].num_tokens, T1 = T > 0 ? T : 1, G = w->H / 128;
  if (fp8 == 3) { /* packed UE8M0 rows, as DeepGEMM's scales */
    const int cols = (G + 3) / 4;
    int32_t *words = calloc((size_t)T1 * cols, sizeof(int32_t));
    EXPECT(words != NULL);
    epx_ref_ue8m0_pack(w->sc[me], T, G, words);
    EXPECT_CUDA(cudaMalloc((void **)&sc_cm, sizeof(int32_t) * (size_t)T1 * cols));
    EXPECT_CUDA(
        cudaMemcpy(sc_cm, words, sizeof(int32_t) * (size_t)T1 * cols, cudaMemcpyHostToDevice));
    free(words);
    a.x_scales = sc_cm;
    a.x_scales_dtype = EPX_DTYPE_INT32;
  }
  if (fp8 == 2) {
    float *host = calloc((size_t)T1 * G, sizeof(float));
    EXPECT(host != NULL);
    for (int i = 0; i < T; i++)
      for (int k = 0; k < G; k++) host[(size_t)k * T + i] = w->sc[me][(size_t)i * G + k];
    EXPECT_CUDA(cudaMalloc((void **)&sc_cm, sizeof(float) * (size_t)T1 * G));
    EXPECT_CUDA(cudaMemcpy(sc_cm, host, sizeof(float) * (size_t)T1 * G, cudaMemcpyHostToDevice));
    free(host);
    a.x_scales = sc_cm;
    a.x_scales_stride_token = 1;
    a.x_scales_stride_group = T1;
  }
  epx_dispatch_expand_result_t res;
  if (gpu_host_barrier(t) != TEST_PASS) return TEST_FAIL; /* as before a combine, below */
  const int row_bytes = w->H * (fp8 ? 1 : 2);
  ready_probe_t probe;
  if (ready_probe_make(w->L, &probe) != TEST_PASS) return TEST_FAIL;
  const epx_status_t st = epx_dispatch_expand(g, h, &a, &res, t->stream);
  int probed = st == EPX_OK ? ready_probe_start(&res, row_bytes, sync, &probe) : TEST_FAIL;
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  if (probed == TEST_PASS) probed = ready_probe_check(&res, row_bytes, &probe, label);
  ready_probe_free(&probe);
  EXPECT_OK(st);
  if (probed != TEST_PASS) return TEST_FAIL;
  EXPECT_CUDA(cudaFree(sc_cm));
  if (!sync) EXPECT_EQ_INT(res.num_rows, -1);
  EXPECT_EQ_INT(res.num_local_experts, w->L);
  if (!sync) { /* the plain count, for check_token_rows */
    EXPECT_CUDA(
        cudaMemcpy(&res.num_recv, res.num_recv_device, sizeof(int), cudaMemcpyDeviceToHost));
  }
  const int ref_align = align ? align : 1;
  if (check_expand_recv(w, me, &res, fp8, ref_align, counts, sync, label) != TEST_PASS)
    return TEST_FAIL;
  if (combine_and_check(t, g, h, w, d, ref_align, label) != TEST_PASS) return TEST_FAIL;
  return poison ? poison_receive(w, &res) : TEST_PASS;
}

/* A world with its topk_weights dropped (the dispatch gets none): the oracle's weights are 0. */
static void drop_weights(world_t *w) {
  for (int s = 0; s < w->R; s++) w->ranks[s].topk_weights = NULL;
}

/* Both fan-out modes (config.expand_fan_out), each test's worlds through each. */
static const int kFanOuts[2] = {EPX_EXPAND_FAN_OUT_AFTER, EPX_EXPAND_FAN_OUT_DURING};
static const char *fan_out_name(int mode) {
  return mode == EPX_EXPAND_FAN_OUT_DURING ? "fan-out during" : "fan-out after";
}

static int run_case(epx_test_rank_t *t, const expand_case_t *c, int fan_out, uint64_t *rng) {
  const int R = t->num_ranks, me = t->rank;
  world_t w;
  world_make(&w, R, &c->world, WORLD_NORMAL, rng);
  if (c->no_weights) drop_weights(&w);
  epx_group_t g;
  epx_handle_t h;
  if (expand_group_make(t, w.M, w.H, w.E, w.K, 0, fan_out, 0, &g, &h) != TEST_PASS)
    return TEST_FAIL;
  world_dev_t d;
  if (world_dev_make(&w, me, (size_t)worst_rows(R, w.M, w.E, w.K), &d) != TEST_PASS)
    return TEST_FAIL;
  const int align_choices[] = {0, 1, 4, MAX_ALIGN};
  const int align = align_choices[epx_test_rand_int(rng, 4)];
  char label[128];
  for (int sync = 1; sync >= 0; sync--) {
    snprintf(label, sizeof label, "%s (%s, align %d, sync_counts %d)", c->name,
             fan_out_name(fan_out), align, sync);
    if (expand_once(t, g, h, &w, &d, c->fp8, c->no_weights, align, sync, 1, label) != TEST_PASS)
      return TEST_FAIL;
  }
  const long long first_bad = world_first_bad_id(&w, me);
  if (first_bad >= 0) { /* the layout reported the first bad id; treated as empty */
    epx_async_error_t e;
    EXPECT_OK(epx_group_get_async_error(g, &e));
    EXPECTF(e.status == EPX_ERR_INVALID_ARGUMENT && e.stage == EPX_STAGE_LAYOUT &&
                e.position == first_bad && e.value == w.idx[me][first_bad],
            "%s: async error %d stage %d at %lld (value %lld), want INVALID_ARGUMENT at LAYOUT at "
            "%lld",
            c->name, (int)e.status, (int)e.stage, (long long)e.position, (long long)e.value,
            first_bad);
    EXPECT_OK(epx_group_clear_async_error(g));
  }
  EXPECT_NO_ASYNC_ERROR(g, c->name);
  world_dev_free(&d);
  world_free(&w);
  EXPECT_OK(epx_handle_destroy(h));
  EXPECT_OK(epx_group_destroy(g));
  return TEST_PASS;
}

/*   name  {T_max  H  E  K  routing  T  empty_rank}  fp8 (2: column-major scales, 3: packed
 *   UE8M0 words)  no_weights */
static const expand_case_t kCases[] = {
    {"uniform", {64, 256, 32, 4, ROUTE_UNIFORM, -1, -1}, 0, 0},
    {"uniform fp8", {64, 256, 32, 4, ROUTE_UNIFORM, -1, -1}, 1, 0},
    {"uniform no weights", {48, 128, 16, 3, ROUTE_UNIFORM, -1, -1}, 0, 1},
    {"holes", {80, 128, 16, 4, ROUTE_HOLES, -1, -1}, 0, 0},
    {"duplicates", {80, 128, 16, 6, ROUTE_DUPLICATES, -1, -1}, 0, 0},
    {"duplicates fp8", {80, 256, 16, 6, ROUTE_DUPLICATES, -1, -1}, 1, 0},
    {"duplicates fp8, column-major scales", {80, 384, 16, 6, ROUTE_DUPLICATES, -1, -1}, 2, 0},
    {"holes fp8, packed UE8M0 scales", {80, 640, 16, 6, ROUTE_HOLES, -1, -1}, 3, 0},
    {"all to one expert", {96, 128, 16, 4, ROUTE_ONE_EXPERT, 96, -1}, 0, 0},
    {"all empty", {32, 128, 16, 4, ROUTE_EMPTY, 32, -1}, 0, 0},
    {"rank 0's experts only", {64, 128, 16, 4, ROUTE_ONE_RANK, -1, -1}, 0, 0},
    {"bad ids", {64, 128, 16, 4, ROUTE_BAD, -1, -1}, 0, 0},
    {"rank 1 empty", {64, 128, 16, 4, ROUTE_UNIFORM, -1, 1}, 0, 0},
    {"one expert per rank, K 1", {64, 128, 0, 1, ROUTE_UNIFORM, -1, -1}, 0, 0},
    {"K 16 of 64 experts", {40, 128, 64, 16, ROUTE_UNIFORM, -1, -1}, 0, 0},
    {"many experts", {600, 128, 256, 8, ROUTE_UNIFORM, 600, -1}, 0, 0},
    {"two layout tiles", {1100, 128, 32, 8, ROUTE_DUPLICATES, -1, -1}, 0, 0},
    {"wide hidden", {32, 2048, 16, 4, ROUTE_UNIFORM, -1, -1}, 0, 0},
    /* DeepSeek-V3's row size: rows land over a long transfer, so DURING's fan-out waits */
    {"DeepSeek-like", {1024, 7168, 256, 8, ROUTE_UNIFORM, 1024, -1}, 0, 0},
    {"DeepSeek-like fp8", {1024, 7168, 256, 8, ROUTE_DUPLICATES, -1, -1}, 1, 0},
};

EPX_GPU_TEST(expand_cases, 600) {
  uint64_t rng = t->seed;
  g_probe_pending = g_probe_experts = 0;
  for (int m = 0; m < 2; m++)
    for (size_t i = 0; i < sizeof kCases / sizeof kCases[0]; i++) {
      if (kCases[i].world.empty_rank >= t->num_ranks) continue;
      if (run_case(t, &kCases[i], kFanOuts[m], &rng) != TEST_PASS) {
        fprintf(stderr, "  case \"%s\", %s, failed (seed %llu)\n", kCases[i].name,
                fan_out_name(kFanOuts[m]), (unsigned long long)t->seed);
        return TEST_FAIL;
      }
    }
  printf(
      "  rank %d: arrival probes: %lld of %lld experts not yet ready at the probe's first look\n",
      t->rank, g_probe_pending, g_probe_experts);
  return TEST_PASS;
}

/* One group, new worlds of random token counts: expand and plain calls interleaved (the plain
 * calls advance the notify epoch too: DURING's ready words must not mistake one call for
 * another). */
static int expand_loop_mode(epx_test_rank_t *t, int fan_out) {
  const int R = t->num_ranks, me = t->rank;
  uint64_t rng = t->seed;
  const world_spec_t spec = {256, 128, 32, 6, ROUTE_DUPLICATES, -1, -1};
  const int rows = worst_rows(R, spec.max_tokens, spec.experts, spec.top_k);
  epx_group_t g;
  epx_handle_t h;
  if (expand_group_make(t, spec.max_tokens, spec.hidden, spec.experts, spec.top_k, rows, fan_out, 0,
                        &g, &h) != TEST_PASS)
    return TEST_FAIL;
  for (int it = 0; it < 12; it++) {
    world_t w;
    world_make(&w, R, &spec, WORLD_NORMAL, &rng);
    world_dev_t d;
    if (world_dev_make(&w, me, (size_t)rows, &d) != TEST_PASS) return TEST_FAIL;
    char label[64];
    snprintf(label, sizeof label, "%s, iteration %d", fan_out_name(fan_out), it);
    const int align = (it % 3) * 8; /* 0, 8, 16 */
    if (expand_once(t, g, h, &w, &d, it % 4 == 1, 0, align, it % 2, 1, label) != TEST_PASS)
      return TEST_FAIL;
    if (it % 3 == 2) { /* a plain dispatch and combine on the same group and handle */
      epx_dispatch_args_t a = EPX_DISPATCH_ARGS_INIT;
      a.x = d.x;
      a.topk_idx = d.idx;
      a.topk_weights = (const float *)d.w;
      a.num_tokens = w.ranks[me].num_tokens;
      epx_dispatch_result_t res;
      EXPECT_OK(epx_dispatch(g, h, &a, &res, t->stream));
      EXPECT_CUDA(cudaStreamSynchronize(t->stream));
      epx_ref_recv_t ref;
      EXPECT(epx_ref_dispatch(&w.ref, me, EPX_REF_PAYLOAD_BF16, 1, &ref) == 0);
      if (normal_check_recv(&w, me, &res, 0, 1, &ref, label) != TEST_PASS) return TEST_FAIL;
      epx_ref_recv_free(&ref);
      epx_combine_expand_args_t ca = EPX_COMBINE_EXPAND_ARGS_INIT;
      ca.x = d.y;
      ca.out = d.out;
      EXPECT_STATUS(epx_combine_expand(g, h, &ca, t->stream), EPX_ERR_INVALID_USAGE);
      /* The plain combine of the received rows sent back unchanged. */
      epx_combine_args_t pc = EPX_COMBINE_ARGS_INIT;
      pc.x = res.recv_x;
      pc.out = d.out;
      EXPECT_OK(epx_combine(g, h, &pc, t->stream));
      EXPECT_CUDA(cudaStreamSynchronize(t->stream));
      if (normal_check_combine_unchanged(&w, me, d.out, label) != TEST_PASS) return TEST_FAIL;
    }
    world_dev_free(&d);
    world_free(&w);
  }
  EXPECT_NO_ASYNC_ERROR(g, "expand_loop");
  EXPECT_OK(epx_handle_destroy(h));
  EXPECT_OK(epx_group_destroy(g));
  return TEST_PASS;
}

EPX_GPU_TEST(expand_loop, 600) {
  for (int m = 0; m < 2; m++)
    if (expand_loop_mode(t, kFanOuts[m]) != TEST_PASS) return TEST_FAIL;
  return TEST_PASS;
}

EPX_GPU_TEST(expand_refuses_bad_arguments, 300) {
  const int R = t->num_ranks, me = t->rank;
  uint64_t rng = t->seed;
  const world_spec_t spec = {64, 128, 16, 4, ROUTE_UNIFORM, -1, -1};
  world_t w;
  world_make(&w, R, &spec, WORLD_NORMAL, &rng);
  epx_group_config_t cfg = gpu_test_config(w.M, w.H, w.E, w.K);
  cfg.modes = EPX_MODE_NORMAL;
  epx_group_t plain = NULL;
  epx_handle_t ph = NULL;
  EXPECT_OK(epx_group_create(t->comm, &cfg, &plain)); /* no expand buffer */
  EXPECT_OK(epx_handle_create(plain, &ph));
  world_dev_t d;
  if (world_dev_make(&w, me, (size_t)worst_rows(R, w.M, w.E, w.K), &d) != TEST_PASS)
    return TEST_FAIL;
  epx_dispatch_args_t a = EPX_DISPATCH_ARGS_INIT;
  a.x = d.x;
  a.topk_idx = d.idx;
  a.topk_weights = (const float *)d.w;
  a.num_tokens = w.ranks[me].num_tokens;
  epx_dispatch_expand_result_t res;
  EXPECT_STATUS(epx_dispatch_expand(plain, ph, &a, &res, t->stream), EPX_ERR_INVALID_USAGE);
  EXPECT(strstr(epx_last_error(), "expand_max_rows") != NULL);
  EXPECT_OK(epx_handle_destroy(ph));
  EXPECT_OK(epx_group_destroy(plain));

  cfg.expand_max_rows = worst_rows(R, w.M, w.E, w.K);
  epx_group_t g = NULL;
  epx_handle_t h = NULL;
  EXPECT_OK(epx_group_create(t->comm, &cfg, &g));
  EXPECT_OK(epx_handle_create(g, &h));
  epx_combine_expand_args_t ca = EPX_COMBINE_EXPAND_ARGS_INIT;
  ca.x = d.y;
  ca.out = d.out;
  EXPECT_STATUS(epx_combine_expand(g, h, &ca, t->stream), EPX_ERR_INVALID_USAGE); /* no dispatch */
  epx_dispatch_args_t b = a;
  b.topk_idx = NULL;
  b.topk_weights = NULL;
  b.is_token_in_rank = (const uint8_t *)d.x;
  b.num_tokens_per_expert = (const int *)d.w;
  EXPECT_STATUS(epx_dispatch_expand(g, h, &b, &res, t->stream), EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "is_token_in_rank") != NULL);
  b = a;
  b.num_worst_tokens = 8;
  b.sync_counts = 0;
  EXPECT_STATUS(epx_dispatch_expand(g, h, &b, &res, t->stream), EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "num_worst_tokens") != NULL);
  b = a;
  b.expert_alignment = -1;
  EXPECT_STATUS(epx_dispatch_expand(g, h, &b, &res, t->stream), EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "expert_alignment") != NULL);
  b = a;
  b.size = 8;
  EXPECT_STATUS(epx_dispatch_expand(g, h, &b, &res, t->stream), EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "EPX_DISPATCH_ARGS_INIT") != NULL);
  EXPECT_STATUS(epx_dispatch_expand(g, h, &a, NULL, t->stream), EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "result") != NULL);
  /* A right call, then the combine's refusals, then a right combine: the group still works. */
  /* (not poisoned: the combine below reduces this dispatch's rows again) */
  if (expand_once(t, g, h, &w, &d, 0, 0, 4, 1, 0, "after refusals") != TEST_PASS) return TEST_FAIL;
  ca.weighted = 2;
  EXPECT_STATUS(epx_combine_expand(g, h, &ca, t->stream), EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "weighted") != NULL);
  ca.weighted = 1;
  ca.size = 4;
  EXPECT_STATUS(epx_combine_expand(g, h, &ca, t->stream), EPX_ERR_INVALID_ARGUMENT);
  ca.size = sizeof ca;
  ca.x = NULL;
  EXPECT_STATUS(epx_combine_expand(g, h, &ca, t->stream), EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "args->x") != NULL);
  EXPECT_STATUS(epx_dispatch_cached(g, h, d.x, EPX_DTYPE_BF16, NULL, NULL, t->stream),
                EPX_ERR_INVALID_ARGUMENT); /* result NULL */
  epx_dispatch_result_t pres;
  EXPECT_STATUS(epx_dispatch_cached(g, h, d.x, EPX_DTYPE_BF16, NULL, &pres, t->stream),
                EPX_ERR_INVALID_USAGE); /* an expand handle */
  if (combine_and_check(t, g, h, &w, &d, 4, "after refusals") != TEST_PASS) return TEST_FAIL;
  EXPECT_NO_ASYNC_ERROR(g, "expand_refuses_bad_arguments");
  world_dev_free(&d);
  world_free(&w);
  EXPECT_OK(epx_handle_destroy(h));
  EXPECT_OK(epx_group_destroy(g));
  return TEST_PASS;
}

/* expand_max_rows below what rank 0 needs (every token of every rank to expert 0, K slots of
 * distinct experts of rank 0): the call is refused after the fact, no row past the capacity is
 * written, the async record says so, and the group recovers after a clear. */
static int capacity_exceeded_mode(epx_test_rank_t *t, int fan_out) {
  const int R = t->num_ranks, me = t->rank;
  uint64_t rng = t->seed;
  const world_spec_t spec = {64, 128, 16, 4, ROUTE_ONE_RANK, 64, -1};
  world_t w;
  world_make(&w, R, &spec, WORLD_NORMAL, &rng);
  epx_group_t g;
  epx_handle_t h;
  /* 100 rows: rank 0 needs R x 64 x min(4, L) rows, 128 or more */
  if (expand_group_make(t, w.M, w.H, w.E, w.K, 100, fan_out, 0, &g, &h) != TEST_PASS)
    return TEST_FAIL;
  world_dev_t d;
  if (world_dev_make(&w, me, 256, &d) != TEST_PASS) return TEST_FAIL;
  epx_ref_expand_t ref;
  EXPECT(epx_ref_dispatch_expand(&w.ref, me, EPX_REF_PAYLOAD_NONE, 1, &ref) == 0);
  epx_dispatch_args_t a = EPX_DISPATCH_ARGS_INIT;
  a.x = d.x;
  a.topk_idx = d.idx;
  a.topk_weights = (const float *)d.w;
  a.num_tokens = w.ranks[me].num_tokens;
  epx_dispatch_expand_result_t res;
  const epx_status_t st = epx_dispatch_expand(g, h, &a, &res, t->stream);
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  epx_async_error_t e;
  EXPECT_OK(epx_group_get_async_error(g, &e));
  if (ref.num_rows > 100) {
    EXPECT_STATUS(st, EPX_ERR_INVALID_ARGUMENT);
    EXPECT(strstr(epx_last_error(), "expand_max_rows") != NULL);
    EXPECT_EQ_INT(res.num_rows, ref.num_rows);
    EXPECTF(e.status == EPX_ERR_INVALID_ARGUMENT && e.stage == EPX_STAGE_DISPATCH,
            "async error %d stage %d, want INVALID_ARGUMENT at DISPATCH", (int)e.status,
            (int)e.stage);
  } else {
    EXPECT_STATUS(st, EPX_OK);
  }
  /* Rows below the capacity are the oracle's, and every expert's arrival signal is up: its rows
   * below the capacity are complete (none, for an expert past it). */
  int *info = fetch(res.recv_src_info, 100 * 4, sizeof(int));
  uint32_t *ready = fetch(res.expert_ready, (size_t)w.L, sizeof(uint32_t));
  EXPECT(info != NULL && ready != NULL);
  for (int j = 0; j < w.L; j++)
    EXPECTF(ready[j] == 1u, "expert_ready[%d] = %u, want 1", j, ready[j]);
  free(ready);
  for (int i = 0; i < 100 && i < ref.num_rows; i++)
    EXPECTF(info[4 * i] == ref.src_rank[i] && info[4 * i + 1] == ref.src_token[i],
            "row %d from (%d, %d), want (%d, %d)", i, info[4 * i], info[4 * i + 1], ref.src_rank[i],
            ref.src_token[i]);
  free(info);
  epx_ref_expand_free(&ref);
  if (gpu_host_barrier(t) != TEST_PASS) return TEST_FAIL;
  EXPECT_OK(epx_group_clear_async_error(g));
  world_dev_free(&d);
  world_free(&w);
  EXPECT_OK(epx_handle_destroy(h));
  EXPECT_OK(epx_group_destroy(g));
  return TEST_PASS;
}

EPX_GPU_TEST(expand_capacity_exceeded, 300) {
  for (int m = 0; m < 2; m++)
    if (capacity_exceeded_mode(t, kFanOuts[m]) != TEST_PASS) return TEST_FAIL;
  return TEST_PASS;
}

/* The last rank passes max_tokens_per_rank + 1 tokens (budget 3 s), with each fan-out mode: it
 * gets EPX_ERR_INVALID_ARGUMENT, every other rank EPX_ERR_TIMEOUT (stage NOTIFY, naming it)
 * well inside the budget, with every arrival signal 0; then every rank's next expand dispatch
 * and combine are right (the counters stayed in step). */
static int too_many_tokens_mode(epx_test_rank_t *t, int fan_out) {
  const int R = t->num_ranks, me = t->rank, over = R - 1;
  uint64_t rng = t->seed;
  const world_spec_t spec = {64, 256, 16, 4, ROUTE_UNIFORM, 64, -1};
  world_t w;
  world_make(&w, R, &spec, WORLD_NORMAL, &rng);
  epx_group_t g;
  epx_handle_t h;
  if (expand_group_make(t, w.M, w.H, w.E, w.K, 0, fan_out, 3000, &g, &h) != TEST_PASS)
    return TEST_FAIL;
  world_dev_t d;
  if (world_dev_make(&w, me, (size_t)worst_rows(R, w.M, w.E, w.K), &d) != TEST_PASS)
    return TEST_FAIL;
  epx_dispatch_args_t a = EPX_DISPATCH_ARGS_INIT;
  a.x = d.x;
  a.topk_idx = d.idx;
  a.topk_weights = (const float *)d.w;
  a.num_tokens = me == over ? w.M + 1 : w.ranks[me].num_tokens;
  epx_dispatch_expand_result_t res;
  if (gpu_host_barrier(t) != TEST_PASS) return TEST_FAIL;
  const double t0 = epx_test_now_s();
  const epx_status_t st = epx_dispatch_expand(g, h, &a, &res, t->stream);
  printf("  rank %d (%s): %s: %s\n", me, fan_out_name(fan_out), epx_status_string(st),
         epx_last_error());
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  const double took = epx_test_now_s() - t0;
  EXPECTF(took < 1.0, "rank %d: the failed call took %.3f s (budget 3 s)", me, took);
  epx_async_error_t err;
  EXPECT_OK(epx_group_get_async_error(g, &err));
  if (me == over) {
    EXPECT_STATUS(st, EPX_ERR_INVALID_ARGUMENT);
    EXPECT(strstr(epx_last_error(), "num_tokens") != NULL);
    EXPECTF(err.status == EPX_OK, "rank %d: the refusing rank's record: %s", me, err.message);
  } else {
    EXPECT_STATUS(st, EPX_ERR_TIMEOUT);
    EXPECTF(err.status == EPX_ERR_TIMEOUT && err.stage == EPX_STAGE_NOTIFY && err.peer == over,
            "rank %d: record %d stage %d peer %d, want TIMEOUT at NOTIFY naming %d", me,
            (int)err.status, (int)err.stage, err.peer, over);
    uint32_t *ready = fetch(res.expert_ready, (size_t)w.L, sizeof(uint32_t));
    EXPECT(ready != NULL);
    for (int j = 0; j < w.L; j++)
      EXPECTF(ready[j] == 0u, "expert_ready[%d] = %u, want 0", j, ready[j]);
    free(ready);
    EXPECT_OK(epx_group_clear_async_error(g));
  }
  if (gpu_host_barrier(t) != TEST_PASS) return TEST_FAIL;
  if (expand_once(t, g, h, &w, &d, 0, 0, 1, 1, 1, "after the refusal") != TEST_PASS)
    return TEST_FAIL;
  EXPECT_NO_ASYNC_ERROR(g, "after the refusal");
  world_dev_free(&d);
  world_free(&w);
  EXPECT_OK(epx_handle_destroy(h));
  EXPECT_OK(epx_group_destroy(g));
  return TEST_PASS;
}

EPX_PEER_TEST(expand_too_many_tokens_fails_every_rank, 120) {
  for (int m = 0; m < 2; m++)
    if (too_many_tokens_mode(t, kFanOuts[m]) != TEST_PASS) return TEST_FAIL;
  return TEST_PASS;
}

/* At 4 ranks or more, ranks 1 and R - 1 skip an expert-major dispatch (sync counts, budget
 * 500 ms): every other rank's call returns EPX_ERR_TIMEOUT, stage NOTIFY, naming one of them,
 * within about one budget. Its count exchange has R x (R + E) words, several a thread, and
 * threads 0-7 (R 4) hold words of both absent ranks: before, each such thread waited out two
 * budgets one after the other. */
EPX_GPU_TEST_MIN_RANKS(expand_two_absent_ranks_cost_one_budget, 4, 120) {
  const int R = t->num_ranks, me = t->rank, absent_a = 1, absent_b = R - 1;
  const int budget_ms = 500;
  uint64_t rng = t->seed;
  const world_spec_t spec = {64, 256, 256, 8, ROUTE_UNIFORM, 64, -1};
  world_t w;
  world_make(&w, R, &spec, WORLD_NORMAL, &rng);
  epx_group_t g;
  epx_handle_t h;
  if (expand_group_make(t, w.M, w.H, w.E, w.K, 0, EPX_EXPAND_FAN_OUT_AFTER, budget_ms, &g, &h) !=
      TEST_PASS)
    return TEST_FAIL;
  world_dev_t d;
  if (world_dev_make(&w, me, (size_t)worst_rows(R, w.M, w.E, w.K), &d) != TEST_PASS)
    return TEST_FAIL;
  if (gpu_host_barrier(t) != TEST_PASS) return TEST_FAIL;
  if (me != absent_a && me != absent_b) {
    epx_dispatch_args_t a = EPX_DISPATCH_ARGS_INIT;
    a.x = d.x;
    a.topk_idx = d.idx;
    a.topk_weights = (const float *)d.w;
    a.num_tokens = w.ranks[me].num_tokens;
    epx_dispatch_expand_result_t res;
    const double t0 = epx_test_now_s();
    EXPECT_STATUS(epx_dispatch_expand(g, h, &a, &res, t->stream), EPX_ERR_TIMEOUT);
    EXPECT_CUDA(cudaStreamSynchronize(t->stream));
    const double took = epx_test_now_s() - t0;
    printf("  rank %d: returned after %.3f s: %s\n", me, took, epx_last_error());
    EXPECTF(took < 1.7 * budget_ms * 1e-3, "rank %d: %.3f s for a budget of %d ms", me, took,
            budget_ms);
    epx_async_error_t err;
    EXPECT_OK(epx_group_get_async_error(g, &err));
    EXPECTF(err.status == EPX_ERR_TIMEOUT && err.stage == EPX_STAGE_NOTIFY &&
                (err.peer == absent_a || err.peer == absent_b),
            "rank %d: record %d stage %d peer %d", me, (int)err.status, (int)err.stage, err.peer);
  }
  if (gpu_host_barrier(t) != TEST_PASS) return TEST_FAIL;
  world_dev_free(&d);
  world_free(&w);
  EXPECT_OK(epx_handle_destroy(h));
  EXPECT_OK(epx_group_destroy(g));
  return TEST_PASS;
}

/* DURING with the last rank killed after a good call (checked): the next expand dispatch
 * returns EPX_ERR_TIMEOUT on every other rank within about one budget (the count exchange
 * gives up, and no fan-out block waits for the dead rank's rows), the async record names the
 * dead peer, and destroy works. */
EPX_DYING_PEER_TEST(expand_during_after_peer_killed, 120) {
  const int R = t->num_ranks, me = t->rank, dead = R - 1;
  const int budget_ms = 500;
  uint64_t rng = t->seed;
  const world_spec_t spec = {64, 256, 16, 4, ROUTE_UNIFORM, 64, -1};
  world_t w;
  world_make(&w, R, &spec, WORLD_NORMAL, &rng);
  epx_group_t g;
  epx_handle_t h;
  if (expand_group_make(t, w.M, w.H, w.E, w.K, 0, EPX_EXPAND_FAN_OUT_DURING, budget_ms, &g, &h) !=
      TEST_PASS)
    return TEST_FAIL;
  world_dev_t d;
  if (world_dev_make(&w, me, (size_t)worst_rows(R, w.M, w.E, w.K), &d) != TEST_PASS)
    return TEST_FAIL;
  if (expand_once(t, g, h, &w, &d, 0, 0, 1, 1, 1, "before the death") != TEST_PASS)
    return TEST_FAIL;
  if (gpu_host_barrier(t) != TEST_PASS) return TEST_FAIL;
  if (me == dead) epx_test_die();

  epx_dispatch_args_t a = EPX_DISPATCH_ARGS_INIT;
  a.x = d.x;
  a.topk_idx = d.idx;
  a.topk_weights = (const float *)d.w;
  a.num_tokens = w.ranks[me].num_tokens;
  a.sync_counts = 1;
  epx_dispatch_expand_result_t res;
  const double t0 = epx_test_now_s();
  EXPECT_STATUS(epx_dispatch_expand(g, h, &a, &res, t->stream), EPX_ERR_TIMEOUT);
  EXPECT_EQ_INT(res.num_rows, -1);
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  const double t1 = epx_test_now_s();
  printf("  rank %d: expand dispatch returned after %.3f s: %s\n", me, t1 - t0, epx_last_error());
  EXPECTF(t1 - t0 < budget_ms * 1e-3 + 1.0, "expand dispatch took %.3f s, budget %d ms", t1 - t0,
          budget_ms);
  epx_async_error_t err;
  EXPECT_OK(epx_group_get_async_error(g, &err));
  EXPECT_EQ_INT(err.status, EPX_ERR_TIMEOUT);
  EXPECT_EQ_INT(err.peer, dead);
  /* the failed count exchange left every arrival signal at 0 (no expert claims its rows) */
  uint32_t *ready = fetch(res.expert_ready, (size_t)w.L, sizeof(uint32_t));
  EXPECT(ready != NULL);
  for (int j = 0; j < w.L; j++)
    EXPECTF(ready[j] == 0u, "expert_ready[%d] = %u, want 0", j, ready[j]);
  free(ready);
  const double t2 = epx_test_now_s();
  EXPECT_OK(epx_handle_destroy(h));
  EXPECT_OK(epx_group_destroy(g));
  printf("  rank %d: destroy returned after %.3f s\n", me, epx_test_now_s() - t2);
  EXPECTF(epx_test_now_s() - t2 < 5.0, "destroy took %.3f s", epx_test_now_s() - t2);
  world_dev_free(&d);
  world_free(&w);
  return TEST_PASS;
}

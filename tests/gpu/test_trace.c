/*
 * test_trace.c - in-kernel tracing on 2 and 4 GPUs: a traced run still matches the CPU
 * reference, and the trace file says what ran, on every rank, with aligned clocks.
 *
 *   test                                  what
 *   trace_dispatch_combine_matches_reference  barrier + dispatch + combine + cached dispatch
 *                                         traced: results vs tests/ref; the file passes
 *                                         trace_check (structure, named tracks, nesting);
 *                                         per rank the exact count of each tag and the right
 *                                         arguments; barrier ends aligned across ranks
 *   trace_full_buffer_drops_and_stays_right  capacity 32: events dropped and reported on every
 *                                         rank, results still right
 *   trace_empty_ranks_and_usage_errors    a dump with no events, with events on one rank only,
 *                                         without a start (every rank refuses, no hang), twice
 *                                         started; the group still works afterwards
 *   trace_env_traces_group_lifetime       EPX_TRACE: create -> destroy written by rank 0, the
 *                                         second group to PATH.g1; set on one rank only: off
 * Files go to /tmp/epx_test_trace_<leader pid>_*.json (rank 0 writes, checks and removes them).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/json.h"
#include "common/trace_check.h"
#include "gpu/normal_checks.h"
#include "trace.h"

/* A TRACE=0 build has no tracing to test. */
#define SKIP_IF_COMPILED_OUT() \
  do {                         \
    if (!EPX_TRACE_COMPILED) { \
      (void)t;                 \
      return TEST_SKIP;        \
    }                          \
  } while (0)

static void trace_path(char *buf, size_t len, const char *what) {
  /* The leader process is every rank's parent: one name per run, the same on every rank. */
  snprintf(buf, len, "/tmp/epx_test_trace_%d_%s.json", (int)getppid(), what);
}

/* The tags and arguments a rank's traced barrier + dispatch + combine + cached dispatch left. */
static int check_rank_spans(const json_value_t *root, const world_t *w, int q, int num_sms) {
  const int T = w->ranks[q].num_tokens;
  /* The explicit barrier, then the one a cached dispatch starts with (src/normal.c). */
  EXPECT_EQ_INT(trace_count_spans(root, q, "barrier"), 2);
  EXPECT_EQ_INT(trace_count_spans(root, q, "layout"), 1);
  EXPECT_EQ_INT(trace_count_spans(root, q, "notify"), 1);
  EXPECT_EQ_INT(trace_count_spans(root, q, "notify wait"), 1);
  EXPECT_EQ_INT(trace_count_spans(root, q, "dispatch send"), 2 * num_sms); /* + cached */
  EXPECT_EQ_INT(trace_count_spans(root, q, "dispatch token"), 2 * T);
  EXPECT_EQ_INT(trace_count_spans(root, q, "dispatch wait"), 2);
  long long ts, dur, arg;
  EXPECT(trace_find_span(root, q, "layout", &ts, &dur, &arg) == 0);
  EXPECT_EQ_INT(arg, T);
  epx_ref_recv_t ref;
  memset(&ref, 0, sizeof ref);
  EXPECT(epx_ref_dispatch(&w->ref, q, EPX_REF_PAYLOAD_BF16, 1, &ref) == 0);
  EXPECT(trace_find_span(root, q, "notify", &ts, &dur, &arg) == 0);
  EXPECTF(arg == ref.num_recv, "rank %d: notify says num_recv %lld, reference %d", q, arg,
          ref.num_recv);
  epx_ref_recv_free(&ref);
  EXPECT(trace_find_span(root, q, "barrier", &ts, &dur, &arg) == 0);
  EXPECTF(arg >= 0 && arg < w->R, "rank %d: barrier's last peer %lld", q, arg);
  return TEST_PASS;
}

EPX_GPU_TEST(trace_dispatch_combine_matches_reference, 300) {
  SKIP_IF_COMPILED_OUT();
  const int R = t->num_ranks, me = t->rank;
  uint64_t rng = t->seed;
  const normal_case_t c = {"traced", {512, 1024, 64, 8, ROUTE_UNIFORM, -1, -1}, 0};
  world_t w;
  world_make(&w, R, &c.world, WORLD_NORMAL, &rng);
  epx_group_config_t cfg = gpu_test_config(w.M, w.H, w.E, w.K);
  epx_group_t g = NULL;
  epx_handle_t h = NULL;
  EXPECT_OK(epx_group_create(t->comm, &cfg, &g));
  EXPECT_OK(epx_handle_create(g, &h));
  epx_group_config_t resolved;
  EXPECT_OK(epx_group_get_config(g, &resolved));
  world_dev_t d;
  if (world_dev_make(&w, me, (size_t)R * w.M, &d) != TEST_PASS) return TEST_FAIL;
  int nrecv = 0;
  uint16_t *y = normal_expert_output(&w, me, &nrecv);
  EXPECT_CUDA(cudaMemcpy(d.y, y, (size_t)nrecv * w.H * 2, cudaMemcpyHostToDevice));
  EXPECT_CUDA(cudaDeviceSynchronize()); /* legacy-stream copy before the test stream's work */
  free(y);

  /* Traced: barrier, dispatch, weighted combine, cached dispatch of the same payload. */
  EXPECT_OK(epx_trace_start(g, 0, t->stream));
  EXPECT_OK(epx_group_barrier(g, t->stream));
  epx_dispatch_args_t a = EPX_DISPATCH_ARGS_INIT;
  a.x = d.x;
  a.topk_idx = d.idx;
  a.topk_weights = (const float *)d.w;
  a.num_tokens = w.ranks[me].num_tokens;
  epx_dispatch_result_t res;
  EXPECT_OK(epx_dispatch(g, h, &a, &res, t->stream));
  epx_combine_args_t ca = EPX_COMBINE_ARGS_INIT;
  ca.x = d.y;
  ca.out = d.out;
  ca.topk_idx = d.idx;
  ca.topk_weights = (const float *)d.w;
  EXPECT_CUDA(cudaMemsetAsync(d.out, 0xFF, (size_t)w.ranks[me].num_tokens * w.H * 2, t->stream));
  EXPECT_OK(epx_combine(g, h, &ca, t->stream));
  EXPECT_OK(epx_dispatch_cached(g, h, d.x, EPX_DTYPE_BF16, NULL, &res, t->stream));
  char path[128];
  trace_path(path, sizeof path, "run");
  epx_trace_summary_t sum;
  EXPECT_OK(epx_trace_dump(g, path, &sum, t->stream));

  /* The results are those of an untraced run. */
  epx_ref_recv_t ref;
  memset(&ref, 0, sizeof ref);
  EXPECT(epx_ref_dispatch(&w.ref, me, EPX_REF_PAYLOAD_BF16, 1, &ref) == 0);
  EXPECT_EQ_INT(res.num_recv, -1); /* cached: no host counts */
  if (normal_check_recv(&w, me, &res, 0, 1, &ref, "traced dispatch") != TEST_PASS) return TEST_FAIL;
  epx_ref_recv_free(&ref);
  if (normal_check_combine(&w, me, d.out, w.w[me], "traced combine") != TEST_PASS) return TEST_FAIL;
  EXPECT_NO_ASYNC_ERROR(g, __func__);

  printf(
      "  rank %d: %lld events, %lld dropped, clock spread %lld ns, drift %lld ns, timer "
      "step %lld ns\n",
      me, sum.num_events, sum.num_dropped, sum.clock_spread_ns, sum.clock_drift_ns,
      sum.timer_tick_ns);
  EXPECT_EQ_INT(sum.num_dropped, 0);
  if (me == 0) {
    json_value_t *root = NULL;
    trace_facts_t f;
    if (trace_load(path, &root, &f) != TEST_PASS) return TEST_FAIL;
    EXPECT_EQ_INT(f.num_ranks, R);
    EXPECT_EQ_INT(f.events, sum.num_events);
    for (int q = 0; q < R; q++) {
      EXPECTF(f.spans[q] > 0, "rank %d has no events in the trace", q);
      EXPECT_EQ_INT(f.clock_syncs[q], 2);
      if (check_rank_spans(root, &w, q, resolved.num_sms) != TEST_PASS) {
        fprintf(stderr, "  in the spans of rank %d\n", q);
        return TEST_FAIL;
      }
    }
    /* Every rank leaves the barrier once the last one arrived: after alignment the ends agree
     * within the alignment error (about a flag latency) plus the ranks' own exit skew. */
    long long ts, dur, arg, lo = 0, hi = 0;
    for (int q = 0; q < R; q++) {
      EXPECT(trace_find_span(root, q, "barrier", &ts, &dur, &arg) == 0);
      if (q == 0 || ts + dur < lo) lo = ts + dur;
      if (q == 0 || ts + dur > hi) hi = ts + dur;
    }
    printf("  barrier ends across ranks after alignment: spread %lld ns\n", hi - lo);
    EXPECTF(hi - lo < 50000, "barrier ends %lld ns apart: clocks not aligned", hi - lo);
    json_free(root);
    unlink(path);
  }
  world_dev_free(&d);
  world_free(&w);
  EXPECT_OK(epx_handle_destroy(h));
  EXPECT_OK(epx_group_destroy(g));
  return TEST_PASS;
}

EPX_GPU_TEST(trace_full_buffer_drops_and_stays_right, 120) {
  SKIP_IF_COMPILED_OUT();
  const int R = t->num_ranks, me = t->rank;
  uint64_t rng = t->seed;
  const normal_case_t c = {"full", {256, 512, 32, 4, ROUTE_UNIFORM, 256, -1}, 0};
  world_t w;
  world_make(&w, R, &c.world, WORLD_NORMAL, &rng);
  epx_group_config_t cfg = gpu_test_config(w.M, w.H, w.E, w.K);
  epx_group_t g = NULL;
  epx_handle_t h = NULL;
  EXPECT_OK(epx_group_create(t->comm, &cfg, &g));
  EXPECT_OK(epx_handle_create(g, &h));
  world_dev_t d;
  if (world_dev_make(&w, me, (size_t)R * w.M, &d) != TEST_PASS) return TEST_FAIL;
  EXPECT_OK(epx_trace_start(g, 32, t->stream));
  epx_dispatch_args_t a = EPX_DISPATCH_ARGS_INIT;
  a.x = d.x;
  a.topk_idx = d.idx;
  a.topk_weights = (const float *)d.w; /* check_recv compares them */
  a.num_tokens = w.ranks[me].num_tokens;
  epx_dispatch_result_t res;
  EXPECT_OK(epx_dispatch(g, h, &a, &res, t->stream));
  epx_combine_args_t ca = EPX_COMBINE_ARGS_INIT;
  ca.x = res.recv_x; /* rows back unchanged */
  ca.out = d.out;
  EXPECT_OK(epx_combine(g, h, &ca, t->stream));
  char path[128];
  trace_path(path, sizeof path, "full");
  epx_trace_summary_t sum;
  EXPECT_OK(epx_trace_dump(g, path, &sum, t->stream));
  EXPECT_EQ_INT(sum.num_events, 32 * R); /* 256 tokens alone overflow 32 slots */
  EXPECT(sum.num_dropped >= (long long)R * (256 - 32));

  epx_ref_recv_t ref;
  memset(&ref, 0, sizeof ref);
  EXPECT(epx_ref_dispatch(&w.ref, me, EPX_REF_PAYLOAD_BF16, 1, &ref) == 0);
  if (normal_check_recv(&w, me, &res, 0, 1, &ref, "dispatch, trace full") != TEST_PASS)
    return TEST_FAIL;
  /* Unweighted combine of unchanged rows: token t comes back times the ranks it went to. */
  if (normal_check_combine_unchanged(&w, me, d.out, "combine with a full trace buffer") !=
      TEST_PASS)
    return TEST_FAIL;
  epx_ref_recv_free(&ref);

  if (me == 0) {
    json_value_t *root = NULL;
    trace_facts_t f;
    if (trace_load(path, &root, &f) != TEST_PASS) return TEST_FAIL;
    EXPECT_EQ_INT(f.dropped, sum.num_dropped);
    for (int q = 0; q < R; q++) {
      EXPECT_EQ_INT(f.spans[q], 32);
      EXPECTF(f.dropped_per_rank[q] > 0 && f.labelled[q], "rank %d: drops not reported", q);
    }
    json_free(root);
    unlink(path);
  }
  world_dev_free(&d);
  world_free(&w);
  EXPECT_OK(epx_handle_destroy(h));
  EXPECT_OK(epx_group_destroy(g));
  return TEST_PASS;
}

EPX_GPU_TEST(trace_empty_ranks_and_usage_errors, 120) {
  SKIP_IF_COMPILED_OUT();
  const int R = t->num_ranks, me = t->rank;
  uint64_t rng = t->seed;
  const normal_case_t c = {"usage", {64, 512, 4 * R, 2, ROUTE_UNIFORM, 64, -1}, 0};
  world_t w;
  world_make(&w, R, &c.world, WORLD_NORMAL, &rng);
  epx_group_config_t cfg = gpu_test_config(64, 512, 4 * R, 2);
  epx_group_t g = NULL;
  epx_handle_t h = NULL;
  EXPECT_OK(epx_group_create(t->comm, &cfg, &g));
  EXPECT_OK(epx_handle_create(g, &h));
  world_dev_t d;
  if (world_dev_make(&w, me, (size_t)R * 64, &d) != TEST_PASS) return TEST_FAIL;
  epx_dispatch_args_t a = EPX_DISPATCH_ARGS_INIT;
  a.x = d.x;
  a.topk_idx = d.idx;
  a.topk_weights = (const float *)d.w; /* check_recv compares them */
  a.num_tokens = 64;
  epx_dispatch_result_t res;
  char path[128];
  trace_path(path, sizeof path, "empty");
  epx_trace_summary_t sum;

  /* Not tracing: every rank refuses the dump, naming a rank; nothing hangs. */
  EXPECT_STATUS(epx_trace_dump(g, path, &sum, t->stream), EPX_ERR_INVALID_USAGE);
  EXPECT(strstr(epx_last_error(), "not tracing") != NULL);
  EXPECT_STATUS(epx_trace_start(g, -1, t->stream), EPX_ERR_INVALID_ARGUMENT);
  EXPECT(strstr(epx_last_error(), "capacity") != NULL);

  /* Untraced work, then a window with nothing in it: no events anywhere, still a file. */
  EXPECT_OK(epx_dispatch(g, h, &a, &res, t->stream));
  EXPECT_OK(epx_trace_start(g, 0, t->stream));
  EXPECT_STATUS(epx_trace_start(g, 0, t->stream), EPX_ERR_INVALID_USAGE); /* already */
  EXPECT_OK(epx_trace_dump(g, path, &sum, t->stream));
  EXPECT_EQ_INT(sum.num_events, 0);
  EXPECT_EQ_INT(sum.num_dropped, 0);
  if (me == 0) {
    json_value_t *root = NULL;
    trace_facts_t f;
    if (trace_load(path, &root, &f) != TEST_PASS) return TEST_FAIL;
    EXPECT_EQ_INT(f.events, 0);
    for (int q = 0; q < R; q++) EXPECT_EQ_INT(f.clock_syncs[q], 2);
    json_free(root);
  }

  /* Events on rank 0 only (epx_layout is not collective). */
  EXPECT_OK(epx_trace_start(g, 0, t->stream));
  if (me == 0) {
    epx_layout_args_t la = EPX_LAYOUT_ARGS_INIT;
    la.topk_idx = d.idx;
    la.num_tokens = 64;
    la.num_tokens_per_rank = (int *)d.out;
    EXPECT_OK(epx_layout(g, &la, t->stream));
  }
  EXPECT_OK(epx_trace_dump(g, path, &sum, t->stream));
  EXPECT_EQ_INT(sum.num_events, 1);
  if (me == 0) {
    json_value_t *root = NULL;
    trace_facts_t f;
    if (trace_load(path, &root, &f) != TEST_PASS) return TEST_FAIL;
    EXPECT_EQ_INT(f.spans[0], 1);
    for (int q = 1; q < R; q++) EXPECT_EQ_INT(f.spans[q], 0);
    EXPECT_EQ_INT(trace_count_spans(root, 0, "layout"), 1);
    json_free(root);
    unlink(path);
  }

  /* Barrier epochs stayed in step through all of it: the group still works. */
  EXPECT_OK(epx_group_barrier(g, t->stream));
  EXPECT_OK(epx_dispatch(g, h, &a, &res, t->stream));
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  epx_ref_recv_t ref;
  memset(&ref, 0, sizeof ref);
  EXPECT(epx_ref_dispatch(&w.ref, me, EPX_REF_PAYLOAD_BF16, 1, &ref) == 0);
  if (normal_check_recv(&w, me, &res, 0, 1, &ref, "after trace usage") != TEST_PASS)
    return TEST_FAIL;
  epx_ref_recv_free(&ref);
  EXPECT_NO_ASYNC_ERROR(g, __func__);
  world_dev_free(&d);
  world_free(&w);
  EXPECT_OK(epx_handle_destroy(h));
  EXPECT_OK(epx_group_destroy(g));
  return TEST_PASS;
}

/* One dispatch on a fresh group created under the current environment, then destroy. */
static int dispatch_once(epx_test_rank_t *t, const world_t *w, const world_dev_t *d) {
  epx_group_config_t cfg = gpu_test_config(64, 512, 4 * t->num_ranks, 2);
  epx_group_t g = NULL;
  epx_handle_t h = NULL;
  EXPECT_OK(epx_group_create(t->comm, &cfg, &g));
  EXPECT_OK(epx_handle_create(g, &h));
  epx_dispatch_args_t a = EPX_DISPATCH_ARGS_INIT;
  a.x = d->x;
  a.topk_idx = d->idx;
  a.num_tokens = w->ranks[t->rank].num_tokens;
  epx_dispatch_result_t res;
  EXPECT_OK(epx_dispatch(g, h, &a, &res, t->stream));
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  EXPECT_OK(epx_handle_destroy(h));
  EXPECT_OK(epx_group_destroy(g)); /* writes the EPX_TRACE file */
  return TEST_PASS;
}

EPX_PEER_TEST(trace_env_traces_group_lifetime, 120) {
  SKIP_IF_COMPILED_OUT();
  const int R = t->num_ranks, me = t->rank;
  uint64_t rng = t->seed;
  const normal_case_t c = {"env", {64, 512, 4 * R, 2, ROUTE_UNIFORM, 64, -1}, 0};
  world_t w;
  world_make(&w, R, &c.world, WORLD_NORMAL, &rng);
  world_dev_t d;
  if (world_dev_make(&w, me, (size_t)R * 64, &d) != TEST_PASS) return TEST_FAIL;
  char path[128], second[128], third[128];
  trace_path(path, sizeof path, "env");
  snprintf(second, sizeof second, "%.*s.g1.json", (int)(strlen(path) - 5), path);
  snprintf(third, sizeof third, "%.*s.g2.json", (int)(strlen(path) - 5), path);

  setenv("EPX_TRACE", path, 1);
  if (dispatch_once(t, &w, &d) != TEST_PASS) return TEST_FAIL; /* -> path */
  if (dispatch_once(t, &w, &d) != TEST_PASS) return TEST_FAIL; /* -> path.g1 */
  if (me != 0) unsetenv("EPX_TRACE");                          /* rank 0 only: not traced */
  if (dispatch_once(t, &w, &d) != TEST_PASS) return TEST_FAIL;
  unsetenv("EPX_TRACE");

  if (me == 0) {
    const char *files[2] = {path, second};
    for (int i = 0; i < 2; i++) {
      json_value_t *root = NULL;
      trace_facts_t f;
      if (trace_load(files[i], &root, &f) != TEST_PASS) return TEST_FAIL;
      for (int q = 0; q < R; q++)
        EXPECT_EQ_INT(trace_count_spans(root, q, "dispatch token"), w.ranks[q].num_tokens);
      json_free(root);
      unlink(files[i]);
    }
    EXPECTF(access(third, F_OK) != 0, "%s written though EPX_TRACE was set on rank 0 only", third);
  }
  world_dev_free(&d);
  world_free(&w);
  return TEST_PASS;
}

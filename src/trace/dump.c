/*
 * dump.c - epx_trace_dump: stop recording, agree, gather every rank's events to rank 0 and
 * write one Chrome trace file there (docs/profiling.md; the writer is json.c).
 *
 * A dump is collective and never leaves a rank waiting: every rank runs the clock kernel (so
 * the barrier epochs stay in step) and all-gathers a small header (status, event count,
 * capacity, clock stamps) even when it has nothing to send; every rank then takes the same
 * decision from the same data. The all-gathers are the group's bounded agreement (agree.h,
 * through the workspace), so a dead or late peer costs a budget and an error, not a hang.
 * Events travel to rank 0 with NCCL send/recv, sized by the headers (zero-sized transfers are
 * skipped), waited for within the budget. Rank 0 writes the file.
 * Invariant: from the header all-gather on, every rank takes the same branches.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "agree.h"
#include "checks.h"
#include "kernels/api.h"
#include "registry.h"
#include "trace_internal.h"

#define K EPX_TRACE_SYNC_ROUNDS
#define HDR EPX_TRACE_HDR_WORDS
_Static_assert(EPX_TRACE_HDR_WORDS <= EPX_AGREE_MAX_WORDS, "a header is one agreement's words");

/* 1. Local: the second clock measurement and the ring's counter, into this rank's header
 * mine[HDR]. Returns the local status (its message in epx_last_error()). */
static epx_status_t measure(epx_group_t g, int tracing, cudaStream_t stream, long long *mine) {
  struct epx__trace *tr = g->trace;
  epx__kernel_ctx_t ctx;
  epx__group_kernel_ctx(g, &ctx);
  unsigned long long ring_hdr[2] = {0, 0}, sync[2][EPX_TRACE_SYNC_WORDS];
  memset(sync, 0, sizeof sync);
  epx_status_t local = epx__clock_sync_launch(&ctx, tr->sync_dev + EPX_TRACE_SYNC_WORDS, K, stream);
  if (local == EPX_OK && tracing)
    local = CUDA_STATUS(
        cudaMemcpyAsync(ring_hdr, tr->ring, sizeof ring_hdr, cudaMemcpyDeviceToHost, stream));
  if (local == EPX_OK)
    local = CUDA_STATUS(
        cudaMemcpyAsync(sync, tr->sync_dev, sizeof sync, cudaMemcpyDeviceToHost, stream));
  if (local == EPX_OK) local = CUDA_STATUS(cudaStreamSynchronize(stream));

  memset(mine, 0, HDR * sizeof *mine);
  mine[EPX_TRACE_HDR_STATUS] = local != EPX_OK ? local : tracing ? EPX_OK : EPX_ERR_INVALID_USAGE;
  if (local == EPX_OK && tracing) {
    mine[EPX_TRACE_HDR_COUNT] = (long long)ring_hdr[0];
    mine[EPX_TRACE_HDR_CAPACITY] = (long long)ring_hdr[1];
    mine[EPX_TRACE_HDR_TICK] = (long long)(sync[0][0] > sync[1][0] ? sync[0][0] : sync[1][0]);
    for (int k = 0; k < K; k++) {
      mine[EPX_TRACE_HDR_START + k] = (long long)sync[0][1 + k];
      mine[EPX_TRACE_HDR_END + k] = (long long)sync[1][1 + k];
    }
  }
  return local;
}

/* 3. The same decision on every rank, from the gathered headers: 1 to go on; else 0 with the
 * status to return in *res (EPX_OK when quiet_if_off and no rank was tracing). */
static int decide(const long long *all, int R, int me, epx_status_t local, const char *local_msg,
                  int quiet_if_off, epx_status_t *res) {
  int off = 0, bad = -1;
  for (int q = 0; q < R; q++) {
    off += all[q * HDR + EPX_TRACE_HDR_STATUS] == EPX_ERR_INVALID_USAGE;
    if (bad < 0 && all[q * HDR + EPX_TRACE_HDR_STATUS] != EPX_OK) bad = q;
  }
  if (bad < 0) return 1;
  const epx_status_t st = (epx_status_t)all[bad * HDR + EPX_TRACE_HDR_STATUS];
  if (quiet_if_off && off == R)
    *res = EPX_OK;
  else if (bad == me && local != EPX_OK)
    *res = epx__set_error(local, "%s", local_msg);
  else if (st == EPX_ERR_INVALID_USAGE)
    *res = epx__set_error(EPX_ERR_INVALID_USAGE,
                          "epx_trace_dump: rank %d was not tracing; call epx_trace_start on "
                          "every rank first (nothing written)",
                          bad);
  else
    *res = epx__set_error(EPX_ERR_INVALID_USAGE,
                          "epx_trace_dump: rank %d failed (%s); see its log (nothing written)", bad,
                          epx_status_string(st));
  return 0;
}

/* Rank q's clock model and counts from the gathered headers (the same on every rank). */
static void rank_from_headers(const long long *all, int q, epx__trace_rank_t *r) {
  const long long *h = all + (size_t)q * HDR, *h0 = all;
  memset(r, 0, sizeof *r);
  const unsigned long long count = (unsigned long long)h[EPX_TRACE_HDR_COUNT];
  r->capacity = (unsigned long long)h[EPX_TRACE_HDR_CAPACITY];
  r->num_events = count < r->capacity ? count : r->capacity;
  r->num_dropped = count - r->num_events;
  r->timer_tick_ns = h[EPX_TRACE_HDR_TICK];
  epx__trace_clock_model((const unsigned long long *)(h + EPX_TRACE_HDR_START),
                         (const unsigned long long *)(h0 + EPX_TRACE_HDR_START), r);
}

/* The second agreement, then the events of every rank into `host` on rank 0 ([sum of n]
 * events; others send theirs and pass NULL). Every rank takes part whatever happened before
 * (so every rank runs the dump's two agreements and their counts stay equal): local_ready says
 * whether this rank can transfer (its earlier steps went well; rank 0 has room), and the
 * transfer happens only if every rank can, so that no sender or receiver is left waiting.
 * skip: the ranks the first agreement gave up on. */
static epx_status_t gather_events(epx_group_t g, const unsigned long long *n,
                                  epx__trace_event_t *host, cudaStream_t stream, int go,
                                  int local_ready, unsigned skip) {
  const int R = g->num_ranks, me = g->rank;
  const size_t ev = sizeof(epx__trace_event_t);
  const epx__trace_event_t *mine = g->trace->ring ? epx__trace_events(g->trace->ring) : NULL;
  unsigned long long remote = 0;
  for (int q = 1; q < R; q++) remote += n[q];
  epx__trace_event_t *recv = NULL;
  epx_status_t res = EPX_OK;
  if (me == 0 && local_ready && remote && cudaMalloc((void **)&recv, remote * ev) != cudaSuccess) {
    (void)cudaGetLastError();
    local_ready = 0;
  }
  {
    long long words[EPX_MAX_RANKS] = {0};
    const long long ready = local_ready;
    EPX_CHECK_GOTO(epx__agree_group(g, stream, &ready, 1, words, "epx_trace_dump", skip, NULL), res,
                   exit);
    if (!go) goto exit; /* every rank decided to stop; the agreement kept the counts equal */
    if (!words[0]) {
      res = epx__set_error(EPX_ERR_SYSTEM,
                           "epx_trace_dump: rank 0 has no memory for %llu events (nothing written)",
                           remote + n[0]);
      goto exit;
    }
    for (int q = 1; q < R; q++)
      if (!words[q]) {
        res = epx__set_error(EPX_ERR_SYSTEM,
                             "epx_trace_dump: rank %d could not take part in the transfer; "
                             "nothing written",
                             q);
        goto exit;
      }
  }
  ncclResult_t nr = ncclGroupStart();
  if (nr == ncclSuccess) {
    unsigned long long off = 0;
    for (int q = 1; q < R; q++) {
      if (me == 0 && n[q] && nr == ncclSuccess)
        nr = ncclRecv(recv + off, n[q] * ev, ncclUint8, q, g->comm, stream);
      off += n[q];
    }
    if (me != 0 && n[me] && nr == ncclSuccess)
      nr = ncclSend(mine, n[me] * ev, ncclUint8, 0, g->comm, stream);
    const ncclResult_t ne = ncclGroupEnd();
    if (nr == ncclSuccess) nr = ne;
  }
  EPX_CHECK_GOTO(NCCL_STATUS(nr), res, exit);
  /* Every rank agreed just before, so the peers are there; a peer that dies in between leaves
   * the transfer pending, and this wait gives up instead of hanging. It comes before the copies
   * to the host: a copy into pageable memory would wait for the transfer unbounded. */
  res = epx__agree_wait_stream(stream, epx__group_nccl_timeout_ms(g->config.timeout_ms),
                               "epx_trace_dump's NCCL transfer");
  if (res == EPX_ERR_TIMEOUT) {
    g->nccl_pending = 1;
    EPX_WARN("epx_trace_dump: %llu bytes of device memory left to the pending transfer",
             remote * (unsigned long long)ev);
    return res; /* recv stays with the pending transfer */
  }
  if (res != EPX_OK) goto exit;
  if (me == 0 && n[0])
    CUDA_CHECK_GOTO(cudaMemcpyAsync(host, mine, n[0] * ev, cudaMemcpyDeviceToHost, stream), res,
                    exit);
  if (me == 0 && remote)
    CUDA_CHECK_GOTO(cudaMemcpyAsync(host + n[0], recv, remote * ev, cudaMemcpyDeviceToHost, stream),
                    res, exit);
  CUDA_CHECK_GOTO(cudaStreamSynchronize(stream), res, exit);
exit:
  if (recv) cudaFree(recv);
  return res;
}

/* Totals, the largest clock spread, drift and timer step over the ranks. */
static void summarize(int R, const epx__trace_rank_t *ranks, epx_trace_summary_t *summary) {
  for (int q = 0; q < R; q++) {
    const epx__trace_rank_t *r = &ranks[q];
    const long long drift = r->sync_local_ns[1] ? llabs(r->offset_ns[1] - r->offset_ns[0]) : 0;
    summary->num_events += (long long)r->num_events;
    summary->num_dropped += (long long)r->num_dropped;
    if (r->spread_ns > summary->clock_spread_ns) summary->clock_spread_ns = r->spread_ns;
    if (drift > summary->clock_drift_ns) summary->clock_drift_ns = drift;
    if (r->timer_tick_ns > summary->timer_tick_ns) summary->timer_tick_ns = r->timer_tick_ns;
  }
}

static epx_status_t write_file(const char *path, int R, const epx__trace_rank_t *ranks) {
  FILE *f = fopen(path, "w");
  if (!f)
    return epx__set_error(EPX_ERR_SYSTEM, "epx_trace_dump: cannot open %s for writing: %s", path,
                          strerror(errno));
  epx_status_t res = epx__trace_write_json(f, R, ranks);
  if (fclose(f) != 0 && res == EPX_OK)
    res = epx__set_error(EPX_ERR_SYSTEM, "epx_trace_dump: writing %s failed: %s", path,
                         strerror(errno));
  return res;
}

/* Rank 0, after the gather: the ranks' events in host[] (n[q] each, in rank order), warnings
 * for dropped events, then the file (none when path is NULL). */
static epx_status_t write_on_rank0(const char *path, int R, epx__trace_rank_t *ranks,
                                   const unsigned long long *n, const epx__trace_event_t *host,
                                   unsigned long long total) {
  unsigned long long at = 0;
  for (int q = 0; q < R; q++) {
    ranks[q].events = host + at;
    at += n[q];
    if (ranks[q].num_dropped)
      EPX_WARN(
          "trace: rank %d dropped %llu events (its buffer holds %llu); raise the capacity "
          "(epx_trace_start, EPX_TRACE_EVENTS)",
          q, ranks[q].num_dropped, ranks[q].capacity);
  }
  if (!path) return EPX_OK;
  const epx_status_t res = write_file(path, R, ranks);
  if (res == EPX_OK)
    EPX_INFO(EPX_SUBSYS_GROUP, "trace written to %s: %llu events from %d ranks", path, total, R);
  return res;
}

epx_status_t epx__trace_dump(epx_group_t g, const char *path, epx_trace_summary_t *summary,
                             cudaStream_t stream, int quiet_if_off) {
  const int R = g->num_ranks, me = g->rank;
  if (summary) memset(summary, 0, sizeof *summary);
  if (epx__trace_stream_capturing(stream))
    return epx__set_error(EPX_ERR_INVALID_USAGE,
                          "epx_trace_dump: stream is being captured into a CUDA graph");
  EPX_CHECK(epx__group_check_collective(g, "epx_trace_dump"));
  EPX_CHECK(epx__trace_state_ensure(g));
  const int tracing = g->trace_ring != NULL;
  g->trace_ring = NULL; /* kernels launched from now on do not record */

  /* 1. Local: the second clock measurement, the buffer's counter, both clock stamps. */
  long long mine[HDR];
  const epx_status_t local = measure(g, tracing, stream, mine);
  char local_msg[512];
  snprintf(local_msg, sizeof local_msg, "%s", epx_last_error());

  /* 2. Everyone learns everyone's status, counts and clock stamps (the first agreement). */
  long long all[EPX_MAX_RANKS * HDR];
  unsigned gave_up = 0;
  epx_status_t res = epx__agree_group(g, stream, mine, HDR, all, "epx_trace_dump", 0, &gave_up);
  /* 3. The same decision on every rank that has the headers. */
  const int go = res == EPX_OK && decide(all, R, me, local, local_msg, quiet_if_off, &res);
  const epx_status_t first = res;

  /* 4. Clock models and counts, room for the events on rank 0, then the second agreement and
   *    the events to rank 0 (every rank takes part in the agreement, go or not). */
  epx__trace_rank_t ranks[EPX_MAX_RANKS];
  memset(ranks, 0, sizeof ranks);
  epx__trace_event_t *host = NULL;
  unsigned long long n[EPX_MAX_RANKS] = {0}, total = 0;
  for (int q = 0; go && q < R; q++) {
    rank_from_headers(all, q, &ranks[q]);
    n[q] = ranks[q].num_events;
    total += n[q];
  }
  if (go && me == 0) host = (epx__trace_event_t *)malloc((total + 1) * sizeof *host);
  char first_msg[512]; /* not go: the first step's outcome stands, its message too */
  snprintf(first_msg, sizeof first_msg, "%s", epx_last_error());
  res = gather_events(g, n, host, stream, go, go && (me != 0 || host), gave_up);
  if (!go) {
    free(host);
    return epx__set_error(first, "%s", first_msg); /* EPX_OK: quiet, nothing written */
  }
  if (res == EPX_OK && summary) summarize(R, ranks, summary);
  if (res == EPX_OK && me == 0) res = write_on_rank0(path, R, ranks, n, host, total);
  free(host);
  return res;
}

EPX_EXPORT epx_status_t epx_trace_dump(epx_group_t g, const char *path,
                                       epx_trace_summary_t *summary, cudaStream_t stream) {
  EPX_CHECK(epx__group_check(g));
  return epx__trace_dump(g, path, summary, stream, 0);
}

/*
 * trace.c - in-kernel tracing, host side: epx_trace_start / epx_trace_dump, EPX_TRACE, clock
 * alignment across GPUs and the Chrome trace writer (docs/profiling.md; format in trace.h).
 *
 * Clock alignment. Each GPU stamps events with its own %globaltimer. At start and at dump the
 * ranks run EPX_TRACE_SYNC_ROUNDS barrier rounds in one kernel (barrier.cu) and stamp the end
 * of each round; all ranks leave a round within about one flag latency of each other, so
 * stamp_q[r] - stamp_0[r] estimates rank q's offset from rank 0. The median over rounds is the
 * offset, max - min the jitter. Between the two measurements the offset is interpolated
 * linearly (drift), outside them it is held. Error: one flag latency plus one timer step.
 *
 * A dump is collective and never leaves a rank waiting: every rank runs the clock kernel (so
 * the barrier epochs stay in step) and all-gathers a small header (status, event count,
 * capacity, clock stamps) even when it has nothing to send; every rank then takes the same
 * decision from the same data. Events travel to rank 0 with NCCL send/recv, sized by the
 * headers (zero-sized transfers are skipped). Rank 0 writes the file.
 */
#include "trace.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "checks.h"
#include "group.h"
#include "kernels/api.h"
#include "registry.h"
#include "param.h"

/* ------------------------------------------------------------------------------------------
 * Tags
 * ---------------------------------------------------------------------------------------- */
static const char *const tag_labels[] = {
#define EPX_TRACE_TAG_LABEL_(name, cat, label, arg) label,
    EPX_TRACE_TAG_MAP(EPX_TRACE_TAG_LABEL_)
#undef EPX_TRACE_TAG_LABEL_
};
static const char *const tag_categories[] = {
#define EPX_TRACE_TAG_CAT_(name, cat, label, arg) cat,
    EPX_TRACE_TAG_MAP(EPX_TRACE_TAG_CAT_)
#undef EPX_TRACE_TAG_CAT_
};
static const char *const tag_args[] = {
#define EPX_TRACE_TAG_ARG_(name, cat, label, arg) arg,
    EPX_TRACE_TAG_MAP(EPX_TRACE_TAG_ARG_)
#undef EPX_TRACE_TAG_ARG_
};

const char *epx__trace_tag_label(int tag) {
  return tag >= 0 && tag < EPX_TRACE_NUM_TAGS ? tag_labels[tag] : "tag";
}
const char *epx__trace_tag_category(int tag) {
  return tag >= 0 && tag < EPX_TRACE_NUM_TAGS ? tag_categories[tag] : "epx";
}
const char *epx__trace_tag_arg(int tag) {
  return tag >= 0 && tag < EPX_TRACE_NUM_TAGS ? tag_args[tag] : "arg";
}

/* ------------------------------------------------------------------------------------------
 * Clock alignment (pure)
 * ---------------------------------------------------------------------------------------- */
static int compare_ll(const void *a, const void *b) {
  const long long x = *(const long long *)a, y = *(const long long *)b;
  return (x > y) - (x < y);
}

int epx__trace_clock_offset(const unsigned long long *mine, const unsigned long long *ref,
                            int rounds, long long *offset_ns, long long *spread_ns) {
  long long diff[64];
  int n = 0;
  for (int r = 0; r < rounds && n < 64; r++)
    if (mine[r] && ref[r]) diff[n++] = (long long)(mine[r] - ref[r]);
  *offset_ns = 0;
  *spread_ns = 0;
  if (n == 0) return 0;
  qsort(diff, (size_t)n, sizeof diff[0], compare_ll);
  *offset_ns = n % 2 ? diff[n / 2] : diff[n / 2 - 1] + (diff[n / 2] - diff[n / 2 - 1]) / 2;
  *spread_ns = diff[n - 1] - diff[0];
  return n;
}

long long epx__trace_align(const epx__trace_rank_t *r, unsigned long long t) {
  const unsigned long long a0 = r->sync_local_ns[0], a1 = r->sync_local_ns[1];
  long long off = r->offset_ns[0];
  if (!r->clock_valid)
    off = 0;
  else if (a1 > a0 && t >= a1)
    off = r->offset_ns[1];
  else if (a1 > a0 && t > a0)
    off += (long long)((double)(r->offset_ns[1] - r->offset_ns[0]) * (double)(t - a0) /
                       (double)(a1 - a0));
  /* NOTE: times are ~1e18 ns since an epoch; only differences go through a double. */
  return (long long)t - off;
}

/* ------------------------------------------------------------------------------------------
 * The Chrome trace writer (pure). One object: otherData (run facts, per-rank counts and clock
 * figures) and traceEvents: per rank, metadata (process and thread names, a label when events
 * were dropped), two clock-sync instants, then its spans as complete ("X") events sorted by
 * start (longer first on ties, so nested spans arrive parent first). Times are microseconds
 * with nanosecond decimals from the earliest aligned time of the file.
 * ---------------------------------------------------------------------------------------- */
typedef struct {
  long long start; /* aligned, ns */
  unsigned dur;
  int tid;
  unsigned index;
} sorted_event_t;

static int compare_events(const void *a, const void *b) {
  const sorted_event_t *x = (const sorted_event_t *)a, *y = (const sorted_event_t *)b;
  if (x->start != y->start) return x->start < y->start ? -1 : 1;
  if (x->dur != y->dur) return x->dur > y->dur ? -1 : 1;
  if (x->tid != y->tid) return x->tid < y->tid ? -1 : 1;
  return (x->index > y->index) - (x->index < y->index);
}

static int compare_int(const void *a, const void *b) {
  const int x = *(const int *)a, y = *(const int *)b;
  return (x > y) - (x < y);
}

/* Track of a block/warp: "block B warp W" is tid (B + 1) * 100 + W (warps < 32), readable in
 * the viewers' tooltips; tid 99 is the clock-sync track. Every tid is above every pid (ranks
 * < 8): viewers treat tid == pid as a process's main thread. */
static int tid_of(const epx__trace_event_t *e) {
  return ((int)e->block + 1) * 100 + (int)e->warp;
}
#define CLOCK_TID 99

/* ns as microseconds with three decimals, exactly (no floating point). */
static const char *us(char *buf, long long ns) {
  const char *sign = ns < 0 ? "-" : "";
  const unsigned long long a = ns < 0 ? 0ull - (unsigned long long)ns : (unsigned long long)ns;
  snprintf(buf, 32, "%s%llu.%03llu", sign, a / 1000, a % 1000);
  return buf;
}

static void write_other_data(FILE *f, int R, const epx__trace_rank_t *ranks, long long origin) {
  unsigned long long events = 0, dropped = 0;
  for (int q = 0; q < R; q++) events += ranks[q].num_events, dropped += ranks[q].num_dropped;
  fprintf(f,
          "{\"displayTimeUnit\":\"ns\",\n\"otherData\":{\"generator\":\"EPX %d.%d.%d\","
          "\"ranks\":%d,\"events\":%llu,\"dropped\":%llu,\"ts_origin_ns\":%lld,\n"
          "\"clock\":\"each rank's %%globaltimer mapped onto rank 0's: offsets measured by %d "
          "barrier rounds at trace start and at dump (median), linear in between; error about "
          "one flag latency plus one timer step (docs/profiling.md)\",\n\"per_rank\":[",
          EPX_VERSION_MAJOR, EPX_VERSION_MINOR, EPX_VERSION_PATCH, R, events, dropped, origin,
          EPX_TRACE_SYNC_ROUNDS);
  for (int q = 0; q < R; q++) {
    const epx__trace_rank_t *r = &ranks[q];
    fprintf(f,
            "%s\n {\"rank\":%d,\"events\":%llu,\"dropped\":%llu,\"capacity\":%llu,"
            "\"clock_aligned\":%s,\"clock_offset_ns\":[%lld,%lld],\"clock_spread_ns\":%lld,"
            "\"timer_tick_ns\":%lld}",
            q ? "," : "", q, r->num_events, r->num_dropped, r->capacity,
            r->clock_valid ? "true" : "false", r->offset_ns[0],
            r->sync_local_ns[1] ? r->offset_ns[1] : r->offset_ns[0], r->spread_ns,
            r->timer_tick_ns);
  }
  fprintf(f, "]},\n\"traceEvents\":[\n");
}

/* Process and thread names of rank q; `tids` are its event tracks, sorted. */
static void write_rank_metadata(FILE *f, int q, const epx__trace_rank_t *r, const int *tids,
                                size_t num_tids, int *first) {
  fprintf(f,
          "%s{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"args\":{\"name\":\"rank %d\"}}",
          *first ? "" : ",\n", q, q);
  *first = 0;
  fprintf(
      f,
      ",\n{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":%d,\"args\":{\"sort_index\":%d}}",
      q, q);
  if (r->num_dropped)
    fprintf(f,
            ",\n{\"name\":\"process_labels\",\"ph\":\"M\",\"pid\":%d,\"args\":{\"labels\":"
            "\"DROPPED %llu events: buffer of %llu full\"}}",
            q, r->num_dropped, r->capacity);
  fprintf(f,
          ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":"
          "\"clock sync\"}}",
          q, CLOCK_TID);
  for (size_t i = 0; i < num_tids; i++) {
    if (i && tids[i] == tids[i - 1]) continue;
    fprintf(f,
            ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":"
            "\"block %d warp %d\"}}",
            q, tids[i], tids[i] / 100 - 1, tids[i] % 100);
    fprintf(f,
            ",\n{\"name\":\"thread_sort_index\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,\"args\":{"
            "\"sort_index\":%d}}",
            q, tids[i], tids[i]);
  }
}

epx_status_t epx__trace_write_json(FILE *f, int R, const epx__trace_rank_t *ranks) {
  /* Origin: the earliest aligned time of any event or sync point. */
  long long origin = 0;
  int have_origin = 0;
  size_t most = 0;
  for (int q = 0; q < R; q++) {
    const epx__trace_rank_t *r = &ranks[q];
    if (r->num_events > most) most = (size_t)r->num_events;
    for (int s = 0; s < 2; s++)
      if (r->sync_local_ns[s]) {
        const long long t = epx__trace_align(r, r->sync_local_ns[s]);
        if (!have_origin || t < origin) origin = t, have_origin = 1;
      }
    for (unsigned long long i = 0; i < r->num_events; i++) {
      const long long t = epx__trace_align(r, r->events[i].start_ns);
      if (!have_origin || t < origin) origin = t, have_origin = 1;
    }
  }
  sorted_event_t *order = (sorted_event_t *)malloc((most + 1) * sizeof *order);
  int *tids = (int *)malloc((most + 1) * sizeof *tids);
  if (!order || !tids) {
    free(order);
    free(tids);
    return epx__set_error(EPX_ERR_SYSTEM, "trace writer: out of host memory (%zu events)", most);
  }

  write_other_data(f, R, ranks, origin);
  int first = 1;
  char b1[32], b2[32];
  for (int q = 0; q < R; q++) {
    const epx__trace_rank_t *r = &ranks[q];
    const size_t n = (size_t)r->num_events;
    for (size_t i = 0; i < n; i++) {
      order[i].start = epx__trace_align(r, r->events[i].start_ns) - origin;
      order[i].dur = r->events[i].dur_ns;
      order[i].tid = tids[i] = tid_of(&r->events[i]);
      order[i].index = (unsigned)i;
    }
    qsort(tids, n, sizeof *tids, compare_int);
    write_rank_metadata(f, q, r, tids, n, &first);
    for (int s = 0; s < 2; s++) {
      if (!r->sync_local_ns[s]) continue;
      fprintf(f,
              ",\n{\"name\":\"clock sync\",\"cat\":\"trace\",\"ph\":\"i\",\"s\":\"t\",\"pid\":%d,"
              "\"tid\":%d,\"ts\":%s,\"args\":{\"offset_ns\":%lld,\"spread_ns\":%lld}}",
              q, CLOCK_TID, us(b1, epx__trace_align(r, r->sync_local_ns[s]) - origin),
              r->offset_ns[s], r->spread_ns);
    }
    qsort(order, n, sizeof *order, compare_events);
    for (size_t i = 0; i < n; i++) {
      const epx__trace_event_t *e = &r->events[order[i].index];
      fprintf(f,
              ",\n{\"name\":\"%s\",\"cat\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%s,"
              "\"dur\":%s,\"args\":{\"%s\":%d,\"sm\":%u}}",
              epx__trace_tag_label(e->tag), epx__trace_tag_category(e->tag), q, order[i].tid,
              us(b1, order[i].start), us(b2, (long long)e->dur_ns), epx__trace_tag_arg(e->tag),
              e->arg, (unsigned)e->sm);
    }
  }
  fprintf(f, "\n]}\n");
  free(order);
  free(tids);
  if (fflush(f) != 0 || ferror(f))
    return epx__set_error(EPX_ERR_SYSTEM, "trace writer: write failed (%s)", strerror(errno));
  return EPX_OK;
}

/* ------------------------------------------------------------------------------------------
 * The group's trace state
 * ---------------------------------------------------------------------------------------- */
#define K EPX_TRACE_SYNC_ROUNDS
#define SYNC_WORDS (1 + K) /* one clock measurement: the timer step, then K round stamps */

/* Header each rank contributes to a dump's all-gather (int64 words). */
enum {
  HDR_STATUS,
  HDR_COUNT,
  HDR_CAPACITY,
  HDR_TICK,
  HDR_START,
  HDR_END = HDR_START + K,
  HDR = HDR_END + K
};

#define EPX_TRACE_MAX_RETIRED 8

struct epx__trace {
  epx__trace_ring_t *ring;      /* device: header + capacity events; NULL before the first start */
  unsigned long long capacity;  /* of ring */
  unsigned long long *sync_dev; /* device [2][SYNC_WORDS]: the clock at start, at dump */
  long long *hdr_dev;           /* device [(R + 1) x HDR]: the all-gather (own header last) */
  char *env_path;               /* EPX_TRACE destination of this group, or NULL */
  /* Rings of earlier capacities, freed at destroy: graphs captured while tracing may hold them. */
  epx__trace_ring_t *retired[EPX_TRACE_MAX_RETIRED];
  int num_retired;
};

static epx_status_t ensure_state(epx_group_t g) {
  if (g->trace) return EPX_OK;
  struct epx__trace *tr = (struct epx__trace *)calloc(1, sizeof *tr);
  if (!tr) return epx__set_error(EPX_ERR_SYSTEM, "trace: out of host memory");
  epx_status_t res = EPX_OK;
  CUDA_CHECK_GOTO(cudaMalloc((void **)&tr->sync_dev, 2 * SYNC_WORDS * sizeof(unsigned long long)),
                  res, fail);
  CUDA_CHECK_GOTO(
      cudaMalloc((void **)&tr->hdr_dev, (size_t)(g->num_ranks + 1) * HDR * sizeof(long long)), res,
      fail);
  g->trace = tr;
  return EPX_OK;
fail:
  if (tr->sync_dev) (void)CUDA_STATUS(cudaFree(tr->sync_dev)); /* logged; res is the cause */
  free(tr);
  return res;
}

static int stream_is_capturing(cudaStream_t stream) {
  enum cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &st) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return st != cudaStreamCaptureStatusNone;
}

static epx_status_t trace_start(epx_group_t g, int capacity, cudaStream_t stream, const char *fn) {
#if !EPX_TRACE_COMPILED
  (void)g, (void)capacity, (void)stream;
  return epx__set_error(EPX_ERR_UNSUPPORTED,
                        "%s: this EPX was built with TRACE=0 (tracing compiled out)", fn);
#else
  EPX_ARG_CHECK(capacity >= 0 && capacity <= EPX_TRACE_MAX_EVENTS,
                "%s: capacity = %d: must be 0 (auto) or 1..%d events", fn, capacity,
                EPX_TRACE_MAX_EVENTS);
  if (g->trace_ring)
    return epx__set_error(EPX_ERR_INVALID_USAGE,
                          "%s: the group is already tracing; call epx_trace_dump first", fn);
  if (stream_is_capturing(stream))
    return epx__set_error(EPX_ERR_INVALID_USAGE,
                          "%s: stream is being captured into a CUDA graph; start tracing outside "
                          "the capture",
                          fn);
  long long cap = capacity;
  if (cap == 0) {
    cap = epx__param_TraceEvents();
    if (cap < 1 || cap > EPX_TRACE_MAX_EVENTS) {
      EPX_WARN("EPX_TRACE_EVENTS=%lld is outside 1..%d; using %d", cap, EPX_TRACE_MAX_EVENTS,
               EPX_TRACE_DEFAULT_EVENTS);
      cap = EPX_TRACE_DEFAULT_EVENTS;
    }
  }
  EPX_CHECK(ensure_state(g));
  struct epx__trace *tr = g->trace;
  if (!tr->ring || tr->capacity != (unsigned long long)cap) {
    /* A graph captured while tracing still writes to the old ring when replayed: keep it
     * until the group is destroyed rather than free memory a graph may write. */
    if (tr->ring) {
      if (tr->num_retired == EPX_TRACE_MAX_RETIRED)
        return epx__set_error(EPX_ERR_UNSUPPORTED,
                              "%s: capacity changed more than %d times on this group; keep one "
                              "capacity (or create a new group)",
                              fn, EPX_TRACE_MAX_RETIRED);
      tr->retired[tr->num_retired++] = tr->ring;
    }
    tr->ring = NULL;
    CUDA_CHECK(cudaMalloc((void **)&tr->ring,
                          sizeof(epx__trace_ring_t) + (size_t)cap * sizeof(epx__trace_event_t)));
    tr->capacity = (unsigned long long)cap;
  }
  /* Empty the buffer before this start's kernels see it (graphs captured during an earlier
   * trace with this ring would record into it again when replayed: the dump counts them). */
  const epx__trace_ring_t empty = {0, tr->capacity};
  CUDA_CHECK(
      cudaMemcpyAsync(tr->ring, &empty, sizeof empty, cudaMemcpyHostToDevice, g->setup_stream));
  CUDA_CHECK(cudaStreamSynchronize(g->setup_stream));
  epx__kernel_ctx_t ctx;
  epx__group_kernel_ctx(g, &ctx);
  EPX_CHECK(epx__clock_sync_launch(&ctx, tr->sync_dev, K, stream));
  g->trace_ring = tr->ring;
  EPX_INFO(EPX_SUBSYS_GROUP, "trace started: %llu events per rank", tr->capacity);
  return EPX_OK;
#endif
}

EPX_EXPORT epx_status_t epx_trace_start(epx_group_t g, int capacity, cudaStream_t stream) {
  EPX_CHECK(epx__group_check(g));
  return trace_start(g, capacity, stream, "epx_trace_start");
}

/* Every rank's header into all[q * HDR], through tr->hdr_dev. */
static epx_status_t allgather_headers(epx_group_t g, const long long *mine, long long *all,
                                      cudaStream_t stream) {
  long long *dev = g->trace->hdr_dev, *own = dev + (size_t)g->num_ranks * HDR;
  CUDA_CHECK(cudaMemcpyAsync(own, mine, HDR * sizeof(long long), cudaMemcpyHostToDevice, stream));
  NCCL_CHECK(ncclAllGather(own, dev, HDR, ncclInt64, g->comm, stream));
  CUDA_CHECK(cudaMemcpyAsync(all, dev, (size_t)g->num_ranks * HDR * sizeof(long long),
                             cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  return EPX_OK;
}

/* Rank q's clock model and counts from the gathered headers (the same on every rank). */
static void rank_from_headers(const long long *all, int q, epx__trace_rank_t *r) {
  const long long *h = all + (size_t)q * HDR, *h0 = all;
  memset(r, 0, sizeof *r);
  const unsigned long long count = (unsigned long long)h[HDR_COUNT];
  r->capacity = (unsigned long long)h[HDR_CAPACITY];
  r->num_events = count < r->capacity ? count : r->capacity;
  r->num_dropped = count - r->num_events;
  r->timer_tick_ns = h[HDR_TICK];
  int anchors = 0;
  for (int s = 0; s < 2; s++) {
    const unsigned long long *mine = (const unsigned long long *)(h + HDR_START + s * K);
    const unsigned long long *ref = (const unsigned long long *)(h0 + HDR_START + s * K);
    long long offset, spread;
    if (!epx__trace_clock_offset(mine, ref, K, &offset, &spread)) continue;
    unsigned long long last = 0; /* the anchor: this rank's last valid stamp */
    for (int k = 0; k < K; k++)
      if (mine[k] && ref[k]) last = mine[k];
    r->sync_local_ns[anchors] = last;
    r->offset_ns[anchors] = offset;
    if (spread > r->spread_ns) r->spread_ns = spread;
    anchors++;
  }
  r->clock_valid = anchors > 0;
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

/* Events of every rank into `host` on rank 0 ([sum of n] events; others send theirs and pass
 * NULL). Rank 0 first tells everyone whether it could make room (a broadcast through the header
 * buffer), so that a rank 0 out of memory never leaves a sender waiting. */
static epx_status_t gather_events(epx_group_t g, const unsigned long long *n,
                                  epx__trace_event_t *host, cudaStream_t stream) {
  const int R = g->num_ranks, me = g->rank;
  const size_t ev = sizeof(epx__trace_event_t);
  const epx__trace_event_t *mine = g->trace->ring ? epx__trace_events(g->trace->ring) : NULL;
  unsigned long long remote = 0;
  for (int q = 1; q < R; q++) remote += n[q];
  epx__trace_event_t *recv = NULL;
  epx_status_t res = EPX_OK;
  long long ready = 1;
  if (me == 0) {
    if (!host) ready = 0;
    if (ready && remote && cudaMalloc((void **)&recv, remote * ev) != cudaSuccess) {
      (void)cudaGetLastError();
      ready = 0;
    }
  }
  long long *flag = g->trace->hdr_dev;
  CUDA_CHECK_GOTO(cudaMemcpyAsync(flag, &ready, sizeof ready, cudaMemcpyHostToDevice, stream), res,
                  exit);
  NCCL_CHECK_GOTO(ncclBroadcast(flag, flag, 1, ncclInt64, 0, g->comm, stream), res, exit);
  CUDA_CHECK_GOTO(cudaMemcpyAsync(&ready, flag, sizeof ready, cudaMemcpyDeviceToHost, stream), res,
                  exit);
  CUDA_CHECK_GOTO(cudaStreamSynchronize(stream), res, exit);
  if (!ready) {
    res = epx__set_error(EPX_ERR_SYSTEM,
                         "epx_trace_dump: rank 0 has no memory for %llu events (nothing written)",
                         remote + n[0]);
    goto exit;
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

/* The dump proper. quiet_if_off: return EPX_OK without a message when no rank was tracing
 * (EPX_TRACE at destroy after the application dumped itself). */
static epx_status_t trace_dump(epx_group_t g, const char *path, epx_trace_summary_t *summary,
                               cudaStream_t stream, int quiet_if_off) {
  const int R = g->num_ranks, me = g->rank;
  if (summary) memset(summary, 0, sizeof *summary);
  if (stream_is_capturing(stream))
    return epx__set_error(EPX_ERR_INVALID_USAGE,
                          "epx_trace_dump: stream is being captured into a CUDA graph");
  EPX_CHECK(ensure_state(g));
  struct epx__trace *tr = g->trace;
  const int tracing = g->trace_ring != NULL;
  g->trace_ring = NULL; /* kernels launched from now on do not record */

  /* 1. Local: the second clock measurement, the buffer's counter, both clock stamps. */
  epx__kernel_ctx_t ctx;
  epx__group_kernel_ctx(g, &ctx);
  unsigned long long ring_hdr[2] = {0, 0}, sync[2][SYNC_WORDS];
  memset(sync, 0, sizeof sync);
  epx_status_t local = epx__clock_sync_launch(&ctx, tr->sync_dev + SYNC_WORDS, K, stream);
  if (local == EPX_OK && tracing)
    local = CUDA_STATUS(
        cudaMemcpyAsync(ring_hdr, tr->ring, sizeof ring_hdr, cudaMemcpyDeviceToHost, stream));
  if (local == EPX_OK)
    local = CUDA_STATUS(
        cudaMemcpyAsync(sync, tr->sync_dev, sizeof sync, cudaMemcpyDeviceToHost, stream));
  if (local == EPX_OK) local = CUDA_STATUS(cudaStreamSynchronize(stream));
  char local_msg[512];
  snprintf(local_msg, sizeof local_msg, "%s", epx_last_error());

  /* 2. Everyone learns everyone's status, counts and clock stamps. */
  long long mine[HDR], *all = (long long *)calloc((size_t)R * HDR, sizeof(long long));
  if (!all) return epx__set_error(EPX_ERR_SYSTEM, "epx_trace_dump: out of host memory");
  memset(mine, 0, sizeof mine);
  mine[HDR_STATUS] = local != EPX_OK ? local : tracing ? EPX_OK : EPX_ERR_INVALID_USAGE;
  if (local == EPX_OK && tracing) {
    mine[HDR_COUNT] = (long long)ring_hdr[0];
    mine[HDR_CAPACITY] = (long long)ring_hdr[1];
    mine[HDR_TICK] = (long long)(sync[0][0] > sync[1][0] ? sync[0][0] : sync[1][0]);
    for (int k = 0; k < K; k++) {
      mine[HDR_START + k] = (long long)sync[0][1 + k];
      mine[HDR_END + k] = (long long)sync[1][1 + k];
    }
  }
  epx_status_t res = allgather_headers(g, mine, all, stream);
  epx__trace_rank_t *ranks = NULL;
  epx__trace_event_t *host = NULL;
  if (res != EPX_OK) goto exit;

  /* 3. The same decision on every rank. */
  int off = 0, bad = -1;
  for (int q = 0; q < R; q++) {
    off += all[q * HDR + HDR_STATUS] == EPX_ERR_INVALID_USAGE;
    if (bad < 0 && all[q * HDR + HDR_STATUS] != EPX_OK) bad = q;
  }
  if (bad >= 0) {
    const epx_status_t st = (epx_status_t)all[bad * HDR + HDR_STATUS];
    if (quiet_if_off && off == R)
      res = EPX_OK;
    else if (bad == me && local != EPX_OK)
      res = epx__set_error(local, "%s", local_msg);
    else if (st == EPX_ERR_INVALID_USAGE)
      res = epx__set_error(EPX_ERR_INVALID_USAGE,
                           "epx_trace_dump: rank %d was not tracing; call epx_trace_start on "
                           "every rank first (nothing written)",
                           bad);
    else
      res = epx__set_error(EPX_ERR_INVALID_USAGE,
                           "epx_trace_dump: rank %d failed (%s); see its log (nothing written)",
                           bad, epx_status_string(st));
    goto exit;
  }

  /* 4. Clock models and counts, then the events to rank 0. */
  ranks = (epx__trace_rank_t *)calloc((size_t)R, sizeof *ranks);
  unsigned long long n[EPX_MAX_RANKS], total = 0;
  if (!ranks) {
    res = epx__set_error(EPX_ERR_SYSTEM, "epx_trace_dump: out of host memory");
    goto exit;
  }
  for (int q = 0; q < R; q++) {
    rank_from_headers(all, q, &ranks[q]);
    n[q] = ranks[q].num_events;
    total += n[q];
  }
  if (me == 0) host = (epx__trace_event_t *)malloc((total + 1) * sizeof *host);
  res = gather_events(g, n, host, stream); /* rank 0 without host memory: all fail, none waits */
  if (res != EPX_OK) goto exit;

  if (summary) {
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
  if (me == 0) {
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
    if (path) {
      res = write_file(path, R, ranks);
      if (res == EPX_OK)
        EPX_INFO(EPX_SUBSYS_GROUP, "trace written to %s: %llu events from %d ranks", path, total,
                 R);
    }
  }
exit:
  free(host);
  free(ranks);
  free(all);
  return res;
}

EPX_EXPORT epx_status_t epx_trace_dump(epx_group_t g, const char *path,
                                       epx_trace_summary_t *summary, cudaStream_t stream) {
  EPX_CHECK(epx__group_check(g));
  return trace_dump(g, path, summary, stream, 0);
}

/* ------------------------------------------------------------------------------------------
 * EPX_TRACE and the group's lifetime
 * ---------------------------------------------------------------------------------------- */
int epx__trace_env_requested(void) {
  const char *path = getenv("EPX_TRACE");
  if (!path || !*path) return 0;
#if !EPX_TRACE_COMPILED
  EPX_WARN("EPX_TRACE=%s ignored: this EPX was built with TRACE=0", path);
  return 0;
#else
  return 1;
#endif
}

/* The n-th traced group of the process (from 0) writes PATH, then PATH with ".g<n>" before its
 * extension: trace.json, trace.g1.json, ... (every rank counts alike: creation is collective). */
static char *env_path_for(const char *path, int n) {
  const size_t len = strlen(path) + 32;
  char *out = (char *)malloc(len);
  if (!out) return NULL;
  if (n == 0) {
    snprintf(out, len, "%s", path);
    return out;
  }
  const char *dot = strrchr(path, '.'), *slash = strrchr(path, '/');
  if (!dot || (slash && dot < slash)) dot = path + strlen(path);
  snprintf(out, len, "%.*s.g%d%s", (int)(dot - path), path, n, dot);
  return out;
}

void epx__trace_env_begin(epx_group_t g) {
  static int traced_groups;
  const int n = __atomic_fetch_add(&traced_groups, 1, __ATOMIC_RELAXED);
  epx_status_t res = ensure_state(g);
  if (res == EPX_OK) {
    g->trace->env_path = env_path_for(getenv("EPX_TRACE"), n);
    if (!g->trace->env_path) res = epx__set_error(EPX_ERR_SYSTEM, "out of host memory");
  }
  if (res == EPX_OK) res = trace_start(g, 0, g->setup_stream, "EPX_TRACE");
  if (res == EPX_OK) res = CUDA_STATUS(cudaStreamSynchronize(g->setup_stream));
  if (res != EPX_OK)
    EPX_WARN("EPX_TRACE: could not start tracing the group: %s", epx_last_error());
  else
    EPX_INFO(EPX_SUBSYS_GROUP, "EPX_TRACE: tracing the group until destroy, into %s",
             g->trace->env_path);
}

void epx__trace_group_end(epx_group_t g) {
  struct epx__trace *tr = g->trace;
  if (!tr) return;
  if (tr->env_path) {
    /* Every rank has env_path (agreed at creation), so every rank takes part. */
    epx_trace_summary_t s;
    epx_status_t res = trace_dump(g, tr->env_path, &s, g->setup_stream, 1);
    if (res != EPX_OK)
      EPX_WARN("EPX_TRACE: writing the trace of the group failed: %s", epx_last_error());
    else if (g->rank == 0 && s.num_events + s.num_dropped > 0)
      EPX_INFO(EPX_SUBSYS_GROUP, "EPX_TRACE: %lld events in %s (%lld dropped)", s.num_events,
               tr->env_path, s.num_dropped);
  }
  g->trace_ring = NULL;
  /* Teardown goes on whatever fails; CUDA_STATUS logs each failure. */
  if (tr->ring) (void)CUDA_STATUS(cudaFree(tr->ring));
  if (tr->sync_dev) (void)CUDA_STATUS(cudaFree(tr->sync_dev));
  if (tr->hdr_dev) (void)CUDA_STATUS(cudaFree(tr->hdr_dev));
  for (int i = 0; i < tr->num_retired; i++) (void)CUDA_STATUS(cudaFree(tr->retired[i]));
  free(tr->env_path);
  free(tr);
  g->trace = NULL;
}

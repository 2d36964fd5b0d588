/*
 * json.c - the Chrome trace writer (pure): the ranks' events and clock models of trace.h into
 * one JSON object that Perfetto and chrome://tracing open (docs/profiling.md).
 *
 * One object: otherData (run facts, per-rank counts and clock figures) and traceEvents: per
 * rank, metadata (process and thread names, a label when events were dropped), two clock-sync
 * instants, then its spans as complete ("X") events sorted by start (longer first on ties, so
 * nested spans arrive parent first). Times are microseconds with nanosecond decimals from the
 * earliest aligned time of the file.
 * Invariant: no floating point in the output (times are printed from integers exactly).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "checks.h"
#include "trace.h"

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

/* The per-round offsets behind each sync's median (null: a round without both stamps), the last
 * member of the rank's object, which this closes. */
static void write_round_offsets(FILE *f, const epx__trace_rank_t *r) {
  fprintf(f, ",\"clock_round_offsets_ns\":[");
  for (int s = 0; s < 2; s++) {
    fprintf(f, "%s[", s ? "," : "");
    for (int k = 0; k < EPX_TRACE_SYNC_ROUNDS; k++) {
      if (r->round_used[s] >> k & 1u)
        fprintf(f, "%s%lld", k ? "," : "", r->round_offset_ns[s][k]);
      else
        fprintf(f, "%snull", k ? "," : "");
    }
    fprintf(f, "]");
  }
  fprintf(f, "]}");
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
            "\"timer_tick_ns\":%lld",
            q ? "," : "", q, r->num_events, r->num_dropped, r->capacity,
            r->clock_valid ? "true" : "false", r->offset_ns[0],
            r->sync_local_ns[1] ? r->offset_ns[1] : r->offset_ns[0], r->spread_ns,
            r->timer_tick_ns);
    write_round_offsets(f, r);
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

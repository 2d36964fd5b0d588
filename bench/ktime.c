/*
 * ktime.c - kernel time's collector (ktime.h): CUPTI's activity API switched on for a window
 * of calls, each call bracketed by an external correlation id, and the records CUPTI hands back
 * copied into plain arrays for ktime_stats.c.
 *
 * Invariants:
 *   - Records are kept only between bench_ktime_start and bench_ktime_stop; CUPTI's buffers are
 *     flushed at stop (FORCED, after the caller synchronized), so a window's records never leak
 *     into the next one.
 *   - Only the common prefix of the kernel, memset and memcpy records is read (kind, start, end,
 *     correlation id, name), through the oldest structs of each kind: every CUPTI since CUDA 9
 *     lays those fields out alike (checked below against the newest structs of this header),
 *     so a libcupti newer or older than the headers still reads right.
 *   - The arrays are touched under one mutex: CUPTI may complete buffers on its own thread.
 * A failure is never fatal: it is remembered as text and stop returns it.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cupti_lib.h"
#include "ktime.h"

#define BUFFER_BYTES (8u << 20) /* per CUPTI buffer: a window holds a few thousand records */
#define EXTERNAL_KIND CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0

/* The fields read, where every record version since CUDA 9 has them (see the invariant). */
#if defined(CUPTI_API_VERSION) && CUPTI_API_VERSION >= 130000 && CUPTI_API_VERSION < 140000
#include <stddef.h>
#define SAME_FIELD(old, new, f) \
  _Static_assert(offsetof(old, f) == offsetof(new, f), #old "." #f " moved in " #new)
SAME_FIELD(CUpti_ActivityKernel4, CUpti_ActivityKernel10, start);
SAME_FIELD(CUpti_ActivityKernel4, CUpti_ActivityKernel10, end);
SAME_FIELD(CUpti_ActivityKernel4, CUpti_ActivityKernel10, correlationId);
SAME_FIELD(CUpti_ActivityKernel4, CUpti_ActivityKernel10, name);
SAME_FIELD(CUpti_ActivityKernel4, CUpti_ActivityKernel10, streamId);
SAME_FIELD(CUpti_ActivityMemset, CUpti_ActivityMemset4, streamId);
SAME_FIELD(CUpti_ActivityMemcpy, CUpti_ActivityMemcpy6, streamId);
SAME_FIELD(CUpti_ActivityMemset, CUpti_ActivityMemset4, start);
SAME_FIELD(CUpti_ActivityMemset, CUpti_ActivityMemset4, end);
SAME_FIELD(CUpti_ActivityMemset, CUpti_ActivityMemset4, correlationId);
SAME_FIELD(CUpti_ActivityMemcpy, CUpti_ActivityMemcpy6, start);
SAME_FIELD(CUpti_ActivityMemcpy, CUpti_ActivityMemcpy6, end);
SAME_FIELD(CUpti_ActivityMemcpy, CUpti_ActivityMemcpy6, correlationId);
#undef SAME_FIELD
#endif

/* The kinds a window enables, in this order (disabled in reverse). DRIVER and RUNTIME are
 * there only because CUPTI writes an external correlation record for an API record: without
 * them no call would be attributed. */
static const CUpti_ActivityKind kinds[] = {
    CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION,
    CUPTI_ACTIVITY_KIND_DRIVER,
    CUPTI_ACTIVITY_KIND_RUNTIME,
    CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL,
    CUPTI_ACTIVITY_KIND_MEMSET,
    CUPTI_ACTIVITY_KIND_MEMCPY,
};
static const char *const kind_names[] = {"EXTERNAL_CORRELATION", "DRIVER", "RUNTIME",
                                         "CONCURRENT_KERNEL",    "MEMSET", "MEMCPY"};
#define NUM_KINDS (int)(sizeof kinds / sizeof kinds[0])
_Static_assert(sizeof kind_names / sizeof kind_names[0] == NUM_KINDS, "a name per kind");

/* A kernel's short name, interned for the life of the process (records of one kernel share
 * CUPTI's name pointer, so it is the first key tried). */
typedef struct {
  const char *raw;
  char *name;
} interned_t;

static struct {
  const bench_cupti_api_t *api;
  int registered;
  pthread_mutex_t mu;
  int recording;
  bench_ktime_activity_t *acts;
  size_t num_acts, cap_acts;
  bench_ktime_link_t *links;
  size_t num_links, cap_links;
  interned_t *names;
  size_t num_names, cap_names;
  size_t dropped;
  int enabled; /* kinds[0..enabled) are on */
  char error[BENCH_KTIME_REASON_LEN];
  char library[600];
} st = {.mu = PTHREAD_MUTEX_INITIALIZER};

/* Remember the first failure of a window (under st.mu, unless no other thread can run). */
static void note_error(const char *what, CUptiResult r) {
  if (st.error[0]) return;
  const char *text = NULL;
  if (st.api && st.api->GetResultString(r, &text) != CUPTI_SUCCESS) text = NULL;
  snprintf(st.error, sizeof st.error, "%s: %s", what, text ? text : "CUPTI error");
}

/* Grow *array (of *cap elements of size bytes) to hold one more. Returns 0, or -1. */
static int reserve(void **array, size_t *cap, size_t count, size_t size) {
  if (count < *cap) return 0;
  const size_t want = *cap ? 2 * *cap : 1024;
  void *grown = realloc(*array, want * size);
  if (!grown) return -1;
  *array = grown;
  *cap = want;
  return 0;
}

static const char *intern(const char *raw) {
  if (!raw) return "?";
  for (size_t i = 0; i < st.num_names; i++)
    if (st.names[i].raw == raw) return st.names[i].name;
  char short_name[BENCH_KTIME_NAME_LEN];
  bench_ktime_short_name(raw, short_name, sizeof short_name);
  for (size_t i = 0; i < st.num_names; i++)
    if (!strcmp(st.names[i].name, short_name)) return st.names[i].name;
  if (reserve((void **)&st.names, &st.cap_names, st.num_names, sizeof *st.names)) return "?";
  char *copy = strdup(short_name);
  if (!copy) return "?";
  st.names[st.num_names].raw = raw;
  st.names[st.num_names].name = copy;
  st.num_names++;
  return copy;
}

static void add_activity(bench_ktime_kind_t kind, uint32_t correlation_id, uint32_t stream_id,
                         uint64_t start, uint64_t end, const char *name) {
  if (reserve((void **)&st.acts, &st.cap_acts, st.num_acts, sizeof *st.acts)) {
    if (!st.error[0]) snprintf(st.error, sizeof st.error, "out of host memory for records");
    return;
  }
  bench_ktime_activity_t *a = &st.acts[st.num_acts++];
  a->kind = kind;
  a->correlation_id = correlation_id;
  a->stream_id = stream_id;
  a->start_ns = start;
  a->end_ns = end;
  a->name = name;
}

/* One record of a completed buffer (st.mu held). */
static void take(const CUpti_Activity *rec) {
  switch (rec->kind) {
    case CUPTI_ACTIVITY_KIND_KERNEL:
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
      const CUpti_ActivityKernel4 *k = (const CUpti_ActivityKernel4 *)rec;
      add_activity(BENCH_KTIME_KERNEL, k->correlationId, k->streamId, k->start, k->end,
                   intern(k->name));
      break;
    }
    case CUPTI_ACTIVITY_KIND_MEMSET: {
      const CUpti_ActivityMemset *m = (const CUpti_ActivityMemset *)rec;
      add_activity(BENCH_KTIME_MEMSET, m->correlationId, m->streamId, m->start, m->end, NULL);
      break;
    }
    case CUPTI_ACTIVITY_KIND_MEMCPY: {
      const CUpti_ActivityMemcpy *m = (const CUpti_ActivityMemcpy *)rec;
      add_activity(BENCH_KTIME_MEMCPY, m->correlationId, m->streamId, m->start, m->end, NULL);
      break;
    }
    case CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION: {
      const CUpti_ActivityExternalCorrelation *x = (const CUpti_ActivityExternalCorrelation *)rec;
      if (x->externalKind != EXTERNAL_KIND) break;
      if (reserve((void **)&st.links, &st.cap_links, st.num_links, sizeof *st.links)) {
        if (!st.error[0]) snprintf(st.error, sizeof st.error, "out of host memory for records");
        break;
      }
      st.links[st.num_links].correlation_id = x->correlationId;
      st.links[st.num_links].external_id = x->externalId;
      st.num_links++;
      break;
    }
    default: /* the driver and runtime API records: only their correlations matter */
      break;
  }
}

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
  /* NOTE: malloc's alignment (16) covers CUPTI's ACTIVITY_RECORD_ALIGNMENT (8). A refusal
   * (NULL) makes CUPTI drop records, which stop reports. */
  *buffer = (uint8_t *)malloc(BUFFER_BYTES);
  *size = *buffer ? BUFFER_BYTES : 0;
  *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream_id, uint8_t *buffer,
                                      size_t size, size_t valid_size) {
  (void)size;
  pthread_mutex_lock(&st.mu);
  CUpti_Activity *rec = NULL;
  for (;;) {
    const CUptiResult r = st.api->ActivityGetNextRecord(buffer, valid_size, &rec);
    if (r == CUPTI_ERROR_MAX_LIMIT_REACHED) break; /* the end of the buffer */
    if (r != CUPTI_SUCCESS) {
      note_error("cuptiActivityGetNextRecord", r);
      break;
    }
    if (st.recording) take(rec);
  }
  size_t dropped = 0;
  const CUptiResult r = st.api->ActivityGetNumDroppedRecords(ctx, stream_id, &dropped);
  if (r != CUPTI_SUCCESS)
    note_error("cuptiActivityGetNumDroppedRecords", r);
  else if (st.recording)
    st.dropped += dropped;
  pthread_mutex_unlock(&st.mu);
  free(buffer);
}

/* ---------------------------------------------------------------------------------------------
 * The window
 * ------------------------------------------------------------------------------------------- */
int bench_ktime_open(char *reason, size_t len) {
  if (st.registered) return 0;
  st.api = bench_cupti_load(reason, len);
  if (!st.api) return -1;
  const CUptiResult r = st.api->ActivityRegisterCallbacks(buffer_requested, buffer_completed);
  if (r != CUPTI_SUCCESS) {
    const char *text = NULL;
    if (st.api->GetResultString(r, &text) != CUPTI_SUCCESS) text = NULL;
    snprintf(reason, len, "cuptiActivityRegisterCallbacks: %s", text ? text : "CUPTI error");
    st.api = NULL;
    return -1;
  }
  snprintf(st.library, sizeof st.library, "%s, CUPTI API version %u", st.api->path,
           st.api->version);
  st.registered = 1;
  return 0;
}

const char *bench_ktime_library(void) {
  return st.library;
}

/* Disable kinds[0..st.enabled), newest first; the first failure goes to st.error. NOTE: st.mu
 * must not be held: CUPTI may hand back buffers (buffer_completed) from inside its calls. */
static void disable_kinds(void) {
  while (st.enabled > 0) {
    const CUptiResult r = st.api->ActivityDisable(kinds[--st.enabled]);
    if (r != CUPTI_SUCCESS) {
      pthread_mutex_lock(&st.mu);
      note_error("cuptiActivityDisable", r);
      pthread_mutex_unlock(&st.mu);
    }
  }
}

int bench_ktime_start(char *reason, size_t len) {
  if (!st.registered) {
    snprintf(reason, len, "CUPTI not loaded");
    return -1;
  }
  pthread_mutex_lock(&st.mu);
  st.num_acts = st.num_links = 0;
  st.dropped = 0;
  st.error[0] = '\0';
  st.recording = 1;
  pthread_mutex_unlock(&st.mu);
  for (int i = 0; i < NUM_KINDS; i++) {
    const CUptiResult r = st.api->ActivityEnable(kinds[i]);
    if (r != CUPTI_SUCCESS) {
      const char *text = NULL;
      if (st.api->GetResultString(r, &text) != CUPTI_SUCCESS) text = NULL;
      snprintf(reason, len, "cuptiActivityEnable(CUPTI_ACTIVITY_KIND_%s): %s", kind_names[i],
               text ? text : "CUPTI error");
      disable_kinds();
      pthread_mutex_lock(&st.mu);
      st.recording = 0;
      pthread_mutex_unlock(&st.mu);
      return -1;
    }
    st.enabled = i + 1;
  }
  return 0;
}

void bench_ktime_call_begin(uint64_t external_id) {
  if (!st.registered) return;
  const CUptiResult r = st.api->ActivityPushExternalCorrelationId(EXTERNAL_KIND, external_id);
  if (r != CUPTI_SUCCESS) {
    pthread_mutex_lock(&st.mu);
    note_error("cuptiActivityPushExternalCorrelationId", r);
    pthread_mutex_unlock(&st.mu);
  }
}

void bench_ktime_call_end(void) {
  if (!st.registered) return;
  uint64_t last = 0;
  const CUptiResult r = st.api->ActivityPopExternalCorrelationId(EXTERNAL_KIND, &last);
  if (r != CUPTI_SUCCESS) {
    pthread_mutex_lock(&st.mu);
    note_error("cuptiActivityPopExternalCorrelationId", r);
    pthread_mutex_unlock(&st.mu);
  }
}

int bench_ktime_stop(char *reason, size_t len) {
  if (!st.registered) {
    snprintf(reason, len, "CUPTI not loaded");
    return -1;
  }
  /* NOTE: st.mu must not be held around CUPTI calls: the flush runs buffer_completed on this
   * thread. Flush once with the kinds on (every record of the window is complete, the caller
   * synchronized), once after disabling them, for anything written in between. */
  CUptiResult r = st.api->ActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  if (r != CUPTI_SUCCESS) {
    pthread_mutex_lock(&st.mu);
    note_error("cuptiActivityFlushAll", r);
    pthread_mutex_unlock(&st.mu);
  }
  disable_kinds();
  r = st.api->ActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  pthread_mutex_lock(&st.mu);
  if (r != CUPTI_SUCCESS) note_error("cuptiActivityFlushAll", r);
  st.recording = 0;
  if (!st.error[0] && st.dropped)
    snprintf(st.error, sizeof st.error, "CUPTI dropped %zu activity records", st.dropped);
  const int rc = st.error[0] ? -1 : 0;
  if (rc) snprintf(reason, len, "%s", st.error);
  pthread_mutex_unlock(&st.mu);
  return rc;
}

int bench_ktime_summarize(uint64_t first_id, int num_calls, bench_ktime_summary_t *out) {
  pthread_mutex_lock(&st.mu);
  const int rc =
      bench_ktime_aggregate(st.acts, st.num_acts, st.links, st.num_links, first_id, num_calls, out);
  pthread_mutex_unlock(&st.mu);
  return rc;
}

long bench_ktime_timeline(uint64_t id, bench_ktime_activity_t **out) {
  pthread_mutex_lock(&st.mu);
  const long n = bench_ktime_call_timeline(st.acts, st.num_acts, st.links, st.num_links, id, out);
  pthread_mutex_unlock(&st.mu);
  return n;
}

/*
 * trace_check.c - checks of EPX trace files for the tests (see trace_check.h).
 */
#include "common/trace_check.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/runner.h"

static int why_fmt(char *why, size_t len, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, len, fmt, ap);
  va_end(ap);
  return -1;
}

static const char *str_of(const json_value_t *o, const char *key) {
  const json_value_t *v = json_get(o, key);
  return v && v->type == JSON_STRING ? v->string : NULL;
}

static int int_of(const json_value_t *o, const char *key, long long *out) {
  const json_value_t *v = json_get(o, key);
  if (!v || v->type != JSON_NUMBER || !v->is_integer) return -1;
  *out = v->integer;
  return 0;
}

/* Microseconds with nanosecond decimals, as integer nanoseconds. */
static int ns_of(const json_value_t *o, const char *key, long long *out) {
  const json_value_t *v = json_get(o, key);
  if (!v || v->type != JSON_NUMBER) return -1;
  *out = llround(v->number * 1000.0);
  return 0;
}

typedef struct {
  long long pid, tid, ts, end;
  const char *name; /* the span's label (for messages), or NULL */
} span_t;

static int compare_spans(const void *a, const void *b) {
  const span_t *x = (const span_t *)a, *y = (const span_t *)b;
  if (x->pid != y->pid) return x->pid < y->pid ? -1 : 1;
  if (x->tid != y->tid) return x->tid < y->tid ? -1 : 1;
  if (x->ts != y->ts) return x->ts < y->ts ? -1 : 1;
  return (x->end < y->end) - (x->end > y->end); /* longer first */
}

/* Spans of one track must nest or follow each other. */
static int check_nesting(span_t *s, size_t n, char *why, size_t len) {
  qsort(s, n, sizeof *s, compare_spans);
  long long stack[64];
  const char *names[64];
  int depth = 0;
  for (size_t i = 0; i < n; i++) {
    if (i == 0 || s[i].pid != s[i - 1].pid || s[i].tid != s[i - 1].tid) depth = 0;
    while (depth > 0 && s[i].ts >= stack[depth - 1]) depth--;
    if (depth > 0 && s[i].end > stack[depth - 1])
      return why_fmt(why, len,
                     "pid %lld tid %lld: span '%s' [%lld, %lld) ns overlaps its enclosing span "
                     "'%s' ending at %lld without nesting",
                     s[i].pid, s[i].tid, s[i].name ? s[i].name : "?", s[i].ts, s[i].end,
                     names[depth - 1] ? names[depth - 1] : "?", stack[depth - 1]);
    if (depth == 64) return why_fmt(why, len, "spans nested more than 64 deep");
    names[depth] = s[i].name;
    stack[depth++] = s[i].end;
  }
  return 0;
}

/* The (pid, tid) pairs that have a thread_name entry, sorted (as spans with ts = end = 0). */
static size_t thread_names(const json_value_t *events, span_t *out) {
  size_t n = 0;
  for (size_t i = 0; i < events->count; i++) {
    const json_value_t *e = events->items[i];
    long long p, t;
    const char *name = str_of(e, "name"), *ph = str_of(e, "ph");
    if (ph && !strcmp(ph, "M") && name && !strcmp(name, "thread_name") && !int_of(e, "pid", &p) &&
        !int_of(e, "tid", &t))
      out[n++] = (span_t){p, t, 0, 0, NULL};
  }
  qsort(out, n, sizeof *out, compare_spans);
  return n;
}

static int has_thread_name(const span_t *names, size_t n, long long pid, long long tid) {
  const span_t key = {pid, tid, 0, 0, NULL};
  return bsearch(&key, names, n, sizeof *names, compare_spans) != NULL;
}

static int check_other_data(const json_value_t *root, trace_facts_t *f, char *why, size_t len) {
  const json_value_t *other = json_get(root, "otherData");
  long long ranks;
  if (!other || other->type != JSON_OBJECT) return why_fmt(why, len, "no otherData object");
  if (int_of(other, "ranks", &ranks) || ranks < 1 || ranks > TRACE_CHECK_MAX_RANKS)
    return why_fmt(why, len, "otherData.ranks missing or out of range");
  f->num_ranks = (int)ranks;
  if (int_of(other, "events", &f->events) || int_of(other, "dropped", &f->dropped))
    return why_fmt(why, len, "otherData.events / dropped missing");
  const json_value_t *per = json_get(other, "per_rank");
  if (!per || per->type != JSON_ARRAY || (long long)per->count != ranks)
    return why_fmt(why, len, "otherData.per_rank is not an array of %lld ranks", ranks);
  long long sum = 0;
  for (size_t q = 0; q < per->count; q++) {
    long long rank, events, capacity;
    if (int_of(per->items[q], "rank", &rank) || rank != (long long)q ||
        int_of(per->items[q], "events", &events) ||
        int_of(per->items[q], "dropped", &f->dropped_per_rank[q]) ||
        int_of(per->items[q], "capacity", &capacity) || events > capacity)
      return why_fmt(why, len, "otherData.per_rank[%zu] is incomplete or inconsistent", q);
    sum += f->dropped_per_rank[q];
  }
  if (sum != f->dropped)
    return why_fmt(why, len, "otherData.dropped = %lld but the ranks' sum is %lld", f->dropped,
                   sum);
  return 0;
}

int trace_check(const json_value_t *root, trace_facts_t *f, char *why, size_t len) {
  memset(f, 0, sizeof *f);
  if (!root || root->type != JSON_OBJECT) return why_fmt(why, len, "not a JSON object");
  if (check_other_data(root, f, why, len)) return -1;
  const json_value_t *events = json_get(root, "traceEvents");
  if (!events || events->type != JSON_ARRAY) return why_fmt(why, len, "no traceEvents array");
  span_t *spans = (span_t *)malloc((events->count + 1) * sizeof *spans);
  span_t *names = (span_t *)malloc((events->count + 1) * sizeof *names);
  if (!spans || !names) {
    free(spans);
    free(names);
    return why_fmt(why, len, "out of memory");
  }
  const size_t num_names = thread_names(events, names);
  size_t n = 0;
  long long last_ts[TRACE_CHECK_MAX_RANKS];
  for (int q = 0; q < TRACE_CHECK_MAX_RANKS; q++) last_ts[q] = -1;
  int rc = 0;
  for (size_t i = 0; i < events->count && rc == 0; i++) {
    const json_value_t *e = events->items[i];
    const char *ph = str_of(e, "ph"), *name = str_of(e, "name");
    long long pid, tid, ts, dur;
    if (!ph || !name || int_of(e, "pid", &pid) || pid < 0 || pid >= f->num_ranks) {
      rc = why_fmt(why, len, "traceEvents[%zu]: needs ph, name and a pid in [0, %d)", i,
                   f->num_ranks);
    } else if (!strcmp(ph, "M")) {
      const json_value_t *args = json_get(e, "args");
      if (!args || args->type != JSON_OBJECT)
        rc = why_fmt(why, len, "traceEvents[%zu]: metadata without args", i);
      else if (!strcmp(name, "process_labels"))
        f->labelled[pid] = 1;
      else if (strcmp(name, "process_name") && strcmp(name, "process_sort_index") &&
               strcmp(name, "thread_name") && strcmp(name, "thread_sort_index"))
        rc = why_fmt(why, len, "traceEvents[%zu]: unknown metadata %s", i, name);
    } else if (!strcmp(ph, "i")) {
      if (ns_of(e, "ts", &ts) || ts < 0 || int_of(e, "tid", &tid) || !str_of(e, "s"))
        rc = why_fmt(why, len, "traceEvents[%zu]: instant needs ts >= 0, tid, s", i);
      else if (!strcmp(name, "clock sync"))
        f->clock_syncs[pid]++;
    } else if (!strcmp(ph, "X")) {
      const json_value_t *args = json_get(e, "args");
      if (!str_of(e, "cat") || int_of(e, "tid", &tid) || ns_of(e, "ts", &ts) ||
          ns_of(e, "dur", &dur) || ts < 0 || dur < 0 || !args || args->type != JSON_OBJECT)
        rc = why_fmt(why, len, "traceEvents[%zu] (%s): span needs cat, tid, ts, dur >= 0, args", i,
                     name);
      else if (ts < last_ts[pid])
        rc = why_fmt(why, len, "traceEvents[%zu] (%s): rank %lld's spans are not sorted by ts", i,
                     name, pid);
      else if (!has_thread_name(names, num_names, pid, tid))
        rc = why_fmt(why, len, "traceEvents[%zu] (%s): track %lld of rank %lld has no name", i,
                     name, tid, pid);
      else {
        last_ts[pid] = ts;
        f->spans[pid]++;
        spans[n++] = (span_t){pid, tid, ts, ts + dur, name};
      }
    } else {
      rc = why_fmt(why, len, "traceEvents[%zu]: unexpected ph %s", i, ph);
    }
  }
  if (rc == 0) rc = check_nesting(spans, n, why, len);
  free(spans);
  free(names);
  if (rc) return rc;
  if ((long long)n != f->events)
    return why_fmt(why, len, "%zu spans in traceEvents, otherData.events says %lld", n, f->events);
  for (int q = 0; q < f->num_ranks; q++)
    if (f->labelled[q] != (f->dropped_per_rank[q] > 0))
      return why_fmt(why, len, "rank %d: dropped %lld events but %s a process label", q,
                     f->dropped_per_rank[q], f->labelled[q] ? "has" : "has no");
  return 0;
}

long long trace_count_spans(const json_value_t *root, int pid, const char *name) {
  const json_value_t *events = json_get(root, "traceEvents");
  long long count = 0, p;
  for (size_t i = 0; events && i < events->count; i++) {
    const json_value_t *e = events->items[i];
    const char *ph = str_of(e, "ph"), *n = str_of(e, "name");
    if (ph && !strcmp(ph, "X") && n && !strcmp(n, name) && !int_of(e, "pid", &p) &&
        (pid < 0 || p == pid))
      count++;
  }
  return count;
}

int trace_find_span(const json_value_t *root, int pid, const char *name, long long *ts_ns,
                    long long *dur_ns, long long *arg) {
  const json_value_t *events = json_get(root, "traceEvents");
  long long p;
  for (size_t i = 0; events && i < events->count; i++) {
    const json_value_t *e = events->items[i];
    const char *ph = str_of(e, "ph"), *n = str_of(e, "name");
    if (!ph || strcmp(ph, "X") || !n || strcmp(n, name) || int_of(e, "pid", &p) || p != pid)
      continue;
    if (ns_of(e, "ts", ts_ns) || ns_of(e, "dur", dur_ns)) return -1;
    *arg = 0;
    const json_value_t *args = json_get(e, "args");
    for (size_t k = 0; args && k < args->count; k++)
      if (strcmp(args->keys[k], "sm") && args->items[k]->type == JSON_NUMBER)
        *arg = args->items[k]->integer;
    return 0;
  }
  return -1;
}

int trace_load(const char *path, json_value_t **root, trace_facts_t *facts) {
  char why[512];
  *root = json_parse_file(path, why, sizeof why);
  EXPECTF(*root != NULL, "%s: %s", path, why);
  EXPECTF(trace_check(*root, facts, why, sizeof why) == 0, "%s: %s", path, why);
  return TEST_PASS;
}

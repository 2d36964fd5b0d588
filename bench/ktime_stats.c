/*
 * ktime_stats.c - kernel time's pure logic (ktime.h): CUPTI's records, already copied out, to
 * per-call sums and a per-kernel breakdown; short kernel names; the breakdown as one line of
 * text. No CUDA, no CUPTI: tests/host/test_ktime.c checks it on hand-made records.
 *
 * Invariant: a call's kernel sum is the sum of the durations of exactly the kernels attributed
 * to it (memsets and memcpys are summed apart, in copy_us), so the breakdown's kernel parts add
 * up to mean_us.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ktime.h"

#define OTHER_NAME "other"

bench_ktime_summary_t bench_ktime_none(void) {
  bench_ktime_summary_t s;
  memset(&s, 0, sizeof s);
  s.mean_us = s.median_us = s.copy_us = s.span_us = s.event_us = NAN;
  return s;
}

/* ---------------------------------------------------------------------------------------------
 * Attribution
 * ------------------------------------------------------------------------------------------- */
static int compare_link(const void *a, const void *b) {
  const bench_ktime_link_t *x = (const bench_ktime_link_t *)a, *y = (const bench_ktime_link_t *)b;
  return (x->correlation_id > y->correlation_id) - (x->correlation_id < y->correlation_id);
}

/* The external id of a correlation id in links sorted by it, or 0 if none. */
static uint64_t external_of(const bench_ktime_link_t *links, size_t n, uint32_t correlation_id) {
  size_t lo = 0, hi = n;
  while (lo < hi) {
    const size_t mid = lo + (hi - lo) / 2;
    if (links[mid].correlation_id < correlation_id)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo < n && links[lo].correlation_id == correlation_id ? links[lo].external_id : 0;
}

/* An activity attributed to call `call`. */
typedef struct {
  const bench_ktime_activity_t *act;
  int call;
} owned_t;

static int compare_owned(const void *a, const void *b) {
  const bench_ktime_activity_t *x = ((const owned_t *)a)->act, *y = ((const owned_t *)b)->act;
  return (x->start_ns > y->start_ns) - (x->start_ns < y->start_ns);
}

static const char *part_name(const bench_ktime_activity_t *a) {
  if (a->kind == BENCH_KTIME_MEMSET) return "[memset]";
  if (a->kind == BENCH_KTIME_MEMCPY) return "[memcpy]";
  return a->name ? a->name : "?";
}

/* ---------------------------------------------------------------------------------------------
 * Breakdown: every distinct name, in order of first start, with its launches and time.
 * ------------------------------------------------------------------------------------------- */
typedef struct {
  const char *name;
  int is_copy;
  long long launches;
  double total_ns;
} name_total_t;

/* The breakdown line of one distinct name. */
static bench_ktime_part_t make_part(const name_total_t *t, int num_calls) {
  bench_ktime_part_t p;
  memset(&p, 0, sizeof p);
  snprintf(p.name, sizeof p.name, "%s", t->name);
  p.is_copy = t->is_copy;
  p.launches_per_call = (double)t->launches / num_calls;
  p.us_per_call = t->total_ns * 1e-3 / num_calls;
  return p;
}

/* Fill out->parts from the distinct names: kernels first, then copies (at most 2: memset,
 * memcpy); kernels beyond what fits in BENCH_KTIME_MAX_PARTS are summed as one "other". */
static void fill_parts(const name_total_t *names, int num_names, int num_calls,
                       bench_ktime_summary_t *out) {
  int num_copies = 0;
  for (int i = 0; i < num_names; i++) num_copies += names[i].is_copy;
  int kernel_slots = BENCH_KTIME_MAX_PARTS - num_copies;
  if (num_names - num_copies > kernel_slots) kernel_slots--; /* room for "other" */
  bench_ktime_part_t other;
  memset(&other, 0, sizeof other);
  snprintf(other.name, sizeof other.name, "%s", OTHER_NAME);
  int kept = 0;
  out->num_parts = 0;
  for (int i = 0; i < num_names; i++) {
    if (names[i].is_copy) continue;
    const bench_ktime_part_t p = make_part(&names[i], num_calls);
    if (kept == kernel_slots) {
      other.launches_per_call += p.launches_per_call;
      other.us_per_call += p.us_per_call;
    } else {
      out->parts[out->num_parts++] = p;
      kept++;
    }
  }
  if (other.launches_per_call > 0) out->parts[out->num_parts++] = other;
  for (int i = 0; i < num_names; i++)
    if (names[i].is_copy) out->parts[out->num_parts++] = make_part(&names[i], num_calls);
}

static int compare_double(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* Per-call sums, mean, median and span of the attributed activities into out. */
static int summarize_calls(const owned_t *owned, size_t n, int num_calls,
                           bench_ktime_summary_t *out) {
  double *kernel_ns = (double *)calloc((size_t)num_calls, sizeof(double));
  double *copy_ns = (double *)calloc((size_t)num_calls, sizeof(double));
  int *kernels = (int *)calloc((size_t)num_calls, sizeof(int));
  uint64_t *first = (uint64_t *)malloc((size_t)num_calls * sizeof(uint64_t));
  uint64_t *last = (uint64_t *)calloc((size_t)num_calls, sizeof(uint64_t));
  int rc = kernel_ns && copy_ns && kernels && first && last ? 0 : -1;
  for (int c = 0; rc == 0 && c < num_calls; c++) first[c] = UINT64_MAX; /* = launched nothing */
  for (size_t i = 0; rc == 0 && i < n; i++) {
    const bench_ktime_activity_t *a = owned[i].act;
    const int c = owned[i].call;
    const double ns = a->end_ns > a->start_ns ? (double)(a->end_ns - a->start_ns) : 0.0;
    if (a->kind == BENCH_KTIME_KERNEL) {
      kernel_ns[c] += ns;
      kernels[c]++;
    } else {
      copy_ns[c] += ns;
    }
    if (a->start_ns < first[c]) first[c] = a->start_ns;
    if (a->end_ns > last[c]) last[c] = a->end_ns;
  }
  if (rc == 0) {
    double kernel_sum = 0, copy_sum = 0, span_sum = 0;
    int spans = 0;
    out->min_kernels = out->max_kernels = kernels[0];
    for (int c = 0; c < num_calls; c++) {
      kernel_sum += kernel_ns[c];
      copy_sum += copy_ns[c];
      if (first[c] != UINT64_MAX) span_sum += (double)(last[c] - first[c]), spans++;
      if (kernels[c] < out->min_kernels) out->min_kernels = kernels[c];
      if (kernels[c] > out->max_kernels) out->max_kernels = kernels[c];
    }
    qsort(kernel_ns, (size_t)num_calls, sizeof *kernel_ns, compare_double);
    const int h = num_calls / 2;
    out->median_us =
        1e-3 * (num_calls % 2 ? kernel_ns[h] : 0.5 * (kernel_ns[h - 1] + kernel_ns[h]));
    out->mean_us = 1e-3 * kernel_sum / num_calls;
    out->copy_us = 1e-3 * copy_sum / num_calls;
    out->span_us = spans ? 1e-3 * span_sum / spans : NAN;
  }
  free(kernel_ns);
  free(copy_ns);
  free(kernels);
  free(first);
  free(last);
  return rc;
}

/* The distinct names of the attributed activities, in order of first start. */
static int breakdown(const owned_t *owned, size_t n, int num_calls, bench_ktime_summary_t *out) {
  name_total_t *names = (name_total_t *)calloc(n + 1, sizeof *names);
  if (!names) return -1;
  int num_names = 0;
  for (size_t i = 0; i < n; i++) {
    const char *name = part_name(owned[i].act);
    int j = 0;
    while (j < num_names && strcmp(names[j].name, name)) j++;
    if (j == num_names) {
      names[j].name = name;
      names[j].is_copy = owned[i].act->kind != BENCH_KTIME_KERNEL;
      num_names++;
    }
    names[j].launches++;
    if (owned[i].act->end_ns > owned[i].act->start_ns)
      names[j].total_ns += (double)(owned[i].act->end_ns - owned[i].act->start_ns);
  }
  fill_parts(names, num_names, num_calls, out);
  free(names);
  return 0;
}

/* A copy of links sorted by correlation id, for external_of; NULL when out of host memory. */
static bench_ktime_link_t *sorted_links(const bench_ktime_link_t *links, size_t num_links) {
  bench_ktime_link_t *sorted = (bench_ktime_link_t *)malloc((num_links + 1) * sizeof *sorted);
  if (!sorted) return NULL;
  if (num_links) memcpy(sorted, links, num_links * sizeof *sorted);
  qsort(sorted, num_links, sizeof *sorted, compare_link);
  return sorted;
}

int bench_ktime_aggregate(const bench_ktime_activity_t *acts, size_t num_acts,
                          const bench_ktime_link_t *links, size_t num_links, uint64_t first_id,
                          int num_calls, bench_ktime_summary_t *out) {
  *out = bench_ktime_none();
  if (num_calls <= 0) return 0;
  bench_ktime_link_t *sorted = sorted_links(links, num_links);
  owned_t *owned = (owned_t *)malloc((num_acts + 1) * sizeof *owned);
  int rc = sorted && owned ? 0 : -1;
  size_t n = 0;
  if (rc == 0) {
    for (size_t i = 0; i < num_acts; i++) {
      const uint64_t id = external_of(sorted, num_links, acts[i].correlation_id);
      if (id < first_id || id - first_id >= (uint64_t)num_calls) continue;
      owned[n].act = &acts[i];
      owned[n].call = (int)(id - first_id);
      n++;
    }
    qsort(owned, n, sizeof *owned, compare_owned);
    out->num_calls = num_calls;
    rc = summarize_calls(owned, n, num_calls, out);
  }
  if (rc == 0) rc = breakdown(owned, n, num_calls, out);
  if (rc) *out = bench_ktime_none();
  free(sorted);
  free(owned);
  return rc;
}

/* ---------------------------------------------------------------------------------------------
 * One call's timeline and overlap
 * ------------------------------------------------------------------------------------------- */
static int compare_start(const void *a, const void *b) {
  const bench_ktime_activity_t *x = (const bench_ktime_activity_t *)a;
  const bench_ktime_activity_t *y = (const bench_ktime_activity_t *)b;
  if (x->start_ns != y->start_ns) return x->start_ns < y->start_ns ? -1 : 1;
  return x->end_ns < y->end_ns ? -1 : x->end_ns > y->end_ns;
}

long bench_ktime_call_timeline(const bench_ktime_activity_t *acts, size_t num_acts,
                               const bench_ktime_link_t *links, size_t num_links, uint64_t id,
                               bench_ktime_activity_t **out) {
  *out = NULL;
  bench_ktime_link_t *sorted = sorted_links(links, num_links);
  bench_ktime_activity_t *mine = (bench_ktime_activity_t *)malloc((num_acts + 1) * sizeof *mine);
  if (!sorted || !mine) {
    free(sorted), free(mine);
    return -1;
  }
  long n = 0;
  for (size_t i = 0; i < num_acts; i++)
    if (external_of(sorted, num_links, acts[i].correlation_id) == id) mine[n++] = acts[i];
  free(sorted);
  qsort(mine, (size_t)n, sizeof *mine, compare_start);
  if (n == 0) {
    free(mine);
    mine = NULL;
  }
  *out = mine;
  return n;
}

/* Sweep over the start and end points in time order, counting the activities of each class
 * running: busy while the count is positive, both while both counts are. */
typedef struct {
  uint64_t t;
  int cls, delta;
} edge_t;

static int compare_edge(const void *a, const void *b) {
  const edge_t *x = (const edge_t *)a, *y = (const edge_t *)b;
  if (x->t != y->t) return x->t < y->t ? -1 : 1;
  return x->delta - y->delta; /* ends first: touching intervals do not overlap */
}

bench_ktime_overlap_t bench_ktime_overlap(const bench_ktime_activity_t *acts, size_t n,
                                          int (*class_of)(const bench_ktime_activity_t *a)) {
  bench_ktime_overlap_t o;
  memset(&o, 0, sizeof o);
  edge_t *e = (edge_t *)malloc((2 * n + 1) * sizeof *e);
  if (!e) return o;
  size_t m = 0;
  uint64_t first = UINT64_MAX, last = 0;
  for (size_t i = 0; i < n; i++) {
    if (acts[i].start_ns < first) first = acts[i].start_ns;
    if (acts[i].end_ns > last) last = acts[i].end_ns;
    const int c = class_of(&acts[i]);
    if ((c != 0 && c != 1) || acts[i].end_ns <= acts[i].start_ns) continue;
    e[m++] = (edge_t){acts[i].start_ns, c, +1};
    e[m++] = (edge_t){acts[i].end_ns, c, -1};
  }
  if (n) o.span_ns = last - first;
  qsort(e, m, sizeof *e, compare_edge);
  int running[2] = {0, 0};
  for (size_t i = 0; i < m; i++) {
    if (i > 0) {
      const uint64_t dt = e[i].t - e[i - 1].t;
      for (int c = 0; c < 2; c++)
        if (running[c] > 0) o.busy_ns[c] += dt;
      if (running[0] > 0 && running[1] > 0) o.both_ns += dt;
    }
    running[e[i].cls] += e[i].delta;
  }
  free(e);
  return o;
}

/* ---------------------------------------------------------------------------------------------
 * Names
 * ------------------------------------------------------------------------------------------- */
static int is_digit(char c) {
  return c >= '0' && c <= '9';
}

/* A <source-name> (decimal length, then that many characters) at *p: its start and length,
 * *p moved past it. Returns 0, or -1 if *p holds none (or one longer than the string). */
static int source_name(const char **p, const char **id, size_t *id_len) {
  size_t len = 0;
  const char *s = *p;
  if (!is_digit(*s)) return -1;
  while (is_digit(*s)) {
    len = len * 10 + (size_t)(*s++ - '0');
    if (len > 4096) return -1;
  }
  if (strnlen(s, len) < len) return -1; /* past the end of the string */
  *id = s;
  *id_len = len;
  *p = s + len;
  return 0;
}

typedef struct {
  const char *s;
  size_t len; /* 0: none */
} ident_t;

/* nvcc and gcc name an anonymous namespace _GLOBAL__N_1 or _GLOBAL__N__<hash>_<file>_<hash>. */
static int is_anonymous(const ident_t *id) {
  return id->len >= 10 && !strncmp(id->s, "_GLOBAL__N", 10);
}

/* The function's own identifier (last) and its scope's (prev: len 0 when it has none, or only
 * anonymous namespaces) in an Itanium-mangled name, up to its template arguments or
 * parameters: enough for kernels, which are plain or namespaced functions, maybe templates.
 * Returns 0, or -1 for anything else. */
static int mangled_identifiers(const char *name, ident_t *prev, ident_t *last) {
  const char *p = name + 2; /* past "_Z" */
  prev->len = last->len = 0;
  if (*p == 'L') p++; /* internal linkage */
  if (*p != 'N') return source_name(&p, &last->s, &last->len);
  p++;
  while (*p == 'r' || *p == 'V' || *p == 'K') p++; /* qualifiers of a member function */
  while (*p && *p != 'E' && *p != 'I') {
    ident_t id;
    if (p[0] == 'S' && p[1] == 't') { /* std:: */
      p += 2;
    } else if (p[0] == 'S') { /* a substitution, S_ or S<seq-id>_ */
      const char *end = strchr(p, '_');
      if (!end) return -1;
      p = end + 1;
    } else if (source_name(&p, &id.s, &id.len) == 0) {
      if (is_anonymous(&id)) continue;
      *prev = *last;
      *last = id;
    } else {
      return -1;
    }
  }
  return last->len ? 0 : -1;
}

void bench_ktime_short_name(const char *name, char *out, size_t len) {
  if (!len) return;
  ident_t prev = {name, 0}, last = {name, strlen(name)};
  if (strncmp(name, "_Z", 2) != 0 || mangled_identifiers(name, &prev, &last) != 0) {
    prev.len = 0;
    last.len = strcspn(name, "(<");
    if (!last.len) last.len = strlen(name);
  }
  /* NOTE: %.*s takes an int; identifiers are at most 4096 long (source_name) */
  if (prev.len)
    snprintf(out, len, "%.*s::%.*s", (int)prev.len, prev.s, (int)last.len, last.s);
  else
    snprintf(out, len, "%.*s", (int)last.len, last.s);
}

/* ---------------------------------------------------------------------------------------------
 * Text
 * ------------------------------------------------------------------------------------------- */
/* snprintf onto the end of buf (used of its len), never past it; used counts what would have
 * been written, as snprintf's result does. */
#define APPEND(...)                                                                         \
  do {                                                                                      \
    const int k_ =                                                                          \
        snprintf(used < len ? buf + used : NULL, used < len ? len - used : 0, __VA_ARGS__); \
    if (k_ > 0) used += (size_t)k_;                                                         \
  } while (0)

static void append_part(char *buf, size_t len, size_t *used_io, const bench_ktime_part_t *p) {
  size_t used = *used_io;
  APPEND("%s %.1f", p->name, p->us_per_call);
  const double n = p->launches_per_call;
  if (fabs(n - 1.0) > 1e-9) {
    if (fabs(n - floor(n + 0.5)) < 1e-9)
      APPEND(" (x%.0f)", n);
    else
      APPEND(" (x%.2f)", n);
  }
  *used_io = used;
}

int bench_ktime_format(const bench_ktime_summary_t *s, char *buf, size_t len) {
  size_t used = 0;
  if (len) buf[0] = '\0';
  if (s->num_calls <= 0) {
    APPEND("no figure");
    return (int)used;
  }
  int kernels = 0;
  for (int i = 0; i < s->num_parts; i++) {
    if (s->parts[i].is_copy) continue;
    if (kernels++) APPEND(" + ");
    append_part(buf, len, &used, &s->parts[i]);
  }
  if (!kernels) APPEND("no kernels");
  APPEND(" = %.1f us (median %.1f)", s->mean_us, s->median_us);
  for (int i = 0; i < s->num_parts; i++) {
    if (!s->parts[i].is_copy) continue;
    APPEND("; ");
    append_part(buf, len, &used, &s->parts[i]);
  }
  if (s->min_kernels != s->max_kernels)
    APPEND("; kernels per call vary: %d..%d", s->min_kernels, s->max_kernels);
  if (!isnan(s->span_us)) APPEND("; span %.1f us", s->span_us);
  if (!isnan(s->event_us)) APPEND("; event %.1f us", s->event_us);
  APPEND("; %d calls", s->num_calls);
  return (int)used;
}

/*
 * ktime.h - kernel time: the GPU's own duration of every kernel, memset and memcpy that a
 * benchmarked call launches, from CUPTI's activity API, summed per call (docs/bench.md,
 * "Timing"). Three files, one concern each:
 *   cupti_lib.c   finding and loading libcupti at run time (dlopen; no link-time dependency),
 *                 its own header cupti_lib.h (the function table, the search order)
 *   ktime.c       the collector: activity kinds on and off, each call bracketed by an external
 *                 correlation id, records copied out of CUPTI's buffers
 *   ktime_stats.c pure logic: records to per-call sums and a per-kernel breakdown, short
 *                 kernel names, the breakdown as text (host-tested, tests/host/test_ktime.c)
 * Invariant: nothing here ever fails a run. Every failure becomes a reason string and "no
 * figure"; the caller prints the reason and goes on timing with events alone.
 *
 * Attribution: bench_ktime_call_begin(id) pushes id as CUPTI's CUSTOM0 external correlation id
 * of the calling thread, bench_ktime_call_end pops it. CUPTI then writes, for every driver and
 * runtime API call in between, an external correlation record (API correlation id -> id); a
 * kernel, memset or memcpy record carries the correlation id of the API call that launched it.
 * So a call's activities are exactly those launched by this thread inside its bracket, whatever
 * stream they ran on; work launched between brackets (the benchmark's barrier) is not counted.
 * Used by one thread per process (each rank is a process); CUPTI's own worker thread may hand
 * back buffers concurrently, which the collector's mutex covers.
 */
#ifndef EPX_BENCH_KTIME_H_
#define EPX_BENCH_KTIME_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define BENCH_KTIME_MAX_PARTS 12 /* names in a breakdown; the rest are summed as "other" */
#define BENCH_KTIME_NAME_LEN 48  /* short kernel names are cut to this, NUL included */
#define BENCH_KTIME_REASON_LEN 256

/* ---------------------------------------------------------------------------------------------
 * Records and summaries (ktime_stats.c, pure)
 * ------------------------------------------------------------------------------------------- */
typedef enum { BENCH_KTIME_KERNEL = 0, BENCH_KTIME_MEMSET, BENCH_KTIME_MEMCPY } bench_ktime_kind_t;

/* One kernel, memset or memcpy that the GPU ran. */
typedef struct bench_ktime_activity {
  bench_ktime_kind_t kind;
  uint32_t correlation_id; /* of the API call that launched it */
  uint32_t stream_id;      /* CUPTI's id of the stream it ran on */
  uint64_t start_ns, end_ns;
  const char *name; /* kernels: short name (bench_ktime_short_name), owned by the collector */
} bench_ktime_activity_t;

/* An API call made inside a bracket: its correlation id and the bracket's external id. */
typedef struct bench_ktime_link {
  uint32_t correlation_id;
  uint64_t external_id;
} bench_ktime_link_t;

/* One line of a breakdown: a kernel name, or "[memset]" / "[memcpy]". */
typedef struct bench_ktime_part {
  char name[BENCH_KTIME_NAME_LEN];
  int is_copy;              /* memset or memcpy: counted in copy_us, not in mean_us */
  double launches_per_call; /* mean over calls */
  double us_per_call;       /* summed durations per call, mean over calls */
} bench_ktime_part_t;

/* Kernel time of num_calls calls of one operation on one rank. num_calls = 0: no figure (the
 * doubles are NAN). */
typedef struct bench_ktime_summary {
  int num_calls;
  double mean_us, median_us;    /* sum of the call's kernel durations (memsets, memcpys apart) */
  double copy_us;               /* sum of the call's memset and memcpy durations, mean */
  double span_us;               /* first activity's start to last one's end, mean */
  double event_us;              /* the profiled calls' own event median (filled by the caller) */
  int min_kernels, max_kernels; /* kernels per call: equal when every call launched alike */
  int num_parts;                /* kernels first, in order of first start; then the copies */
  bench_ktime_part_t parts[BENCH_KTIME_MAX_PARTS];
} bench_ktime_summary_t;

/* The summary of a run with no figure. */
bench_ktime_summary_t bench_ktime_none(void);

/* Summarize the calls whose external ids are [first_id, first_id + num_calls): each activity
 * goes to the call whose bracket made the API call with its correlation id; activities of
 * other ids, or of no id, are ignored. Neither array need be sorted. Returns 0, or -1 when out
 * of host memory. A call that launched nothing counts as 0 us. */
int bench_ktime_aggregate(const bench_ktime_activity_t *acts, size_t num_acts,
                          const bench_ktime_link_t *links, size_t num_links, uint64_t first_id,
                          int num_calls, bench_ktime_summary_t *out);

/* The activities of call `id` (as bench_ktime_aggregate attributes them), sorted by start, in a
 * new array (*out, free() it; NULL when there are none). Returns their number, or -1 when out
 * of host memory. */
long bench_ktime_call_timeline(const bench_ktime_activity_t *acts, size_t num_acts,
                               const bench_ktime_link_t *links, size_t num_links, uint64_t id,
                               bench_ktime_activity_t **out);

/* Overlap of two classes of a timeline's activities (class_of(a) = 0 or 1; others ignored): the
 * union of each class's busy intervals and of their intersection, in ns. */
typedef struct bench_ktime_overlap {
  uint64_t span_ns;    /* first start to last end, every class */
  uint64_t busy_ns[2]; /* time at least one activity of the class runs */
  uint64_t both_ns;    /* time both classes run */
} bench_ktime_overlap_t;
bench_ktime_overlap_t bench_ktime_overlap(const bench_ktime_activity_t *acts, size_t n,
                                          int (*class_of)(const bench_ktime_activity_t *a));

/* The short name of a kernel, from an Itanium-mangled name its identifier with its enclosing
 * scope's, anonymous namespaces left out ("_ZN3epx6normal8dispatchIiiLi0EEEv..." ->
 * "normal::dispatch", "_ZN12_GLOBAL__N_113layout_kernelILb0ElEEvN..." -> "layout_kernel"); an
 * unmangled name up to its first '(' or '<'; else the name as given; cut to len - 1
 * characters. */
void bench_ktime_short_name(const char *name, char *out, size_t len);

/* "layout_kernel 3.1 + notify_kernel 4.9 + dispatch_kernel 205.0 = 213.0 us" then the copies,
 * span and event time: the text of one --kernels line. Returns what snprintf returns. */
int bench_ktime_format(const bench_ktime_summary_t *s, char *buf, size_t len);

/* ---------------------------------------------------------------------------------------------
 * The collector (ktime.c). One per process; every function is a no-op returning -1 before a
 * successful bench_ktime_open.
 * ------------------------------------------------------------------------------------------- */
/* Load CUPTI (the first candidate that opens and has every symbol) and register the buffer
 * callbacks. Idempotent. Returns 0, or -1 with why in reason. */
int bench_ktime_open(char *reason, size_t len);
/* "<path>, CUPTI API version N" of the loaded library, or "" before a successful open. */
const char *bench_ktime_library(void);
/* Forget earlier records and enable the activity kinds (concurrent kernels, memsets, memcpys,
 * external correlation, and the driver and runtime API records the latter needs). */
int bench_ktime_start(char *reason, size_t len);
/* Bracket one call (external_id > 0) launched by this thread. A failure is remembered and
 * reported by bench_ktime_stop. */
void bench_ktime_call_begin(uint64_t external_id);
void bench_ktime_call_end(void);
/* Flush every record (the caller has synchronized the work it launched) and disable the kinds.
 * Returns 0, or -1 with why (records dropped, a CUPTI call failed) in reason. */
int bench_ktime_stop(char *reason, size_t len);
/* bench_ktime_aggregate of the records of the last start..stop. */
int bench_ktime_summarize(uint64_t first_id, int num_calls, bench_ktime_summary_t *out);
/* bench_ktime_call_timeline of the records of the last start..stop. */
long bench_ktime_timeline(uint64_t id, bench_ktime_activity_t **out);

#ifdef __cplusplus
}
#endif

#endif /* EPX_BENCH_KTIME_H_ */

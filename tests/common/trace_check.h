/*
 * trace_check.h - what the tests require of a trace file written by epx_trace_dump, checked on
 * the parsed JSON (tests/common/json.h): the Chrome trace structure every event needs, one
 * named track per block/warp, spans of one track nested or disjoint (as the viewers need them),
 * events sorted by time per rank, counts that agree with otherData, and a label on exactly the
 * ranks that dropped events.
 */
#ifndef EPX_TESTS_TRACE_CHECK_H_
#define EPX_TESTS_TRACE_CHECK_H_

#include <stddef.h>

#include "common/json.h"

#define TRACE_CHECK_MAX_RANKS 64

typedef struct trace_facts {
  int num_ranks;                          /* otherData.ranks */
  long long events, dropped;              /* otherData totals */
  long long spans[TRACE_CHECK_MAX_RANKS]; /* "X" events per rank */
  long long dropped_per_rank[TRACE_CHECK_MAX_RANKS];
  int labelled[TRACE_CHECK_MAX_RANKS];          /* rank has a process_labels entry */
  long long clock_syncs[TRACE_CHECK_MAX_RANKS]; /* "clock sync" instants per rank */
} trace_facts_t;

/* 0 if root is a valid EPX trace (facts filled), else -1 with the reason in why. */
int trace_check(const json_value_t *root, trace_facts_t *facts, char *why, size_t why_len);

/* trace_load - parse the file at path and trace_check it, as two test expectations (a failure
 * prints the path and the reason). *root stays for the caller (json_free).
 * Returns TEST_PASS or TEST_FAIL (common/runner.h). */
int trace_load(const char *path, json_value_t **root, trace_facts_t *facts);

/* Spans of rank `pid` named `name` (every rank if pid < 0). */
long long trace_count_spans(const json_value_t *root, int pid, const char *name);

/* The first span of rank pid named name: start and duration in ns; 0 if found, -1 if not. */
int trace_find_span(const json_value_t *root, int pid, const char *name, long long *ts_ns,
                    long long *dur_ns, long long *arg);

#endif /* EPX_TESTS_TRACE_CHECK_H_ */

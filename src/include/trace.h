/*
 * trace.h - in-kernel tracing, the pure host side: clock alignment across GPUs and the Chrome
 * trace writer (src/trace/clock.c, json.c, tags.c), on top of the event format of
 * trace_format.h. No GPU and no group here: the host tests drive these on synthetic ranks.
 *
 * At a dump (src/trace/dump.c) the host gathers every rank's events to rank 0, maps each
 * rank's %globaltimer onto rank 0's with offsets measured by barrier rounds at start and at
 * dump, and writes one JSON file in the Chrome trace event format (docs/profiling.md).
 * Invariant: everything declared here is a function of its arguments only.
 */
#ifndef EPX_TRACE_H_
#define EPX_TRACE_H_

#include <stdio.h>

#include "epx.h"
#include "trace_format.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What the writer knows of one rank. Its clock is mapped onto rank 0's as
 *   t0 = t - offset(t),  offset linear between (sync_local_ns[0], offset_ns[0]) and
 *   (sync_local_ns[1], offset_ns[1]) and constant outside; one anchor if the second is 0. */
typedef struct epx__trace_rank {
  const epx__trace_event_t *events; /* num_events of them, in any order */
  unsigned long long num_events;
  unsigned long long num_dropped;      /* claimed beyond the capacity */
  unsigned long long capacity;         /* events the rank's buffer held */
  int clock_valid;                     /* 0: the clock syncs failed; offsets are 0 (unaligned) */
  unsigned long long sync_local_ns[2]; /* this rank's %globaltimer at the two syncs (0 = none) */
  long long offset_ns[2];              /* this rank's clock minus rank 0's at those points */
  long long spread_ns;                 /* max - min of the offset over the sync rounds */
  long long timer_tick_ns;             /* the GPU timer's step, 0 if unknown */
  /* Per sync and round: this rank's stamp minus rank 0's, what the median is taken over (kept
   * for the JSON, so a bad alignment can be traced to the rounds that caused it). */
  long long round_offset_ns[2][EPX_TRACE_SYNC_ROUNDS];
  unsigned round_used[2]; /* bit k: round k had both stamps */
} epx__trace_rank_t;

/* Offset of one rank's clock from the reference's, from the exits of the same barrier rounds:
 * the median over rounds of mine[r] - ref[r] (rounds where either stamp is 0 are skipped), and
 * the spread (max - min) of those differences. Returns the rounds used (0: no offset). */
int epx__trace_clock_offset(const unsigned long long *mine, const unsigned long long *ref,
                            int rounds, long long *offset_ns, long long *spread_ns);
/* Rank r's clock model (sync_local_ns, offset_ns, spread_ns, clock_valid, and the per-round
 * round_offset_ns / round_used behind them) from the round stamps of its two measurements,
 * mine[2][EPX_TRACE_SYNC_ROUNDS], and rank 0's, ref[2][same] (at trace start, at dump). A
 * measurement with no usable round gives no anchor. */
void epx__trace_clock_model(const unsigned long long *mine, const unsigned long long *ref,
                            epx__trace_rank_t *r);
/* A time of rank r's clock on rank 0's clock. */
long long epx__trace_align(const epx__trace_rank_t *r, unsigned long long t);
/* Write the merged Chrome trace JSON of num_ranks ranks to f. Pure: no GPU, no globals.
 * Returns EPX_OK or EPX_ERR_SYSTEM (a write or allocation failed). */
epx_status_t epx__trace_write_json(FILE *f, int num_ranks, const epx__trace_rank_t *ranks);
/* Label, category and argument name of a tag ("tag" / "epx" / "arg" if unknown). */
const char *epx__trace_tag_label(int tag);
const char *epx__trace_tag_category(int tag);
const char *epx__trace_tag_arg(int tag);

#ifdef __cplusplus
}
#endif

#endif /* EPX_TRACE_H_ */

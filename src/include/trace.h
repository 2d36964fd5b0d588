/*
 * trace.h - in-kernel tracing: the event format shared by kernels and host, the list of tags,
 * and the host side (start/dump, clock alignment, the Chrome trace writer in src/trace.c).
 *
 * Kernels append fixed-size events to a per-rank device buffer (epx__trace_ring_t) through
 * src/kernels/trace.cuh. A slot is claimed with one atomicAdd on `count`; once `count` passes
 * `capacity` further events are counted but not written, so a full buffer keeps the first
 * `capacity` events and `count - capacity` says how many were dropped. The buffer does not
 * wrap: a wrapped slot could hold half of an old and half of a new event.
 * At a dump the host gathers every rank's events to rank 0, maps each rank's %globaltimer
 * onto rank 0's with offsets measured by barrier rounds at start and at dump, and writes one
 * JSON file in the Chrome trace event format (docs/profiling.md).
 * Invariant: an event is written in full by the thread that claimed its slot; the host reads
 * the buffer only after the stream that recorded it has been synchronized.
 */
#ifndef EPX_TRACE_H_
#define EPX_TRACE_H_

#include <stdio.h>

#include "epx.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Compiled in unless the library is built with `make TRACE=0` (then epx_trace_start returns
 * EPX_ERR_UNSUPPORTED and the kernels carry no tracing code at all). */
#ifndef EPX_TRACE_COMPILED
#define EPX_TRACE_COMPILED 1
#endif

/* Every tag: X(NAME, category, label, name of its argument). The category is the kernel
 * family (Chrome's "cat"), the label the slice's name in the viewer. Add tags at the end. */
#define EPX_TRACE_TAG_MAP(X)                                 \
  X(BARRIER, "barrier", "barrier", "last_peer")              \
  X(LAYOUT, "layout", "layout", "tokens")                    \
  X(NOTIFY, "notify", "notify", "num_recv")                  \
  X(NOTIFY_WAIT, "notify", "notify wait", "call")            \
  X(DISPATCH_SEND, "dispatch", "dispatch send", "tokens")    \
  X(DISPATCH_TOKEN, "dispatch", "dispatch token", "token")   \
  X(DISPATCH_WAIT, "dispatch", "dispatch wait", "last_peer") \
  X(COMBINE_SEND, "combine", "combine send", "units")        \
  X(COMBINE_UNIT, "combine", "combine unit", "peer")         \
  X(COMBINE_WAIT, "combine", "combine wait", "peer")         \
  X(COMBINE_REDUCE, "combine", "combine reduce", "tokens")   \
  X(COMBINE_TOKEN, "combine", "combine token", "token")      \
  X(LL_DISPATCH_SEND, "ll", "ll dispatch send", "tokens")    \
  X(LL_DISPATCH_WAIT, "ll", "ll dispatch wait", "sources")   \
  X(LL_DISPATCH_RECV, "ll", "ll dispatch recv", "block")     \
  X(LL_COMBINE_SEND, "ll", "ll combine send", "block")       \
  X(LL_COMBINE_WAIT, "ll", "ll combine wait", "ranks")       \
  X(LL_COMBINE_REDUCE, "ll", "ll combine reduce", "tokens")

typedef enum epx__trace_tag {
#define EPX_TRACE_TAG_ENUM_(name, cat, label, arg) EPX_TRACE_##name,
  EPX_TRACE_TAG_MAP(EPX_TRACE_TAG_ENUM_)
#undef EPX_TRACE_TAG_ENUM_
      EPX_TRACE_NUM_TAGS
} epx__trace_tag_t;

/* One span, 24 bytes. */
typedef struct epx__trace_event {
  unsigned long long start_ns; /* %globaltimer of this rank's GPU at the begin */
  unsigned int dur_ns;         /* end - begin, saturated at 2^32 - 1 (4.29 s) */
  int arg;                     /* tag-specific (token, peer, count); -1 = none */
  unsigned short tag;          /* epx__trace_tag_t */
  unsigned short block;        /* blockIdx.x of the recording thread */
  unsigned short warp;         /* threadIdx.x / 32 */
  unsigned short sm;           /* %smid */
} epx__trace_event_t;

/* The device buffer of one rank: this header, then `capacity` events. */
typedef struct epx__trace_ring {
  unsigned long long count;    /* slots claimed so far; > capacity: the rest were dropped */
  unsigned long long capacity; /* events the buffer holds */
} epx__trace_ring_t;

#define EPX_TRACE_DEFAULT_EVENTS (1 << 16) /* 1.5 MiB per rank */
#define EPX_TRACE_MAX_EVENTS (1 << 24)     /* 384 MiB per rank */
#define EPX_TRACE_SYNC_ROUNDS 9            /* barrier rounds per clock measurement (odd: median) */

#ifdef __CUDACC__
__host__ __device__
#endif
    static inline epx__trace_event_t *
    epx__trace_events(epx__trace_ring_t *ring) {
  return (epx__trace_event_t *)(ring + 1);
}

/* ---------------------------------------------------------------------------------------------
 * Host side (src/trace.c).
 * ------------------------------------------------------------------------------------------- */
struct epx_group;

/* Group creation: whether this rank's environment asks for tracing (EPX_TRACE set). */
int epx__trace_env_requested(void);
/* Group creation, once every rank agreed that EPX_TRACE is set: start tracing on the setup
 * stream and remember the path for destroy. Collective. A failure is logged, not returned. */
void epx__trace_env_begin(struct epx_group *g);
/* Group destroy, before the transport closes: write the EPX_TRACE file if the group was created
 * with it (collective), then free the group's trace buffers. Failures are logged. */
void epx__trace_group_end(struct epx_group *g);

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
} epx__trace_rank_t;

/* Offset of one rank's clock from the reference's, from the exits of the same barrier rounds:
 * the median over rounds of mine[r] - ref[r] (rounds where either stamp is 0 are skipped), and
 * the spread (max - min) of those differences. Returns the rounds used (0: no offset). */
int epx__trace_clock_offset(const unsigned long long *mine, const unsigned long long *ref,
                            int rounds, long long *offset_ns, long long *spread_ns);
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

/*
 * trace_internal.h - the state the files of src/trace/ share: a group's trace state (struct
 * epx__trace behind g->trace), the words of a dump's header, and the calls between the files:
 *
 *   tags.c clock.c json.c   pure: tag names, clock offsets and alignment, the Chrome writer
 *   ring.c                  the state, epx_trace_start, ring allocation and retirement
 *   dump.c                  epx_trace_dump: header all-gather, one decision, events to rank 0
 *   env.c                   EPX_TRACE: the hooks group creation and destroy call
 *
 * Invariant: g->trace_ring (what kernels record into) is non-NULL only between a successful
 * start and the next dump, and then equals g->trace->ring.
 */
#ifndef EPX_TRACE_INTERNAL_H_
#define EPX_TRACE_INTERNAL_H_

#include "epx.h"
#include "group.h"
#include "trace.h"

#define EPX_TRACE_SYNC_WORDS                                          \
  (1 + EPX_TRACE_SYNC_ROUNDS) /* the timer step, then a stamp a round \
                               */
#define EPX_TRACE_MAX_RETIRED 8

/* Header each rank contributes to a dump's all-gather (int64 words): its status, its ring's
 * counter and capacity, its timer step, and the round stamps of its two clock measurements. */
enum {
  EPX_TRACE_HDR_STATUS,
  EPX_TRACE_HDR_COUNT,
  EPX_TRACE_HDR_CAPACITY,
  EPX_TRACE_HDR_TICK,
  EPX_TRACE_HDR_START,
  EPX_TRACE_HDR_END = EPX_TRACE_HDR_START + EPX_TRACE_SYNC_ROUNDS,
  EPX_TRACE_HDR_WORDS = EPX_TRACE_HDR_END + EPX_TRACE_SYNC_ROUNDS
};

struct epx__trace {
  epx__trace_ring_t *ring;      /* device: header + capacity events; NULL before the first start */
  unsigned long long capacity;  /* of ring */
  unsigned long long *sync_dev; /* device [2][EPX_TRACE_SYNC_WORDS]: the clock at start, at dump */
  char *env_path;               /* EPX_TRACE destination of this group, or NULL */
  /* Rings of earlier capacities, freed at destroy: graphs captured while tracing may hold them. */
  epx__trace_ring_t *retired[EPX_TRACE_MAX_RETIRED];
  int num_retired;
};

/* ring.c */
/* g->trace, allocated (host state and its small device buffers) if the group has none. */
epx_status_t epx__trace_state_ensure(epx_group_t g);
/* Stop recording and free g->trace with every ring it held. Failures are logged. */
void epx__trace_state_free(epx_group_t g);
/* Whether stream is being captured into a CUDA graph (0 if that cannot be told). */
int epx__trace_stream_capturing(cudaStream_t stream);
/* epx_trace_start on a checked group; fn names the caller in messages. */
epx_status_t epx__trace_start(epx_group_t g, int capacity, cudaStream_t stream, const char *fn);

/* dump.c */
/* epx_trace_dump on a checked group. quiet_if_off: return EPX_OK without a message when no
 * rank was tracing (EPX_TRACE at destroy after the application dumped itself). */
epx_status_t epx__trace_dump(epx_group_t g, const char *path, epx_trace_summary_t *summary,
                             cudaStream_t stream, int quiet_if_off);

#endif /* EPX_TRACE_INTERNAL_H_ */

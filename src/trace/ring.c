/*
 * ring.c - a group's trace state and epx_trace_start: the host state behind g->trace, the
 * device event buffer (ring) each start empties or, at a new capacity, replaces, and the first
 * clock measurement (docs/profiling.md).
 *
 * A ring replaced by a start at another capacity is retired, not freed: a CUDA graph captured
 * while tracing still writes to it when replayed. Retired rings are freed with the state.
 * Invariant: g->trace_ring is set last, once the ring is empty and the clock kernel is queued.
 */
#include <stdlib.h>

#include "checks.h"
#include "kernels/api.h"
#include "param.h"
#include "registry.h"
#include "trace_internal.h"

epx_status_t epx__trace_state_ensure(epx_group_t g) {
  if (g->trace) return EPX_OK;
  struct epx__trace *tr = (struct epx__trace *)calloc(1, sizeof *tr);
  if (!tr) return epx__set_error(EPX_ERR_SYSTEM, "trace: out of host memory");
  epx_status_t res = EPX_OK;
  CUDA_CHECK_GOTO(
      cudaMalloc((void **)&tr->sync_dev, 2 * EPX_TRACE_SYNC_WORDS * sizeof(unsigned long long)),
      res, fail);
  g->trace = tr;
  return EPX_OK;
fail:
  if (tr->sync_dev) (void)CUDA_STATUS(cudaFree(tr->sync_dev)); /* logged; res is the cause */
  free(tr);
  return res;
}

void epx__trace_state_free(epx_group_t g) {
  struct epx__trace *tr = g->trace;
  if (!tr) return;
  g->trace_ring = NULL;
  /* Teardown goes on whatever fails; CUDA_STATUS logs each failure. Freeing device memory
   * waits for the device, which a pending NCCL operation may never let go (group.h). */
  if (!g->nccl_pending) {
    if (tr->ring) (void)CUDA_STATUS(cudaFree(tr->ring));
    if (tr->sync_dev) (void)CUDA_STATUS(cudaFree(tr->sync_dev));
    for (int i = 0; i < tr->num_retired; i++) (void)CUDA_STATUS(cudaFree(tr->retired[i]));
  }
  free(tr->env_path);
  free(tr);
  g->trace = NULL;
}

int epx__trace_stream_capturing(cudaStream_t stream) {
  enum cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &st) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return st != cudaStreamCaptureStatusNone;
}

#if EPX_TRACE_COMPILED
/* The capacity a start asks for: `capacity`, or EPX_TRACE_EVENTS when it is 0 (auto). */
static long long capacity_of(int capacity) {
  long long cap = capacity;
  if (cap == 0) {
    cap = epx__param_TraceEvents();
    if (cap < 1 || cap > EPX_TRACE_MAX_EVENTS) {
      EPX_WARN("EPX_TRACE_EVENTS=%lld is outside 1..%d; using %d", cap, EPX_TRACE_MAX_EVENTS,
               EPX_TRACE_DEFAULT_EVENTS);
      cap = EPX_TRACE_DEFAULT_EVENTS;
    }
  }
  return cap;
}

/* tr->ring of cap events: kept if it has that capacity, else a new one (the old retired). */
static epx_status_t ensure_ring(struct epx__trace *tr, long long cap, const char *fn) {
  if (tr->ring && tr->capacity == (unsigned long long)cap) return EPX_OK;
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
  return EPX_OK;
}
#endif

epx_status_t epx__trace_start(epx_group_t g, int capacity, cudaStream_t stream, const char *fn) {
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
  if (epx__trace_stream_capturing(stream))
    return epx__set_error(EPX_ERR_INVALID_USAGE,
                          "%s: stream is being captured into a CUDA graph; start tracing outside "
                          "the capture",
                          fn);
  const long long cap = capacity_of(capacity);
  EPX_CHECK(epx__trace_state_ensure(g));
  struct epx__trace *tr = g->trace;
  EPX_CHECK(ensure_ring(tr, cap, fn));
  /* Empty the buffer before this start's kernels see it (graphs captured during an earlier
   * trace with this ring would record into it again when replayed: the dump counts them). */
  const epx__trace_ring_t empty = {0, tr->capacity};
  CUDA_CHECK(
      cudaMemcpyAsync(tr->ring, &empty, sizeof empty, cudaMemcpyHostToDevice, g->setup_stream));
  CUDA_CHECK(cudaStreamSynchronize(g->setup_stream));
  epx__kernel_ctx_t ctx;
  epx__group_kernel_ctx(g, &ctx);
  EPX_CHECK(epx__clock_sync_launch(&ctx, tr->sync_dev, EPX_TRACE_SYNC_ROUNDS, stream));
  g->trace_ring = tr->ring;
  EPX_INFO(EPX_SUBSYS_GROUP, "trace started: %llu events per rank", tr->capacity);
  return EPX_OK;
#endif
}

EPX_EXPORT epx_status_t epx_trace_start(epx_group_t g, int capacity, cudaStream_t stream) {
  EPX_CHECK(epx__group_check(g));
  EPX_CHECK(epx__group_check_collective(g, "epx_trace_start"));
  return epx__trace_start(g, capacity, stream, "epx_trace_start");
}

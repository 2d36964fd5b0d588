/*
 * trace_format.h - in-kernel tracing, the part kernels and host share: the event format, the
 * per-rank device buffer (ring), and the list of tags. Kernels record through
 * src/kernels/trace.cuh; the host side lives in src/trace/ (docs/profiling.md).
 *
 * Kernels append fixed-size events to a per-rank device buffer (epx__trace_ring_t). A slot is
 * claimed with one atomicAdd on `count`; once `count` passes `capacity` further events are
 * counted but not written, so a full buffer keeps the first `capacity` events and
 * `count - capacity` says how many were dropped. The buffer does not wrap: a wrapped slot could
 * hold half of an old and half of a new event.
 * Invariant: an event is written in full by the thread that claimed its slot; the host reads
 * the buffer only after the stream that recorded it has been synchronized.
 */
#ifndef EPX_TRACE_FORMAT_H_
#define EPX_TRACE_FORMAT_H_

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
#define EPX_TRACE_TAG_MAP(X)                                  \
  X(BARRIER, "barrier", "barrier", "last_peer")               \
  X(LAYOUT, "layout", "layout", "tokens")                     \
  X(NOTIFY, "notify", "notify", "num_recv")                   \
  X(NOTIFY_WAIT, "notify", "notify wait", "call")             \
  X(DISPATCH_SEND, "dispatch", "dispatch send", "tokens")     \
  X(DISPATCH_TOKEN, "dispatch", "dispatch token", "token")    \
  X(DISPATCH_WAIT, "dispatch", "dispatch wait", "last_peer")  \
  X(COMBINE_SEND, "combine", "combine send", "units")         \
  X(COMBINE_UNIT, "combine", "combine unit", "peer")          \
  X(COMBINE_WAIT, "combine", "combine wait", "peer")          \
  X(COMBINE_REDUCE, "combine", "combine reduce", "tokens")    \
  X(COMBINE_TOKEN, "combine", "combine token", "token")       \
  X(LL_DISPATCH_SEND, "ll", "ll dispatch send", "tokens")     \
  X(LL_DISPATCH_WAIT, "ll", "ll dispatch wait", "sources")    \
  X(LL_DISPATCH_RECV, "ll", "ll dispatch recv", "block")      \
  X(LL_COMBINE_SEND, "ll", "ll combine send", "block")        \
  X(LL_COMBINE_WAIT, "ll", "ll combine wait", "ranks")        \
  X(LL_COMBINE_REDUCE, "ll", "ll combine reduce", "tokens")   \
  X(EXPAND_FAN_OUT_WAIT, "dispatch", "fan-out wait", "row")   \
  X(EXPAND_FAN_OUT_TOKEN, "dispatch", "fan-out token", "row") \
  X(EXPAND_EXPERT_READY, "dispatch", "expert ready", "expert")

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

#ifdef __cplusplus
}
#endif

#endif /* EPX_TRACE_FORMAT_H_ */

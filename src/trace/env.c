/*
 * env.c - EPX_TRACE: trace every group from epx_group_create to epx_group_destroy, which
 * writes the file. The hooks of trace_hooks.h, the only part of tracing group.c calls.
 *
 * The n-th traced group of the process (from 0) writes PATH, then PATH with ".g<n>" before its
 * extension: trace.json, trace.g1.json, ... (every rank counts alike: creation is collective).
 * Invariant: creation agreed that EPX_TRACE is set on every rank or traces none, so every rank
 * of a traced group holds its path and takes part in the dump at destroy. (A rank out of host
 * memory for the path at creation would not; that case is logged, not handled.)
 */
#include <stdlib.h>
#include <string.h>

#include "checks.h"
#include "trace_hooks.h"
#include "trace_internal.h"

int epx__trace_env_requested(void) {
  const char *path = getenv("EPX_TRACE");
  if (!path || !*path) return 0;
#if !EPX_TRACE_COMPILED
  EPX_WARN("EPX_TRACE=%s ignored: this EPX was built with TRACE=0", path);
  return 0;
#else
  return 1;
#endif
}

/* PATH for the n-th traced group (see above); NULL when out of host memory. */
static char *env_path_for(const char *path, int n) {
  const size_t len = strlen(path) + 32;
  char *out = (char *)malloc(len);
  if (!out) return NULL;
  if (n == 0) {
    snprintf(out, len, "%s", path);
    return out;
  }
  const char *dot = strrchr(path, '.'), *slash = strrchr(path, '/');
  if (!dot || (slash && dot < slash)) dot = path + strlen(path);
  snprintf(out, len, "%.*s.g%d%s", (int)(dot - path), path, n, dot);
  return out;
}

void epx__trace_on_group_create(epx_group_t g, int num_requesting) {
  if (num_requesting == 0) return;
  if (num_requesting < g->num_ranks) {
    EPX_WARN("EPX_TRACE is set on %d of %d ranks only; the group is not traced", num_requesting,
             g->num_ranks);
    return;
  }
  static int traced_groups;
  const int n = __atomic_fetch_add(&traced_groups, 1, __ATOMIC_RELAXED);
  epx_status_t res = epx__trace_state_ensure(g);
  if (res == EPX_OK) {
    g->trace->env_path = env_path_for(getenv("EPX_TRACE"), n);
    if (!g->trace->env_path) res = epx__set_error(EPX_ERR_SYSTEM, "out of host memory");
  }
  if (res == EPX_OK) res = epx__trace_start(g, 0, g->setup_stream, "EPX_TRACE");
  if (res == EPX_OK) res = CUDA_STATUS(cudaStreamSynchronize(g->setup_stream));
  if (res != EPX_OK)
    EPX_WARN("EPX_TRACE: could not start tracing the group: %s", epx_last_error());
  else
    EPX_INFO(EPX_SUBSYS_GROUP, "EPX_TRACE: tracing the group until destroy, into %s",
             g->trace->env_path);
}

void epx__trace_on_group_destroy(epx_group_t g) {
  struct epx__trace *tr = g->trace;
  if (!tr) return;
  if (tr->env_path) {
    /* Every rank has env_path (agreed at creation), so every rank takes part. */
    epx_trace_summary_t s;
    epx_status_t res = epx__trace_dump(g, tr->env_path, &s, g->setup_stream, 1);
    if (res != EPX_OK)
      EPX_WARN("EPX_TRACE: writing the trace of the group failed: %s", epx_last_error());
    else if (g->rank == 0 && s.num_events + s.num_dropped > 0)
      EPX_INFO(EPX_SUBSYS_GROUP, "EPX_TRACE: %lld events in %s (%lld dropped)", s.num_events,
               tr->env_path, s.num_dropped);
  }
  epx__trace_state_free(g);
}

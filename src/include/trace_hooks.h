/*
 * trace_hooks.h - what group creation and destruction need from tracing (src/trace/env.c):
 * EPX_TRACE traces a group from epx_group_create to epx_group_destroy. group.c sees these
 * three calls and nothing of the trace state behind g->trace.
 * Invariant: the hooks never fail the group; a tracing failure is logged and the group works
 * untraced.
 */
#ifndef EPX_TRACE_HOOKS_H_
#define EPX_TRACE_HOOKS_H_

#ifdef __cplusplus
extern "C" {
#endif

struct epx_group;

/* Whether this rank's environment asks for tracing (EPX_TRACE set; a warning and 0 when the
 * library was built with TRACE=0). Local: group creation all-gathers it with the config. */
int epx__trace_env_requested(void);
/* Group creation, after the transport opened, on every rank alike: num_requesting is the
 * number of ranks whose epx__trace_env_requested() was 1. Every rank: start tracing on the
 * setup stream until destroy (collective); some ranks: a warning, no tracing. */
void epx__trace_on_group_create(struct epx_group *g, int num_requesting);
/* Group destroy, before the transport closes: write the EPX_TRACE file if the group was
 * traced from creation (collective), then free the group's trace buffers. */
void epx__trace_on_group_destroy(struct epx_group *g);

#ifdef __cplusplus
}
#endif

#endif /* EPX_TRACE_HOOKS_H_ */

/*
 * agree.h - "every rank learns every rank's words, then every rank takes the same decision":
 * the small collectives EPX runs before any step that one rank could fail alone (group
 * creation's fingerprint, the transport's allocation, a trace dump, clearing the peer mask),
 * so that no rank is left waiting inside a collective another rank has given up on.
 *
 * Two kinds. Before the group's workspace exists (creation), over NCCL: each call copies this
 * rank's words to a device buffer, runs one NCCL collective over comm on `stream`, copies the
 * result back and waits for `stream` at most timeout_ms. In a live group, through the
 * workspace (epx__agree_group): no NCCL, bounded on the device by the group's budget, so a
 * dead or stalled peer is an error on every rank, not a hang. Either way the caller then
 * decides from data that is the same on every rank. Collective: every rank calls it, in the
 * same order as its other agreements.
 * Invariant: every CUDA and NCCL call is checked. Before the NCCL collective a call only
 * allocates a temporary device buffer and copies this rank's words into it; a rank whose
 * allocation or copy fails returns without joining. A group's agreements use scratch
 * allocated with the group, so they get through a device out of memory.
 */
#ifndef EPX_AGREE_H_
#define EPX_AGREE_H_

#include <stddef.h>
#include <stdint.h>

#include "epx.h"
#include "workspace.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Where an agreement over NCCL runs (before a group's workspace exists). */
typedef struct epx__agree {
  ncclComm_t comm;
  int num_ranks;       /* of comm */
  cudaStream_t stream; /* the copies and the collective; waited for before each call returns */
  int timeout_ms;      /* the host waits this long for the collective (> 0), then gives up */
} epx__agree_t;

/* all[q * n + i] = rank q's mine[i], for every rank q.
 *   mine - [IN] host, n int64 words;  all - [OUT] host, num_ranks x n int64 words. */
epx_status_t epx__agree_allgather(const epx__agree_t *a, const long long *mine, int n,
                                  long long *all);
/* *all_ok = the minimum of ok over ranks: with ok 0 or 1, whether every rank is ok. */
epx_status_t epx__agree_all(const epx__agree_t *a, int ok, int *all_ok);

/* Wait for `stream` until its work is done or timeout_ms has passed. A timeout returns
 * EPX_ERR_TIMEOUT naming `what`: an NCCL operation that waits for a dead or stalled peer then
 * stays pending on its communicator, which only ncclCommAbort ends (docs/api.md, "After a
 * fault"). */
epx_status_t epx__agree_wait_stream(cudaStream_t stream, int timeout_ms, const char *what);

/* The agreement of a live group: the same all-gather through the group's workspace
 * (kernels/agree.cu) instead of NCCL, bounded by the group's timeout_ms on the device, so a
 * dead, stalled or late peer costs one budget and an error on every rank, never a hang.
 * all[q * n + i] = rank q's mine[i] (n <= EPX_AGREE_MAX_WORDS), on `stream`, which is
 * synchronized. EPX_ERR_TIMEOUT (naming the rank and `fn`) when some rank did not take part
 * in time or gave this agreement up; a rank that arrives after the others gave up fails too.
 * skip: ranks this rank gave up on in an earlier agreement of the same step (failed of that
 * one): not waited for again (a dead one would cost another budget), and the call fails.
 * failed (optional): [OUT] the ranks given up on, skip included.
 * Collective over the group, ordered with its other agreements; every rank must call it, also
 * when its own part failed (put the failure in its words), so that the ranks' agreement counts
 * (their epochs) stay equal. */
epx_status_t epx__agree_group(epx_group_t g, cudaStream_t stream, const long long *mine, int n,
                              long long *all, const char *fn, unsigned skip, unsigned *failed);
/* Device scratch epx__agree_group needs, allocated with the group (group.h: agree_dev). */
#define EPX_AGREE_GROUP_SCRATCH_BYTES \
  ((size_t)(1 + EPX_MAX_RANKS) * EPX_AGREE_MAX_WORDS * sizeof(long long) + sizeof(long long))

#ifdef __cplusplus
}
#endif

#endif /* EPX_AGREE_H_ */

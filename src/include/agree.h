/*
 * agree.h - "every rank learns every rank's words, then every rank takes the same decision":
 * the small collectives EPX runs before any step that one rank could fail alone (group
 * creation's fingerprint, the transport's allocation, a trace dump), so that no rank is left
 * waiting inside a collective another rank has given up on.
 *
 * Each call copies this rank's words to a device buffer, runs one NCCL collective over comm on
 * `stream`, copies the result back and synchronizes `stream`; the caller then decides from
 * data that is the same on every rank. Collective: every rank of comm calls it, in the same
 * order as its other collectives on comm.
 * Invariant: every CUDA and NCCL call is checked. Before the collective a call only copies this
 * rank's words to the device, after allocating a temporary buffer when scratch is NULL; a rank
 * whose copy or allocation fails returns without joining. Callers that must get through a
 * device out of memory pass scratch allocated earlier (the trace dump does).
 */
#ifndef EPX_AGREE_H_
#define EPX_AGREE_H_

#include <stddef.h>
#include <stdint.h>

#include "epx.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Where an agreement runs. */
typedef struct epx__agree {
  ncclComm_t comm;
  int num_ranks;       /* of comm */
  cudaStream_t stream; /* the copies and the collective; synchronized before each call returns */
  void *scratch;       /* device memory of EPX_AGREE_SCRATCH_BYTES or more, or NULL (see above) */
} epx__agree_t;

/* Scratch bytes an all-gather of n int64 words per rank needs (the reductions need 4). */
#define EPX_AGREE_SCRATCH_BYTES(num_ranks, n) \
  ((size_t)((num_ranks) + 1) * (size_t)(n) * sizeof(long long))

/* all[q * n + i] = rank q's mine[i], for every rank q.
 *   mine - [IN] host, n int64 words;  all - [OUT] host, num_ranks x n int64 words. */
epx_status_t epx__agree_allgather(const epx__agree_t *a, const long long *mine, int n,
                                  long long *all);
/* *all_ok = the minimum of ok over ranks: with ok 0 or 1, whether every rank is ok. */
epx_status_t epx__agree_all(const epx__agree_t *a, int ok, int *all_ok);
/* *largest = the maximum of mine over ranks. */
epx_status_t epx__agree_max_u32(const epx__agree_t *a, uint32_t mine, uint32_t *largest);

#ifdef __cplusplus
}
#endif

#endif /* EPX_AGREE_H_ */

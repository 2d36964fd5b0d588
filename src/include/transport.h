/*
 * transport.h - how a group reaches its peers' memory. Transports sit behind one table chosen
 * at group creation; common code never branches on which one it has.
 */
#ifndef EPX_TRANSPORT_H_
#define EPX_TRANSPORT_H_

#include "epx.h"

#ifdef __cplusplus
extern "C" {
#endif

struct epx_group;

typedef struct epx__transport_ops {
  const char *name;
  /* Allocate g->layout.total_bytes of workspace on every rank, zeroed, register it and fill
   * g->workspace and g->peer_base. Collective. */
  epx_status_t (*open)(struct epx_group *g);
  /* Release what open created; safe on a partially opened group. Collective. */
  epx_status_t (*close)(struct epx_group *g);
} epx__transport_ops_t;

extern const epx__transport_ops_t epx__transport_nvlink;

/* Number of ranks of comm that this rank reaches by load/store (NCCL's LSA team). */
epx_status_t epx__transport_lsa_size(ncclComm_t comm, int *lsa_size);

#ifdef __cplusplus
}
#endif

#endif /* EPX_TRANSPORT_H_ */

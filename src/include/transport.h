/*
 * transport.h - what group.c needs from the transports before a group exists.
 */
#ifndef EPX_TRANSPORT_H_
#define EPX_TRANSPORT_H_

#include "epx.h"

#ifdef __cplusplus
extern "C" {
#endif
/* Number of ranks of comm that this rank reaches by load/store (NCCL's LSA team). */
epx_status_t epx__transport_lsa_size(ncclComm_t comm, int *lsa_size);
#ifdef __cplusplus
}
#endif

#endif /* EPX_TRANSPORT_H_ */

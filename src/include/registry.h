/*
 * registry.h - live EPX objects (groups and handles), so that a destroyed or foreign handle is
 * refused with EPX_ERR_INVALID_USAGE instead of being dereferenced.
 */
#ifndef EPX_REGISTRY_H_
#define EPX_REGISTRY_H_

#include "epx.h"

#ifdef __cplusplus
extern "C" {
#endif
epx_status_t epx__registry_add(const void *object);
void epx__registry_remove(const void *object);
int epx__registry_contains(const void *object);
/* A number unique to this registration of object (never reused, never 0); 0 if not live. A
 * handle keeps its group's serial, so a new group at a destroyed group's address is told apart. */
unsigned long long epx__registry_serial(const void *object);
/* EPX_OK if g is a live group; EPX_ERR_INVALID_ARGUMENT if NULL; EPX_ERR_INVALID_USAGE if
 * destroyed or never created. */
epx_status_t epx__group_check(epx_group_t g);
/* EPX_OK if h is a live handle of the live group g. */
epx_status_t epx__handle_check(epx_group_t g, epx_handle_t h);
#ifdef __cplusplus
}
#endif

#endif /* EPX_REGISTRY_H_ */

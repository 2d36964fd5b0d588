/*
 * layout.h - epx_layout's entry for already-checked arguments (src/layout.c), used by
 * epx_dispatch to fill its handle's routing.
 */
#ifndef EPX_LAYOUT_H_
#define EPX_LAYOUT_H_

#include "epx.h"

#ifdef __cplusplus
extern "C" {
#endif
epx_status_t epx__layout_enqueue(epx_group_t g, const epx_layout_args_t *args, cudaStream_t stream);
#ifdef __cplusplus
}
#endif

#endif /* EPX_LAYOUT_H_ */

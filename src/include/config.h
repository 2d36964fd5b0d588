/*
 * config.h - resolving and validating a group config (defaults for auto fields, limits).
 */
#ifndef EPX_CONFIG_H_
#define EPX_CONFIG_H_

#include "epx.h"
#include "workspace.h"

#ifdef __cplusplus
extern "C" {
#endif
/* Copy `in` (honouring in->size) into *out with auto fields resolved, then validate it for
 * num_ranks. Returns EPX_OK or the first problem, named in epx_last_error(). */
epx_status_t epx__config_resolve(const epx_group_config_t *in, int num_ranks,
                                 epx_group_config_t *out);
/* The workspace layout of a resolved config. */
void epx__config_layout(const epx_group_config_t *c, int num_ranks, epx__ws_layout_t *layout);
#ifdef __cplusplus
}
#endif

#endif /* EPX_CONFIG_H_ */

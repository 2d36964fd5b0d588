/*
 * barrier.h - launchers of the cross-rank barrier and of tracing's clock sync (barrier.cu).
 */
#ifndef EPX_KERNELS_BARRIER_H_
#define EPX_KERNELS_BARRIER_H_

#include <stdint.h>

#include "epx.h"
#include "kernel_ctx.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One-block barrier across all ranks through the control region's inboxes. */
epx_status_t epx__barrier_launch(const epx__kernel_ctx_t *ctx, cudaStream_t stream);
/* Clock sync of tracing: `rounds` barrier rounds; out[0] = %globaltimer's step, out[1 + r] =
 * this rank's %globaltimer at the end of round r (0 if it timed out). Device memory. */
epx_status_t epx__clock_sync_launch(const epx__kernel_ctx_t *ctx, unsigned long long *out,
                                    int rounds, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* EPX_KERNELS_BARRIER_H_ */

/*
 * gpu_util.h - helpers shared by the multi-GPU tests: configs, device buffers, test kernels.
 */
#ifndef EPX_TESTS_GPU_UTIL_H_
#define EPX_TESTS_GPU_UTIL_H_

#include <stdint.h>

#include "common/runner.h"
#include "epx.h"
#include "group.h"

static inline epx_group_config_t gpu_test_config(int max_tokens, int hidden, int experts,
                                                 int top_k) {
  epx_group_config_t c = EPX_GROUP_CONFIG_INIT;
  c.max_tokens_per_rank = max_tokens;
  c.hidden = hidden;
  c.num_experts = experts;
  c.top_k = top_k;
  c.timeout_ms = 2000;
  return c;
}

#ifdef __cplusplus
extern "C" {
#endif
/* Test kernels (tests/gpu/test_kernels.cu). */
/* Write `value` into slot [rank] of every rank's normal region (this rank's slot on peer p). */
cudaError_t test_write_peer_slots(epx_group_t g, uint64_t value, cudaStream_t stream);
/* Count the slots of this rank's normal region [0, R) that differ from `value` into *wrong. */
cudaError_t test_count_wrong_slots(epx_group_t g, uint64_t value, int *wrong_dev,
                                   cudaStream_t stream);
/* Keep the GPU busy for about `ns` nanoseconds on stream. */
cudaError_t test_spin_ns(uint64_t ns, cudaStream_t stream);
#ifdef __cplusplus
}
#endif

#endif /* EPX_TESTS_GPU_UTIL_H_ */

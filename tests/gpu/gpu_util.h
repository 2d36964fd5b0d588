/*
 * gpu_util.h - helpers shared by the multi-GPU tests: configs, a host barrier, test kernels.
 */
#ifndef EPX_TESTS_GPU_UTIL_H_
#define EPX_TESTS_GPU_UTIL_H_

#include <stdint.h>
#include <string.h>

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

/* The call is refused with status and its message (epx_last_error) names needle: a bad
 * argument refused by name. */
#define EXPECT_REFUSED(call, status, needle)                                       \
  do {                                                                             \
    EXPECT_STATUS((call), (status));                                               \
    EXPECTF(strstr(epx_last_error(), (needle)) != NULL, "message '%s' lacks '%s'", \
            epx_last_error(), (needle));                                           \
  } while (0)

/* The group has no async error on record; label names the place in the failure message. */
#define EXPECT_NO_ASYNC_ERROR(g, label)                                       \
  do {                                                                        \
    epx_async_error_t e_;                                                     \
    EXPECT_OK(epx_group_get_async_error((g), &e_));                           \
    EXPECTF(e_.status == EPX_OK, "%s: async error: %s", (label), e_.message); \
  } while (0)

/* Every rank meets on the host (an NCCL all-reduce of one int), nothing of EPX in flight
 * afterwards. */
static inline int gpu_host_barrier(epx_test_rank_t *t) {
  int *one = NULL;
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  EXPECT_CUDA(cudaMalloc((void **)&one, sizeof(int)));
  EXPECT_NCCL(ncclAllReduce(one, one, 1, ncclInt32, ncclSum, t->comm, t->stream));
  EXPECT_CUDA(cudaStreamSynchronize(t->stream));
  EXPECT_CUDA(cudaFree(one));
  return TEST_PASS;
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
/* A consumer of epx_dispatch_expand's arrival signals: for each local expert j, wait (at most
 * budget_ns in all) for ready[j] == 1, then sums[j] = the wrapping sum of the 32-bit words of
 * its rows [begin[j], min(begin[j] + count[j], cap)) of x (row_bytes each); late[j] = 1 where
 * the wait ran out (sums[j] 0), 2 where the first look saw 0 and the wait ended, else 0. */
cudaError_t test_expert_ready_sums(const uint32_t *ready, const int *begin, const int *count, int L,
                                   int cap, const void *x, int row_bytes, uint32_t *sums, int *late,
                                   uint64_t budget_ns, cudaStream_t stream);
/* Keep the GPU busy for about `ns` nanoseconds on stream. */
cudaError_t test_spin_ns(uint64_t ns, cudaStream_t stream);
#ifdef __cplusplus
}
#endif

#endif /* EPX_TESTS_GPU_UTIL_H_ */

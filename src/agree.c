/*
 * agree.c - the agreements of agree.h: before a group exists, one exchange over NCCL (words to
 * the device, one all-gather or all-reduce, the result back, a wait bounded on the host) behind
 * two calls; in a live group, the same all-gather through the workspace (kernels/agree.cu),
 * bounded on the device.
 *
 * Invariant: one buffer layout for the NCCL calls: the reduction works in place on one
 * element; the all-gather stages this rank's words after the num_ranks x n words it gathers.
 * No wait here is unbounded: a collective that does not complete in time is left pending, with
 * its buffer, and reported.
 */
#include "agree.h"

#include <time.h>

#include "checks.h"
#include "group.h"
#include "kernels/api.h"

/* One exchange of `count` elements of `elem_bytes` from every rank. gather: all-gather into
 * out[num_ranks x count] (own words staged after the gathered ones); else all-reduce with op
 * into out[count] (in place). */
static epx_status_t exchange(const epx__agree_t *a, const void *mine, size_t count,
                             size_t elem_bytes, ncclDataType_t type, int gather, ncclRedOp_t op,
                             void *out) {
  const size_t bytes = count * elem_bytes;
  const size_t out_bytes = gather ? (size_t)a->num_ranks * bytes : bytes;
  char *dev = NULL;
  epx_status_t res = EPX_OK;
  CUDA_CHECK(cudaMalloc((void **)&dev, gather ? out_bytes + bytes : bytes));
  char *own = gather ? dev + out_bytes : dev;
  CUDA_CHECK_GOTO(cudaMemcpyAsync(own, mine, bytes, cudaMemcpyHostToDevice, a->stream), res, exit);
  if (gather)
    NCCL_CHECK_GOTO(ncclAllGather(own, dev, count, type, a->comm, a->stream), res, exit);
  else
    NCCL_CHECK_GOTO(ncclAllReduce(own, dev, count, type, op, a->comm, a->stream), res, exit);
  /* The bounded wait comes before the copy back: a copy into pageable host memory returns only
   * once the stream's earlier work is done, so it would wait for the collective unbounded. */
  res = epx__agree_wait_stream(a->stream, a->timeout_ms,
                               gather ? "an NCCL all-gather of EPX" : "an NCCL all-reduce of EPX");
  if (res == EPX_ERR_TIMEOUT) {
    /* The collective still owns dev; freeing it would wait for the collective. */
    EPX_WARN("agree: %zu bytes of device memory left to the pending collective", out_bytes);
    return res;
  }
  if (res != EPX_OK) goto exit;
  CUDA_CHECK_GOTO(cudaMemcpyAsync(out, dev, out_bytes, cudaMemcpyDeviceToHost, a->stream), res,
                  exit);
  CUDA_CHECK_GOTO(cudaStreamSynchronize(a->stream), res, exit); /* the collective is done */
exit:
  cudaFree(dev);
  return res;
}

epx_status_t epx__agree_allgather(const epx__agree_t *a, const long long *mine, int n,
                                  long long *all) {
  return exchange(a, mine, (size_t)n, sizeof *mine, ncclInt64, 1, ncclSum, all);
}

epx_status_t epx__agree_all(const epx__agree_t *a, int ok, int *all_ok) {
  return exchange(a, &ok, 1, sizeof ok, ncclInt32, 0, ncclMin, all_ok);
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

epx_status_t epx__agree_wait_stream(cudaStream_t stream, int timeout_ms, const char *what) {
  const double deadline = now_s() + 1e-3 * (timeout_ms > 0 ? timeout_ms : 1);
  long pause_ns = 2000; /* polls back off from 2 us to 1 ms: quick when the peers are there */
  for (;;) {
    const cudaError_t e = cudaStreamQuery(stream);
    if (e == cudaSuccess) return EPX_OK;
    if (e != cudaErrorNotReady) return CUDA_STATUS(e);
    if (now_s() > deadline)
      return epx__set_error(EPX_ERR_TIMEOUT,
                            "%s did not complete within timeout_ms = %d: a peer is stalled or "
                            "dead; the operation stays pending on the NCCL communicator, which "
                            "only ncclCommAbort ends (docs/api.md, \"After a fault\")",
                            what, timeout_ms);
    const struct timespec pause = {0, pause_ns};
    nanosleep(&pause, NULL);
    if (pause_ns < 1000000) pause_ns *= 2;
  }
}

epx_status_t epx__agree_group(epx_group_t g, cudaStream_t stream, const long long *mine, int n,
                              long long *all, const char *fn, unsigned skip, unsigned *failed) {
  if (failed) *failed = 0;
  if (n < 1 || n > EPX_AGREE_MAX_WORDS)
    return epx__set_error(EPX_ERR_INTERNAL, "%s: an agreement of %d words (at most %d)", fn, n,
                          EPX_AGREE_MAX_WORDS);
  long long *dev_mine = g->agree_dev, *dev_all = dev_mine + EPX_AGREE_MAX_WORDS;
  int *dev_outcome = (int *)(dev_all + (size_t)EPX_MAX_RANKS * EPX_AGREE_MAX_WORDS);
  int outcome[2] = {-1, 0};
  epx__kernel_ctx_t ctx;
  epx__group_kernel_ctx(g, &ctx);
  CUDA_CHECK(
      cudaMemcpyAsync(dev_mine, mine, (size_t)n * sizeof *mine, cudaMemcpyHostToDevice, stream));
  EPX_CHECK(epx__agree_launch(&ctx, dev_mine, n, dev_all, skip, dev_outcome, stream));
  CUDA_CHECK(cudaMemcpyAsync(all, dev_all, (size_t)g->num_ranks * n * sizeof *all,
                             cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaMemcpyAsync(outcome, dev_outcome, sizeof outcome, cudaMemcpyDeviceToHost, stream));
  /* The kernel gives up within the budget by itself: this wait is bounded. */
  CUDA_CHECK(cudaStreamSynchronize(stream));
  if (failed) *failed = (unsigned)outcome[1] | skip;
  if (outcome[0] >= 0)
    return epx__set_error(EPX_ERR_TIMEOUT,
                          "%s: rank %d did not take part within timeout_ms = %d (it is stalled, "
                          "dead, or it gave up on another rank); nothing was done",
                          fn, outcome[0], g->config.timeout_ms);
  if (skip)
    return epx__set_error(EPX_ERR_TIMEOUT,
                          "%s: rank %d did not take part in an earlier step of this call; "
                          "nothing was done",
                          fn, __builtin_ctz(skip));
  return EPX_OK;
}

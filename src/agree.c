/*
 * agree.c - the agreement collectives of agree.h: one exchange (words to the device, one NCCL
 * all-gather or all-reduce, the result back, synchronize) behind three calls.
 *
 * Invariant: one buffer layout for all three: the reductions work in place on one element; the
 * all-gather stages this rank's words after the num_ranks x n words it gathers.
 */
#include "agree.h"

#include "checks.h"

/* One exchange of `count` elements of `elem_bytes` from every rank. gather: all-gather into
 * out[num_ranks x count] (own words staged after the gathered ones); else all-reduce with op
 * into out[count] (in place). */
static epx_status_t exchange(const epx__agree_t *a, const void *mine, size_t count,
                             size_t elem_bytes, ncclDataType_t type, int gather, ncclRedOp_t op,
                             void *out) {
  const size_t bytes = count * elem_bytes;
  const size_t out_bytes = gather ? (size_t)a->num_ranks * bytes : bytes;
  char *dev = (char *)a->scratch;
  epx_status_t res = EPX_OK;
  if (!dev) CUDA_CHECK(cudaMalloc((void **)&dev, gather ? out_bytes + bytes : bytes));
  char *own = gather ? dev + out_bytes : dev;
  CUDA_CHECK_GOTO(cudaMemcpyAsync(own, mine, bytes, cudaMemcpyHostToDevice, a->stream), res, exit);
  if (gather)
    NCCL_CHECK_GOTO(ncclAllGather(own, dev, count, type, a->comm, a->stream), res, exit);
  else
    NCCL_CHECK_GOTO(ncclAllReduce(own, dev, count, type, op, a->comm, a->stream), res, exit);
  CUDA_CHECK_GOTO(cudaMemcpyAsync(out, dev, out_bytes, cudaMemcpyDeviceToHost, a->stream), res,
                  exit);
  CUDA_CHECK_GOTO(cudaStreamSynchronize(a->stream), res, exit);
exit:
  if (dev != a->scratch) cudaFree(dev);
  return res;
}

epx_status_t epx__agree_allgather(const epx__agree_t *a, const long long *mine, int n,
                                  long long *all) {
  return exchange(a, mine, (size_t)n, sizeof *mine, ncclInt64, 1, ncclSum, all);
}

epx_status_t epx__agree_all(const epx__agree_t *a, int ok, int *all_ok) {
  return exchange(a, &ok, 1, sizeof ok, ncclInt32, 0, ncclMin, all_ok);
}

epx_status_t epx__agree_max_u32(const epx__agree_t *a, uint32_t mine, uint32_t *largest) {
  return exchange(a, &mine, 1, sizeof mine, ncclUint32, 0, ncclMax, largest);
}

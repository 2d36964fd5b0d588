/*
 * nvlink.cu - the NVLink transport: symmetric workspace through NCCL's device API (LSA).
 *
 * open(): ncclMemAlloc the workspace, zero it, register it as a symmetric window (collective),
 * create a device communicator (which fails cleanly if NCCL cannot give load/store access to
 * every peer), then resolve each peer's workspace base once with a tiny kernel that calls
 * ncclGetPeerPointer. Kernels afterwards see only plain pointers (design principle 3).
 * Between steps that allocate, ranks agree (agree.h) so that a rank that fails (e.g. out of
 * memory) does not leave the others inside a collective registration.
 */
#include <nccl.h>
#include <nccl_device.h>
#include <stdlib.h>
#include <string.h>

#include "agree.h"
#include "checks.h"
#include "group.h"
#include "transport.h"

namespace {

struct nvlink_state {
  void *base = nullptr;
  size_t bytes = 0;
  ncclWindow_t window = nullptr;
  ncclDevComm dev_comm;
  bool have_dev_comm = false;
};

__global__ void resolve_peers_kernel(ncclWindow_t window, int num_ranks, char **out) {
  const int p = threadIdx.x;
  if (p < num_ranks) out[p] = (char *)ncclGetPeerPointer(window, 0, p);
}

epx_status_t nvlink_close(epx_group_t g) {
  nvlink_state *s = (nvlink_state *)g->transport_state;
  if (!s) return EPX_OK;
  epx_status_t res = EPX_OK, r;
  if (s->have_dev_comm && (r = NCCL_STATUS(ncclDevCommDestroy(g->comm, &s->dev_comm))) != EPX_OK)
    res = r;
  if (s->window && (r = NCCL_STATUS(ncclCommWindowDeregister(g->comm, s->window))) != EPX_OK &&
      res == EPX_OK)
    res = r;
  if (s->base && (r = NCCL_STATUS(ncclMemFree(s->base))) != EPX_OK && res == EPX_OK) res = r;
  delete s;
  g->transport_state = nullptr;
  g->workspace = nullptr;
  memset(g->peer_base, 0, sizeof g->peer_base);
  return res;
}

epx_status_t nvlink_open(epx_group_t g) {
  nvlink_state *s = new (std::nothrow) nvlink_state();
  if (!s) return epx__set_error(EPX_ERR_SYSTEM, "nvlink transport: out of host memory");
  g->transport_state = s;
  s->bytes = g->layout.total_bytes;

  /* 1. Allocate and zero locally; agree before the collective registration. */
  epx_status_t local = NCCL_STATUS(ncclMemAlloc(&s->base, s->bytes));
  if (local == EPX_OK) local = CUDA_STATUS(cudaMemsetAsync(s->base, 0, s->bytes, g->setup_stream));
  if (local == EPX_OK) local = CUDA_STATUS(cudaStreamSynchronize(g->setup_stream));
  int all = 0;
  const epx__agree_t agree = {g->comm, g->num_ranks, g->setup_stream,
                              epx__group_nccl_timeout_ms(g->config.timeout_ms)};
  const epx_status_t agreed = epx__agree_all(&agree, local == EPX_OK, &all);
  if (agreed == EPX_ERR_TIMEOUT) g->nccl_pending = 1; /* the all-reduce may wait on */
  EPX_CHECK(agreed);
  if (local != EPX_OK) return local;
  if (!all)
    return epx__set_error(
        EPX_ERR_INVALID_USAGE,
        "epx_group_create: another rank could not allocate its %zu-byte workspace", s->bytes);
  g->workspace = (char *)s->base;

  /* 2. Register the symmetric window (collective; ends in a barrier, so every rank's zeroing
   *    is complete before any peer can reach its memory). */
  NCCL_CHECK(
      ncclCommWindowRegister(g->comm, s->base, s->bytes, &s->window, NCCL_WIN_COLL_SYMMETRIC));

  /* 3. Device communicator: fails if NCCL has no symmetric (load/store) access to all peers.
   *    NOTE: 2.28 wants the requirements zeroed (2.29+ has an initializer macro instead). No
   *    multimem: NVLink multicast stays off. */
  ncclDevCommRequirements reqs;
  memset(&reqs, 0, sizeof reqs);
  reqs.lsaBarrierCount = 1;
  ncclResult_t nr = ncclDevCommCreate(g->comm, &reqs, &s->dev_comm);
  if (nr != ncclSuccess)
    return epx__set_error(
        EPX_ERR_UNSUPPORTED,
        "ncclDevCommCreate failed (%s): NCCL cannot give load/store access to every peer "
        "(needs CUDA P2P between all GPUs and cuMem); %s",
        ncclGetErrorString(nr), ncclGetLastError(g->comm));
  s->have_dev_comm = true;

  /* 4. Peer base pointers, resolved once. */
  char **dev_table = nullptr;
  epx_status_t res = EPX_OK;
  CUDA_CHECK(cudaMalloc(&dev_table, sizeof(char *) * EPX_MAX_RANKS));
  resolve_peers_kernel<<<1, 32, 0, g->setup_stream>>>(s->window, g->num_ranks, dev_table);
  CUDA_CHECK_GOTO(cudaGetLastError(), res, exit);
  CUDA_CHECK_GOTO(cudaMemcpyAsync(g->peer_base, dev_table, sizeof(char *) * g->num_ranks,
                                  cudaMemcpyDeviceToHost, g->setup_stream),
                  res, exit);
  CUDA_CHECK_GOTO(cudaStreamSynchronize(g->setup_stream), res, exit);
  if (g->peer_base[g->rank] == nullptr)
    res = epx__set_error(EPX_ERR_INTERNAL, "nvlink transport: own window pointer did not resolve");
exit:
  cudaFree(dev_table);
  return res;
}

}  // namespace

extern "C" epx_status_t epx__transport_lsa_size(ncclComm_t comm, int *lsa_size) {
  ncclTeam_t lsa = ncclTeamLsa(comm);
  *lsa_size = lsa.nRanks;
  return EPX_OK;
}

extern "C" const epx__transport_ops_t epx__transport_nvlink = {"nvlink", nvlink_open, nvlink_close};

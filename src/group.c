/*
 * group.c - the group object's life: epx_group_create (collective), epx_group_destroy, the
 * queries, the barrier entry point, and the kernel context every launch gets from its group.
 * Async errors are read in async_error.c; tracing hangs off the group through trace_hooks.h.
 *
 * Creation is collective and never leaves a rank waiting on another that has already given
 * up: every rank first runs its local checks (NCCL version, config, NVLink reachability),
 * then all ranks all-gather a fingerprint of those results and of their configs (agree.h), and
 * every rank takes the same decision from the same data. Only then is memory allocated and
 * registered.
 */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "agree.h"
#include "arg_check.h"
#include "checks.h"
#include "config.h"
#include "debug.h"
#include "expand.h"
#include "group.h"
#include "kernels/api.h"
#include "param.h"
#include "registry.h"
#include "trace_hooks.h"
#include "transport.h"

epx__control_t *epx__group_control(epx_group_t g) {
  return (epx__control_t *)(g->workspace + g->layout.control_offset);
}

void epx__group_kernel_ctx(epx_group_t g, epx__kernel_ctx_t *ctx) {
  /* Every launching call comes here before its first launch. A CUDA error the application left
   * pending (e.g. a failed cudaMalloc) could otherwise come back from one of this call's
   * launches after the kernel was queued, and a rank that returns an error for a collective its
   * kernel still runs desynchronizes the group (issue 14). The application got that error from
   * its own call; it is logged here. A sticky error is not cleared by this and fails the
   * launch, as it should. */
  const cudaError_t stale = cudaGetLastError();
  if (stale != cudaSuccess)
    EPX_WARN(
        "a CUDA error from before this EPX call was pending (%s); it was cleared so that "
        "it is not taken for this call's",
        cudaGetErrorString(stale));
  memset(ctx, 0, sizeof *ctx);
  memcpy(ctx->peer_base, g->peer_base, sizeof ctx->peer_base);
  ctx->rank = g->rank;
  ctx->num_ranks = g->num_ranks;
  ctx->timeout_ns = (unsigned long long)g->config.timeout_ms * 1000000ull;
  ctx->error = g->error_dev;
  ctx->layout = g->layout;
  ctx->trace = g->trace_ring;
}

/* ------------------------------------------------------------------------------------------
 * Agreement across ranks before anything is allocated.
 * ---------------------------------------------------------------------------------------- */
enum {
  FP_STATUS,
  FP_NCCL_VERSION,
  FP_EPX_VERSION,
  FP_NUM_RANKS,
  FP_LSA_SIZE,
  FP_MAX_TOKENS,
  FP_HIDDEN,
  FP_EXPERTS,
  FP_TOP_K,
  FP_DTYPES,
  FP_MODES,
  FP_NUM_SMS,
  FP_TIMEOUT_MS,
  FP_LL_NUM_SMS,
  FP_LL_ROUTE,
  FP_LL_MAX_TOKENS,
  FP_EXPAND_ROWS,
  FP_EXPAND_FAN_OUT,
  FP_ALONE_FAN_OUT,
  FP_TRACE, /* EPX_TRACE set: not compared (no name); tracing starts if every rank has it */
  FP_COUNT
};
static const char *const fp_names[FP_COUNT] = {"local status",
                                               "NCCL runtime version",
                                               "EPX version",
                                               "rank count",
                                               "NVLink (LSA) team size",
                                               "config.max_tokens_per_rank",
                                               "config.hidden",
                                               "config.num_experts",
                                               "config.top_k",
                                               "config.dtypes",
                                               "config.modes",
                                               "config.num_sms",
                                               "config.timeout_ms",
                                               "config.ll_num_sms",
                                               "config.ll_route",
                                               "config.ll_max_tokens_per_rank",
                                               "config.expand_max_rows",
                                               "config.expand_fan_out",
                                               "EPX_MOE_ALONE_FAN_OUT as this GPU resolves it"};

/* Ranks reach epx_group_create at times further apart than calls of a running group (model
 * loading), and a transfer's length grows with its bytes: ten wait budgets, at least a
 * minute. */
int epx__group_nccl_timeout_ms(int timeout_ms) {
  if (timeout_ms <= 0) timeout_ms = (int)epx__param_TimeoutMs();
  return timeout_ms >= 6000 ? 10 * timeout_ms : 60000;
}

/* All-gather `mine` over comm into all[num_ranks][FP_COUNT], on a stream of its own (the group
 * and its setup stream do not exist yet). */
static epx_status_t allgather_fingerprint(ncclComm_t comm, int num_ranks, const long long *mine,
                                          long long *all, int timeout_ms) {
  cudaStream_t stream = NULL;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const epx__agree_t agree = {comm, num_ranks, stream, epx__group_nccl_timeout_ms(timeout_ms)};
  const epx_status_t res = epx__agree_allgather(&agree, mine, FP_COUNT, all);
  cudaStreamDestroy(stream);
  return res;
}

/* The same decision on every rank, from the same gathered data. */
static epx_status_t decide(int rank, int num_ranks, epx_status_t local, const long long *all) {
  for (int q = 0; q < num_ranks; q++) {
    if (all[q * FP_COUNT + FP_STATUS] == EPX_OK) continue;
    if (q == rank) return local; /* our own message is already in epx_last_error */
    return epx__set_error(EPX_ERR_INVALID_USAGE,
                          "epx_group_create: rank %d failed its local checks (%s); see its log", q,
                          epx_status_string((epx_status_t)all[q * FP_COUNT + FP_STATUS]));
  }
  for (int f = FP_NCCL_VERSION; f < FP_TRACE; f++)
    for (int q = 1; q < num_ranks; q++)
      if (all[q * FP_COUNT + f] != all[f])
        return epx__set_error(
            EPX_ERR_INVALID_USAGE,
            "epx_group_create: %s differs across ranks: rank 0 has %lld, rank %d has "
            "%lld; every rank must pass the same config",
            fp_names[f], all[f], q, all[q * FP_COUNT + f]);
  return EPX_OK;
}

/* Local checks of this rank; fills the resolved config. */
static epx_status_t local_checks(ncclComm_t comm, int num_ranks, const epx_group_config_t *in,
                                 epx_group_config_t *cfg, int *lsa_size, int *num_device_sms) {
  int version = 0;
  NCCL_CHECK(ncclGetVersion(&version));
  if (version != NCCL_VERSION_CODE)
    return epx__set_error(EPX_ERR_UNSUPPORTED,
                          "NCCL runtime is version %d but EPX was built with NCCL headers %d; the "
                          "device API of this NCCL needs them equal (check LD_LIBRARY_PATH)",
                          version, NCCL_VERSION_CODE);
  EPX_CHECK(epx__config_resolve(in, num_ranks, cfg));
  int comm_dev = -1, cur_dev = -1;
  NCCL_CHECK(ncclCommCuDevice(comm, &comm_dev));
  CUDA_CHECK(cudaGetDevice(&cur_dev));
  if (comm_dev != cur_dev)
    return epx__set_error(EPX_ERR_INVALID_USAGE,
                          "the current CUDA device is %d but the communicator's is %d; call "
                          "cudaSetDevice(%d) first",
                          cur_dev, comm_dev, comm_dev);
  CUDA_CHECK(cudaDeviceGetAttribute(num_device_sms, cudaDevAttrMultiProcessorCount, cur_dev));
  if (cfg->num_sms > *num_device_sms)
    return epx__set_error(EPX_ERR_INVALID_ARGUMENT, "config.num_sms = %d: the GPU has only %d SMs",
                          cfg->num_sms, *num_device_sms);
  /* DURING's dispatch runs num_sms sending blocks and fan-out blocks on the SMs they leave (one
   * block per SM): at least num_sms of those, or the fan-out cannot keep pace with the
   * transfer. */
  if (cfg->expand_fan_out == EPX_EXPAND_FAN_OUT_DURING && cfg->expand_max_rows > 0 &&
      2 * cfg->num_sms > *num_device_sms)
    return epx__set_error(EPX_ERR_INVALID_ARGUMENT,
                          "config.expand_fan_out = EPX_EXPAND_FAN_OUT_DURING with config.num_sms = "
                          "%d: the dispatch runs 2 x num_sms blocks, one per SM, and the GPU has "
                          "%d SMs; use num_sms <= %d or EPX_EXPAND_FAN_OUT_AFTER",
                          cfg->num_sms, *num_device_sms, *num_device_sms / 2);
  /* Low-latency blocks must all be resident at once (one per SM): at most the SM count. */
  if (cfg->ll_num_sms == EPX_AUTO) cfg->ll_num_sms = *num_device_sms;
  if (cfg->ll_num_sms > *num_device_sms)
    return epx__set_error(EPX_ERR_INVALID_ARGUMENT,
                          "config.ll_num_sms = %d: the GPU has only %d SMs", cfg->ll_num_sms,
                          *num_device_sms);
  EPX_CHECK(epx__transport_lsa_size(comm, lsa_size));
  if (*lsa_size != num_ranks)
    return epx__set_error(
        EPX_ERR_UNSUPPORTED,
        "only %d of the %d ranks are reachable over NVLink/P2P from this rank; EPX "
        "needs every peer on NVLink (one host, CUDA P2P between all GPUs)",
        *lsa_size, num_ranks);
  return EPX_OK;
}

/* Undo group_prepare (any part of it may be missing). */
static void group_release_prepared(epx_group_t g) {
  if (!g) return;
  epx__registry_remove(g);
  if (!g->nccl_pending) { /* (freeing device memory waits for the device) */
    if (g->error_host) cudaFreeHost((void *)g->error_host);
    if (g->agree_dev) cudaFree(g->agree_dev);
  }
  if (g->setup_stream) cudaStreamDestroy(g->setup_stream);
  free(g);
}

/* The parts of a group that can fail on one rank alone (host memory, a stream, the mapped error
 * record, the registry entry), made BEFORE the agreement so that such a failure is one of the
 * agreed statuses and every rank returns, instead of the others waiting forever in the
 * collective transport open (issue 14). *out is set as soon as it is allocated. */
static epx_status_t group_prepare(ncclComm_t comm, int rank, int num_ranks,
                                  const epx_group_config_t *cfg, int num_device_sms,
                                  epx_group_t *out) {
  epx_group_t g = (epx_group_t)calloc(1, sizeof *g);
  *out = g;
  if (!g) return epx__set_error(EPX_ERR_SYSTEM, "epx_group_create: out of host memory");
  g->rank = rank;
  g->num_ranks = num_ranks;
  g->comm = comm;
  g->config = *cfg;
  g->num_device_sms = num_device_sms;
  CUDA_CHECK(cudaGetDevice(&g->cuda_device));
  epx__config_layout(cfg, num_ranks, &g->layout);
  CUDA_CHECK(cudaStreamCreateWithFlags(&g->setup_stream, cudaStreamNonBlocking));
  CUDA_CHECK(cudaHostAlloc((void **)&g->error_host, sizeof *g->error_host, cudaHostAllocMapped));
  memset((void *)g->error_host, 0, sizeof *g->error_host);
  CUDA_CHECK(cudaHostGetDevicePointer((void **)&g->error_dev, (void *)g->error_host, 0));
  CUDA_CHECK(cudaMalloc((void **)&g->agree_dev, EPX_AGREE_GROUP_SCRATCH_BYTES));
  return epx__registry_add(g);
}

/* After one of EPX's NCCL operations timed out (g->nccl_pending), it may still wait on the
 * device for a dead peer, holding the workspace: waiting for the device or deregistering the
 * window would wait with it. The workspace and the transport's state are left behind (a leak,
 * logged) and only host state is freed; the application aborts the communicator next. */
static void leave_to_pending_nccl(epx_group_t g) {
  EPX_WARN(
      "an NCCL operation of this group timed out and may still be pending: %zu bytes of "
      "workspace (and a few small buffers) are left allocated; abort the communicator "
      "(ncclCommAbort) next",
      g->layout.total_bytes);
  g->transport_state = NULL;
  g->workspace = NULL;
}

EPX_EXPORT epx_status_t epx_group_create(ncclComm_t comm, const epx_group_config_t *config,
                                         epx_group_t *group) {
  EPX_CHECK(epx__check_not_null("epx_group_create", "comm", comm));
  if (group) *group = NULL;
  int num_ranks = 0, rank = 0;
  NCCL_CHECK(ncclCommCount(comm, &num_ranks));
  NCCL_CHECK(ncclCommUserRank(comm, &rank));
  epx__log_set_rank(rank);

  epx_group_config_t cfg;
  memset(&cfg, 0, sizeof cfg);
  int lsa_size = 0, num_device_sms = 0;
  epx_status_t local =
      group ? local_checks(comm, num_ranks, config, &cfg, &lsa_size, &num_device_sms)
            : epx__set_error(EPX_ERR_INVALID_ARGUMENT, "epx_group_create: group is NULL");
  epx_group_t g = NULL;
  if (local == EPX_OK) local = group_prepare(comm, rank, num_ranks, &cfg, num_device_sms, &g);
  char local_msg[512];
  snprintf(local_msg, sizeof local_msg, "%s", epx_last_error());

  long long mine[FP_COUNT] = {local,          NCCL_VERSION_CODE, EPX_VERSION_CODE,
                              num_ranks,      lsa_size,          cfg.max_tokens_per_rank,
                              cfg.hidden,     cfg.num_experts,   cfg.top_k,
                              cfg.dtypes,     cfg.modes,         cfg.num_sms,
                              cfg.timeout_ms, cfg.ll_num_sms,    cfg.ll_route};
  mine[FP_LL_MAX_TOKENS] = cfg.ll_max_tokens_per_rank;
  mine[FP_EXPAND_ROWS] = cfg.expand_max_rows;
  mine[FP_EXPAND_FAN_OUT] = cfg.expand_fan_out;
  const int alone_fan_out = epx__expand_alone_fan_out(
      epx__param_MoeAloneFanOut(), cfg.expand_fan_out, cfg.num_sms, num_device_sms);
  mine[FP_ALONE_FAN_OUT] = alone_fan_out;
  mine[FP_TRACE] = epx__trace_env_requested();
  /* On the stack for every supported rank count: no allocation that could fail here alone. */
  long long all_small[EPX_MAX_RANKS * FP_COUNT];
  long long *all = num_ranks <= EPX_MAX_RANKS
                       ? all_small
                       : (long long *)calloc((size_t)num_ranks * FP_COUNT, sizeof(long long));
  if (!all) { /* more ranks than supported: every rank fails here alike (local_checks) */
    group_release_prepared(g);
    return epx__set_error(EPX_ERR_SYSTEM, "epx_group_create: out of host memory");
  }
  epx_status_t res = allgather_fingerprint(comm, num_ranks, mine, all, cfg.timeout_ms);
  /* Timed out: the all-gather may wait on; freeing device memory would wait with it. */
  if (res == EPX_ERR_TIMEOUT && g) g->nccl_pending = 1;
  int trace_ranks = 0; /* ranks whose EPX_TRACE asks for tracing */
  if (res == EPX_OK) {
    if (local != EPX_OK) epx__set_error(local, "%s", local_msg); /* restore the local reason */
    res = decide(rank, num_ranks, local, all);
    for (int q = 0; q < num_ranks; q++) trace_ranks += all[q * FP_COUNT + FP_TRACE] != 0;
  }
  if (all != all_small) free(all);
  if (res != EPX_OK) {
    group_release_prepared(g);
    return res;
  }
  g->alone_fan_out = alone_fan_out;

  /* From here on every step is collective or agreed: the transport open agrees on its
   * allocation; nothing that can fail on one rank alone comes after it. */
  g->transport = &epx__transport_nvlink;
  EPX_CHECK_GOTO(g->transport->open(g), res, fail);
  /* Collective; a failure is logged and the group works untraced. */
  epx__trace_on_group_create(g, trace_ranks);
  EPX_INFO(EPX_SUBSYS_GROUP, "group created: rank %d of %d, workspace %zu bytes, transport %s",
           rank, num_ranks, g->layout.total_bytes, g->transport->name);
  *group = g;
  return EPX_OK;
fail:
  if (g->nccl_pending)
    leave_to_pending_nccl(g); /* the transport's memory may be in the pending operation */
  else
    g->transport->close(g); /* releases whatever part of the transport was opened */
  group_release_prepared(g);
  return res;
}

EPX_EXPORT epx_status_t epx_group_destroy(epx_group_t g) {
  if (!g) return EPX_OK;
  EPX_CHECK(epx__group_check(g));
  epx__registry_remove(g);
  /* EPX's own kernels all end within the wait budget, so this wait is bounded unless an NCCL
   * operation of EPX timed out (then nothing here waits for the device). */
  epx_status_t res = g->nccl_pending ? EPX_OK : CUDA_STATUS(cudaDeviceSynchronize());
  /* Collective but bounded: EPX_TRACE's file (skipped, with a warning, when a rank does not
   * take part in time), then the trace buffers. */
  epx__trace_on_group_destroy(g);
  if (g->nccl_pending) {
    leave_to_pending_nccl(g);
  } else {
    const epx_status_t r2 = g->transport->close(g);
    if (res == EPX_OK) res = r2;
  }
  group_release_prepared(g);
  return res;
}

epx_status_t epx__group_check_collective(epx_group_t g, const char *fn) {
  if (!g->nccl_pending) return EPX_OK;
  return epx__set_error(EPX_ERR_INVALID_USAGE,
                        "%s: an earlier NCCL operation of this group timed out on a dead or "
                        "stalled peer and may still be pending; destroy the group, then abort "
                        "the communicator (docs/api.md, \"After a fault\")",
                        fn);
}

/* A query: g is a live group and `out` is not NULL (named `arg` in the message), then the
 * group's field at `offset` (of the type *out points to) into *out. */
static epx_status_t query(epx_group_t g, const char *fn, const char *arg, void *out, size_t offset,
                          size_t bytes) {
  EPX_CHECK(epx__group_check(g));
  EPX_CHECK(epx__check_not_null(fn, arg, out));
  memcpy(out, (const char *)g + offset, bytes);
  return EPX_OK;
}
#define QUERY(g, fn, out, field) \
  query((g), (fn), #out, (out), offsetof(struct epx_group, field), sizeof *(out))

EPX_EXPORT epx_status_t epx_group_rank(epx_group_t g, int *rank) {
  return QUERY(g, "epx_group_rank", rank, rank);
}

EPX_EXPORT epx_status_t epx_group_size(epx_group_t g, int *num_ranks) {
  return QUERY(g, "epx_group_size", num_ranks, num_ranks);
}

EPX_EXPORT epx_status_t epx_group_get_config(epx_group_t g, epx_group_config_t *config) {
  return QUERY(g, "epx_group_get_config", config, config);
}

EPX_EXPORT epx_status_t epx_group_workspace_bytes(epx_group_t g, size_t *bytes) {
  return QUERY(g, "epx_group_workspace_bytes", bytes, layout.total_bytes);
}

static epx_status_t barrier(epx_group_t g, int skip_masked, cudaStream_t stream) {
  EPX_CHECK(epx__group_check(g));
  epx__kernel_ctx_t ctx;
  epx__group_kernel_ctx(g, &ctx);
  return epx__barrier_launch(&ctx, skip_masked, stream);
}

EPX_EXPORT epx_status_t epx_group_barrier(epx_group_t g, cudaStream_t stream) {
  return barrier(g, 0, stream);
}

EPX_EXPORT epx_status_t epx_group_barrier_unmasked(epx_group_t g, cudaStream_t stream) {
  return barrier(g, 1, stream);
}

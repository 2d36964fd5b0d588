/*
 * moe_prefill.c - epx_moe_prefill: one MoE layer at prefill size on normal-mode groups
 * (docs/moe.md, "MoE layer at prefill"), and its plan. Per chunk of tokens:
 *   epx_dispatch_expand (sync_counts = 1: the host learns each local expert's rows)  ->
 *   the FFN on the compute stream (src/moe_ffn.c: cuBLAS GEMMs per expert over the plan's
 *   GEMM lanes, or one batched GEMM per projection, the row kernel between them; or
 *   epx_experts_ffn)  ->  epx_combine_expand
 *   (weighted).
 *
 * Overlap: chunk c uses group c % 2 and its handle. Every dispatch and combine goes on the
 * plan's one communication stream, in the order D0 D1 C0 D2 C1 D3 C2 ..., and every FFN on its
 * compute stream; events order FFN c after D c and C c after FFN c. So:
 *   - one group is never used on two streams at once (EPX's rule): all its calls are on the
 *     communication stream;
 *   - D c (group c % 2) comes after C c-2 on that stream, so chunk c-2's rows and outputs are no
 *     longer needed when the group's receive buffers are overwritten;
 *   - FFN c writes output slot c % 2, which C c-2 (before D c, which FFN c waits for) has read.
 * The host queues D c+1 (and C c-1 before it) before it waits for chunk c's count exchange and
 * queues FFN c (epx_dispatch_expand in its two halves, expand.h), so D c+1's transfer runs while
 * the host is still queueing FFN c's GEMMs; when the host waits, FFN c-1 is queued, so the
 * compute stream does not starve.
 *
 * Invariant: every argument a step could refuse is checked before the first dispatch; once a
 * dispatch is queued, the call queues every remaining dispatch and every combine, whatever
 * fails, so that no peer waits for this rank (an FFN failure is returned at the end).
 */
#include <stdio.h>
#include <string.h>

#include "arg_check.h"
#include "checks.h"
#include "expand.h"
#include "experts.h"
#include "group.h"
#include "handle.h"
#include "kernels/api.h"
#include "moe_prefill.h"
#include "moe_test_hooks.h"
#include "param.h"
#include "registry.h"

#define WS_ALIGN 256

static size_t align_up(size_t v) {
  return (v + WS_ALIGN - 1) / WS_ALIGN * WS_ALIGN;
}

epx__moe_ws_layout_t epx__moe_ws_layout(int backend, int fp8, int gu_fp32, int lanes, size_t rows,
                                        int H, int I, size_t ffn_bytes, size_t send_tokens) {
  epx__moe_ws_layout_t l;
  memset(&l, 0, sizeof l);
  size_t off = 0;
  for (int s = 0; s < 2; s++) {
    l.y[s] = off;
    off += align_up(rows * (size_t)H * 2);
  }
  if (backend == EPX_MOE_FFN_EPX) {
    l.ffn = off;
    off += align_up(ffn_bytes);
    l.total = off;
    return l;
  }
  l.gu = off;
  off += align_up(rows * 2 * (size_t)I * (fp8 && gu_fp32 ? 4 : 2));
  l.h = off;
  off += align_up(rows * (size_t)I * (fp8 ? 1 : 2));
  if (fp8) {
    l.hs = off;
    off += align_up(rows * (size_t)(I / 128) * sizeof(float));
    l.xq = off; /* FP8 on the wire: the GEMMs read the received codes; no copy here */
    if (!send_tokens) off += align_up(rows * (size_t)H);
    l.xs = off;
    off += align_up(rows * (size_t)(H / 128) * sizeof(float));
  }
  l.blas = off;
  off += (size_t)(lanes > 1 ? lanes : 1) * align_up(EPX__MOE_BLAS_WS);
  if (send_tokens) { /* a chunk's tokens in FP8, before their dispatch */
    l.send = off;
    off += align_up(send_tokens * (size_t)H);
    l.send_s = off;
    off += align_up(send_tokens * (size_t)(H / 128) * sizeof(float));
  }
  l.total = off;
  return l;
}

void epx__moe_chunk(int T, int n, int c, int *first, int *count) {
  if (T < 0) T = 0;
  if (n < 1) n = 1;
  const int base = T / n, extra = T % n;
  *first = c * base + (c < extra ? c : extra);
  *count = c < n ? base + (c < extra ? 1 : 0) : 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Plan                                                                                       */
/* ------------------------------------------------------------------------------------------ */

static epx_status_t plan_check(const char *fn, epx_moe_prefill_t p) {
  if (!p) return epx__set_error(EPX_ERR_INVALID_ARGUMENT, "%s: plan = NULL", fn);
  if (!epx__registry_contains(p))
    return epx__set_error(EPX_ERR_INVALID_USAGE,
                          "%s: plan %p is not a live plan (destroyed, or never created)", fn,
                          (void *)p);
  for (int i = 0; i < p->num_groups; i++)
    if (epx__group_check(p->groups[i]) != EPX_OK)
      return epx__set_error(EPX_ERR_INVALID_USAGE,
                            "%s: the plan's group %d was destroyed; destroy the plan first", fn, i);
  return EPX_OK;
}

/* A group the layer can run on, and the same shape as the first. */
static epx_status_t check_group(const char *fn, const epx_group_t *groups, int i) {
  epx_group_t g = groups[i];
  EPX_CHECK(epx__group_check(g));
  if (!(g->config.modes & EPX_MODE_NORMAL))
    return epx__set_error(EPX_ERR_INVALID_USAGE,
                          "%s: groups[%d] was created without EPX_MODE_NORMAL in config.modes", fn,
                          i);
  if (g->layout.expand_rows == 0)
    return epx__set_error(EPX_ERR_INVALID_USAGE,
                          "%s: groups[%d] has config.expand_max_rows = 0 (the layer dispatches "
                          "into the expert-major layout); set it at epx_group_create",
                          fn, i);
  if (i == 0) {
    /* Room for any routing: every (token, local expert) pair of every source, and each expert's
     * alignment padding. Less would fail the dispatch on one receiving rank only. */
    const epx_group_config_t *c = &g->config;
    const int L = c->num_experts / g->num_ranks, per = c->top_k < L ? c->top_k : L;
    const long long need = (long long)g->num_ranks * c->max_tokens_per_rank * per +
                           (long long)(EPX__MOE_ALIGN - 1) * L;
    EPX_ARG_CHECK(c->expand_max_rows >= need,
                  "%s: groups[0] has config.expand_max_rows = %d: the layer needs at least %lld "
                  "(ranks x max_tokens_per_rank x min(top_k, local experts) + %d x local "
                  "experts of alignment padding)",
                  fn, c->expand_max_rows, need, EPX__MOE_ALIGN - 1);
    return EPX_OK;
  }
  const epx_group_config_t *a = &groups[0]->config, *b = &g->config;
  EPX_ARG_CHECK(g != groups[0], "%s: groups[1] = groups[0]: two distinct groups are needed", fn);
  EPX_ARG_CHECK(g->num_ranks == groups[0]->num_ranks && g->rank == groups[0]->rank &&
                    a->hidden == b->hidden && a->num_experts == b->num_experts &&
                    a->top_k == b->top_k && a->max_tokens_per_rank == b->max_tokens_per_rank &&
                    a->expand_max_rows == b->expand_max_rows && a->num_sms == b->num_sms,
                "%s: groups[1]: its ranks, rank, hidden, num_experts, top_k, "
                "max_tokens_per_rank, expand_max_rows and num_sms must equal groups[0]'s",
                fn);
  return EPX_OK;
}

static epx_status_t check_experts(const char *fn, epx_group_t g, const epx_experts_t *w) {
  EPX_CHECK(epx__experts_check(fn, w, EPX_DTYPE_BF16));
  EPX_CHECK(
      epx__experts_check_share(fn, w, g->config.num_experts / g->num_ranks, g->config.hidden));
  return EPX_OK;
}

/* The first failure of the release steps, with its message (a later step's failure would
 * replace epx_last_error's text). */
typedef struct {
  epx_status_t status;
  char message[512];
} release_t;

static void keep_release(release_t *r, epx_status_t st) {
  if (r->status != EPX_OK || st == EPX_OK) return;
  r->status = st;
  snprintf(r->message, sizeof r->message, "%s", epx_last_error());
}

/* Whether a group of the plan (still alive) has an NCCL operation pending (group.h): waiting for
 * the device would wait behind it, and freeing device memory or destroying a cuBLAS handle waits
 * for the device. */
static int plan_nccl_pending(epx_moe_prefill_t p) {
  for (int i = 0; i < p->num_groups; i++)
    if (p->groups[i] && epx__registry_contains(p->groups[i]) && p->groups[i]->nccl_pending)
      return 1;
  return 0;
}

/* Releases everything the plan holds and returns the first failure (every step runs either
 * way). With a group's NCCL operation pending, only the host memory is freed: the device
 * resources are left allocated, as epx_handle_destroy and epx_group_destroy do then. */
static epx_status_t plan_free(epx_moe_prefill_t p) {
  if (!p) return EPX_OK;
  if (plan_nccl_pending(p)) { /* (either handle's destroy would wait for the device) */
    for (int i = 0; i < 2; i++)
      if (p->handles[i]) epx__handle_free_host(p->handles[i]);
    free(p);
    return EPX_OK;
  }
  release_t first = {EPX_OK, ""};
  if (p->comm) keep_release(&first, CUDA_STATUS(cudaStreamSynchronize(p->comm)));
  if (p->compute) keep_release(&first, CUDA_STATUS(cudaStreamSynchronize(p->compute)));
  if (p->copy) keep_release(&first, CUDA_STATUS(cudaStreamSynchronize(p->copy)));
  for (int i = 1; i < EPX__MOE_MAX_LANES; i++)
    if (p->lane_stream[i])
      keep_release(&first, CUDA_STATUS(cudaStreamSynchronize(p->lane_stream[i])));
  keep_release(&first, epx__moe_gemm_destroy(p));
  for (int i = 0; i < 2; i++) {
    if (p->handles[i]) keep_release(&first, epx_handle_destroy(p->handles[i]));
    if (p->scales[i]) keep_release(&first, CUDA_STATUS(cudaFree(p->scales[i])));
  }
  if (p->ones) keep_release(&first, CUDA_STATUS(cudaFree(p->ones)));
  if (p->phase_parts) keep_release(&first, CUDA_STATUS(cudaFree(p->phase_parts)));
  if (p->gates) keep_release(&first, CUDA_STATUS(cudaFree(p->gates)));
  cudaEvent_t *events[] = {&p->start,    &p->comm_done, &p->compute_done,
                           &p->phase_up, &p->copied,    &p->slab_free};
  for (size_t i = 0; i < sizeof events / sizeof events[0]; i++)
    if (*events[i]) keep_release(&first, CUDA_STATUS(cudaEventDestroy(*events[i])));
  for (int i = 0; i < EPX_MAX_RANKS; i++)
    if (p->reduced[i]) keep_release(&first, CUDA_STATUS(cudaEventDestroy(p->reduced[i])));
  for (int c = 0; c < EPX__MOE_MAX_CHUNKS; c++) {
    if (p->dispatched[c]) keep_release(&first, CUDA_STATUS(cudaEventDestroy(p->dispatched[c])));
    if (p->ffn_done[c]) keep_release(&first, CUDA_STATUS(cudaEventDestroy(p->ffn_done[c])));
  }
  for (int i = 0; i < EPX__MOE_MAX_LANES; i++) {
    if (p->lane_stream[i]) keep_release(&first, CUDA_STATUS(cudaStreamDestroy(p->lane_stream[i])));
    if (p->lane_done[i]) keep_release(&first, CUDA_STATUS(cudaEventDestroy(p->lane_done[i])));
  }
  if (p->lane_fork) keep_release(&first, CUDA_STATUS(cudaEventDestroy(p->lane_fork)));
  if (p->comm) keep_release(&first, CUDA_STATUS(cudaStreamDestroy(p->comm)));
  if (p->compute) keep_release(&first, CUDA_STATUS(cudaStreamDestroy(p->compute)));
  if (p->copy) keep_release(&first, CUDA_STATUS(cudaStreamDestroy(p->copy)));
  free(p);
  return first.status == EPX_OK ? EPX_OK : epx__set_error(first.status, "%s", first.message);
}

/* The FP8 block scales [E][n/128][k/128] copied into [E][n/128][kb4] (kb4 = k/128 rounded up to
 * a multiple of 4, the padding 0): the leading dimension cuBLASLt's 128x128 scales take. */
static epx_status_t repack_scales(const float *src, int E, int n, int k, float **dst, int *kb4) {
  const size_t kb = (size_t)k / 128, nb = (size_t)n / 128;
  *kb4 = (int)((kb + 3) / 4 * 4);
  const size_t bytes = (size_t)E * nb * (size_t)*kb4 * sizeof(float);
  CUDA_CHECK(cudaMalloc((void **)dst, bytes));
  CUDA_CHECK(cudaMemset(*dst, 0, bytes));
  CUDA_CHECK(cudaMemcpy2D(*dst, (size_t)*kb4 * sizeof(float), src, kb * sizeof(float),
                          kb * sizeof(float), (size_t)E * nb, cudaMemcpyDeviceToDevice));
  return EPX_OK;
}

int epx__moe_auto_grouped_fp8(long long max_tokens_per_rank, int ranks, int top_k, int experts,
                              int chunks, int hidden, int intermediate) {
  if (experts <= 0 || chunks <= 0) return 1;
  const double rows = (double)max_tokens_per_rank * ranks * top_k / experts / chunks;
  return 2.0 * rows * hidden * 2.0 * intermediate < EPX__MOE_GROUPED_FP8_MAX_FLOPS;
}

/* Whether EPX's grouped FP8 GEMM runs here (FP8 weights checked by the caller); the reason in
 * epx_last_error otherwise. */
static epx_status_t grouped_fp8_runs_here(const char *fn, epx_moe_prefill_t p) {
  int dev = 0, major = 0, minor = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  if (major != 9 || minor != 0)
    return epx__set_error(EPX_ERR_UNSUPPORTED,
                          "%s: EPX_MOE_FFN_EPX_GROUPED needs a GPU of compute capability 9.0 (its "
                          "kernel is built for sm_90a); this one is %d.%d",
                          fn, major, minor);
  if (!epx__moe_gemm_fp8_supported(2 * p->I, p->H, p->L) ||
      !epx__moe_gemm_fp8_supported(p->H, p->I, p->L))
    return epx__set_error(EPX_ERR_UNSUPPORTED,
                          "%s: EPX_MOE_FFN_EPX_GROUPED: hidden %d and intermediate %d must be "
                          "multiples of 128, local experts %d at most %d",
                          fn, p->H, p->I, p->L, EPX_MAX_EXPERTS);
  if (!epx__moe_gemm_fp8_driver_ok())
    return epx__set_error(EPX_ERR_UNSUPPORTED,
                          "%s: EPX_MOE_FFN_EPX_GROUPED needs the driver's cuTensorMapEncodeTiled, "
                          "which this driver does not give",
                          fn);
  return EPX_OK;
}

/* Which backend runs the FFN, and the gate/up output type of FP8 cuBLASLt. */
static epx_status_t choose_backend(const char *fn, epx_moe_prefill_t p, int asked) {
  /* FP8 weights: EPX's grouped GEMM if asked for (refused where it cannot run), or by AUTO
   * where an expert's GEMM in a chunk is small (epx__moe_auto_grouped_fp8) and it can run
   * (cuBLASLt otherwise, the reason left in epx_last_error as plan_build's no-cuBLAS fallback
   * leaves its own). Without cuBLAS AUTO keeps EPX's FFN, as before the grouped GEMM existed:
   * that path is not run on the lent machines. */
  const epx_group_config_t *gc = &p->groups[0]->config;
  int grouped_fp8 = asked == EPX_MOE_FFN_EPX_GROUPED;
  if (grouped_fp8) EPX_CHECK(grouped_fp8_runs_here(fn, p));
  if (asked == EPX_MOE_FFN_AUTO && !p->no_blas && p->experts.weight_dtype == EPX_DTYPE_FP8_E4M3 &&
      epx__moe_auto_grouped_fp8(gc->max_tokens_per_rank, p->R, p->K, gc->num_experts, p->num_chunks,
                                p->H, p->I))
    grouped_fp8 = grouped_fp8_runs_here(fn, p) == EPX_OK;
  if (grouped_fp8) {
    /* The FP8 cuBLAS plan's workspace, scales and FP8 wire, its GEMMs replaced (moe_ffn.c) */
    p->backend = EPX_MOE_FFN_CUBLAS;
    p->fp8_grouped = 1;
    p->gu_fp32 = 1; /* closest to the oracle: h from float32 gate and up */
    return EPX_OK;
  }
  p->backend = asked == EPX_MOE_FFN_EPX || p->no_blas ? EPX_MOE_FFN_EPX : EPX_MOE_FFN_CUBLAS;
  /* BF16 weights: auto takes the batched GEMM (docs/moe.md: faster at both of issue 16's
   * shapes on 4x H200, ba211eb); asked for, the weights were checked and cuBLAS loaded */
  if (asked == EPX_MOE_FFN_CUBLAS_GROUPED ||
      (asked == EPX_MOE_FFN_AUTO && p->backend == EPX_MOE_FFN_CUBLAS &&
       p->experts.weight_dtype == EPX_DTYPE_BF16)) {
    p->grouped = 1;
    return epx__moe_gemm_batched_alloc(p);
  }
  if (p->backend == EPX_MOE_FFN_EPX || p->experts.weight_dtype != EPX_DTYPE_FP8_E4M3) return EPX_OK;
  p->gu_fp32 = 1; /* closest to the oracle: h from float32 gate and up */
  int ok = epx__moe_lt_supported(p, 0);
  if (!ok) {
    p->gu_fp32 = 0;
    ok = epx__moe_lt_supported(p, 0);
  }
  ok = ok && epx__moe_lt_supported(p, 1);
  if (ok) return EPX_OK;
  if (asked == EPX_MOE_FFN_CUBLAS)
    return epx__set_error(EPX_ERR_UNSUPPORTED,
                          "%s: config->ffn_backend = EPX_MOE_FFN_CUBLAS, but cuBLASLt has no FP8 "
                          "kernel with 128x128 weight and 1x128 row block scales on this GPU "
                          "(needs CUDA 12.9+ on Hopper); use EPX_MOE_FFN_AUTO",
                          fn);
  p->backend = EPX_MOE_FFN_EPX;
  p->gu_fp32 = 0;
  return EPX_OK;
}

/* What the dispatches carry. FP8 needs FP8 weights on cuBLAS (the GEMMs take FP8 rows with
 * per-128 scales as they are) and groups that carry FP8 (config.dtypes). */
static epx_status_t choose_wire(const char *fn, epx_moe_prefill_t p, int asked) {
  int groups_fp8 = 1;
  for (int i = 0; i < p->num_groups; i++)
    groups_fp8 = groups_fp8 && (p->groups[i]->config.dtypes & EPX_DTYPE_FP8_E4M3);
  const int weights_fp8 = p->experts.weight_dtype == EPX_DTYPE_FP8_E4M3;
  const int can = weights_fp8 && groups_fp8 && p->backend == EPX_MOE_FFN_CUBLAS;
  if (asked == EPX_DTYPE_FP8_E4M3 && !can) {
    if (weights_fp8 && groups_fp8) /* cuBLAS(Lt) missing or without the kernel here */
      return epx__set_error(EPX_ERR_UNSUPPORTED,
                            "%s: config->dispatch_dtype = EPX_DTYPE_FP8_E4M3 needs the cuBLAS FFN, "
                            "and this plan runs EPX's (cuBLASLt missing or without an FP8 "
                            "block-scaled kernel)",
                            fn);
    return epx__set_error(EPX_ERR_INVALID_ARGUMENT,
                          "%s: config->dispatch_dtype = EPX_DTYPE_FP8_E4M3 needs FP8 weights (%s) "
                          "and EPX_DTYPE_FP8_E4M3 in every group's config.dtypes (%s)",
                          fn, weights_fp8 ? "yes" : "no", groups_fp8 ? "yes" : "no");
  }
  p->wire_fp8 = asked == EPX_DTYPE_BF16 ? 0 : can;
  return EPX_OK;
}

/* The GEMM lanes (moe_ffn.c): `asked` (0: auto) with cuBLAS, else 1 (EPX's FFN). The batched
 * GEMM is one call per projection on the FFN's stream; its plan has lanes all the same for the
 * chunks that fall back to one GEMM per expert (a skewed routing). Lanes 1.. are streams of
 * the compute stream's priority. */
static epx_status_t lanes_build(epx_moe_prefill_t p, int asked) {
  p->lanes = p->backend == EPX_MOE_FFN_CUBLAS && !p->fp8_grouped
                 ? (asked ? asked : EPX__MOE_AUTO_LANES)
                 : 1;
  if (p->lanes <= 1) return EPX_OK;
  int least = 0, greatest = 0;
  CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  CUDA_CHECK(cudaEventCreateWithFlags(&p->lane_fork, cudaEventDisableTiming));
  for (int i = 1; i < p->lanes; i++) {
    CUDA_CHECK(cudaStreamCreateWithPriority(&p->lane_stream[i], cudaStreamNonBlocking, least));
    CUDA_CHECK(cudaEventCreateWithFlags(&p->lane_done[i], cudaEventDisableTiming));
  }
  return EPX_OK;
}

static epx_status_t plan_build(const char *fn, epx_moe_prefill_t p, int asked) {
  int least = 0, greatest = 0;
  CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  /* Communication first when both streams have blocks waiting: its kernels are few and short,
   * and the GEMMs wait for them. */
  CUDA_CHECK(cudaStreamCreateWithPriority(&p->comm, cudaStreamNonBlocking, greatest));
  CUDA_CHECK(cudaStreamCreateWithPriority(&p->compute, cudaStreamNonBlocking, least));
  CUDA_CHECK(cudaStreamCreateWithPriority(&p->copy, cudaStreamNonBlocking, greatest));
  cudaEvent_t *events[] = {&p->start,    &p->comm_done, &p->compute_done,
                           &p->phase_up, &p->copied,    &p->slab_free};
  for (size_t i = 0; i < sizeof events / sizeof events[0]; i++)
    CUDA_CHECK(cudaEventCreateWithFlags(events[i], cudaEventDisableTiming));
  for (int i = 0; i < p->R; i++)
    CUDA_CHECK(cudaEventCreateWithFlags(&p->reduced[i], cudaEventDisableTiming));
  /* Phases by source: the parts and the phases' rows (moe_prefill.h) and this rank's gate words,
   * 0 ("no call yet": every call's value is not 0) */
  const size_t E = (size_t)p->L * p->R;
  CUDA_CHECK(cudaMalloc((void **)&p->phase_parts, (3 * E + 1 + p->R * (p->L + 1)) * sizeof(int)));
  CUDA_CHECK(cudaMalloc((void **)&p->gates, (size_t)p->R * sizeof(unsigned)));
  CUDA_CHECK(cudaMemset(p->gates, 0, (size_t)p->R * sizeof(unsigned)));
  for (int c = 0; c < EPX__MOE_MAX_CHUNKS; c++) {
    CUDA_CHECK(cudaEventCreateWithFlags(&p->dispatched[c], cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&p->ffn_done[c], cudaEventDisableTiming));
  }
  for (int i = 0; i < p->num_groups; i++)
    EPX_CHECK(epx_handle_create(p->groups[i], &p->handles[i]));
  /* Weights of 1 for callers without topk_weights: every slot counts once, duplicates too. */
  const size_t n_ones = (size_t)p->num_chunks * p->groups[0]->config.max_tokens_per_rank * p->K;
  float *host = malloc(n_ones * sizeof(float));
  if (!host) return epx__set_error(EPX_ERR_SYSTEM, "%s: out of host memory", fn);
  for (size_t i = 0; i < n_ones; i++) host[i] = 1.f;
  epx_status_t st = CUDA_STATUS(cudaMalloc((void **)&p->ones, n_ones * sizeof(float)));
  if (st == EPX_OK)
    st = CUDA_STATUS(cudaMemcpy(p->ones, host, n_ones * sizeof(float), cudaMemcpyHostToDevice));
  free(host);
  EPX_CHECK(st);
  st = epx__moe_gemm_create(p);
  /* No cuBLAS on this machine: AUTO runs EPX's own FFN (choose_backend); the cuBLAS backends
   * fail here. */
  if (st == EPX_ERR_UNSUPPORTED && asked != EPX_MOE_FFN_CUBLAS &&
      asked != EPX_MOE_FFN_CUBLAS_GROUPED) {
    p->no_blas = 1;
    return EPX_OK;
  }
  return st;
}

EPX_EXPORT epx_status_t epx_moe_prefill_create(const epx_group_t *groups, int num_groups,
                                               const epx_experts_t *experts,
                                               const epx_moe_prefill_config_t *config,
                                               epx_moe_prefill_t *plan) {
  static const char fn[] = "epx_moe_prefill_create";
  EPX_CHECK(epx__check_not_null(fn, "plan", plan));
  *plan = NULL;
  EPX_CHECK(epx__check_not_null(fn, "groups", groups));
  EPX_ARG_CHECK(num_groups == 1 || num_groups == 2, "%s: num_groups = %d: must be 1 or 2", fn,
                num_groups);
  for (int i = 0; i < num_groups; i++) EPX_CHECK(check_group(fn, groups, i));
  EPX_CHECK(check_experts(fn, groups[0], experts));
  epx_moe_prefill_config_t cfg = EPX_MOE_PREFILL_CONFIG_INIT;
  if (config) {
    EPX_CHECK(epx__check_struct_size(fn, "config", config->size, sizeof(epx_moe_prefill_config_t),
                                     "EPX_MOE_PREFILL_CONFIG_INIT"));
    cfg = *config;
  }
  EPX_ARG_CHECK(
      cfg.num_chunks == 0 || (cfg.num_chunks >= 2 && cfg.num_chunks <= EPX__MOE_MAX_CHUNKS),
      "%s: config->num_chunks = %d: must be 0 (auto) or in [2, %d]", fn, cfg.num_chunks,
      EPX__MOE_MAX_CHUNKS);
  EPX_ARG_CHECK(cfg.ffn_backend >= EPX_MOE_FFN_AUTO && cfg.ffn_backend <= EPX_MOE_FFN_EPX_GROUPED,
                "%s: config->ffn_backend = %d: must be an epx_moe_ffn_backend_t", fn,
                cfg.ffn_backend);
  epx_group_t g = groups[0];
  EPX_ARG_CHECK(cfg.gemm_sms >= 0 && cfg.gemm_sms <= g->num_device_sms,
                "%s: config->gemm_sms = %d: must be in [0, the GPU's %d SMs]", fn, cfg.gemm_sms,
                g->num_device_sms);
  EPX_ARG_CHECK(cfg.dispatch_dtype == 0 || cfg.dispatch_dtype == EPX_DTYPE_BF16 ||
                    cfg.dispatch_dtype == EPX_DTYPE_FP8_E4M3,
                "%s: config->dispatch_dtype = %d: must be 0 (auto), EPX_DTYPE_BF16 or "
                "EPX_DTYPE_FP8_E4M3",
                fn, cfg.dispatch_dtype);
  EPX_ARG_CHECK(cfg.gemm_lanes >= 0 && cfg.gemm_lanes <= EPX__MOE_MAX_LANES,
                "%s: config->gemm_lanes = %d: must be 0 (auto) or in [1, %d]", fn, cfg.gemm_lanes,
                EPX__MOE_MAX_LANES);
  EPX_ARG_CHECK(
      cfg.ffn_backend != EPX_MOE_FFN_CUBLAS_GROUPED || experts->weight_dtype == EPX_DTYPE_BF16,
      "%s: config->ffn_backend = EPX_MOE_FFN_CUBLAS_GROUPED needs BF16 weights (cuBLAS's "
      "batched GEMM has no FP8 block scaling); use EPX_MOE_FFN_CUBLAS for FP8",
      fn);
  EPX_ARG_CHECK(
      cfg.ffn_backend != EPX_MOE_FFN_EPX_GROUPED || experts->weight_dtype == EPX_DTYPE_FP8_E4M3,
      "%s: config->ffn_backend = EPX_MOE_FFN_EPX_GROUPED needs FP8 weights (it is an FP8 GEMM); "
      "use EPX_MOE_FFN_CUBLAS_GROUPED for BF16",
      fn);

  epx_moe_prefill_t p = calloc(1, sizeof *p);
  if (!p) return epx__set_error(EPX_ERR_SYSTEM, "%s: out of host memory", fn);
  p->num_groups = num_groups;
  for (int i = 0; i < num_groups; i++) p->groups[i] = groups[i];
  p->experts = *experts;
  p->R = g->num_ranks;
  p->L = experts->num_experts;
  p->H = experts->hidden;
  p->I = experts->intermediate;
  p->K = g->config.top_k;
  p->rows = g->layout.expand_rows;
  p->num_chunks = cfg.num_chunks ? cfg.num_chunks : 2;
  p->device_sms = g->num_device_sms;
  /* The communication's SMs: num_sms, twice that with DURING. DURING's fan-out blocks
   * (epx__expand_fan_out_blocks) can be more than num_sms (66 at EP2 with 24 senders); those past
   * the reserve take SMs as the GEMMs' blocks end. The plan reserves only what group creation
   * checked; docs/moe.md has the chunked layer measured with a DURING group (slower than AFTER).
   * The chain's and the phases' dispatches fan out as the group's alone_fan_out says instead
   * (dispatch_fan_out): nothing of the layer runs beside them. */
  const int comm_sms =
      g->config.num_sms * (g->config.expand_fan_out == EPX_EXPAND_FAN_OUT_DURING ? 2 : 1);
  p->gemm_sms = cfg.gemm_sms ? cfg.gemm_sms : g->num_device_sms - comm_sms;
  if (p->gemm_sms < 1) p->gemm_sms = 1;
  epx_status_t st = plan_build(fn, p, cfg.ffn_backend);
  if (st == EPX_OK) st = choose_backend(fn, p, cfg.ffn_backend);
  /* EPX's grouped FP8 GEMM holds the SMs it is given for its whole launch (one CTA per SM, the
   * whole register file); the communication beside it ends long before it does, and the SMs
   * kept for that communication then idle: on 2x H200 its layer was 1.08x (DeepSeek) and 1.13x
   * (Qwen3) faster on all 132 SMs than on 108 (docs/moe.md, "EPX's grouped FP8 GEMM") */
  if (st == EPX_OK && p->fp8_grouped && !cfg.gemm_sms) p->gemm_sms = p->device_sms;
  if (st == EPX_OK) st = lanes_build(p, cfg.gemm_lanes);
  if (st == EPX_OK) st = choose_wire(fn, p, cfg.dispatch_dtype);
  if (st == EPX_OK && p->backend == EPX_MOE_FFN_EPX)
    st = epx_experts_ffn_workspace_size(experts, (int)p->rows, EPX_DTYPE_BF16, &p->ffn_bytes);
  if (st == EPX_OK && p->backend == EPX_MOE_FFN_CUBLAS &&
      experts->weight_dtype == EPX_DTYPE_FP8_E4M3) {
    st = repack_scales(experts->gate_up_scales, p->L, 2 * p->I, p->H, &p->scales[0],
                       &p->scales_kb[0]);
    if (st == EPX_OK)
      st = repack_scales(experts->down_scales, p->L, p->H, p->I, &p->scales[1], &p->scales_kb[1]);
  }
  /* The uploads above (the weights of 1, the repacked scales, the zeroed gates) ran on the legacy
   * stream, which
   * the plan's non-blocking streams do not wait for, nor may the caller's stream: a first call
   * must not read them half-written. */
  if (st == EPX_OK) st = CUDA_STATUS(cudaDeviceSynchronize());
  if (st == EPX_OK) st = epx__registry_add(p);
  if (st != EPX_OK) {
    char message[512];
    snprintf(message, sizeof message, "%s", epx_last_error());
    plan_free(p);
    return epx__set_error(st, "%s", message);
  }
  *plan = p;
  return EPX_OK;
}

EPX_EXPORT epx_status_t epx_moe_prefill_destroy(epx_moe_prefill_t p) {
  if (!p) return EPX_OK;
  if (!epx__registry_contains(p))
    return epx__set_error(EPX_ERR_INVALID_USAGE,
                          "epx_moe_prefill_destroy: plan %p is not a live plan", (void *)p);
  epx__registry_remove(p);
  return plan_free(p);
}

epx__moe_ws_layout_t epx__moe_plan_ws_layout(epx_moe_prefill_t p) {
  return epx__moe_ws_layout(p->backend, p->experts.weight_dtype == EPX_DTYPE_FP8_E4M3, p->gu_fp32,
                            p->lanes, p->rows, p->H, p->I, p->ffn_bytes,
                            p->wire_fp8 ? (size_t)p->groups[0]->config.max_tokens_per_rank : 0);
}

EPX_EXPORT epx_status_t epx_moe_prefill_workspace_size(epx_moe_prefill_t p, size_t *bytes) {
  static const char fn[] = "epx_moe_prefill_workspace_size";
  EPX_CHECK(plan_check(fn, p));
  EPX_CHECK(epx__check_not_null(fn, "bytes", bytes));
  *bytes = epx__moe_plan_ws_layout(p).total;
  return EPX_OK;
}

EPX_EXPORT epx_status_t epx_moe_prefill_get_info(epx_moe_prefill_t p,
                                                 epx_moe_prefill_info_t *info) {
  static const char fn[] = "epx_moe_prefill_get_info";
  EPX_CHECK(plan_check(fn, p));
  EPX_CHECK(epx__check_not_null(fn, "info", info));
  EPX_CHECK(epx__check_struct_size(fn, "info", info->size, sizeof(epx_moe_prefill_info_t),
                                   "EPX_MOE_PREFILL_INFO_INIT"));
  info->num_chunks = p->num_chunks;
  info->num_groups = p->num_groups;
  info->ffn_backend = p->grouped       ? EPX_MOE_FFN_CUBLAS_GROUPED
                      : p->fp8_grouped ? EPX_MOE_FFN_EPX_GROUPED
                                       : p->backend;
  info->gemm_sms = p->gemm_sms;
  info->gate_up_out_fp32 = p->gu_fp32;
  info->expert_alignment = EPX__MOE_ALIGN;
  info->workspace_bytes = epx__moe_plan_ws_layout(p).total;
  info->gemm_lanes = p->lanes;
  info->dispatch_dtype = p->wire_fp8 ? EPX_DTYPE_FP8_E4M3 : EPX_DTYPE_BF16;
  return EPX_OK;
}

static epx_status_t check_call(const char *fn, epx_moe_prefill_t p, const epx_moe_prefill_args_t *a,
                               const epx__moe_ws_layout_t *l, cudaStream_t stream) {
  EPX_CHECK(epx__check_not_null(fn, "args", a));
  enum cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone)
    return epx__set_error(EPX_ERR_INVALID_USAGE,
                          "%s: the stream is being captured; the prefill layer waits on the host "
                          "for each chunk's counts (cuBLAS takes host sizes), so it cannot be "
                          "captured (epx_moe_decode can)",
                          fn);
  EPX_CHECK(epx__check_struct_size(fn, "args", a->size, sizeof(epx_moe_prefill_args_t),
                                   "EPX_MOE_PREFILL_ARGS_INIT"));
  EPX_ARG_CHECK(a->overlap >= EPX_MOE_CHAIN && a->overlap <= EPX_MOE_OVERLAP_PHASES,
                "%s: args->overlap = %d: must be EPX_MOE_CHAIN (0), EPX_MOE_OVERLAP_CHUNKS (1) or "
                "EPX_MOE_OVERLAP_PHASES (2)",
                fn, a->overlap);
  if (a->overlap == EPX_MOE_OVERLAP_PHASES && !p->fp8_grouped)
    return epx__set_error(EPX_ERR_UNSUPPORTED,
                          "%s: args->overlap = EPX_MOE_OVERLAP_PHASES needs EPX's grouped FP8 GEMM "
                          "(FP8 weights, ffn_backend EPX_MOE_FFN_EPX_GROUPED or AUTO's choice of "
                          "it; epx_moe_prefill_get_info says which runs)",
                          fn);
  /* the gated combine sending on SMs holds num_sms of them while it waits for the phases: some
   * must be left (with the copy engines it starts after the phases) */
  if (a->overlap == EPX_MOE_OVERLAP_PHASES && !epx__param_MoePhasesCopyEngine() &&
      p->device_sms - p->groups[0]->config.num_sms < EPX__MOE_PHASES_MIN_SMS)
    return epx__set_error(
        EPX_ERR_UNSUPPORTED,
        "%s: args->overlap = EPX_MOE_OVERLAP_PHASES with the group's num_sms = %d "
        "of the GPU's %d SMs: the combine holds them while it waits for the "
        "phases, which need at least %d others",
        fn, p->groups[0]->config.num_sms, p->device_sms, EPX__MOE_PHASES_MIN_SMS);
  if (a->overlap == EPX_MOE_OVERLAP_CHUNKS && p->num_groups < 2)
    return epx__set_error(EPX_ERR_INVALID_USAGE,
                          "%s: args->overlap = 1 with a plan of one group: overlapped calls "
                          "alternate two groups (epx_moe_prefill_create with num_groups = 2)",
                          fn);
  const int M = p->groups[0]->config.max_tokens_per_rank;
  const int n = a->overlap == EPX_MOE_OVERLAP_CHUNKS ? p->num_chunks : 1;
  EPX_CHECK(epx__check_token_count(fn, "args->num_tokens", a->num_tokens, n * M));
  EPX_CHECK(epx__check_index_dtype(fn, "args->topk_idx_dtype", a->topk_idx_dtype));
  if (a->num_tokens > 0) {
    EPX_CHECK(epx__check_device_ptr(fn, "args->x", a->x, 16));
    EPX_CHECK(epx__check_device_ptr(fn, "args->topk_idx", a->topk_idx,
                                    (int)epx__index_bytes(a->topk_idx_dtype)));
    if (a->topk_weights)
      EPX_CHECK(epx__check_device_ptr(fn, "args->topk_weights", a->topk_weights, 4));
    EPX_CHECK(epx__check_device_ptr(fn, "args->out", a->out, 16));
  }
  EPX_CHECK(epx__check_device_ptr(fn, "args->workspace", a->workspace, WS_ALIGN));
  EPX_ARG_CHECK(a->workspace_bytes >= l->total,
                "%s: args->workspace_bytes = %zu: must be at least %zu "
                "(epx_moe_prefill_workspace_size)",
                fn, a->workspace_bytes, l->total);
  for (int i = 0; i < (a->overlap == EPX_MOE_OVERLAP_CHUNKS ? 2 : 1); i++)
    EPX_CHECK(epx__group_check_collective(p->groups[i], fn));
  return EPX_OK;
}

/* One call's state across its chunks (epx_moe_prefill's loop). Chunk c uses slot c % 2: its
 * group, handle, counts and output rows. */
typedef struct {
  epx_moe_prefill_t p;
  const epx_moe_prefill_args_t *a;
  epx__moe_ws_layout_t l;
  char *ws;
  cudaStream_t comm, compute;
  int n; /* chunks */
  size_t idx_bytes;
  epx_status_t first; /* the first failure, returned at the end */
  char message[512];
  int queued[2];   /* the slot's dispatch reached the GPU: its combine must follow */
  int enqueued[2]; /* ... without an error, and its end recorded: its counts can be waited for
                      and its FFN can wait for its rows */
  int tok_first[2];
  int y_block_rows[2]; /* the slot's FFN left y blocked (epx__moe_ffn): its combine maps it */
  int y_valid[2];      /* the slot's FFN was queued whole, and its end recorded */
  int counts[2][EPX_MAX_EXPERTS];
  epx__expand_pending_t pending[2];
  epx_dispatch_expand_result_t res[2]; /* filled when the slot's counts are waited for */
} chunk_call_t;

int epx__moe_test_fail_chunk = -1;
int epx__moe_test_phase_rows = -1;

/* Remember the first failure with its message. */
static void keep_first(chunk_call_t *k, epx_status_t st) {
  if (st == EPX_OK || k->first != EPX_OK) return;
  k->first = st;
  snprintf(k->message, sizeof k->message, "%s", epx_last_error());
}

epx_status_t epx__moe_order_after(cudaStream_t later, cudaStream_t earlier, cudaEvent_t ev) {
  epx_status_t st = CUDA_STATUS(cudaEventRecord(ev, earlier));
  if (st == EPX_OK) st = CUDA_STATUS(cudaStreamWaitEvent(later, ev, 0));
  if (st != EPX_OK && cudaStreamSynchronize(earlier) != cudaSuccess) {
    char first[256];
    snprintf(first, sizeof first, "%s", epx_last_error());
    st = epx__set_error(st, "%s; draining the earlier stream on the host failed too", first);
  }
  return st;
}

/* The blocks of a local HBM pass on the communication stream (a dispatch's fan-out, a combine's
 * expert-side reduce, the FP8 wire's quantization; two blocks per SM, which for the first two
 * fill an SM's registers): 0 = every SM where nothing runs beside them (a chain call; an
 * overlapped call's first dispatch and last combine), else the communication's share, so that they
 * do not hold every SM while the GEMMs' blocks and the FFN's small kernels wait to start (seen on
 * the timeline at 47d064c: each chunk's FFN started 20-30 us late behind the previous chunk's
 * reduce). */
static int local_blocks(const chunk_call_t *k, int beside_gemms) {
  return k->a->overlap && beside_gemms ? 2 * k->p->groups[0]->config.num_sms : 0;
}

/* A combine's blocks: the group's num_sms beside a chunk's GEMMs; alone (the chain's, an
 * overlapped call's last), every SM unless EPX_MOE_ALONE_COMBINE_BLOCKS says how many: its
 * reduce warps are latency-bound (on 24 blocks the chain's combine took 265 us at DeepSeek's
 * shape on 2 ranks where the phases' one on every SM took 62 for the same sums, docs/moe.md). */
static int combine_blocks(const chunk_call_t *k, int beside_gemms) {
  if (k->a->overlap && beside_gemms) return 0;
  const int64_t asked = epx__param_MoeAloneCombineBlocks();
  return asked > 0 && asked < k->p->device_sms ? (int)asked : k->p->device_sms;
}

/* Where a dispatch's fan-out runs (epx__dispatch_expand_enqueue's fan_out): with nothing of the
 * layer beside it (the chain's, the phases'), the group's alone_fan_out (DURING unless
 * EPX_MOE_ALONE_FAN_OUT says otherwise): the copies to a token's other rows then run as its rows
 * land, on SMs the dispatch leaves idle, instead of in a kernel after it (docs/moe.md, "The row
 * kernels' occupancy, DURING in the chain"); beside a chunk's GEMMs the group's config, whose
 * DURING blocks would take the GEMMs' SMs. The same on every rank: the overlap mode is, and group
 * creation compared alone_fan_out. */
static int dispatch_fan_out(const chunk_call_t *k) {
  return k->a->overlap == EPX_MOE_OVERLAP_CHUNKS ? 0 : k->p->groups[0]->alone_fan_out;
}

/* Queue chunk c's dispatch on the communication stream (no host wait: the counts are waited for
 * in run_ffn, after the next chunk's dispatch is queued). */
static void enqueue_dispatch(chunk_call_t *k, int c) {
  epx_moe_prefill_t p = k->p;
  const epx_moe_prefill_args_t *a = k->a;
  const int s = c % 2, H = p->H, K = p->K;
  int t0 = 0, T = 0;
  epx__moe_chunk(a->num_tokens, k->n, c, &t0, &T);
  epx_dispatch_args_t d = EPX_DISPATCH_ARGS_INIT;
  d.x = T > 0 ? (const char *)a->x + (size_t)t0 * H * 2 : a->x;
  d.x_dtype = EPX_DTYPE_BF16;
  if (p->wire_fp8) { /* quantize the chunk's tokens on the communication stream, send FP8 */
    const int share = local_blocks(k, c > 0);
    const int blocks = share > 0 ? share : epx__moe_row_blocks(p, 0);
    const epx__moe_quantize_tokens_launch_args_t qa = {
        d.x, k->ws + k->l.send, (float *)(k->ws + k->l.send_s), T, H, blocks};
    /* A failure is returned at the end; the dispatch goes anyway (every rank must make it,
     * and in the same dtype: the receivers read FP8 rows). */
    keep_first(k, epx__moe_quantize_tokens_launch(&qa, k->comm));
    d.x = k->ws + k->l.send;
    d.x_dtype = EPX_DTYPE_FP8_E4M3;
    d.x_scales = (const float *)(k->ws + k->l.send_s); /* [T, H/128], contiguous */
  }
  d.topk_idx = T > 0 ? (const char *)a->topk_idx + (size_t)t0 * K * k->idx_bytes : a->topk_idx;
  d.topk_idx_dtype = a->topk_idx_dtype;
  d.topk_weights = (a->topk_weights ? a->topk_weights : p->ones) + (size_t)t0 * K;
  d.num_tokens = T;
  d.expert_alignment = EPX__MOE_ALIGN;
  d.sync_counts = 1;
  d.num_recv_per_expert = k->counts[s];
  p->handles[s]->expand = 0; /* set again by the dispatch once everything is queued */
  const epx_status_t st =
      epx__dispatch_expand_enqueue(p->groups[s], p->handles[s], &d, &k->res[s], k->comm,
                                   local_blocks(k, c > 0), dispatch_fan_out(k), &k->pending[s]);
  keep_first(k, st);
  /* Without this record the FFN's wait would pass on a stale event and read rows still
   * arriving: such a chunk gets no FFN (its combine still runs). */
  const epx_status_t rec = CUDA_STATUS(cudaEventRecord(p->dispatched[c], k->comm));
  keep_first(k, rec);
  k->queued[s] = p->handles[s]->expand;
  k->enqueued[s] = st == EPX_OK && rec == EPX_OK;
  k->tok_first[s] = t0;
}

/* Wait for chunk c's counts; where they came, *rows describes its rows (begin: the caller's
 * [L + 1]) and 1 is returned; else 0, the failure kept. */
static int chunk_rows(chunk_call_t *k, int c, int *begin, epx__moe_rows_t *rows) {
  epx_moe_prefill_t p = k->p;
  const int s = c % 2, L = p->L;
  const epx_dispatch_expand_result_t *res = &k->res[s];
  epx_status_t st = k->enqueued[s] ? epx__dispatch_expand_finish(p->groups[s], p->handles[s],
                                                                 &k->pending[s], &k->res[s])
                                   : EPX_ERR_INTERNAL; /* (its failure is already kept) */
  if (k->enqueued[s]) keep_first(k, st);
  if (st != EPX_OK) return 0;
  begin[0] = 0;
  for (int j = 0; j < L; j++)
    begin[j + 1] =
        begin[j] + (k->counts[s][j] + EPX__MOE_ALIGN - 1) / EPX__MOE_ALIGN * EPX__MOE_ALIGN;
  if (begin[L] != res->num_rows) {
    keep_first(k, epx__set_error(EPX_ERR_INTERNAL,
                                 "epx_moe_prefill: chunk %d: %d rows from the counts, %d from "
                                 "the dispatch",
                                 c, begin[L], res->num_rows));
    return 0;
  }
  memset(rows, 0, sizeof *rows);
  rows->x = res->recv_x;
  rows->x_scales = res->recv_x_scales; /* NULL: BF16 rows */
  rows->num_rows = res->num_rows;
  rows->x_capacity = res->capacity;
  rows->count = k->counts[s];
  rows->begin = begin;
  rows->count_dev = res->expert_count_device;
  rows->begin_dev = res->expert_begin_device;
  rows->y = k->ws + k->l.y[s];
  return 1;
}

/* Wait for chunk c's counts and queue its FFN on the compute stream once its rows are in; the
 * FFN's end is recorded whatever failed, for the combine to wait on. */
static void run_ffn(chunk_call_t *k, int c) {
  epx_moe_prefill_t p = k->p;
  const int s = c % 2;
  k->y_block_rows[s] = 0;
  k->y_valid[s] = 0;
  int begin[EPX_MAX_EXPERTS + 1];
  epx__moe_rows_t rows;
  if (chunk_rows(k, c, begin, &rows)) {
    /* Without the wait the FFN would read rows still arriving: skip it then. */
    const epx_status_t ws_st = CUDA_STATUS(cudaStreamWaitEvent(k->compute, p->dispatched[c], 0));
    keep_first(k, ws_st);
    if (ws_st == EPX_OK) {
      const epx_status_t ffn =
          c == epx__moe_test_fail_chunk
              ? epx__set_error(EPX_ERR_INTERNAL,
                               "epx_moe_prefill: chunk %d: an FFN failure injected by a test", c)
              : epx__moe_ffn(p, &rows, k->a->overlap, k->ws, k->a->workspace_bytes,
                             &k->y_block_rows[s], k->compute);
      keep_first(k, ffn);
      k->y_valid[s] = ffn == EPX_OK;
    }
  }
  const epx_status_t rec = CUDA_STATUS(cudaEventRecord(p->ffn_done[c], k->compute));
  keep_first(k, rec);
  if (rec != EPX_OK) k->y_valid[s] = 0; /* the combine could not wait for the FFN's end */
}

/* Phase s of the phases by source: s's down projection on `sms` SMs (where the rows were
 * phased; else the FFN ran whole) and the expert-side reduce of s's tokens. Returns whether its
 * rows are valid (EPX_OK), keeping the first failure. */
static epx_status_t run_phase(chunk_call_t *k, const epx__moe_rows_t *rows, int valid, int phased,
                              int s, int sms) {
  epx_moe_prefill_t p = k->p;
  if (!valid) return EPX_ERR_INTERNAL;
  epx_status_t st = EPX_OK;
  if (phased) st = epx__moe_ffn_phased_down(p, rows, s, sms, k->ws, k->compute);
  if (st == EPX_OK)
    st = epx__expand_reduce_source(p->groups[0], p->handles[0], k->ws + k->l.y[0], 1, s,
                                   phased ? rows->parts_dev : NULL,
                                   phased ? rows->part_out_dev : NULL, 2 * sms, k->compute);
  keep_first(k, st);
  return st;
}

/* The copy stream after a check on the communication stream (right after the dispatch there)
 * that every peer has finished the combine that last used the slab parity the copies write,
 * the wait a combine makes before it stores into a peer's slab. */
static epx_status_t copies_wait_for_free_slabs(chunk_call_t *k) {
  epx_moe_prefill_t p = k->p;
  epx__kernel_ctx_t ctx;
  epx__group_kernel_ctx(p->groups[0], &ctx);
  EPX_CHECK(epx__combine_slab_free_launch(&ctx, k->comm));
  CUDA_CHECK(cudaEventRecord(p->slab_free, k->comm));
  CUDA_CHECK(cudaStreamWaitEvent(p->copy, p->slab_free, 0));
  return EPX_OK;
}

/* The phases with the copy engines (EPX_MOE_PHASES_COPY_ENGINE, the default): the GEMMs and
 * reduces keep every SM; after phase s's reduce, s's partial rows go into s's combine slab by
 * one copy on the plan's copy stream (notify left the tokens from each source and the slab's
 * parity in the handle's host counts, hc, read only where the counts were waited for: valid);
 * the combine, queued after the last phase and the last copy, only signals those rows and sums
 * this rank's tokens. A phase that failed, or whose copy could not be queued, writes its gate
 * with bit 31: the combine marks those rows; all of them where the copies could not be ordered
 * before it. */
static void phases_by_copy_engine(chunk_call_t *k, const epx__moe_rows_t *rows, int valid,
                                  int phased, const volatile int *hc) {
  epx_moe_prefill_t p = k->p;
  epx_group_t g = p->groups[0];
  const int R = p->R, me = g->rank, E = p->L * p->R;
  unsigned parity = 2; /* not known: nothing is copied, every row goes marked */
  int first[EPX_MAX_RANKS + 1] = {0};
  epx_status_t can_copy = EPX_ERR_INTERNAL;
  if (valid) {
    parity = (unsigned)hc[EPX__HOST_COUNTS_COMBINES(E, R)] & 1u;
    for (int s = 0; s < R; s++) first[s + 1] = first[s] + hc[EPX__HOST_COUNTS_TOKENS(E, R) + s];
    can_copy = copies_wait_for_free_slabs(k);
    keep_first(k, can_copy);
  }
  for (int i = 0; i < R; i++) {
    const int s = (me + 1 + i) % R;
    epx_status_t st = run_phase(k, rows, valid, phased, s, p->device_sms);
    if (st == EPX_OK && s != me) {
      st = can_copy;
      if (st == EPX_OK) st = CUDA_STATUS(cudaEventRecord(p->reduced[i], k->compute));
      if (st == EPX_OK) st = CUDA_STATUS(cudaStreamWaitEvent(p->copy, p->reduced[i], 0));
      if (st == EPX_OK)
        st = epx__combine_copy_rows(g, s, first[s], first[s + 1] - first[s], parity, p->copy);
      if (st != can_copy) keep_first(k, st);
    }
    const unsigned mark = st == EPX_OK ? 0u : 1u << 31;
    keep_first(k, epx__moe_gate_launch(p->gates + s, p->gate_value | mark, k->compute));
  }
  /* The combine after every phase and every copy; where an order cannot be queued, the host
   * drains that stream instead (epx__moe_order_after); if the copies' order failed at all, every
   * row goes marked (their signals must not vouch for rows that may not have landed). */
  const epx_status_t copies_ordered = epx__moe_order_after(k->comm, p->copy, p->copied);
  keep_first(k, copies_ordered);
  keep_first(k, epx__moe_order_after(k->comm, k->compute, p->phase_up));
  epx_combine_expand_args_t ca = EPX_COMBINE_EXPAND_ARGS_INIT;
  ca.x = k->ws + k->l.y[0];
  ca.weighted = 1;
  ca.out = k->a->out;
  /* Nothing runs beside it now: every SM (combine_blocks; on the group's 24 it took 392 us at
   * DeepSeek's shape on 2 ranks, 62 on every SM, docs/moe.md) */
  keep_first(k, epx__combine_expand_sent(g, p->handles[0], &ca, p->gates, p->gate_value, parity,
                                         copies_ordered != EPX_OK, combine_blocks(k, 0), k->comm));
}

/* EPX_MOE_OVERLAP_PHASES (docs/moe.md, "Phases by source"): one dispatch on group 0 (queued by
 * the caller), then on the compute stream the parts, gate/up and the row kernel over every row
 * and, per source s in the combine's order (this rank + 1 first, this rank last), s's down
 * projection, its expert-side reduce and its gate word. The rows go back by the copy engines
 * (phases_by_copy_engine, the default) or, with EPX_MOE_PHASES_COPY_ENGINE=0, by the gated
 * combine, which waits on the communication stream for the row kernel's end (so it takes its SMs
 * from the down projections, which run on the others) and sends each source's rows once its gate
 * opens. Every gate is written whatever failed (bit 31 set where the rows are not valid: they go
 * marked, and the peers leave them out), so no peer waits for rows that never come. */
static void run_phases(chunk_call_t *k) {
  epx_moe_prefill_t p = k->p;
  epx_group_t g = p->groups[0];
  epx_handle_t h = p->handles[0];
  const int L = p->L, R = p->R, me = g->rank;
  int begin[EPX_MAX_EXPERTS + 1];
  epx__moe_rows_t rows;
  int valid = chunk_rows(k, 0, begin, &rows);
  if (!k->queued[0]) return; /* no dispatch went out: no combine either (as chain calls) */
  p->gate_value = (p->gate_value + 1) & 0x7fffffffu;
  if (p->gate_value == 0) p->gate_value = 1;
  if (valid && epx__moe_test_fail_chunk == 0) { /* a test's failure: every gate marked */
    keep_first(k, epx__set_error(EPX_ERR_INTERNAL,
                                 "epx_moe_prefill: an FFN failure injected by a test (phases)"));
    valid = 0;
  }
  if (valid) {
    const epx_status_t st = CUDA_STATUS(cudaStreamWaitEvent(k->compute, p->dispatched[0], 0));
    keep_first(k, st);
    valid = st == EPX_OK;
  }
  /* The phases' rows on the host (the GEMMs' widths; the kernels' copy: the parts kernel), from
   * the rows of each source for each expert that notify left with the counts. Where they do not
   * fit the FFN's rows (each part rounded up to 4: at most 3 L R more than the dispatch's), the
   * FFN runs whole and the reduces and gates follow it: the same combine, no overlap. */
  int *dev = p->phase_parts, phase_begin[EPX_MAX_RANKS * (EPX_MAX_EXPERTS + 1)];
  int by_source[EPX_MAX_EXPERTS]; /* [L][R], L R = E */
  const volatile int *hc = (const volatile int *)h->host_counts;
  for (int i = 0; i < L * R; i++) by_source[i] = hc[EPX__HOST_COUNTS_BY_SOURCE(L * R, R) + i];
  const int row = epx__moe_phase_rows(by_source, L, R, phase_begin);
  const size_t room = epx__moe_test_phase_rows >= 0 ? (size_t)epx__moe_test_phase_rows : p->rows;
  const int phased = valid && (size_t)row <= room;
  if (phased) {
    rows.num_sources = R;
    rows.phase_rows = row;
    rows.phase_begin = phase_begin;
    rows.parts_dev = dev;
    rows.part_count_dev = dev + L * R + 1;
    rows.part_out_dev = dev + 2 * L * R + 1;
    rows.phase_begin_dev = dev + 3 * L * R + 1;
    const epx__moe_phase_parts_args_t pa = {
        h->host_counts_dev + EPX__HOST_COUNTS_BY_SOURCE(L * R, R),
        rows.begin_dev,
        dev,
        (int *)rows.part_count_dev,
        (int *)rows.part_out_dev,
        (int *)rows.phase_begin_dev,
        L,
        R};
    epx_status_t st = epx__moe_phase_parts_launch(&pa, k->compute);
    if (st == EPX_OK)
      st = epx__moe_ffn_phased_up(p, &rows, k->ws, k->a->workspace_bytes, k->compute);
    keep_first(k, st);
    valid = st == EPX_OK;
  } else if (valid) { /* (y in the dispatch's row order: the reduces map nothing) */
    int y_block_rows = 0;
    const epx_status_t st =
        epx__moe_ffn(p, &rows, 0, k->ws, k->a->workspace_bytes, &y_block_rows, k->compute);
    keep_first(k, st);
    valid = st == EPX_OK;
  }
  if (epx__param_MoePhasesCopyEngine()) {
    phases_by_copy_engine(k, &rows, valid, phased, hc);
    return;
  }
  /* Where the gated combine may start: after the row kernel (or whatever ran before a failure),
   * so that it takes its SMs from the down projections, which run on the others. */
  const epx_status_t up = CUDA_STATUS(cudaEventRecord(p->phase_up, k->compute));
  keep_first(k, up);
  /* The combine holds the group's num_sms SMs for the whole down projection (fewer measured
   * slower: 8, 12 and 16 blocks against 24 at 4 ranks, docs/moe.md "Phases by source"); the
   * phases' GEMMs and reduces run on the others. */
  const int blocks = g->config.num_sms, sms = p->device_sms - blocks;
  for (int i = 0; i < R; i++) {
    const int s = (me + 1 + i) % R;
    epx_status_t st = run_phase(k, &rows, valid, phased, s, sms);
    const unsigned mark = st == EPX_OK ? 0u : 1u << 31;
    keep_first(k, epx__moe_gate_launch(p->gates + s, p->gate_value | mark, k->compute));
  }
  /* The combine is queued last: it spins on the gates while the phases run, and a kernel launched
   * for the first time after it (CUDA's lazy module loading, the default) could wait for the
   * device to idle, that is for the combine, which waits for that kernel's gate: a timeout. */
  epx_status_t waited = up;
  if (up == EPX_OK) waited = CUDA_STATUS(cudaStreamWaitEvent(k->comm, p->phase_up, 0));
  if (waited != EPX_OK && cudaStreamSynchronize(k->compute) != cudaSuccess)
    keep_first(k, epx__set_error(waited, "epx_moe_prefill: the phases' compute stream failed"));
  keep_first(k, waited);
  epx_combine_expand_args_t ca = EPX_COMBINE_EXPAND_ARGS_INIT;
  ca.x = k->ws + k->l.y[0];
  ca.weighted = 1;
  ca.out = k->a->out;
  keep_first(k, epx__combine_expand_gated(g, h, &ca, p->gates, p->gate_value, blocks, k->comm));
}

/* Queue chunk c's combine once its FFN is done (queued even after an FFN failure: every peer
 * waits for this rank's rows; they then come marked not valid, and the peers leave them out and
 * record EPX_ERR_PEER_DATA). */
static void enqueue_combine(chunk_call_t *k, int c) {
  epx_moe_prefill_t p = k->p;
  const int s = c % 2;
  if (!k->queued[s]) return;
  const epx_status_t waited = CUDA_STATUS(cudaStreamWaitEvent(k->comm, p->ffn_done[c], 0));
  keep_first(k, waited);
  epx_combine_expand_args_t ca = EPX_COMBINE_EXPAND_ARGS_INIT;
  ca.x = k->ws + k->l.y[s];
  ca.weighted = 1;
  ca.out = (char *)k->a->out + (size_t)k->tok_first[s] * p->H * 2;
  keep_first(k, epx__combine_expand_blocked(p->groups[s], p->handles[s], &ca, k->y_block_rows[s],
                                            local_blocks(k, c + 1 < k->n),
                                            !k->y_valid[s] || waited != EPX_OK,
                                            combine_blocks(k, c + 1 < k->n), k->comm));
}

EPX_EXPORT epx_status_t epx_moe_prefill(epx_moe_prefill_t p, const epx_moe_prefill_args_t *a,
                                        cudaStream_t stream) {
  static const char fn[] = "epx_moe_prefill";
  EPX_CHECK(plan_check(fn, p));
  const epx__moe_ws_layout_t l = epx__moe_plan_ws_layout(p);
  EPX_CHECK(check_call(fn, p, a, &l, stream));
  const int n = a->overlap == EPX_MOE_OVERLAP_CHUNKS ? p->num_chunks : 1;
  /* Chain: every step on the caller's stream. Overlapped: the plan's two streams, after and
   * before the caller's (no early return from here on: the peers wait for every step). */
  chunk_call_t k;
  memset(&k, 0, sizeof k);
  if (a->overlap) {
    keep_first(&k, epx__moe_order_after(p->comm, stream, p->start));
    keep_first(&k, epx__moe_order_after(p->compute, stream, p->start));
  }
  k.p = p, k.a = a, k.l = l, k.ws = (char *)a->workspace;
  k.comm = a->overlap ? p->comm : stream;
  k.compute = a->overlap ? p->compute : stream;
  k.n = n;
  k.idx_bytes = epx__index_bytes(a->topk_idx_dtype);
  /* Communication order D0 D1 C0 D2 C1 D3 ... (D c+1 after C c-1: the group's receive rows are
   * free again). Chunk c+1's dispatch is queued before the host waits for chunk c's counts and
   * queues chunk c's GEMMs, so its transfer runs while the host is still queueing them. */
  enqueue_dispatch(&k, 0);
  if (a->overlap == EPX_MOE_OVERLAP_PHASES) {
    run_phases(&k);
  } else {
    for (int c = 0; c < n; c++) {
      if (c >= 1) enqueue_combine(&k, c - 1);
      if (c + 1 < n) enqueue_dispatch(&k, c + 1);
      run_ffn(&k, c);
    }
    enqueue_combine(&k, n - 1);
  }
  if (a->overlap) { /* the caller's stream after both, whatever failed before */
    keep_first(&k, epx__moe_order_after(stream, p->comm, p->comm_done));
    keep_first(&k, epx__moe_order_after(stream, p->compute, p->compute_done));
  }
  if (k.first != EPX_OK) return epx__set_error(k.first, "%s", k.message);
  return EPX_OK;
}

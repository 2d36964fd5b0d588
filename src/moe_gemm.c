/*
 * moe_gemm.c - the prefill layer's GEMMs through cuBLAS (docs/moe.md, "MoE layer at prefill"):
 * one GEMM per (expert, projection), y[rows, n] = x[rows, k] w[n, k]^T with row-major x, w and
 * y, which in cuBLAS's column-major terms is D (n x rows) = op(A = w, transposed) B (= x), the
 * "TN" form Hopper's FP8 kernels require.
 *   BF16 weights: cublasGemmEx, BF16 in and out, float32 compute, no reduced-precision
 *                 reduction.
 *   FP8 weights:  cublasLtMatmul with CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F on A (the
 *                 weights' 128x128 block scales, DeepSeek-V3's weight_scale_inv) and
 *                 CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F on B (the rows' per-128-channel
 *                 scales), CUDA 12.9+ on Hopper. The scale tensors' layouts, as read from the
 *                 cuBLAS documentation and PyTorch's use of it (not checked on a GPU here):
 *                 A's [k/128, n/128] column-major with its leading dimension k/128 rounded up
 *                 to 4 (the plan repacks the weights' scales so); B's [k/128, rows] with rows
 *                 contiguous (the quantize kernels write each expert's segment so).
 *   BF16 weights, batched (EPX_MOE_FFN_CUBLAS_GROUPED): every expert's GEMM of one projection
 *                 in one cublasGemmBatchedEx over blocks of the same row count (the largest
 *                 expert's, moe_ffn.c), its matrix pointers listed on the device by
 *                 epx__moe_group_ptrs_launch. cublasGemmGroupedBatchedEx (one problem per
 *                 expert, each its own size) was this backend at 22692d7: on 4x H200 its GEMMs
 *                 took 11.4 ms against 5.3 ms one cublasGemmEx per expert (DeepSeek-V3, 4096
 *                 tokens, BF16), so it went.
 * cuBLASLt algorithms come from its heuristic, cached per (projection, row-count bucket); a
 * cached algorithm that refuses a new size is looked up again for that size.
 * Every cuBLAS failure becomes EPX_ERR_CUDA with cuBLAS's status name.
 */
#include <stdlib.h>
#include <string.h>

#include "blas_lib.h"
#include "checks.h"
#include "kernels/api.h"
#include "moe_prefill.h"

/* cuBLAS's functions, loaded by the first plan's epx__moe_gemm_create (blas_lib.h). */
static const epx__blas_t *B;

static epx_status_t blas_status(cublasStatus_t st, const char *what) {
  if (st == CUBLAS_STATUS_SUCCESS) return EPX_OK;
  return epx__set_error(EPX_ERR_CUDA, "epx_moe_prefill: %s failed: %s", what,
                        B->cublasGetStatusName(st));
}
#define BLAS_CHECK(call) EPX_CHECK(blas_status((call), #call))

epx_status_t epx__moe_gemm_create(epx_moe_prefill_t p) {
  const char *why = NULL;
  if (!(B = epx__blas_load(&why)))
    return epx__set_error(EPX_ERR_UNSUPPORTED, "epx_moe_prefill: cuBLAS could not be loaded: %s",
                          why);
  BLAS_CHECK(B->cublasCreate(&p->blas));
  BLAS_CHECK(B->cublasSetMathMode(
      p->blas, CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION));
  if (p->experts.weight_dtype != EPX_DTYPE_FP8_E4M3) return EPX_OK;
  BLAS_CHECK(B->cublasLtCreate(&p->lt));
  for (int which = 0; which < 2; which++) {
    BLAS_CHECK(B->cublasLtMatmulDescCreate(&p->lt_desc[which], CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    const int32_t mode_a = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
                  mode_b = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    cublasLtMatmulDesc_t d = p->lt_desc[which];
    BLAS_CHECK(B->cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    BLAS_CHECK(B->cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    BLAS_CHECK(B->cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_a,
                                                 sizeof mode_a));
    BLAS_CHECK(B->cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode_b,
                                                 sizeof mode_b));
  }
  return EPX_OK;
}

static epx_status_t batched_free(epx_moe_prefill_t p); /* below, with the batched GEMM */

epx_status_t epx__moe_gemm_destroy(epx_moe_prefill_t p) {
  epx_status_t first = batched_free(p);
  epx_status_t st;
  for (int which = 0; which < 2; which++)
    if (p->lt_desc[which]) {
      st =
          blas_status(B->cublasLtMatmulDescDestroy(p->lt_desc[which]), "cublasLtMatmulDescDestroy");
      if (first == EPX_OK) first = st;
    }
  if (p->lt) {
    st = blas_status(B->cublasLtDestroy(p->lt), "cublasLtDestroy");
    if (first == EPX_OK) first = st;
  }
  if (p->blas) {
    st = blas_status(B->cublasDestroy(p->blas), "cublasDestroy");
    if (first == EPX_OK) first = st;
  }
  p->lt_desc[0] = p->lt_desc[1] = NULL;
  p->lt = NULL;
  p->blas = NULL;
  return first;
}

/* The plan's cuBLAS handle for the next call: its stream, workspace slice and SM target. */
static epx_status_t blas_bind(epx_moe_prefill_t p, cudaStream_t stream, void *blas_ws,
                              int sm_target) {
  BLAS_CHECK(B->cublasSetStream(p->blas, stream));
  /* After SetStream (which goes back to cuBLAS's own pool): GEMMs of other lanes may be
   * running on other streams, each with its own slice. */
  BLAS_CHECK(B->cublasSetWorkspace(p->blas, blas_ws, EPX__MOE_BLAS_WS));
  BLAS_CHECK(B->cublasSetSmCountTarget(p->blas, sm_target));
  return EPX_OK;
}

epx_status_t epx__moe_gemm_bf16(epx_moe_prefill_t p, const void *w, const void *x, void *y, int n,
                                int k, int rows, int sm_target, void *blas_ws,
                                cudaStream_t stream) {
  if (rows <= 0) return EPX_OK;
  const float one = 1.f, zero = 0.f;
  EPX_CHECK(blas_bind(p, stream, blas_ws, sm_target));
  BLAS_CHECK(B->cublasGemmEx(p->blas, CUBLAS_OP_T, CUBLAS_OP_N, n, rows, k, &one, w, CUDA_R_16BF, k,
                             x, CUDA_R_16BF, k, &zero, y, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                             CUBLAS_GEMM_DEFAULT));
  return EPX_OK;
}

/* Pointers from one of the batched GEMM's device arrays to the next: 32 x 8 bytes keeps each
 * array 256-byte aligned (with an odd L, an unpadded B array would start 8 bytes off 16, and
 * batched cuBLAS calls have refused such arrays). */
static size_t group_stride(int L) {
  return ((size_t)L + 31) / 32 * 32;
}

epx_status_t epx__moe_gemm_batched_alloc(epx_moe_prefill_t p) {
  CUDA_CHECK(cudaMalloc((void **)&p->group_ptrs, 3 * group_stride(p->L) * sizeof(void *)));
  CUDA_CHECK(cudaMalloc((void **)&p->blocked_begin, ((size_t)p->L + 1) * sizeof(int)));
  return EPX_OK;
}

static epx_status_t batched_free(epx_moe_prefill_t p) {
  const epx_status_t a = p->group_ptrs ? CUDA_STATUS(cudaFree(p->group_ptrs)) : EPX_OK;
  const epx_status_t b = p->blocked_begin ? CUDA_STATUS(cudaFree(p->blocked_begin)) : EPX_OK;
  p->group_ptrs = NULL;
  p->blocked_begin = NULL;
  return a != EPX_OK ? a : b;
}

epx_status_t epx__moe_gemm_bf16_batched(epx_moe_prefill_t p, const epx__moe_batched_gemm_t *g,
                                        int sm_target, void *blas_ws, cudaStream_t stream) {
  if (!p->group_ptrs || !p->blocked_begin)
    return epx__set_error(EPX_ERR_INTERNAL, "epx_moe_prefill: the batched GEMM was not set up");
  if (g->block_rows <= 0) return EPX_OK;
  const size_t S = group_stride(p->L);
  const epx__moe_group_ptrs_launch_args_t pa = {
      g->w,          g->w_stride,
      g->x,          g->x_row,
      g->y,          g->y_row,
      g->begin_dev,  p->L,
      g->block_rows, g->x_blocked,
      g->y_blocked,  (int)S,
      p->group_ptrs, g->blocked_begin ? p->blocked_begin : NULL};
  EPX_CHECK(epx__moe_group_ptrs_launch(&pa, stream));
  EPX_CHECK(blas_bind(p, stream, blas_ws, sm_target));
  const float one = 1.f, zero = 0.f;
  void **ptrs = p->group_ptrs;
  /* Column-major, as epx__moe_gemm_bf16's call: C (n x block) = A^T (A: k x n) B (k x block). */
  BLAS_CHECK(B->cublasGemmBatchedEx(
      p->blas, CUBLAS_OP_T, CUBLAS_OP_N, g->n, g->block_rows, g->k, &one, (const void *const *)ptrs,
      CUDA_R_16BF, g->k, (const void *const *)(ptrs + S), CUDA_R_16BF, g->k, &zero, ptrs + 2 * S,
      CUDA_R_16BF, g->n, p->L, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return EPX_OK;
}

/* The bucket of a row count: the next power of two (at least 16). */
static int bucket_of(int rows) {
  int b = 16;
  while (b < rows && b < (1 << 30)) b <<= 1;
  return b;
}

static cudaDataType_t out_type(epx_moe_prefill_t p, int which) {
  return which == 0 && p->gu_fp32 ? CUDA_R_32F : CUDA_R_16BF;
}

typedef struct {
  cublasLtMatrixLayout_t a, b, d;
} layouts_t;

static void layouts_destroy(layouts_t *l) {
  if (l->a) B->cublasLtMatrixLayoutDestroy(l->a);
  if (l->b) B->cublasLtMatrixLayoutDestroy(l->b);
  if (l->d) B->cublasLtMatrixLayoutDestroy(l->d);
  memset(l, 0, sizeof *l);
}

static epx_status_t layouts_make(epx_moe_prefill_t p, int which, int n, int k, int rows,
                                 layouts_t *l) {
  memset(l, 0, sizeof *l);
  epx_status_t st = blas_status(B->cublasLtMatrixLayoutCreate(&l->a, CUDA_R_8F_E4M3, k, n, k),
                                "B->cublasLtMatrixLayoutCreate(A)");
  if (st == EPX_OK)
    st = blas_status(B->cublasLtMatrixLayoutCreate(&l->b, CUDA_R_8F_E4M3, k, rows, k),
                     "B->cublasLtMatrixLayoutCreate(B)");
  if (st == EPX_OK)
    st = blas_status(B->cublasLtMatrixLayoutCreate(&l->d, out_type(p, which), n, rows, n),
                     "B->cublasLtMatrixLayoutCreate(D)");
  if (st != EPX_OK) layouts_destroy(l);
  return st;
}

/* The heuristic's best algorithm for this size; 0 if it has none. */
static int heuristic(epx_moe_prefill_t p, int which, const layouts_t *l, int sm_target,
                     cublasLtMatmulAlgo_t *algo) {
  cublasLtMatmulPreference_t pref = NULL;
  if (B->cublasLtMatmulPreferenceCreate(&pref) != CUBLAS_STATUS_SUCCESS) return 0;
  const size_t ws = EPX__MOE_BLAS_WS;
  const int32_t sms = sm_target;
  /* an attribute that did not take would pick an algorithm for another workspace or SM count */
  if (B->cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                              sizeof ws) != CUBLAS_STATUS_SUCCESS ||
      B->cublasLtMatmulDescSetAttribute(p->lt_desc[which], CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET,
                                        &sms, sizeof sms) != CUBLAS_STATUS_SUCCESS) {
    B->cublasLtMatmulPreferenceDestroy(pref);
    return 0;
  }
  cublasLtMatmulHeuristicResult_t res;
  int found = 0;
  memset(&res, 0, sizeof res);
  const cublasStatus_t st = B->cublasLtMatmulAlgoGetHeuristic(p->lt, p->lt_desc[which], l->a, l->b,
                                                              l->d, l->d, pref, 1, &res, &found);
  B->cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS || found < 1 || res.state != CUBLAS_STATUS_SUCCESS) return 0;
  *algo = res.algo;
  return 1;
}

int epx__moe_lt_supported(epx_moe_prefill_t p, int which) {
  const int n = which == 0 ? 2 * p->I : p->H, k = which == 0 ? p->H : p->I;
  layouts_t l;
  if (layouts_make(p, which, n, k, 256, &l) != EPX_OK) return 0;
  /* cuBLASLt refuses block-scale modes without scale pointers at the heuristic step: any valid,
   * aligned device address will do for the probe (the calls set the real ones). */
  const void *probe = p->ones;
  cublasLtMatmulAlgo_t algo;
  const int ok =
      B->cublasLtMatmulDescSetAttribute(p->lt_desc[which], CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                        &probe, sizeof probe) == CUBLAS_STATUS_SUCCESS &&
      B->cublasLtMatmulDescSetAttribute(p->lt_desc[which], CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                        &probe, sizeof probe) == CUBLAS_STATUS_SUCCESS &&
      heuristic(p, which, &l, 0, &algo);
  layouts_destroy(&l);
  return ok;
}

static epx__moe_lt_algo_t *cache_slot(epx_moe_prefill_t p, int which, int bucket) {
  for (int i = 0; i < EPX__MOE_LT_CACHE; i++) {
    epx__moe_lt_algo_t *a = &p->algos[i];
    if (a->valid && a->kind == which && a->bucket == bucket) return a;
  }
  for (int i = 0; i < EPX__MOE_LT_CACHE; i++)
    if (!p->algos[i].valid) return &p->algos[i];
  return &p->algos[(unsigned)bucket % EPX__MOE_LT_CACHE]; /* full: replace one */
}

epx_status_t epx__moe_gemm_fp8(epx_moe_prefill_t p, int which, const void *w, const float *w_scales,
                               const void *x, const float *x_scales, void *y, int n, int k,
                               int rows, int sm_target, void *blas_ws, cudaStream_t stream) {
  if (rows <= 0) return EPX_OK;
  cublasLtMatmulDesc_t d = p->lt_desc[which];
  BLAS_CHECK(B->cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &w_scales,
                                               sizeof w_scales));
  BLAS_CHECK(B->cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &x_scales,
                                               sizeof x_scales));
  const int32_t sms = sm_target;
  BLAS_CHECK(
      B->cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &sms, sizeof sms));
  layouts_t l;
  EPX_CHECK(layouts_make(p, which, n, k, rows, &l));
  const int bucket = bucket_of(rows) * 2 + (sm_target != 0); /* overlapped calls apart */
  epx__moe_lt_algo_t *slot = cache_slot(p, which, bucket);
  const float one = 1.f, zero = 0.f;
  cublasStatus_t st = CUBLAS_STATUS_NOT_SUPPORTED;
  for (int attempt = 0; attempt < 2; attempt++) {
    if (!(slot->valid && slot->kind == which && slot->bucket == bucket) || attempt == 1) {
      slot->valid = heuristic(p, which, &l, sm_target, &slot->algo);
      slot->kind = which;
      slot->bucket = bucket;
      if (!slot->valid) break;
    }
    st = B->cublasLtMatmul(p->lt, d, &one, w, l.a, x, l.b, &zero, y, l.d, y, l.d, &slot->algo,
                           blas_ws, EPX__MOE_BLAS_WS, stream);
    if (st != CUBLAS_STATUS_NOT_SUPPORTED && st != CUBLAS_STATUS_INVALID_VALUE) break;
  }
  layouts_destroy(&l);
  if (!slot->valid)
    return epx__set_error(EPX_ERR_UNSUPPORTED,
                          "epx_moe_prefill: cuBLASLt has no FP8 block-scaled kernel for the %s "
                          "GEMM (n %d, k %d, rows %d)",
                          which == 0 ? "gate/up" : "down", n, k, rows);
  return blas_status(st, "cublasLtMatmul");
}

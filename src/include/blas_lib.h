/*
 * blas_lib.h - cuBLAS and cuBLASLt, loaded at run time (src/blas_lib.c) by the one user of
 * them, the prefill MoE layer's GEMMs (src/moe_gemm.c). libepx does not link them: a program
 * that never makes a prefill plan runs where no cuBLAS is installed, and one that does gets a
 * clear error (or EPX's own FFN, with ffn_backend AUTO) instead of a loader failure.
 *
 * The table's members are named after the libraries' exported symbols (cublas_v2.h maps
 * cublasCreate to cublasCreate_v2, so `t->cublasCreate(...)` reaches the right member), with
 * the headers' own prototypes.
 */
#ifndef EPX_BLAS_LIB_H_
#define EPX_BLAS_LIB_H_

#include <cublasLt.h>
#include <cublas_v2.h>

#define EPX__BLAS_FUNCTIONS(X)               \
  X(0, cublasCreate_v2)                      \
  X(0, cublasDestroy_v2)                     \
  X(0, cublasSetStream_v2)                   \
  X(0, cublasSetWorkspace_v2)                \
  X(0, cublasSetMathMode)                    \
  X(0, cublasSetSmCountTarget)               \
  X(0, cublasGemmEx)                         \
  X(0, cublasGemmBatchedEx)                  \
  X(0, cublasGetStatusName)                  \
  X(1, cublasLtCreate)                       \
  X(1, cublasLtDestroy)                      \
  X(1, cublasLtMatmul)                       \
  X(1, cublasLtMatmulAlgoGetHeuristic)       \
  X(1, cublasLtMatmulDescCreate)             \
  X(1, cublasLtMatmulDescDestroy)            \
  X(1, cublasLtMatmulDescSetAttribute)       \
  X(1, cublasLtMatmulPreferenceCreate)       \
  X(1, cublasLtMatmulPreferenceDestroy)      \
  X(1, cublasLtMatmulPreferenceSetAttribute) \
  X(1, cublasLtMatrixLayoutCreate)           \
  X(1, cublasLtMatrixLayoutDestroy)

typedef struct epx__blas {
#define EPX__BLAS_MEMBER(lib, name) __typeof__(&name) name;
  EPX__BLAS_FUNCTIONS(EPX__BLAS_MEMBER)
#undef EPX__BLAS_MEMBER
} epx__blas_t;

/* The loaded table, or NULL when either library or any function is missing; then *why (if not
 * NULL) says which file or symbol. Loads once per process (thread-safe); later calls return
 * the same answer. */
const epx__blas_t *epx__blas_load(const char **why);

#endif /* EPX_BLAS_LIB_H_ */

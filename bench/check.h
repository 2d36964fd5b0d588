/*
 * check.h - what every benchmark program shares (epx_bench and the one-GPU benches under
 * bench/experts, bench/layout, bench/moe): checked CUDA / NCCL / EPX calls that print the
 * failing call and return -1, and whole-string parsing of integer flags and comma lists.
 * Messages start with bench_program (each program's main sets it) and, in a rank process,
 * the rank.
 */
#ifndef EPX_BENCH_CHECK_H_
#define EPX_BENCH_CHECK_H_

#include <cuda_runtime.h>
#include <stdio.h>

#include "epx.h"

#ifdef __cplusplus
extern "C" {
#endif

extern const char *bench_program; /* first word of every message; "epx_bench" by default */
extern int bench_log_rank;        /* this process's rank, -1 in the parent */
void bench_report_failure(const char *file, int line, const char *expr, const char *why);

#define BENCH_CUDA(call)                                                       \
  do {                                                                         \
    cudaError_t e_ = (call);                                                   \
    if (e_ != cudaSuccess) {                                                   \
      bench_report_failure(__FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      return -1;                                                               \
    }                                                                          \
  } while (0)

#define BENCH_NCCL(call)                                                       \
  do {                                                                         \
    ncclResult_t r_ = (call);                                                  \
    if (r_ != ncclSuccess) {                                                   \
      bench_report_failure(__FILE__, __LINE__, #call, ncclGetErrorString(r_)); \
      return -1;                                                               \
    }                                                                          \
  } while (0)

#define BENCH_EPX(call)                                                  \
  do {                                                                   \
    epx_status_t s_ = (call);                                            \
    if (s_ != EPX_OK) {                                                  \
      bench_report_failure(__FILE__, __LINE__, #call, epx_last_error()); \
      return -1;                                                         \
    }                                                                    \
  } while (0)

/* A whole-string integer in [lo, hi]. Returns 0, or -1 after printing why. */
int bench_parse_int(const char *flag, const char *s, int lo, int hi, int *out);
/* A comma-separated list of 1 to max integers in [lo, hi] into out, their number in *count.
 * Returns 0, or -1 after printing why. */
int bench_parse_list(const char *flag, const char *s, int lo, int hi, int max, int *out,
                     int *count);

#ifdef __cplusplus
}
#endif

#endif /* EPX_BENCH_CHECK_H_ */

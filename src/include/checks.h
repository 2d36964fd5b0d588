/*
 * checks.h - status propagation for host code.
 *
 * EPX_CHECK(call) returns a failing status upward and logs one "-> status" line per frame at
 * INFO; EPX_CHECK_GOTO jumps to a cleanup label instead, for functions that own resources.
 * CUDA_CHECK / NCCL_CHECK turn a CUDA or NCCL failure into EPX_ERR_CUDA / EPX_ERR_NCCL with the
 * library's own message recorded for epx_last_error().
 */
#ifndef EPX_CHECKS_H_
#define EPX_CHECKS_H_

#include "debug.h"
#include "epx.h"

/* Marks the definition of a public epx_* function: everything else in the library is compiled
 * with -fvisibility=hidden, and src/epx.map keeps only epx_* in the dynamic symbol table. */
#define EPX_EXPORT __attribute__((visibility("default")))

#define EPX_CHECK(call)                                                       \
  do {                                                                        \
    epx_status_t res_ = (call);                                               \
    if (res_ != EPX_OK) {                                                     \
      EPX_INFO(EPX_SUBSYS_ALL, "%s:%d -> %d", __FILE__, __LINE__, (int)res_); \
      return res_;                                                            \
    }                                                                         \
  } while (0)

#define EPX_CHECK_GOTO(call, res, label)                                       \
  do {                                                                         \
    (res) = (call);                                                            \
    if ((res) != EPX_OK) {                                                     \
      EPX_INFO(EPX_SUBSYS_ALL, "%s:%d -> %d", __FILE__, __LINE__, (int)(res)); \
      goto label;                                                              \
    }                                                                          \
  } while (0)

#define CUDA_STATUS(call) epx__cuda_status((call), #call, __FILE__, __LINE__)
#define NCCL_STATUS(call) epx__nccl_status((call), #call, __FILE__, __LINE__)
#define CUDA_CHECK(call) EPX_CHECK(CUDA_STATUS(call))
#define NCCL_CHECK(call) EPX_CHECK(NCCL_STATUS(call))
#define CUDA_CHECK_GOTO(call, res, label) EPX_CHECK_GOTO(CUDA_STATUS(call), res, label)
#define NCCL_CHECK_GOTO(call, res, label) EPX_CHECK_GOTO(NCCL_STATUS(call), res, label)

/* Argument checks: refuse with EPX_ERR_INVALID_ARGUMENT and a message naming the argument. */
#define EPX_ARG_CHECK(cond, ...)                                               \
  do {                                                                         \
    if (!(cond)) return epx__set_error(EPX_ERR_INVALID_ARGUMENT, __VA_ARGS__); \
  } while (0)

#ifdef __cplusplus
extern "C" {
#endif
/* Record a message for epx_last_error() and return status. printf-style. */
epx_status_t epx__set_error(epx_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
epx_status_t epx__cuda_status(int cuda_error, const char *expr, const char *file, int line);
epx_status_t epx__nccl_status(int nccl_result, const char *expr, const char *file, int line);
#ifdef __cplusplus
}
#endif

#endif /* EPX_CHECKS_H_ */

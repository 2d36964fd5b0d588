/*
 * cupti_lib.h - libcupti loaded at run time (cupti_lib.c): where it is looked for, and the table
 * of the functions the kernel-time collector (ktime.c) calls. Nothing links against libcupti:
 * the GPU machine may have it elsewhere, or not at all, and the benchmark must run either way.
 *
 * Invariant: each pointer's type is the type of CUPTI's own declaration in the headers the
 * benchmark is compiled against (__typeof__ of the prototype), so a call through the table is
 * checked by the compiler exactly as a linked call would be.
 */
#ifndef EPX_BENCH_CUPTI_LIB_H_
#define EPX_BENCH_CUPTI_LIB_H_

#include <stddef.h>

#include <cupti.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct bench_cupti_api {
  __typeof__(&cuptiGetVersion) GetVersion;
  __typeof__(&cuptiGetResultString) GetResultString;
  __typeof__(&cuptiActivityRegisterCallbacks) ActivityRegisterCallbacks;
  __typeof__(&cuptiActivityEnable) ActivityEnable;
  __typeof__(&cuptiActivityDisable) ActivityDisable;
  __typeof__(&cuptiActivityFlushAll) ActivityFlushAll;
  __typeof__(&cuptiActivityGetNextRecord) ActivityGetNextRecord;
  __typeof__(&cuptiActivityGetNumDroppedRecords) ActivityGetNumDroppedRecords;
  __typeof__(&cuptiActivityPushExternalCorrelationId) ActivityPushExternalCorrelationId;
  __typeof__(&cuptiActivityPopExternalCorrelationId) ActivityPopExternalCorrelationId;
  uint32_t version; /* cuptiGetVersion's */
  char path[512];   /* the file that was loaded */
} bench_cupti_api_t;

/* Load libcupti once per process: the first candidate (bench_cupti_candidates) that dlopen
 * accepts and that has every function of the table. Returns the table, or NULL with why in
 * reason (every later call returns the same). */
const bench_cupti_api_t *bench_cupti_load(char *reason, size_t len);

/* Where to look, in this order: `library` itself; lib64, extras/CUPTI/lib64 and lib of
 * `cuda_home`, of `build_cuda_home`, then of root + /usr/local/cuda; then PyTorch's wheel
 * layout, site-packages/nvidia/<any>/lib (nvidia/cuda_cupti/lib, nvidia/cu13/lib), under
 * lib/python3.* of each of `python_prefixes` and of root + /opt/<any>/.venv, and under root +
 * /usr/local/lib/python3.x/dist-packages. In each directory every libcupti.so* file, sorted.
 * NULL or "" entries are skipped. */
typedef struct bench_cupti_search {
  const char *library;            /* $EPX_CUPTI_LIBRARY: one file */
  const char *cuda_home;          /* $CUDA_HOME */
  const char *build_cuda_home;    /* the toolkit epx_bench was built with */
  const char *python_prefixes[2]; /* $VIRTUAL_ENV, $CONDA_PREFIX */
  const char *root;               /* "" (the host test: a scratch directory) */
} bench_cupti_search_t;

/* The search of this process: its environment and the build's toolkit. */
bench_cupti_search_t bench_cupti_search_from_env(void);

/* The candidate files of s, in order, each once (by real path), malloc'ed; at most max. Returns
 * the count (the caller frees each entry), or -1 when out of host memory. */
int bench_cupti_candidates(const bench_cupti_search_t *s, char **out, int max);

#ifdef __cplusplus
}
#endif

#endif /* EPX_BENCH_CUPTI_LIB_H_ */

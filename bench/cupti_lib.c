/*
 * cupti_lib.c - finding and loading libcupti at run time (cupti_lib.h): the candidate files in
 * a fixed order (the environment's override, CUDA toolkits, PyTorch's wheel layout), the first
 * that dlopen accepts with every function of the table wins.
 *
 * Invariant: loading never fails a run and happens once per process; a failure leaves a reason
 * (the override's own dlopen error first, else the last candidate's) that every later call
 * returns. Python's site-packages are found only through $VIRTUAL_ENV / $CONDA_PREFIX and a few
 * fixed glob patterns, never by running python.
 */
#include <dlfcn.h>
#include <glob.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cupti_lib.h"

#ifndef EPX_BENCH_CUDA_HOME /* the Makefile passes the toolkit the benchmark is built with */
#define EPX_BENCH_CUDA_HOME ""
#endif

#define MAX_CANDIDATES 64

bench_cupti_search_t bench_cupti_search_from_env(void) {
  bench_cupti_search_t s;
  memset(&s, 0, sizeof s);
  s.library = getenv("EPX_CUPTI_LIBRARY");
  s.cuda_home = getenv("CUDA_HOME");
  s.build_cuda_home = EPX_BENCH_CUDA_HOME;
  s.python_prefixes[0] = getenv("VIRTUAL_ENV");
  s.python_prefixes[1] = getenv("CONDA_PREFIX");
  s.root = "";
  return s;
}

/* ---------------------------------------------------------------------------------------------
 * Candidates
 * ------------------------------------------------------------------------------------------- */
typedef struct {
  char **out;
  int max, count;
  char **real; /* each entry's real path (or its own text when it has none), for duplicates */
  int oom;
} list_t;

static void add_file(list_t *l, const char *path) {
  if (l->oom || l->count == l->max) return;
  char resolved[PATH_MAX];
  const char *key = realpath(path, resolved) ? resolved : path;
  for (int i = 0; i < l->count; i++)
    if (!strcmp(l->real[i], key)) return;
  l->out[l->count] = strdup(path);
  l->real[l->count] = strdup(key);
  if (!l->out[l->count] || !l->real[l->count]) {
    free(l->out[l->count]);
    free(l->real[l->count]);
    l->oom = 1;
    return;
  }
  l->count++;
}

/* Every file matching pattern, sorted (glob's order). */
static void add_glob(list_t *l, const char *pattern) {
  glob_t g;
  if (glob(pattern, 0, NULL, &g) == 0)
    for (size_t i = 0; i < g.gl_pathc; i++) add_file(l, g.gl_pathv[i]);
  globfree(&g);
}

/* dir/libcupti.so* for dir = base + each of the toolkit's library directories. */
static void add_toolkit(list_t *l, const char *root, const char *base) {
  static const char *const dirs[] = {"lib64", "extras/CUPTI/lib64", "lib"};
  if (!base || !*base) return;
  for (size_t i = 0; i < sizeof dirs / sizeof dirs[0]; i++) {
    char pattern[PATH_MAX];
    snprintf(pattern, sizeof pattern, "%s%s/%s/libcupti.so*", root, base, dirs[i]);
    add_glob(l, pattern);
  }
}

/* PyTorch's wheels put CUPTI in site-packages/nvidia/cuda_cupti/lib (CUDA 12) or
 * nvidia/cu13/lib (CUDA 13). */
static void add_python_prefix(list_t *l, const char *root, const char *prefix) {
  if (!prefix || !*prefix) return;
  char pattern[PATH_MAX];
  snprintf(pattern, sizeof pattern, "%s%s/lib/python3.*/site-packages/nvidia/*/lib/libcupti.so*",
           root, prefix);
  add_glob(l, pattern);
}

int bench_cupti_candidates(const bench_cupti_search_t *s, char **out, int max) {
  list_t l = {out, max, 0, NULL, 0};
  l.real = (char **)calloc((size_t)(max > 0 ? max : 1), sizeof *l.real);
  if (!l.real) return -1;
  const char *root = s->root ? s->root : "";
  if (s->library && *s->library) add_file(&l, s->library);
  add_toolkit(&l, "", s->cuda_home);
  add_toolkit(&l, "", s->build_cuda_home);
  add_toolkit(&l, root, "/usr/local/cuda");
  for (int i = 0; i < 2; i++) add_python_prefix(&l, "", s->python_prefixes[i]);
  char pattern[PATH_MAX];
  snprintf(pattern, sizeof pattern,
           "%s/opt/*/.venv/lib/python3.*/site-packages/nvidia/*/lib/libcupti.so*", root);
  add_glob(&l, pattern);
  snprintf(pattern, sizeof pattern,
           "%s/usr/local/lib/python3.*/dist-packages/nvidia/*/lib/libcupti.so*", root);
  add_glob(&l, pattern);
  for (int i = 0; i < l.count; i++) free(l.real[i]);
  free(l.real);
  if (l.oom) {
    for (int i = 0; i < l.count; i++) free(out[i]);
    return -1;
  }
  return l.count;
}

/* ---------------------------------------------------------------------------------------------
 * Loading
 * ------------------------------------------------------------------------------------------- */
/* Every function of the table from handle. Returns 0, or -1 naming the missing one in why. */
static int resolve(void *handle, bench_cupti_api_t *api, char *why, size_t len) {
#define RESOLVE(field, symbol)                                   \
  do {                                                           \
    api->field = (__typeof__(api->field))dlsym(handle, #symbol); \
    if (!api->field) {                                           \
      snprintf(why, len, "%s has no %s", api->path, #symbol);    \
      return -1;                                                 \
    }                                                            \
  } while (0)
  RESOLVE(GetVersion, cuptiGetVersion);
  RESOLVE(GetResultString, cuptiGetResultString);
  RESOLVE(ActivityRegisterCallbacks, cuptiActivityRegisterCallbacks);
  RESOLVE(ActivityEnable, cuptiActivityEnable);
  RESOLVE(ActivityDisable, cuptiActivityDisable);
  RESOLVE(ActivityFlushAll, cuptiActivityFlushAll);
  RESOLVE(ActivityGetNextRecord, cuptiActivityGetNextRecord);
  RESOLVE(ActivityGetNumDroppedRecords, cuptiActivityGetNumDroppedRecords);
  RESOLVE(ActivityPushExternalCorrelationId, cuptiActivityPushExternalCorrelationId);
  RESOLVE(ActivityPopExternalCorrelationId, cuptiActivityPopExternalCorrelationId);
#undef RESOLVE
  return 0;
}

/* dlopen one candidate and fill api. Returns 0, or -1 with why. */
static int try_load(const char *path, bench_cupti_api_t *api, char *why, size_t len) {
  memset(api, 0, sizeof *api);
  snprintf(api->path, sizeof api->path, "%s", path);
  void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    const char *e = dlerror();
    snprintf(why, len, "dlopen %s", e ? e : path);
    return -1;
  }
  if (resolve(handle, api, why, len) == 0) {
    const CUptiResult r = api->GetVersion(&api->version);
    if (r == CUPTI_SUCCESS) return 0;
    snprintf(why, len, "%s: cuptiGetVersion returned %d", path, (int)r);
  }
  dlclose(handle);
  return -1;
}

static bench_cupti_api_t loaded;
static int load_state;         /* 0 = not tried, 1 = loaded, -1 = failed (reason below) */
static char load_reason[1100]; /* holds any `why` below, prefixed */

static void load_once(void) {
  const bench_cupti_search_t s = bench_cupti_search_from_env();
  char *files[MAX_CANDIDATES];
  const int n = bench_cupti_candidates(&s, files, MAX_CANDIDATES);
  load_state = -1;
  if (n < 0) {
    snprintf(load_reason, sizeof load_reason, "out of host memory");
    return;
  }
  if (n == 0)
    snprintf(load_reason, sizeof load_reason,
             "no libcupti.so* in $CUDA_HOME, %s, /usr/local/cuda or python's nvidia/*/lib; set "
             "EPX_CUPTI_LIBRARY=/path/to/libcupti.so",
             *s.build_cuda_home ? s.build_cuda_home : "the build's toolkit");
  char override_why[sizeof load_reason] = "";
  for (int i = 0; i < n; i++) {
    char why[1024]; /* > the path plus the longest symbol name */
    if (load_state < 0 && try_load(files[i], &loaded, why, sizeof why) == 0) load_state = 1;
    if (load_state < 0) {
      snprintf(load_reason, sizeof load_reason, "%s", why);
      /* the override's failure is the one a user wants to read */
      if (i == 0 && s.library && *s.library)
        snprintf(override_why, sizeof override_why, "EPX_CUPTI_LIBRARY: %s", why);
    }
    free(files[i]);
  }
  if (load_state < 0 && *override_why)
    snprintf(load_reason, sizeof load_reason, "%s", override_why);
}

const bench_cupti_api_t *bench_cupti_load(char *reason, size_t len) {
  if (load_state == 0) load_once();
  if (load_state > 0) return &loaded;
  snprintf(reason, len, "%s", load_reason);
  return NULL;
}

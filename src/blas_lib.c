/*
 * blas_lib.c - loading cuBLAS and cuBLASLt at run time (blas_lib.h).
 *
 * Where: $EPX_CUBLAS_LIBDIR when set, then the toolkit libepx was built with (EPX_CUDA_LIBDIR,
 * from the Makefile), then the loader's own search (LD_LIBRARY_PATH, libepx's run path, and
 * any copy already in the process, e.g. PyTorch's nvidia-cublas wheel, found by its soname).
 * The soname's major version is the headers' (CUBLAS_VER_MAJOR), so the ABI is the one compiled
 * against. Invariant: one attempt per process; the answer (table or reason) never changes.
 */
#include "blas_lib.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef EPX_CUDA_LIBDIR
#define EPX_CUDA_LIBDIR ""
#endif

#define STR2(x) #x
#define STR(x) STR2(x)

static pthread_once_t once = PTHREAD_ONCE_INIT;
static epx__blas_t table;
static const epx__blas_t *loaded;
static char reason[512];

/* dlopen file (a soname) from dir, or from the loader's search when dir is NULL. */
static void *open_in(const char *dir, const char *file) {
  char path[4096];
  if (!dir || !*dir) return dlopen(file, RTLD_NOW | RTLD_LOCAL);
  if (snprintf(path, sizeof path, "%s/%s", dir, file) >= (int)sizeof path) return NULL;
  return dlopen(path, RTLD_NOW | RTLD_LOCAL);
}

static void *open_library(const char *file) {
  const char *dirs[3] = {getenv("EPX_CUBLAS_LIBDIR"), EPX_CUDA_LIBDIR, NULL};
  for (int i = 0; i < 3; i++) {
    if (i < 2 && (!dirs[i] || !*dirs[i])) continue;
    void *h = open_in(dirs[i], file);
    if (h) return h;
  }
  const char *err = dlerror();
  snprintf(reason, sizeof reason, "%s not found (%s); set EPX_CUBLAS_LIBDIR to its directory", file,
           err ? err : "no error text");
  return NULL;
}

static void load(void) {
  /* cuBLASLt first: libcublas needs it, and finds it loaded by its soname. */
  void *libs[2] = {NULL, open_library("libcublasLt.so." STR(CUBLAS_VER_MAJOR))};
  if (!libs[1]) return;
  libs[0] = open_library("libcublas.so." STR(CUBLAS_VER_MAJOR));
  if (!libs[0]) return;
#define EPX__BLAS_RESOLVE(lib, name)                                                           \
  if (!(table.name = (__typeof__(&name))dlsym(libs[lib], #name))) {                            \
    snprintf(                                                                                  \
        reason, sizeof reason, "%s has no %s",                                                 \
        lib ? "libcublasLt.so." STR(CUBLAS_VER_MAJOR) : "libcublas.so." STR(CUBLAS_VER_MAJOR), \
        #name);                                                                                \
    return;                                                                                    \
  }
  EPX__BLAS_FUNCTIONS(EPX__BLAS_RESOLVE)
#undef EPX__BLAS_RESOLVE
  loaded = &table;
}

const epx__blas_t *epx__blas_load(const char **why) {
  pthread_once(&once, load);
  if (!loaded && why) *why = reason;
  return loaded;
}

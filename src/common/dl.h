/* A shared library's entry points loaded at run time (dlopen + dlsym)
 * instead of linked: the pattern of comm/nccl/nccl_lib.h and
 * backend/cuda/cublaslt_lib.h, whose libraries are large and needed only
 * by some runs. */
#ifndef ML_COMMON_DL_H
#define ML_COMMON_DL_H

#include <stddef.h>

/* One entry point: its exported name and the function pointer it goes to. */
typedef struct ml_dl_sym {
  const char *name;
  void **slot;
} ml_dl_sym;

/* dlopen(soname, RTLD_NOW | RTLD_LOCAL), found as the dynamic loader finds
 * any library, then every syms[i].name into *syms[i].slot. 0, or −1 with
 * why [why_size] set to "SONAME cannot be loaded (<dlerror>)" or "SONAME
 * has no NAME (expected EXPECTED)" (nothing recorded with ml_err: callers
 * keep the reason for every later call). The library stays loaded. */
int ml_dl_load(const char *soname, const ml_dl_sym *syms, size_t n, const char *expected,
               char *why, size_t why_size);

#endif

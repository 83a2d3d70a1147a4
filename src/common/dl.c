/* Run-time loading of a shared library's entry points (dl.h). */
#define _POSIX_C_SOURCE 200809L /* dlopen */
#include "common/dl.h"

#include <dlfcn.h>
#include <stdio.h>

int ml_dl_load(const char *soname, const ml_dl_sym *syms, size_t n, const char *expected,
               char *why, size_t why_size) {
  void *h = dlopen(soname, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char *e = dlerror();
    snprintf(why, why_size, "%s cannot be loaded (%s)", soname, e ? e : "no message");
    return -1;
  }
  for (size_t i = 0; i < n; i++) {
    *syms[i].slot = dlsym(h, syms[i].name);
    if (!*syms[i].slot) {
      snprintf(why, why_size, "%s has no %s (expected %s)", soname, syms[i].name, expected);
      return -1;
    }
  }
  return 0;
}

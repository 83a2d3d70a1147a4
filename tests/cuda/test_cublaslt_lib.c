/* cuBLASLt loaded at run time (backend/cuda/cublaslt_lib.h), what a machine
 * without a GPU can check: a program of a CUDA build does not map
 * libcublasLt at start, nor when it makes the CPU backend (the CPU runs of a
 * CUDA build do not pay its 148 MiB of RSS); ml_cublaslt_lib_get maps it,
 * every entry point resolves, the version is the headers' major, a second
 * call returns the same table, and a status converts to its name. */
#include <stdio.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cuda/cublaslt_lib.h"
#include "common/status.h"

static int expect(int ok, const char *what) {
  printf("%s %s\n", ok ? "ok  " : "FAIL", what);
  if (!ok) printf("     message: %s\n", ml_error_msg());
  return ok ? 0 : 1;
}

/* Whether a file whose name contains "libcublasLt" is mapped into this process. */
static int mapped(void) {
  FILE *f = fopen("/proc/self/maps", "r");
  if (!f) return -1;
  char line[4096];
  int found = 0;
  while (!found && fgets(line, sizeof line, f)) found = strstr(line, "libcublasLt") != NULL;
  fclose(f);
  return found;
}

int main(void) {
  int fails = expect(mapped() == 0, "libcublasLt not mapped at start");
  ml_backend *cpu;
  fails += expect(ml_backend_get("cpu", 0, &cpu) == 0, "the CPU backend");
  fails += expect(mapped() == 0, "libcublasLt not mapped by the CPU backend");
  const ml_cublaslt_lib *lib, *again;
  if (ml_cublaslt_lib_get(&lib)) {
    printf("skipped: %s\n", ml_error_msg());
    return fails ? 1 : 77;
  }
  size_t v = lib->GetVersion();
  printf("cuBLASLt version %zu\n", v);
  fails += expect(mapped() == 1, "libcublasLt mapped once loaded");
  fails += expect(v / 10000 == CUBLAS_VER_MAJOR, "the headers' major version");
  fails += expect(ml_cublaslt_lib_get(&again) == 0 && again == lib, "loaded once");
  const char *name = lib->GetStatusName(CUBLAS_STATUS_NOT_SUPPORTED);
  fails += expect(name && strcmp(name, "CUBLAS_STATUS_NOT_SUPPORTED") == 0, "a status's name");
  return fails ? 1 : 0;
}

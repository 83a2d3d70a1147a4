/* A failed kernel launch names its kernel (issue 27): every launch in
 * kernels/cuda goes through KC_LAUNCH, which checks cudaGetLastError() at
 * once and records the kernel for ml_cuda_launched's message. Where no GPU
 * is usable every launch fails (no driver, no device), which is what this
 * checks, on any machine without a GPU; where a GPU is visible it exits 77
 * (skipped): a launch there would run. */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <string.h>

#include "backend/cuda/cuda.h"
#include "common/status.h"
#include "kernels/cuda/kernels.h"

static int expect(int ok, const char *what) {
  printf("%s %s\n", ok ? "ok  " : "FAIL", what);
  if (!ok) printf("     message: %s\n", ml_error_msg());
  return ok ? 0 : 1;
}

int main(void) {
  int count = 0;
  if (cudaGetDeviceCount(&count) == cudaSuccess && count > 0) {
    printf("skip: a GPU is visible\n");
    return 77;
  }
  int fails = 0;
  ml_error_clear();
  cudaError_t e = kc_add(NULL, NULL, NULL, 4);
  fails += expect(e != cudaSuccess, "kc_add without a GPU: an error");
  fails += expect(ml_cuda_launched(e, "add") == -1 &&
                      strstr(ml_error_msg(), "cuda: add: kernel add_kernel: ") != NULL,
                  "ml_cuda_launched names the operator and the kernel");
  /* a template kernel through KC_LAUNCH((k<...>), ...), the second of two launches not reached */
  ml_error_clear();
  e = kc_sumsq(NULL, NULL, 4, NULL, NULL);
  fails += expect(ml_cuda_launched(e, "grad-norm partial") == -1 &&
                      strstr(ml_error_msg(), "kernel (norm_partial<sumsq_term, kc_sum_op>): ") != NULL,
                  "the first failing launch of two is the one named");
  /* an error that no launch gave: the operator alone, no stale kernel name */
  ml_error_clear();
  fails += expect(ml_cuda_launched(cudaErrorInvalidValue, "rope forward") == -1 &&
                      strstr(ml_error_msg(), "cuda: rope forward: cudaErrorInvalidValue") != NULL &&
                      strstr(ml_error_msg(), "kernel") == NULL,
                  "an error without a launch: no kernel named");
  return fails ? 1 : 0;
}

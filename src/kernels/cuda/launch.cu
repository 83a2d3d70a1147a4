/* The name of the kernel whose launch failed (common.cuh's KC_LAUNCH,
 * kernels.h's kc_failed_kernel): one per host thread, as CUDA's last error. */
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

thread_local const char *kc_failed;

extern "C" const char *kc_failed_kernel(void) {
  const char *name = kc_failed;
  kc_failed = nullptr;
  return name;
}

/* cuBLASLt loaded at run time (cublaslt_lib.h). */
#include "backend/cuda/cublaslt_lib.h"

#include <stdio.h>

#include "common/dl.h"
#include "common/status.h"

#define ML_STR_(x) #x
#define ML_STR(x) ML_STR_(x)
/* The library of the major version the headers are: libcublasLt.so.13 */
#define SONAME "libcublasLt.so." ML_STR(CUBLAS_VER_MAJOR)

static ml_cublaslt_lib g_lib;
static int g_state; /* 0 not tried, 1 loaded, −1 failed (g_why) */
static char g_why[512];

static void load(void) {
  const ml_dl_sym k[] = {
      {"cublasLtGetVersion", (void **)&g_lib.GetVersion},
      {"cublasLtCreate", (void **)&g_lib.Create},
      {"cublasLtDestroy", (void **)&g_lib.Destroy},
      {"cublasLtGetStatusName", (void **)&g_lib.GetStatusName},
      {"cublasLtGetStatusString", (void **)&g_lib.GetStatusString},
      {"cublasLtMatmulDescCreate", (void **)&g_lib.MatmulDescCreate},
      {"cublasLtMatmulDescDestroy", (void **)&g_lib.MatmulDescDestroy},
      {"cublasLtMatmulDescSetAttribute", (void **)&g_lib.MatmulDescSetAttribute},
      {"cublasLtMatrixLayoutCreate", (void **)&g_lib.MatrixLayoutCreate},
      {"cublasLtMatrixLayoutDestroy", (void **)&g_lib.MatrixLayoutDestroy},
      {"cublasLtMatmulPreferenceCreate", (void **)&g_lib.MatmulPreferenceCreate},
      {"cublasLtMatmulPreferenceDestroy", (void **)&g_lib.MatmulPreferenceDestroy},
      {"cublasLtMatmulPreferenceSetAttribute", (void **)&g_lib.MatmulPreferenceSetAttribute},
      {"cublasLtMatmulAlgoGetHeuristic", (void **)&g_lib.MatmulAlgoGetHeuristic},
      {"cublasLtMatmul", (void **)&g_lib.Matmul},
  };
  char expected[32];
  snprintf(expected, sizeof expected, "cuBLASLt %d", CUBLAS_VER_MAJOR);
  if (ml_dl_load(SONAME, k, sizeof k / sizeof k[0], expected, g_why, sizeof g_why)) {
    g_state = -1;
    return;
  }
  /* cublasLtGetVersion: 10000·major + 100·minor + patch, as CUBLAS_VERSION */
  size_t v = g_lib.GetVersion();
  if (v / 10000 != CUBLAS_VER_MAJOR) {
    snprintf(g_why, sizeof g_why, "%s is cuBLASLt version %zu; expected major version %d",
             SONAME, v, CUBLAS_VER_MAJOR);
    g_state = -1;
    return;
  }
  g_state = 1;
}

int ml_cublaslt_lib_get(const ml_cublaslt_lib **out) {
  if (g_state == 0) load();
  if (g_state < 0) return ml_err("cuBLASLt: %s", g_why);
  *out = &g_lib;
  return 0;
}

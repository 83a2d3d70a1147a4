/* cuBLASLt's entry points, loaded from its shared library at run time
 * (dlopen) rather than linked, as NCCL is (comm/nccl/nccl_lib.h). Linked,
 * libcublasLt.so (541 MB on CUDA 13) is mapped and relocated at every
 * start of a CUDA build: +148 MiB resident and ~0.3 s on a process that
 * runs on the CPU and never touches a GPU. Loaded here, only the CUDA
 * backend pays it, when it is made (ml_cuda_gemm_create). Compiled against
 * cublasLt.h; the library loaded is ML_CUBLASLT_SONAME (CMake: the
 * toolkit's major version, e.g. libcublasLt.so.13), found as the dynamic
 * loader finds any library (LD_LIBRARY_PATH, the binary's RUNPATH, the
 * system's paths). */
#ifndef ML_BACKEND_CUDA_CUBLASLT_LIB_H
#define ML_BACKEND_CUDA_CUBLASLT_LIB_H

#include <cublasLt.h>

/* The functions meshlm calls, under their cuBLASLt names without the prefix. */
typedef struct ml_cublaslt_lib {
  size_t (*GetVersion)(void);
  cublasStatus_t (*Create)(cublasLtHandle_t *handle);
  cublasStatus_t (*Destroy)(cublasLtHandle_t handle);
  const char *(*GetStatusName)(cublasStatus_t status);
  const char *(*GetStatusString)(cublasStatus_t status);
  cublasStatus_t (*MatmulDescCreate)(cublasLtMatmulDesc_t *desc, cublasComputeType_t compute,
                                     cudaDataType_t scale);
  cublasStatus_t (*MatmulDescDestroy)(cublasLtMatmulDesc_t desc);
  cublasStatus_t (*MatmulDescSetAttribute)(cublasLtMatmulDesc_t desc,
                                           cublasLtMatmulDescAttributes_t attr, const void *buf,
                                           size_t size);
  cublasStatus_t (*MatrixLayoutCreate)(cublasLtMatrixLayout_t *layout, cudaDataType type,
                                       uint64_t rows, uint64_t cols, int64_t ld);
  cublasStatus_t (*MatrixLayoutDestroy)(cublasLtMatrixLayout_t layout);
  cublasStatus_t (*MatmulPreferenceCreate)(cublasLtMatmulPreference_t *pref);
  cublasStatus_t (*MatmulPreferenceDestroy)(cublasLtMatmulPreference_t pref);
  cublasStatus_t (*MatmulPreferenceSetAttribute)(cublasLtMatmulPreference_t pref,
                                                 cublasLtMatmulPreferenceAttributes_t attr,
                                                 const void *buf, size_t size);
  cublasStatus_t (*MatmulAlgoGetHeuristic)(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                           cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                           cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                           cublasLtMatmulPreference_t pref, int requested,
                                           cublasLtMatmulHeuristicResult_t results[],
                                           int *returned);
  cublasStatus_t (*Matmul)(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void *alpha,
                           const void *A, cublasLtMatrixLayout_t a, const void *B,
                           cublasLtMatrixLayout_t b, const void *beta, const void *C,
                           cublasLtMatrixLayout_t c, void *D, cublasLtMatrixLayout_t d,
                           const cublasLtMatmulAlgo_t *algo, void *workspace,
                           size_t workspace_bytes, cudaStream_t stream);
} ml_cublaslt_lib;

/* cuBLASLt, loaded on the first call and kept for the process. Errors (the
 * same on every later call): the library not found or not loadable (with
 * dlerror's text), an entry point missing, a major version other than the
 * one compiled against (CUBLAS_VER_MAJOR). */
int ml_cublaslt_lib_get(const ml_cublaslt_lib **out);

#endif

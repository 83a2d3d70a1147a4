/* The CPU backend (backend/backend.h): memory from a caching pool over
 * malloc (device and host memory are the same), every call synchronous,
 * operators from kernels/cpu (fp32, OpenMP) and oneDNN's matmul for the
 * GEMMs (gemm.c: fp32, and bf16 on AMX / AVX512-BF16 where the CPU has
 * them). The only code that includes kernels/cpu. */
#ifndef ML_BACKEND_CPU_H
#define ML_BACKEND_CPU_H

#include "backend/backend.h"

/* Create the CPU backend. Errors: allocation, oneDNN engine creation. */
int ml_backend_cpu_create(ml_backend **out);

/* ---- the GEMM (gemm.c) ---------------------------------------------------- */
typedef struct ml_cpu_gemm ml_cpu_gemm;
/* oneDNN's CPU engine and stream, and a cache of matmul primitives keyed
 * by shape, layout, dtypes and epilogue (creating a primitive costs far
 * more than a small GEMM). Scratch for operand conversions comes from
 * `pool_be`'s pool. */
int ml_cpu_gemm_create(ml_backend *pool_be, ml_cpu_gemm **out);
void ml_cpu_gemm_destroy(ml_cpu_gemm *g);
/* backend.h's ml_be_gemm on the CPU. */
int ml_cpu_gemm_run(ml_cpu_gemm *g, const ml_gemm *args);

#endif

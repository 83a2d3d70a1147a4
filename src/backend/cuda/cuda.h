/* The CUDA backend (backend/backend.h) on one NVIDIA GPU per process:
 * memory from caching pools over cudaMalloc (device tensors) and
 * cudaMallocHost (pinned host staging), never managed memory; every
 * operator enqueued on one non-blocking compute stream; events are
 * cudaEvents; the kernels of kernels/cuda and cuBLASLt's matmul for the
 * GEMMs (gemm.c); every operator but the batch-invariant mode
 * (ML_OP_BATCH_INVARIANT, ml_be_supports). Calls that hand results to the
 * host (ml_be_copy D2H, the loss sums, norm partials) synchronise the
 * stream before returning;
 * everything else returns once enqueued. Only this directory includes
 * kernels/cuda and the CUDA headers. Built only when CMake finds nvcc
 * (ML_HAVE_CUDA); comm/nccl (the NCCL comm) uses the CUDA runtime too, on
 * this backend's stream and device (ml_cuda_stream, ml_cuda_device). */
#ifndef ML_BACKEND_CUDA_H
#define ML_BACKEND_CUDA_H

#include "backend/backend.h"

/* Create the CUDA backend on the device this process should use: GPU
 * local_rank modulo the count visible, local_rank being this process's
 * rank among its job's processes on its node (comm/node.h), as torchrun's
 * LOCAL_RANK picks cuda:LOCAL_RANK (device 0 for local_rank <= 0).
 * Errors: no CUDA device or driver (with the runtime's message), a device
 * whose compute capability the build has no code for (ML_CUDA_ARCHS,
 * backend/cuda_arch.h), allocation, cuBLASLt initialisation. */
int ml_backend_cuda_create(int local_rank, ml_backend **out);

/* The compute stream (a cudaStream_t) and the device index of be, for the
 * NCCL comm (comm/nccl/comm_nccl.h), which orders its own streams against
 * the compute stream with events; NULL and −1 when be is not the CUDA
 * backend. */
void *ml_cuda_stream(const ml_backend *be);
int ml_cuda_device(const ml_backend *be);

/* ---- the GEMM (gemm.c) ---------------------------------------------------- */
typedef struct ml_cuda_gemm ml_cuda_gemm;
/* A cuBLASLt handle, its workspace and a cache of matmul descriptors and
 * algorithms keyed by the call's shape, layout, dtypes, epilogue and
 * operand alignment (the heuristic query costs more than a small GEMM).
 * Operand conversions (fp32 → bf16 under bf16 compute) use scratch from
 * `be`'s pool, on `stream`. */
int ml_cuda_gemm_create(ml_backend *be, void *stream, ml_cuda_gemm **out);
void ml_cuda_gemm_destroy(ml_cuda_gemm *g);
/* backend.h's ml_be_gemm on the GPU (enqueued; no synchronisation). */
int ml_cuda_gemm_run(ml_cuda_gemm *g, const ml_gemm *args);
/* Bytes of pool scratch ml_cuda_gemm_run holds at once for args (backend.h
 * ml_be_gemm_temp): operands rounded to bf16, a bf16 bias widened, a bf16
 * C's fp32 product where cuBLASLt does not write it (gemm.c). */
int64_t ml_cuda_gemm_temp(const ml_gemm *args);

/* 0, or −1 with "cuda: WHAT: <the runtime's error name and text>" for a
 * failed CUDA runtime call (rc a cudaError_t). */
int ml_cuda_check(int rc, const char *what);
/* The same for a kernels/cuda launcher's result (operator `op`), naming the
 * kernel whose launch failed (kc_failed_kernel) where there is one. */
int ml_cuda_launched(int rc, const char *op);

#endif

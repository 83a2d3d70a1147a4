/* The CPU backend (backend/backend.h): memory from a caching pool over
 * malloc (device and host memory are the same: ml_be_host_memory), every
 * call synchronous, every operator (ml_be_supports), from kernels/cpu
 * (fp32, OpenMP), and oneDNN's matmul for the GEMMs (gemm.c: fp32, and
 * bf16 on AMX / AVX512-BF16 where the CPU has them, also inside
 * attention). The only code that includes kernels/cpu. */
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
 * `pool_be`'s pool. Also bounds oneDNN's own primitive cache
 * (ml_cpu_gemm_onednn_cache_bound). Errors: allocation, oneDNN's. */
int ml_cpu_gemm_create(ml_backend *pool_be, ml_cpu_gemm **out);
void ml_cpu_gemm_destroy(ml_cpu_gemm *g);
/* The entries of oneDNN's process-wide primitive cache that
 * ml_cpu_gemm_create leaves it (oneDNN's default: 1024). meshlm keeps the
 * primitives it runs in its own caches (gemm.c: 128 for ml_cpu_gemm_run, 64
 * per thread for the tiles), so oneDNN's cache only spares a JIT where a
 * primitive is built again: a tile shape on another thread (at most the 64
 * of a tile cache), or a shape evicted from meshlm's cache. Unbounded in
 * practice, it grew a Qwen3-MoE run by ~300 KB per new expert GEMM shape
 * (a new M, the tokens routed to the expert, every step: 308 -> 385 MiB
 * over 30 steps on dp_shard 2, 380 -> 650 MiB on --ep 2; flat with the
 * cache off, AMD EPYC Zen 4). Bounded at the tile cache's size, the
 * cross-thread reuse stays and the cache's memory is at most that many
 * primitives. */
enum { ML_CPU_GEMM_ONEDNN_CACHE = 64 };
/* Set oneDNN's primitive cache capacity (dnnl_set_primitive_cache_capacity,
 * process-wide) to ML_CPU_GEMM_ONEDNN_CACHE, unless the environment sets
 * ONEDNN_PRIMITIVE_CACHE_CAPACITY or DNNL_PRIMITIVE_CACHE_CAPACITY (oneDNN
 * reads those; the user's value then stands). ml_cpu_gemm_create calls it.
 * Returns 0, or -1 (message) where oneDNN refuses. */
int ml_cpu_gemm_onednn_cache_bound(void);
/* backend.h's ml_be_gemm on the CPU: ml_cpu_gemm_run_on with
 * ML_CPU_GEMM_AUTO. */
int ml_cpu_gemm_run(ml_cpu_gemm *g, const ml_gemm *args);
/* The kernel a GEMM runs on: AUTO the backend's choice — x·W^T (trans_a
 * false, trans_b true) on FIXED in batch-invariant mode or when M <=
 * ML_CPU_GEMM_SMALL_M, everything else on ONEDNN — or the one named
 * (bench/ and tests compare them on the same call). */
typedef enum { ML_CPU_GEMM_AUTO, ML_CPU_GEMM_ONEDNN, ML_CPU_GEMM_FIXED } ml_cpu_gemm_path;
/* The rows of x·W^T up to which the default path runs ml_cpu_gemm_fixed
 * (decode: W streamed once at memory bandwidth) rather than oneDNN.
 * Measured with bench/cpu_gemm_small.c (AMD EPYC Zen 4, 2 threads,
 * OMP_WAIT_POLICY=passive, K 576, W cold, threads' read ceiling 28.5 GB/s),
 * fixed against oneDNN: M 1 fp32 N 49152 4.34 against 5.61 ms (26.1 against
 * 20.2 GB/s), N 192 0.030 against 0.052 ms; M 8 fp32 0.05 / 0.13 / 0.26 /
 * 6.98 ms against 0.07 / 0.14 / 0.27 / 7.34 (N 192 / 576 / 1536 / 49152),
 * bf16 0.04 / 0.11 / 0.20 / 5.23 against 0.07 / 0.11 / 0.19 / 4.83; M 16
 * lost everywhere (fp32 N 49152 23.9 against 17.5 ms; bf16 9.7 against
 * 7.0), where oneDNN's larger register blocking is compute-bound and the
 * fixed kernel's 4 × 4 tiles (one FMA chain per element) are not. */
enum { ML_CPU_GEMM_SMALL_M = 8 };
/* ml_be_gemm's args on `path`, the operands converted to the compute dtype
 * as ml_cpu_gemm_run does. Errors: FIXED for a layout other than A·B^T,
 * oneDNN's, allocation. */
int ml_cpu_gemm_run_on(ml_cpu_gemm *g, const ml_gemm *args, ml_cpu_gemm_path path);
/* Bytes of pool scratch ml_cpu_gemm_run holds at once for args (backend.h
 * ml_be_gemm_temp): the operands converted to the compute dtype, a bf16
 * bias widened, and a bf16 C's fp32 product where oneDNN writes no bf16
 * dst (see gemm.c). */
int64_t ml_cpu_gemm_temp(const ml_cpu_gemm *g, const ml_gemm *args);
/* Those bytes as the pool blocks ml_cpu_gemm_run takes, in the order it
 * takes them, all held until it returns (backend.h ml_be_gemm_temp_blocks):
 * a bf16 C's fp32 product, operand A converted, operand B converted, a bf16
 * bias widened — those the call needs. Returns their number. */
int ml_cpu_gemm_temp_blocks(const ml_cpu_gemm *g, const ml_gemm *args,
                            int64_t bytes[ML_GEMM_TEMP_BLOCKS]);
/* Batch-invariant mode (on: true): every ml_cpu_gemm_run of the forward's
 * layout (trans_a false, trans_b true: x·W^T, the linears, lm_head and the
 * fused classifier's tiles) runs on ml_cpu_gemm_fixed instead of oneDNN,
 * whatever M; the backward's layouts (dY·W, dY^T·X) stay on oneDNN (no
 * log-prob reads them). Off at creation. */
void ml_cpu_gemm_set_fixed(ml_cpu_gemm *g, bool on);
/* The batch-invariant GEMM (gemm_fixed.c): args' C (=|+=) A·B^T (+ bias)
 * for args' M, N, K >= 1, trans_a false and trans_b true, on the operands
 * as the compute dtype has them — A [M, K] (lda) and B [N, K] (ldb), each
 * fp32 or bf16 (a_bf16, b_bf16; a bf16 GEMM's fp32 operand holding bf16
 * values gives the same bits as that operand in bf16) — and bias [N] fp32
 * (NULL: none), args' own A, B, bias ignored. Each C element's summation
 * order depends on K only (see gemm_fixed.c), so a row of C is bitwise the
 * same whatever M, N, the other rows or the thread count. Returns 0. */
int ml_cpu_gemm_fixed(const ml_gemm *args, const void *A, int64_t lda, bool a_bf16, const void *B,
                      int64_t ldb, bool b_bf16, const float *bias);
/* Whether bf16 GEMMs run on bf16 operands here (else they are emulated on
 * fp32 operands holding bf16 values, and the tiles below are unavailable). */
bool ml_cpu_gemm_bf16_native(const ml_cpu_gemm *g);

/* Tiles: C [M, N] = alpha·op(A)·op(B) + beta·C (beta 0 or 1), row-major
 * bf16 A (lda), B (ldb) as cblas_sgemm takes them, fp32 C (ldc), fp32
 * accumulation: the small products of attention, run from the OpenMP
 * threads of a kernel, each on its thread alone. Before the parallel
 * region, reserve state for its thread count; inside, thread t (its
 * omp_get_thread_num()) calls ml_cpu_gemm_tile, which returns 0, or 1 and
 * records the failure; after it, ml_cpu_gemm_tiles_check reports the first
 * recorded failure (0 or −1 with the message). Only with bf16_native. */
int ml_cpu_gemm_tiles_reserve(ml_cpu_gemm *g, int threads);
int ml_cpu_gemm_tile(ml_cpu_gemm *g, int thread, bool ta, bool tb, int64_t M, int64_t N,
                     int64_t K, float alpha, const void *A, int64_t lda, const void *B,
                     int64_t ldb, float beta, float *C, int64_t ldc);
int ml_cpu_gemm_tiles_check(ml_cpu_gemm *g);
/* oneDNN's name of the implementation ml_cpu_gemm_tile runs on thread's
 * state for these arguments (dnnl_query_impl_info_str of the cached
 * primitive, built if missing: e.g. "brg:avx512_core_amx" or
 * "gemm:jit"), valid while the primitive is cached; NULL with the message
 * set when it cannot be built. After ml_cpu_gemm_tiles_reserve, outside a
 * parallel region; bench/attn_tile_gemm.c's. */
const char *ml_cpu_gemm_tile_impl(ml_cpu_gemm *g, int thread, bool ta, bool tb, int64_t M,
                                  int64_t N, int64_t K, float alpha, int64_t lda, int64_t ldb,
                                  float beta, int64_t ldc);

#endif

/* Device helpers shared by the CUDA kernels (internal to kernels/cuda):
 * launch sizes, 64-bit grid-stride indices, 4-element (quad) loads and
 * stores that vectorise when a pointer is aligned, bf16 bit conversions
 * exactly as tensor/dtype.h's, deterministic warp and block reductions,
 * and the two-pass column sum (reduce.cu) that bias_grad and RMSNorm's dw
 * share. Launch sizes are fixed constants, never queried from the device,
 * so the order of every sum depends on the problem sizes alone. */
#ifndef ML_KERNELS_CUDA_COMMON_CUH
#define ML_KERNELS_CUDA_COMMON_CUH

#include <cuda_runtime.h>
#include <stdint.h>

static constexpr int KC_THREADS = 256;     /* block size of the grid-stride and row kernels */
static constexpr int KC_MAX_BLOCKS = 4096; /* grid-stride grids: ~4 waves of 256 threads on
                                              132 SMs */
static constexpr int KC_RED_BLOCKS = 1024; /* most block partials of a whole-buffer reduction,
                                              and the size of the one block that folds them */
static constexpr int KC_MAX_ROW_GRID = 65535; /* row kernels loop over rows beyond this many
                                                 blocks (also the limit of grid.y, grid.z) */

/* ---- launch sizes (host) ------------------------------------------------ */

/* Blocks of `threads` for `items` work items, capped at KC_MAX_BLOCKS (the
 * kernels stride over the rest); at least 1. */
static inline unsigned kc_grid(int64_t items, int threads) {
  int64_t b = (items + threads - 1) / threads;
  return (unsigned)(b < 1 ? 1 : b < KC_MAX_BLOCKS ? b : KC_MAX_BLOCKS);
}

/* Blocks for one block per row, capped at KC_MAX_ROW_GRID; at least 1. */
static inline unsigned kc_row_grid(int64_t rows) {
  return (unsigned)(rows < 1 ? 1 : rows < KC_MAX_ROW_GRID ? rows : KC_MAX_ROW_GRID);
}

/* Blocks of a whole-buffer reduction over `items` (one per KC_THREADS
 * items, at most KC_RED_BLOCKS): a function of the size alone, so each
 * thread's share and the partials' order are fixed for given sizes. */
static inline int kc_reduce_blocks(int64_t items) {
  int64_t b = (items + KC_THREADS - 1) / KC_THREADS;
  return (int)(b < 1 ? 1 : b < KC_RED_BLOCKS ? b : KC_RED_BLOCKS);
}

/* ---- launches (host) ----------------------------------------------------
 * Every kernel launch goes through KC_LAUNCH(kernel, grid, block, smem,
 * stream, args...) (a template kernel in parentheses: KC_LAUNCH((k<A, B>),
 * ...)): it launches, checks cudaGetLastError() at once and, on an error,
 * records the kernel's name for kc_failed_kernel() (kernels.h) before
 * returning the error, so that the backend's message names the kernel and
 * not only the operator. The error is the launch's (a bad configuration,
 * no code for the device) or one left by earlier asynchronous work; under
 * CUDA_LAUNCH_BLOCKING=1 it is this kernel's own execution too. */
extern thread_local const char *kc_failed;

template <typename... P, typename... A>
static cudaError_t kc_launch(const char *name, void (*kernel)(P...), dim3 grid, dim3 block,
                             size_t smem, cudaStream_t st, A... args) {
  kernel<<<grid, block, smem, st>>>(args...);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) kc_failed = name;
  return e;
}
#define KC_LAUNCH(kernel, ...) kc_launch(#kernel, kernel, __VA_ARGS__)

/* ---- grid-stride indices (device) --------------------------------------- */

static __device__ __forceinline__ int64_t kc_gtid(void) {
  return (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
}

static __device__ __forceinline__ int64_t kc_gstride(void) {
  return (int64_t)gridDim.x * blockDim.x;
}

/* ---- quad loads and stores ------------------------------------------------
 * Element i of p is one of the quad p[i .. i+4) with i a multiple of 4, so
 * p + i is 16-byte (float) or 8-byte (uint16_t) aligned exactly when p is:
 * a whole quad of an aligned pointer moves in one vector access, anything
 * else (misaligned p, or the last quad when n % 4 != 0) element by
 * element. Loads give 0 past n; stores skip past n. */

static __device__ __forceinline__ bool kc_aligned(const void *p, unsigned bytes) {
  return ((uintptr_t)p & (bytes - 1)) == 0;
}

static __device__ __forceinline__ void kc_ld4(const float *p, int64_t i, int64_t n, float v[4]) {
  if (i + 4 <= n && kc_aligned(p, 16)) {
    float4 q = *reinterpret_cast<const float4 *>(p + i);
    v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
  } else {
    for (int k = 0; k < 4; k++) v[k] = i + k < n ? p[i + k] : 0.0f;
  }
}

static __device__ __forceinline__ void kc_st4(float *p, int64_t i, int64_t n, const float v[4]) {
  if (i + 4 <= n && kc_aligned(p, 16)) {
    *reinterpret_cast<float4 *>(p + i) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
    for (int k = 0; k < 4; k++)
      if (i + k < n) p[i + k] = v[k];
  }
}

/* 16-bit elements: a quad is one uint2, element 0 in the low half of .x
 * (little-endian, as the array's memory order). */
static __device__ __forceinline__ void kc_ld4h(const uint16_t *p, int64_t i, int64_t n,
                                               uint16_t v[4]) {
  if (i + 4 <= n && kc_aligned(p, 8)) {
    uint2 q = *reinterpret_cast<const uint2 *>(p + i);
    v[0] = (uint16_t)q.x, v[1] = (uint16_t)(q.x >> 16);
    v[2] = (uint16_t)q.y, v[3] = (uint16_t)(q.y >> 16);
  } else {
    for (int k = 0; k < 4; k++) v[k] = i + k < n ? p[i + k] : (uint16_t)0;
  }
}

static __device__ __forceinline__ void kc_st4h(uint16_t *p, int64_t i, int64_t n,
                                               const uint16_t v[4]) {
  if (i + 4 <= n && kc_aligned(p, 8)) {
    *reinterpret_cast<uint2 *>(p + i) =
        make_uint2(v[0] | (uint32_t)v[1] << 16, v[2] | (uint32_t)v[3] << 16);
  } else {
    for (int k = 0; k < 4; k++)
      if (i + k < n) p[i + k] = v[k];
  }
}

/* ---- bf16 (tensor/dtype.h's ml_bf16_to_f32 / ml_f32_to_bf16, bit for bit) */

static __device__ __forceinline__ float kc_bf16_to_f32(uint16_t h) {
  return __uint_as_float((uint32_t)h << 16);
}

/* torch's round_to_nearest_even: NaN -> canonical 0x7FC0 (sign dropped);
 * else add 0x7FFF plus the lowest kept bit (the carry may reach inf). */
static __device__ __forceinline__ uint16_t kc_f32_to_bf16(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* Quad of a weight row held as fp32 or bf16 (widened exactly): elements
 * off + i .. off + i + 4 of w, n the row length (off a row's start). */
static __device__ __forceinline__ void kc_ld4w(const void *w, bool bf16, int64_t off, int64_t i,
                                               int64_t n, float v[4]) {
  if (bf16) {
    uint16_t h[4];
    kc_ld4h((const uint16_t *)w + off, i, n, h);
    for (int k = 0; k < 4; k++) v[k] = kc_bf16_to_f32(h[k]);
  } else {
    kc_ld4((const float *)w + off, i, n, v);
  }
}

/* ---- deterministic reductions --------------------------------------------
 * Fixed trees: a warp folds by shfl_down (16, 8, 4, 2, 1), lane 0 holding
 * the result; a block folds its warps' results the same way in warp 0.
 * The order depends only on blockDim, so results are bitwise repeatable. */

struct kc_sum_op {
  template <typename T> __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
/* max for values without NaN (callers map or skip NaNs first) */
struct kc_max_op {
  template <typename T> __device__ __forceinline__ T operator()(T a, T b) const {
    return a > b ? a : b;
  }
};

/* Lane 0 gets op over the warp's 32 values; needs all 32 lanes. */
template <typename T, typename Op>
static __device__ __forceinline__ T kc_warp_reduce(T v, Op op) {
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_down_sync(0xffffffffu, v, o));
  return v;
}

/* Every thread of the block gets op over the block's values; blockDim.x a
 * multiple of 32 (<= 1024), called by all threads. `ident` is op's
 * identity (it fills warp 0's lanes past the warp count). Back-to-back
 * calls are safe: sh[32] is written again only after the next call's first
 * barrier, which every thread reaches after reading this call's result. */
template <typename T, typename Op>
static __device__ __forceinline__ T kc_block_reduce(T v, T ident, Op op) {
  __shared__ T sh[33];
  int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = kc_warp_reduce(v, op);
  if (lane == 0) sh[wid] = v;
  __syncthreads();
  if (wid == 0) {
    v = kc_warp_reduce(lane < nw ? sh[lane] : ident, op);
    if (lane == 0) sh[32] = v;
  }
  __syncthreads();
  return sh[32];
}

/* ---- column sums (reduce.cu) -------------------------------------------- */
/* out[j] (+=) (float) of the fp64 sum over t of dy[t, j] (x == NULL: the
 * bias gradient) or of (double)dy[t, j]·x[t, j]·rstd[t] (RMSNorm's dw), for
 * dy, x [T, N]. Two passes, no atomics: fixed chunks of rows write fp64
 * partial column sums into `work`, then one thread per column adds its
 * chunks' partials in chunk order. work: kc_colsum_work bytes; T, N > 0. */
size_t kc_colsum_work(int64_t T, int64_t N);
cudaError_t kc_colsum(cudaStream_t st, const float *dy, const float *x, const float *rstd,
                      int64_t T, int64_t N, float *out, void *work);

#endif

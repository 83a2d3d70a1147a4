/* Reductions over rows or whole buffers: the bias gradient (column sums,
 * also RMSNorm's dw through kc_colsum), the gradient-norm pieces sumsq and
 * absmax, and the non-finite check. Semantics of kernels/cpu/vector.c
 * (k_bias_grad, k_norm_partials, k_has_nonfinite): fp64 accumulation,
 * NaN counted as +inf by absmax. Deterministic: block partials in `work`,
 * reduced in a fixed order by one block; no atomics. */
#include <math.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

/* ---- column sums ----------------------------------------------------------
 * Pass 1: grid (column blocks, row chunks); a thread owns one quad of
 * columns and adds the rows of its chunk in row order into fp64
 * partials[chunk][j]. Pass 2: a thread per column adds the chunk partials
 * in chunk order and adds the rounded total to out. The chunking targets
 * COLSUM_TARGET blocks (enough to fill the GPU) with chunks of at least
 * COLSUM_MIN_ROWS rows, and depends on T and N alone. */
static constexpr int COLSUM_THREADS = 128;
static constexpr int COLSUM_COLS = 4 * COLSUM_THREADS; /* columns per block */
static constexpr int COLSUM_TARGET = 2048;
static constexpr int COLSUM_MIN_ROWS = 16;

// chunks of rows_per rows covering T (the last may be shorter), for dy [T, N]
static int64_t colsum_chunks(int64_t T, int64_t N, int64_t *rows_per) {
  int64_t colblocks = (N + COLSUM_COLS - 1) / COLSUM_COLS;
  int64_t chunks = (COLSUM_TARGET + colblocks - 1) / colblocks;
  int64_t most = (T + COLSUM_MIN_ROWS - 1) / COLSUM_MIN_ROWS;
  if (chunks > most) chunks = most;
  if (chunks < 1) chunks = 1;
  *rows_per = (T + chunks - 1) / chunks;
  return (T + *rows_per - 1) / *rows_per; /* <= COLSUM_TARGET < 65535: fits grid.y */
}

size_t kc_colsum_work(int64_t T, int64_t N) {
  if (T <= 0 || N <= 0) return 0;
  int64_t rows_per;
  return (size_t)(colsum_chunks(T, N, &rows_per) * N) * sizeof(double);
}

// part[chunk, j] = sum over the chunk's rows t of dy[t, j] (or dy·x·rstd)
static __global__ void colsum_partial(const float *dy, const float *x, const float *rstd,
                                      int64_t T, int64_t N, int64_t rows_per, double *part) {
  int64_t j = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * 4;
  if (j >= N) return;
  int64_t t0 = (int64_t)blockIdx.y * rows_per, t1 = t0 + rows_per < T ? t0 + rows_per : T;
  double a[4] = {0.0, 0.0, 0.0, 0.0};
  for (int64_t t = t0; t < t1; t++) {
    float d[4], xv[4];
    kc_ld4(dy + t * N, j, N, d);
    if (x) {
      kc_ld4(x + t * N, j, N, xv);
      float r = rstd[t];
      for (int k = 0; k < 4; k++) a[k] += (double)d[k] * xv[k] * r;
    } else {
      for (int k = 0; k < 4; k++) a[k] += d[k];
    }
  }
  double *p = part + (int64_t)blockIdx.y * N;
  for (int k = 0; k < 4; k++)
    if (j + k < N) p[j + k] = a[k];
}

// out[j] += (float) sum over the chunks, in chunk order, of part[c, j]
static __global__ void colsum_final(const double *part, int64_t chunks, int64_t N, float *out) {
  for (int64_t j = kc_gtid(); j < N; j += kc_gstride()) {
    double s = 0.0;
    for (int64_t c = 0; c < chunks; c++) s += part[c * N + j];
    out[j] += (float)s;
  }
}

cudaError_t kc_colsum(cudaStream_t st, const float *dy, const float *x, const float *rstd,
                      int64_t T, int64_t N, float *out, void *work) {
  int64_t rows_per, chunks = colsum_chunks(T, N, &rows_per);
  dim3 grid((unsigned)((N + COLSUM_COLS - 1) / COLSUM_COLS), (unsigned)chunks);
  cudaError_t e = KC_LAUNCH(colsum_partial, grid, COLSUM_THREADS, 0, st, dy, x, rstd, T, N,
                            rows_per, (double *)work);
  if (e != cudaSuccess) return e;
  return KC_LAUNCH(colsum_final, kc_grid(N, KC_THREADS), KC_THREADS, 0, st, (const double *)work,
                   chunks, N, out);
}

extern "C" size_t kc_bias_grad_work(int64_t T, int64_t N) { return kc_colsum_work(T, N); }

extern "C" cudaError_t kc_bias_grad(cudaStream_t st, const float *dy, int64_t T, int64_t N,
                                    float *db, void *work) {
  if (T <= 0 || N <= 0) return cudaSuccess;
  return kc_colsum(st, dy, NULL, NULL, T, N, db, work);
}

/* ---- whole-buffer reductions ----------------------------------------------
 * kc_reduce_blocks(quads) blocks stride over the quads of g, each thread
 * folding its elements in index order, each block writing one partial to
 * work[block]; then a block of KC_RED_BLOCKS threads folds the partials
 * (thread b reads partial b) into out[0]. */

extern "C" size_t kc_reduce_work(int64_t n) {
  return (size_t)kc_reduce_blocks((n + 3) / 4) * sizeof(double);
}

/* The fold of one element into a norm partial: s + g² in fp64 (the square
 * exact), or max(s, |g|) with a NaN as +inf. */
struct sumsq_term {
  __device__ __forceinline__ double operator()(double s, float v) const {
    return s + (double)v * v;
  }
};
struct absmax_term {
  __device__ __forceinline__ double operator()(double s, float v) const {
    return fmax(s, isnan(v) ? INFINITY : fabs((double)v));
  }
};

// this thread's fold over its quads of g [n] as thread threadIdx.x of block b of a grid
// of nb blocks (a kc_reduce_blocks grid), in index order; zeros past n add nothing and
// never exceed s >= 0
template <typename Term>
static __device__ __forceinline__ double norm_share(const float *g, int64_t n, int64_t b,
                                                    int64_t nb, Term term) {
  double s = 0.0;
  for (int64_t i = (b * blockDim.x + threadIdx.x) * 4; i < n; i += nb * blockDim.x * 4) {
    float v[4];
    kc_ld4(g, i, n, v);
    for (int k = 0; k < 4; k++) s = term(s, v[k]);
  }
  return s;
}

// work[block] = the block's share of the sum of g² (sumsq_term, kc_sum_op) or of max |g|
// (absmax_term, kc_max_op)
template <typename Term, typename Op>
static __global__ void norm_partial(const float *g, int64_t n, Term term, Op op, double *work) {
  double s = kc_block_reduce(norm_share(g, n, blockIdx.x, gridDim.x, term), 0.0, op);
  if (threadIdx.x == 0) work[blockIdx.x] = s;
}

// work[block] = 1 when the block's share holds a NaN or ±inf, else 0
static __global__ void nonfinite_partial(const float *g, int64_t n, int *work) {
  int f = 0;
  for (int64_t i = kc_gtid() * 4; i < n; i += kc_gstride() * 4) {
    float v[4];
    kc_ld4(g, i, n, v); /* zeros past n are finite */
    for (int k = 0; k < 4; k++) f |= !isfinite(v[k]);
  }
  f = kc_block_reduce(f, 0, kc_max_op());
  if (threadIdx.x == 0) work[blockIdx.x] = f;
}

// out[0] = op over part[0 .. nb), nb <= KC_RED_BLOCKS, in a fixed tree
template <typename T, typename Op>
static __global__ void reduce_final(const T *part, int nb, T ident, Op op, T *out) {
  T v = kc_block_reduce((int)threadIdx.x < nb ? part[threadIdx.x] : ident, ident, op);
  if (threadIdx.x == 0) out[0] = v;
}

extern "C" cudaError_t kc_sumsq(cudaStream_t st, const float *g, int64_t n, double *out,
                                void *work) {
  if (n <= 0) return cudaMemsetAsync(out, 0, sizeof(double), st); /* empty sum: 0.0 */
  int nb = kc_reduce_blocks((n + 3) / 4);
  cudaError_t e = KC_LAUNCH((norm_partial<sumsq_term, kc_sum_op>), nb, KC_THREADS, 0, st, g, n,
                            sumsq_term(), kc_sum_op(), (double *)work);
  if (e != cudaSuccess) return e;
  return KC_LAUNCH((reduce_final<double, kc_sum_op>), 1, KC_RED_BLOCKS, 0, st, (const double *)work,
                   nb, 0.0, kc_sum_op(), out);
}

extern "C" cudaError_t kc_absmax(cudaStream_t st, const float *g, int64_t n, double *out,
                                 void *work) {
  if (n <= 0) return cudaMemsetAsync(out, 0, sizeof(double), st); /* as the CPU's 0.0 */
  int nb = kc_reduce_blocks((n + 3) / 4);
  cudaError_t e = KC_LAUNCH((norm_partial<absmax_term, kc_max_op>), nb, KC_THREADS, 0, st, g, n,
                            absmax_term(), kc_max_op(), (double *)work);
  if (e != cudaSuccess) return e;
  return KC_LAUNCH((reduce_final<double, kc_max_op>), 1, KC_RED_BLOCKS, 0, st, (const double *)work,
                   nb, 0.0, kc_max_op(), out);
}

extern "C" cudaError_t kc_has_nonfinite(cudaStream_t st, const float *g, int64_t n, int *out,
                                        void *work) {
  if (n <= 0) return cudaMemsetAsync(out, 0, sizeof(int), st);
  int nb = kc_reduce_blocks((n + 3) / 4);
  cudaError_t e = KC_LAUNCH(nonfinite_partial, nb, KC_THREADS, 0, st, g, n, (int *)work);
  if (e != cudaSuccess) return e;
  return KC_LAUNCH((reduce_final<int, kc_max_op>), 1, KC_RED_BLOCKS, 0, st, (const int *)work, nb,
                   0, kc_max_op(), out);
}

/* ---- norm partials of many pieces ----------------------------------------
 * Up to NORM_SEGS pieces per launch pair, passed by value: piece s has the
 * blocks [b0[s], b0[s+1]) of the first grid, kc_reduce_blocks of its quads,
 * each computing what block (b − b0[s]) of kc_sumsq's / kc_absmax's grid
 * over the piece computes; then block s of the second grid folds the
 * piece's partials as reduce_final does. So each out[s] is bitwise that
 * call's result. */
static constexpr int NORM_SEGS = 32;
struct norm_segs {
  const float *g[NORM_SEGS];
  int64_t n[NORM_SEGS];
  int b0[NORM_SEGS + 1];
};

// work[block] = its piece's partial (block − b0[s] of the piece's grid)
template <typename Term, typename Op>
static __global__ void norm_segs_partial(norm_segs sg, int k, Term term, Op op, double *work) {
  int s = 0, b = (int)blockIdx.x;
  while (s + 1 < k && b >= sg.b0[s + 1]) s++; /* pieces of no blocks (n = 0) skipped */
  double v = norm_share(sg.g[s], sg.n[s], b - sg.b0[s], sg.b0[s + 1] - sg.b0[s], term);
  v = kc_block_reduce(v, 0.0, op);
  if (threadIdx.x == 0) work[b] = v;
}

// out[s] = op over piece s's partials work[b0[s] .. b0[s+1]) (none: 0.0), in reduce_final's tree
template <typename Op>
static __global__ void norm_segs_final(norm_segs sg, Op op, const double *work, double *out) {
  int s = (int)blockIdx.x, nb = sg.b0[s + 1] - sg.b0[s];
  double v = kc_block_reduce((int)threadIdx.x < nb ? work[sg.b0[s] + threadIdx.x] : 0.0, 0.0, op);
  if (threadIdx.x == 0) out[s] = v;
}

// the blocks of piece n's grid (none for an empty piece)
static int segs_blocks(int64_t n) { return n > 0 ? kc_reduce_blocks((n + 3) / 4) : 0; }

extern "C" size_t kc_norm_segs_work(const int64_t *n, int k) {
  size_t most = 0;
  for (int at = 0; at < k; at += NORM_SEGS) {
    size_t blocks = 0;
    for (int s = at; s < k && s < at + NORM_SEGS; s++) blocks += (size_t)segs_blocks(n[s]);
    most = blocks > most ? blocks : most;
  }
  return most * sizeof(double);
}

template <typename Term, typename Op>
static cudaError_t norm_segs_run(cudaStream_t st, const float *const *g, const int64_t *n, int k,
                                 Term term, Op op, double *out, double *work) {
  for (int at = 0; at < k; at += NORM_SEGS) {
    int m = k - at < NORM_SEGS ? k - at : NORM_SEGS;
    norm_segs sg = {};
    for (int s = 0; s < m; s++) {
      sg.g[s] = g[at + s];
      sg.n[s] = n[at + s];
      sg.b0[s + 1] = sg.b0[s] + segs_blocks(n[at + s]);
    }
    cudaError_t e = cudaSuccess;
    if (sg.b0[m] > 0)
      e = KC_LAUNCH((norm_segs_partial<Term, Op>), sg.b0[m], KC_THREADS, 0, st, sg, m, term, op,
                    work);
    if (e == cudaSuccess)
      e = KC_LAUNCH((norm_segs_final<Op>), m, KC_RED_BLOCKS, 0, st, sg, op, (const double *)work,
                    out + at);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

extern "C" cudaError_t kc_norm_segs(cudaStream_t st, const float *const *g, const int64_t *n,
                                    int k, int absmax, double *out, void *work) {
  if (absmax) return norm_segs_run(st, g, n, k, absmax_term(), kc_max_op(), out, (double *)work);
  return norm_segs_run(st, g, n, k, sumsq_term(), kc_sum_op(), out, (double *)work);
}

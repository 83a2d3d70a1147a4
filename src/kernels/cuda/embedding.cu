/* Vocab-parallel embedding lookup and its weight gradient (Megatron
 * VocabParallelEmbedding), semantics of kernels/cpu/embedding.c: ids
 * outside [row0, row0 + rows) give zero rows and no gradient; a bf16 W is
 * widened exactly and scaled in fp32; dW[row] += scale·dout[t] one token
 * at a time in token order, in fp32.
 *
 * Forward: one block per token row, threads over quads of H (common.cuh).
 *
 * Backward, deterministic without atomics: the tokens are sorted by row
 * with a stable LSD radix sort (8-bit digits, as many passes as the row
 * count needs; out-of-range tokens get the key `rows` and sort last), so
 * the tokens of one row form a segment in token order. Then one block per
 * sorted position that starts a segment adds the segment's dout rows into
 * dW's row in that order, exactly the CPU's sequence of fp32 additions.
 * A radix pass over tiles of SORT_TILE keys: count each tile's digits
 * (hist[digit][tile]), exclusive-scan hist in (digit, tile) order in one
 * block, then scatter every key to its digit's offset plus its rank among
 * the equal digits before it in the tile (warp match masks and per-warp
 * digit counts), which keeps equal digits in their input order. */
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

static constexpr int RADIX = 256;          /* 8-bit digits */
static constexpr int SORT_THREADS = RADIX; /* a thread per digit for the tile's counts */
static constexpr int SORT_WARPS = SORT_THREADS / 32;
static constexpr int SORT_ROUNDS = 4; /* keys per thread and tile */
static constexpr int SORT_TILE = SORT_THREADS * SORT_ROUNDS;
static constexpr int SCAN_THREADS = 1024;

static __device__ __forceinline__ bool in_range(int32_t id, int64_t row0, int64_t rows) {
  return id >= row0 && id < row0 + rows;
}

/* ---- forward ------------------------------------------------------------ */

// out[t] = scale · W[ids[t] − row0] for ids in range, else 0
static __global__ void embedding_fwd_kernel(const int32_t *ids, int64_t T, const void *W,
                                            bool w_bf16, int64_t row0, int64_t rows, int64_t H,
                                            float scale, float *out) {
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    int32_t id = ids[t];
    bool in = in_range(id, row0, rows);
    int64_t off = in ? (id - row0) * H : 0;
    float *o = out + t * H;
    for (int64_t i = threadIdx.x * 4; i < H; i += blockDim.x * 4) {
      float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      if (in) {
        kc_ld4w(W, w_bf16, off, i, H, v);
        for (int k = 0; k < 4; k++) v[k] = scale * v[k];
      }
      kc_st4(o, i, H, v);
    }
  }
}

extern "C" cudaError_t kc_embedding_fwd(cudaStream_t st, const int32_t *ids, int64_t T,
                                        const void *W, bool w_bf16, int64_t row0, int64_t rows,
                                        int64_t H, float scale, float *out) {
  if (T <= 0 || H <= 0) return cudaSuccess;
  return KC_LAUNCH(embedding_fwd_kernel, kc_row_grid(T), KC_THREADS, 0, st, ids, T, W, w_bf16, row0,
                   rows, H, scale, out);
}

/* ---- backward: work layout --------------------------------------------------
 * keys and token indices twice (ping-pong between radix passes), then the
 * RADIX × tiles digit counts; each region 256-byte aligned. */

static int64_t sort_tiles(int64_t T) { return (T + SORT_TILE - 1) / SORT_TILE; }

static size_t align256(size_t b) { return (b + 255) & ~(size_t)255; }

extern "C" size_t kc_embedding_bwd_work(int64_t T) {
  if (T <= 0) return 0;
  return 4 * align256((size_t)T * sizeof(uint32_t)) +
         align256((size_t)(RADIX * sort_tiles(T)) * sizeof(uint32_t));
}

/* ---- backward: sort ------------------------------------------------------- */

// key[t] = ids[t] − row0 in range, else `sentinel` (= rows, after every row); val[t] = t
static __global__ void sort_init(const int32_t *ids, int64_t T, int64_t row0, int64_t rows,
                                 uint32_t sentinel, uint32_t *key, uint32_t *val) {
  for (int64_t t = kc_gtid(); t < T; t += kc_gstride()) {
    int32_t id = ids[t];
    key[t] = in_range(id, row0, rows) ? (uint32_t)(id - row0) : sentinel;
    val[t] = (uint32_t)t;
  }
}

// hist[d * tiles + b] = keys of tile b whose digit (at shift) is d
static __global__ void sort_hist(const uint32_t *key, int64_t T, int shift, uint32_t *hist) {
  __shared__ uint32_t cnt[RADIX];
  cnt[threadIdx.x] = 0;
  __syncthreads();
  int64_t base = (int64_t)blockIdx.x * SORT_TILE;
  for (int r = 0; r < SORT_ROUNDS; r++) {
    int64_t i = base + r * SORT_THREADS + threadIdx.x;
    if (i < T) atomicAdd(&cnt[(key[i] >> shift) & (RADIX - 1)], 1u); /* integer: exact */
  }
  __syncthreads();
  hist[(int64_t)threadIdx.x * gridDim.x + blockIdx.x] = cnt[threadIdx.x];
}

// h[0 .. n) = its exclusive prefix sums, in one block: each thread scans a
// contiguous stretch after a block scan of the stretches' totals
static __global__ void sort_scan(uint32_t *h, int64_t n) {
  __shared__ uint32_t wsum[32];
  int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
  int64_t per = (n + blockDim.x - 1) / blockDim.x, a = threadIdx.x * per;
  int64_t b = a + per < n ? a + per : n;
  uint32_t s = 0;
  for (int64_t i = a; i < b; i++) s += h[i];
  uint32_t incl = s; /* inclusive scan of s over the warp */
  for (int o = 1; o < 32; o <<= 1) {
    uint32_t v = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += v;
  }
  if (lane == 31) wsum[wid] = incl;
  __syncthreads();
  if (wid == 0) { /* warp totals -> their exclusive prefixes */
    uint32_t w = lane < nw ? wsum[lane] : 0, wi = w;
    for (int o = 1; o < 32; o <<= 1) {
      uint32_t v = __shfl_up_sync(0xffffffffu, wi, o);
      if (lane >= o) wi += v;
    }
    if (lane < nw) wsum[lane] = wi - w;
  }
  __syncthreads();
  uint32_t run = wsum[wid] + incl - s;
  for (int64_t i = a; i < b; i++) {
    uint32_t c = h[i];
    h[i] = run;
    run += c;
  }
}

// stable scatter of tile b's keys (and vals) to off[d * tiles + b] + rank
static __global__ void sort_scatter(const uint32_t *key, const uint32_t *val, int64_t T,
                                    int shift, const uint32_t *off, uint32_t *key_out,
                                    uint32_t *val_out) {
  __shared__ uint32_t base[RADIX];              /* next output slot of each digit */
  __shared__ uint32_t wcnt[SORT_WARPS][RADIX];  /* this round's digit counts per warp */
  int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  base[threadIdx.x] = off[(int64_t)threadIdx.x * gridDim.x + blockIdx.x];
  for (int w = 0; w < SORT_WARPS; w++) wcnt[w][threadIdx.x] = 0;
  __syncthreads();
  int64_t tile = (int64_t)blockIdx.x * SORT_TILE;
  for (int r = 0; r < SORT_ROUNDS; r++) {
    int64_t i = tile + r * SORT_THREADS + threadIdx.x;
    bool valid = i < T;
    uint32_t k = valid ? key[i] : 0;
    uint32_t d = valid ? (k >> shift) & (RADIX - 1) : RADIX; /* RADIX: matches no digit */
    uint32_t peers = __match_any_sync(0xffffffffu, d);
    uint32_t rank = __popc(peers & ((1u << lane) - 1)); /* equal digits in lower lanes */
    if (valid && rank == 0) wcnt[wid][d] = __popc(peers);
    __syncthreads();
    if (valid) {
      uint32_t pos = base[d] + rank;
      for (int w = 0; w < wid; w++) pos += wcnt[w][d];
      key_out[pos] = k;
      val_out[pos] = val[i];
    }
    __syncthreads();
    uint32_t add = 0; /* thread = digit: advance base, clear the counts */
    for (int w = 0; w < SORT_WARPS; w++) {
      add += wcnt[w][threadIdx.x];
      wcnt[w][threadIdx.x] = 0;
    }
    base[threadIdx.x] += add;
    __syncthreads();
  }
}

/* ---- backward: accumulate ------------------------------------------------- */

// for each segment start p of the sorted keys (below sentinel): dW[key] += scale·dout[val[q]]
// for q over the segment in order; grid.y strides over the column quads of H
static __global__ void embedding_accum(const uint32_t *key, const uint32_t *val, int64_t T,
                                       uint32_t sentinel, const float *dout, int64_t H,
                                       float scale, float *dW) {
  for (int64_t p = blockIdx.x; p < T; p += gridDim.x) {
    uint32_t k = key[p];
    if (k == sentinel || (p > 0 && key[p - 1] == k)) continue;
    float *wr = dW + (int64_t)k * H;
    for (int64_t i = ((int64_t)blockIdx.y * blockDim.x + threadIdx.x) * 4; i < H;
         i += (int64_t)gridDim.y * blockDim.x * 4) {
      float a[4];
      kc_ld4(wr, i, H, a);
      for (int64_t q = p; q < T && key[q] == k; q++) {
        float d[4];
        kc_ld4(dout + (int64_t)val[q] * H, i, H, d);
        for (int j = 0; j < 4; j++) a[j] += scale * d[j];
      }
      kc_st4(wr, i, H, a);
    }
  }
}

extern "C" cudaError_t kc_embedding_bwd(cudaStream_t st, const int32_t *ids, int64_t T,
                                        const float *dout, int64_t row0, int64_t rows, int64_t H,
                                        float scale, float *dW, void *work) {
  if (T <= 0 || H <= 0 || rows <= 0) return cudaSuccess;
  /* token indices and keys (< rows, and the sentinel rows) are 32-bit */
  if (T > INT32_MAX || rows >= (int64_t)UINT32_MAX) return cudaErrorInvalidValue;
  uint32_t sentinel = (uint32_t)rows;
  int bits = 0;
  while (bits < 32 && (sentinel >> bits) != 0) bits++;
  int passes = (bits + 7) / 8;
  int64_t tiles = sort_tiles(T);
  char *wp = (char *)work;
  size_t kb = align256((size_t)T * sizeof(uint32_t));
  uint32_t *key = (uint32_t *)wp, *val = (uint32_t *)(wp + kb);
  uint32_t *key2 = (uint32_t *)(wp + 2 * kb), *val2 = (uint32_t *)(wp + 3 * kb);
  uint32_t *hist = (uint32_t *)(wp + 4 * kb);
  cudaError_t e = KC_LAUNCH(sort_init, kc_grid(T, KC_THREADS), KC_THREADS, 0, st, ids, T, row0,
                            rows, sentinel, key, val);
  if (e != cudaSuccess) return e;
  for (int p = 0; p < passes; p++) {
    e = KC_LAUNCH(sort_hist, (unsigned)tiles, SORT_THREADS, 0, st, key, T, 8 * p, hist);
    if (e != cudaSuccess) return e;
    e = KC_LAUNCH(sort_scan, 1, SCAN_THREADS, 0, st, hist, RADIX * tiles);
    if (e != cudaSuccess) return e;
    e = KC_LAUNCH(sort_scatter, (unsigned)tiles, SORT_THREADS, 0, st, key, val, T, 8 * p, hist,
                  key2, val2);
    if (e != cudaSuccess) return e;
    uint32_t *t = key;
    key = key2, key2 = t;
    t = val, val = val2, val2 = t;
  }
  int64_t ygrid = (H + 4 * KC_THREADS - 1) / (4 * KC_THREADS);
  dim3 grid(kc_row_grid(T), (unsigned)(ygrid < KC_MAX_ROW_GRID ? ygrid : KC_MAX_ROW_GRID));
  return KC_LAUNCH(embedding_accum, grid, KC_THREADS, 0, st, key, val, T, sentinel, dout, H, scale,
                   dW);
}

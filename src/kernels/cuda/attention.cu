/* Causal grouped-query attention on the GPU (kernels.h: kc_attention_*):
 * FlashAttention-2 (T. Dao, "FlashAttention-2: Faster Attention with
 * Better Parallelism and Work Partitioning", 2023) with a deterministic
 * backward. No [S, S] tensor is ever stored: scores live in registers and
 * shared memory one tile at a time.
 *
 * Forward (one block per query tile of one head): the tile's queries stay
 * in shared memory while key/value tiles stream through; each row keeps a
 * running maximum m and sum l of exp(score − m), and the output
 * accumulator is rescaled by exp(m_old − m_new) whenever m grows (online
 * softmax). At the end out = acc / l and lse = m + log(l).
 *
 * Backward, without atomics (FA2 adds dq with atomics; we do not):
 *   1. D = rowsum(dout ⊙ out) [B, nh, S] into `work` (fp64 sum, fixed order);
 *   2. one block per key tile of one kv head computes that tile's dk, dv:
 *      it loops over the group's query heads, then over the query tiles
 *      that can see the keys, in a fixed order, recomputing
 *      P = exp(scale·q·k − lse) and dS = P ⊙ (dP − D), dP = dout·v^T, and
 *      adds dv += P^T·dout, dk += scale·dS^T·q in registers;
 *   3. one block per query tile of one head computes dq = scale·dS·k over
 *      the key tiles it sees, recomputing P and dS the same way.
 * Every output element is written by exactly one thread, once, and every
 * sum runs in an order fixed by the sizes: results are bitwise
 * reproducible run to run.
 *
 * Masking: query i sees key j iff j <= i and, when window > 0,
 * j > i − window. Tiles entirely above the diagonal (causal) or entirely
 * left of every query's window are never visited; tiles that straddle a
 * boundary evaluate the exact predicate per element. Tiles are padded with
 * zeros past S and past hd, and padded rows are never stored.
 *
 * Two arithmetic modes (`bf16`):
 *   false: fp32 products on CUDA cores (plain FMA), the parity mode;
 *   true:  tensor cores (mma.sync m16n8k16, bf16 in, fp32 accumulate), as
 *          SDPA under autocast(bfloat16): q, k, v, dout are rounded to bf16
 *          (nearest-even) once per call (bf16 staging, below), and P and
 *          dS are rounded where they enter a product; the
 *          softmax, its sums and its backward stay fp32.
 * Head sizes: hd any multiple of 8 up to 256; kernels are instantiated for
 * padded widths 32, 64, 128, 256 (the zero columns past hd add nothing).
 *
 * Requirements checked by the launchers: q, k, v, out, dout, dq, dk, dv
 * and (bf16) the stage 16-byte aligned (cudaMalloc's are; tiles load as
 * float4 or 16-byte cp.async), S < 2^30, nh a
 * multiple of nkv. Tiles above 48 KiB of shared memory opt in with
 * cudaFuncSetAttribute before each launch (cheap; follows the current
 * device). The bf16 kernels need sm_80 or newer (built for sm_90 they run
 * on H100); an older target traps in them.
 *
 * bf16 staging: q, k, v (and dout) are rounded to bf16 once per call into
 * a scratch (kc_attention_stage_bytes) by the launcher; the kernels copy
 * their tiles from it with cp.async, double-buffered (the next tile's
 * copies in flight while the current one is computed) where shared memory
 * allows (stages_for). The rounding is the one the tiles used to do in
 * registers (nearest-even), so the results are bitwise those of staging
 * from fp32.
 *
 * Blocks (kc_attention_block_*: ring attention's pieces, packed documents,
 * generation's KV cache): the same kernels on a block's geometry (Params:
 * sq queries at q_pos − k_pos = dpos from sk keys, strides, the lse
 * layout, a GQA head offset); accumulate merges into the out and lse
 * there, and the backward adds into dq, dk, dv. Paged keys (a block
 * table) and strided blocks in bf16 are gathered compact into the stage
 * first (gather_rows), so the tiles always read contiguous rows. Masked
 * tiles compare each element with its row's key range (row_keys), not
 * the whole predicate.
 *
 * Speed (H200, bench/cuda_attention.c vs bench/attention_peer.py, causal,
 * S 2048, bf16; bench/results/2026-11-26-nvidia-h200-block-attention.md):
 * hd 64 forward 152 TFLOP/s, backward 110 (PyTorch SDPA's
 * FlashAttention-2 248 and 173, cuDNN 349 and 251); hd 128: 181 and 136
 * (FA2 246 and 201, cuDNN 481 and 289). What would close the gap: Hopper's wgmma and TMA
 * (FlashAttention-3) in place of mma.sync and cp.async; the backward's dq
 * without recomputing S and dP in a second kernel (7 products where FA2
 * does 5 — FA2 adds dq with atomics, which is not deterministic; an
 * ordered accumulation would be); the dk/dv kernel could split the group's
 * heads across blocks (deterministic second-pass sum) when B·nkv·S/64
 * blocks do not fill the GPU. */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace {

typedef __nv_bfloat16 bf16;

constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

/* Everything a kernel reads: one struct by value for all of them. The
 * geometry is block attention's (kernels.h kc_attn_block): sq query rows
 * against sk key rows per sequence, query i seeing key j iff j <= i + dpos
 * and, with a window, j > i + dpos − win (dpos = q_pos − k_pos: the masks
 * on global positions); a whole sequence is sq = sk = S, dpos = 0. */
struct Params {
  const float *q, *k, *v;  /* [B][sq | sk rows, nh | nkv, hd] */
  const float *dout;       /* backward */
  /* bf16 mode: q, k, v (and dout) rounded to bf16 once (the stage) */
  const bf16 *qh, *kh, *vh, *douth;
  const float *lse_in;     /* backward: the forward's (final) lse */
  const float *D;          /* backward: rowsum(dout ⊙ out) [B, nh, sq] */
  float *o, *lse;          /* forward results */
  float *dq, *dk, *dv;     /* backward results */
  int B, sq, sk, nh, nkv, group, off, hd;
  int dpos;                /* q_pos − k_pos */
  int win;                 /* sliding window, 0 = none */
  float scale;
  int64_t q_bs, k_bs;      /* elements from one sequence to the next: q, out, dout, dq; k, v, dk, dv */
  int64_t qs_bs, ks_bs;    /* the same of what the tiles read (q, dout; k, v): the stage's in
                            * bf16 and for paged keys, else q_bs, k_bs */
  int64_t l_bs, l_rs, l_hs; /* lse of (b, i, h) at b·l_bs + i·l_rs + h·l_hs */
  bool acc;                /* forward: merged into out, lse; backward: dq, dk, dv += */
  bool o_bf16;             /* out is bf16 (kc_attn_block.out_bf16; bf16 kernels, acc false):
                            * fwd_bf16 stores O / l rounded to nearest-even, rowdot reads it */
};

/* Offset of element 0 of query row i, head h (key row j, kv head g) of
 * sequence b, bs elements from one sequence to the next. */
__device__ __forceinline__ int64_t q_at(const Params &p, int64_t bs, int b, int i, int h) {
  return (int64_t)b * bs + ((int64_t)i * p.nh + h) * p.hd;
}
__device__ __forceinline__ int64_t k_at(const Params &p, int64_t bs, int b, int j, int g) {
  return (int64_t)b * bs + ((int64_t)j * p.nkv + g) * p.hd;
}
/* lse and D of query row i, head h of sequence b */
__device__ __forceinline__ int64_t lse_at(const Params &p, int b, int i, int h) {
  return (int64_t)b * p.l_bs + (int64_t)i * p.l_rs + (int64_t)h * p.l_hs;
}
__device__ __forceinline__ int64_t d_at(const Params &p, int b, int i, int h) {
  return ((int64_t)b * p.nh + h) * p.sq + i;
}
/* visible() as ranges, for the tensor-core kernels' masked tiles (a row's
 * bounds are the same for all its elements, which the unrolled loops then
 * compare with two instructions each): the keys query row i sees, lo ..
 * hi, and the queries that see key row j, lo .. hi (hi < lo: none). */
__device__ __forceinline__ void row_keys(const Params &p, int i, int &lo, int &hi) {
  const int d = i + p.dpos;
  lo = p.win > 0 ? max(0, d - p.win + 1) : 0;
  hi = i < p.sq ? min(d, p.sk - 1) : -1;
}
__device__ __forceinline__ void key_queries(const Params &p, int j, int &lo, int &hi) {
  lo = max(0, j - p.dpos);
  hi = j >= p.sk ? -1 : p.win > 0 ? min(p.sq - 1, j - p.dpos + p.win - 1) : p.sq - 1;
}

/* The kv head query head h reads (GQA; a tp rank's heads may start inside a group). */
__device__ __forceinline__ int kv_of(const Params &p, int h) { return (h + p.off) / p.group; }

/* The mask: query row i sees key row j (rows past sq or sk see nothing). */
__device__ __forceinline__ bool visible(const Params &p, int i, int j) {
  const int d = i + p.dpos;
  return i < p.sq && j < p.sk && j <= d && (p.win <= 0 || j > d - p.win);
}

/* fp32 pair → packed bf16x2, lo in the low half (the lower column index,
 * as the mma fragments hold it), both rounded to nearest-even. */
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &v, sizeof u);
  return u;
}

/* ---- tensor-core primitives (PTX ISA 9.7.14: mma.m16n8k16, ldmatrix) ----
 * Fragment layouts, lane = 4·g + t (g = lane / 4, t = lane % 4):
 *   A 16×16 (4 regs): a0 (row g, cols 2t, 2t+1), a1 (row g+8, same cols),
 *                     a2 (row g, cols 2t+8, 2t+9), a3 (row g+8, cols 2t+8..);
 *   B 16×8  (2 regs): b0 (rows 2t, 2t+1, col g), b1 (rows 2t+8, 2t+9, col g);
 *   C 16×8  (4 fp32): c0, c1 (row g, cols 2t, 2t+1), c2, c3 (row g+8, same).
 * ldmatrix.x4 loads four 8×8 bf16 matrices; lanes 8m..8m+7 give the row
 * addresses of matrix m, and register m of a lane holds row g, elements
 * 2t, 2t+1 of matrix m (with .trans: elements [2t][g], [2t+1][g]). */

/* Four 8×8 matrices, not transposed. Row addresses 16-byte aligned. */
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const bf16 *p) {
  uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

/* Four 8×8 matrices, transposed. */
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const bf16 *p) {
  uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

/* c[16×8] += a[16×16] · b[16×8], bf16 operands, fp32 accumulation. */
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap(); /* bf16 mma needs sm_80: build for sm_90 */
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

/* Lane addresses for ldmatrix on a bf16 tile X stored row-major with row
 * stride ld (elements), for the 16×16 block at (r0, c0):
 *   frag_a:   A operand, A = X[r0.., c0..] (rows = M, cols = K);
 *   frag_bn:  B operands of two n-tiles, B[k][n] = X[r0 + n][c0 + k]
 *             (X holds B^T: n-tiles rows r0..r0+7 and r0+8..r0+15),
 *             registers {0, 1} for the first n-tile, {2, 3} the second;
 *   frag_bt:  B operands of two n-tiles, B[k][n] = X[r0 + k][c0 + n]
 *             (X holds B: n-tiles cols c0..c0+7 and c0+8..c0+15), .trans. */
__device__ __forceinline__ const bf16 *frag_a(const bf16 *X, int ld, int r0, int c0, int lane) {
  return X + (r0 + (lane & 15)) * ld + c0 + (lane >> 4) * 8;
}
__device__ __forceinline__ const bf16 *frag_bn(const bf16 *X, int ld, int r0, int c0, int lane) {
  return X + (r0 + (lane & 7) + (lane >> 4) * 8) * ld + c0 + ((lane >> 3) & 1) * 8;
}
__device__ __forceinline__ const bf16 *frag_bt(const bf16 *X, int ld, int r0, int c0, int lane) {
  return X + (r0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + c0 + (lane >> 4) * 8;
}

/* ---- asynchronous copies (PTX ISA 9.7.9.25: cp.async, sm_80) -------------
 * A thread's copies global → shared bypass its registers; they land when
 * cp_async_wait<N>() has retired all but its N most recent committed groups,
 * and other threads see them after the __syncthreads that follows. `in`
 * false copies nothing and writes zeros (src-size 0; src is not read). */
__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool in) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap(); /* cp.async needs sm_80: build for sm_90 */
#else
  uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src),
               "r"(in ? 16 : 0)
               : "memory");
#endif
}
__device__ __forceinline__ void cp_async4(void *dst, const void *src, bool in) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();
#else
  uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src),
               "r"(in ? 4 : 0)
               : "memory");
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

/* ---- staging tiles in shared memory -------------------------------------
 * Rows 0..R−1 of a tile come from src + r·ld (hd columns); rows past nrows
 * and columns past hd are zero, so padded keys and queries score 0, padded
 * values add 0, and no uninitialised shared memory is ever read. */

/* bf16 tile [R][HP + 8] from the bf16 copy of a tensor, by cp.async (the
 * caller commits and waits). The 8-element (16-byte) padding per row keeps
 * the ldmatrix row addresses 16-byte aligned and spreads 8 consecutive rows
 * over distinct banks. */
template <int R, int HP, int NT>
__device__ __forceinline__ void stage_async(bf16 *dst, const bf16 *__restrict__ src, int64_t ld,
                                            int nrows, int hd) {
  constexpr int C8 = HP / 8; /* 16-byte chunks per row; hd % 8 == 0: a chunk is all in or out */
  for (int e = threadIdx.x; e < R * C8; e += NT) {
    const int r = e / C8, c = (e % C8) * 8;
    const bool in = r < nrows && c < hd;
    cp_async16(dst + r * (HP + 8) + c, in ? src + r * ld + c : src, in);
  }
}

/* Double buffering: 2 stages (the next tile's copies in flight while the
 * current one is computed) when `blocks` blocks of that size still fit an
 * SM's shared memory (sm_90: 228 KiB, 1 KiB of it reserved per block), else
 * 1 (each tile copied, then computed: the other resident block overlaps). */
constexpr int stages_for(size_t smem2, int blocks) {
  return (smem2 + 1024) * blocks <= 233472 ? 2 : 1;
}

/* fp32 tile [R][HP + 1]: the odd row stride puts the 8 rows a warp reads
 * at once on distinct banks. */
template <int R, int HP, int NT>
__device__ __forceinline__ void stage_f32(float *dst, const float *__restrict__ src, int64_t ld,
                                          int nrows, int hd) {
  constexpr int C4 = HP / 4;
  for (int e = threadIdx.x; e < R * C4; e += NT) {
    int r = e / C4, c = (e % C4) * 4;
    float4 x = {0.f, 0.f, 0.f, 0.f};
    if (r < nrows && c < hd) x = *reinterpret_cast<const float4 *>(src + r * ld + c);
    float *d = dst + r * (HP + 1) + c;
    d[0] = x.x;
    d[1] = x.y;
    d[2] = x.z;
    d[3] = x.w;
  }
}

/* Query-tile kernels (forward, dq) order their blocks by descending tile
 * index so that the longest (latest) tiles of every head start first. */
struct QTile {
  int b, h, qb;
};
__device__ __forceinline__ QTile qtile_of(const Params &p, int BM) {
  int nqb = (p.sq + BM - 1) / BM, bh = (int)(blockIdx.x % (unsigned)(p.B * p.nh));
  int r = (int)(blockIdx.x / (unsigned)(p.B * p.nh));
  return {bh / p.nh, bh % p.nh, nqb - 1 - r};
}

/* Key tiles a query tile [i0, i0 + BM) visits: [first, last] (tile indices
 * of width BN; last < first when it sees no key). Keys past the tile's
 * last real query's diagonal are above it for all of its rows; keys before
 * i0 + dpos − win + 1 are left of every row's window. */
__device__ __forceinline__ void key_tiles(const Params &p, int i0, int BM, int BN, int &first,
                                          int &last) {
  const int jlo = p.win > 0 ? max(0, i0 + p.dpos - p.win + 1) : 0;
  const int jhi = min(min(i0 + BM, p.sq) - 1 + p.dpos, p.sk - 1);
  first = jhi < jlo ? 0 : jlo / BN;
  last = jhi < jlo ? -1 : jhi / BN;
}

/* Query tiles (width BM) that see a key of the key tile [j0, j0 + BN):
 * qb0 .. qb0 + nq − 1 (nq 0 when none does). */
__device__ __forceinline__ void query_tiles(const Params &p, int j0, int BN, int BM, int &qb0,
                                            int &nq) {
  const int jlast = min(j0 + BN, p.sk) - 1;
  const int ilo = max(0, j0 - p.dpos);
  const int ihi = p.win > 0 ? min(p.sq - 1, jlast + p.win - 1 - p.dpos) : p.sq - 1;
  qb0 = ihi < ilo ? 0 : ilo / BM;
  nq = ihi < ilo ? 0 : ihi / BM - qb0 + 1;
}

/* The query heads of kv head kvh: h0 .. h0 + n − 1. */
__device__ __forceinline__ void group_heads(const Params &p, int kvh, int &h0, int &n) {
  h0 = max(0, kvh * p.group - p.off);
  n = max(0, min(p.nh, (kvh + 1) * p.group - p.off) - h0);
}

/* True when some (i, j) of the tile rows [i0, i0+BM) × keys [j0, j0+BN) is
 * masked: a key above the first row's diagonal, one at or left of the last
 * row's window edge, or a row or key past sq or sk. Otherwise every pair
 * is visible. */
__device__ __forceinline__ bool tile_masked(const Params &p, int i0, int BM, int j0, int BN) {
  return j0 + BN - 1 > i0 + p.dpos || (p.win > 0 && j0 <= i0 + BM - 1 + p.dpos - p.win) ||
         j0 + BN > p.sk || i0 + BM > p.sq;
}

/* The row's result for out and lse, given its block's sum l and lse lb
 * (natural log) and, accumulating, the lse la already there (else −inf):
 * false when nothing is written (accumulating, and the row saw no key);
 * else out = wa·out + f·acc (wa 0: out is not read; acc the row's
 * unnormalised output) and lse = lnew — the block's own (f = 1/l), zeros
 * and −inf for a row without keys, or ring attention's merge (kernels.h
 * kc_attn_block). */
__device__ __forceinline__ bool row_result(const Params &p, float l, float lb, float la, float &wa,
                                           float &f, float &lnew) {
  if (l == 0.f) {
    wa = f = 0.f;
    lnew = -INFINITY;
    return !p.acc;
  }
  if (la == -INFINITY) {
    wa = 0.f;
    f = 1.f / l;
    lnew = lb;
    return true;
  }
  const float mx = fmaxf(la, lb), ea = expf(la - mx), eb = expf(lb - mx), s = ea + eb;
  wa = ea / s;
  f = eb / s / l;
  lnew = mx + logf(s);
  return true;
}

/* x (=) a, or x += a when accumulating: one thread owns each element. */
__device__ __forceinline__ void put2(float *x, float a, float b, bool acc) {
  float2 v = make_float2(a, b);
  if (acc) {
    const float2 o = *reinterpret_cast<const float2 *>(x);
    v.x += o.x;
    v.y += o.y;
  }
  *reinterpret_cast<float2 *>(x) = v;
}
__device__ __forceinline__ void put1(float *x, float a, bool acc) { *x = acc ? *x + a : a; }

/* ==== bf16 forward ========================================================
 * Block: NW warps; warp w owns query rows [16·MT·w, 16·MT·(w+1)) of a BM =
 * 16·MT·NW query tile and keeps their scores, running max/sum and output
 * accumulator in registers. Per key tile of BN keys: S = Q·K^T (A from Qs,
 * B from Ks via ldmatrix), mask, online softmax, then O += P·V with P's
 * accumulator registers re-packed as bf16 A fragments (the C layout of two
 * adjacent n-tiles is the A layout of one k-step) and V via ldmatrix.trans.
 * MT = 2 (32 rows per warp) halves the shared-memory traffic per mma where
 * the registers allow it; BN shrinks for wide heads for the same reason.
 * Key/value tiles are double-buffered: tile kb + 1 is copied (cp.async)
 * while tile kb is computed. The shapes per head size are the fastest of
 * those measured on an H200 (bench/results/2026-11-26-nvidia-h200-attention.md:
 * hd 128 with 8 warps and 128-key tiles 1.24× the 4-warp, 64-key one; hd 64
 * best as here; 32 and 256 not measured). */
template <int HP>
struct FwdBf16 {
  static constexpr int MT = HP <= 64 ? 2 : 1, NW = HP == 128 ? 8 : 4, NT = 32 * NW;
  static constexpr int BM = 16 * MT * NW, BN = HP <= 64 ? 64 : HP == 128 ? 128 : 32, LD = HP + 8;
  /* Qs [BM][LD]; per buffer Ks, Vs [BN][LD] */
  static constexpr size_t smem = (size_t)(BM + 4 * BN) * LD * sizeof(bf16);
};

template <int HP>
__global__ void __launch_bounds__(FwdBf16<HP>::NT) fwd_bf16(Params p) {
  using C = FwdBf16<HP>;
  constexpr int MT = C::MT, BM = C::BM, BN = C::BN, LD = C::LD;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16 *Qs = reinterpret_cast<bf16 *>(smem), *KV = Qs + BM * LD; /* buffer u: KV + 2·BN·LD·u */
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const QTile qt = qtile_of(p, BM);
  const int i0 = qt.qb * BM, kvh = kv_of(p, qt.h);
  const int64_t ldq = (int64_t)p.nh * p.hd, ldk = (int64_t)p.nkv * p.hd;
  const float sl2 = p.scale * LOG2E; /* scores in log2 units: exp(x) = exp2(x·log2 e) */
  /* key/value tile kb into buffer u */
  auto stage_kv = [&](int kb, int u) {
    const int j0 = kb * BN;
    const int64_t koff = k_at(p, p.ks_bs, qt.b, j0, kvh);
    stage_async<BN, HP, C::NT>(KV + 2 * BN * LD * u, p.kh + koff, ldk, p.sk - j0, p.hd);
    stage_async<BN, HP, C::NT>(KV + 2 * BN * LD * u + BN * LD, p.vh + koff, ldk, p.sk - j0, p.hd);
  };

  int kb0, kb1;
  key_tiles(p, i0, BM, BN, kb0, kb1);
  stage_async<BM, HP, C::NT>(Qs, p.qh + q_at(p, p.qs_bs, qt.b, i0, qt.h), ldq, p.sq - i0, p.hd);
  if (kb0 <= kb1) stage_kv(kb0, 0);
  cp_async_commit();

  const int wr = warp * 16 * MT; /* first tile row of this warp */
  float o[MT][HP / 8][4] = {};   /* out accumulator, C layout per 8 columns */
  float m[MT][2], l[MT][2];      /* per row (g, g+8): running max (log2 units), partial sum */
#pragma unroll
  for (int mt = 0; mt < MT; mt++)
#pragma unroll
    for (int hf = 0; hf < 2; hf++) m[mt][hf] = -INFINITY, l[mt][hf] = 0.f;

  for (int kb = kb0; kb <= kb1; kb++) {
    const int j0 = kb * BN, u = (kb - kb0) & 1;
    __syncthreads(); /* tile kb − 1 (buffer u ^ 1, refilled next) is no longer read */
    if (kb < kb1) {
      stage_kv(kb + 1, u ^ 1);
      cp_async_commit();
      cp_async_wait<1>(); /* all but tile kb + 1's copies have landed */
    } else {
      cp_async_wait<0>();
    }
    __syncthreads(); /* Qs (first pass) and tile kb staged, for every thread */
    const bf16 *Ks = KV + 2 * BN * LD * u, *Vs = Ks + BN * LD;

    float s[MT][BN / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < HP / 16; kk++) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; mt++) ldsm_x4(a[mt], frag_a(Qs, LD, wr + 16 * mt, 16 * kk, lane));
#pragma unroll
      for (int np = 0; np < BN / 16; np++) {
        uint32_t bk[4];
        ldsm_x4(bk, frag_bn(Ks, LD, 16 * np, 16 * kk, lane));
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
          mma_bf16(s[mt][2 * np], a[mt], bk[0], bk[1]);
          mma_bf16(s[mt][2 * np + 1], a[mt], bk[2], bk[3]);
        }
      }
    }

    /* scale, then mask (after scaling, so any sign of scale is safe) */
    const bool masked = tile_masked(p, i0, BM, j0, BN);
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
      for (int nt = 0; nt < BN / 8; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
          float x = s[mt][nt][e] * sl2;
          int lo, hi, j = j0 + 8 * nt + 2 * t + (e & 1);
          row_keys(p, i0 + wr + 16 * mt + g + 8 * (e >> 1), lo, hi);
          s[mt][nt][e] = masked && (j < lo || j > hi) ? -INFINITY : x;
        }

    /* online softmax: row max over the 4 lanes of the row (xor 1, 2 keep g) */
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
      for (int hf = 0; hf < 2; hf++) {
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < BN / 8; nt++)
          mx = fmaxf(mx, fmaxf(s[mt][nt][2 * hf], s[mt][nt][2 * hf + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float mnew = fmaxf(m[mt][hf], mx);
        /* a row with no visible key yet keeps mnew = −inf: subtract 0 instead,
         * so that exp2(−inf − 0) = 0 rather than exp2(−inf + inf) = NaN */
        const float base = mnew == -INFINITY ? 0.f : mnew;
        const float alpha = exp2f(m[mt][hf] - base);
        m[mt][hf] = mnew;
        float rs = 0.f;
#pragma unroll
        for (int nt = 0; nt < BN / 8; nt++)
#pragma unroll
          for (int e = 2 * hf; e < 2 * hf + 2; e++) {
            s[mt][nt][e] = exp2f(s[mt][nt][e] - base);
            rs += s[mt][nt][e];
          }
        /* this lane's share of the row sum; the 4 shares add up at the end */
        l[mt][hf] = l[mt][hf] * alpha + rs;
#pragma unroll
        for (int dt = 0; dt < HP / 8; dt++) {
          o[mt][dt][2 * hf] *= alpha;
          o[mt][dt][2 * hf + 1] *= alpha;
        }
      }

    /* O += P·V: P's C fragments of n-tiles 2kk, 2kk+1 are the A fragment of
     * k-step kk (a0 = row g cols 2t.., a1 = row g+8, a2/a3 = cols 2t+8..) */
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; mt++) {
        a[mt][0] = pack_bf16(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        a[mt][1] = pack_bf16(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        a[mt][2] = pack_bf16(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        a[mt][3] = pack_bf16(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < HP / 16; dp++) {
        uint32_t bv[4];
        ldsm_x4_t(bv, frag_bt(Vs, LD, 16 * kk, 16 * dp, lane));
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
          mma_bf16(o[mt][2 * dp], a[mt], bv[0], bv[1]);
          mma_bf16(o[mt][2 * dp + 1], a[mt], bv[2], bv[3]);
        }
      }
    }
  }

  if (kb0 > kb1) cp_async_wait<0>(); /* no key tile: Qs's copies, never read, retire */
  /* out = O / l (l summed over the row's 4 lanes), lse = ln 2 · (m + log2 l), or
   * merged into them (row_result) */
#pragma unroll
  for (int mt = 0; mt < MT; mt++)
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
      float sum = l[mt][hf];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const int i = i0 + wr + 16 * mt + g + 8 * hf;
      const bool in = i < p.sq;
      float *lse = p.lse + lse_at(p, qt.b, in ? i : 0, qt.h), wa, f, lnew;
      /* accumulating: lane t = 0 reads the row's lse, before it writes it */
      float la = p.acc && in && t == 0 ? *lse : -INFINITY;
      la = __shfl_sync(0xffffffffu, la, lane & ~3);
      if (!in || !row_result(p, sum, (m[mt][hf] + log2f(sum)) * LN2, la, wa, f, lnew)) continue;
      float *dst = p.o + q_at(p, p.q_bs, qt.b, i, qt.h);
      /* a bf16 out: the same element offset in bf16 (wa is 0: never accumulating) */
      bf16 *dsth = reinterpret_cast<bf16 *>(p.o) + q_at(p, p.q_bs, qt.b, i, qt.h);
#pragma unroll
      for (int dt = 0; dt < HP / 8; dt++) {
        const int c = 8 * dt + 2 * t;
        if (c >= p.hd) continue;
        float2 x = make_float2(o[mt][dt][2 * hf] * f, o[mt][dt][2 * hf + 1] * f);
        if (p.o_bf16) {
          *reinterpret_cast<__nv_bfloat162 *>(dsth + c) = __floats2bfloat162_rn(x.x, x.y);
          continue;
        }
        if (wa != 0.f) {
          const float2 y = *reinterpret_cast<const float2 *>(dst + c);
          x = make_float2(wa * y.x + x.x, wa * y.y + x.y);
        }
        *reinterpret_cast<float2 *>(dst + c) = x;
      }
      if (t == 0) *lse = lnew;
    }
}

/* ==== bf16 backward =======================================================
 * Both kernels: 8 warps; each block owns BR = 64·RT rows of its own side
 * (dk/dv: keys; dq: queries) and streams tiles of BC = 64 of the other
 * side, two phases per tile:
 *   phase 1: the BR × 64 scores and dP in 8 pieces of 16·RT rows × 32
 *            columns (warp w: rows 16·RT·(w%4), columns 32·(w/4)); P and dS
 *            rounded to bf16 into shared memory;
 *   phase 2: the block's gradient rows 16·RT·(w%4).. and head columns
 *            (HP/2)·(w/4).. accumulate (HP/2 columns per warp keeps the
 *            accumulators within registers at HP = 256).
 * RT = 2 (32 rows per warp) where the accumulators fit in 128 registers
 * (2 blocks per SM): each ldmatrix of the streamed side then feeds two mma
 * instead of one (on an H200 the hd-64 backward 1.05× the RT = 1 one; with
 * 1 block per SM, RT = 2 was 0.82× at hd 64 and 0.93× at hd 128).
 * The tiles a kernel streams (dk/dv: the query tiles' Qs, dOs, lse, D; dq:
 * the key tiles' Ks, Vs) are double-buffered where shared memory allows
 * (stages_for): the next one is copied while the current one is computed. */
template <int HP>
struct BwdBf16 {
  static constexpr int NT = 256, RT = HP <= 64 ? 2 : 1, BR = 64 * RT, BC = 64;
  static constexpr int LD = HP + 8, LP = BC + 8, DW = HP / 2;
  /* 2 blocks per SM (registers capped at 128) where that costs no spills */
  static constexpr int MINB = HP <= 128 ? 2 : 1;
  /* dk/dv: Ks, Vs [BR][LD], Pt, dSt [BR][LP] bf16; per stage Qs, dOs [BC][LD] bf16 and
   * lse, D [BC] fp32 */
  static constexpr size_t kv_fixed = (size_t)2 * BR * LD * sizeof(bf16) + 2 * BR * LP * sizeof(bf16);
  static constexpr size_t kv_stage = (size_t)2 * BC * LD * sizeof(bf16) + 2 * BC * 4;
  static constexpr int KV_STAGES = stages_for(kv_fixed + 2 * kv_stage, MINB);
  static constexpr size_t smem_kv = kv_fixed + KV_STAGES * kv_stage;
  /* dq: Qs, dOs [BR][LD], dS [BR][LP] bf16; per stage Ks, Vs [BC][LD] bf16 */
  static constexpr size_t q_fixed = (size_t)2 * BR * LD * sizeof(bf16) + BR * LP * sizeof(bf16);
  static constexpr size_t q_stage = (size_t)2 * BC * LD * sizeof(bf16);
  static constexpr int Q_STAGES = stages_for(q_fixed + 2 * q_stage, MINB);
  static constexpr size_t smem_q = q_fixed + Q_STAGES * q_stage;
};

/* Phase 1 of both backward kernels, per warp: x1 += A1·B1^T and x2 += A2·B2^T
 * for rows r0..r0+16·RT−1 of A1, A2 (m-tile mt: rows r0 + 16·mt..) and rows
 * c0..c0+31 of B1, B2 (bf16 tiles [rows][LD] in shared memory; the products
 * reduce over their HP columns), as 4 C fragments of 8 columns per m-tile. */
template <int HP, int LD, int RT>
__device__ __forceinline__ void products_32(const bf16 *A1, const bf16 *A2, const bf16 *B1,
                                            const bf16 *B2, int r0, int c0, int lane,
                                            float (&x1)[RT][4][4], float (&x2)[RT][4][4]) {
#pragma unroll
  for (int kk = 0; kk < HP / 16; kk++) {
    uint32_t a1[RT][4], a2[RT][4];
#pragma unroll
    for (int mt = 0; mt < RT; mt++) {
      ldsm_x4(a1[mt], frag_a(A1, LD, r0 + 16 * mt, 16 * kk, lane));
      ldsm_x4(a2[mt], frag_a(A2, LD, r0 + 16 * mt, 16 * kk, lane));
    }
#pragma unroll
    for (int np = 0; np < 2; np++) {
      uint32_t b1[4], b2[4];
      ldsm_x4(b1, frag_bn(B1, LD, c0 + 16 * np, 16 * kk, lane));
      ldsm_x4(b2, frag_bn(B2, LD, c0 + 16 * np, 16 * kk, lane));
#pragma unroll
      for (int mt = 0; mt < RT; mt++) {
        mma_bf16(x1[mt][2 * np], a1[mt], b1[0], b1[1]);
        mma_bf16(x1[mt][2 * np + 1], a1[mt], b1[2], b1[3]);
        mma_bf16(x2[mt][2 * np], a2[mt], b2[0], b2[1]);
        mma_bf16(x2[mt][2 * np + 1], a2[mt], b2[2], b2[3]);
      }
    }
  }
}

/* dk, dv of one key tile of one kv head (blocks in ascending tile order:
 * the first key tiles have the most queries after them). Phase 1 works on
 * the transposed scores S^T = K·Q^T, so that P^T and dS^T land in shared
 * memory as [key][query], the row-major A operands of phase 2's
 * dV += P^T·dO and dK += dS^T·Q. */
template <int HP>
__global__ void __launch_bounds__(BwdBf16<HP>::NT, BwdBf16<HP>::MINB) dkdv_bf16(Params p) {
  using C = BwdBf16<HP>;
  /* BN keys of the block, BM queries per streamed tile */
  constexpr int RT = C::RT, BN = C::BR, BM = C::BC, LD = C::LD, LP = C::LP, DW = C::DW;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16 *Ks = reinterpret_cast<bf16 *>(smem), *Vs = Ks + BN * LD, *Pt = Vs + BN * LD;
  bf16 *dSt = Pt + BN * LP;
  unsigned char *stage0 = reinterpret_cast<unsigned char *>(dSt + BN * LP);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int bg = (int)(blockIdx.x % (unsigned)(p.B * p.nkv));
  const int kb = (int)(blockIdx.x / (unsigned)(p.B * p.nkv));
  const int b = bg / p.nkv, kvh = bg % p.nkv, j0 = kb * BN;
  const int64_t ldq = (int64_t)p.nh * p.hd, ldk = (int64_t)p.nkv * p.hd;
  const float sl2 = p.scale * LOG2E;

  /* queries that see a key of this tile (query_tiles); the block visits the
   * query tiles qb0 .. qb0 + nq − 1 of each of the group's heads h0 .. h0 +
   * ng − 1: iteration n = head · nq + tile */
  int qb0, nq, h0, ng;
  query_tiles(p, j0, BN, BM, qb0, nq);
  group_heads(p, kvh, h0, ng);
  const int nit = ng * nq;
  /* stage u: Qs, dOs [BM][LD] bf16, then lse (natural log), D [BM] fp32 */
  auto Qs_of = [&](int u) { return reinterpret_cast<bf16 *>(stage0 + C::kv_stage * u); };
  auto lse_of = [&](int u) { return reinterpret_cast<float *>(Qs_of(u) + 2 * BM * LD); };
  /* iteration n's query tile into stage u; rows past sq zero */
  auto stage_q = [&](int n, int u) {
    const int h = h0 + n / nq, i0 = (qb0 + n % nq) * BM;
    const int64_t qoff = q_at(p, p.qs_bs, b, i0, h);
    stage_async<BM, HP, C::NT>(Qs_of(u), p.qh + qoff, ldq, p.sq - i0, p.hd);
    stage_async<BM, HP, C::NT>(Qs_of(u) + BM * LD, p.douth + qoff, ldq, p.sq - i0, p.hd);
    for (int r = threadIdx.x; r < BM; r += C::NT) {
      const bool in = i0 + r < p.sq;
      const int i = in ? i0 + r : i0;
      cp_async4(lse_of(u) + r, p.lse_in + lse_at(p, b, i, h), in);
      cp_async4(lse_of(u) + BM + r, p.D + d_at(p, b, i, h), in);
    }
  };

  const int64_t koff = k_at(p, p.ks_bs, b, j0, kvh);
  stage_async<BN, HP, C::NT>(Ks, p.kh + koff, ldk, p.sk - j0, p.hd);
  stage_async<BN, HP, C::NT>(Vs, p.vh + koff, ldk, p.sk - j0, p.hd);
  if (C::KV_STAGES == 2 && nit > 0) stage_q(0, 0);
  cp_async_commit();

  const int kr = 16 * RT * (warp & 3); /* phase 1 and 2: this warp's 16·RT key rows */
  const int qc = 32 * (warp >> 2);      /* phase 1: its 32 query columns */
  const int dc = DW * (warp >> 2);      /* phase 2: its DW head columns */
  float dk[RT][DW / 8][4] = {}, dv[RT][DW / 8][4] = {};

  for (int n = 0; n < nit; n++) {
    const int i0 = (qb0 + n % nq) * BM, u = C::KV_STAGES == 2 ? n & 1 : 0;
    __syncthreads(); /* iteration n − 1's phase 2 no longer reads Pt, dSt and its stage */
    if (C::KV_STAGES == 1) {
      stage_q(n, 0);
      cp_async_commit();
      cp_async_wait<0>();
    } else if (n + 1 < nit) {
      stage_q(n + 1, u ^ 1);
      cp_async_commit();
      cp_async_wait<1>(); /* all but iteration n + 1's copies have landed */
    } else {
      cp_async_wait<0>();
    }
    __syncthreads(); /* Ks, Vs (first pass) and iteration n's stage, for every thread */
    const bf16 *Qs = Qs_of(u), *dOs = Qs + BM * LD;
    const float *lse_s = lse_of(u), *D_s = lse_s + BM;

    /* phase 1: S^T = K·Q^T and dP^T = V·dO^T, 16·RT keys × 32 queries */
    float st[RT][4][4] = {}, dpt[RT][4][4] = {};
    products_32<HP, LD, RT>(Ks, Vs, Qs, dOs, kr, qc, lane, st, dpt);
    /* P = exp(scaled score − lse), 0 where masked or past S; dS = P ⊙ (dP − D).
     * Element (e) of n-tile nt of m-tile mt: key row kr + 16·mt + g + 8·(e/2),
     * query qc + 8·nt + 2t + e%2. */
    const bool masked = tile_masked(p, i0, BM, j0, BN);
#pragma unroll
    for (int mt = 0; mt < RT; mt++)
#pragma unroll
      for (int nt = 0; nt < 4; nt++)
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
          float pv[2], ds[2];
          const int jr = kr + 16 * mt + g + 8 * hf;
          int lo, hi;
          key_queries(p, j0 + jr, lo, hi);
#pragma unroll
          for (int e = 0; e < 2; e++) {
            const int ic = qc + 8 * nt + 2 * t + e;
            /* lse in log2 units, as the scores (__fmul_rn: never fused) */
            const float x = st[mt][nt][2 * hf + e] * sl2 - __fmul_rn(lse_s[ic], LOG2E);
            const bool off = masked && (i0 + ic < lo || i0 + ic > hi);
            pv[e] = off ? 0.f : exp2f(x);
            ds[e] = pv[e] * (dpt[mt][nt][2 * hf + e] - D_s[ic]);
          }
          const int at = jr * LP + qc + 8 * nt + 2 * t;
          *reinterpret_cast<uint32_t *>(Pt + at) = pack_bf16(pv[0], pv[1]);
          *reinterpret_cast<uint32_t *>(dSt + at) = pack_bf16(ds[0], ds[1]);
        }
    __syncthreads(); /* Pt, dSt complete */

    /* phase 2: dV += P^T·dO, dK += dS^T·Q over the tile's 64 queries */
#pragma unroll
    for (int kk = 0; kk < BM / 16; kk++) {
      uint32_t ap[RT][4], as[RT][4];
#pragma unroll
      for (int mt = 0; mt < RT; mt++) {
        ldsm_x4(ap[mt], frag_a(Pt, LP, kr + 16 * mt, 16 * kk, lane));
        ldsm_x4(as[mt], frag_a(dSt, LP, kr + 16 * mt, 16 * kk, lane));
      }
#pragma unroll
      for (int dp = 0; dp < DW / 16; dp++) {
        uint32_t bo[4], bq[4];
        ldsm_x4_t(bo, frag_bt(dOs, LD, 16 * kk, dc + 16 * dp, lane));
        ldsm_x4_t(bq, frag_bt(Qs, LD, 16 * kk, dc + 16 * dp, lane));
#pragma unroll
        for (int mt = 0; mt < RT; mt++) {
          mma_bf16(dv[mt][2 * dp], ap[mt], bo[0], bo[1]);
          mma_bf16(dv[mt][2 * dp + 1], ap[mt], bo[2], bo[3]);
          mma_bf16(dk[mt][2 * dp], as[mt], bq[0], bq[1]);
          mma_bf16(dk[mt][2 * dp + 1], as[mt], bq[2], bq[3]);
        }
      }
    }
  }

  if (nit == 0) cp_async_wait<0>(); /* no query sees the tile: Ks, Vs's copies retire */
  /* rows kr + 16·mt + g (+8) of the tile, columns dc + 8·dt + 2t (+1) */
#pragma unroll
  for (int mt = 0; mt < RT; mt++)
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
      const int j = j0 + kr + 16 * mt + g + 8 * hf;
      if (j >= p.sk) continue;
      const int64_t off = k_at(p, p.k_bs, b, j, kvh);
#pragma unroll
      for (int dt = 0; dt < DW / 8; dt++) {
        const int c = dc + 8 * dt + 2 * t;
        if (c >= p.hd) continue;
        put2(p.dk + off + c, p.scale * dk[mt][dt][2 * hf], p.scale * dk[mt][dt][2 * hf + 1], p.acc);
        put2(p.dv + off + c, dv[mt][dt][2 * hf], dv[mt][dt][2 * hf + 1], p.acc);
      }
    }
}

/* dq of one query tile of one head: per key tile, phase 1 recomputes S =
 * Q·K^T, dP = dO·V^T and writes dS (bf16) to shared memory; phase 2 adds
 * dS·K with K as the B operand through ldmatrix.trans. */
template <int HP>
__global__ void __launch_bounds__(BwdBf16<HP>::NT, BwdBf16<HP>::MINB) dq_bf16(Params p) {
  using C = BwdBf16<HP>;
  /* BM queries of the block, BN keys per streamed tile */
  constexpr int RT = C::RT, BM = C::BR, BN = C::BC, LD = C::LD, LP = C::LP, DW = C::DW;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16 *Qs = reinterpret_cast<bf16 *>(smem), *dOs = Qs + BM * LD, *dSs = dOs + BM * LD;
  bf16 *KV = dSs + BM * LP; /* stage u: Ks, Vs [BN][LD] at KV + 2·BN·LD·u */
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const QTile qt = qtile_of(p, BM);
  const int i0 = qt.qb * BM, kvh = kv_of(p, qt.h);
  const int64_t ldq = (int64_t)p.nh * p.hd, ldk = (int64_t)p.nkv * p.hd;
  const float sl2 = p.scale * LOG2E;

  /* key/value tile kb into stage u */
  auto stage_kv = [&](int kb, int u) {
    const int j0 = kb * BN;
    const int64_t koff = k_at(p, p.ks_bs, qt.b, j0, kvh);
    stage_async<BN, HP, C::NT>(KV + 2 * BN * LD * u, p.kh + koff, ldk, p.sk - j0, p.hd);
    stage_async<BN, HP, C::NT>(KV + 2 * BN * LD * u + BN * LD, p.vh + koff, ldk, p.sk - j0, p.hd);
  };
  const int64_t qoff = q_at(p, p.qs_bs, qt.b, i0, qt.h);
  stage_async<BM, HP, C::NT>(Qs, p.qh + qoff, ldq, p.sq - i0, p.hd);
  stage_async<BM, HP, C::NT>(dOs, p.douth + qoff, ldq, p.sq - i0, p.hd);

  const int qr = 16 * RT * (warp & 3); /* phase 1 and 2: this warp's 16·RT query rows */
  const int kc = 32 * (warp >> 2);      /* phase 1: its 32 key columns */
  const int dc = DW * (warp >> 2);      /* phase 2: its DW head columns */
  /* lse (log2 units) and D of rows qr + 16·mt + g (+8); rows past sq: 0 (never stored) */
  float lse_r[RT][2], D_r[RT][2];
#pragma unroll
  for (int mt = 0; mt < RT; mt++)
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
      const int i = i0 + qr + 16 * mt + g + 8 * hf;
      lse_r[mt][hf] = i < p.sq ? p.lse_in[lse_at(p, qt.b, i, qt.h)] * LOG2E : 0.f;
      D_r[mt][hf] = i < p.sq ? p.D[d_at(p, qt.b, i, qt.h)] : 0.f;
    }
  int kb0, kb1;
  key_tiles(p, i0, BM, BN, kb0, kb1);
  if (C::Q_STAGES == 2 && kb0 <= kb1) stage_kv(kb0, 0);
  cp_async_commit();
  float dq[RT][DW / 8][4] = {};

  for (int kb = kb0; kb <= kb1; kb++) {
    const int j0 = kb * BN, u = C::Q_STAGES == 2 ? (kb - kb0) & 1 : 0;
    __syncthreads(); /* tile kb − 1's phase 2 no longer reads dSs and its stage */
    if (C::Q_STAGES == 1) {
      stage_kv(kb, 0);
      cp_async_commit();
      cp_async_wait<0>();
    } else if (kb < kb1) {
      stage_kv(kb + 1, u ^ 1);
      cp_async_commit();
      cp_async_wait<1>(); /* all but tile kb + 1's copies have landed */
    } else {
      cp_async_wait<0>();
    }
    __syncthreads(); /* Qs, dOs (first pass) and tile kb staged, for every thread */
    const bf16 *Ks = KV + 2 * BN * LD * u, *Vs = Ks + BN * LD;

    /* phase 1: S = Q·K^T, dP = dO·V^T, 16·RT queries × 32 keys */
    float s[RT][4][4] = {}, dp[RT][4][4] = {};
    products_32<HP, LD, RT>(Qs, dOs, Ks, Vs, qr, kc, lane, s, dp);
    /* dS = P ⊙ (dP − D), P = exp(scaled score − lse), 0 where masked */
    const bool masked = tile_masked(p, i0, BM, j0, BN);
#pragma unroll
    for (int mt = 0; mt < RT; mt++)
#pragma unroll
      for (int nt = 0; nt < 4; nt++)
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
          float ds[2];
          const int ir = qr + 16 * mt + g + 8 * hf;
          int lo, hi;
          row_keys(p, i0 + ir, lo, hi);
#pragma unroll
          for (int e = 0; e < 2; e++) {
            const int j = j0 + kc + 8 * nt + 2 * t + e;
            const float x = s[mt][nt][2 * hf + e] * sl2 - lse_r[mt][hf];
            const float pv = masked && (j < lo || j > hi) ? 0.f : exp2f(x);
            ds[e] = pv * (dp[mt][nt][2 * hf + e] - D_r[mt][hf]);
          }
          *reinterpret_cast<uint32_t *>(dSs + ir * LP + kc + 8 * nt + 2 * t) =
              pack_bf16(ds[0], ds[1]);
        }
    __syncthreads(); /* dSs complete */

    /* phase 2: dQ += dS·K over the tile's 64 keys */
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) {
      uint32_t as[RT][4];
#pragma unroll
      for (int mt = 0; mt < RT; mt++) ldsm_x4(as[mt], frag_a(dSs, LP, qr + 16 * mt, 16 * kk, lane));
#pragma unroll
      for (int dq2 = 0; dq2 < DW / 16; dq2++) {
        uint32_t bk[4];
        ldsm_x4_t(bk, frag_bt(Ks, LD, 16 * kk, dc + 16 * dq2, lane));
#pragma unroll
        for (int mt = 0; mt < RT; mt++) {
          mma_bf16(dq[mt][2 * dq2], as[mt], bk[0], bk[1]);
          mma_bf16(dq[mt][2 * dq2 + 1], as[mt], bk[2], bk[3]);
        }
      }
    }
  }

  if (kb0 > kb1) cp_async_wait<0>(); /* no key tile: Qs, dOs's copies retire */
#pragma unroll
  for (int mt = 0; mt < RT; mt++)
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
      const int i = i0 + qr + 16 * mt + g + 8 * hf;
      if (i >= p.sq) continue;
      float *dst = p.dq + q_at(p, p.q_bs, qt.b, i, qt.h);
#pragma unroll
      for (int dt = 0; dt < DW / 8; dt++) {
        const int c = dc + 8 * dt + 2 * t;
        if (c < p.hd)
          put2(dst + c, p.scale * dq[mt][dt][2 * hf], p.scale * dq[mt][dt][2 * hf + 1], p.acc);
      }
    }
}

/* ==== fp32 kernels (parity mode) ==========================================
 * 128 threads, 32 × 32 tiles, plain FMA. Thread (r, c4) = (tid / 4, tid % 4)
 * owns tile row r: its 8 scores are columns c4 + 4u (u < 8) and its head
 * columns c4 + 4u (u < HP/4), so the 4 threads of a row are adjacent lanes
 * (row reductions: shuffles xor 1, 2) and a row's probabilities, written to
 * shared memory by those 4 lanes and read back by them, need only
 * __syncwarp. Every dot product runs over d = 0..hd−1 in order. */
template <int HP>
struct F32 {
  static constexpr int NT = 128, BM = 32, BN = 32, LD = HP + 1, LP = 33;
  /* forward: Qs, Ks, Vs [32][LD]; P [32][LP] */
  static constexpr size_t smem_fwd = (size_t)(BM + 2 * BN) * LD * 4 + BM * LP * 4;
  /* dq: Qs, dOs, Ks, Vs; dS */
  static constexpr size_t smem_q = (size_t)(2 * BM + 2 * BN) * LD * 4 + BM * LP * 4;
  /* dk/dv: Ks, Vs, Qs, dOs; P^T, dS^T; lse, D */
  static constexpr size_t smem_kv =
      (size_t)(2 * BN + 2 * BM) * LD * 4 + 2 * BN * LP * 4 + 2 * BM * 4;
};

/* The fp32 backward's scores and dP of one thread: x1[u] = A1[a]·B1[b0 + 4u]
 * and x2[u] = A2[a]·B2[b0 + 4u] (u < 8), dot products of rows of fp32 tiles
 * [rows][LD] over d = 0..hd−1 in order. */
template <int LD>
__device__ __forceinline__ void dots8(const float *A1, const float *A2, const float *B1,
                                      const float *B2, int a, int b0, int hd, float (&x1)[8],
                                      float (&x2)[8]) {
  for (int d = 0; d < hd; d++) {
    const float v1 = A1[a * LD + d], v2 = A2[a * LD + d];
#pragma unroll
    for (int u = 0; u < 8; u++) {
      x1[u] = fmaf(v1, B1[(b0 + 4 * u) * LD + d], x1[u]);
      x2[u] = fmaf(v2, B2[(b0 + 4 * u) * LD + d], x2[u]);
    }
  }
}

template <int HP>
__global__ void __launch_bounds__(F32<HP>::NT) fwd_f32(Params p) {
  using C = F32<HP>;
  constexpr int BM = C::BM, BN = C::BN, LD = C::LD, LP = C::LP;
  extern __shared__ __align__(16) unsigned char smem[];
  float *Qs = reinterpret_cast<float *>(smem), *Ks = Qs + BM * LD, *Vs = Ks + BN * LD;
  float *Ps = Vs + BN * LD;
  const int r = threadIdx.x >> 2, c4 = threadIdx.x & 3;
  const QTile qt = qtile_of(p, BM);
  const int i0 = qt.qb * BM, i = i0 + r, kvh = kv_of(p, qt.h);
  const int64_t ldq = (int64_t)p.nh * p.hd, ldk = (int64_t)p.nkv * p.hd;

  stage_f32<BM, HP, C::NT>(Qs, p.q + q_at(p, p.qs_bs, qt.b, i0, qt.h), ldq, p.sq - i0, p.hd);
  int kb0, kb1;
  key_tiles(p, i0, BM, BN, kb0, kb1);
  float o[HP / 4] = {};
  float m = -INFINITY, l = 0.f; /* running max; this thread's share of the row sum */

  for (int kb = kb0; kb <= kb1; kb++) {
    const int j0 = kb * BN;
    __syncthreads(); /* the previous tile's Ks, Vs, Ps are no longer read */
    const int64_t koff = k_at(p, p.ks_bs, qt.b, j0, kvh);
    stage_f32<BN, HP, C::NT>(Ks, p.k + koff, ldk, p.sk - j0, p.hd);
    stage_f32<BN, HP, C::NT>(Vs, p.v + koff, ldk, p.sk - j0, p.hd);
    __syncthreads();

    float s[8] = {};
    for (int d = 0; d < p.hd; d++) {
      const float qv = Qs[r * LD + d];
#pragma unroll
      for (int u = 0; u < 8; u++) s[u] = fmaf(qv, Ks[(c4 + 4 * u) * LD + d], s[u]);
    }
    float mx = -INFINITY;
#pragma unroll
    for (int u = 0; u < 8; u++) {
      s[u] = visible(p, i, j0 + c4 + 4 * u) ? s[u] * p.scale : -INFINITY;
      mx = fmaxf(mx, s[u]);
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float mnew = fmaxf(m, mx);
    const float base = mnew == -INFINITY ? 0.f : mnew; /* as in fwd_bf16 */
    const float alpha = expf(m - base);
    m = mnew;
    float rs = 0.f;
#pragma unroll
    for (int u = 0; u < 8; u++) {
      const float pv = expf(s[u] - base);
      rs += pv;
      Ps[r * LP + c4 + 4 * u] = pv;
    }
    l = l * alpha + rs;
    __syncwarp(); /* row r's probabilities: written and read by its 4 lanes */
#pragma unroll
    for (int u = 0; u < HP / 4; u++) o[u] *= alpha;
    for (int j = 0; j < BN; j++) {
      const float pj = Ps[r * LP + j];
#pragma unroll
      for (int u = 0; u < HP / 4; u++) o[u] = fmaf(pj, Vs[j * LD + c4 + 4 * u], o[u]);
    }
  }

  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  /* accumulating: lane c4 = 0 reads the row's lse, before it writes it */
  const bool in = i < p.sq;
  float *lse = p.lse + lse_at(p, qt.b, in ? i : 0, qt.h), wa, f, lnew;
  float la = p.acc && in && c4 == 0 ? *lse : -INFINITY;
  la = __shfl_sync(0xffffffffu, la, threadIdx.x & 28);
  if (!in || !row_result(p, l, m + logf(l), la, wa, f, lnew)) return; /* no barrier follows */
  float *dst = p.o + q_at(p, p.q_bs, qt.b, i, qt.h);
#pragma unroll
  for (int u = 0; u < HP / 4; u++)
    if (c4 + 4 * u < p.hd) {
      const float x = o[u] * f;
      dst[c4 + 4 * u] = wa != 0.f ? wa * dst[c4 + 4 * u] + x : x;
    }
  if (c4 == 0) *lse = lnew;
}

template <int HP>
__global__ void __launch_bounds__(F32<HP>::NT) dq_f32(Params p) {
  using C = F32<HP>;
  constexpr int BM = C::BM, BN = C::BN, LD = C::LD, LP = C::LP;
  extern __shared__ __align__(16) unsigned char smem[];
  float *Qs = reinterpret_cast<float *>(smem), *dOs = Qs + BM * LD, *Ks = dOs + BM * LD;
  float *Vs = Ks + BN * LD, *dSs = Vs + BN * LD;
  const int r = threadIdx.x >> 2, c4 = threadIdx.x & 3;
  const QTile qt = qtile_of(p, BM);
  const int i0 = qt.qb * BM, i = i0 + r, kvh = kv_of(p, qt.h);
  const int64_t ldq = (int64_t)p.nh * p.hd, ldk = (int64_t)p.nkv * p.hd;

  const int64_t qoff = q_at(p, p.qs_bs, qt.b, i0, qt.h);
  stage_f32<BM, HP, C::NT>(Qs, p.q + qoff, ldq, p.sq - i0, p.hd);
  stage_f32<BM, HP, C::NT>(dOs, p.dout + qoff, ldq, p.sq - i0, p.hd);
  const float lse_i = i < p.sq ? p.lse_in[lse_at(p, qt.b, i, qt.h)] : 0.f;
  const float D_i = i < p.sq ? p.D[d_at(p, qt.b, i, qt.h)] : 0.f;
  int kb0, kb1;
  key_tiles(p, i0, BM, BN, kb0, kb1);
  float acc[HP / 4] = {};

  for (int kb = kb0; kb <= kb1; kb++) {
    const int j0 = kb * BN;
    __syncthreads(); /* the previous tile's Ks, dSs are no longer read */
    const int64_t koff = k_at(p, p.ks_bs, qt.b, j0, kvh);
    stage_f32<BN, HP, C::NT>(Ks, p.k + koff, ldk, p.sk - j0, p.hd);
    stage_f32<BN, HP, C::NT>(Vs, p.v + koff, ldk, p.sk - j0, p.hd);
    __syncthreads();

    float s[8] = {}, dp[8] = {};
    dots8<LD>(Qs, dOs, Ks, Vs, r, c4, p.hd, s, dp);
#pragma unroll
    for (int u = 0; u < 8; u++) {
      const float pv = visible(p, i, j0 + c4 + 4 * u) ? expf(s[u] * p.scale - lse_i) : 0.f;
      dSs[r * LP + c4 + 4 * u] = pv * (dp[u] - D_i);
    }
    __syncwarp(); /* row r's dS: written and read by its 4 lanes */
    for (int j = 0; j < BN; j++) {
      const float dsj = dSs[r * LP + j];
#pragma unroll
      for (int u = 0; u < HP / 4; u++) acc[u] = fmaf(dsj, Ks[j * LD + c4 + 4 * u], acc[u]);
    }
  }

  if (i >= p.sq) return; /* no barrier follows */
  float *dst = p.dq + q_at(p, p.q_bs, qt.b, i, qt.h);
#pragma unroll
  for (int u = 0; u < HP / 4; u++)
    if (c4 + 4 * u < p.hd) put1(dst + c4 + 4 * u, p.scale * acc[u], p.acc);
}

/* dk, dv of one key tile of one kv head; thread (c, q4) = (tid / 4, tid % 4)
 * owns key row c: its scores are queries q4 + 4u, its columns q4 + 4u. */
template <int HP>
__global__ void __launch_bounds__(F32<HP>::NT) dkdv_f32(Params p) {
  using C = F32<HP>;
  constexpr int BM = C::BM, BN = C::BN, LD = C::LD, LP = C::LP;
  extern __shared__ __align__(16) unsigned char smem[];
  float *Ks = reinterpret_cast<float *>(smem), *Vs = Ks + BN * LD, *Qs = Vs + BN * LD;
  float *dOs = Qs + BM * LD, *Pt = dOs + BM * LD, *dSt = Pt + BN * LP;
  float *lse_s = dSt + BN * LP, *D_s = lse_s + BM;
  const int c = threadIdx.x >> 2, q4 = threadIdx.x & 3;
  const int bg = (int)(blockIdx.x % (unsigned)(p.B * p.nkv));
  const int kb = (int)(blockIdx.x / (unsigned)(p.B * p.nkv));
  const int b = bg / p.nkv, kvh = bg % p.nkv, j0 = kb * BN, j = j0 + c;
  const int64_t ldq = (int64_t)p.nh * p.hd, ldk = (int64_t)p.nkv * p.hd;

  const int64_t koff = k_at(p, p.ks_bs, b, j0, kvh);
  stage_f32<BN, HP, C::NT>(Ks, p.k + koff, ldk, p.sk - j0, p.hd);
  stage_f32<BN, HP, C::NT>(Vs, p.v + koff, ldk, p.sk - j0, p.hd);
  int qb0, nq, h0, ng; /* as dkdv_bf16 */
  query_tiles(p, j0, BN, BM, qb0, nq);
  group_heads(p, kvh, h0, ng);
  float ak[HP / 4] = {}, av[HP / 4] = {};

  for (int h = h0; h < h0 + ng; h++) {
    for (int qb = qb0; qb < qb0 + nq; qb++) {
      const int i0 = qb * BM;
      __syncthreads(); /* the previous tile's Qs, dOs, Pt, dSt are no longer read */
      const int64_t qoff = q_at(p, p.qs_bs, b, i0, h);
      stage_f32<BM, HP, C::NT>(Qs, p.q + qoff, ldq, p.sq - i0, p.hd);
      stage_f32<BM, HP, C::NT>(dOs, p.dout + qoff, ldq, p.sq - i0, p.hd);
      for (int x = threadIdx.x; x < BM; x += C::NT) {
        const bool in = i0 + x < p.sq;
        lse_s[x] = in ? p.lse_in[lse_at(p, b, i0 + x, h)] : 0.f;
        D_s[x] = in ? p.D[d_at(p, b, i0 + x, h)] : 0.f;
      }
      __syncthreads();

      float s[8] = {}, dp[8] = {};
      dots8<LD>(Ks, Vs, Qs, dOs, c, q4, p.hd, s, dp);
#pragma unroll
      for (int u = 0; u < 8; u++) {
        const int ic = q4 + 4 * u, i = i0 + ic;
        const bool on = visible(p, i, j);
        const float pv = on ? expf(s[u] * p.scale - lse_s[ic]) : 0.f;
        Pt[c * LP + ic] = pv;
        dSt[c * LP + ic] = pv * (dp[u] - D_s[ic]);
      }
      __syncwarp(); /* key row c's P^T, dS^T: written and read by its 4 lanes */
      for (int x = 0; x < BM; x++) {
        const float px = Pt[c * LP + x], dsx = dSt[c * LP + x];
#pragma unroll
        for (int u = 0; u < HP / 4; u++) {
          av[u] = fmaf(px, dOs[x * LD + q4 + 4 * u], av[u]);
          ak[u] = fmaf(dsx, Qs[x * LD + q4 + 4 * u], ak[u]);
        }
      }
    }
  }

  if (j >= p.sk) return; /* no barrier follows */
  const int64_t off = k_at(p, p.k_bs, b, j, kvh);
#pragma unroll
  for (int u = 0; u < HP / 4; u++)
    if (q4 + 4 * u < p.hd) {
      put1(p.dk + off + q4 + 4 * u, p.scale * ak[u], p.acc);
      put1(p.dv + off + q4 + 4 * u, av[u], p.acc);
    }
}

/* ==== D = rowsum(dout ⊙ out) =============================================
 * One warp per (sequence, query row, head): lane sums d = lane, lane + 32,
 * .. in fp64, then a fixed butterfly. In bf16 mode dout enters rounded, as
 * it enters dP = dout·v^T (so D = rowsum(P ⊙ dP) up to P's rounding in out);
 * a bf16 out (p.o_bf16) is widened exactly. */
constexpr int ROWDOT_NT = 256;

__global__ void __launch_bounds__(ROWDOT_NT) rowdot(Params p, const float *__restrict__ out,
                                                    float *__restrict__ D, bool round) {
  const int lane = threadIdx.x & 31;
  const int64_t rows = (int64_t)p.B * p.sq * p.nh, warps = (int64_t)gridDim.x * (ROWDOT_NT / 32);
  for (int64_t row = (int64_t)blockIdx.x * (ROWDOT_NT / 32) + (threadIdx.x >> 5); row < rows;
       row += warps) {
    /* row = (b·sq + i)·nh + h; all lanes share `row`: no divergence */
    const int h = (int)(row % p.nh), i = (int)(row / p.nh % p.sq), b = (int)(row / p.nh / p.sq);
    const int64_t off = q_at(p, p.q_bs, b, i, h);
    double acc = 0.0;
    for (int d = lane; d < p.hd; d += 32) {
      float x = p.dout[off + d];
      if (round) x = __bfloat162float(__float2bfloat16_rn(x));
      const float o = p.o_bf16 ? __bfloat162float(reinterpret_cast<const bf16 *>(out)[off + d])
                               : out[off + d];
      acc += (double)x * o;
    }
    for (int w = 16; w > 0; w >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, w);
    if (lane == 0) D[d_at(p, b, i, h)] = (float)acc;
  }
}

/* ==== gathering a block's rows ===========================================
 * dst [B][rows, width] (compact) from rows of B sequences: row r of
 * sequence b at src + b·bs + r·width elements, or with a block table (paged
 * keys, kc_attn_block.kv_table) pool row table[b·tbs + r / blk]·blk + r %
 * blk. Elements fp32 or bf16 either side: rounded to nearest-even, widened
 * exactly or copied. */
__global__ void __launch_bounds__(KC_THREADS) gather_rows(void *__restrict__ dst, bool dst_bf16,
                                                         const void *__restrict__ src,
                                                         bool src_bf16, int B, int rows, int width,
                                                         int64_t bs,
                                                         const int32_t *__restrict__ table,
                                                         int64_t tbs, int blk) {
  const int64_t n = (int64_t)B * rows * width;
  for (int64_t e = kc_gtid(); e < n; e += kc_gstride()) {
    const int64_t t = e / width, w = e % width;
    const int r = (int)(t % rows), b = (int)(t / rows);
    const int64_t at = table ? ((int64_t)table[b * tbs + r / blk] * blk + r % blk) * width + w
                             : b * bs + (int64_t)r * width + w;
    if (src_bf16 && dst_bf16) {
      static_cast<uint16_t *>(dst)[e] = static_cast<const uint16_t *>(src)[at];
      continue;
    }
    const float x = src_bf16 ? kc_bf16_to_f32(static_cast<const uint16_t *>(src)[at])
                             : static_cast<const float *>(src)[at];
    if (dst_bf16)
      static_cast<uint16_t *>(dst)[e] = kc_f32_to_bf16(x);
    else
      static_cast<float *>(dst)[e] = x;
  }
}

/* ==== launchers ========================================================== */

/* Launches `kernel` (`name` in an error, common.cuh's kc_launch) on
 * `blocks` 1-D blocks, opting in to its shared memory first when that is
 * above the default 48 KiB. */
template <typename K>
cudaError_t launch(const char *name, K kernel, int64_t blocks, int threads, size_t smem,
                   cudaStream_t st, const Params &p) {
  if (blocks < 1 || blocks > INT32_MAX) return cudaErrorInvalidValue;
  if (smem > 48 * 1024) {
    cudaError_t e =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) {
      kc_failed = name;
      return e;
    }
  }
  return kc_launch(name, kernel, (unsigned)blocks, threads, smem, st, p);
}

bool aligned16(const void *x) { return ((uintptr_t)x & 15) == 0; }

constexpr int64_t LIM = 1 << 30; /* rows, positions and windows fit an int with room */

/* Checks a block's geometry and fills the fields both directions share:
 * group 0 is nh / nkv (nh a multiple of nkv); query head h reads kv head
 * (h + off) / group, which must exist; a window <= 0 or of LIM or more
 * masks nothing and becomes 0. The strides are the caller's. */
cudaError_t setup(Params &p, const kc_attn_block &k) {
  const int64_t group = k.group ? k.group : k.nkv > 0 && k.nh % k.nkv == 0 ? k.nh / k.nkv : 0;
  if (k.B < 1 || k.sq < 1 || k.sk < 0 || k.sq >= LIM || k.sk >= LIM || k.nkv < 1 || k.nh < 1 ||
      group < 1 || k.head_off < 0 || k.head_off >= group ||
      (k.nh - 1 + k.head_off) / group >= k.nkv || k.hd < 8 || k.hd > 256 || k.hd % 8 ||
      k.B > INT32_MAX || k.nh > INT32_MAX || k.q_pos <= -LIM || k.q_pos >= LIM ||
      k.k_pos <= -LIM || k.k_pos >= LIM)
    return cudaErrorInvalidValue;
  const int64_t qrow = k.nh * k.hd, krow = k.nkv * k.hd;
  if (k.B > 1 && (k.q_bs < k.sq * qrow || (!k.kv_table && k.k_bs < k.sk * krow) ||
                  k.l_bs < k.sq * k.nh))
    return cudaErrorInvalidValue;
  if (k.kv_table && (k.kv_block < 1 || k.kv_block >= LIM ||
                     k.table_bs < (k.sk + k.kv_block - 1) / k.kv_block))
    return cudaErrorInvalidValue;
  p.B = (int)k.B;
  p.sq = (int)k.sq;
  p.sk = (int)k.sk;
  p.nh = (int)k.nh;
  p.nkv = (int)k.nkv;
  p.group = (int)group;
  p.off = (int)k.head_off;
  p.hd = (int)k.hd;
  p.dpos = (int)(k.q_pos - k.k_pos);
  p.win = k.window > 0 && k.window < LIM ? (int)k.window : 0;
  p.scale = k.scale;
  p.o_bf16 = k.out_bf16;
  p.q_bs = p.qs_bs = k.q_bs;
  p.k_bs = p.ks_bs = k.k_bs;
  p.l_bs = k.l_bs;
  p.l_rs = k.nh;
  p.l_hs = 1;
  return cudaSuccess;
}

/* The whole-sequence call as one block: lse [B, nh, S]. */
cudaError_t setup_whole(Params &p, int64_t B, int64_t S, int64_t nh, int64_t nkv, int64_t hd,
                        float scale, int64_t window) {
  if (nkv < 1 || nh % nkv) return cudaErrorInvalidValue;
  kc_attn_block k = {};
  k.B = B, k.sq = k.sk = S, k.nh = nh, k.nkv = nkv, k.hd = hd, k.scale = scale;
  k.window = window >= S ? 0 : window;
  k.q_bs = S * nh * hd, k.k_bs = S * nkv * hd, k.l_bs = S * nh;
  cudaError_t e = setup(p, k);
  if (e != cudaSuccess) return e;
  p.l_bs = nh * S;
  p.l_rs = 1;
  p.l_hs = S;
  return cudaSuccess;
}

/* Padded head width: the smallest instantiated width >= hd. */
int padded(int hd) { return hd <= 32 ? 32 : hd <= 64 ? 64 : hd <= 128 ? 128 : 256; }

int64_t tiles(int64_t S, int T) { return (S + T - 1) / T; }

template <int HP>
cudaError_t fwd_launch(cudaStream_t st, const Params &p, bool bf) {
  const int64_t heads = (int64_t)p.B * p.nh;
  if (bf)
    return launch("fwd_bf16", fwd_bf16<HP>, tiles(p.sq, FwdBf16<HP>::BM) * heads,
                  FwdBf16<HP>::NT, FwdBf16<HP>::smem, st, p);
  return launch("fwd_f32", fwd_f32<HP>, tiles(p.sq, F32<HP>::BM) * heads, F32<HP>::NT,
                F32<HP>::smem_fwd, st, p);
}

/* dk/dv then dq (both read D; neither writes what the other reads). */
template <int HP>
cudaError_t bwd_launch(cudaStream_t st, const Params &p, bool bf) {
  const int64_t heads = (int64_t)p.B * p.nh, kv_heads = (int64_t)p.B * p.nkv;
  cudaError_t e;
  if (bf) {
    using C = BwdBf16<HP>;
    e = launch("dkdv_bf16", dkdv_bf16<HP>, tiles(p.sk, C::BR) * kv_heads, C::NT, C::smem_kv, st,
               p);
    if (e != cudaSuccess) return e;
    return launch("dq_bf16", dq_bf16<HP>, tiles(p.sq, C::BR) * heads, C::NT, C::smem_q, st, p);
  }
  using C = F32<HP>;
  e = launch("dkdv_f32", dkdv_f32<HP>, tiles(p.sk, C::BN) * kv_heads, C::NT, C::smem_kv, st, p);
  if (e != cudaSuccess) return e;
  return launch("dq_f32", dq_f32<HP>, tiles(p.sq, C::BM) * heads, C::NT, C::smem_q, st, p);
}

cudaError_t fwd_run(cudaStream_t st, const Params &p, bool bf) {
  switch (padded(p.hd)) {
    case 32: return fwd_launch<32>(st, p, bf);
    case 64: return fwd_launch<64>(st, p, bf);
    case 128: return fwd_launch<128>(st, p, bf);
    default: return fwd_launch<256>(st, p, bf);
  }
}

cudaError_t bwd_run(cudaStream_t st, const Params &p, bool bf) {
  switch (padded(p.hd)) {
    case 32: return bwd_launch<32>(st, p, bf);
    case 64: return bwd_launch<64>(st, p, bf);
    case 128: return bwd_launch<128>(st, p, bf);
    default: return bwd_launch<256>(st, p, bf);
  }
}

/* Elements of q (and dout) and of k (and v), compact. */
void counts(const Params &p, int64_t &nq, int64_t &nk) {
  nq = (int64_t)p.B * p.sq * p.nh * p.hd;
  nk = (int64_t)p.B * p.sk * p.nkv * p.hd;
}

/* Bytes of the stage: bf16, q, k, v (and dout) in bf16 (qkv: q, k, v
 * bf16 already, read in place: dout alone); fp32 with paged keys, k and v
 * in fp32; else none. SIZE_MAX on overflow. */
size_t stage_bytes(int64_t B, int64_t sq, int64_t sk, int64_t nh, int64_t nkv, int64_t hd,
                   bool bf, bool paged, bool dout, bool qkv) {
  if (B < 0 || sq < 0 || sk < 0 || nh < 0 || nkv < 0 || hd < 0) return SIZE_MAX;
  if (!bf && !paged) return 0;
  size_t q, k, n;
  if (__builtin_mul_overflow((size_t)B, (size_t)hd, &n) ||
      __builtin_mul_overflow(n, (size_t)sq * (size_t)nh, &q) ||
      __builtin_mul_overflow(n, (size_t)sk * (size_t)nkv, &k) ||
      __builtin_mul_overflow(k, (size_t)(qkv  ? 0
                                         : bf ? 2 * sizeof(bf16)
                                              : 2 * sizeof(float)),
                             &k) ||
      __builtin_mul_overflow(q, (size_t)(bf ? (!qkv + dout) * sizeof(bf16) : 0), &q) ||
      __builtin_add_overflow(q, k, &n))
    return SIZE_MAX;
  return n;
}

/* One tensor's rows into the stage at *h (compact; cursor advanced): q or
 * dout (keys false) with the caller's strides, or k, v (keys true) through
 * the block table when paged. */
cudaError_t gather(cudaStream_t st, const kc_attn_block &k, const Params &p, const void *src,
                   bool keys, bool bf, unsigned char *&h, int64_t &bs) {
  const int rows = keys ? p.sk : p.sq, width = (keys ? p.nkv : p.nh) * p.hd;
  const bool paged = keys && k.kv_table;
  const int64_t n = (int64_t)p.B * rows * width;
  bs = (int64_t)rows * width;
  if (n == 0) return cudaSuccess;
  cudaError_t e = KC_LAUNCH(gather_rows, kc_grid(n, KC_THREADS), KC_THREADS, 0, st, (void *)h, bf,
                            src, paged && k.kv_bf16, p.B, rows, width,
                            keys ? k.k_bs : k.q_bs, paged ? k.kv_table : nullptr,
                            k.table_bs, (int)k.kv_block);
  h += n * (bf ? sizeof(bf16) : sizeof(float));
  return e;
}

/* Fills what the tiles read: bf16, q, k, v (and dout) rounded into the
 * stage (whole sequences: one conversion each; blocks: gathered compact),
 * or bf16 q, k, v (kc_attn_block.qkv_bf16) read in place at the caller's
 * strides and dout alone gathered; fp32 with paged keys, k and v gathered
 * there; else the caller's tensors. */
cudaError_t stage_inputs(cudaStream_t st, const kc_attn_block *k, Params &p, bool bf,
                         void *stage) {
  unsigned char *h = static_cast<unsigned char *>(stage);
  if (bf && !k) { /* whole sequences: compact already */
    int64_t nq, nk;
    counts(p, nq, nk);
    const float *src[] = {p.q, p.k, p.v, p.dout};
    const bf16 **dst[] = {&p.qh, &p.kh, &p.vh, &p.douth};
    const int64_t n[] = {nq, nk, nk, nq};
    for (int i = 0; i < (p.dout ? 4 : 3); i++) {
      cudaError_t e = kc_f32_to_bf16(st, src[i], reinterpret_cast<uint16_t *>(h), n[i]);
      if (e != cudaSuccess) return e;
      *dst[i] = reinterpret_cast<const bf16 *>(h);
      h += n[i] * sizeof(bf16);
    }
    return cudaSuccess;
  }
  if (!k || (!bf && !k->kv_table)) return cudaSuccess;
  cudaError_t e;
  const unsigned char *at = h;
  if (bf && k->qkv_bf16) { /* the caller's bf16 q, k, v; strides as given */
    p.qh = reinterpret_cast<const bf16 *>(p.q);
    p.kh = reinterpret_cast<const bf16 *>(p.k);
    p.vh = reinterpret_cast<const bf16 *>(p.v);
  } else if (bf) {
    if ((e = gather(st, *k, p, p.q, false, true, h, p.qs_bs)) != cudaSuccess) return e;
    p.qh = reinterpret_cast<const bf16 *>(at);
  }
  const void *kv[] = {p.k, p.v}; /* paged: the pool */
  for (int i = 0; i < 2 && !(bf && k->qkv_bf16); i++) {
    at = h;
    if ((e = gather(st, *k, p, kv[i], true, bf, h, p.ks_bs)) != cudaSuccess) return e;
    if (bf)
      (i ? p.vh : p.kh) = reinterpret_cast<const bf16 *>(at);
    else
      (i ? p.v : p.k) = reinterpret_cast<const float *>(at);
  }
  if (bf && p.dout) {
    at = h;
    if ((e = gather(st, *k, p, p.dout, false, true, h, p.qs_bs)) != cudaSuccess) return e;
    p.douth = reinterpret_cast<const bf16 *>(at);
  }
  return cudaSuccess;
}

/* The forward on p's geometry (k: the block's, NULL for whole sequences):
 * the operands, their staging, the launch. */
cudaError_t forward(cudaStream_t st, const kc_attn_block *k, Params &p, const float *q,
                    const float *kk, const float *v, float *out, float *lse, bool bf,
                    void *stage) {
  p.q = q;
  p.k = kk;
  p.v = v;
  p.o = out;
  p.lse = lse;
  cudaError_t e = stage_inputs(st, k, p, bf, stage);
  return e != cudaSuccess ? e : fwd_run(st, p, bf);
}

/* The backward on p's geometry: the operands (every tensor 16-byte
 * aligned: the tiles load float4 or 16-byte cp.async), then 1. D, 2. dk/dv
 * and 3. dq. */
cudaError_t backward(cudaStream_t st, const kc_attn_block *k, Params &p, const float *dout,
                     const float *q, const float *kk, const float *v, const float *out,
                     const float *lse, float *dq, float *dk, float *dv, void *work, bool bf,
                     void *stage) {
  const void *ptrs[] = {dout, q, kk, v, out, dq, dk, dv};
  for (const void *x : ptrs)
    if (!aligned16(x)) return cudaErrorInvalidValue;
  if (!lse || !work || (bf && (!stage || !aligned16(stage)))) return cudaErrorInvalidValue;
  p.q = q;
  p.k = kk;
  p.v = v;
  p.dout = dout;
  p.lse_in = lse;
  p.D = static_cast<float *>(work);
  p.dq = dq;
  p.dk = dk;
  p.dv = dv;
  const int64_t rows = (int64_t)p.B * p.sq * p.nh;
  const int64_t blocks = tiles(rows, ROWDOT_NT / 32);
  cudaError_t e = KC_LAUNCH(rowdot, (unsigned)(blocks < (1 << 20) ? blocks : (1 << 20)),
                            ROWDOT_NT, 0, st, p, out, const_cast<float *>(p.D), bf);
  if (e != cudaSuccess) return e;
  if ((e = stage_inputs(st, k, p, bf, stage)) != cudaSuccess) return e;
  return bwd_run(st, p, bf);
}

}  // namespace

extern "C" size_t kc_attention_stage_bytes(int64_t B, int64_t S, int64_t nh, int64_t nkv,
                                           int64_t hd, bool dout) {
  return stage_bytes(B, S, S, nh, nkv, hd, true, false, dout, false);
}

extern "C" cudaError_t kc_attention_fwd(cudaStream_t st, const float *q, const float *k,
                                        const float *v, float *out, float *lse, int64_t B,
                                        int64_t S, int64_t nh, int64_t nkv, int64_t hd,
                                        float scale, int64_t window, bool bf16, void *stage) {
  Params p = {};
  cudaError_t e = setup_whole(p, B, S, nh, nkv, hd, scale, window);
  if (e != cudaSuccess) return e;
  if (!aligned16(q) || !aligned16(k) || !aligned16(v) || !aligned16(out) || !lse ||
      (bf16 && (!stage || !aligned16(stage))))
    return cudaErrorInvalidValue;
  return forward(st, nullptr, p, q, k, v, out, lse, bf16, stage);
}

/* work: D [B, nh, S] fp32. */
extern "C" size_t kc_attention_bwd_work(int64_t B, int64_t S, int64_t nh, int64_t /* nkv */,
                                        int64_t /* hd */) {
  if (B < 0 || S < 0 || nh < 0) return SIZE_MAX;
  size_t n;
  if (__builtin_mul_overflow((size_t)B, (size_t)S, &n) ||
      __builtin_mul_overflow(n, (size_t)nh, &n) || __builtin_mul_overflow(n, sizeof(float), &n))
    return SIZE_MAX;
  return n;
}

extern "C" cudaError_t kc_attention_bwd(cudaStream_t st, const float *dout, const float *q,
                                        const float *k, const float *v, const float *out,
                                        const float *lse, float *dq, float *dk, float *dv,
                                        int64_t B, int64_t S, int64_t nh, int64_t nkv,
                                        int64_t hd, float scale, int64_t window, bool bf16,
                                        void *work, void *stage) {
  Params p = {};
  cudaError_t e = setup_whole(p, B, S, nh, nkv, hd, scale, window);
  return e != cudaSuccess ? e
                          : backward(st, nullptr, p, dout, q, k, v, out, lse, dq, dk, dv, work,
                                     bf16, stage);
}

/* ---- block attention ---------------------------------------------------- */

namespace {
/* bf16 q, k, v (kc_attn_block.qkv_bf16): bf16 products on unpaged keys;
 * more than one sequence: q compact (q_bs = sq·nh·hd: the backward's
 * dout, staged compact, shares its sequence stride, Params.qs_bs), k_bs
 * keeping every key row 16-byte aligned for the tiles' 16-byte copies (hd
 * is a multiple of 8 already) */
bool qkv_ok(const kc_attn_block &k, bool bf16) {
  return !k.qkv_bf16 ||
         (bf16 && !k.kv_table && (k.B == 1 || (k.q_bs == k.sq * k.nh * k.hd && k.k_bs % 8 == 0)));
}
}  // namespace

extern "C" size_t kc_attention_block_stage_bytes(const kc_attn_block *blk, bool bf16, bool dout) {
  return stage_bytes(blk->B, blk->sq, blk->sk, blk->nh, blk->nkv, blk->hd, bf16,
                     blk->kv_table != nullptr, dout, bf16 && blk->qkv_bf16);
}

extern "C" cudaError_t kc_attention_block_fwd(cudaStream_t st, const kc_attn_block *blk,
                                              const float *q, const float *k, const float *v,
                                              float *out, float *lse, bool accumulate, bool bf16,
                                              void *stage) {
  if (blk->B == 0 || blk->sq == 0) return cudaSuccess;
  Params p = {};
  cudaError_t e = setup(p, *blk);
  if (e != cudaSuccess) return e;
  const bool paged = blk->kv_table != nullptr;
  if (!aligned16(q) || !aligned16(out) || !lse || !k || !v ||
      (!paged && (!aligned16(k) || !aligned16(v))) ||
      (((bf16 && !blk->qkv_bf16) || paged) && (!stage || !aligned16(stage))) ||
      (blk->out_bf16 && (accumulate || !bf16)) || /* fwd_bf16 alone writes a bf16 out */
      !qkv_ok(*blk, bf16))
    return cudaErrorInvalidValue;
  p.acc = accumulate;
  return forward(st, blk, p, q, k, v, out, lse, bf16, stage);
}

namespace {
/* A block without queries or keys: nothing to add; written
 * (bwd_overwrite), the other side's rows are 0, one sequence at a time. */
cudaError_t empty_bwd(cudaStream_t st, const kc_attn_block &k, float *dq, float *dk, float *dv) {
  if (!k.bwd_overwrite) return cudaSuccess;
  const size_t q = sizeof(float) * (size_t)(k.sq * k.nh * k.hd),
               kv = sizeof(float) * (size_t)(k.sk * k.nkv * k.hd);
  cudaError_t e = cudaSuccess;
  for (int64_t b = 0; b < k.B && e == cudaSuccess; b++) {
    if (q) e = cudaMemsetAsync(dq + b * k.q_bs, 0, q, st);
    if (kv && e == cudaSuccess) e = cudaMemsetAsync(dk + b * k.k_bs, 0, kv, st);
    if (kv && e == cudaSuccess) e = cudaMemsetAsync(dv + b * k.k_bs, 0, kv, st);
  }
  return e;
}
}  // namespace

/* work: D [B, nh, sq] fp32. */
extern "C" size_t kc_attention_block_work(const kc_attn_block *blk) {
  return kc_attention_bwd_work(blk->B, blk->sq, blk->nh, blk->nkv, blk->hd);
}

extern "C" cudaError_t kc_attention_block_bwd(cudaStream_t st, const kc_attn_block *blk,
                                              const float *dout, const float *q, const float *k,
                                              const float *v, const float *out, const float *lse,
                                              float *dq, float *dk, float *dv, bool bf16,
                                              void *work, void *stage) {
  if (blk->B == 0 || blk->sq == 0 || blk->sk == 0) return empty_bwd(st, *blk, dq, dk, dv);
  Params p = {};
  cudaError_t e = setup(p, *blk);
  if (e != cudaSuccess) return e;
  if (blk->kv_table || (blk->out_bf16 && !bf16) || !qkv_ok(*blk, bf16))
    return cudaErrorInvalidValue; /* the KV cache is forward only; a bf16 out, bf16 only */
  /* Written, the kernels store their accumulators, which start at +0 and
   * only add (never −0), so each element is bitwise 0 + itself; their grids
   * cover every query row and every (kv head, key row), those no product
   * reaches storing 0. */
  p.acc = !blk->bwd_overwrite;
  return backward(st, blk, p, dout, q, k, v, out, lse, dq, dk, dv, work, bf16, stage);
}

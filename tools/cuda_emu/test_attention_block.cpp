// attention.cu's block attention (kc_attention_block_fwd / _bwd: backend.h
// ml_attn_block on the GPU) on the CPU under tools/cuda_emu's emulator
// (AddressSanitizer, UBSan), checked against the whole-sequence kernels
// (kc_attention_fwd / _bwd, which test_attention.cpp checks against exact
// attention) on the same operands, fp32 and bf16:
//  - strided: every sequence one block at a distance from the next, at
//    global positions q_pos = k_pos = 1000, lse in the block layout
//    [B][sq, nh]: out, lse bitwise the whole call's; the backward adds into
//    dq, dk, dv holding random values: bitwise fl(G + the whole call's);
//    the gaps between sequences (NaN) never read nor written;
//  - query split (ring attention's query chunks, generation's prefill of a
//    continuation): each chunk at q_pos against all keys — a row's output,
//    lse and dq are computed over the same key tiles in the same order as
//    in the whole call: equal; dk, dv are the sum over the chunks, each
//    within the whole call's error bound of exact (attn_bound: the partial
//    sums' bounds add up to the whole's, one more addition inside its
//    gamma), so |split − whole| <= bound;
//  - key split at 128 (a multiple of every kernel's key tile): the forward
//    of the later keys first, then the earlier ones merged (accumulate):
//    within bound.out + the merge's own error of the whole's (derived at
//    merge_bound); the backward of each key block given the whole's out and
//    lse: dk, dv of a key come from its block alone over the same query
//    tiles: equal; dq sums the blocks' parts: within bound.dq;
//  - paged keys (generation's KV cache): the last rows' queries against
//    keys read through a shuffled block table of 16-row blocks, the pool in
//    fp32 and (bf16 products) bf16: equal to the whole call's rows;
//  - a GQA head offset (a tp rank whose query heads start inside a kv
//    group): heads 1 .. nh−2 of the whole call as a block with head_off 1:
//    out, lse, dq of those heads equal;
//  - an empty block (a row that sees no key): accumulating leaves out, lse
//    bitwise as they were; not accumulating writes 0 and −inf;
//  - a bf16 out (kc_attn_block.out_bf16, bf16 products: o_proj's input
//    saved in bf16): out bitwise the fp32-out call's rounded to
//    nearest-even, lse bitwise the same; the backward on it bitwise the
//    backward given an fp32 out holding those values (rowdot widens it
//    exactly); a merge or fp32 products with a bf16 out refused;
//  - bf16 q, k, v (kc_attn_block.qkv_bf16, bf16 products: attention's
//    inputs saved in bf16; hd 64 and 72, the two bf16 tile widths): the
//    whole sequences with a bf16 out and, with several sequences, keys
//    strided (k_bs beyond the rows, the gaps NaN) and a query chunk at
//    q_pos against all keys (one sequence) with an fp32 out: out, lse, dq, dk, dv bitwise
//    those of the call on the fp32 q, k, v (the stage's rounding is the
//    caller's), the stage dout's alone (none forward); fp32 products, paged
//    keys, or several sequences of queries not compact, refused.
// "equal": as values (==), so that a zero's sign, which fl(0 + x) may
// change, is not a difference.
// Built by tools/cuda_emu/CMakeLists.txt; usage: test_attention_block.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/attn_bound.h"
#include "emu.h"
#include "kernels/cuda/kernels.h"
#include "tolerance.h"

typedef std::vector<float> vec;

struct Shape {
  int64_t B, S, nh, nkv, hd, win;
  bool bf;
};

static float R(float x, bool bf) { return bf ? __bfloat162float(__float2bfloat16_rn(x)) : x; }

// exact-size, NaN-filled heap copy (ASan sees an overrun; a read of an
// element never written shows as NaN)
static float *dev(size_t n) {
  float *p = (float *)malloc(n ? n * 4 : 4);
  for (size_t i = 0; i < n; i++) p[i] = NAN;
  return p;
}

static int fails = 0;
static void expect(bool ok, const char *what, const Shape &s) {
  if (ok) return;
  printf("FAIL %s (B=%ld S=%ld nh=%ld nkv=%ld hd=%ld win=%ld %s)\n", what, (long)s.B, (long)s.S,
         (long)s.nh, (long)s.nkv, (long)s.hd, (long)s.win, s.bf ? "bf16" : "fp32");
  fails++;
}

// the whole-sequence call: inputs and results ([B, S, heads, hd]; lse [B, nh, S])
struct Whole {
  Shape s;
  float scale;
  vec q, k, v, dout, out, lse, dq, dk, dv;
};

static Whole whole(const Shape &s, unsigned seed) {
  Whole w;
  w.s = s, w.scale = 1.0f / std::sqrt((float)s.hd);
  std::mt19937 rng(seed);
  std::normal_distribution<float> N(0.f, 1.f);
  size_t nq = s.B * s.S * s.nh * s.hd, nk = s.B * s.S * s.nkv * s.hd;
  w.q.resize(nq), w.dout.resize(nq), w.k.resize(nk), w.v.resize(nk);
  for (auto &x : w.q) x = 1.5f * N(rng);
  for (auto &x : w.dout) x = N(rng);
  for (auto &x : w.k) x = 1.5f * N(rng);
  for (auto &x : w.v) x = N(rng);
  float *out = dev(nq), *lse = dev(s.B * s.nh * s.S), *dq = dev(nq), *dk = dev(nk), *dv = dev(nk);
  float *work = dev(kc_attention_bwd_work(s.B, s.S, s.nh, s.nkv, s.hd) / 4);
  float *stage = s.bf ? dev(kc_attention_stage_bytes(s.B, s.S, s.nh, s.nkv, s.hd, true) / 4) : 0;
  cudaError_t e = kc_attention_fwd(nullptr, w.q.data(), w.k.data(), w.v.data(), out, lse, s.B,
                                   s.S, s.nh, s.nkv, s.hd, w.scale, s.win, s.bf, stage);
  if (e == cudaSuccess)
    e = kc_attention_bwd(nullptr, w.dout.data(), w.q.data(), w.k.data(), w.v.data(), out, lse, dq,
                         dk, dv, s.B, s.S, s.nh, s.nkv, s.hd, w.scale, s.win, s.bf, work, stage);
  expect(e == cudaSuccess, "the whole-sequence call", s);
  w.out.assign(out, out + nq), w.lse.assign(lse, lse + s.B * s.nh * s.S);
  w.dq.assign(dq, dq + nq), w.dk.assign(dk, dk + nk), w.dv.assign(dv, dv + nk);
  free(out), free(lse), free(dq), free(dk), free(dv), free(work), free(stage);
  return w;
}

// A block over the whole call's tensors (compact [B, S, heads, hd]): query
// rows q0 .. q0+sq−1, key rows k0 .. k0+sk−1 of each sequence, heads h0 ..
// h0+nh−1 (head_off h0 % group); lse in the block layout [B][S, nh_all].
static kc_attn_block block_of(const Whole &w, int64_t q0, int64_t sq, int64_t k0, int64_t sk) {
  const Shape &s = w.s;
  kc_attn_block b = {};
  b.B = s.B, b.sq = sq, b.sk = sk, b.nh = s.nh, b.nkv = s.nkv, b.hd = s.hd;
  b.q_pos = q0, b.k_pos = k0, b.scale = w.scale, b.window = s.win;
  b.q_bs = s.S * s.nh * s.hd, b.k_bs = s.S * s.nkv * s.hd, b.l_bs = s.S * s.nh;
  return b;
}

struct Bufs {  // a block call's outputs in the whole call's layouts ([B, S, ..]; lse [B][S, nh])
  float *out, *lse, *dq, *dk, *dv;
};

static Bufs bufs(const Shape &s) {
  size_t nq = s.B * s.S * s.nh * s.hd, nk = s.B * s.S * s.nkv * s.hd;
  return {dev(nq), dev(s.B * s.S * s.nh), dev(nq), dev(nk), dev(nk)};
}
static void release(Bufs &b) { free(b.out), free(b.lse), free(b.dq), free(b.dk), free(b.dv); }
static void zero(float *x, size_t n) { memset(x, 0, n * 4); }

static cudaError_t fwd(const Whole &w, const kc_attn_block &b, const float *q, const float *k,
                       const float *v, float *out, float *lse, bool acc) {
  float *stage = dev(kc_attention_block_stage_bytes(&b, w.s.bf, false) / 4);
  cudaError_t e = kc_attention_block_fwd(nullptr, &b, q, k, v, out, lse, acc, w.s.bf, stage);
  free(stage);
  return e;
}

static cudaError_t bwd(const Whole &w, const kc_attn_block &b, int64_t qo, int64_t ko, int64_t lo,
                       const float *out, const float *lse, const Bufs &g) {
  float *stage = dev(kc_attention_block_stage_bytes(&b, w.s.bf, true) / 4);
  float *work = dev(kc_attention_block_work(&b) / 4);
  cudaError_t e = kc_attention_block_bwd(nullptr, &b, w.dout.data() + qo, w.q.data() + qo,
                                         w.k.data() + ko, w.v.data() + ko, out + qo, lse + lo,
                                         g.dq + qo, g.dk + ko, g.dv + ko, w.s.bf, work, stage);
  free(stage), free(work);
  return e;
}

// lse [B, nh, S] (the whole call's) ↔ [B][S, nh] (the block layout)
static int64_t at_whole(const Shape &s, int64_t b, int64_t i, int64_t h) {
  return (b * s.nh + h) * s.S + i;
}
static int64_t at_block(const Shape &s, int64_t b, int64_t i, int64_t h) {
  return (b * s.S + i) * s.nh + h;
}
static vec lse_block(const Whole &w) {
  const Shape &s = w.s;
  vec l(s.B * s.S * s.nh);
  for (int64_t b = 0; b < s.B; b++)
    for (int64_t i = 0; i < s.S; i++)
      for (int64_t h = 0; h < s.nh; h++) l[at_block(s, b, i, h)] = w.lse[at_whole(s, b, i, h)];
  return l;
}

static bool equal(const float *a, const float *b, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (!(a[i] == b[i])) return false;
  return true;
}

// the operands as the products read them, and the bound on either call's error
static attn_bounds bounds(const Whole &w) {
  const Shape &s = w.s;
  vec q(w.q), k(w.k), v(w.v), g(w.dout);
  for (auto *x : {&q, &k, &v, &g})
    for (auto &e : *x) e = R(e, s.bf);
  return attn_bound(s.B, s.S, s.nh, s.nkv, s.hd, s.win, q.data(), k.data(), v.data(), g.data(),
                    w.scale, s.bf);
}

// strided sequences at global positions 1000, lse in the block layout
static void strided(const Whole &w) {
  const Shape &s = w.s;
  const int64_t qr = s.nh * s.hd, kr = s.nkv * s.hd, gap = 3, S2 = s.S + gap;
  kc_attn_block b = block_of(w, 1000, s.S, 1000, s.S);
  b.q_bs = S2 * qr, b.k_bs = S2 * kr, b.l_bs = S2 * s.nh;
  size_t nq = s.B * S2 * qr, nk = s.B * S2 * kr;
  float *q = dev(nq), *k = dev(nk), *v = dev(nk), *dout = dev(nq), *out = dev(nq);
  float *lse = dev(s.B * S2 * s.nh), *dq = dev(nq), *dk = dev(nk), *dv = dev(nk);
  std::mt19937 rng(5);
  std::normal_distribution<float> N(0.f, 1.f);
  vec G(nq + 2 * nk);
  for (auto &x : G) x = N(rng);
  for (int64_t bb = 0; bb < s.B; bb++) {
    memcpy(q + bb * S2 * qr, &w.q[bb * s.S * qr], s.S * qr * 4);
    memcpy(dout + bb * S2 * qr, &w.dout[bb * s.S * qr], s.S * qr * 4);
    memcpy(k + bb * S2 * kr, &w.k[bb * s.S * kr], s.S * kr * 4);
    memcpy(v + bb * S2 * kr, &w.v[bb * s.S * kr], s.S * kr * 4);
    memcpy(dq + bb * S2 * qr, &G[bb * S2 * qr], s.S * qr * 4);
    memcpy(dk + bb * S2 * kr, &G[nq + bb * S2 * kr], s.S * kr * 4);
    memcpy(dv + bb * S2 * kr, &G[nq + nk + bb * S2 * kr], s.S * kr * 4);
  }
  expect(fwd(w, b, q, k, v, out, lse, false) == cudaSuccess, "strided forward", s);
  float *stage = dev(kc_attention_block_stage_bytes(&b, s.bf, true) / 4);
  float *work = dev(kc_attention_block_work(&b) / 4);
  expect(kc_attention_block_bwd(nullptr, &b, dout, q, k, v, out, lse, dq, dk, dv, s.bf, work,
                                stage) == cudaSuccess,
         "strided backward", s);
  free(stage), free(work);
  bool ok_o = true, ok_l = true, ok_g = true, ok_gap = true;
  for (int64_t bb = 0; bb < s.B; bb++) {
    ok_o &= !memcmp(out + bb * S2 * qr, &w.out[bb * s.S * qr], s.S * qr * 4);
    for (int64_t i = 0; i < s.S; i++)
      for (int64_t h = 0; h < s.nh; h++)
        ok_l &= !memcmp(&lse[(bb * S2 + i) * s.nh + h], &w.lse[at_whole(s, bb, i, h)], 4);
    for (int64_t x = 0; x < s.S * qr; x++) {
      float e = G[bb * S2 * qr + x] + w.dq[bb * s.S * qr + x];
      ok_g &= !memcmp(&dq[bb * S2 * qr + x], &e, 4);
    }
    for (int64_t x = 0; x < s.S * kr; x++) {
      float ek = G[nq + bb * S2 * kr + x] + w.dk[bb * s.S * kr + x];
      float ev = G[nq + nk + bb * S2 * kr + x] + w.dv[bb * s.S * kr + x];
      ok_g &= !memcmp(&dk[bb * S2 * kr + x], &ek, 4) && !memcmp(&dv[bb * S2 * kr + x], &ev, 4);
    }
    for (int64_t x = s.S * qr; x < S2 * qr; x++)
      ok_gap &= std::isnan(out[bb * S2 * qr + x]) && std::isnan(dq[bb * S2 * qr + x]);
    for (int64_t x = s.S * kr; x < S2 * kr; x++)
      ok_gap &= std::isnan(dk[bb * S2 * kr + x]) && std::isnan(dv[bb * S2 * kr + x]);
  }
  expect(ok_o, "strided: out bitwise the whole call's", s);
  expect(ok_l, "strided: lse bitwise the whole call's", s);
  expect(ok_g, "strided: dq, dk, dv bitwise fl(G + the whole call's)", s);
  expect(ok_gap, "strided: the gaps untouched", s);
  free(q), free(k), free(v), free(dout), free(out), free(lse), free(dq), free(dk), free(dv);
}

// query chunks [0, c), [c, S) against all keys
static void query_split(const Whole &w, const attn_bounds &bd) {
  const Shape &s = w.s;
  const int64_t c = s.S / 3 + 5, qr = s.nh * s.hd;
  Bufs o = bufs(s);
  size_t nq = s.B * s.S * qr, nk = s.B * s.S * s.nkv * s.hd;
  zero(o.dq, nq), zero(o.dk, nk), zero(o.dv, nk);
  vec wl = lse_block(w);
  for (int64_t q0 : {int64_t(0), c}) {
    kc_attn_block b = block_of(w, q0, q0 ? s.S - c : c, 0, s.S);
    expect(fwd(w, b, w.q.data() + q0 * qr, w.k.data(), w.v.data(), o.out + q0 * qr,
               o.lse + q0 * s.nh, false) == cudaSuccess,
           "query split forward", s);
    expect(bwd(w, b, q0 * qr, 0, q0 * s.nh, w.out.data(), wl.data(), o) == cudaSuccess,
           "query split backward", s);
  }
  vec ol(o.lse, o.lse + wl.size());
  expect(equal(o.out, w.out.data(), nq), "query split: out equal", s);
  expect(equal(ol.data(), wl.data(), wl.size()), "query split: lse equal", s);
  expect(equal(o.dq, w.dq.data(), nq), "query split: dq equal", s);
  bool ok = true;
  for (size_t x = 0; x < nk; x++)
    ok &= fabs(o.dk[x] - w.dk[x]) <= bd.dk[x] && fabs(o.dv[x] - w.dv[x]) <= bd.dv[x];
  expect(ok, "query split: dk, dv within the bound of the whole call's", s);
  release(o);
}

/* |merged − whole| for the forward over two key blocks merged: each call
 * within half of bound.out of exact (a block's own bound is at most the
 * whole's: fewer keys, a smaller spread R and max |A|, its P|v| summing to
 * its weight's share of the whole's), plus the merge (first order): the
 * weights w = exp(lse_x − lse') carry both blocks' lse errors (together at
 * most bound.lse, which is twice one call's) and (2·TOL_LIBM + 6)u of the
 * merge's own arithmetic (two subtractions, two expf, a sum, two
 * divisions, the product and the sum of out' = w_a·out_a + f·acc), relative
 * to sum_j P_j|v_j| (outb, exact). lse' = mx + log(e^(la−mx) + e^(lb−mx)):
 * one call's lse error, two expf, a sum, a logf and an addition:
 * (3·TOL_LIBM + 2)u·(1 + |lse'|) beyond bound.lse. */
static void key_split(const Whole &w, const attn_bounds &bd) {
  const Shape &s = w.s;
  const int64_t s1 = 128, qr = s.nh * s.hd, kr = s.nkv * s.hd;
  Bufs o = bufs(s);
  size_t nq = s.B * s.S * qr, nk = s.B * s.S * kr;
  // the later keys first, then the earlier ones merged in
  kc_attn_block late = block_of(w, 0, s.S, s1, s.S - s1), early = block_of(w, 0, s.S, 0, s1);
  expect(fwd(w, late, w.q.data(), w.k.data() + s1 * kr, w.v.data() + s1 * kr, o.out, o.lse,
             false) == cudaSuccess &&
             fwd(w, early, w.q.data(), w.k.data(), w.v.data(), o.out, o.lse, true) == cudaSuccess,
         "key split forward", s);
  // outb = sum_j P_j |v_j| in double on the operands as rounded
  const double u = TOL_U;
  bool ok_o = true, ok_l = true;
  const int64_t grp = s.nh / s.nkv;
  for (int64_t b = 0; b < s.B; b++)
    for (int64_t h = 0; h < s.nh; h++)
      for (int64_t i = 0; i < s.S; i++) {
        std::vector<double> sc(s.S, -INFINITY);
        double m = -INFINITY, l = 0;
        for (int64_t j = 0; j <= i; j++) {
          if (s.win > 0 && j <= i - s.win) continue;
          double d = 0;
          for (int64_t x = 0; x < s.hd; x++)
            d += (double)R(w.q[((b * s.S + i) * s.nh + h) * s.hd + x], s.bf) *
                 R(w.k[((b * s.S + j) * s.nkv + h / grp) * s.hd + x], s.bf);
          sc[j] = w.scale * d, m = std::max(m, sc[j]);
        }
        for (int64_t j = 0; j <= i; j++) l += std::exp(sc[j] - m);
        const double lse = m + std::log(l);
        const int64_t lb = at_block(s, b, i, h), lw = at_whole(s, b, i, h);
        ok_l &= fabs(o.lse[lb] - w.lse[lw]) <=
                bd.lse[lw] + TOL_FIRST_ORDER * (3 * TOL_LIBM + 2) * u * (1 + fabs(lse));
        for (int64_t x = 0; x < s.hd; x++) {
          double outb = 0;
          for (int64_t j = 0; j <= i; j++)
            outb += std::exp(sc[j] - m) / l *
                    fabs(R(w.v[((b * s.S + j) * s.nkv + h / grp) * s.hd + x], s.bf));
          const int64_t e = ((b * s.S + i) * s.nh + h) * s.hd + x;
          ok_o &= fabs(o.out[e] - w.out[e]) <=
                  bd.out[e] + TOL_FIRST_ORDER * (bd.lse[lw] + (2 * TOL_LIBM + 6) * u) * outb;
        }
      }
  expect(ok_o, "key split: merged out within bound of the whole call's", s);
  expect(ok_l, "key split: merged lse within bound of the whole call's", s);
  // backward of each key block for the whole call's out and lse
  zero(o.dq, nq), zero(o.dk, nk), zero(o.dv, nk);
  vec wl = lse_block(w);
  expect(bwd(w, early, 0, 0, 0, w.out.data(), wl.data(), o) == cudaSuccess &&
             bwd(w, late, 0, s1 * kr, 0, w.out.data(), wl.data(), o) == cudaSuccess,
         "key split backward", s);
  expect(equal(o.dk, w.dk.data(), nk) && equal(o.dv, w.dv.data(), nk), "key split: dk, dv equal",
         s);
  bool ok = true;
  for (size_t x = 0; x < nq; x++) ok &= fabs(o.dq[x] - w.dq[x]) <= bd.dq[x];
  expect(ok, "key split: dq within the bound of the whole call's", s);
  release(o);
}

// the last rows' queries against keys through a shuffled block table
static void paged(const Whole &w, bool pool_bf16) {
  const Shape &s = w.s;
  const int64_t blk = 16, nb = (s.S + blk - 1) / blk, kr = s.nkv * s.hd, qr = s.nh * s.hd;
  const int64_t nqr = std::min<int64_t>(s.S, 5), q0 = s.S - nqr, nblocks = s.B * nb + 3;
  std::vector<int32_t> perm(nblocks);
  for (int64_t x = 0; x < nblocks; x++) perm[x] = (int32_t)x;
  std::shuffle(perm.begin(), perm.end(), std::mt19937(11));
  std::vector<int32_t> table(s.B * (nb + 1), -1);  // table_bs nb + 1: room a cache keeps
  size_t pn = nblocks * blk * kr;
  float *pk = dev(pn), *pv = dev(pn);
  uint16_t *hk = (uint16_t *)pk, *hv = (uint16_t *)pv;  // bf16 pool in the same allocation
  for (int64_t b = 0; b < s.B; b++)
    for (int64_t j = 0; j < s.S; j++) {
      int32_t p = perm[b * nb + j / blk];
      table[b * (nb + 1) + j / blk] = p;
      for (int64_t x = 0; x < kr; x++) {
        size_t at = (p * blk + j % blk) * kr + x;
        float kx = w.k[(b * s.S + j) * kr + x], vx = w.v[(b * s.S + j) * kr + x];
        if (pool_bf16) {
          __nv_bfloat16 kb = __float2bfloat16_rn(kx), vb = __float2bfloat16_rn(vx);
          memcpy(hk + at, &kb, 2), memcpy(hv + at, &vb, 2);
        } else {
          pk[at] = kx, pv[at] = vx;
        }
      }
    }
  kc_attn_block b = block_of(w, q0, nqr, 0, s.S);
  b.kv_table = table.data(), b.kv_block = blk, b.table_bs = nb + 1, b.kv_bf16 = pool_bf16;
  b.k_bs = 0;
  Bufs o = bufs(s);
  expect(fwd(w, b, w.q.data() + q0 * qr, pk, pv, o.out, o.lse, false) == cudaSuccess,
         "paged forward", s);
  bool ok = true; /* the block's rows at the whole call's strides, from row 0 */
  for (int64_t bb = 0; bb < s.B; bb++) {
    ok &= equal(o.out + bb * s.S * qr, &w.out[(bb * s.S + q0) * qr], nqr * qr);
    for (int64_t i = 0; i < nqr; i++)
      for (int64_t h = 0; h < s.nh; h++)
        ok &= o.lse[at_block(s, bb, i, h)] == w.lse[at_whole(s, bb, q0 + i, h)];
  }
  expect(ok, pool_bf16 ? "paged (bf16 pool): out, lse equal" : "paged (fp32 pool): out, lse equal",
         s);
  // paged keys have no backward
  float *work = dev(kc_attention_block_work(&b) / 4);
  expect(kc_attention_block_bwd(nullptr, &b, w.dout.data(), w.q.data(), pk, pv, o.out, o.lse,
                                o.dq, o.dk, o.dv, s.bf, work, o.dk) == cudaErrorInvalidValue,
         "paged backward refused", s);
  free(work), free(pk), free(pv);
  release(o);
}

// heads 1 .. nh−2 as a block with head_off 1 (group >= 2)
static void head_offset(const Whole &w) {
  const Shape &s = w.s;
  const int64_t grp = s.nh / s.nkv, nl = s.nh - 2, qr = s.nh * s.hd, lr = nl * s.hd;
  size_t nq = s.B * s.S * lr;
  vec q(nq), g(nq), out(nq), lse(s.B * s.S * nl);
  for (int64_t t = 0; t < s.B * s.S; t++) {
    memcpy(&q[t * lr], &w.q[t * qr + s.hd], lr * 4);
    memcpy(&g[t * lr], &w.dout[t * qr + s.hd], lr * 4);
    memcpy(&out[t * lr], &w.out[t * qr + s.hd], lr * 4);
    for (int64_t h = 0; h < nl; h++)
      lse[t * nl + h] = w.lse[at_whole(s, t / s.S, t % s.S, h + 1)];
  }
  kc_attn_block b = block_of(w, 0, s.S, 0, s.S);
  b.nh = nl, b.group = grp, b.head_off = 1, b.q_bs = s.S * lr, b.l_bs = s.S * nl;
  float *o = dev(nq), *l = dev(lse.size()), *dq = dev(nq), *dk = dev(w.k.size()),
        *dv = dev(w.k.size());
  zero(dq, nq), zero(dk, w.k.size()), zero(dv, w.k.size());
  expect(fwd(w, b, q.data(), w.k.data(), w.v.data(), o, l, false) == cudaSuccess,
         "head offset forward", s);
  float *stage = dev(kc_attention_block_stage_bytes(&b, s.bf, true) / 4);
  float *work = dev(kc_attention_block_work(&b) / 4);
  expect(kc_attention_block_bwd(nullptr, &b, g.data(), q.data(), w.k.data(), w.v.data(),
                                out.data(), lse.data(), dq, dk, dv, s.bf, work,
                                stage) == cudaSuccess,
         "head offset backward", s);
  bool ok = equal(o, out.data(), nq) && equal(l, lse.data(), lse.size());
  for (int64_t t = 0; t < s.B * s.S; t++) ok &= equal(dq + t * lr, &w.dq[t * qr + s.hd], lr);
  expect(ok, "head offset: out, lse, dq of heads 1 .. nh−2 equal", s);
  free(stage), free(work), free(o), free(l), free(dq), free(dk), free(dv);
}

/* The backward written (kc_attn_block.bwd_overwrite) is bitwise the added
 * one on zeros (memcmp), from NaN everywhere but the block's rows, which
 * the added run has at 0: queries 0 .. 69 against keys 10 .. 79 (rows
 * seeing no key, keys no query sees; the other rows, neither's, must stay
 * NaN), the same with one group of all the query heads (kv heads unread;
 * nkv >= 2), and blocks without keys or without queries. */
static void overwritten(const Whole &w) {
  const Shape &s = w.s;
  const int64_t qr = s.nh * s.hd, kr = s.nkv * s.hd, k0 = 10;
  const size_t nq = s.B * s.S * qr, nk = s.B * s.S * kr;
  for (int c = 0; c < 4; c++) {
    if (c == 1 && s.nkv < 2) continue;
    kc_attn_block b = block_of(w, 0, c == 3 ? 0 : 70, k0, c == 2 ? 0 : 70);
    if (c == 1) b.group = s.nh; /* every query head reads kv head 0 */
    Bufs o[2] = {bufs(s), bufs(s)};
    if (b.sq && b.sk)
      expect(fwd(w, b, w.q.data(), w.k.data() + k0 * kr, w.v.data() + k0 * kr, o[0].out,
                 o[0].lse, false) == cudaSuccess,
             "overwrite forward", s);
    for (int x = 0; x < 2; x++) {
      for (float *d : {o[x].dq, o[x].dk, o[x].dv}) memset(d, 0xff, (d == o[x].dq ? nq : nk) * 4);
      for (int64_t bb = 0; bb < s.B && !x; bb++) {
        zero(o[0].dq + bb * b.q_bs, b.sq * qr);
        zero(o[0].dk + k0 * kr + bb * b.k_bs, b.sk * kr);
        zero(o[0].dv + k0 * kr + bb * b.k_bs, b.sk * kr);
      }
      b.bwd_overwrite = x;
      expect(bwd(w, b, 0, k0 * kr, 0, o[0].out, o[0].lse, o[x]) == cudaSuccess,
             "overwrite backward", s);
    }
    bool ok = !memcmp(o[0].dq, o[1].dq, nq * 4) && !memcmp(o[0].dk, o[1].dk, nk * 4) &&
              !memcmp(o[0].dv, o[1].dv, nk * 4);
    const char *what[] = {"overwrite: dq, dk, dv written = added onto zeros, bitwise",
                          "overwrite, kv heads unread: written = added onto zeros, bitwise",
                          "overwrite, no keys: dq 0, the rest untouched",
                          "overwrite, no queries: dk, dv 0, the rest untouched"};
    expect(ok, what[c], s);
    release(o[0]), release(o[1]);
  }
}

// keys after every query: no row sees one
static void empty(const Whole &w) {
  const Shape &s = w.s;
  const int64_t nq = 3, qr = s.nh * s.hd;
  kc_attn_block b = block_of(w, 0, nq, nq, s.S - nq);
  b.B = 1;
  vec o0(nq * qr), l0(nq * s.nh);
  for (size_t x = 0; x < o0.size(); x++) o0[x] = (float)x;
  for (size_t x = 0; x < l0.size(); x++) l0[x] = 0.5f * x;
  vec o(o0), l(l0);
  expect(fwd(w, b, w.q.data(), w.k.data() + nq * s.nkv * s.hd, w.v.data() + nq * s.nkv * s.hd,
             o.data(), l.data(), true) == cudaSuccess,
         "empty block forward", s);
  expect(!memcmp(o.data(), o0.data(), o.size() * 4) && !memcmp(l.data(), l0.data(), l.size() * 4),
         "empty block, accumulating: out, lse untouched", s);
  expect(fwd(w, b, w.q.data(), w.k.data() + nq * s.nkv * s.hd, w.v.data() + nq * s.nkv * s.hd,
             o.data(), l.data(), false) == cudaSuccess,
         "empty block forward", s);
  bool ok = true;
  for (float x : o) ok &= x == 0.f;
  for (float x : l) ok &= x == -INFINITY;
  expect(ok, "empty block: out 0, lse -inf", s);
}

// the whole sequences with a bf16 out (bf16 products only)
static void bf16_out(const Whole &w) {
  const Shape &s = w.s;
  const size_t nq = s.B * s.S * s.nh * s.hd, nk = s.B * s.S * s.nkv * s.hd, nl = s.B * s.S * s.nh;
  kc_attn_block b = block_of(w, 0, s.S, 0, s.S), bh = b;
  bh.out_bf16 = true;
  float *o = dev(nq), *l = dev(nl), *lh = dev(nl), *o_r = dev(nq);
  __nv_bfloat16 *oh = (__nv_bfloat16 *)dev((nq + 1) / 2);
  expect(fwd(w, b, w.q.data(), w.k.data(), w.v.data(), o, l, false) == cudaSuccess &&
             fwd(w, bh, w.q.data(), w.k.data(), w.v.data(), (float *)oh, lh, false) == cudaSuccess,
         "bf16 out forward", s);
  bool ok = !memcmp(l, lh, nl * 4);
  for (size_t x = 0; x < nq; x++) {
    __nv_bfloat16 r = __float2bfloat16_rn(o[x]);
    ok &= !memcmp(&r, &oh[x], sizeof r);
    o_r[x] = __bfloat162float(oh[x]);
  }
  expect(ok, "bf16 out: out = the fp32 out rounded, lse equal, bitwise", s);
  float *g[2][3];
  for (int r = 0; r < 2; r++) {
    for (int t = 0; t < 3; t++) g[r][t] = dev(t ? nk : nq), zero(g[r][t], t ? nk : nq);
    const kc_attn_block &k = r ? b : bh;
    float *stage = dev(kc_attention_block_stage_bytes(&k, true, true) / 4);
    float *work = dev(kc_attention_block_work(&k) / 4);
    expect(kc_attention_block_bwd(nullptr, &k, w.dout.data(), w.q.data(), w.k.data(), w.v.data(),
                                  r ? o_r : (const float *)oh, lh, g[r][0], g[r][1], g[r][2], true,
                                  work, stage) == cudaSuccess,
           "bf16 out backward", s);
    free(stage), free(work);
  }
  expect(!memcmp(g[0][0], g[1][0], nq * 4) && !memcmp(g[0][1], g[1][1], nk * 4) &&
             !memcmp(g[0][2], g[1][2], nk * 4),
         "bf16 out backward = the backward on its values in fp32, bitwise", s);
  float *stage = dev(kc_attention_block_stage_bytes(&bh, true, false) / 4);
  expect(kc_attention_block_fwd(nullptr, &bh, w.q.data(), w.k.data(), w.v.data(), (float *)oh, lh,
                                true, true, stage) == cudaErrorInvalidValue &&
             kc_attention_block_fwd(nullptr, &bh, w.q.data(), w.k.data(), w.v.data(),
                                    (float *)oh, lh, false, false, stage) == cudaErrorInvalidValue,
         "bf16 out: a merge, fp32 products refused", s);
  free(stage);
  for (int r = 0; r < 2; r++)
    for (int t = 0; t < 3; t++) free(g[r][t]);
  free(o), free(l), free(lh), free(o_r), free(oh);
}

// the bf16 values of x [n] (NaN-filled heap, as dev)
static __nv_bfloat16 *dev_bf16(const float *x, size_t n) {
  __nv_bfloat16 *p = (__nv_bfloat16 *)dev((n + 1) / 2);
  for (size_t i = 0; i < n; i++) p[i] = __float2bfloat16_rn(x[i]);
  return p;
}

// block b on q, k, v given as fp32 (qkv false) or as their bf16 copies (b.qkv_bf16 set):
// out (bf16 when b.out_bf16), lse, then dq, dk, dv (=) into g [nq, nk, nk]; the stages
// exactly kc_attention_block_stage_bytes (ASan sees an overrun)
static cudaError_t run_qkv(const Whole &w, const kc_attn_block &b, const void *q, const void *k,
                           const void *v, const float *dout, void *out, float *lse, float **g,
                           size_t nq, size_t nk) {
  float *st = dev(kc_attention_block_stage_bytes(&b, true, false) / 4);
  cudaError_t e = kc_attention_block_fwd(nullptr, &b, (const float *)q, (const float *)k,
                                         (const float *)v, (float *)out, lse, false, true, st);
  free(st);
  for (int t = 0; t < 3; t++) zero(g[t], t ? nk : nq);
  st = dev(kc_attention_block_stage_bytes(&b, true, true) / 4);
  float *work = dev(kc_attention_block_work(&b) / 4);
  if (e == cudaSuccess)
    e = kc_attention_block_bwd(nullptr, &b, dout, (const float *)q, (const float *)k,
                               (const float *)v, (const float *)out, lse, g[0], g[1], g[2], true,
                               work, st);
  free(st), free(work);
  return e;
}

// bf16 q, k, v against fp32 ones (bf16 products only); gap: rows between the sequences
// of k, v (k_bs beyond sk rows); q0 > 0: one sequence's queries q0 .. S−1 at q_pos q0
static void bf16_qkv_case(const Whole &w, bool out_bf16, int64_t gap, int64_t q0) {
  const Shape &s = w.s;
  const int64_t B = q0 ? 1 : s.B, sq = s.S - q0, qr = s.nh * s.hd, kr = s.nkv * s.hd;
  const size_t nq = B * sq * qr, nk = B * (s.S + gap) * kr, nl = B * sq * s.nh;
  kc_attn_block b = block_of(w, q0, sq, 0, s.S), bq;
  b.B = B, b.q_bs = sq * qr, b.k_bs = (s.S + gap) * kr, b.l_bs = sq * s.nh, b.out_bf16 = out_bf16;
  bq = b, bq.qkv_bf16 = true;
  float *k = dev(nk), *v = dev(nk);
  for (int64_t bb = 0; bb < B; bb++) {
    memcpy(k + bb * (s.S + gap) * kr, &w.k[bb * s.S * kr], s.S * kr * 4);
    memcpy(v + bb * (s.S + gap) * kr, &w.v[bb * s.S * kr], s.S * kr * 4);
  }
  const float *q = w.q.data() + q0 * qr, *dout = w.dout.data() + q0 * qr;
  /* the gaps stay NaN: a read of them would show in the results */
  __nv_bfloat16 *qh = dev_bf16(q, nq), *kh = dev_bf16(k, nk), *vh = dev_bf16(v, nk);
  float *out[2] = {dev(nq), dev(nq)}, *lse[2] = {dev(nl), dev(nl)}, *g[2][3];
  for (int r = 0; r < 2; r++)
    for (int t = 0; t < 3; t++) g[r][t] = dev(t ? nk : nq);
  expect(run_qkv(w, b, q, k, v, dout, out[0], lse[0], g[0], nq, nk) == cudaSuccess &&
             run_qkv(w, bq, qh, kh, vh, dout, out[1], lse[1], g[1], nq, nk) == cudaSuccess,
         "bf16 q, k, v: forward and backward", s);
  expect(!memcmp(out[0], out[1], nq * (out_bf16 ? 2 : 4)) && !memcmp(lse[0], lse[1], nl * 4) &&
             !memcmp(g[0][0], g[1][0], nq * 4) && !memcmp(g[0][1], g[1][1], nk * 4) &&
             !memcmp(g[0][2], g[1][2], nk * 4),
         out_bf16 ? "bf16 q, k, v (bf16 out): out, lse, dq, dk, dv bitwise the fp32 q, k, v's"
                  : "bf16 q, k, v: out, lse, dq, dk, dv bitwise the fp32 q, k, v's",
         s);
  for (int r = 0; r < 2; r++) {
    free(out[r]), free(lse[r]);
    for (int t = 0; t < 3; t++) free(g[r][t]);
  }
  free(k), free(v), free(qh), free(kh), free(vh);
}

static void bf16_qkv(const Whole &w) {
  const Shape &s = w.s;
  /* the model's call (a bf16 out); with several sequences (a stride matters only between them)
   * strided keys and a query chunk with an fp32 out too */
  bf16_qkv_case(w, true, 0, 0);
  if (s.B > 1) bf16_qkv_case(w, true, 5, 0), bf16_qkv_case(w, false, 0, s.S / 3);
  kc_attn_block b = block_of(w, 0, s.S, 0, s.S);
  b.qkv_bf16 = true;
  const size_t nq = s.B * s.S * s.nh * s.hd, nk = s.B * s.S * s.nkv * s.hd;
  kc_attn_block fq = b;
  expect(kc_attention_block_stage_bytes(&b, true, false) == 0 &&
             kc_attention_block_stage_bytes(&b, true, true) == nq * 2 &&
             kc_attention_block_stage_bytes(&fq, false, true) == 0,
         "bf16 q, k, v: the stage holds dout alone", s);
  float *o = dev(nq), *l = dev(s.B * s.S * s.nh), *st = dev(nq + 2 * nk);
  std::vector<int32_t> table(s.S);
  for (int64_t i = 0; i < s.S; i++) table[i] = (int32_t)i;
  kc_attn_block paged = b, loose = b;
  paged.B = 1, paged.kv_table = table.data(), paged.kv_block = 1, paged.table_bs = s.S;
  loose.q_bs += 8; /* several sequences of queries, not compact */
  bool refused =
      kc_attention_block_fwd(nullptr, &b, w.q.data(), w.k.data(), w.v.data(), o, l, false, false,
                             st) == cudaErrorInvalidValue &&
      kc_attention_block_fwd(nullptr, &paged, w.q.data(), w.k.data(), w.v.data(), o, l, false,
                             true, st) == cudaErrorInvalidValue;
  if (s.B > 1)
    refused &= kc_attention_block_fwd(nullptr, &loose, w.q.data(), w.k.data(), w.v.data(), o, l,
                                      false, true, st) == cudaErrorInvalidValue;
  expect(refused, "bf16 q, k, v: fp32 products, paged keys, queries not compact refused", s);
  free(o), free(l), free(st);
}

int main() {
  const Shape shapes[] = {
      {2, 150, 4, 2, 64, 0, true},  {1, 150, 3, 1, 32, 40, false}, {1, 140, 4, 2, 128, 0, true},
      {1, 133, 4, 2, 72, 70, true}, {1, 129, 3, 1, 256, 0, false}, {2, 131, 6, 2, 16, 0, false},
  };
  for (const Shape &s : shapes) {
    Whole w = whole(s, 100 + (unsigned)s.hd);
    attn_bounds bd = bounds(w);
    strided(w);
    query_split(w, bd);
    key_split(w, bd);
    paged(w, false);
    if (s.bf) paged(w, true);
    if (s.nh / s.nkv >= 2 && s.nh >= 3) head_offset(w);
    empty(w);
    if (&s == &shapes[0] || &s == &shapes[5]) overwritten(w); /* bf16 B 2, fp32 hd 16 */
    if (s.bf) bf16_out(w);
    if (s.bf && (s.B > 1 || s.win)) bf16_qkv(w); /* hd 64 and 72: both bf16 tile widths */
    attn_bounds_free(&bd);
    printf("B=%ld S=%ld nh=%ld nkv=%ld hd=%ld win=%ld %s: done\n", (long)s.B, (long)s.S,
           (long)s.nh, (long)s.nkv, (long)s.hd, (long)s.win, s.bf ? "bf16" : "fp32");
    fflush(stdout);
  }
  printf("%d failures\n", fails);
  return fails != 0;
}

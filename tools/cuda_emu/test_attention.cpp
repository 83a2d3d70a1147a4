// attention.cu on the CPU under tools/cuda_emu's emulator (AddressSanitizer,
// UBSan): kc_attention_fwd and kc_attention_bwd against the exact softmax
// attention and its gradients in double, on the operands as the products
// read them (bf16: q, k, v, dout rounded to nearest-even). Each
// configuration runs twice, the second time with the warps run one at a
// time in a random order (emu.h emu_order 2): the results must be bitwise
// equal (kernels.h promises run-to-run reproducibility; a missing barrier
// or a race shows). The CTest set (no arguments) covers every head size
// the kernels accept (kernels.h: hd a multiple of 8 up to 256; the engine's
// config allows any even head_dim, and the launchers refuse the others with
// cudaErrorInvalidValue, checked here too), in fp32 and bf16, with causal
// and sliding windows, GQA groups 1 to 6, S = 1, S not a multiple of a
// tile, several tiles.
//
// Tolerance: attn_bound, the bound on either backend's error against exact
// attention that tests/cuda/test_cuda_ops.c uses too (derived term by term,
// lse's included, from tests/tolerance.h in tests/cuda/attn_bound.h); used
// twice as there, the second half covering the double reference's own
// rounding.
// The tensor-core fragments are emulated from the PTX ISA's description of
// mma.m16n8k16 and ldmatrix, so a misreading of that description would
// pass here; the GPU check is tests/cuda/test_cuda_ops.c.
// Built by tools/cuda_emu/CMakeLists.txt (cmake --build build --target
// cuda_emu_test_attention; the program is build/tests/cuda_emu/...).
// usage: test_attention                       (the CTest set)
//        test_attention SEED N                (N random configurations)
//        test_attention B S nh nkv hd window bf16
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "cuda/attn_bound.h"
#include "emu.h"
#include "kernels/cuda/kernels.h"
#include "tolerance.h"

static float R(float x, bool bf) { return bf ? __bfloat162float(__float2bfloat16_rn(x)) : x; }

struct Cfg {
  int64_t B, S, nh, nkv, hd, win;
  bool bf;
};

static float *alloc_f(size_t n, float fill) {
  float *p = (float *)malloc(n ? n * 4 : 1);  // exact size for ASan; malloc aligns 16
  for (size_t i = 0; i < n; i++) p[i] = fill;
  return p;
}

// worst |a - r| / bound (inf when any is above its bound or not finite)
static double worst(const float *a, const std::vector<double> &r, const double *b) {
  double w = 0;
  for (size_t i = 0; i < r.size(); i++) {
    double d = fabs(a[i] - r[i]);
    if (!(d <= b[i])) return INFINITY;
    if (b[i] > 0) w = std::max(w, d / b[i]);
  }
  return w;
}

int run(const Cfg &c, unsigned seed) {
  int64_t B = c.B, S = c.S, nh = c.nh, nkv = c.nkv, hd = c.hd, T = B * S, grp = nh / nkv;
  float scale = 1.0f / std::sqrt((float)hd);
  std::mt19937 rng(seed);
  std::normal_distribution<float> N(0.f, 1.f);
  size_t nq = T * nh * hd, nk = T * nkv * hd;
  float *q = alloc_f(nq, 0), *k = alloc_f(nk, 0), *v = alloc_f(nk, 0), *dout = alloc_f(nq, 0);
  for (size_t i = 0; i < nq; i++) q[i] = 1.5f * N(rng), dout[i] = N(rng);
  for (size_t i = 0; i < nk; i++) k[i] = 1.5f * N(rng), v[i] = N(rng);
  // the operands as the products read them
  std::vector<float> qr(nq), kr(nk), vr(nk), dr(nq);
  for (size_t i = 0; i < nq; i++) qr[i] = R(q[i], c.bf), dr[i] = R(dout[i], c.bf);
  for (size_t i = 0; i < nk; i++) kr[i] = R(k[i], c.bf), vr[i] = R(v[i], c.bf);
  // reference in double
  std::vector<double> ro(nq, 0), rlse(B * nh * S), rdq(nq, 0), rdk(nk, 0), rdv(nk, 0);
  auto vis = [&](int64_t i, int64_t j) { return j <= i && (c.win <= 0 || j > i - c.win); };
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < nh; h++) {
      int64_t g = h / grp;
      std::vector<double> P(S * S, 0), dP(S * S, 0), D(S, 0);
      auto Q = [&](int64_t i, int64_t d) { return (double)qr[((b * S + i) * nh + h) * hd + d]; };
      auto G = [&](int64_t i, int64_t d) { return (double)dr[((b * S + i) * nh + h) * hd + d]; };
      auto K = [&](int64_t j, int64_t d) { return (double)kr[((b * S + j) * nkv + g) * hd + d]; };
      auto V = [&](int64_t j, int64_t d) { return (double)vr[((b * S + j) * nkv + g) * hd + d]; };
      for (int64_t i = 0; i < S; i++) {
        double m = -INFINITY;
        for (int64_t j = 0; j < S; j++) {
          if (!vis(i, j)) continue;
          double s = 0;
          for (int64_t d = 0; d < hd; d++) s += Q(i, d) * K(j, d);
          s *= scale;
          P[i * S + j] = s;
          m = std::max(m, s);
        }
        double l = 0;
        for (int64_t j = 0; j < S; j++)
          if (vis(i, j)) l += std::exp(P[i * S + j] - m);
        for (int64_t j = 0; j < S; j++)
          P[i * S + j] = vis(i, j) ? std::exp(P[i * S + j] - m) / l : 0;
        rlse[(b * nh + h) * S + i] = m + std::log(l);
        for (int64_t d = 0; d < hd; d++) {
          double o = 0;
          for (int64_t j = 0; j < S; j++)
            if (vis(i, j)) o += P[i * S + j] * V(j, d);
          ro[((b * S + i) * nh + h) * hd + d] = o;
        }
        for (int64_t j = 0; j < S; j++) {
          if (!vis(i, j)) continue;
          double s = 0;
          for (int64_t d = 0; d < hd; d++) s += G(i, d) * V(j, d);
          dP[i * S + j] = s;
          D[i] += P[i * S + j] * s;
        }
      }
      for (int64_t i = 0; i < S; i++)
        for (int64_t j = 0; j < S; j++) {
          if (!vis(i, j)) continue;
          double p = P[i * S + j], ds = p * (dP[i * S + j] - D[i]);
          for (int64_t d = 0; d < hd; d++) {
            rdv[((b * S + j) * nkv + g) * hd + d] += p * G(i, d);
            rdk[((b * S + j) * nkv + g) * hd + d] += scale * ds * Q(i, d);
            rdq[((b * S + i) * nh + h) * hd + d] += scale * ds * K(j, d);
          }
        }
    }
  attn_bounds bd = attn_bound(B, S, nh, nkv, hd, c.win, qr.data(), kr.data(), vr.data(),
                              dr.data(), scale, c.bf);

  float *outs[2][5];
  for (int pass = 0; pass < 2; pass++) {
    emu_order = pass == 0 ? 0 : 2;
    emu_seed = seed * 7 + pass;
    float *out = alloc_f(nq, NAN), *lse = alloc_f(B * nh * S, NAN);
    float *dq = alloc_f(nq, NAN), *dk = alloc_f(nk, NAN), *dv = alloc_f(nk, NAN);
    size_t wb = kc_attention_bwd_work(B, S, nh, nkv, hd);
    float *work = alloc_f(wb / 4, NAN);
    // bf16: the rounded copies of q, k, v, dout (NaN-filled first: a tile
    // copied from past a tensor's end would show); fp32: none
    float *stage =
        c.bf ? alloc_f(kc_attention_stage_bytes(B, S, nh, nkv, hd, true) / 4, NAN) : nullptr;
    cudaError_t e = kc_attention_fwd(nullptr, q, k, v, out, lse, B, S, nh, nkv, hd, scale, c.win,
                                     c.bf, stage);
    if (e == cudaSuccess)
      e = kc_attention_bwd(nullptr, dout, q, k, v, out, lse, dq, dk, dv, B, S, nh, nkv, hd, scale,
                           c.win, c.bf, work, stage);
    if (e != cudaSuccess) {
      printf("launch error %d (%s)\n", e, kc_failed_kernel());
      attn_bounds_free(&bd);
      return 1;
    }
    outs[pass][0] = out;
    outs[pass][1] = lse;
    outs[pass][2] = dq;
    outs[pass][3] = dk;
    outs[pass][4] = dv;
    free(work);
    free(stage);
  }
  size_t ns[5] = {nq, (size_t)(B * nh * S), nq, nk, nk};
  const std::vector<double> *refs[5] = {&ro, &rlse, &rdq, &rdk, &rdv};
  const double *bnds[5] = {bd.out, bd.lse, bd.dq, bd.dk, bd.dv};
  const char *names[5] = {"out", "lse", "dq", "dk", "dv"};
  int fail = 0;
  printf("B=%ld S=%ld nh=%ld nkv=%ld hd=%ld win=%ld %s: error/bound", (long)B, (long)S, (long)nh,
         (long)nkv, (long)hd, (long)c.win, c.bf ? "bf16" : "fp32");
  for (int t = 0; t < 5; t++) {
    double w = worst(outs[0][t], *refs[t], bnds[t]);
    printf(" %s %.2e", names[t], w);
    if (!(w <= 1.0)) fail = 1;
    if (memcmp(outs[0][t], outs[1][t], ns[t] * 4)) {
      printf(" [%s DEPENDS ON THE SCHEDULE]", names[t]);
      fail = 1;
    }
    free(outs[0][t]);
    free(outs[1][t]);
  }
  attn_bounds_free(&bd);
  printf(fail ? "  FAIL\n" : "  ok\n");
  fflush(stdout);
  free(q);
  free(k);
  free(v);
  free(dout);
  return fail;
}

// head sizes the engine's config allows (even) but the kernels do not, and
// misaligned pointers: refused before any launch
static int refused() {
  int fails = 0;
  float *x = alloc_f(1024, 0.0f);
  for (int64_t hd : {2, 6, 12, 260, 264}) {
    cudaError_t e =
        kc_attention_fwd(nullptr, x, x, x, x, x, 1, 1, 1, 1, hd, 1.0f, 0, false, nullptr);
    const char *name = kc_failed_kernel();
    printf("hd=%ld: %s%s\n", (long)hd, e == cudaErrorInvalidValue ? "refused" : "NOT refused",
           name ? " by a launch" : "");
    fails += e != cudaErrorInvalidValue || name;
  }
  // pointers not 16-byte aligned: refused (the tiles load float4)
  cudaError_t e =
      kc_attention_fwd(nullptr, x + 1, x, x, x, x, 1, 1, 1, 1, 8, 1.0f, 0, false, nullptr);
  printf("q misaligned: %s\n", e == cudaErrorInvalidValue ? "refused" : "NOT refused");
  fails += e != cudaErrorInvalidValue;
  // bf16 without its stage, or with a misaligned one: refused
  for (float *st : {(float *)nullptr, x + 1}) {
    e = kc_attention_fwd(nullptr, x, x, x, x, x, 1, 1, 1, 1, 8, 1.0f, 0, true, st);
    printf("bf16 stage %s: %s\n", st ? "misaligned" : "missing",
           e == cudaErrorInvalidValue ? "refused" : "NOT refused");
    fails += e != cudaErrorInvalidValue;
  }
  free(x);
  return fails;
}

int main(int argc, char **argv) {
  std::vector<Cfg> cfgs;
  int fails = 0;
  if (argc >= 8) {
    cfgs.push_back({atol(argv[1]), atol(argv[2]), atol(argv[3]), atol(argv[4]), atol(argv[5]),
                    atol(argv[6]), atoi(argv[7]) != 0});
  } else if (argc >= 3) {
    std::mt19937 rng(atoi(argv[1]));
    int n = atoi(argv[2]);
    int64_t Ss[] = {1, 2, 7, 31, 32, 33, 63, 64, 65, 97, 128, 129, 150};
    int64_t gr[][2] = {{1, 1}, {2, 1}, {4, 2}, {3, 3}, {6, 2}, {3, 1}};
    for (int i = 0; i < n; i++) {
      Cfg c;
      c.hd = 8 * (1 + rng() % 32);
      c.S = Ss[rng() % 13];
      c.B = 1 + rng() % 2;
      auto *g = gr[rng() % 6];
      c.nh = g[0];
      c.nkv = g[1];
      int64_t wins[] = {0, 0, 1, 2, 5, 17, 33, 64, 65, c.S, c.S + 3, -1};
      c.win = wins[rng() % 12];
      c.bf = rng() % 2;
      cfgs.push_back(c);
    }
  } else {
    // every accepted head size, both modes; shapes cycle so that each size
    // meets a different S, group and window
    const int64_t Ss[] = {1, 9, 17, 33, 40, 3}, wins[] = {0, 0, 5, 0, 16, 1};
    const int64_t gr[][2] = {{1, 1}, {2, 1}, {4, 2}, {3, 3}, {6, 2}, {3, 1}};
    int i = 0;
    for (int64_t hd = 8; hd <= 256; hd += 8)
      for (int bf = 0; bf < 2; bf++, i++)
        cfgs.push_back({1 + (i % 5 == 0), Ss[i % 6], gr[i % 6][0], gr[i % 6][1], hd,
                        wins[(i / 6) % 6], bf != 0});
    // several tiles of 64 queries and keys, windows across tile edges
    cfgs.push_back({1, 150, 2, 1, 64, 0, true});
    cfgs.push_back({1, 130, 4, 2, 128, 65, false});
    cfgs.push_back({2, 97, 3, 1, 32, 33, true});
    cfgs.push_back({1, 33, 3, 3, 72, 40, false});  // a window beyond S: causal only
    fails += refused();
  }
  for (size_t i = 0; i < cfgs.size(); i++) fails += run(cfgs[i], 1000 + i);
  printf("%d failures of %zu; blocks %zu switches %ld\n", fails, cfgs.size(), emu_blocks_run,
         emu_switches);
  return fails != 0;
}

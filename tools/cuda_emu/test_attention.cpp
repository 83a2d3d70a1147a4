// attention.cu on the CPU (tools/attention_emu/run.sh): kc_attention_fwd and
// kc_attention_bwd, compiled as C++ over emu.h's emulation of the CUDA
// features they use, against a double-precision eager reference (the exact
// softmax attention and its gradients), each configuration run twice with
// the threads and blocks scheduled in another order (results must be
// bitwise equal: a missing barrier or a race shows). A developer check for
// machines without a GPU, not a CTest: its thresholds (relative max error
// 2e-5 fp32, 2e-2 bf16) are smoke levels, not derived bounds; the derived
// comparison is tests/cuda/test_cuda_ops.c on a GPU. The tensor-core
// fragments are emulated from the PTX ISA's description of mma.m16n8k16 and
// ldmatrix, so a misreading of that description would pass here.
// usage: test [B S nh nkv hd window bf16]   (no arguments: 20 random configurations;
//        test SEED N: N random configurations from SEED)
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "emu.h"
#include "kernels/cuda/kernels.h"

static float R(float x, bool bf) { return bf ? __bfloat162float(__float2bfloat16_rn(x)) : x; }

struct Cfg {
  int64_t B, S, nh, nkv, hd, win;
  bool bf;
};

static float *alloc_f(size_t n, float fill) {
  // exact-size allocation for ASan; aligned 16 (malloc gives 16 on glibc x86-64)
  float *p = (float *)aligned_alloc(16, ((n * 4 + 15) / 16) * 16);
  for (size_t i = 0; i < n; i++) p[i] = fill;
  return p;
}

static double maxerr(const float *a, const std::vector<double> &r, size_t n, double *refmax) {
  double e = 0, m = 0;
  for (size_t i = 0; i < n; i++) {
    if (!std::isfinite(a[i])) return INFINITY;
    e = std::max(e, std::fabs(a[i] - r[i]));
    m = std::max(m, std::fabs(r[i]));
  }
  *refmax = m;
  return e;
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
  float nan = NAN;
  // reference in double
  std::vector<double> ro(nq, 0), rlse(B * nh * S), rdq(nq, 0), rdk(nk, 0), rdv(nk, 0);
  auto vis = [&](int64_t i, int64_t j) { return j <= i && (c.win <= 0 || j > i - c.win); };
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < nh; h++) {
      int64_t g = h / grp;
      std::vector<double> P(S * S, 0), dP(S * S, 0), D(S, 0);
      auto Q = [&](int64_t i, int64_t d) {
        return (double)R(q[((b * S + i) * nh + h) * hd + d], c.bf);
      };
      auto G = [&](int64_t i, int64_t d) {
        return (double)R(dout[((b * S + i) * nh + h) * hd + d], c.bf);
      };
      auto K = [&](int64_t j, int64_t d) {
        return (double)R(k[((b * S + j) * nkv + g) * hd + d], c.bf);
      };
      auto V = [&](int64_t j, int64_t d) {
        return (double)R(v[((b * S + j) * nkv + g) * hd + d], c.bf);
      };
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

  float *outs[2][5];
  for (int pass = 0; pass < 2; pass++) {
    emu_order = pass == 0 ? 0 : (seed & 1 ? 1 : 2);
    emu_seed = seed * 7 + pass;
    float *out = alloc_f(nq, nan), *lse = alloc_f(B * nh * S, nan);
    float *dq = alloc_f(nq, nan), *dk = alloc_f(nk, nan), *dv = alloc_f(nk, nan);
    size_t wb = kc_attention_bwd_work(B, S, nh, nkv, hd);
    float *work = alloc_f(wb / 4, nan);
    cudaError_t e =
        kc_attention_fwd(nullptr, q, k, v, out, lse, B, S, nh, nkv, hd, scale, c.win, c.bf);
    if (e != cudaSuccess) {
      printf("fwd launch error %d\n", e);
      return 1;
    }
    e = kc_attention_bwd(nullptr, dout, q, k, v, out, lse, dq, dk, dv, B, S, nh, nkv, hd, scale,
                         c.win, c.bf, work);
    if (e != cudaSuccess) {
      printf("bwd launch error %d\n", e);
      return 1;
    }
    outs[pass][0] = out;
    outs[pass][1] = lse;
    outs[pass][2] = dq;
    outs[pass][3] = dk;
    outs[pass][4] = dv;
    free(work);
  }
  size_t ns[5] = {nq, (size_t)(B * nh * S), nq, nk, nk};
  const std::vector<double> *refs[5] = {&ro, &rlse, &rdq, &rdk, &rdv};
  const char *names[5] = {"out", "lse", "dq", "dk", "dv"};
  double tol = c.bf ? 2e-2 : 2e-5;
  int fail = 0;
  printf("B=%ld S=%ld nh=%ld nkv=%ld hd=%ld win=%ld %s:", (long)B, (long)S, (long)nh, (long)nkv,
         (long)hd, (long)c.win, c.bf ? "bf16" : "fp32");
  for (int t = 0; t < 5; t++) {
    double rm, err = maxerr(outs[0][t], *refs[t], ns[t], &rm);
    double rel = err / std::max(rm, 0.1);
    printf(" %s %.2e", names[t], rel);
    if (!(rel <= tol)) fail = 1;
    if (memcmp(outs[0][t], outs[1][t], ns[t] * 4)) {
      printf(" [%s NONDETERMINISTIC]", names[t]);
      fail = 1;
    }
    free(outs[0][t]);
    free(outs[1][t]);
  }
  printf(fail ? "  FAIL\n" : "  ok\n");
  fflush(stdout);
  free(q);
  free(k);
  free(v);
  free(dout);
  return fail;
}

int main(int argc, char **argv) {
  std::vector<Cfg> cfgs;
  if (argc >= 8) {
    cfgs.push_back({atol(argv[1]), atol(argv[2]), atol(argv[3]), atol(argv[4]), atol(argv[5]),
                    atol(argv[6]), atoi(argv[7]) != 0});
  } else {
    std::mt19937 rng(argc > 1 ? atoi(argv[1]) : 123);
    int n = argc > 2 ? atoi(argv[2]) : 20;
    int64_t hds[] = {8, 16, 24, 32, 40, 64, 72, 96, 128, 136, 200, 256};
    int64_t Ss[] = {1, 2, 7, 31, 32, 33, 63, 64, 65, 97, 128, 129, 150};
    int64_t gr[][2] = {{1, 1}, {2, 1}, {4, 2}, {3, 3}, {6, 2}, {3, 1}};
    for (int i = 0; i < n; i++) {
      Cfg c;
      c.hd = hds[rng() % 12];
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
  }
  int fails = 0;
  for (size_t i = 0; i < cfgs.size(); i++) fails += run(cfgs[i], 1000 + i);
  printf("%d failures of %zu; blocks %zu switches %ld\n", fails, cfgs.size(), emu_blocks_run,
         emu_switches);
  return fails != 0;
}

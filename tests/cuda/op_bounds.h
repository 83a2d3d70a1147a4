/* Error bounds of the CUDA kernels against their CPU counterparts, shared
 * by tests/cuda/test_cuda_ops.c (the CUDA backend against the CPU backend
 * on a GPU) and tools/cuda_emu's test_kernels.cpp (the kernels under the CPU
 * emulator against src/kernels/cpu): one derivation each, from
 * tests/tolerance.h's rules. Each side is an fp32 evaluation of the same
 * expression within tolerance.h's bound of the exact value, so the two
 * differ by at most twice it: every bound here is that sum of both. Plain C
 * that compiles as C++ too. Attention's bound: attn_bound.h. */
#ifndef ML_TESTS_CUDA_OP_BOUNDS_H
#define ML_TESTS_CUDA_OP_BOUNDS_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>

#include "tolerance.h"

/* Roundings a sum of n products counts (R2): n in fp32, or on tensor
 * cores (bf16) 2·max over the block size b in 1..32 of (n + n/b + b + 1),
 * reached at b = 1 or b = 32 (convex in b). Tensor cores' fp32
 * accumulation works in block FMAs that align the products of a block (up
 * to 32 of them here) and the accumulator to the largest exponent and
 * truncate instead of rounding (Fasi, Higham, Mikaitis, Pranesh, "Numerical
 * behavior of NVIDIA tensor cores", PeerJ Comput. Sci. 7:e330, 2021): one
 * block of b products errs by < 2u·(b + 1)·max|term| (one ulp per term of
 * the largest), so a sum of n products in ceil(n/b) blocks errs by <
 * 2u·(n + n/b + b + 1)·sum|terms|; the bf16 operands are the same RNE
 * roundings on both sides, and a product of two bf16 values is exact in
 * fp32. */
static inline double sum_count(double n, bool tensor_cores) {
  return tensor_cores ? 2.0 * fmax(2.0 * n + 2.0, n + n / 32.0 + 33.0) : n;
}

/* Gated activation h = act(g)·u, tolerance.h §1 (GLU): SiLU h
 * TOL_K_GLU_SILU_FWD of |h|, dg TOL_K_GLU_SILU_DG of |dh||u|·s(1 + |x|(1 +
 * s)), du TOL_K_GLU_DU of |dh||silu|; GELU(tanh) h TOL_K_GLU_GELU_FWD of
 * |u|·G, G = 0.5|x|(1 + |th| + (1 − th²)|inner|), dg TOL_K_GLU_GELU_DG of
 * |dh||u|(0.5(1 + |th| + (1 − th²)|inner|) + 0.5|x|(1 + th² + 2|th|(|th| +
 * (1 − th²)|inner|))·beta(1 + 3kappa·x²)), du TOL_K_GLU_DU of |dh|·G;
 * twice each. */
static inline void glu_bounds(const float *g, const float *u, const float *dh, int64_t n,
                              bool gelu, double *bh, double *bg, double *bu) {
  const double beta = 0.7978845608028654, kappa = 0.044715;
  for (int64_t i = 0; i < n; i++) {
    double x = g[i], au = fabs(u[i]), ad = fabs(dh[i]), fw, gr, dv;
    if (!gelu) {
      double s = 1.0 / (1.0 + exp(-x));
      fw = TOL_K_GLU_SILU_FWD, gr = TOL_K_GLU_SILU_DG;
      bh[i] = fabs(x) * s * au;
      bg[i] = ad * au * s * (1 + fabs(x) * (1 + s));
      dv = fabs(x) * s;
    } else {
      double inner = beta * (x + kappa * x * x * x), th = tanh(inner), t2 = 1 - th * th;
      double G = 0.5 * fabs(x) * (1 + fabs(th) + t2 * fabs(inner));
      fw = TOL_K_GLU_GELU_FWD, gr = TOL_K_GLU_GELU_DG;
      bh[i] = au * G;
      bg[i] = ad * au *
              (0.5 * (1 + fabs(th) + t2 * fabs(inner)) +
               0.5 * fabs(x) * (1 + th * th + 2 * fabs(th) * (fabs(th) + t2 * fabs(inner))) *
                   beta * (1 + 3 * kappa * x * x));
      dv = G;
    }
    bh[i] *= 2.0 * tol_gamma(fw);
    bg[i] *= 2.0 * tol_gamma(gr);
    bu[i] = 2.0 * tol_gamma(TOL_K_GLU_DU) * ad * dv;
  }
}

/* Bias gradient db (+=) column sums of dy [T, N]: each side sums in fp64
 * (gamma64_T), converts (1) and adds to db (1): tol_vs_double(TOL_K_LINEAR_DB,
 * T) of |db0| + sum_t |dy| each, twice. */
static inline void bias_grad_bounds(const float *dy, int64_t T, int64_t N, const float *db0,
                                    double *bound) {
  for (int64_t j = 0; j < N; j++) {
    double a = fabs(db0[j]);
    for (int64_t t = 0; t < T; t++) a += fabs(dy[t * N + j]);
    bound[j] = 2.0 * tol_vs_double(TOL_K_LINEAR_DB, (double)T) * a;
  }
}

/* RMSNorm forward [T, H]: rstd relative tol_vs_double(TOL_K_RMS_RSTD, H)
 * each (the fp64 sum of squares in any order, R2 in double), y
 * TOL_K_RMS_FWD against |x|·rstd·(|offset| + |w|) (w as the kernels read
 * it: bf16-rounded where bf16); twice each. */
static inline void rmsnorm_fwd_bounds(const float *x, const float *w, float offset, float eps,
                                      int64_t T, int64_t H, double *by, double *brstd) {
  for (int64_t t = 0; t < T; t++) {
    double ss = 0;
    for (int64_t h = 0; h < H; h++) ss += (double)x[t * H + h] * x[t * H + h];
    double rex = 1.0 / sqrt(ss / (double)H + eps);
    brstd[t] = 2.0 * tol_vs_double(TOL_K_RMS_RSTD, H + 2.0) * rex;
    for (int64_t h = 0; h < H; h++)
      by[t * H + h] = 2.0 * tol_vs_double(TOL_K_RMS_FWD, H + 2.0) * fabs(x[t * H + h]) * rex *
                      (fabs(offset) + fabs(w[h]));
  }
}

/* RMSNorm backward from the same rstd on both sides, we = offset + w: dx
 * TOL_K_RMS_DX against rstd|we||dy| + |x|·rstd³/H·sum |dy||we||x| (fp64 row
 * dot), dw (+=) TOL_K_RMS_DW against |dw0| + sum_t |dy·x|·rstd (fp64 column
 * sums); twice each. */
static inline void rmsnorm_bwd_bounds(const float *dy, const float *x, const float *w,
                                      float offset, const float *rstd, const float *dw0,
                                      int64_t T, int64_t H, double *bdx, double *bdw) {
  for (int64_t h = 0; h < H; h++) bdw[h] = fabs(dw0[h]);
  for (int64_t t = 0; t < T; t++) {
    double dot = 0, rt = rstd[t];
    for (int64_t h = 0; h < H; h++)
      dot += fabs((double)dy[t * H + h] * (offset + (double)w[h]) * x[t * H + h]);
    for (int64_t h = 0; h < H; h++) {
      double we = fabs(offset + (double)w[h]);
      bdx[t * H + h] = 2.0 * tol_vs_double(TOL_K_RMS_DX, H + 2.0) *
                       (rt * we * fabs(dy[t * H + h]) +
                        fabs(x[t * H + h]) * dot * rt * rt * rt / (double)H);
      bdw[h] += fabs((double)dy[t * H + h] * x[t * H + h]) * rt;
    }
  }
  for (int64_t h = 0; h < H; h++) bdw[h] *= 2.0 * tol_vs_double(TOL_K_RMS_DW, T + 1.0);
}

/* RoPE rotation of x [B, S, nh, hd] from the same tables (cos ct, sin st,
 * [S, hd/2]) on both sides: a 2-term dot product, TOL_K_ROPE against
 * |x1·c| + |x2·s| (and |x2·c| + |x1·s|), twice; the backward (−s) has the
 * same bound. */
static inline void rope_bounds(const float *x, const float *ct, const float *st, int64_t B,
                               int64_t S, int64_t nh, int64_t hd, double *bound) {
  int64_t half = hd / 2;
  for (int64_t t = 0; t < B * S; t++)
    for (int64_t h = 0; h < nh; h++)
      for (int64_t i = 0; i < half; i++) {
        int64_t o = (t * nh + h) * hd + i, p = (t % S) * half + i;
        double a = fabs(x[o]), b = fabs(x[o + half]), c = fabs(ct[p]), s = fabs(st[p]);
        bound[o] = 2.0 * tol_gamma(TOL_K_ROPE) * (a * c + b * s);
        bound[o + half] = 2.0 * tol_gamma(TOL_K_ROPE) * (b * c + a * s);
      }
}

/* Embedding backward (+=) on rows [row0, row0 + rows) of dW [rows, H]:
 * dW0 plus the c tokens of a row, c + 1 terms of one product each (R2):
 * gamma_{c+2}·(|dW0| + sum |scale·dout|) each, twice (emb_bwd_bound); a row
 * no id hits (c = 0) is left as it was: bound 0. emb_bwd_sums adds the sum
 * |scale·dout| of each row's tokens into acc and counts them into cnt (both
 * as the caller set them: zeros, or acc holding |dW0| already). */
static inline void emb_bwd_sums(const int32_t *ids, int64_t T, const float *dout, int64_t row0,
                                int64_t rows, int64_t H, float scale, double *acc,
                                int64_t *cnt) {
  for (int64_t t = 0; t < T; t++)
    if (ids[t] >= row0 && ids[t] < row0 + rows) {
      cnt[ids[t] - row0]++;
      for (int64_t h = 0; h < H; h++)
        acc[(ids[t] - row0) * H + h] += fabs((double)scale * dout[t * H + h]);
    }
}

/* the bound of one element of a row of cnt tokens, a = |dW0| + sum |scale·dout| */
static inline double emb_bwd_bound(int64_t cnt, double a) {
  return cnt == 0 ? 0.0 : 2.0 * tol_gamma(cnt + 2.0) * a;
}


/* Cross-entropy on a shard [v0, v0 + V) of the vocabulary, logits [T, V],
 * targets y (in the shard, outside it, or −1), from the same row maxima mx
 * on both sides (rowmax exact; tl = l_y − mx one subtraction, or 0: both
 * bitwise):
 *  se = (float) sum_j expf(l_j − mx) in fp64: relative u·max|l − mx| +
 *    TOL_K_XENT_SE·u + gamma64_V each (§1), twice (xent_se_bounds). */
static inline void xent_se_bounds(const float *lg, int64_t T, int64_t V, const float *mx,
                                  double *bse) {
  for (int64_t t = 0; t < T; t++) {
    double se = 0, R = 0;
    for (int64_t j = 0; j < V; j++)
      se += exp((double)lg[t * V + j] - mx[t]), R = fmax(R, fabs(lg[t * V + j] - mx[t]));
    bse[t] = 2.0 * (TOL_U * R + TOL_K_XENT_SE * TOL_U + tol_gamma64((double)V)) * se;
  }
}

/*  log-probs from the same se, tl: tl − log(se) in fp64 (log within 1 ulp
 *    on both: 2 roundings, the subtraction 1: gamma64_3·(|tl| + |log se|)),
 *    rounded once to fp32: 2u|lp| + 2·gamma64_3(...) (blp); the loss sum:
 *    both fp64 sums of the same T terms onto the same start: the per-term
 *    bounds plus 2·gamma64_{T+1}·(|start| + sum |lp|), returned; the count
 *    and the weights exact (xent_logprob_bounds). */
static inline double xent_logprob_bounds(const float *se, const float *tl, const int32_t *y,
                                         int64_t T, double start, double *blp) {
  double loss_b = 0, lsum_abs = fabs(start);
  for (int64_t t = 0; t < T; t++) {
    bool hit = y[t] >= 0;
    double lp = hit ? (double)tl[t] - log((double)se[t]) : 0.0;
    double e64 = hit ? tol_gamma64(3.0) * (fabs(tl[t]) + fabs(log((double)se[t]))) : 0.0;
    blp[t] = 2.0 * TOL_U * fabs(lp) + 2.0 * e64;
    loss_b += 2.0 * e64;
    lsum_abs += fabs(lp);
  }
  return loss_b + 2.0 * tol_gamma64(T + 1.0) * lsum_abs;
}

/*  bwd from the same mx, se, w: |w|p_j(u|l_j − mx| + TOL_K_XENT_BWD·u) +
 *    u|w|(p_j + [j = y]) each (§1 with se given), twice, first order
 *    (xent_bwd_bounds). */
static inline void xent_bwd_bounds(const float *lg, int64_t T, int64_t V, int64_t v0,
                                   const int32_t *y, const float *mx, const float *se,
                                   const float *w, double *bd) {
  for (int64_t t = 0; t < T; t++)
    for (int64_t j = 0; j < V; j++) {
      double p = exp((double)lg[t * V + j] - mx[t]) / se[t], aw = fabs(w[t]);
      double hit = y[t] == v0 + j;
      bd[t * V + j] = 2.0 * TOL_FIRST_ORDER *
                      (aw * p * (TOL_U * fabs(lg[t * V + j] - mx[t]) + TOL_K_XENT_BWD * TOL_U) +
                       TOL_U * aw * (p + hit));
    }
}

#endif

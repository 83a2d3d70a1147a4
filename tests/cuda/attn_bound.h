/* Attention's error bound, shared by tests/cuda/test_cuda_ops.c (the CUDA
 * backend against the CPU backend on a GPU) and tools/cuda_emu's
 * test_attention.cpp (attention.cu under the CPU emulator against exact
 * attention in double): one derivation, from tests/tolerance.h's rules.
 * Plain C that compiles as C++ too. */
#ifndef ML_TESTS_CUDA_ATTN_BOUND_H
#define ML_TESTS_CUDA_ATTN_BOUND_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

#include "op_bounds.h" /* sum_count */
#include "tolerance.h"

typedef struct attn_bounds {
  double *out, *lse, *dq, *dk, *dv;
} attn_bounds;

static inline double *ab_zeros(int64_t n) {
  return (double *)calloc((size_t)(n ? n : 1), sizeof(double));
}

static inline void attn_bounds_free(attn_bounds *b) {
  free(b->out), free(b->lse), free(b->dq), free(b->dk), free(b->dv);
}

/* Bounds on |cuda − cpu| for out, dq, dk, dv: twice a bound that holds for
 * either backend's error against exact attention on the operands as
 * rounded (bf16: q, k, v, dout rounded to bf16, RNE, on both), first order
 * (TOL_FIRST_ORDER). Per query row i, with A_j = |scale|·sum_d |q_d k_jd|,
 * R = max_j (m − s_j) over the visible keys, nv of them, and k(n) =
 * sum_count(n) roundings for a sum of n products (tensor cores in bf16):
 *  score s_j: a dot of hd terms, the scale and (CUDA) the log2(e) factor
 *    folded into it: d = gamma_{k(hd) + 2}·max_j A_j absolute;
 *  e_j = exp(s_j − m): 2d (s_j and the maximum), the subtraction u·R,
 *    expf/exp2f TOL_LIBM; the online softmax (CUDA) rescales a term by
 *    exp(m_old − m_new) at most once per later key that raises the
 *    maximum (nv − 1 times), each a subtraction, exp2f and two products
 *    (acc and l); the intermediate maxima telescope, their subtractions
 *    add at most another u·R: eps_e = 2d + 2uR + (TOL_LIBM + (nv − 1)·
 *    (TOL_LIBM + 2))·u;
 *  P_j = e_j / l: eps_P = 2·eps_e + gamma_{k(nv)} + 2u. CUDA's backward
 *    recomputes P = exp(s − lse), lse = m + logf(l): 2d + eps_e +
 *    gamma_{k(nv)} + TOL_LIBM·u·(1 + log l) + u·(|lse| + R + log l); the
 *    larger of the two is used; bf16 adds u_bf16 where P enters a product;
 *  out = sum_j P_j v_j: (gamma_{k(nv) + 1} + eps_P + lowp)·sum_j P_j|v_j|;
 *  dP_j = dout·v_j: gamma_{k(hd)}·sum|dout||v_j|; D = sum_j P_j dP_j (CPU,
 *    fp64) or sum_d dout_d·out_d (CUDA, from its own out): both terms added;
 *  dS_j = P_j(dP_j − D): P_j(eps_P|dP_j − D| + e_dP + e_D) + 2u·P_j|dP_j − D|
 *    + lowp·|dS_j|;
 *  dq = scale·sum_j dS_j k_j, dk = scale·sum over the group's rows dS q,
 *    dv = sum P·dout: the dS (P) errors carried, plus gamma of the sum
 *    length (nv + 1, S·group + 1) times its |.|-evaluation.
 * lse (the forward's log-sum-exp, which the CUDA backward reads; the
 * emulator test checks it): the scores' error d, the sum of exponentials'
 * eps_e + gamma_{k(nv)} (relative, so absolute in its log), logf
 * (TOL_LIBM), and the additions and base-2 conversions around them (3u of
 * |lse| and |m|), first order, twice.
 * Each array is calloc'd, index as the tensor it bounds (lse: [B, nh, S]);
 * attn_bounds_free releases them. Called on a reference in double, the
 * bound is used twice over (R5: the reference's own rounding, u64 in place
 * of u, is far smaller). */
static inline attn_bounds attn_bound(int64_t B, int64_t S, int64_t nh, int64_t nkv, int64_t hd,
                                     int64_t window, const float *q, const float *k,
                                     const float *v, const float *dout, float scale, bool bf16) {
  int64_t grp = nh / nkv;
  int64_t nq = B * S * nh * hd, nk = B * S * nkv * hd;
  attn_bounds o = {ab_zeros(nq), ab_zeros(B * nh * S), ab_zeros(nq), ab_zeros(nk),
                   ab_zeros(nk)};
  const double u = TOL_U, lowp = bf16 ? TOL_U_BF16 : 0.0;
  const double as = fabs(scale);
  double *sc = ab_zeros(S), *P = ab_zeros(S), *dP = ab_zeros(S), *dPa = ab_zeros(S);
  double *dS = ab_zeros(S), *edS = ab_zeros(S), *outv = ab_zeros(hd), *outb = ab_zeros(hd);
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < nh; h++)
      for (int64_t i = 0; i < S; i++) {
        int64_t g = h / grp, lo = window > 0 && i - window + 1 > 0 ? i - window + 1 : 0;
        const float *qi = q + ((b * S + i) * nh + h) * hd, *gi = dout + ((b * S + i) * nh + h) * hd;
        double m = -INFINITY, Amax = 0, l = 0, R = 0;
        int64_t nv = i - lo + 1;
        for (int64_t j = lo; j <= i; j++) {
          const float *kj = k + ((b * S + j) * nkv + g) * hd;
          double dot = 0, a = 0;
          for (int64_t d = 0; d < hd; d++) dot += (double)qi[d] * kj[d], a += fabs(qi[d] * kj[d]);
          sc[j] = scale * dot;
          Amax = fmax(Amax, as * a);
          m = fmax(m, sc[j]);
        }
        for (int64_t j = lo; j <= i; j++) R = fmax(R, m - sc[j]), l += exp(sc[j] - m);
        double dd = tol_gamma(sum_count((double)hd, bf16) + 2.0) * Amax;
        double eps_e = 2 * dd + 2 * u * R + (TOL_LIBM + (nv - 1.0) * (TOL_LIBM + 2.0)) * u;
        double gl = tol_gamma(sum_count((double)nv, bf16)), logl = log(l), lse = m + logl;
        double eps_P = fmax(2 * eps_e + gl + 2 * u,
                            2 * dd + eps_e + gl + TOL_LIBM * u * (1 + logl) +
                                u * (fabs(lse) + R + logl));
        o.lse[(b * nh + h) * S + i] =
            2.0 * TOL_FIRST_ORDER *
            (dd + eps_e + gl + TOL_LIBM * u * (1 + fabs(logl)) + 3 * u * (fabs(lse) + fabs(m)));
        double D = 0, eD = 0, Dabs = 0;
        for (int64_t d = 0; d < hd; d++) outv[d] = 0, outb[d] = 0;
        for (int64_t j = lo; j <= i; j++) {
          P[j] = exp(sc[j] - m) / l;
          const float *vj = v + ((b * S + j) * nkv + g) * hd;
          double dp = 0, dpa = 0;
          for (int64_t d = 0; d < hd; d++) {
            outv[d] += P[j] * vj[d];
            outb[d] += P[j] * fabs(vj[d]);
            dp += (double)gi[d] * vj[d], dpa += fabs(gi[d] * vj[d]);
          }
          dP[j] = dp, dPa[j] = dpa;
          D += P[j] * dp;
        }
        int64_t oq = ((b * S + i) * nh + h) * hd;
        double tout = tol_gamma(sum_count((double)nv, bf16) + 1.0) + eps_P + lowp;
        for (int64_t d = 0; d < hd; d++) {
          double bo = TOL_FIRST_ORDER * tout * outb[d];
          o.out[oq + d] = 2.0 * bo;
          Dabs += fabs(gi[d] * outv[d]);
          eD += fabs(gi[d]) * bo; /* CUDA's D from its own out */
        }
        eD += tol_gamma(sum_count((double)hd, bf16)) * Dabs + u * fabs(D);
        for (int64_t j = lo; j <= i; j++) {
          double edp = tol_gamma(sum_count((double)hd, bf16)) * dPa[j];
          eD += P[j] * (eps_P * fabs(dP[j]) + edp); /* the CPU's D = sum P·dP */
        }
        for (int64_t j = lo; j <= i; j++) {
          double x = fabs(dP[j] - D), edp = tol_gamma(sum_count((double)hd, bf16)) * dPa[j];
          dS[j] = P[j] * (dP[j] - D);
          edS[j] = P[j] * (eps_P * x + edp + eD) + 2 * u * P[j] * x + lowp * fabs(dS[j]);
        }
        double gq = tol_gamma(sum_count((double)nv, bf16) + 1.0);
        double gk = tol_gamma(sum_count((double)(S * grp), bf16) + 1.0);
        double gv = tol_gamma(sum_count((double)(S * grp), bf16));
        for (int64_t j = lo; j <= i; j++) {
          const float *kj = k + ((b * S + j) * nkv + g) * hd;
          int64_t okv = ((b * S + j) * nkv + g) * hd;
          for (int64_t d = 0; d < hd; d++) {
            o.dq[oq + d] += as * (edS[j] + gq * fabs(dS[j])) * fabs(kj[d]);
            o.dk[okv + d] += as * (edS[j] + gk * fabs(dS[j])) * fabs(qi[d]);
            o.dv[okv + d] += (eps_P + lowp + gv) * P[j] * fabs(gi[d]);
          }
        }
      }
  for (int64_t x = 0; x < nq; x++) o.dq[x] *= 2.0 * TOL_FIRST_ORDER;
  for (int64_t x = 0; x < nk; x++) {
    o.dk[x] *= 2.0 * TOL_FIRST_ORDER;
    o.dv[x] *= 2.0 * TOL_FIRST_ORDER;
  }
  free(sc), free(P), free(dP), free(dPa), free(dS), free(edS), free(outv), free(outb);
  return o;
}

#endif

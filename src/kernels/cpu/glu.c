/* Gated MLP activation h = act(g)·u with act = SiLU or tanh-approximate GELU
 * (torch's formulas). SiLU takes its exponentials CHUNK at a time from
 * k_expf (vectorized, expf's values), then applies the same fp32
 * expressions elementwise. */
#include <math.h>

#include "kernels/cpu/kernels.h"

static const float GELU_BETA = 0.7978845608028654f;  // sqrt(2/pi)
static const float GELU_KAPPA = 0.044715f;

enum { CHUNK = 512 };

// silu(x) given e = expf(-x)
static inline float silu(float x, float e) { return x / (1.0f + e); }

// silu'(x) given e = expf(-x)
static inline float silu_grad(float x, float e) {
  float s = 1.0f / (1.0f + e);
  return s * (1.0f + x * (1.0f - s));
}

// e[n] = expf(-g[n]), n <= CHUNK
static void exp_neg(const float *g, float *e, int64_t n) {
  for (int64_t i = 0; i < n; i++) e[i] = -g[i];
  k_expf(e, e, n);
}

static inline int64_t chunk_len(int64_t c0, int64_t n) { return n - c0 < CHUNK ? n - c0 : CHUNK; }

static inline float gelu_tanh(float x) {
  float inner = GELU_BETA * (x + GELU_KAPPA * x * x * x);
  return 0.5f * x * (1.0f + tanhf(inner));
}

static inline float gelu_tanh_grad(float x) {
  float th = tanhf(GELU_BETA * (x + GELU_KAPPA * x * x * x));
  float right = 0.5f * x * (1.0f - th * th) * GELU_BETA * (1.0f + 3.0f * GELU_KAPPA * x * x);
  return 0.5f * (1.0f + th) + right;
}

// g, u, h: [n]
void k_glu_fwd(const float *g, const float *u, float *h, int64_t n, ml_glu_act act) {
  if (act == ML_GLU_SILU) {
#pragma omp parallel for if (n >= K_PAR_MIN)
    for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
      int64_t c = chunk_len(c0, n);
      float e[CHUNK];
      exp_neg(g + c0, e, c);
      for (int64_t i = 0; i < c; i++) h[c0 + i] = silu(g[c0 + i], e[i]) * u[c0 + i];
    }
  } else {
#pragma omp parallel for simd if (n >= K_PAR_MIN)
    for (int64_t i = 0; i < n; i++) h[i] = gelu_tanh(g[i]) * u[i];
  }
}

// dg = dh·u·act'(g); du = dh·act(g); all [n]
void k_glu_bwd(const float *dh, const float *g, const float *u, float *dg, float *du, int64_t n,
               ml_glu_act act) {
  if (act == ML_GLU_SILU) {
#pragma omp parallel for
    for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
      int64_t c = chunk_len(c0, n);
      float e[CHUNK];
      exp_neg(g + c0, e, c);
      for (int64_t j = 0; j < c; j++) {
        int64_t i = c0 + j;
        float d = dh[i], gi = g[i];
        dg[i] = d * u[i] * silu_grad(gi, e[j]);
        du[i] = d * silu(gi, e[j]);
      }
    }
  } else {
#pragma omp parallel for simd
    for (int64_t i = 0; i < n; i++) {
      float d = dh[i], gi = g[i];
      dg[i] = d * u[i] * gelu_tanh_grad(gi);
      du[i] = d * gelu_tanh(gi);
    }
  }
}

/* Gated MLP activation h = act(g)·u with act = SiLU or tanh-approximate GELU
 * (torch's formulas). */
#include <math.h>

#include "kernels/cpu/kernels.h"

static const float GELU_BETA = 0.7978845608028654f;  // sqrt(2/pi)
static const float GELU_KAPPA = 0.044715f;

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

static inline float silu_grad(float x) {
  float s = 1.0f / (1.0f + expf(-x));
  return s * (1.0f + x * (1.0f - s));
}

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
#pragma omp parallel for simd
    for (int64_t i = 0; i < n; i++) h[i] = silu(g[i]) * u[i];
  } else {
#pragma omp parallel for simd
    for (int64_t i = 0; i < n; i++) h[i] = gelu_tanh(g[i]) * u[i];
  }
}

// dg = dh·u·act'(g); du = dh·act(g); all [n]
void k_glu_bwd(const float *dh, const float *g, const float *u, float *dg, float *du, int64_t n,
               ml_glu_act act) {
  if (act == ML_GLU_SILU) {
#pragma omp parallel for simd
    for (int64_t i = 0; i < n; i++) {
      float d = dh[i], gi = g[i];
      dg[i] = d * u[i] * silu_grad(gi);
      du[i] = d * silu(gi);
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

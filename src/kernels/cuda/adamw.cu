/* AdamW step (torch.optim.AdamW, single-tensor path), the arithmetic of
 * kernels/cpu/adamw.c's k_adamw_step: the bias corrections and scalar
 * factors formed in fp64 on the host and rounded once to fp32, the update
 * in fp32 except v's b2 term, which (as in the CPU's v·b2 with b2 a double)
 * is computed in fp64 and rounded once. One grid-stride launch over quads
 * of the four arrays (common.cuh kc_ld4, vectorised per aligned pointer);
 * p_bf16 (optional) takes the updated p's bf16 rounding in the same pass. */
#include "kernels/adamw_scalars.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

static __global__ void adamw_kernel(float *p, float *g, float *m, float *v, uint16_t *p_bf16,
                                    int64_t n, float grad_scale, float decay, float w1, float w2,
                                    float neg_step, float bc2_sqrt, float feps, double b2) {
  for (int64_t i = kc_gtid() * 4; i < n; i += kc_gstride() * 4) {
    float pv[4], gv[4], mv[4], vv[4];
    kc_ld4(p, i, n, pv);
    kc_ld4(g, i, n, gv);
    kc_ld4(m, i, n, mv);
    kc_ld4(v, i, n, vv);
    if (grad_scale != 1.0f) { /* clipping: kc_scale's rounded product, never fused */
      for (int k = 0; k < 4; k++) gv[k] = __fmul_rn(gv[k], grad_scale);
      kc_st4(g, i, n, gv);
    }
    for (int k = 0; k < 4; k++) {
      float gi = gv[k];
      pv[k] *= decay;
      mv[k] += w1 * (gi - mv[k]); /* exp_avg.lerp_(grad, 1 - b1) */
      vv[k] = (float)(vv[k] * b2 + w2 * gi * gi);
      float denom = sqrtf(vv[k]) / bc2_sqrt + feps;
      pv[k] += neg_step * mv[k] / denom;
    }
    kc_st4(p, i, n, pv);
    for (int k = 0; p_bf16 && k < 4 && i + k < n; k++) p_bf16[i + k] = kc_f32_to_bf16(pv[k]);
    kc_st4(m, i, n, mv);
    kc_st4(v, i, n, vv);
  }
}

extern "C" cudaError_t kc_adamw(cudaStream_t st, float *p, float *g, float *m, float *v,
                                uint16_t *p_bf16, int64_t n, float grad_scale, double lr,
                                double b1, double b2, double eps, double wd, int64_t step) {
  if (n <= 0) return cudaSuccess;
  ml_adamw_scalars c = ml_adamw_scalars_of(lr, b1, b2, eps, wd, step);
  return KC_LAUNCH(adamw_kernel, kc_grid((n + 3) / 4, KC_THREADS), KC_THREADS, 0, st, p, g, m, v,
                   p_bf16, n, grad_scale, c.decay, c.w1, c.w2, c.neg_step, c.bc2_sqrt, c.eps, b2);
}

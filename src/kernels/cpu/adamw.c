/* AdamW update, torch.optim.AdamW single-tensor path (foreach=False). */
#include <math.h>

#include "kernels/adamw_scalars.h"
#include "kernels/cpu/kernels.h"

// p, g, m, v: [n]; scalars derived in double as Python does, applied in fp32
void k_adamw_step(float *p, const float *g, float *m, float *v, int64_t n, double lr, double b1,
                  double b2, double eps, double wd, int64_t step) {
  ml_adamw_scalars c = ml_adamw_scalars_of(lr, b1, b2, eps, wd, step);
  float decay = c.decay, w1 = c.w1, w2 = c.w2, neg_step = c.neg_step, bc2_sqrt = c.bc2_sqrt,
        feps = c.eps;
#pragma omp parallel for simd
  for (int64_t i = 0; i < n; i++) {
    float gi = g[i];
    p[i] *= decay;
    m[i] += w1 * (gi - m[i]);  // exp_avg.lerp_(grad, 1 - b1)
    v[i] = v[i] * b2 + w2 * gi * gi;
    float denom = sqrtf(v[i]) / bc2_sqrt + feps;
    p[i] += neg_step * m[i] / denom;
  }
}

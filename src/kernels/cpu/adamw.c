/* AdamW update, torch.optim.AdamW single-tensor path (foreach=False). */
#include <math.h>

#include "kernels/cpu/kernels.h"

// p, g, m, v: [n]; scalars derived in double as Python does, applied in fp32
void k_adamw_step(float *p, const float *g, float *m, float *v, int64_t n, double lr, double b1,
                  double b2, double eps, double wd, int64_t step) {
  double bc1 = 1.0 - pow(b1, (double)step);
  double bc2 = 1.0 - pow(b2, (double)step);
  float decay = (float)(1.0 - lr * wd);
  float w1 = (float)(1.0 - b1), w2 = (float)(1.0 - b2);
  float neg_step = (float)(-lr / bc1);
  float bc2_sqrt = (float)sqrt(bc2), feps = (float)eps;
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

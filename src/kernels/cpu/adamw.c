/* AdamW update, torch.optim.AdamW single-tensor path (foreach=False). */
#include <math.h>

#include "kernels/cpu/kernels.h"

// p, g, m, v: [n]; scalars derived in double as Python does, applied in fp32
void k_adamw_step(float *p, const float *g, float *m, float *v, int64_t n, float lr, float b1,
                  float b2, float eps, float wd, int64_t step) {
  double bc1 = 1.0 - pow((double)b1, (double)step);
  double bc2 = 1.0 - pow((double)b2, (double)step);
  float decay = (float)(1.0 - (double)lr * (double)wd);
  float w1 = (float)(1.0 - (double)b1), w2 = (float)(1.0 - (double)b2);
  float neg_step = (float)(-(double)lr / bc1);
  float bc2_sqrt = (float)sqrt(bc2);
#pragma omp parallel for simd
  for (int64_t i = 0; i < n; i++) {
    float gi = g[i];
    p[i] *= decay;
    m[i] += w1 * (gi - m[i]);  // exp_avg.lerp_(grad, 1 - b1)
    v[i] = v[i] * b2 + w2 * gi * gi;
    float denom = sqrtf(v[i]) / bc2_sqrt + eps;
    p[i] += neg_step * m[i] / denom;
  }
}

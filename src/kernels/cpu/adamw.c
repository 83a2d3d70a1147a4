/* AdamW update, torch.optim.AdamW single-tensor path (foreach=False). */
#include <math.h>

#include "kernels/adamw_scalars.h"
#include "kernels/cpu/kernels.h"

// One element's update with gradient gi; scalars derived in double as Python does, applied in fp32
static inline void adamw_elem(float *p, float *m, float *v, float gi, const ml_adamw_scalars *c,
                              double b2) {
  *p *= c->decay;
  *m += c->w1 * (gi - *m);  // exp_avg.lerp_(grad, 1 - b1)
  *v = *v * b2 + c->w2 * gi * gi;
  float denom = sqrtf(*v) / c->bc2_sqrt + c->eps;
  *p += c->neg_step * *m / denom;
}

// p, g, m, v: [n]
void k_adamw_step(float *p, float *g, float *m, float *v, int64_t n, float grad_scale, double lr,
                  double b1, double b2, double eps, double wd, int64_t step) {
  ml_adamw_scalars c = ml_adamw_scalars_of(lr, b1, b2, eps, wd, step);
  if (grad_scale == 1.0f) {
#pragma omp parallel for simd
    for (int64_t i = 0; i < n; i++) adamw_elem(&p[i], &m[i], &v[i], g[i], &c, b2);
    return;
  }
  // clip_grad_norm_'s g *= scale (k_scale's product, rounded and stored: a stored product is never
  // fused into the update's arithmetic) in the same pass
#pragma omp parallel for simd
  for (int64_t i = 0; i < n; i++) {
    float gi = g[i] * grad_scale;
    g[i] = gi;
    adamw_elem(&p[i], &m[i], &v[i], gi, &c, b2);
  }
}

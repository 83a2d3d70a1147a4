/* nn.Linear as a module with edge hooks (used by model/ only). */
#ifndef ML_LINEAR_H
#define ML_LINEAR_H

#include "model/model.h"

static inline int ml_hook_run(ml_hook h, float *x, int64_t rows, int64_t cols) {
  return h.fn ? h.fn(h.ctx, x, rows, cols) : 0;
}

/* y [T, out_local] = x [T, in_local] · W^T (+ b); output hooks run on y.
 * The input hooks are the caller's (they may be shared by siblings). */
int ml_linear_forward(const ml_linear *lin, const float *x, float *y, int64_t T);
/* dy [T, out_local] (output hooks run on it, in place) → dx [T, in_local]
 * (= or += when accumulate; NULL to skip) and weight/bias grads (+=). */
int ml_linear_backward(const ml_linear *lin, float *dy, const float *x, float *dx, int accumulate,
                       int64_t T);

#endif

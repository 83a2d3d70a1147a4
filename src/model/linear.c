#include "model/linear.h"

#include "common/status.h"
#include "kernels/cpu/kernels.h"

int ml_linear_forward(const ml_linear *lin, const float *x, float *y, int64_t T) {
  const ml_param *w = lin->weight;
  const float *b = lin->bias && lin->bias_in_forward ? lin->bias->data : NULL;
  k_linear_fwd(x, w->data, b, y, T, w->local[1], w->local[0]);
  return ml_hook_run(lin->out_fwd, y, T, w->local[0]);
}

int ml_linear_backward(const ml_linear *lin, float *dy, const float *x, float *dx, int accumulate,
                       int64_t T) {
  const ml_param *w = lin->weight;
  ML_TRY(ml_hook_run(lin->out_bwd, dy, T, w->local[0]));
  k_linear_bwd(dy, x, w->data, dx, accumulate, w->grad, lin->bias ? lin->bias->grad : NULL, T,
               w->local[1], w->local[0]);
  return 0;
}

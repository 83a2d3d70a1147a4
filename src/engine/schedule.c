#include "engine/schedule.h"

#include <math.h>

static const double k_pi = 3.14159265358979323846;

double ml_lr_at(const ml_lr_schedule *s, int64_t step) {
  if (step < s->warmup_steps) return s->lr * (double)step / (double)s->warmup_steps;
  if (s->decay == ML_LR_CONSTANT) return s->lr;
  int64_t span = s->total_steps - 1 - s->warmup_steps;
  double p = (double)(step - s->warmup_steps) / (double)(span > 1 ? span : 1);
  if (p > 1.0) p = 1.0;
  double f = s->decay == ML_LR_LINEAR ? 1.0 - p : 0.5 * (1.0 + cos(k_pi * p));
  return s->min_lr + (s->lr - s->min_lr) * f;
}

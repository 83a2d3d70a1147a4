#include "common/rng.h"

#include <math.h>

uint64_t ml_rng_next(ml_rng *r) {
  uint64_t z = (r->state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

double ml_rng_uniform(ml_rng *r) { return (double)(ml_rng_next(r) >> 11) * 0x1.0p-53; }

double ml_rng_normal(ml_rng *r) {
  double u1 = 1.0 - ml_rng_uniform(r), u2 = ml_rng_uniform(r);
  return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

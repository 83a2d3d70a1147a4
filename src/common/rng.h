/* Deterministic random numbers (splitmix64), identical on every rank and
 * platform for a given seed: weight initialisation and data shuffling. */
#ifndef ML_RNG_H
#define ML_RNG_H

#include <stdint.h>

typedef struct ml_rng {
  uint64_t state;
} ml_rng;

static inline ml_rng ml_rng_seed(uint64_t seed) { return (ml_rng){seed * 0x9E3779B97F4A7C15ull + 1}; }
/* Next 64 random bits (Steele et al., splitmix64). */
uint64_t ml_rng_next(ml_rng *r);
/* Uniform in [0, 1) with 53 random bits. */
double ml_rng_uniform(ml_rng *r);
/* Standard normal (Box–Muller). */
double ml_rng_normal(ml_rng *r);

#endif

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

/* splitmix64's output function (Steele et al.): a bijection of the 64 bits
 * whose every output bit depends on every input bit. */
static inline uint64_t ml_rng_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* A counter-based draw (as Random123's Philox is drawn by (key, counter),
 * Salmon et al. 2011): 64 random bits that are a function of key and
 * counter alone, so any rank draws the value of any element in any order.
 * Keys chain: ml_rng_hash(ml_rng_hash(seed, a), b). */
static inline uint64_t ml_rng_hash(uint64_t key, uint64_t counter) {
  return ml_rng_mix(ml_rng_mix(key + 0x9E3779B97F4A7C15ull) ^ (counter * 0xD1B54A32D192ED03ull));
}

#endif

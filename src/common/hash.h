/* FNV-1a (64-bit, Fowler–Noll–Vo) over bytes: a fingerprint of host data
 * that ranks compare to check they passed or computed the same thing
 * (api/session.c's batches, engine/generate.c's tokens under tp). Not a
 * cryptographic hash: it detects accidental differences, not forged ones. */
#ifndef ML_HASH_H
#define ML_HASH_H

#include <stddef.h>
#include <stdint.h>

/* FNV-1a's offset basis: the hash of no bytes. */
#define ML_FNV_BASIS 1469598103934665603ull

/* h folded with bytes p[0 .. n−1] (start from ML_FNV_BASIS). */
static inline uint64_t ml_fnv1a(uint64_t h, const void *p, size_t n) {
  const unsigned char *b = p;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

#endif

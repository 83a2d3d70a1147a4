/* Open-addressing hash maps for the tokenizer (linear probing, power-of-two
 * tables at most half full):
 * - tok_strmap: byte string → int32 (the vocabulary, added tokens); keys are
 *   copied into one blob; a key may hold any bytes, NUL included.
 * - tok_u64map: uint64 → uint32 (BPE merge ranks keyed by an id pair, trie
 *   edges). The key UINT64_MAX is reserved (marks an empty slot).
 * Lookups never allocate and may run on several threads at once. */
#ifndef ML_TOK_HASH_H
#define ML_TOK_HASH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct tok_strent {
  uint64_t hash;
  size_t off; /* key bytes: blob[off .. off + len) */
  uint32_t len;
  int32_t val;
} tok_strent;

typedef struct tok_strmap {
  uint32_t *slots; /* entry index + 1; 0 = empty */
  size_t mask;     /* slots − 1 */
  tok_strent *ents;
  size_t n, ents_cap;
  char *blob;
  size_t blob_n, blob_cap;
} tok_strmap;

/* 64-bit hash of a byte string (the maps' hash; exported for caches). */
uint64_t tok_hash_bytes(const char *s, size_t len);

/* Set key → val (replacing the value of an existing key). Keys longer than
 * 2^32 − 1 bytes are refused. Errors: allocation. */
int tok_strmap_put(tok_strmap *m, const char *key, size_t len, int32_t val);
/* The value of key, or −1 when absent (values stored are ≥ 0). */
int32_t tok_strmap_get(const tok_strmap *m, const char *key, size_t len);
/* Key bytes of entry i (0 ≤ i < m->n, in insertion order). */
static inline const char *tok_strmap_key(const tok_strmap *m, size_t i) {
  return m->blob + m->ents[i].off;
}
void tok_strmap_free(tok_strmap *m);

typedef struct tok_u64map {
  uint64_t *keys;
  uint32_t *vals;
  size_t mask, n;
} tok_u64map;

int tok_u64map_put(tok_u64map *m, uint64_t key, uint32_t val);
/* Whether key is present; its value in *val. */
/* The slot a key hashes to (every key bit reaches the low bits). */
static inline size_t tok_u64_slot(uint64_t key, size_t mask) {
  uint64_t h = (key ^ key >> 31) * 0x9E3779B97F4A7C15ull;
  return (size_t)(h ^ h >> 29) & mask;
}

static inline bool tok_u64map_get(const tok_u64map *m, uint64_t key, uint32_t *val) {
  if (!m->keys) return false;
  size_t i = tok_u64_slot(key, m->mask);
  for (;;) {
    uint64_t k = m->keys[i];
    if (k == key) {
      *val = m->vals[i];
      return true;
    }
    if (k == UINT64_MAX) return false;
    i = (i + 1) & m->mask;
  }
}
void tok_u64map_free(tok_u64map *m);

#endif

#include "tokenizer/tok_hash.h"

#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "tokenizer/tok_util.h"

static inline uint64_t mix(uint64_t h) {
  h ^= h >> 32;
  h *= 0xD6E8FEB86659FD93ull;
  h ^= h >> 32;
  return h;
}

uint64_t tok_hash_bytes(const char *s, size_t len) {
  uint64_t h = 0x243F6A8885A308D3ull ^ (len * 0x9E3779B97F4A7C15ull);
  while (len >= 8) {
    uint64_t w;
    memcpy(&w, s, 8);
    h = mix(h ^ w) * 0x9E3779B97F4A7C15ull;
    s += 8;
    len -= 8;
  }
  uint64_t w = 0;
  memcpy(&w, s, len);
  return mix(h ^ w ^ ((uint64_t)len << 56));
}

static int str_rehash(tok_strmap *m, size_t slots) {
  uint32_t *s = ml_calloc(slots, sizeof *s, "tokenizer hash table");
  if (!s) return -1;
  for (size_t i = 0; i < m->n; i++) {
    size_t j = (size_t)m->ents[i].hash & (slots - 1);
    while (s[j]) j = (j + 1) & (slots - 1);
    s[j] = (uint32_t)(i + 1);
  }
  free(m->slots);
  m->slots = s;
  m->mask = slots - 1;
  return 0;
}

int32_t tok_strmap_get(const tok_strmap *m, const char *key, size_t len) {
  if (!m->slots) return -1;
  uint64_t h = tok_hash_bytes(key, len);
  size_t i = (size_t)h & m->mask;
  for (uint32_t e; (e = m->slots[i]) != 0; i = (i + 1) & m->mask) {
    const tok_strent *t = &m->ents[e - 1];
    if (t->hash == h && t->len == len && memcmp(m->blob + t->off, key, len) == 0) return t->val;
  }
  return -1;
}

int tok_strmap_put(tok_strmap *m, const char *key, size_t len, int32_t val) {
  if (len > UINT32_MAX) return ml_err("tokenizer: a token of %zu bytes is too long", len);
  if (!m->slots || 2 * (m->n + 1) > m->mask + 1) {
    if (m->n >= (size_t)UINT32_MAX - 1) return ml_err("tokenizer: more than 2^32 tokens");
    ML_TRY(str_rehash(m, m->slots ? 2 * (m->mask + 1) : 64));
  }
  uint64_t h = tok_hash_bytes(key, len);
  size_t i = (size_t)h & m->mask;
  for (uint32_t e; (e = m->slots[i]) != 0; i = (i + 1) & m->mask) {
    tok_strent *t = &m->ents[e - 1];
    if (t->hash == h && t->len == len && memcmp(m->blob + t->off, key, len) == 0) {
      t->val = val;
      return 0;
    }
  }
  ML_TRY(tok_reserve(&m->ents, &m->ents_cap, m->n + 1, sizeof *m->ents, "tokenizer vocabulary"));
  if (len > SIZE_MAX - m->blob_n) return ml_err("out of memory: tokenizer vocabulary");
  ML_TRY(tok_reserve(&m->blob, &m->blob_cap, m->blob_n + len, 1, "tokenizer vocabulary"));
  memcpy(m->blob + m->blob_n, key, len);
  m->ents[m->n] = (tok_strent){h, m->blob_n, (uint32_t)len, val};
  m->blob_n += len;
  m->slots[i] = (uint32_t)++m->n;
  return 0;
}

void tok_strmap_free(tok_strmap *m) {
  free(m->slots);
  free(m->ents);
  free(m->blob);
  memset(m, 0, sizeof *m);
}

static int u64_rehash(tok_u64map *m, size_t slots) {
  uint64_t *k = ml_malloc(slots * sizeof *k, "tokenizer hash table");
  uint32_t *v = ml_malloc(slots * sizeof *v, "tokenizer hash table");
  if (!k || !v) {
    free(k);
    free(v);
    return -1;
  }
  memset(k, 0xFF, slots * sizeof *k);
  for (size_t i = 0; m->keys && i <= m->mask; i++) {
    if (m->keys[i] == UINT64_MAX) continue;
    size_t j = tok_u64_slot(m->keys[i], slots - 1);
    while (k[j] != UINT64_MAX) j = (j + 1) & (slots - 1);
    k[j] = m->keys[i];
    v[j] = m->vals[i];
  }
  free(m->keys);
  free(m->vals);
  m->keys = k;
  m->vals = v;
  m->mask = slots - 1;
  return 0;
}

int tok_u64map_put(tok_u64map *m, uint64_t key, uint32_t val) {
  if (!m->keys || 2 * (m->n + 1) > m->mask + 1)
    ML_TRY(u64_rehash(m, m->keys ? 2 * (m->mask + 1) : 64));
  size_t i = tok_u64_slot(key, m->mask);
  while (m->keys[i] != UINT64_MAX && m->keys[i] != key) i = (i + 1) & m->mask;
  if (m->keys[i] == UINT64_MAX) m->n++;
  m->keys[i] = key;
  m->vals[i] = val;
  return 0;
}

void tok_u64map_free(tok_u64map *m) {
  free(m->keys);
  free(m->vals);
  memset(m, 0, sizeof *m);
}

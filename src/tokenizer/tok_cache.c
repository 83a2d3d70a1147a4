#include "tokenizer/tok_cache.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#define TOK_CACHE_SLOTS 16384

typedef struct slot {
  uint64_t serial, hash; /* serial 0: empty */
  uint8_t len, n;
  char key[TOK_CACHE_KEY];
  int32_t ids[TOK_CACHE_IDS];
} slot;

static atomic_uint_fast64_t next_serial = 1;
static pthread_key_t key;
static pthread_once_t key_once = PTHREAD_ONCE_INIT;

static void make_key(void) { pthread_key_create(&key, free); }

uint64_t tok_cache_serial(void) { return (uint64_t)atomic_fetch_add(&next_serial, 1); }

/* This thread's slots, made on first use; NULL when out of memory. */
static slot *slots(bool create) {
  pthread_once(&key_once, make_key);
  slot *s = pthread_getspecific(key);
  if (!s && create && (s = calloc(TOK_CACHE_SLOTS, sizeof *s)) && pthread_setspecific(key, s)) {
    free(s);
    s = NULL;
  }
  return s;
}

bool tok_cache_get(uint64_t serial, uint64_t h, const char *s, size_t len, int32_t *ids,
                   size_t *n) {
  slot *c = slots(false);
  if (!c || len > TOK_CACHE_KEY) return false;
  const slot *e = &c[h & (TOK_CACHE_SLOTS - 1)];
  if (e->serial != serial || e->hash != h || e->len != len || memcmp(e->key, s, len) != 0)
    return false;
  memcpy(ids, e->ids, e->n * sizeof *ids);
  *n = e->n;
  return true;
}

void tok_cache_put(uint64_t serial, uint64_t h, const char *s, size_t len, const int32_t *ids,
                   size_t n) {
  if (len > TOK_CACHE_KEY || n > TOK_CACHE_IDS) return;
  slot *c = slots(true);
  if (!c) return; /* no cache: every pre-token is merged */
  slot *e = &c[h & (TOK_CACHE_SLOTS - 1)];
  e->serial = serial;
  e->hash = h;
  e->len = (uint8_t)len;
  e->n = (uint8_t)n;
  memcpy(e->key, s, len);
  memcpy(e->ids, ids, n * sizeof *ids);
}

/* A per-thread cache of BPE results for short pre-tokens, as tokenizers
 * keeps one (BPE_LOCAL_CACHE, tokenizers/src/models/bpe/model.rs): text is
 * mostly the same few thousand words, and a hit costs a hash instead of a
 * merge. Direct-mapped, TOK_CACHE_SLOTS slots per thread (about 1.5 MiB,
 * made on a thread's first use and freed when the thread exits); a slot is
 * tagged with the tokenizer's serial number, so tokenizers never see each
 * other's entries and need not clear anything. A result depends only on the
 * pre-token, so the cache never changes ids. */
#ifndef ML_TOK_CACHE_H
#define ML_TOK_CACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define TOK_CACHE_KEY 30 /* longest pre-token cached, bytes */
#define TOK_CACHE_IDS 14 /* most ids of a cached result */

/* A new serial number for a tokenizer (never 0, never reused). */
uint64_t tok_cache_serial(void);

/* Look s[0..len) (hash h) up for tokenizer `serial`: true with its ids in
 * ids[0..*n) (room for TOK_CACHE_IDS). */
bool tok_cache_get(uint64_t serial, uint64_t h, const char *s, size_t len, int32_t *ids, size_t *n);

/* Remember s → ids[0..n) for `serial` (ignored when too long or when the
 * thread's cache cannot be allocated). */
void tok_cache_put(uint64_t serial, uint64_t h, const char *s, size_t len, const int32_t *ids,
                   size_t n);

#endif

/* The BPE model of tokenizer.json (tokenizers/src/models/bpe/model.rs,
 * word.rs, serialization.rs): vocabulary, merge ranks, and the encoding of
 * one pre-token.
 *
 * A word starts as one symbol per character (the vocabulary id of the
 * char; else its bytes as <0xNN> tokens under byte_fallback; else
 * unk_token, consecutive unknowns fused into one under fuse_unk; else the
 * char is dropped, as tokenizers drops it), then merge_all applies merges
 * by a min-heap on (rank, position), as word.rs does, stale entries
 * skipped. ignore_merges: a pre-token that is itself in the vocabulary is
 * one token. Merge ranks are list positions; a pair listed twice keeps its
 * last rank (tokenizers collects the list into a hash map).
 *
 * Byte-level mode (a ByteLevel pre-tokenizer feeds the model): the model
 * takes raw bytes and reads byte b as the char tok_byte_to_cp(b), the
 * vocabulary being looked up by the raw bytes its tokens stand for, so the
 * mapped string is never built. */
#ifndef ML_TOK_BPE_H
#define ML_TOK_BPE_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tokenizer/tok_hash.h"

typedef struct tok_bpe {
  tok_strmap vocab;   /* token → id, as written in tokenizer.json */
  size_t vocab_len;   /* distinct tokens (tokenizers' get_vocab_size) */
  int32_t max_id;     /* largest id, −1 when empty */
  int32_t *id_ent;    /* id → index of its vocab entry, −1 (max_id + 1 of them: at most
                         2 · vocab_len + 256, tok_id) */
  tok_u64map merges;  /* (left id << 32 | right id) → rank */
  int32_t *merge_new; /* rank → id of the merged token */
  size_t n_merges;
  const char *unk; /* unk_token (into the JSON) or NULL */
  size_t unk_len;
  bool byte_fallback, fuse_unk, ignore_merges;
  int32_t byte_fb[256]; /* id of "<0xNN>", −1 when absent */
  bool byte_level;      /* the byte-level mode above */
  tok_strmap raw_vocab; /* byte-level: raw bytes of a token → id */
  int32_t byte_id[256]; /* byte-level: id of the char byte b stands for, −1 if none */
  uint64_t serial;      /* this model's tag in the per-thread cache (tok_cache.h) */
} tok_bpe;

/* Read `model` (tokenizer.json's "model" object) of `file`. Refused: a type
 * other than "BPE", dropout other than null or 0, a non-empty
 * continuing_subword_prefix or end_of_word_suffix, vocabulary ids outside
 * [0, 2 · its number of tokens + 256) (tok_id), merges that are not "a b"
 * strings or [a, b] pairs, a merge naming a token (or forming one) not in
 * the vocabulary. */
int tok_bpe_load(tok_bpe *m, const json_t *model, const char *file);

/* Switch to byte-level mode (builds raw_vocab and byte_id). */
int tok_bpe_set_byte_level(tok_bpe *m);

void tok_bpe_free(tok_bpe *m);

/* The token of id `id` (its bytes, *len of them), or NULL. */
const char *tok_bpe_token(const tok_bpe *m, int32_t id, size_t *len);

/* Work space of tok_bpe_encode, one per thread. */
typedef struct tok_bpe_work {
  struct tok_sym *syms;
  size_t syms_cap;
  uint64_t *heap;
  size_t heap_cap;
} tok_bpe_work;

void tok_bpe_work_free(tok_bpe_work *w);

/* Encode one pre-token s[0..len) (valid UTF-8; raw bytes in byte-level
 * mode) and append its ids to ids[*n..] (growing *ids / *cap). Errors:
 * unk_token needed but not in the vocabulary, allocation. Short pre-tokens'
 * results are cached per thread (tok_cache.h). */
int tok_bpe_encode(const tok_bpe *m, tok_bpe_work *w, const char *s, size_t len, int32_t **ids,
                   size_t *n, size_t *cap);

#endif

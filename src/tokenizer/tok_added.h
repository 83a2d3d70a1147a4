/* Added tokens (tokenizers/src/tokenizer/added_vocabulary.rs): tokens
 * split out of the text before the pre-tokenizer, each then one id.
 *
 * Ids as `tokenizers` assigns them on load (add_tokens): the token's id in
 * the model vocabulary (or an earlier added token's), else the next id
 * from the vocabulary's size on; the "id" written in the file is not read
 * (tokenizers only warns when it differs). Tokens with normalized = false
 * are matched in the raw text first; the pieces between them are
 * normalized, and tokens with normalized = true are matched in those, by
 * their content normalized. Matching is leftmost-longest, non-overlapping
 * (daachorse MatchKind::LeftmostLongest); a single_word match with a word
 * char (Rust regex \w) just before or after it is skipped (the search goes
 * on after it), lstrip / rstrip take the whitespace (\s) before / after
 * into the token. `special` only matters to decoding. */
#ifndef ML_TOK_ADDED_H
#define ML_TOK_ADDED_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tokenizer/tok_bpe.h"
#include "tokenizer/tok_hash.h"
#include "tokenizer/tok_norm.h"
#include "tokenizer/tok_regex.h"

typedef struct tok_added_token {
  const char *content; /* into the JSON document */
  size_t len;
  int32_t id;
  bool special, normalized, lstrip, rstrip, single_word;
  char *normed; /* normalized = true: the content normalized, when it differs (owned); the
                   string decoding shows (simple_id_to_token) */
  size_t normed_len;
} tok_added_token;

/* A byte trie of the tokens' match strings. */
typedef struct tok_trie {
  tok_u64map edges; /* node << 8 | byte → child node */
  int32_t *term;    /* node → index of the token ending there, −1 */
  size_t nodes, cap;
  bool first[256]; /* bytes that start a token */
} tok_trie;

typedef struct tok_added {
  tok_added_token *tok;
  size_t n, cap;
  tok_u64map by_id; /* id → index in tok */
  tok_trie raw;     /* normalized = false, matched in the raw text */
  tok_trie norm;    /* normalized = true, by their normalized content */
  tok_regex word;   /* Rust regex's Unicode \w, one char */
  int32_t max_id;   /* −1 when none */
} tok_added;

/* A piece of text (id −1) or an added token's span, [start, end). */
typedef struct tok_aspan {
  size_t start, end;
  int32_t id;
} tok_aspan;

/* Read tokenizer.json's "added_tokens" (NULL: none) of `file`, ids from
 * `model`, normalized contents by `nm`. Errors: malformed entries. */
int tok_added_load(tok_added *a, const json_t *list, const tok_bpe *model, const tok_normalizer *nm,
                   const char *file);
void tok_added_free(tok_added *a);

/* The added token of id `id`, or NULL. */
const tok_added_token *tok_added_by_id(const tok_added *a, int32_t id);

/* added_vocabulary.rs find_matches on s[0..len) with the raw (normalized =
 * false) or the normalized trie: spans covering the text in order, tokens
 * with their id, appended to *sp. */
int tok_added_split(const tok_added *a, bool normalized, tok_match_state *ms, const char *s,
                    size_t len, tok_aspan **sp, size_t *n, size_t *cap);

#endif

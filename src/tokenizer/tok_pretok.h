/* Pre-tokenizers of tokenizer.json (tokenizers/src/pre_tokenizers/):
 * - Split (split.rs): a {"String": s} or {"Regex": r} pattern, `invert`,
 *   and the delimiter behaviour Removed / Isolated / MergedWithPrevious /
 *   MergedWithNext / Contiguous (tokenizer/normalizer.rs, split);
 * - ByteLevel (byte_level.rs): add_prefix_space (a space before every
 *   piece that does not start with one), use_regex (then the GPT-2 regex
 *   splits, Isolated), and the byte → char map, which the BPE model applies
 *   itself (tok_bpe.h, byte-level mode), so it must be the last step;
 * - Digits (digits.rs): numeric chars (Rust char::is_numeric: Nd, Nl, No)
 *   isolated one by one, or runs of them (individual_digits false);
 * - Sequence of these, applied in order.
 * Every step works on each piece of the previous one independently; empty
 * pieces are dropped (tokenizer/pre_tokenizer.rs, split). */
#ifndef ML_TOK_PRETOK_H
#define ML_TOK_PRETOK_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "tokenizer/tok_regex.h"

typedef enum {
  TOK_REMOVED,
  TOK_ISOLATED,
  TOK_MERGED_WITH_PREVIOUS,
  TOK_MERGED_WITH_NEXT,
  TOK_CONTIGUOUS
} tok_behavior;

typedef enum { TOK_PRE_SPLIT, TOK_PRE_BYTELEVEL, TOK_PRE_DIGITS } tok_pre_kind;

typedef struct tok_pre_step {
  tok_pre_kind kind;
  tok_regex re; /* Split: its pattern; ByteLevel with use_regex: GPT-2's */
  tok_behavior behavior;
  bool invert;
  bool add_prefix_space, use_regex; /* ByteLevel */
  bool individual_digits;           /* Digits */
} tok_pre_step;

typedef struct tok_pretok {
  tok_pre_step *steps;
  size_t n, cap;   /* n = 0: no pre-tokenizer */
  bool byte_level; /* the last step is ByteLevel */
} tok_pretok;

/* Read tokenizer.json's "pre_tokenizer" (`j`: NULL or null for none) of
 * `file`. Errors: an unsupported type (named, with its JSON path), a
 * ByteLevel step that is not the last, a bad behaviour or pattern. */
int tok_pretok_load(tok_pretok *p, const json_t *j, const char *file);
void tok_pretok_free(tok_pretok *p);

/* The pieces step `st` (Split or Digits) cuts s[0..len) into, after its
 * behaviour, appended to *sp as spans; empty pieces are left out, the
 * `match` flags are meaningless. Errors: allocation, matching. */
int tok_pretok_split(const tok_pre_step *st, tok_match_state *ms, const char *s, size_t len,
                     tok_span **sp, size_t *n, size_t *cap);

#endif

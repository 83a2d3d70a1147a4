/* Normalizers of tokenizer.json (tokenizers/src/normalizers/): NFC
 * (unicode.rs; utf8proc's composition), Replace (replace.rs: a string or a
 * regex pattern, every non-overlapping match, left to right, replaced by
 * `content`), Prepend (prepend.rs: `prepend` before any non-empty text),
 * Sequence of these (in order). Anything else is refused at load. */
#ifndef ML_TOK_NORM_H
#define ML_TOK_NORM_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "tokenizer/tok_regex.h"
#include "tokenizer/tok_util.h"

typedef enum { TOK_NORM_NFC, TOK_NORM_REPLACE, TOK_NORM_PREPEND } tok_norm_kind;

typedef struct tok_norm_step {
  tok_norm_kind kind;
  const char *text; /* Replace: the string pattern (NULL for a regex); Prepend: the prefix */
  size_t text_len;
  const char *content; /* Replace: the replacement */
  size_t content_len;
  tok_regex re; /* Replace with a {"Regex": ...} pattern */
} tok_norm_step;

typedef struct tok_normalizer {
  tok_norm_step *steps; /* strings point into the JSON document, which outlives this */
  size_t n, cap;        /* n = 0: no normalizer */
} tok_normalizer;

/* Read tokenizer.json's "normalizer" (`j`: NULL or null for none) of
 * `file`. Errors: an unsupported type (named, with its JSON path), a
 * malformed field, an empty Replace pattern, a regex PCRE2 refuses. */
int tok_norm_load(tok_normalizer *nm, const json_t *j, const char *file);
void tok_norm_free(tok_normalizer *nm);

/* Normalize s[0..len) (valid UTF-8) into *out (replacing its contents);
 * *tmp is scratch. Errors: allocation. */
int tok_norm_apply(const tok_normalizer *nm, tok_match_state *st, const char *s, size_t len,
                   tok_buf *out, tok_buf *tmp);

#endif

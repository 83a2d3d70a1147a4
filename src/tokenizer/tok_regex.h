/* Regular expressions of tokenizer.json (Split pre-tokenizer, Replace
 * normalizer) on PCRE2 (UTF + UCP, JIT), matching as `tokenizers` matches
 * with Oniguruma (tokenizers/src/utils/onig.rs, Ruby syntax):
 * - escapes whose meaning differs between the two engines are rewritten to
 *   Oniguruma's Unicode definitions: \s = [\t\n\v\f\r \x{85}\p{Z}],
 *   \w = [\p{L}\p{M}\p{N}\p{Pc}], \d = \p{Nd}, \v = U+000B, \uHHHH;
 *   ^ and $ match at line starts and ends (Ruby); escapes with no
 *   equivalent (\b, \h, \R, \X, \K, ...) are refused at load;
 * - successive matches follow onig's find_iter: an empty match right where
 *   the previous match ended is skipped by one character.
 * The one difference left is the Unicode version of the property tables
 * (PCRE2's against Oniguruma's), for characters assigned in between. */
#ifndef ML_TOK_REGEX_H
#define ML_TOK_REGEX_H

#include <stdbool.h>
#include <stddef.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

typedef struct tok_regex {
  pcre2_code *code;
  bool jit; /* JIT-compiled */
} tok_regex;

/* A match or gap of a split: bytes [start, end) of the searched text. */
typedef struct tok_span {
  size_t start, end;
  bool match;
} tok_span;

/* Per-thread matching state (match data, a JIT stack made on demand). */
typedef struct tok_match_state {
  pcre2_match_data *md;
  pcre2_match_context *mctx;
  pcre2_jit_stack *stack;
} tok_match_state;

/* Compile `pattern` (len bytes); literal: match the string itself
 * (tokenizers' {"String": ...} patterns). Errors name file and field
 * (e.g. "pre_tokenizer.pattern.Regex"), the pattern, and PCRE2's reason. */
int tok_regex_compile(tok_regex *re, const char *pattern, size_t len, bool literal,
                      const char *file, const char *field);
void tok_regex_free(tok_regex *re);

/* Whether `re` matches at the very start of s[0..len) (an anchored
 * match: the single_word / strip checks of added tokens). */
int tok_regex_match_at_start(const tok_regex *re, tok_match_state *st, const char *s, size_t len,
                             bool *matched);

/* tokenizers' Pattern::find_matches for a regex: the spans covering
 * s[0..len) in order, alternating gaps (match false) and matches (match
 * true), appended to *spans (n, cap). Empty text gives one empty gap. */
int tok_regex_find_matches(const tok_regex *re, tok_match_state *st, const char *s, size_t len,
                           tok_span **spans, size_t *n, size_t *cap);

void tok_match_state_free(tok_match_state *st);

#endif

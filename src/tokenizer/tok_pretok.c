#include "tokenizer/tok_pretok.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "common/status.h"
#include "tokenizer/tok_util.h"

/* byte_level.rs: the GPT-2 pre-tokenization regex */
static const char GPT2_RE[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

static int add_step(tok_pretok *p, const json_t *j, const char *field, const char *file);
static int add_item(void *p, const json_t *j, const char *field, const char *file) {
  return add_step(p, j, field, file);
}

static int push_step(tok_pretok *p, tok_pre_step *st) {
  if (tok_reserve(&p->steps, &p->cap, p->n + 1, sizeof *p->steps, "pre-tokenizers")) {
    tok_regex_free(&st->re);
    return -1;
  }
  p->steps[p->n++] = *st;
  return 0;
}

static int load_split(tok_pre_step *st, const json_t *j, const char *field, const char *file) {
  static const char *const names[] = {"Removed", "Isolated", "MergedWithPrevious", "MergedWithNext",
                                      "Contiguous"};
  char f[256];
  const json_t *b = json_object_get(j, "behavior");
  int k = 0;
  while (k < 5 && !(json_is_string(b) && strcmp(json_string_value(b), names[k]) == 0)) k++;
  if (k == 5) {
    snprintf(f, sizeof f, "%s.behavior", field);
    return tok_bad(file, f, b,
                   "Removed, Isolated, MergedWithPrevious, MergedWithNext or Contiguous");
  }
  st->behavior = (tok_behavior)k;
  ML_TRY(tok_bool(file, j, field, "invert", false, &st->invert));
  const json_t *pat = json_object_get(j, "pattern");
  const json_t *s = json_object_get(pat, "String"), *r = json_object_get(pat, "Regex");
  if (json_is_string(s) && json_string_length(s) > 0) {
    snprintf(f, sizeof f, "%s.pattern.String", field);
    return tok_regex_compile(&st->re, json_string_value(s), json_string_length(s), true, file, f);
  }
  if (json_is_string(r) && json_string_length(r) > 0) {
    snprintf(f, sizeof f, "%s.pattern.Regex", field);
    return tok_regex_compile(&st->re, json_string_value(r), json_string_length(r), false, file, f);
  }
  snprintf(f, sizeof f, "%s.pattern", field);
  return tok_bad(file, f, pat, "{\"String\": s} or {\"Regex\": r}, not empty");
}

static int add_step(tok_pretok *p, const json_t *j, const char *field, const char *file) {
  char f[256];
  if (p->byte_level) {
    snprintf(f, sizeof f, "%s", field);
    return tok_bad(file, f, j,
                   "nothing after the ByteLevel pre-tokenizer (meshlm applies its "
                   "byte map in the model, so ByteLevel must come last)");
  }
  const json_t *type = json_object_get(j, "type");
  const char *t = json_is_string(type) ? json_string_value(type) : "";
  tok_pre_step st = {0};
  if (strcmp(t, "Sequence") == 0)
    return tok_each_item(j, "pretokenizers", field, file, "an array of pre-tokenizers", add_item,
                         p);
  if (strcmp(t, "Split") == 0) {
    st.kind = TOK_PRE_SPLIT;
    if (load_split(&st, j, field, file)) {
      tok_regex_free(&st.re);
      return -1;
    }
  } else if (strcmp(t, "ByteLevel") == 0) {
    st.kind = TOK_PRE_BYTELEVEL;
    st.behavior = TOK_ISOLATED;
    ML_TRY(tok_bool(file, j, field, "add_prefix_space", true, &st.add_prefix_space));
    ML_TRY(tok_bool(file, j, field, "use_regex", true, &st.use_regex));
    snprintf(f, sizeof f, "%s (GPT-2 regex)", field);
    if (st.use_regex) ML_TRY(tok_regex_compile(&st.re, GPT2_RE, strlen(GPT2_RE), false, file, f));
    p->byte_level = true;
  } else if (strcmp(t, "Digits") == 0) {
    st.kind = TOK_PRE_DIGITS;
    ML_TRY(tok_bool(file, j, field, "individual_digits", false, &st.individual_digits));
    st.behavior = st.individual_digits ? TOK_ISOLATED : TOK_CONTIGUOUS;
  } else {
    snprintf(f, sizeof f, "%s.type", field);
    return tok_bad(file, f, type,
                   "\"Split\", \"ByteLevel\", \"Digits\" or \"Sequence\" (the pre-tokenizers "
                   "meshlm implements)");
  }
  return push_step(p, &st);
}

int tok_pretok_load(tok_pretok *p, const json_t *j, const char *file) {
  memset(p, 0, sizeof *p);
  if (!j || json_is_null(j)) return 0;
  if (!json_is_object(j)) return tok_bad(file, "pre_tokenizer", j, "an object or null");
  return add_step(p, j, "pre_tokenizer", file);
}

void tok_pretok_free(tok_pretok *p) {
  for (size_t i = 0; i < p->n; i++) tok_regex_free(&p->steps[i].re);
  free(p->steps);
  memset(p, 0, sizeof *p);
}

static int push(tok_span **sp, size_t *n, size_t *cap, size_t a, size_t b, bool m) {
  ML_TRY(tok_reserve(sp, cap, *n + 1, sizeof **sp, "tokenizer splits"));
  (*sp)[(*n)++] = (tok_span){a, b, m};
  return 0;
}

/* pattern.rs for a char predicate (char::is_numeric): each numeric char a
 * match, the text between a gap. */
static int numeric_matches(const char *s, size_t len, tok_span **sp, size_t *n, size_t *cap) {
  if (len == 0) return push(sp, n, cap, 0, 0, false);
  size_t last = 0;
  for (size_t i = 0; i < len;) {
    size_t cl = tok_utf8_len((unsigned char)s[i]);
    utf8proc_category_t c = utf8proc_category((utf8proc_int32_t)tok_utf8_decode(s + i));
    if (c == UTF8PROC_CATEGORY_ND || c == UTF8PROC_CATEGORY_NL || c == UTF8PROC_CATEGORY_NO) {
      if (last < i) ML_TRY(push(sp, n, cap, last, i, false));
      ML_TRY(push(sp, n, cap, i, i + cl, true));
      last = i + cl;
    }
    i += cl;
  }
  if (last < len) ML_TRY(push(sp, n, cap, last, len, false));
  return 0;
}

int tok_pretok_split(const tok_pre_step *st, tok_match_state *ms, const char *s, size_t len,
                     tok_span **sp, size_t *n, size_t *cap) {
  size_t first = *n;
  if (st->kind == TOK_PRE_DIGITS)
    ML_TRY(numeric_matches(s, len, sp, n, cap));
  else
    ML_TRY(tok_regex_find_matches(&st->re, ms, s, len, sp, n, cap));
  tok_span *m = *sp + first;
  size_t k = *n - first, out = 0;
  if (st->invert)
    for (size_t i = 0; i < k; i++) m[i].match = !m[i].match;
  /* normalizer.rs split: fold the spans in place by the behaviour */
  bool prev = false;
  switch (st->behavior) {
    case TOK_ISOLATED: out = k; break;
    case TOK_REMOVED:
      for (size_t i = 0; i < k; i++)
        if (!m[i].match) m[out++] = m[i];
      break;
    case TOK_CONTIGUOUS:
    case TOK_MERGED_WITH_PREVIOUS:
      for (size_t i = 0; i < k; i++) {
        bool join = st->behavior == TOK_CONTIGUOUS ? m[i].match == prev : m[i].match && !prev;
        prev = m[i].match;
        if (join && out > 0)
          m[out - 1].end = m[i].end;
        else
          m[out++] = m[i];
      }
      break;
    case TOK_MERGED_WITH_NEXT: /* the same from the right, merging into the next piece */
      for (size_t i = k; i-- > 0;) {
        bool join = m[i].match && !prev;
        prev = m[i].match;
        if (join && out > 0)
          m[k - out].start = m[i].start;
        else
          m[k - 1 - out++] = m[i];
      }
      memmove(m, m + k - out, out * sizeof *m);
      break;
  }
  size_t kept = 0; /* drop empty pieces */
  for (size_t i = 0; i < out; i++)
    if (m[i].end > m[i].start) m[kept++] = m[i];
  *n = first + kept;
  return 0;
}

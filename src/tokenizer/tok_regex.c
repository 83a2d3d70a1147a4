#include "tokenizer/tok_regex.h"

#include <stdio.h>
#include <string.h>

#include "common/status.h"
#include "tokenizer/tok_util.h"

/* Oniguruma's Unicode classes (doc/RE of Oniguruma 6.9, "Unicode case"),
 * written as class bodies so that they nest inside [...] too. */
#define ONIG_SPACE "\\t\\n\\x0B\\f\\r\\x20\\x{85}\\p{Z}"
#define ONIG_WORD "\\p{L}\\p{M}\\p{N}\\p{Pc}"

/* Rewrite an Oniguruma (Ruby syntax) pattern into PCRE2 syntax in *out.
 * Returns 0, or -1 naming the escape that has no PCRE2 equivalent. */
static int rewrite(const char *p, size_t len, tok_buf *out, const char *file, const char *field) {
  int depth = 0; /* inside a character class when > 0 */
  for (size_t i = 0; i < len; i++) {
    char c = p[i];
    if (c == '[')
      depth++;
    else if (c == ']' && depth > 0)
      depth--;
    if (c != '\\' || i + 1 == len) {
      ML_TRY(tok_buf_put(out, &c, 1));
      continue;
    }
    char e = p[++i];
    const char *body = NULL, *neg = NULL;
    switch (e) {
      case 's': body = ONIG_SPACE; break;
      case 'S': neg = ONIG_SPACE; break;
      case 'w': body = ONIG_WORD; break;
      case 'W': neg = ONIG_WORD; break;
      case 'd': body = "\\p{Nd}"; break;
      case 'D': neg = "\\p{Nd}"; break;
      case 'v': body = "\\x0B"; break;
      case 'u': /* \uHHHH (Ruby) → \x{HHHH} */
        if (i + 4 < len && strspn(p + i + 1, "0123456789abcdefABCDEF") >= 4) {
          char hex[16];
          snprintf(hex, sizeof hex, "\\x{%.4s}", p + i + 1);
          ML_TRY(tok_buf_put(out, hex, strlen(hex)));
          i += 4;
          continue;
        }
        break;
      case 'b':
      case 'B':
      case 'h':
      case 'H':
      case 'R':
      case 'X':
      case 'K':
      case 'N':
      case 'O':
      case 'y':
      case 'Y':
      case 'g':
      case 'k':
      case 'G':
        return ml_err(
            "%s: field '%s': found the escape \\%c in the pattern %.*s, expected a "
            "pattern without it (Oniguruma and PCRE2 read it differently; meshlm "
            "does not implement it)",
            file, field, e, (int)(len > 200 ? 200 : len), p);
      default: break;
    }
    if (body || neg) {
      /* a class body: bare outside a class, bracketed inside one; a negated
       * class inside a class cannot be written as a body, so refuse it */
      if (neg && depth > 0)
        return ml_err(
            "%s: field '%s': found \\%c inside a character class in %.*s, expected it "
            "outside one (meshlm does not implement it)",
            file, field, e, (int)(len > 200 ? 200 : len), p);
      if (depth == 0) ML_TRY(tok_buf_put(out, neg ? "[^" : "[", neg ? 2 : 1));
      const char *b = body ? body : neg;
      ML_TRY(tok_buf_put(out, b, strlen(b)));
      if (depth == 0) ML_TRY(tok_buf_put(out, "]", 1));
      continue;
    }
    char esc[2] = {'\\', e};
    ML_TRY(tok_buf_put(out, esc, 2));
  }
  return 0;
}

int tok_regex_compile(tok_regex *re, const char *pattern, size_t len, bool literal,
                      const char *file, const char *field) {
  memset(re, 0, sizeof *re);
  tok_buf pat = {0};
  uint32_t opts = PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK;
  if (literal) {
    opts = PCRE2_UTF | PCRE2_NO_UTF_CHECK | PCRE2_LITERAL; /* UCP is not allowed here */
    if (tok_buf_put(&pat, pattern, len)) return -1;
  } else {
    opts |= PCRE2_MULTILINE;
    if (rewrite(pattern, len, &pat, file, field)) {
      tok_buf_free(&pat);
      return -1;
    }
  }
  pcre2_compile_context *cc = pcre2_compile_context_create(NULL);
  if (!cc) {
    tok_buf_free(&pat);
    return ml_err("out of memory compiling a tokenizer regex");
  }
  pcre2_set_newline(cc, PCRE2_NEWLINE_LF);
  int err = 0;
  PCRE2_SIZE at = 0;
  re->code = pcre2_compile((PCRE2_SPTR)(pat.p ? pat.p : ""), pat.n, opts, &err, &at, cc);
  pcre2_compile_context_free(cc);
  tok_buf_free(&pat);
  if (!re->code) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    return ml_err("%s: field '%s': found the pattern %.*s, expected a regex PCRE2 compiles (%s)",
                  file, field, (int)(len > 200 ? 200 : len), pattern, (const char *)msg);
  }
  /* without JIT (a PCRE2 built without it) the interpreter gives the same matches */
  re->jit = pcre2_jit_compile(re->code, PCRE2_JIT_COMPLETE) == 0;
  return 0;
}

void tok_regex_free(tok_regex *re) {
  pcre2_code_free(re->code);
  re->code = NULL;
}

void tok_match_state_free(tok_match_state *st) {
  pcre2_match_data_free(st->md);
  pcre2_match_context_free(st->mctx);
  pcre2_jit_stack_free(st->stack);
  memset(st, 0, sizeof *st);
}

/* One search from `from`: 1 with the match in *s, *e; 0 none; -1 error.
 * A JIT stack overflow retries once with a 64 MiB stack. */
static int search(const tok_regex *re, tok_match_state *st, const char *text, size_t len,
                  size_t from, uint32_t opts, size_t *s, size_t *e) {
  if (!st->md && !(st->md = pcre2_match_data_create(1, NULL)))
    return ml_err("out of memory: regex match data");
  for (;;) {
    /* pcre2_jit_match skips pcre2_match's checks; it cannot anchor at match time */
    int rc = re->jit && !(opts & PCRE2_ANCHORED)
                 ? pcre2_jit_match(re->code, (PCRE2_SPTR)text, len, from, opts, st->md, st->mctx)
                 : pcre2_match(re->code, (PCRE2_SPTR)text, len, from, opts | PCRE2_NO_UTF_CHECK,
                               st->md, st->mctx);
    if (rc >= 0) {
      PCRE2_SIZE *ov = pcre2_get_ovector_pointer(st->md);
      *s = ov[0];
      *e = ov[1];
      return 1;
    }
    if (rc == PCRE2_ERROR_NOMATCH) return 0;
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT && !st->stack) {
      st->mctx = pcre2_match_context_create(NULL);
      st->stack = pcre2_jit_stack_create(32 * 1024, 64 * 1024 * 1024, NULL);
      if (!st->mctx || !st->stack) return ml_err("out of memory: regex JIT stack");
      pcre2_jit_stack_assign(st->mctx, NULL, st->stack);
      continue;
    }
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(rc, msg, sizeof msg);
    return ml_err("tokenizer regex: matching failed at byte %zu: %s", from, (const char *)msg);
  }
}

int tok_regex_match_at_start(const tok_regex *re, tok_match_state *st, const char *s, size_t len,
                             bool *matched) {
  size_t a = 0, b = 0;
  int rc = search(re, st, s, len, 0, PCRE2_ANCHORED, &a, &b);
  if (rc < 0) return -1;
  *matched = rc == 1;
  return 0;
}

static int push(tok_span **spans, size_t *n, size_t *cap, size_t a, size_t b, bool m) {
  ML_TRY(tok_reserve(spans, cap, *n + 1, sizeof **spans, "tokenizer splits"));
  (*spans)[(*n)++] = (tok_span){a, b, m};
  return 0;
}

int tok_regex_find_matches(const tok_regex *re, tok_match_state *st, const char *s, size_t len,
                           tok_span **spans, size_t *n, size_t *cap) {
  if (len == 0) return push(spans, n, cap, 0, 0, false);
  /* onig's FindMatches: search from last_end; an empty match at the end of
   * the previous match is dropped and the search moves one char on */
  size_t prev = 0, last_end = 0;
  bool have_last = false;
  size_t last_match_end = 0;
  while (last_end <= len) {
    size_t a = 0, b = 0;
    int rc = search(re, st, s, len, last_end, 0, &a, &b);
    if (rc < 0) return -1;
    if (rc == 0) break;
    if (a == b && have_last && last_match_end == b) {
      last_end += last_end < len ? tok_utf8_len((unsigned char)s[last_end]) : 1;
      continue;
    }
    last_end = b;
    last_match_end = b;
    have_last = true;
    if (prev != a) ML_TRY(push(spans, n, cap, prev, a, false));
    ML_TRY(push(spans, n, cap, a, b, true));
    prev = b;
  }
  if (prev != len) ML_TRY(push(spans, n, cap, prev, len, false));
  return 0;
}

#define _GNU_SOURCE /* memmem */
#include "tokenizer/tok_norm.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "common/status.h"

static int add_step(tok_normalizer *nm, const json_t *j, const char *field, const char *file);
static int add_item(void *nm, const json_t *j, const char *field, const char *file) {
  return add_step(nm, j, field, file);
}

static int load_sequence(tok_normalizer *nm, const json_t *j, const char *field, const char *file) {
  return tok_each_item(j, "normalizers", field, file, "an array of normalizers", add_item, nm);
}

/* A {"String": s} or {"Regex": r} pattern object. */
static int load_pattern(tok_norm_step *st, const json_t *pat, const char *field, const char *file) {
  char f[256];
  snprintf(f, sizeof f, "%s.pattern", field);
  const json_t *s = json_object_get(pat, "String"), *r = json_object_get(pat, "Regex");
  if (json_is_string(s) && json_string_length(s) > 0) {
    st->text = json_string_value(s);
    st->text_len = json_string_length(s);
    return 0;
  }
  if (json_is_string(r) && json_string_length(r) > 0) {
    snprintf(f, sizeof f, "%s.pattern.Regex", field);
    return tok_regex_compile(&st->re, json_string_value(r), json_string_length(r), false, file, f);
  }
  return tok_bad(file, f, pat, "{\"String\": s} or {\"Regex\": r}, not empty");
}

static int add_step(tok_normalizer *nm, const json_t *j, const char *field, const char *file) {
  char f[256];
  snprintf(f, sizeof f, "%s.type", field);
  const json_t *type = json_object_get(j, "type");
  const char *t = json_is_string(type) ? json_string_value(type) : "";
  if (strcmp(t, "Sequence") == 0) return load_sequence(nm, j, field, file);
  tok_norm_step st = {0};
  if (strcmp(t, "NFC") == 0) {
    st.kind = TOK_NORM_NFC;
  } else if (strcmp(t, "Replace") == 0) {
    st.kind = TOK_NORM_REPLACE;
    ML_TRY(load_pattern(&st, json_object_get(j, "pattern"), field, file));
    if (tok_str(file, j, field, "content", &st.content, &st.content_len)) {
      tok_regex_free(&st.re);
      return -1;
    }
  } else if (strcmp(t, "Prepend") == 0) {
    st.kind = TOK_NORM_PREPEND;
    ML_TRY(tok_str(file, j, field, "prepend", &st.text, &st.text_len));
  } else {
    return tok_bad(file, f, type,
                   "\"NFC\", \"Replace\", \"Prepend\" or \"Sequence\" (the normalizers meshlm "
                   "implements)");
  }
  if (tok_reserve(&nm->steps, &nm->cap, nm->n + 1, sizeof *nm->steps, "normalizers")) {
    tok_regex_free(&st.re);
    return -1;
  }
  nm->steps[nm->n++] = st;
  return 0;
}

int tok_norm_load(tok_normalizer *nm, const json_t *j, const char *file) {
  memset(nm, 0, sizeof *nm);
  if (!j || json_is_null(j)) return 0;
  if (!json_is_object(j)) return tok_bad(file, "normalizer", j, "an object or null");
  return add_step(nm, j, "normalizer", file);
}

void tok_norm_free(tok_normalizer *nm) {
  for (size_t i = 0; i < nm->n; i++) tok_regex_free(&nm->steps[i].re);
  free(nm->steps);
  memset(nm, 0, sizeof *nm);
}

static bool ascii(const char *s, size_t len) {
  for (size_t i = 0; i < len; i++)
    if ((unsigned char)s[i] >= 0x80) return false;
  return true;
}

static int nfc(const char *s, size_t len, tok_buf *out) {
  if (ascii(s, len)) return tok_buf_put(out, s, len); /* NFC leaves ASCII alone */
  utf8proc_uint8_t *d = NULL;
  utf8proc_ssize_t n = utf8proc_map((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)len, &d,
                                    UTF8PROC_STABLE | UTF8PROC_COMPOSE);
  if (n < 0) return ml_err("NFC normalizer: %s", utf8proc_errmsg(n));
  int rc = tok_buf_put(out, (const char *)d, (size_t)n);
  free(d);
  return rc;
}

static int replace(const tok_norm_step *st, tok_match_state *ms, const char *s, size_t len,
                   tok_buf *out) {
  if (st->text) {
    size_t i = 0;
    for (;;) {
      const char *hit =
          len - i >= st->text_len ? memmem(s + i, len - i, st->text, st->text_len) : NULL;
      size_t end = hit ? (size_t)(hit - s) : len;
      ML_TRY(tok_buf_put(out, s + i, end - i));
      if (!hit) return 0;
      ML_TRY(tok_buf_put(out, st->content, st->content_len));
      i = end + st->text_len;
    }
  }
  tok_span *sp = NULL;
  size_t n = 0, cap = 0;
  int rc = tok_regex_find_matches(&st->re, ms, s, len, &sp, &n, &cap);
  for (size_t k = 0; k < n && rc == 0; k++)
    rc = sp[k].match ? tok_buf_put(out, st->content, st->content_len)
                     : tok_buf_put(out, s + sp[k].start, sp[k].end - sp[k].start);
  free(sp);
  return rc;
}

int tok_norm_apply(const tok_normalizer *nm, tok_match_state *ms, const char *s, size_t len,
                   tok_buf *out, tok_buf *tmp) {
  out->n = 0;
  ML_TRY(tok_buf_put(out, s, len));
  for (size_t i = 0; i < nm->n; i++) {
    const tok_norm_step *st = &nm->steps[i];
    tmp->n = 0;
    switch (st->kind) {
      case TOK_NORM_NFC: ML_TRY(nfc(out->p, out->n, tmp)); break;
      case TOK_NORM_REPLACE: ML_TRY(replace(st, ms, out->p, out->n, tmp)); break;
      case TOK_NORM_PREPEND:
        if (out->n) ML_TRY(tok_buf_put(tmp, st->text, st->text_len));
        ML_TRY(tok_buf_put(tmp, out->p, out->n));
        break;
    }
    tok_buf t = *out;
    *out = *tmp;
    *tmp = t;
  }
  return 0;
}

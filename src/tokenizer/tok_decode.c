#include "tokenizer/tok_decode.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "tokenizer/tok_bytelevel.h"

int tok_strs_push(tok_strs *l, const char *s, size_t len) {
  ML_TRY(tok_reserve(&l->off, &l->cap, l->n + 2, sizeof *l->off, "decoded tokens"));
  ML_TRY(tok_reserve(&l->buf.p, &l->buf.cap, 1, 1, "decoded tokens")); /* buf.p never NULL */
  if (l->n == 0) l->off[0] = l->buf.n;
  ML_TRY(tok_buf_put(&l->buf, s, len));
  l->off[++l->n] = l->buf.n;
  return 0;
}

void tok_strs_free(tok_strs *l) {
  tok_buf_free(&l->buf);
  free(l->off);
  memset(l, 0, sizeof *l);
}

static int add_step(tok_decoder *d, const json_t *j, const char *field, const char *file);
static int add_item(void *d, const json_t *j, const char *field, const char *file) {
  return add_step(d, j, field, file);
}

static int add_step(tok_decoder *d, const json_t *j, const char *field, const char *file) {
  const json_t *type = json_object_get(j, "type");
  const char *t = json_is_string(type) ? json_string_value(type) : "";
  char f[256];
  tok_dec_step st = {0};
  if (strcmp(t, "Sequence") == 0)
    return tok_each_item(j, "decoders", field, file, "an array of decoders", add_item, d);
  if (strcmp(t, "ByteLevel") == 0) {
    st.kind = TOK_DEC_BYTELEVEL;
  } else if (strcmp(t, "ByteFallback") == 0) {
    st.kind = TOK_DEC_BYTEFALLBACK;
  } else if (strcmp(t, "Fuse") == 0) {
    st.kind = TOK_DEC_FUSE;
  } else if (strcmp(t, "Replace") == 0) {
    st.kind = TOK_DEC_REPLACE;
    const json_t *pat = json_object_get(j, "pattern");
    const json_t *s = json_object_get(pat, "String");
    snprintf(f, sizeof f, "%s.pattern", field);
    if (!json_is_string(s) || json_string_length(s) == 0)
      return tok_bad(file, f, pat,
                     "{\"String\": s}, not empty (a Replace decoder meshlm implements)");
    st.pattern = json_string_value(s);
    st.pattern_len = json_string_length(s);
    ML_TRY(tok_str(file, j, field, "content", &st.content, &st.content_len));
  } else if (strcmp(t, "Strip") == 0) {
    st.kind = TOK_DEC_STRIP;
    ML_TRY(tok_str(file, j, field, "content", &st.content, &st.content_len));
    const json_t *a = json_object_get(j, "start"), *b = json_object_get(j, "stop");
    snprintf(f, sizeof f, "%s.start", field);
    if (!json_is_integer(a) || json_integer_value(a) < 0)
      return tok_bad(file, f, a, "a count >= 0");
    snprintf(f, sizeof f, "%s.stop", field);
    if (!json_is_integer(b) || json_integer_value(b) < 0)
      return tok_bad(file, f, b, "a count >= 0");
    st.start = (size_t)json_integer_value(a);
    st.stop = (size_t)json_integer_value(b);
    snprintf(f, sizeof f, "%s.content", field);
    if (st.content_len == 0 || tok_utf8_len((unsigned char)st.content[0]) != st.content_len)
      return tok_bad(file, f, json_object_get(j, "content"), "one character");
  } else {
    snprintf(f, sizeof f, "%s.type", field);
    return tok_bad(file, f, type,
                   "\"ByteLevel\", \"Replace\", \"ByteFallback\", \"Fuse\", \"Strip\" or "
                   "\"Sequence\" (the decoders meshlm implements)");
  }
  ML_TRY(tok_reserve(&d->steps, &d->cap, d->n + 1, sizeof *d->steps, "decoders"));
  d->steps[d->n++] = st;
  return 0;
}

int tok_decoder_load(tok_decoder *d, const json_t *j, const char *file) {
  memset(d, 0, sizeof *d);
  if (!j || json_is_null(j)) return 0;
  if (!json_is_object(j)) return tok_bad(file, "decoder", j, "an object or null");
  d->present = true;
  return add_step(d, j, "decoder", file);
}

void tok_decoder_free(tok_decoder *d) {
  free(d->steps);
  memset(d, 0, sizeof *d);
}

/* Length of the invalid sequence at s[0] (the valid prefix of a sequence
 * that breaks off, at least 1), as Rust's Utf8Error::error_len. */
static size_t invalid_len(const unsigned char *s, size_t len) {
  unsigned c = s[0], lo = 0x80, hi = 0xBF;
  size_t need;
  if (c >= 0xC2 && c <= 0xDF)
    need = 2;
  else if (c >= 0xE0 && c <= 0xEF)
    need = 3;
  else if (c >= 0xF0 && c <= 0xF4)
    need = 4;
  else
    return 1;
  if (c == 0xE0)
    lo = 0xA0; /* overlong */
  else if (c == 0xED)
    hi = 0x9F; /* surrogates */
  else if (c == 0xF0)
    lo = 0x90; /* overlong */
  else if (c == 0xF4)
    hi = 0x8F; /* above U+10FFFF */
  if (len < 2 || s[1] < lo || s[1] > hi) return 1;
  size_t k = 2;
  while (k < need && k < len && (s[k] & 0xC0) == 0x80) k++;
  return k;
}

/* Rust's String::from_utf8_lossy: each invalid sequence → one U+FFFD. */
static int lossy(tok_buf *out, const char *s, size_t len) {
  while (len > 0) {
    size_t bad;
    if (tok_utf8_valid(s, len, &bad)) return tok_buf_put(out, s, len);
    ML_TRY(tok_buf_put(out, s, bad));
    ML_TRY(tok_buf_put(out, "\xEF\xBF\xBD", 3));
    size_t k = invalid_len((const unsigned char *)s + bad, len - bad);
    s += bad + k;
    len -= bad + k;
  }
  return 0;
}

static int byte_level(tok_strs *in, tok_strs *out) {
  tok_buf raw = {0}, txt = {0};
  int rc = 0;
  for (size_t i = 0; i < in->n && rc == 0; i++) {
    const char *s = in->buf.p + in->off[i];
    size_t len = in->off[i + 1] - in->off[i];
    if ((rc = tok_reserve(&raw.p, &raw.cap, raw.n + len + 1, 1, "decoded bytes"))) break;
    long n = tok_bytelevel_unmap(s, len, raw.p + raw.n);
    if (n >= 0)
      raw.n += (size_t)n;
    else
      rc = tok_buf_put(&raw, s, len); /* a char outside the map: the token as is */
  }
  if (rc == 0) rc = lossy(&txt, raw.p, raw.n);
  if (rc == 0) rc = tok_strs_push(out, txt.p, txt.n);
  tok_buf_free(&raw);
  tok_buf_free(&txt);
  return rc;
}

static int flush_bytes(tok_strs *out, tok_buf *bytes) {
  if (bytes->n == 0) return 0;
  size_t bad;
  if (tok_utf8_valid(bytes->p, bytes->n, &bad)) {
    ML_TRY(tok_strs_push(out, bytes->p, bytes->n));
  } else {
    for (size_t k = 0; k < bytes->n; k++) ML_TRY(tok_strs_push(out, "\xEF\xBF\xBD", 3));
  }
  bytes->n = 0;
  return 0;
}

static int hexval(char c) {
  return c >= '0' && c <= '9'   ? c - '0'
         : c >= 'a' && c <= 'f' ? c - 'a' + 10
         : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                : -1;
}

static int byte_fallback(tok_strs *in, tok_strs *out) {
  tok_buf bytes = {0};
  int rc = 0;
  for (size_t i = 0; i < in->n && rc == 0; i++) {
    const char *s = in->buf.p + in->off[i];
    size_t len = in->off[i + 1] - in->off[i];
    if (len == 6 && memcmp(s, "<0x", 3) == 0 && s[5] == '>' && hexval(s[3]) >= 0 &&
        hexval(s[4]) >= 0) {
      char b = (char)(hexval(s[3]) << 4 | hexval(s[4]));
      rc = tok_buf_put(&bytes, &b, 1);
      continue;
    }
    if ((rc = flush_bytes(out, &bytes))) break;
    rc = tok_strs_push(out, s, len);
  }
  if (rc == 0) rc = flush_bytes(out, &bytes);
  tok_buf_free(&bytes);
  return rc;
}

static int per_token(const tok_dec_step *st, tok_strs *in, tok_strs *out) {
  tok_buf t = {0};
  int rc = 0;
  for (size_t i = 0; i < in->n && rc == 0; i++) {
    const char *s = in->buf.p + in->off[i];
    size_t len = in->off[i + 1] - in->off[i];
    t.n = 0;
    if (st->kind == TOK_DEC_REPLACE) {
      size_t j = 0;
      while (j < len && rc == 0) {
        if (len - j >= st->pattern_len && memcmp(s + j, st->pattern, st->pattern_len) == 0) {
          rc = tok_buf_put(&t, st->content, st->content_len);
          j += st->pattern_len;
        } else {
          rc = tok_buf_put(&t, s + j, 1);
          j++;
        }
      }
    } else { /* Strip: up to start / stop copies of the char at either end */
      size_t a = 0, b = len, cl = st->content_len;
      for (size_t k = 0; k < st->start && b - a >= cl && memcmp(s + a, st->content, cl) == 0; k++)
        a += cl;
      for (size_t k = 0; k < st->stop && b - a >= cl && memcmp(s + b - cl, st->content, cl) == 0;
           k++)
        b -= cl;
      rc = tok_buf_put(&t, s + a, b - a);
    }
    if (rc == 0) rc = tok_strs_push(out, t.p, t.n);
  }
  tok_buf_free(&t);
  return rc;
}

int tok_decoder_run(const tok_decoder *d, tok_strs *tokens, tok_buf *out) {
  for (size_t i = 0; i < d->n; i++) {
    tok_strs next = {0};
    int rc;
    switch (d->steps[i].kind) {
      case TOK_DEC_BYTELEVEL: rc = byte_level(tokens, &next); break;
      case TOK_DEC_BYTEFALLBACK: rc = byte_fallback(tokens, &next); break;
      case TOK_DEC_FUSE:
        rc = tok_strs_push(&next, tokens->n ? tokens->buf.p + tokens->off[0] : "",
                           tokens->n ? tokens->buf.n - tokens->off[0] : 0);
        break;
      default: rc = per_token(&d->steps[i], tokens, &next); break;
    }
    tok_strs_free(tokens);
    *tokens = next;
    ML_TRY(rc);
  }
  out->n = 0;
  for (size_t i = 0; i < tokens->n; i++) {
    if (i > 0 && !d->present) ML_TRY(tok_buf_put(out, " ", 1));
    ML_TRY(tok_buf_put(out, tokens->buf.p + tokens->off[i], tokens->off[i + 1] - tokens->off[i]));
  }
  return 0;
}

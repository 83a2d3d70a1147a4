#include "tokenizer/tok_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "io/json.h"

int tok_reserve(void *p, size_t *cap, size_t need, size_t elem, const char *what) {
  if (need <= *cap) return 0;
  size_t n = *cap ? *cap : 16;
  while (n < need) {
    if (n > SIZE_MAX / 2) return ml_err("out of memory: %s needs more than 2^63 bytes", what);
    n *= 2;
  }
  if (n > SIZE_MAX / elem) return ml_err("out of memory: %s needs more than 2^63 bytes", what);
  void *q = realloc(*(void **)p, n * elem);
  if (!q) return ml_err("out of memory allocating %zu bytes for %s", n * elem, what);
  *(void **)p = q;
  *cap = n;
  return 0;
}

int tok_buf_put(tok_buf *b, const char *s, size_t len) {
  if (len > SIZE_MAX - b->n) return ml_err("out of memory: tokenizer text buffer");
  ML_TRY(tok_reserve(&b->p, &b->cap, b->n + len, 1, "tokenizer text buffer"));
  if (len) memcpy(b->p + b->n, s, len);
  b->n += len;
  return 0;
}

void tok_buf_free(tok_buf *b) {
  free(b->p);
  memset(b, 0, sizeof *b);
}

uint32_t tok_utf8_decode(const char *s) {
  const unsigned char *u = (const unsigned char *)s;
  if (u[0] < 0x80) return u[0];
  if (u[0] < 0xE0) return (uint32_t)(u[0] & 0x1F) << 6 | (u[1] & 0x3F);
  if (u[0] < 0xF0)
    return (uint32_t)(u[0] & 0x0F) << 12 | (uint32_t)(u[1] & 0x3F) << 6 | (u[2] & 0x3F);
  return (uint32_t)(u[0] & 0x07) << 18 | (uint32_t)(u[1] & 0x3F) << 12 |
         (uint32_t)(u[2] & 0x3F) << 6 | (u[3] & 0x3F);
}

size_t tok_utf8_encode(uint32_t cp, char *out) {
  unsigned char *o = (unsigned char *)out;
  if (cp < 0x80) {
    o[0] = (unsigned char)cp;
    return 1;
  }
  if (cp < 0x800) {
    o[0] = (unsigned char)(0xC0 | cp >> 6);
    o[1] = (unsigned char)(0x80 | (cp & 0x3F));
    return 2;
  }
  if (cp < 0x10000) {
    o[0] = (unsigned char)(0xE0 | cp >> 12);
    o[1] = (unsigned char)(0x80 | (cp >> 6 & 0x3F));
    o[2] = (unsigned char)(0x80 | (cp & 0x3F));
    return 3;
  }
  o[0] = (unsigned char)(0xF0 | cp >> 18);
  o[1] = (unsigned char)(0x80 | (cp >> 12 & 0x3F));
  o[2] = (unsigned char)(0x80 | (cp >> 6 & 0x3F));
  o[3] = (unsigned char)(0x80 | (cp & 0x3F));
  return 4;
}

bool tok_utf8_valid(const char *s, size_t len, size_t *bad) {
  const unsigned char *u = (const unsigned char *)s;
  size_t i = 0;
  while (i < len) {
    /* ASCII runs, 8 bytes at a time */
    while (i + 8 <= len) {
      uint64_t w;
      memcpy(&w, u + i, 8);
      if (w & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= len) break;
    unsigned c = u[i];
    if (c < 0x80) {
      i++;
      continue;
    }
    size_t n;
    unsigned lo = 0x80, hi = 0xBF; /* allowed range of the second byte */
    if (c >= 0xC2 && c <= 0xDF)
      n = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
      n = 3;
      if (c == 0xE0)
        lo = 0xA0; /* overlong */
      else if (c == 0xED)
        hi = 0x9F; /* surrogates */
    } else if (c >= 0xF0 && c <= 0xF4) {
      n = 4;
      if (c == 0xF0)
        lo = 0x90; /* overlong */
      else if (c == 0xF4)
        hi = 0x8F; /* above U+10FFFF */
    } else {
      *bad = i;
      return false;
    }
    if (i + n > len || u[i + 1] < lo || u[i + 1] > hi) {
      *bad = i;
      return false;
    }
    for (size_t k = 2; k < n; k++)
      if ((u[i + k] & 0xC0) != 0x80) {
        *bad = i;
        return false;
      }
    i += n;
  }
  return true;
}

int tok_bad(const char *file, const char *field, const json_t *found, const char *expected) {
  char buf[120];
  ml_json_brief(found, buf, sizeof buf);
  return ml_err("%s: field '%s': found %s, expected %s", file, field, buf, expected);
}

int tok_id(const char *file, const char *field, const json_t *v, size_t tokens, int32_t *out) {
  int64_t limit =
      tokens > (INT32_MAX - 256) / 2 ? (int64_t)INT32_MAX + 1 : 2 * (int64_t)tokens + 256;
  json_int_t id = json_is_integer(v) ? json_integer_value(v) : -1;
  if (id < 0 || id >= limit) {
    char what[160];
    snprintf(what, sizeof what,
             "an id in [0, %lld) (meshlm's bound for %zu tokens: twice as many, plus 256)",
             (long long)limit, tokens);
    return tok_bad(file, field, v, what);
  }
  *out = (int32_t)id;
  return 0;
}

int tok_each_item(const json_t *j, const char *key, const char *field, const char *file,
                  const char *what, tok_item_fn fn, void *ctx) {
  const json_t *list = json_object_get(j, key);
  char f[256];
  snprintf(f, sizeof f, "%s.%s", field, key);
  if (!json_is_array(list)) return tok_bad(file, f, list, what);
  for (size_t i = 0; i < json_array_size(list); i++) {
    char fi[300];
    snprintf(fi, sizeof fi, "%s[%zu]", f, i);
    ML_TRY(fn(ctx, json_array_get(list, i), fi, file));
  }
  return 0;
}

int tok_str(const char *file, const json_t *obj, const char *field, const char *key,
            const char **out, size_t *len) {
  const json_t *v = json_object_get(obj, key);
  if (!json_is_string(v)) {
    char f[256];
    snprintf(f, sizeof f, "%s.%s", field, key);
    return tok_bad(file, f, v, "a string");
  }
  *out = json_string_value(v);
  *len = json_string_length(v);
  return 0;
}

int tok_bool(const char *file, const json_t *obj, const char *field, const char *key, bool dflt,
             bool *out) {
  const json_t *v = json_object_get(obj, key);
  if (!v || json_is_null(v)) {
    *out = dflt;
    return 0;
  }
  if (!json_is_boolean(v)) {
    char f[256];
    snprintf(f, sizeof f, "%s.%s", field, key);
    return tok_bad(file, f, v, "true or false");
  }
  *out = json_is_true(v);
  return 0;
}

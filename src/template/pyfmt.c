/* Python's str(), repr() and json.dumps() of values (pyfmt.h). */
#include "template/pyfmt.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <utf8proc.h>

int jbuf_put(jbuf *b, const char *s, size_t n) {
  if (n > b->limit || b->len > b->limit - n) {
    b->over = true;
    return -1;
  }
  if (b->len + n + 1 > b->cap) {
    size_t nc = b->cap ? b->cap : 256;
    while (nc < b->len + n + 1) nc = nc > SIZE_MAX / 2 ? b->len + n + 1 : nc * 2;
    char *p = realloc(b->p, nc);
    if (!p) return -1;
    b->p = p;
    b->cap = nc;
  }
  if (n) memcpy(b->p + b->len, s, n);
  b->len += n;
  b->p[b->len] = 0;
  return 0;
}

static int puts_(jbuf *b, const char *s) { return jbuf_put(b, s, strlen(s)); }

void jbuf_free(jbuf *b) {
  free(b->p);
  b->p = NULL;
  b->len = b->cap = 0;
}

void py_float_repr(double x, char *out) {
  if (isnan(x)) {
    strcpy(out, "nan");
    return;
  }
  if (isinf(x)) {
    strcpy(out, x > 0 ? "inf" : "-inf");
    return;
  }
  /* the shortest %e text that reads back to x: its digits and exponent */
  char e[40];
  for (int prec = 1; prec <= 17; prec++) {
    snprintf(e, sizeof e, "%.*e", prec - 1, x);
    if (strtod(e, NULL) == x) break;
  }
  char digits[24];
  size_t nd = 0;
  const char *p = e;
  bool neg = *p == '-';
  if (neg) p++;
  for (; *p && *p != 'e'; p++)
    if (*p != '.') digits[nd++] = *p;
  while (nd > 1 && digits[nd - 1] == '0') nd--;
  digits[nd] = 0;
  int exp10 = atoi(p + 1); /* x = d.ddd × 10^exp10 */
  int decpt = exp10 + 1;   /* x = 0.dddd × 10^decpt */
  char *o = out;
  if (neg) *o++ = '-';
  if (decpt > 16 || decpt < -3) {
    *o++ = digits[0];
    if (nd > 1) {
      *o++ = '.';
      memcpy(o, digits + 1, nd - 1);
      o += nd - 1;
    }
    sprintf(o, "e%c%02d", exp10 < 0 ? '-' : '+', exp10 < 0 ? -exp10 : exp10);
    return;
  }
  if (decpt <= 0) {
    *o++ = '0';
    *o++ = '.';
    for (int i = 0; i < -decpt; i++) *o++ = '0';
    memcpy(o, digits, nd);
    o += nd;
  } else {
    for (int i = 0; i < decpt; i++) *o++ = (size_t)i < nd ? digits[i] : '0';
    *o++ = '.';
    if ((size_t)decpt < nd) {
      memcpy(o, digits + decpt, nd - (size_t)decpt);
      o += nd - (size_t)decpt;
    } else {
      *o++ = '0';
    }
  }
  *o = 0;
}

/* Python's str.isprintable() for one code point. */
static bool printable(int32_t c) {
  if (c == ' ') return true;
  switch (utf8proc_category(c)) {
  case UTF8PROC_CATEGORY_CC:
  case UTF8PROC_CATEGORY_CF:
  case UTF8PROC_CATEGORY_CS:
  case UTF8PROC_CATEGORY_CO:
  case UTF8PROC_CATEGORY_CN:
  case UTF8PROC_CATEGORY_ZL:
  case UTF8PROC_CATEGORY_ZP:
  case UTF8PROC_CATEGORY_ZS: return false;
  default: return true;
  }
}

/* repr(str): quotes and escapes as Python 3 chooses them. */
static int repr_str(jbuf *b, const jstr *s) {
  bool sq = memchr(s->s, '\'', s->len) != NULL, dq = memchr(s->s, '"', s->len) != NULL;
  char q = sq && !dq ? '"' : '\'';
  if (jbuf_put(b, &q, 1)) return -1;
  const uint8_t *p = (const uint8_t *)s->s;
  size_t i = 0;
  while (i < s->len) {
    int32_t c;
    utf8proc_ssize_t n = utf8proc_iterate(p + i, (utf8proc_ssize_t)(s->len - i), &c);
    char esc[16];
    if (n <= 0) { /* invalid UTF-8 cannot come from JSON or a template: show the byte */
      snprintf(esc, sizeof esc, "\\x%02x", p[i]);
      if (puts_(b, esc)) return -1;
      i++;
      continue;
    }
    if (c == q || c == '\\') {
      esc[0] = '\\';
      esc[1] = (char)c;
      if (jbuf_put(b, esc, 2)) return -1;
    } else if (c == '\n' || c == '\r' || c == '\t') {
      if (puts_(b, c == '\n' ? "\\n" : c == '\r' ? "\\r" : "\\t")) return -1;
    } else if (c < 0x7f ? c >= 0x20 : printable(c)) {
      if (jbuf_put(b, (const char *)p + i, (size_t)n)) return -1;
    } else {
      snprintf(esc, sizeof esc, c < 0x100 ? "\\x%02x" : c < 0x10000 ? "\\u%04x" : "\\U%08x", c);
      if (puts_(b, esc)) return -1;
    }
    i += (size_t)n;
  }
  return jbuf_put(b, &q, 1);
}

static int str_d(jbuf *b, jv v, bool repr, int depth, const char **why) {
  char tmp[40];
  *why = NULL;
  if (depth > JV_DEPTH) {
    *why = "values nested deeper than 512";
    return -1;
  }
  switch (v.kind) {
  case JV_UNDEF: return repr ? puts_(b, "Undefined") : 0;
  case JV_NONE: return puts_(b, "None");
  case JV_BOOL: return puts_(b, v.u.b ? "True" : "False");
  case JV_INT:
    snprintf(tmp, sizeof tmp, "%" PRId64, v.u.i);
    return puts_(b, tmp);
  case JV_FLOAT: py_float_repr(v.u.f, tmp); return puts_(b, tmp);
  case JV_STR:
    if (repr && jv_is_markup(v)) {
      *why = "a Markup string (from escape or safe) inside a list or dict has no text here";
      return -1;
    }
    return repr ? repr_str(b, v.u.s) : jbuf_put(b, v.u.s->s, v.u.s->len);
  case JV_LIST: {
    const jlist *l = v.u.l;
    static const char *const open[] = {"[", "(", "dict_items([", "dict_keys([", "dict_values(["};
    static const char *const close[] = {"]", ")", "])", "])", "])"};
    if (l->view == JL_GEN || l->view == JL_RANGE) {
      *why = l->view == JL_GEN ? "a generator (what map, select, selectattr... return) has no text here: add |list"
                               : "a range() has no text here: add |list";
      return -1;
    }
    if (puts_(b, open[l->view])) return -1;
    for (size_t i = 0; i < l->n; i++) {
      if (i && puts_(b, ", ")) return -1;
      if (str_d(b, l->items[i], true, depth + 1, why)) return -1;
    }
    if (l->view == JL_TUPLE && l->n == 1 && puts_(b, ",")) return -1;
    return puts_(b, close[l->view]);
  }
  case JV_DICT: {
    const jdict *d = v.u.d;
    if (puts_(b, "{")) return -1;
    for (size_t i = 0; i < d->n; i++) {
      if (i && puts_(b, ", ")) return -1;
      if (str_d(b, d->keys[i], true, depth + 1, why) || puts_(b, ": ") ||
          str_d(b, d->vals[i], true, depth + 1, why))
        return -1;
    }
    return puts_(b, "}");
  }
  default:
    *why = "a namespace, loop, macro or function object has no text here";
    return -1;
  }
}

int py_str(jbuf *b, jv v, const char **why) { return str_d(b, v, false, 0, why); }
int py_repr(jbuf *b, jv v, const char **why) { return str_d(b, v, true, 0, why); }

static int json_str(jbuf *b, const char *s, size_t len, bool ascii) {
  if (jbuf_put(b, "\"", 1)) return -1;
  const uint8_t *p = (const uint8_t *)s;
  size_t i = 0;
  while (i < len) {
    uint8_t c = p[i];
    char esc[16];
    const char *e = NULL;
    switch (c) {
    case '"': e = "\\\""; break;
    case '\\': e = "\\\\"; break;
    case '\n': e = "\\n"; break;
    case '\r': e = "\\r"; break;
    case '\t': e = "\\t"; break;
    case '\b': e = "\\b"; break;
    case '\f': e = "\\f"; break;
    default: break;
    }
    if (e) {
      if (puts_(b, e)) return -1;
      i++;
    } else if (c < 0x20 || (ascii && c == 0x7f)) {
      snprintf(esc, sizeof esc, "\\u%04x", c);
      if (puts_(b, esc)) return -1;
      i++;
    } else if (c < 0x80 || !ascii) {
      size_t j = i + 1; /* a run of bytes written as they are */
      while (j < len && p[j] >= 0x20 && p[j] != '"' && p[j] != '\\' && (!ascii || p[j] < 0x80)) j++;
      if (jbuf_put(b, s + i, j - i)) return -1;
      i = j;
    } else {
      int32_t cp;
      utf8proc_ssize_t n = utf8proc_iterate(p + i, (utf8proc_ssize_t)(len - i), &cp);
      if (n <= 0) {
        cp = 0xfffd;
        n = 1;
      }
      if (cp >= 0x10000) {
        int32_t v = cp - 0x10000;
        snprintf(esc, sizeof esc, "\\u%04x\\u%04x", 0xd800 + (v >> 10), 0xdc00 + (v & 0x3ff));
      } else {
        snprintf(esc, sizeof esc, "\\u%04x", cp);
      }
      if (puts_(b, esc)) return -1;
      i += (size_t)n;
    }
  }
  return jbuf_put(b, "\"", 1);
}

static int newline(jbuf *b, const py_json_opts *o, int level) {
  if (o->indent < 0) return 0;
  if (puts_(b, "\n")) return -1;
  for (int i = 0; i < level * o->indent; i++)
    if (puts_(b, " ")) return -1;
  return 0;
}

/* A dict key as json.dumps turns it into a string; -1 for other types. */
static int key_text(jbuf *b, jv k, const py_json_opts *o, const char **why) {
  char tmp[40];
  switch (k.kind) {
  case JV_STR: return json_str(b, k.u.s->s, k.u.s->len, o->ensure_ascii);
  case JV_NONE: return puts_(b, "\"null\"");
  case JV_BOOL: return puts_(b, k.u.b ? "\"true\"" : "\"false\"");
  case JV_INT: snprintf(tmp, sizeof tmp, "\"%" PRId64 "\"", k.u.i); return puts_(b, tmp);
  case JV_FLOAT:
    if (isnan(k.u.f)) return puts_(b, "\"NaN\"");
    if (isinf(k.u.f)) return puts_(b, k.u.f > 0 ? "\"Infinity\"" : "\"-Infinity\"");
    py_float_repr(k.u.f, tmp);
    return puts_(b, "\"") || puts_(b, tmp) || puts_(b, "\"");
  default: *why = "keys must be str, int, float, bool or None"; return -1;
  }
}

/* The order sort_keys=True writes: by key, keys being strings. */
static int cmp_key(const void *x, const void *y) {
  const jstr *a = ((const jv *)x)->u.s, *b = ((const jv *)y)->u.s;
  int c = memcmp(a->s, b->s, a->len < b->len ? a->len : b->len);
  return c ? c : (a->len > b->len) - (a->len < b->len);
}

static int json_d(jbuf *b, jv v, const py_json_opts *o, int level, const char **why) {
  char tmp[40];
  if (level > JV_DEPTH) {
    *why = "values nested deeper than 512";
    return -1;
  }
  const char *isep = o->item_sep ? o->item_sep : o->indent < 0 ? ", " : ",";
  const char *ksep = o->key_sep ? o->key_sep : ": ";
  switch (v.kind) {
  case JV_NONE: return puts_(b, "null");
  case JV_BOOL: return puts_(b, v.u.b ? "true" : "false");
  case JV_INT: snprintf(tmp, sizeof tmp, "%" PRId64, v.u.i); return puts_(b, tmp);
  case JV_FLOAT:
    if (isnan(v.u.f)) return puts_(b, "NaN");
    if (isinf(v.u.f)) return puts_(b, v.u.f > 0 ? "Infinity" : "-Infinity");
    py_float_repr(v.u.f, tmp);
    return puts_(b, tmp);
  case JV_STR: return json_str(b, v.u.s->s, v.u.s->len, o->ensure_ascii);
  case JV_LIST: {
    const jlist *l = v.u.l;
    if (l->view > JL_TUPLE) {
      *why = l->view == JL_GEN     ? "Object of type generator is not JSON serializable"
             : l->view == JL_RANGE ? "Object of type range is not JSON serializable"
                                   : "Object of type dict_items/keys/values is not JSON serializable";
      return -1;
    }
    if (!l->n) return puts_(b, "[]");
    if (puts_(b, "[")) return -1;
    for (size_t i = 0; i < l->n; i++) {
      if (i && puts_(b, isep)) return -1;
      if (newline(b, o, level + 1) || json_d(b, l->items[i], o, level + 1, why)) return -1;
    }
    return newline(b, o, level) || puts_(b, "]");
  }
  case JV_DICT: {
    const jdict *d = v.u.d;
    if (!d->n) return puts_(b, "{}");
    /* sort_keys: an index order by key (json.dumps refuses non-str keys then) */
    size_t *ord = NULL;
    if (o->sort_keys) {
      for (size_t i = 0; i < d->n; i++)
        if (d->keys[i].kind != JV_STR) {
          *why = "sort_keys needs string keys ('<' not supported between the key types)";
          return -1;
        }
      jv *pairs = malloc(d->n * 2 * sizeof(jv));
      ord = malloc(d->n * sizeof(size_t));
      if (!pairs || !ord) {
        free(pairs);
        free(ord);
        *why = "out of memory";
        return -1;
      }
      for (size_t i = 0; i < d->n; i++) {
        pairs[2 * i] = d->keys[i];
        pairs[2 * i + 1] = jv_int((int64_t)i);
      }
      qsort(pairs, d->n, 2 * sizeof(jv), cmp_key);
      for (size_t i = 0; i < d->n; i++) ord[i] = (size_t)pairs[2 * i + 1].u.i;
      free(pairs);
    }
    int rc = puts_(b, "{");
    for (size_t k = 0; !rc && k < d->n; k++) {
      size_t i = ord ? ord[k] : k;
      if (k) rc = puts_(b, isep);
      rc = rc || newline(b, o, level + 1) || key_text(b, d->keys[i], o, why) || puts_(b, ksep) ||
           json_d(b, d->vals[i], o, level + 1, why);
    }
    free(ord);
    return rc || newline(b, o, level) || puts_(b, "}");
  }
  default:
    *why = v.kind == JV_UNDEF ? "Object of type Undefined is not JSON serializable"
           : v.kind == JV_NS  ? "Object of type Namespace is not JSON serializable"
                              : "Object of this type (loop, macro or function) is not JSON serializable";
    return -1;
  }
}

int py_tojson(jbuf *b, jv v, const py_json_opts *o, const char **why) {
  *why = NULL;
  return json_d(b, v, o, 0, why);
}

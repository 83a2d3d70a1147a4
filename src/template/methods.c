/* Methods of str, dict and list values and loop.cycle, as Python's through
 * Jinja2's ImmutableSandboxedEnvironment: methods that modify a list or a
 * dict are "unsafe" (the call is refused, as the sandbox's SecurityError);
 * Python methods outside this subset are refused by name when called. */
#include <stdio.h>
#include <string.h>

#include "template/bi.h"
#include "template/text.h"

enum status { OK, UNSAFE, UNSUPPORTED };

typedef struct method {
  char type; /* 's' str, 'd' dict, 'l' list, 'p' loop */
  const char *name;
  enum status st;
} method;

static const method METHODS[] = {
    {'s', "strip", OK}, {'s', "lstrip", OK}, {'s', "rstrip", OK}, {'s', "split", OK},
    {'s', "rsplit", OK}, {'s', "splitlines", OK}, {'s', "startswith", OK}, {'s', "endswith", OK},
    {'s', "replace", OK}, {'s', "upper", OK}, {'s', "lower", OK}, {'s', "title", OK},
    {'s', "capitalize", OK}, {'s', "join", OK}, {'s', "find", OK}, {'s', "rfind", OK},
    {'s', "count", OK}, {'s', "isdigit", OK}, {'s', "isalpha", OK}, {'s', "isalnum", OK},
    {'s', "isspace", OK}, {'s', "islower", OK}, {'s', "isupper", OK}, {'s', "format", OK},
    {'s', "casefold", UNSUPPORTED}, {'s', "center", UNSUPPORTED}, {'s', "encode", UNSUPPORTED},
    {'s', "expandtabs", UNSUPPORTED}, {'s', "format_map", UNSUPPORTED}, {'s', "index", UNSUPPORTED},
    {'s', "isascii", UNSUPPORTED}, {'s', "isdecimal", UNSUPPORTED}, {'s', "isidentifier", UNSUPPORTED},
    {'s', "isnumeric", UNSUPPORTED}, {'s', "isprintable", UNSUPPORTED}, {'s', "istitle", UNSUPPORTED},
    {'s', "ljust", UNSUPPORTED}, {'s', "partition", UNSUPPORTED}, {'s', "removeprefix", UNSUPPORTED},
    {'s', "removesuffix", UNSUPPORTED}, {'s', "rindex", UNSUPPORTED}, {'s', "rjust", UNSUPPORTED},
    {'s', "rpartition", UNSUPPORTED}, {'s', "swapcase", UNSUPPORTED}, {'s', "translate", UNSUPPORTED},
    {'s', "zfill", UNSUPPORTED}, {'s', "maketrans", UNSUPPORTED},
    {'d', "items", OK}, {'d', "keys", OK}, {'d', "values", OK}, {'d', "get", OK},
    {'d', "copy", UNSUPPORTED}, {'d', "fromkeys", UNSUPPORTED}, {'d', "clear", UNSAFE},
    {'d', "pop", UNSAFE}, {'d', "popitem", UNSAFE}, {'d', "setdefault", UNSAFE}, {'d', "update", UNSAFE},
    {'l', "index", OK}, {'l', "count", OK}, {'l', "copy", UNSUPPORTED}, {'l', "append", UNSAFE},
    {'l', "extend", UNSAFE}, {'l', "insert", UNSAFE}, {'l', "pop", UNSAFE}, {'l', "remove", UNSAFE},
    {'l', "reverse", UNSAFE}, {'l', "sort", UNSAFE}, {'l', "clear", UNSAFE},
    {'p', "cycle", OK},
};

#define NMETHODS (sizeof METHODS / sizeof *METHODS)

int jb_method(jx *x, const jexpr *at, jv v, const char *name, size_t len, jv *out) {
  char type = v.kind == JV_STR ? 's' : v.kind == JV_DICT ? 'd' : v.kind == JV_LOOP ? 'p'
              : v.kind == JV_LIST && v.u.l->view == JL_LIST ? 'l' : 0;
  if (!type) return 0;
  for (size_t i = 0; i < NMETHODS; i++)
    if (METHODS[i].type == type && strlen(METHODS[i].name) == len && !memcmp(METHODS[i].name, name, len)) {
      if (METHODS[i].st == UNSAFE) { /* the sandbox: an Undefined that fails when used */
        char *msg = ja_alloc(&x->a, 96);
        if (!msg) return jx_oom(x, at);
        snprintf(msg, 96, "access to attribute '%s' of '%s' object is unsafe", METHODS[i].name,
                 type == 'd' ? "dict" : "list");
        *out = jv_undef_msg(msg);
        return 1;
      }
      jfunc *f = ja_alloc(&x->a, sizeof *f);
      if (!f) return jx_oom(x, at);
      f->id = M_FIRST + (int)i;
      f->self = v;
      *out = (jv){.kind = JV_FUNC, .u.fn = f};
      return 1;
    }
  return 0;
}

/* ---- str ---- */

/* Whether cp is one of the code points of chars (NULL: whitespace). */
static bool in_set(const jstr *chars, int32_t cp) {
  if (!chars) return txt_space(cp);
  for (size_t i = 0; i < chars->len;) {
    size_t n;
    if (txt_cp(chars->s, chars->len, i, &n) == cp) return true;
    i += n;
  }
  return false;
}

/* str.strip / lstrip / rstrip: the kept range of s. */
static void strip_range(const jstr *s, const jstr *chars, bool left, bool right, size_t *b, size_t *e) {
  size_t i = 0, j = s->len, n;
  while (left && i < j && in_set(chars, txt_cp(s->s, s->len, i, &n))) i += n;
  while (right && j > i) {
    size_t k = j - 1;
    while (k > i && ((unsigned char)s->s[k] & 0xC0) == 0x80) k--;
    if (!in_set(chars, txt_cp(s->s, s->len, k, &n))) break;
    j = k;
  }
  *b = i;
  *e = j;
}

static int str_new(jx *x, const jexpr *at, const char *p, size_t n, jv *out) { return jx_str(x, at, p, n, out); }

static int list_push(jx *x, const jexpr *at, jlist *l, jv v) {
  return jlist_push(&x->a, l, v) ? jx_oom(x, at) : 0;
}

/* The start of the code point that ends at byte e of s (e > 0). */
static size_t prev_cp(const jstr *s, size_t e) {
  size_t k = e - 1;
  while (k > 0 && ((unsigned char)s->s[k] & 0xC0) == 0x80) k--;
  return k;
}

static bool space_at(const jstr *s, size_t i) {
  size_t n;
  return txt_space(txt_cp(s->s, s->len, i, &n));
}

static size_t next_cp(const jstr *s, size_t i) {
  size_t n;
  txt_cp(s->s, s->len, i, &n);
  return i + n;
}

/* str.split / rsplit (sep NULL: runs of whitespace, no empty pieces; what
 * maxsplit leaves is kept whole, stripped on its outer side only). */
static int do_split(jx *x, const jexpr *at, const jstr *s, const jstr *sep, int64_t maxsplit, bool rev, jv *out) {
  if (sep && !sep->len) return jx_fail(x, at, "empty separator");
  jlist *l = jlist_new(&x->a, 0);
  if (!l) return jx_oom(x, at);
  jv piece;
  if (!rev) {
    size_t i = 0;
    for (;;) {
      if (!sep) {
        while (i < s->len && space_at(s, i)) i = next_cp(s, i);
        if (i >= s->len) break;
      }
      const char *f = sep && maxsplit ? txt_find(s->s + i, s->len - i, sep->s, sep->len) : NULL;
      if (maxsplit == 0 || (sep && !f)) {
        if (str_new(x, at, s->s + i, s->len - i, &piece) || list_push(x, at, l, piece)) return -1;
        break;
      }
      size_t j = i, next;
      if (sep) {
        j = (size_t)(f - s->s);
        next = j + sep->len;
      } else {
        while (j < s->len && !space_at(s, j)) j = next_cp(s, j);
        next = j;
      }
      if (str_new(x, at, s->s + i, j - i, &piece) || list_push(x, at, l, piece)) return -1;
      if (maxsplit > 0) maxsplit--;
      i = next;
    }
  } else {
    size_t e = s->len;
    for (;;) {
      if (!sep) {
        while (e > 0 && space_at(s, prev_cp(s, e))) e = prev_cp(s, e);
        if (e == 0) break;
      }
      size_t b = e, next = 0;
      bool found = false;
      if (sep && maxsplit) {
        for (size_t k = e >= sep->len ? e - sep->len + 1 : 0; k-- > 0;)
          if (!memcmp(s->s + k, sep->s, sep->len)) {
            b = k + sep->len;
            next = k;
            found = true;
            break;
          }
      }
      if (maxsplit == 0 || (sep && !found)) {
        if (str_new(x, at, s->s, e, &piece) || list_push(x, at, l, piece)) return -1;
        break;
      }
      if (!sep) {
        while (b > 0 && !space_at(s, prev_cp(s, b))) b = prev_cp(s, b);
        next = b;
      }
      if (str_new(x, at, s->s + b, e - b, &piece) || list_push(x, at, l, piece)) return -1;
      if (maxsplit > 0) maxsplit--;
      e = next;
    }
    for (size_t i = 0; i < l->n / 2; i++) {
      jv t = l->items[i];
      l->items[i] = l->items[l->n - 1 - i];
      l->items[l->n - 1 - i] = t;
    }
  }
  *out = (jv){.kind = JV_LIST, .u.l = l};
  return 0;
}

static int do_replace(jx *x, const jexpr *at, const jstr *s, const jstr *old, const jstr *new_, int64_t count,
                      jv *out) {
  jbuf b = {.limit = JINJA_MAX_OUTPUT};
  size_t i = 0, n;
  int64_t done = 0;
  int rc = 0;
  if (!old->len) { /* between every character, and at both ends */
    while (!rc && (count < 0 || done < count)) {
      rc = jbuf_put(&b, new_->s, new_->len);
      done++;
      if (i >= s->len) break;
      txt_cp(s->s, s->len, i, &n);
      rc = rc || jbuf_put(&b, s->s + i, n);
      i += n;
    }
    rc = rc || jbuf_put(&b, s->s + i, s->len - i);
  } else {
    while (!rc && (count < 0 || done < count)) {
      const char *f = txt_find(s->s + i, s->len - i, old->s, old->len);
      if (!f) break;
      size_t p = (size_t)(f - s->s);
      rc = jbuf_put(&b, s->s + i, p - i) || jbuf_put(&b, new_->s, new_->len);
      i = p + old->len;
      done++;
    }
    rc = rc || jbuf_put(&b, s->s + i, s->len - i);
  }
  if (rc) {
    int r = jb_buf_fail(x, at, &b);
    jbuf_free(&b);
    return r;
  }
  return jb_take(x, at, &b, out);
}

int jb_case_str(jx *x, const jexpr *at, const jstr *s, char mode, jv *out) {
  jbuf b = {.limit = JINJA_MAX_OUTPUT};
  int rc = 0;
  int32_t bad = 0;
  if (mode == 'u' || mode == 'l') {
    rc = txt_case(&b, s->s, s->len, 0, s->len, mode, &bad);
  } else {
    bool prev_cased = false;
    for (size_t i = 0, n; !rc && i < s->len; i += n) {
      int32_t c = txt_cp(s->s, s->len, i, &n);
      bool up = mode == 'T' ? !prev_cased : i == 0;
      rc = txt_case(&b, s->s, s->len, i, i + n, up ? 't' : 'l', &bad);
      prev_cased = txt_upper(c) || txt_lower(c);
    }
  }
  return rc ? jb_case_fail(x, at, &b, rc, bad) : jb_take(x, at, &b, out);
}

/* str.format with {} {0} {name} fields and {{ }}; format specs and
 * conversions are refused. */
static int do_format(jx *x, const jexpr *at, const jstr *s, const jargs *a, jv *out) {
  jbuf b = {.limit = JINJA_MAX_OUTPUT};
  size_t auto_i = 0;
  int rc = 0;
  for (size_t i = 0; !rc && i < s->len; i++) {
    char c = s->s[i];
    if ((c == '{' || c == '}') && i + 1 < s->len && s->s[i + 1] == c) {
      rc = jbuf_put(&b, &c, 1);
      i++;
      continue;
    }
    if (c == '}') {
      jbuf_free(&b);
      return jx_fail(x, at, "str.format(): Single '}' encountered in format string");
    }
    if (c != '{') {
      rc = jbuf_put(&b, &c, 1);
      continue;
    }
    size_t j = i + 1;
    while (j < s->len && s->s[j] != '}') j++;
    if (j >= s->len) {
      jbuf_free(&b);
      return jx_fail(x, at, "str.format(): Single '{' encountered in format string");
    }
    const char *f = s->s + i + 1;
    size_t fl = j - i - 1;
    jv v = jb_missing();
    if (memchr(f, ':', fl) || memchr(f, '!', fl) || memchr(f, '.', fl) || memchr(f, '[', fl)) {
      jbuf_free(&b);
      return jx_fail(x, at, "str.format(): format specs, conversions and field access are not supported");
    }
    if (!fl) {
      if (auto_i < a->npos) v = a->pos[auto_i];
      auto_i++;
    } else if (f[0] >= '0' && f[0] <= '9') {
      size_t k = 0;
      for (size_t m = 0; m < fl; m++) k = k * 10 + (size_t)(f[m] - '0');
      if (k < a->npos) v = a->pos[k];
    } else {
      for (size_t k = 0; k < a->nkw; k++)
        if (strlen(a->kwn[k]) == fl && !memcmp(a->kwn[k], f, fl)) v = a->kwv[k];
    }
    if (!jb_given(v)) {
      jbuf_free(&b);
      return jx_fail(x, at, "str.format(): no argument for the field '{%.*s}'", (int)fl, f);
    }
    jv sv;
    if (jx_tostr(x, at, v, &sv)) {
      jbuf_free(&b);
      return -1;
    }
    rc = jbuf_put(&b, sv.u.s->s, sv.u.s->len);
    i = j;
  }
  if (rc) {
    int r = jb_buf_fail(x, at, &b);
    jbuf_free(&b);
    return r;
  }
  return jb_take(x, at, &b, out);
}

/* The code-point index of byte offset off in s. */
static int64_t char_index(const jstr *s, size_t off) { return (int64_t)txt_chars(s->s, off); }

static int str_method(jx *x, const jexpr *at, const char *name, const jstr *s, const jargs *a, jv *out) {
  jv p[3];
  if (!strcmp(name, "format")) return do_format(x, at, s, a, out);
  if (!strcmp(name, "strip") || !strcmp(name, "lstrip") || !strcmp(name, "rstrip")) {
    static const char *const names[] = {"chars"};
    const jstr *chars = NULL;
    if (jb_bind(x, at, name, a, names, 1, p)) return -1;
    if (jb_given(p[0]) && p[0].kind != JV_NONE && jb_str_arg(x, at, name, p[0], &chars)) return -1;
    size_t b, e;
    strip_range(s, chars, name[0] != 'r', name[0] != 'l', &b, &e);
    return str_new(x, at, s->s + b, e - b, out);
  }
  if (!strcmp(name, "split") || !strcmp(name, "rsplit")) {
    static const char *const names[] = {"sep", "maxsplit"};
    const jstr *sep = NULL;
    int64_t max = -1;
    if (jb_bind(x, at, name, a, names, 2, p)) return -1;
    if (jb_given(p[0]) && p[0].kind != JV_NONE && jb_str_arg(x, at, name, p[0], &sep)) return -1;
    if (jb_given(p[1]) && jb_int_arg(x, at, name, p[1], &max)) return -1;
    return do_split(x, at, s, sep, max, name[0] == 'r', out);
  }
  if (!strcmp(name, "splitlines")) {
    static const char *const names[] = {"keepends"};
    if (jb_bind(x, at, name, a, names, 1, p)) return -1;
    bool keep = jb_given(p[0]) && jv_truthy(p[0]);
    jlist *l = jlist_new(&x->a, 0);
    if (!l) return jx_oom(x, at);
    size_t i = 0, start = 0;
    while (i < s->len) {
      size_t br = txt_linebreak(s->s, s->len, i);
      if (!br) {
        i++;
        continue;
      }
      jv line;
      if (str_new(x, at, s->s + start, i - start + (keep ? br : 0), &line) || list_push(x, at, l, line)) return -1;
      i += br;
      start = i;
    }
    jv line;
    if (start < s->len && (str_new(x, at, s->s + start, s->len - start, &line) || list_push(x, at, l, line)))
      return -1;
    *out = (jv){.kind = JV_LIST, .u.l = l};
    return 0;
  }
  if (!strcmp(name, "startswith") || !strcmp(name, "endswith")) {
    if (a->npos != 1 || a->nkw) return jx_fail(x, at, "%s(): one argument (a string or a tuple of strings) is supported", name);
    jv arg = a->pos[0];
    const jv *opts = &arg;
    size_t nopt = 1;
    if (arg.kind == JV_LIST && arg.u.l->view == JL_TUPLE) {
      opts = arg.u.l->items;
      nopt = arg.u.l->n;
    }
    bool r = false;
    for (size_t k = 0; k < nopt && !r; k++) {
      const jstr *o;
      if (jb_str_arg(x, at, name, opts[k], &o)) return -1;
      r = o->len <= s->len && !memcmp(name[0] == 's' ? s->s : s->s + s->len - o->len, o->s, o->len);
    }
    *out = jv_bool(r);
    return 0;
  }
  if (!strcmp(name, "replace")) {
    static const char *const names[] = {"old", "new", "count"};
    const jstr *o, *n;
    int64_t count = -1;
    if (jb_bind(x, at, name, a, names, 3, p)) return -1;
    if (!jb_given(p[0]) || !jb_given(p[1])) return jx_fail(x, at, "replace() takes at least 2 arguments");
    if (jb_str_arg(x, at, name, p[0], &o) || jb_str_arg(x, at, name, p[1], &n)) return -1;
    if (jb_given(p[2]) && jb_int_arg(x, at, name, p[2], &count)) return -1;
    return do_replace(x, at, s, o, n, count, out);
  }
  if (a->npos + a->nkw && (!strcmp(name, "upper") || !strcmp(name, "lower") || !strcmp(name, "title") ||
                           !strcmp(name, "capitalize") || !strncmp(name, "is", 2)))
    return jx_fail(x, at, "%s() takes no arguments", name);
  if (!strcmp(name, "upper")) return jb_case_str(x, at, s, 'u', out);
  if (!strcmp(name, "lower")) return jb_case_str(x, at, s, 'l', out);
  if (!strcmp(name, "title")) return jb_case_str(x, at, s, 'T', out);
  if (!strcmp(name, "capitalize")) return jb_case_str(x, at, s, 'C', out);
  if (!strncmp(name, "is", 2)) {
    bool r = s->len > 0, any_cased = false, bad_case = false;
    for (size_t i = 0, n; i < s->len; i += n) {
      int32_t c = txt_cp(s->s, s->len, i, &n);
      if (!strcmp(name, "isdigit")) r = r && txt_digit(c);
      else if (!strcmp(name, "isalpha")) r = r && txt_alpha(c);
      else if (!strcmp(name, "isalnum")) r = r && (txt_alpha(c) || txt_digit(c));
      else if (!strcmp(name, "isspace")) r = r && txt_space(c);
      else {
        bool want_upper = !strcmp(name, "isupper");
        any_cased = any_cased || (want_upper ? txt_upper(c) : txt_lower(c));
        bad_case = bad_case || (want_upper ? txt_lower(c) : txt_upper(c));
      }
    }
    if (!strcmp(name, "isupper") || !strcmp(name, "islower")) r = any_cased && !bad_case;
    *out = jv_bool(r);
    return 0;
  }
  if (!strcmp(name, "join")) {
    jlist *l;
    if (a->npos != 1 || a->nkw) return jx_fail(x, at, "join() takes exactly one argument");
    if (jx_iter(x, at, a->pos[0], &l)) return -1;
    jbuf b = {.limit = JINJA_MAX_OUTPUT};
    for (size_t i = 0; i < l->n; i++) {
      if (l->items[i].kind != JV_STR) {
        jbuf_free(&b);
        return jx_fail(x, at, "sequence item %zu: expected str instance, %s found", i, jv_type_name(l->items[i]));
      }
      if ((i && jbuf_put(&b, s->s, s->len)) || jbuf_put(&b, l->items[i].u.s->s, l->items[i].u.s->len)) {
        int r = jb_buf_fail(x, at, &b);
        jbuf_free(&b);
        return r;
      }
    }
    return jb_take(x, at, &b, out);
  }
  /* find, rfind, count */
  const jstr *sub;
  if (a->npos != 1 || a->nkw) return jx_fail(x, at, "%s(): one argument (the substring) is supported", name);
  if (jb_str_arg(x, at, name, a->pos[0], &sub)) return -1;
  if (!strcmp(name, "count")) {
    int64_t c = 0;
    if (!sub->len) c = (int64_t)txt_chars(s->s, s->len) + 1;
    else
      for (const char *f = s->s; (f = txt_find(f, s->len - (size_t)(f - s->s), sub->s, sub->len)); f += sub->len) c++;
    *out = jv_int(c);
    return 0;
  }
  int64_t r = -1;
  if (name[0] == 'r') {
    for (size_t i = s->len + 1; i-- > 0;)
      if (s->len - i >= sub->len && !memcmp(s->s + i, sub->s, sub->len)) {
        r = char_index(s, i);
        break;
      }
  } else {
    const char *f = txt_find(s->s, s->len, sub->s, sub->len);
    if (f) r = char_index(s, (size_t)(f - s->s));
  }
  *out = jv_int(r);
  return 0;
}

/* ---- dict, list, loop ---- */

static int dict_method(jx *x, const jexpr *at, const char *name, const jdict *d, const jargs *a, jv *out) {
  if (!strcmp(name, "get")) {
    static const char *const names[] = {"key", "default"};
    jv p[2];
    if (jb_bind(x, at, name, a, names, 2, p)) return -1;
    if (!jb_given(p[0])) return jx_fail(x, at, "get() expected at least 1 argument, got 0");
    jv *v = jdict_get(d, p[0]);
    *out = v ? *v : jb_given(p[1]) ? p[1] : jv_none();
    return 0;
  }
  if (a->npos || a->nkw) return jx_fail(x, at, "%s() takes no arguments", name);
  jlist *l = jlist_new(&x->a, d->n);
  if (!l) return jx_oom(x, at);
  for (size_t i = 0; i < d->n; i++) {
    if (name[0] == 'i') {
      jlist *pair = jlist_new(&x->a, 2);
      if (!pair) return jx_oom(x, at);
      pair->items[0] = d->keys[i];
      pair->items[1] = d->vals[i];
      pair->n = 2;
      pair->view = JL_TUPLE;
      l->items[i] = (jv){.kind = JV_LIST, .u.l = pair};
    } else {
      l->items[i] = name[0] == 'k' ? d->keys[i] : d->vals[i];
    }
  }
  l->n = d->n;
  l->view = name[0] == 'i' ? JL_ITEMS : name[0] == 'k' ? JL_KEYS : JL_VALUES;
  *out = (jv){.kind = JV_LIST, .u.l = l};
  return 0;
}

int jb_call_method(jx *x, const jexpr *at, const jfunc *f, const jargs *a, jv *out) {
  const method *m = &METHODS[f->id - M_FIRST];
  const char *tname = m->type == 's' ? "str" : m->type == 'd' ? "dict" : m->type == 'l' ? "list" : "loop";
  if (m->st == UNSUPPORTED) return jx_fail(x, at, "%s.%s() is not supported", tname, m->name);
  switch (m->type) {
  case 's':
    if (jv_is_markup(f->self))
      return jx_fail(x, at, "str.%s() of a Markup string (from escape or safe) is not supported", m->name);
    return str_method(x, at, m->name, f->self.u.s, a, out);
  case 'd': return dict_method(x, at, m->name, f->self.u.d, a, out);
  case 'p':
    if (!a->npos || a->nkw) return jx_fail(x, at, "loop.cycle() needs at least one positional argument");
    *out = a->pos[f->self.u.loop->index0 % a->npos];
    return 0;
  default: break;
  }
  /* list.index, list.count */
  if (a->npos != 1 || a->nkw) return jx_fail(x, at, "list.%s() takes exactly one argument", m->name);
  const jlist *l = f->self.u.l;
  int64_t c = 0;
  for (size_t i = 0; i < l->n; i++) {
    bool eq;
    if (jv_equal(l->items[i], a->pos[0], &eq)) return jx_fail(x, at, "values nested deeper than %d", JV_DEPTH);
    if (eq && m->name[0] == 'i') {
      *out = jv_int((int64_t)i);
      return 0;
    }
    c += eq;
  }
  if (m->name[0] == 'i') return jx_fail(x, at, "list.index(x): x not in list");
  *out = jv_int(c);
  return 0;
}

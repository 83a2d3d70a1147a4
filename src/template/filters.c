/* Filters, as jinja2/filters.py defines them (autoescape off, as
 * transformers' environment) and tojson as transformers overrides it. What
 * Jinja2 returns as a generator (map, select, reject, selectattr,
 * rejectattr, unique, items, reverse of a list) is a JL_GEN list here:
 * iterable, always true, without len() or text. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "template/bi.h"
#include "template/text.h"

enum {
  F_ABS, F_ATTR, F_CAPITALIZE, F_CENTER, F_DEFAULT, F_DICTSORT, F_ESCAPE, F_FIRST, F_FLOAT,
  F_INDENT, F_INT, F_ITEMS, F_JOIN, F_LAST, F_LENGTH, F_LIST, F_LOWER, F_MAP, F_MAX, F_MIN,
  F_REJECT, F_REJECTATTR, F_REPLACE, F_REVERSE, F_ROUND, F_SAFE, F_SELECT, F_SELECTATTR,
  F_SORT, F_STRING, F_SUM, F_TITLE, F_TOJSON, F_TRIM, F_UNIQUE, F_UPPER,
};

static const struct {
  const char *name;
  int id;
} FILTERS[] = {
    {"abs", F_ABS}, {"attr", F_ATTR}, {"capitalize", F_CAPITALIZE}, {"center", F_CENTER},
    {"count", F_LENGTH}, {"d", F_DEFAULT}, {"default", F_DEFAULT}, {"dictsort", F_DICTSORT},
    {"e", F_ESCAPE}, {"escape", F_ESCAPE}, {"forceescape", F_ESCAPE}, {"first", F_FIRST},
    {"float", F_FLOAT}, {"indent", F_INDENT}, {"int", F_INT}, {"items", F_ITEMS}, {"join", F_JOIN},
    {"last", F_LAST}, {"length", F_LENGTH}, {"list", F_LIST}, {"lower", F_LOWER}, {"map", F_MAP},
    {"max", F_MAX}, {"min", F_MIN}, {"reject", F_REJECT}, {"rejectattr", F_REJECTATTR},
    {"replace", F_REPLACE}, {"reverse", F_REVERSE}, {"round", F_ROUND}, {"safe", F_SAFE},
    {"select", F_SELECT}, {"selectattr", F_SELECTATTR}, {"sort", F_SORT}, {"string", F_STRING},
    {"sum", F_SUM}, {"title", F_TITLE}, {"tojson", F_TOJSON}, {"trim", F_TRIM},
    {"unique", F_UNIQUE}, {"upper", F_UPPER},
};

static const char *const UNSUPPORTED[] = {
    "batch", "filesizeformat", "format", "groupby", "pprint", "random", "slice", "striptags",
    "truncate", "urlencode", "urlize", "wordcount", "wordwrap", "xmlattr", NULL};

int jb_filter_id(const char *name) {
  for (size_t i = 0; i < sizeof FILTERS / sizeof *FILTERS; i++)
    if (!strcmp(FILTERS[i].name, name)) return FILTERS[i].id;
  for (size_t i = 0; UNSUPPORTED[i]; i++)
    if (!strcmp(UNSUPPORTED[i], name)) return JB_UNSUPPORTED;
  return -1;
}

const char *jb_filter_names(void) {
  return "abs, attr, capitalize, center, count, d/default, dictsort, e/escape/forceescape, first, "
         "float, indent, int, items, join, last, length, list, lower, map, max, min, reject, "
         "rejectattr, replace, reverse, round, safe, select, selectattr, sort, string, sum, title, "
         "tojson, trim, unique, upper";
}

static jv list_v(jlist *l) { return (jv){.kind = JV_LIST, .u.l = l}; }

/* A filter's string result from a jbuf that may have failed (rc). */
static int finish(jx *x, const jexpr *at, jbuf *b, int rc, jv *out) {
  if (rc) {
    int r = jb_buf_fail(x, at, b);
    jbuf_free(b);
    return r;
  }
  return jb_take(x, at, b, out);
}

/* str(v) of the filtered value (soft_str); Undefined is "". */
static int as_str(jx *x, const jexpr *at, jv v, const jstr **out) {
  jv s;
  if (jx_tostr(x, at, v, &s)) return -1;
  *out = s.u.s;
  return 0;
}

/* ignore_case: strings lowercased for comparing. */
static int fold(jx *x, const jexpr *at, jv v, bool case_sensitive, jv *out) {
  if (case_sensitive || v.kind != JV_STR) {
    *out = v;
    return 0;
  }
  return jb_case_str(x, at, v.u.s, 'l', out);
}

/* The key of an item for sort/unique/min/max: the attribute (comma
 * separated list for sort) then case folding. */
static int sort_key(jx *x, const jexpr *at, jv item, jv attr, bool multi, bool cs, jv *out) {
  if (!jb_given(attr) || attr.kind == JV_NONE) return fold(x, at, item, cs, out);
  const jstr *path;
  if (attr.kind == JV_INT) {
    jv key = attr, *f;
    *out = item.kind == JV_LIST && jlist_indexable(item.u.l) && attr.u.i >= 0 && (size_t)attr.u.i < item.u.l->n
               ? item.u.l->items[attr.u.i]
           : item.kind == JV_DICT && (f = jdict_get(item.u.d, key)) ? *f
                                                                   : jv_undef_msg("no such item");
    return fold(x, at, *out, cs, out);
  }
  if (jb_str_arg(x, at, "attribute", attr, &path)) return -1;
  if (!multi || !memchr(path->s, ',', path->len)) {
    jv v;
    return jb_attr_path(x, at, item, path, &v) || fold(x, at, v, cs, out);
  }
  jlist *keys = jlist_new(&x->a, 0);
  if (!keys) return jx_oom(x, at);
  for (size_t i = 0; i <= path->len;) {
    size_t j = i;
    while (j < path->len && path->s[j] != ',') j++;
    jv part, v;
    if (jx_str(x, at, path->s + i, j - i, &part) || jb_attr_path(x, at, item, part.u.s, &v) ||
        fold(x, at, v, cs, &v))
      return -1;
    if (jlist_push(&x->a, keys, v)) return jx_oom(x, at);
    i = j + 1;
  }
  *out = list_v(keys);
  return 0;
}

/* A stable merge sort of items by keys (Python's sorted; reverse keeps
 * equal items in their order, as Python's). */
typedef struct kv {
  jv key, item;
} kv;

static int merge_sort(jx *x, const jexpr *at, kv *a, kv *tmp, size_t n, bool rev) {
  if (n < 2) return 0;
  size_t h = n / 2;
  if (merge_sort(x, at, a, tmp, h, rev) || merge_sort(x, at, a + h, tmp, n - h, rev)) return -1;
  size_t i = 0, j = h, k = 0;
  while (i < h && j < n) {
    bool lt; /* take the right one first only when it is strictly before */
    if (rev ? jx_less(x, at, a[i].key, a[j].key, &lt) : jx_less(x, at, a[j].key, a[i].key, &lt)) return -1;
    tmp[k++] = lt ? a[j++] : a[i++];
  }
  while (i < h) tmp[k++] = a[i++];
  while (j < n) tmp[k++] = a[j++];
  memcpy(a, tmp, n * sizeof *a);
  return 0;
}

static int sorted(jx *x, const jexpr *at, jlist *items, jv attr, bool multi, bool cs, bool rev, jlist **out) {
  size_t n = items->n;
  kv *a = ja_alloc(&x->a, (n + 1) * sizeof *a), *tmp = ja_alloc(&x->a, (n + 1) * sizeof *tmp);
  jlist *l = jlist_new(&x->a, n);
  if (!a || !tmp || !l) return jx_oom(x, at);
  for (size_t i = 0; i < n; i++) {
    a[i].item = items->items[i];
    if (sort_key(x, at, a[i].item, attr, multi, cs, &a[i].key)) return -1;
  }
  if (merge_sort(x, at, a, tmp, n, rev)) return -1;
  for (size_t i = 0; i < n; i++) l->items[i] = a[i].item;
  l->n = n;
  *out = l;
  return 0;
}

/* Python's round(x, ndigits) for a float: correctly rounded (glibc's
 * printf rounds the exact binary value, half to even, as Python's). */
static double py_round(double v, int64_t nd) {
  if (!isfinite(v) || nd > 300) return v;
  if (nd < -300) return 0.0 * v;
  char buf[512];
  if (nd >= 0) {
    snprintf(buf, sizeof buf, "%.*f", (int)nd, v);
    return strtod(buf, NULL);
  }
  double p = pow(10.0, (double)-nd), y = v / p, r = nearbyint(y);
  if (fabs(y - trunc(y)) == 0.5) r = 2.0 * nearbyint(y / 2.0);
  return r * p;
}

/* Python's int(str) (base 10, surrounding whitespace, one sign, digits
 * with single underscores) and float(str). */
static bool parse_int(const jstr *s, int64_t *out) {
  size_t b, e, n;
  for (b = 0; b < s->len && txt_space(txt_cp(s->s, s->len, b, &n));) b += n;
  for (e = s->len; e > b && (s->s[e - 1] == ' ' || (s->s[e - 1] >= '\t' && s->s[e - 1] <= '\r'));) e--;
  bool neg = false;
  if (b < e && (s->s[b] == '+' || s->s[b] == '-')) neg = s->s[b++] == '-';
  if (b >= e) return false;
  __int128 v = 0;
  for (size_t i = b; i < e; i++) {
    if (s->s[i] == '_' && i > b && i + 1 < e && s->s[i - 1] != '_') continue;
    if (s->s[i] < '0' || s->s[i] > '9') return false;
    v = v * 10 + (s->s[i] - '0');
    if (v > (__int128)INT64_MAX + 1) return false;
  }
  v = neg ? -v : v;
  if (v > INT64_MAX) return false;
  *out = (int64_t)v;
  return true;
}

static bool parse_float(const jstr *s, double *out) {
  char buf[128];
  size_t b = 0, e = s->len;
  while (b < e && (s->s[b] == ' ' || (s->s[b] >= '\t' && s->s[b] <= '\r'))) b++;
  while (e > b && (s->s[e - 1] == ' ' || (s->s[e - 1] >= '\t' && s->s[e - 1] <= '\r'))) e--;
  if (e == b || e - b >= sizeof buf) return false;
  size_t k = 0;
  for (size_t i = b; i < e; i++)
    if (s->s[i] != '_') buf[k++] = s->s[i];
  buf[k] = 0;
  if (strchr(buf, 'x') || strchr(buf, 'X')) return false; /* C's hex floats */
  char *end;
  double v = strtod(buf, &end);
  if (*end) return false;
  *out = v;
  return true;
}

/* Jinja2's indent: lines after the first (and the first with first=True)
 * get the indentation; empty lines only with blank=True. */
static int do_indent(jx *x, const jexpr *at, const jstr *s, const jstr *ind, bool first, bool blank, jv *out) {
  jbuf b = {.limit = JINJA_MAX_OUTPUT};
  int rc = first ? jbuf_put(&b, ind->s, ind->len) : 0;
  /* s + "\n" split into lines (splitlines), rejoined with "\n" */
  size_t i = 0, start = 0;
  bool first_line = true;
  while (!rc && i <= s->len) {
    size_t br = i < s->len ? txt_linebreak(s->s, s->len, i) : 1;
    if (!br) {
      i++;
      continue;
    }
    size_t len = i - start;
    if (!first_line) {
      rc = jbuf_put(&b, "\n", 1);
      if (!rc && (len || blank)) rc = jbuf_put(&b, ind->s, ind->len);
    }
    if (!rc) rc = jbuf_put(&b, s->s + start, len);
    first_line = false;
    i += br;
    start = i;
    if (i > s->len) break;
  }
  return finish(x, at, &b, rc, out);
}

/* tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) */
static int do_tojson(jx *x, const jexpr *at, jv v, const jv *p, jv *out) {
  py_json_opts o = {.indent = -1};
  if (jb_given(p[0])) o.ensure_ascii = jv_truthy(p[0]);
  if (jb_given(p[1]) && p[1].kind != JV_NONE) {
    int64_t ind;
    if (jb_int_arg(x, at, "tojson indent", p[1], &ind)) return -1;
    if (ind > 64) return jx_fail(x, at, "tojson(): an indent of %lld, expected at most 64", (long long)ind);
    o.indent = ind < 0 ? 0 : (int)ind;
  }
  if (jb_given(p[2]) && p[2].kind != JV_NONE) {
    const jstr *a, *b;
    if (p[2].kind != JV_LIST || p[2].u.l->n != 2 || jb_str_arg(x, at, "tojson separators", p[2].u.l->items[0], &a) ||
        jb_str_arg(x, at, "tojson separators", p[2].u.l->items[1], &b))
      return jx_fail(x, at, "tojson(): separators must be a pair of strings");
    o.item_sep = a->s;
    o.key_sep = b->s;
  }
  if (jb_given(p[3])) o.sort_keys = jv_truthy(p[3]);
  jbuf b = {.limit = JINJA_MAX_OUTPUT};
  const char *why;
  if (py_tojson(&b, v, &o, &why)) {
    jbuf_free(&b);
    return why ? jx_fail(x, at, "tojson: %s", why) : jb_buf_fail(x, at, &b);
  }
  return jb_take(x, at, &b, out);
}

/* map / select / reject / selectattr / rejectattr. */
static int do_map(jx *x, const jexpr *at, jv v, const jargs *a, jv *out) {
  jlist *items, *l;
  if (!jv_truthy(v)) { /* "if value:" */
    if (!(l = jlist_new(&x->a, 0))) return jx_oom(x, at);
    l->view = JL_GEN;
    *out = list_v(l);
    return 0;
  }
  if (jx_iter(x, at, v, &items)) return -1;
  if (!(l = jlist_new(&x->a, items->n))) return jx_oom(x, at);
  l->view = JL_GEN;
  bool by_attr = !a->npos && a->nkw && !strcmp(a->kwn[0], "attribute");
  if (by_attr) {
    jv dflt = jv_none();
    const jstr *path;
    for (size_t k = 1; k < a->nkw; k++) {
      if (strcmp(a->kwn[k], "default")) return jx_fail(x, at, "map(): unexpected keyword argument '%s'", a->kwn[k]);
      dflt = a->kwv[k];
    }
    if (a->kwv[0].kind == JV_INT) return jx_fail(x, at, "map(attribute=) with an integer is not supported");
    if (jb_str_arg(x, at, "map attribute", a->kwv[0], &path)) return -1;
    for (size_t i = 0; i < items->n; i++) {
      jv r;
      if (jb_attr_path(x, at, items->items[i], path, &r)) return -1;
      if (r.kind == JV_UNDEF && dflt.kind != JV_NONE) r = dflt;
      l->items[l->n++] = r;
    }
  } else {
    if (!a->npos) return jx_fail(x, at, "map requires a filter argument");
    const jstr *name;
    if (jb_str_arg(x, at, "map", a->pos[0], &name)) return -1;
    int id = jb_filter_id(name->s);
    if (id < 0) return jx_fail(x, at, "map(): no filter named '%s' in the supported subset", name->s);
    jargs rest = {.pos = a->pos + 1, .npos = a->npos - 1, .kwn = a->kwn, .kwv = a->kwv, .nkw = a->nkw};
    for (size_t i = 0; i < items->n; i++)
      if (jb_filter(x, at, id, items->items[i], &rest, &l->items[l->n++])) return -1;
  }
  *out = list_v(l);
  return 0;
}

static int do_select(jx *x, const jexpr *at, jv v, const jargs *a, bool attr, bool keep, jv *out) {
  jlist *items, *l = jlist_new(&x->a, 0);
  if (!l) return jx_oom(x, at);
  l->view = JL_GEN;
  *out = list_v(l);
  if (!jv_truthy(v)) return 0; /* "if value:" */
  if (a->nkw) return jx_fail(x, at, "select/reject filters take no keyword arguments");
  if (jx_iter(x, at, v, &items)) return -1;
  size_t off = attr ? 1 : 0;
  const jstr *path = NULL;
  if (attr && (!a->npos || jb_str_arg(x, at, "selectattr", a->pos[0], &path)))
    return a->npos ? -1 : jx_fail(x, at, "Missing parameter for attribute name");
  int test = -1;
  if (a->npos > off) {
    const jstr *name;
    if (jb_str_arg(x, at, "select test", a->pos[off], &name)) return -1;
    test = jb_test_id(name->s);
    if (test < 0) return jx_fail(x, at, "no test named '%s' in the supported subset", name->s);
  }
  for (size_t i = 0; i < items->n; i++) {
    jv item = items->items[i], t = item;
    bool r;
    if (path && jb_attr_path(x, at, item, path, &t)) return -1;
    if (test < 0) r = jv_truthy(t);
    else if (jb_test_pos(x, at, test, t, a->pos + off + 1, a->npos - off - 1, &r)) return -1;
    if (r == keep && jlist_push(&x->a, l, item)) return jx_oom(x, at);
  }
  return 0;
}

/* Parameter lists of the filters that take named parameters. */
#define P(...) (const char *const[]){__VA_ARGS__}, sizeof((const char *const[]){__VA_ARGS__}) / sizeof(char *)

int jb_filter(jx *x, const jexpr *at, int id, jv v, const jargs *a, jv *out) {
  const char *fname = at->kind == E_FILTER ? at->name : "map";
  jv p[6];
  const jstr *s;
  jlist *items;
  jbuf b = {.limit = JINJA_MAX_OUTPUT};
  /* Markup strings: what keeps the same text as a str does is allowed */
  if (jv_is_markup(v) && id != F_ESCAPE && id != F_SAFE && id != F_STRING && id != F_LENGTH && id != F_TOJSON &&
      id != F_DEFAULT && id != F_JOIN && id != F_FIRST && id != F_LAST && id != F_LIST)
    return jx_fail(x, at, "filter '%s' of a Markup string (from escape or safe) is not supported", fname);
  switch (id) {
  case F_ABS:
    if (jb_bind(x, at, fname, a, NULL, 0, p)) return -1;
    if (v.kind == JV_FLOAT) *out = jv_float(fabs(v.u.f));
    else if (v.kind == JV_INT || v.kind == JV_BOOL) {
      int64_t i = v.kind == JV_INT ? v.u.i : v.u.b;
      if (i == INT64_MIN) return jx_fail(x, at, "integer overflow in abs");
      *out = jv_int(i < 0 ? -i : i);
    } else return jx_fail(x, at, "bad operand type for abs(): '%s'", jv_type_name(v));
    return 0;
  case F_ATTR:
    if (jb_bind(x, at, fname, a, P("name"), p) || jb_str_arg(x, at, fname, p[0], &s)) return -1;
    if (v.kind == JV_DICT) { /* getattr only: a dict's keys are not its attributes */
      int m = jb_method(x, at, v, s->s, s->len, out);
      if (!m) *out = jv_undef(s->s);
      return m < 0 ? -1 : 0;
    }
    return jx_getattr(x, at, v, s->s, s->len, out);
  case F_CAPITALIZE:
  case F_LOWER:
  case F_UPPER: {
    if (jb_bind(x, at, fname, a, NULL, 0, p) || as_str(x, at, v, &s)) return -1;
    return jb_case_str(x, at, s, id == F_LOWER ? 'l' : id == F_UPPER ? 'u' : 'C', out);
  }
  case F_CENTER: {
    int64_t w = 80;
    if (jb_bind(x, at, fname, a, P("width"), p) || as_str(x, at, v, &s)) return -1;
    if (jb_given(p[0]) && jb_int_arg(x, at, fname, p[0], &w)) return -1;
    int64_t n = (int64_t)txt_chars(s->s, s->len);
    if (w > (int64_t)JINJA_MAX_OUTPUT) return jx_fail(x, at, "center(): a width of %lld is too large", (long long)w);
    int64_t pad = w > n ? w - n : 0, left = pad / 2 + (pad & w & 1);
    int rc = 0;
    for (int64_t i = 0; !rc && i < left; i++) rc = jbuf_put(&b, " ", 1);
    rc = rc || jbuf_put(&b, s->s, s->len);
    for (int64_t i = 0; !rc && i < pad - left; i++) rc = jbuf_put(&b, " ", 1);
    return finish(x, at, &b, rc, out);
  }
  case F_DEFAULT:
    if (jb_bind(x, at, fname, a, P("default_value", "boolean"), p)) return -1;
    if (v.kind == JV_UNDEF || (jb_given(p[1]) && jv_truthy(p[1]) && !jv_truthy(v))) {
      if (!jb_given(p[0])) return jx_str(x, at, "", 0, out);
      *out = p[0];
    } else {
      *out = v;
    }
    return 0;
  case F_DICTSORT: {
    if (jb_bind(x, at, fname, a, P("case_sensitive", "by", "reverse"), p)) return -1;
    if (v.kind != JV_DICT) return jx_fail(x, at, "dictsort: expected a dict, found %s", jv_type_name(v));
    int64_t pos = 0;
    if (jb_given(p[1])) {
      const jstr *by;
      if (jb_str_arg(x, at, fname, p[1], &by)) return -1;
      if (strcmp(by->s, "key") && strcmp(by->s, "value"))
        return jx_fail(x, at, "You can only sort by either \"key\" or \"value\"");
      pos = by->s[0] == 'v';
    }
    jlist *pairs = jlist_new(&x->a, v.u.d->n);
    if (!pairs) return jx_oom(x, at);
    for (size_t i = 0; i < v.u.d->n; i++) {
      jlist *t = jlist_new(&x->a, 2);
      if (!t) return jx_oom(x, at);
      t->items[0] = v.u.d->keys[i];
      t->items[1] = v.u.d->vals[i];
      t->n = 2;
      t->view = JL_TUPLE;
      pairs->items[pairs->n++] = list_v(t);
    }
    jlist *r;
    if (sorted(x, at, pairs, jv_int(pos), false, jb_given(p[0]) && jv_truthy(p[0]), jb_given(p[2]) && jv_truthy(p[2]),
               &r))
      return -1;
    *out = list_v(r);
    return 0;
  }
  case F_ESCAPE: {
    if (jb_bind(x, at, fname, a, NULL, 0, p)) return -1;
    if (jv_is_markup(v) && strcmp(fname, "forceescape")) { /* escaped once */
      *out = v;
      return 0;
    }
    if (as_str(x, at, v, &s)) return -1;
    int rc = 0;
    for (size_t i = 0; !rc && i < s->len; i++) {
      const char *r = s->s[i] == '&' ? "&amp;" : s->s[i] == '<' ? "&lt;" : s->s[i] == '>' ? "&gt;"
                    : s->s[i] == '"' ? "&#34;" : s->s[i] == '\'' ? "&#39;" : NULL;
      rc = r ? jbuf_put(&b, r, strlen(r)) : jbuf_put(&b, s->s + i, 1);
    }
    if (finish(x, at, &b, rc, out)) return -1;
    *out = jv_markupv(out->u.s);
    return 0;
  }
  case F_FIRST:
  case F_LAST:
    if (jb_bind(x, at, fname, a, NULL, 0, p)) return -1;
    if (id == F_LAST && v.kind == JV_LIST && v.u.l->view == JL_GEN)
      return jx_fail(x, at, "last: a generator cannot be reversed (add |list before |last)");
    if (id == F_LAST && v.kind == JV_DICT) return jx_fail(x, at, "last of a dict is not supported");
    if (jx_iter(x, at, v, &items)) return -1;
    *out = items->n ? items->items[id == F_FIRST ? 0 : items->n - 1]
                    : jv_undef_msg(id == F_FIRST ? "No first item, sequence was empty." : "No last item, sequence was empty.");
    return 0;
  case F_FLOAT: {
    if (jb_bind(x, at, fname, a, P("default"), p)) return -1;
    if (v.kind == JV_UNDEF) return jx_undefined(x, at, v); /* float(Undefined) fails */
    double f;
    if (jv_is_num(v)) *out = jv_float(jv_num(v));
    else if (v.kind == JV_STR && parse_float(v.u.s, &f)) *out = jv_float(f);
    else *out = jb_given(p[0]) ? p[0] : jv_float(0.0);
    return 0;
  }
  case F_INT: {
    if (jb_bind(x, at, fname, a, P("default", "base"), p)) return -1;
    if (v.kind == JV_UNDEF) return jx_undefined(x, at, v); /* int(Undefined) fails */
    if (jb_given(p[1]) && !jv_eq(p[1], jv_int(10))) return jx_fail(x, at, "int(): only base 10 is supported");
    int64_t i;
    double f;
    if (v.kind == JV_INT || v.kind == JV_BOOL) *out = jv_int(v.kind == JV_INT ? v.u.i : v.u.b);
    else if (v.kind == JV_STR && parse_int(v.u.s, &i)) *out = jv_int(i);
    else if ((v.kind == JV_FLOAT && (f = v.u.f, true)) || (v.kind == JV_STR && parse_float(v.u.s, &f))) {
      if (!(f > -9.2e18 && f < 9.2e18)) *out = jb_given(p[0]) ? p[0] : jv_int(0);
      else *out = jv_int((int64_t)f);
    } else *out = jb_given(p[0]) ? p[0] : jv_int(0);
    return 0;
  }
  case F_ITEMS: {
    if (jb_bind(x, at, fname, a, NULL, 0, p)) return -1;
    if (v.kind == JV_UNDEF) v = (jv){.kind = JV_DICT, .u.d = jdict_new(&x->a, 0)};
    if (v.kind != JV_DICT || !v.u.d) return v.u.d ? jx_fail(x, at, "Can only get item pairs from a mapping.") : jx_oom(x, at);
    jv fn;
    jargs none = {0};
    if (jb_method(x, at, v, "items", 5, &fn) < 0 || jb_call(x, at, fn.u.fn, &none, out)) return -1;
    out->u.l->view = JL_GEN;
    return 0;
  }
  case F_JOIN: {
    if (jb_bind(x, at, fname, a, P("d", "attribute"), p)) return -1;
    const jstr *d = NULL;
    if (jb_given(p[0]) && as_str(x, at, p[0], &d)) return -1;
    if (jx_iter(x, at, v, &items)) return -1;
    int rc = 0;
    for (size_t i = 0; !rc && i < items->n; i++) {
      jv it = items->items[i];
      const jstr *path;
      if (jb_given(p[1]) && p[1].kind != JV_NONE &&
          (jb_str_arg(x, at, fname, p[1], &path) || jb_attr_path(x, at, it, path, &it))) {
        jbuf_free(&b);
        return -1;
      }
      if (as_str(x, at, it, &s)) {
        jbuf_free(&b);
        return -1;
      }
      if (i && d) rc = jbuf_put(&b, d->s, d->len);
      rc = rc || jbuf_put(&b, s->s, s->len);
    }
    return finish(x, at, &b, rc, out);
  }
  case F_LENGTH:
    if (jb_bind(x, at, fname, a, NULL, 0, p)) return -1;
    switch (v.kind) {
    case JV_UNDEF: *out = jv_int(0); return 0;
    case JV_STR: *out = jv_int((int64_t)txt_chars(v.u.s->s, v.u.s->len)); return 0;
    case JV_DICT: *out = jv_int((int64_t)v.u.d->n); return 0;
    case JV_LIST:
      if (v.u.l->view != JL_GEN) {
        *out = jv_int((int64_t)v.u.l->n);
        return 0;
      }
      return jx_fail(x, at, "object of type 'generator' has no len() (add |list before |length)");
    default: return jx_fail(x, at, "object of type '%s' has no len()", jv_type_name(v));
    }
  case F_LIST: {
    if (jb_bind(x, at, fname, a, NULL, 0, p) || jx_iter(x, at, v, &items)) return -1;
    jlist *l = jlist_new(&x->a, items->n);
    if (!l) return jx_oom(x, at);
    jv_copy(l->items, items->items, items->n);
    l->n = items->n;
    *out = list_v(l);
    return 0;
  }
  case F_MAP: return do_map(x, at, v, a, out);
  case F_SELECT: return do_select(x, at, v, a, false, true, out);
  case F_REJECT: return do_select(x, at, v, a, false, false, out);
  case F_SELECTATTR: return do_select(x, at, v, a, true, true, out);
  case F_REJECTATTR: return do_select(x, at, v, a, true, false, out);
  case F_MAX:
  case F_MIN: {
    if (jb_bind(x, at, fname, a, P("case_sensitive", "attribute"), p) || jx_iter(x, at, v, &items)) return -1;
    if (!items->n) {
      *out = jv_undef_msg("No aggregated item, sequence was empty.");
      return 0;
    }
    bool cs = jb_given(p[0]) && jv_truthy(p[0]);
    jv best = items->items[0], bk;
    if (sort_key(x, at, best, p[1], false, cs, &bk)) return -1;
    for (size_t i = 1; i < items->n; i++) {
      jv k;
      bool lt;
      if (sort_key(x, at, items->items[i], p[1], false, cs, &k) ||
          (id == F_MAX ? jx_less(x, at, bk, k, &lt) : jx_less(x, at, k, bk, &lt)))
        return -1;
      if (lt) {
        best = items->items[i];
        bk = k;
      }
    }
    *out = best;
    return 0;
  }
  case F_REPLACE: {
    if (jb_bind(x, at, fname, a, P("old", "new", "count"), p) || as_str(x, at, v, &s)) return -1;
    if (!jb_given(p[0]) || !jb_given(p[1])) return jx_fail(x, at, "replace needs the old and new strings");
    jv fn, args3[3] = {p[0], p[1], jb_given(p[2]) && p[2].kind != JV_NONE ? p[2] : jv_int(-1)};
    const jstr *o, *n;
    if (as_str(x, at, p[0], &o) || as_str(x, at, p[1], &n)) return -1;
    args3[0] = jv_strv(o);
    args3[1] = jv_strv(n);
    jargs ra = {.pos = args3, .npos = 3};
    if (jb_method(x, at, jv_strv(s), "replace", 7, &fn) < 0) return -1;
    return jb_call(x, at, fn.u.fn, &ra, out);
  }
  case F_REVERSE: {
    if (jb_bind(x, at, fname, a, NULL, 0, p)) return -1;
    if (v.kind == JV_STR) { /* value[::-1], by characters */
      int rc = 0;
      for (size_t e = v.u.s->len; !rc && e > 0;) {
        size_t k = e - 1;
        while (k > 0 && ((unsigned char)v.u.s->s[k] & 0xC0) == 0x80) k--;
        rc = jbuf_put(&b, v.u.s->s + k, e - k);
        e = k;
      }
      return finish(x, at, &b, rc, out);
    }
    if (jx_iter(x, at, v, &items)) return -1;
    jlist *l = jlist_new(&x->a, items->n);
    if (!l) return jx_oom(x, at);
    for (size_t i = 0; i < items->n; i++) l->items[i] = items->items[items->n - 1 - i];
    l->n = items->n;
    /* reversed() of a list, tuple or dict is an iterator; of a generator,
     * list(value) reversed */
    l->view = v.kind == JV_LIST && v.u.l->view == JL_GEN ? JL_LIST : JL_GEN;
    *out = list_v(l);
    return 0;
  }
  case F_ROUND: {
    if (jb_bind(x, at, fname, a, P("precision", "method"), p)) return -1;
    int64_t nd = 0;
    if (jb_given(p[0]) && jb_int_arg(x, at, fname, p[0], &nd)) return -1;
    const char *method = "common";
    if (jb_given(p[1])) {
      if (jb_str_arg(x, at, fname, p[1], &s)) return -1;
      method = s->s;
    }
    if (strcmp(method, "common") && strcmp(method, "ceil") && strcmp(method, "floor"))
      return jx_fail(x, at, "method must be common, ceil or floor");
    if (!jv_is_num(v)) return jx_fail(x, at, "round: expected a number, found %s", jv_type_name(v));
    if (method[0] == 'c' && method[1] == 'o') {
      if (v.kind != JV_FLOAT) { /* round(int, n) is an int, ties to even */
        int64_t i = v.kind == JV_INT ? v.u.i : v.u.b, r = i;
        if (nd < 0) {
          int64_t m = 1;
          for (int64_t k = 0; k < -nd && m <= INT64_MAX / 10; k++) m *= 10;
          if (-nd > 18) { /* |i| < 2^63 < 10^20 / 2: 0, or 10^19 which does not fit */
            if (-nd == 19 && (i > 5000000000000000000LL || i < -5000000000000000000LL))
              return jx_fail(x, at, "integer overflow in round");
            r = 0;
          } else {
            int64_t q = i / m, rem = i % m;
            if (rem < 0) {
              q--;
              rem += m;
            }
            if (rem * 2 > m || (rem * 2 == m && (q & 1))) q++;
            if (__builtin_mul_overflow(q, m, &r)) return jx_fail(x, at, "integer overflow in round");
          }
        }
        *out = jv_int(r);
        return 0;
      }
      *out = jv_float(py_round(v.u.f, nd));
      return 0;
    }
    if (nd < -300 || nd > 300) return jx_fail(x, at, "round: precision %lld is out of range", (long long)nd);
    double scale = pow(10.0, (double)nd), y = jv_num(v) * scale;
    *out = jv_float((method[0] == 'c' ? ceil(y) : floor(y)) / scale);
    return 0;
  }
  case F_SAFE:
  case F_STRING: /* soft_str keeps a Markup; safe makes one */
    if (jb_bind(x, at, fname, a, NULL, 0, p) || jx_tostr(x, at, v, out)) return -1;
    if (id == F_SAFE || jv_is_markup(v)) *out = jv_markupv(out->u.s);
    return 0;
  case F_SORT: {
    if (jb_bind(x, at, fname, a, P("reverse", "case_sensitive", "attribute"), p) || jx_iter(x, at, v, &items))
      return -1;
    jlist *r;
    if (sorted(x, at, items, p[2], true, jb_given(p[1]) && jv_truthy(p[1]), jb_given(p[0]) && jv_truthy(p[0]), &r))
      return -1;
    *out = list_v(r);
    return 0;
  }
  case F_SUM: {
    if (jb_bind(x, at, fname, a, P("attribute", "start"), p) || jx_iter(x, at, v, &items)) return -1;
    jv acc = jb_given(p[1]) ? p[1] : jv_int(0);
    if (acc.kind == JV_STR) return jx_fail(x, at, "sum() can't sum strings [use ''.join(seq) instead]");
    for (size_t i = 0; i < items->n; i++) {
      jv it = items->items[i];
      const jstr *path;
      if (jb_given(p[0]) && p[0].kind != JV_NONE &&
          (jb_str_arg(x, at, fname, p[0], &path) || jb_attr_path(x, at, it, path, &it)))
        return -1;
      if (jx_arith(x, at, '+', acc, it, &acc)) return -1;
    }
    *out = acc;
    return 0;
  }
  case F_TITLE: { /* Jinja2's: per word (after runs of - whitespace ( { [ <), word[0].upper() +
                    word[1:].lower(), each part a string of its own */
    if (jb_bind(x, at, fname, a, NULL, 0, p) || as_str(x, at, v, &s)) return -1;
    int rc = 0;
    int32_t bad = 0;
    for (size_t i = 0, n; !rc && i < s->len;) {
      int32_t c = txt_cp(s->s, s->len, i, &n);
      if (c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || txt_space(c)) {
        rc = jbuf_put(&b, s->s + i, n);
        i += n;
        continue;
      }
      size_t e = i + n, m;
      while (e < s->len) {
        int32_t d = txt_cp(s->s, s->len, e, &m);
        if (d == '-' || d == '(' || d == '{' || d == '[' || d == '<' || txt_space(d)) break;
        e += m;
      }
      rc = txt_case(&b, s->s + i, n, 0, n, 'u', &bad);
      if (!rc) rc = txt_case(&b, s->s + i + n, e - i - n, 0, e - i - n, 'l', &bad);
      i = e;
    }
    return rc ? jb_case_fail(x, at, &b, rc, bad) : jb_take(x, at, &b, out);
  }
  case F_TOJSON:
    if (jb_bind(x, at, fname, a, P("ensure_ascii", "indent", "separators", "sort_keys"), p)) return -1;
    return do_tojson(x, at, v, p, out);
  case F_TRIM: {
    if (jb_bind(x, at, fname, a, P("chars"), p) || as_str(x, at, v, &s)) return -1;
    jv fn;
    jv sv = jv_strv(s);
    jargs ta = {.pos = p, .npos = jb_given(p[0]) ? 1 : 0};
    if (jb_method(x, at, sv, "strip", 5, &fn) < 0) return -1;
    return jb_call(x, at, fn.u.fn, &ta, out);
  }
  case F_UNIQUE: {
    if (jb_bind(x, at, fname, a, P("case_sensitive", "attribute"), p) || jx_iter(x, at, v, &items)) return -1;
    jlist *l = jlist_new(&x->a, 0), *seen = jlist_new(&x->a, 0);
    if (!l || !seen) return jx_oom(x, at);
    l->view = JL_GEN;
    bool cs = jb_given(p[0]) && jv_truthy(p[0]);
    for (size_t i = 0; i < items->n; i++) {
      jv k;
      bool dup = false;
      if (sort_key(x, at, items->items[i], p[1], false, cs, &k)) return -1;
      if (k.kind == JV_DICT || k.kind == JV_NS || (k.kind == JV_LIST && k.u.l->view != JL_TUPLE))
        return jx_fail(x, at, "unhashable type: '%s'", jv_type_name(k));
      for (size_t j = 0; j < seen->n && !dup; j++)
        if (jv_equal(seen->items[j], k, &dup)) return jx_fail(x, at, "values nested deeper than %d", JV_DEPTH);
      if (!dup && (jlist_push(&x->a, seen, k) || jlist_push(&x->a, l, items->items[i]))) return jx_oom(x, at);
    }
    *out = list_v(l);
    return 0;
  }
  case F_INDENT: {
    if (jb_bind(x, at, fname, a, P("width", "first", "blank"), p)) return -1;
    if (v.kind == JV_UNDEF) return jx_undefined(x, at, v);
    if (v.kind != JV_STR) /* Jinja2's indent does s += "\n" */
      return jx_fail(x, at, "unsupported operand type(s) for +=: '%s' and 'str'", jv_type_name(v));
    s = v.u.s;
    const jstr *ind;
    if (jb_given(p[0]) && p[0].kind == JV_STR) {
      ind = p[0].u.s;
    } else {
      int64_t w = 4;
      if (jb_given(p[0]) && jb_int_arg(x, at, fname, p[0], &w)) return -1;
      if (w > 1024) return jx_fail(x, at, "indent(): a width of %lld, expected at most 1024", (long long)w);
      char sp[1025];
      memset(sp, ' ', w > 0 ? (size_t)w : 0);
      jv iv;
      if (jx_str(x, at, sp, w > 0 ? (size_t)w : 0, &iv)) return -1;
      ind = iv.u.s;
    }
    return do_indent(x, at, s, ind, jb_given(p[1]) && jv_truthy(p[1]), jb_given(p[2]) && jv_truthy(p[2]), out);
  }
  default: return jx_fail(x, at, "filter '%s' is not supported", fname);
  }
}

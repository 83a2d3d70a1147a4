#define _POSIX_C_SOURCE 200809L /* localtime_r */
/* Tests, globals, argument binding and the callables' dispatch
 * (builtins.h, bi.h). Tests follow jinja2/tests.py. */
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "template/bi.h"
#include "template/text.h"

static const char JB_MISSING_MARK[] = "(missing)";

jv jb_missing(void) { return jv_undef(JB_MISSING_MARK); }
bool jb_given(jv v) { return !(v.kind == JV_UNDEF && v.aux == JB_MISSING_MARK); }

int jb_bind(jx *x, const jexpr *at, const char *fname, const jargs *args, const char *const *names, size_t n,
            jv *out) {
  if (args->npos > n)
    return jx_fail(x, at, "%s() takes at most %zu argument(s), %zu given", fname, n, args->npos);
  for (size_t i = 0; i < n; i++) out[i] = i < args->npos ? args->pos[i] : jb_missing();
  for (size_t k = 0; k < args->nkw; k++) {
    size_t i = 0;
    while (i < n && strcmp(names[i], args->kwn[k])) i++;
    if (i == n) return jx_fail(x, at, "%s() got an unexpected keyword argument '%s'", fname, args->kwn[k]);
    if (jb_given(out[i])) return jx_fail(x, at, "%s() got multiple values for argument '%s'", fname, args->kwn[k]);
    out[i] = args->kwv[k];
  }
  return 0;
}

int jb_buf_fail(jx *x, const jexpr *at, const jbuf *b) {
  if (b->over) return jx_fail(x, at, "a string longer than %zu MiB", JINJA_MAX_OUTPUT >> 20);
  return jx_fail(x, at, "out of memory building a string");
}

int jb_case_fail(jx *x, const jexpr *at, jbuf *b, int rc, int32_t bad) {
  int r = rc == -2 ? jx_fail(x, at, "changing the case of U+%04X needs Unicode's special casing, which is not supported", bad)
                   : jb_buf_fail(x, at, b);
  jbuf_free(b);
  return r;
}

int jb_take(jx *x, const jexpr *at, jbuf *b, jv *out) {
  int rc = jx_str(x, at, b->p ? b->p : "", b->len, out);
  jbuf_free(b);
  return rc;
}

int jb_int_arg(jx *x, const jexpr *at, const char *fname, jv v, int64_t *out) {
  if (v.kind == JV_INT) *out = v.u.i;
  else if (v.kind == JV_BOOL) *out = v.u.b;
  else if (v.kind == JV_UNDEF) return jx_undefined(x, at, v);
  else return jx_fail(x, at, "%s(): expected an integer, found %s", fname, jv_type_name(v));
  return 0;
}

int jb_str_arg(jx *x, const jexpr *at, const char *fname, jv v, const jstr **out) {
  if (v.kind == JV_UNDEF) return jx_undefined(x, at, v);
  if (v.kind != JV_STR) return jx_fail(x, at, "%s(): expected a string, found %s", fname, jv_type_name(v));
  *out = v.u.s;
  return 0;
}

int jb_attr_path(jx *x, const jexpr *at, jv v, const jstr *path, jv *out) {
  size_t i = 0;
  do {
    size_t j = i;
    while (j < path->len && path->s[j] != '.') j++;
    jv key;
    int64_t num = 0;
    bool digits = j > i;
    for (size_t k = i; k < j && digits; k++) {
      digits = path->s[k] >= '0' && path->s[k] <= '9';
      num = num * 10 + (path->s[k] - '0');
      if (num > 1000000000) digits = false;
    }
    if (digits) key = jv_int(num);
    else if (jx_str(x, at, path->s + i, j - i, &key)) return -1;
    /* environment.getitem: the item, else the attribute */
    jv *f;
    if (v.kind == JV_UNDEF) return jx_undefined(x, at, v);
    if (v.kind == JV_DICT && (f = jdict_get(v.u.d, key))) v = *f;
    else if (v.kind == JV_LIST && key.kind == JV_INT && jlist_indexable(v.u.l) && (size_t)key.u.i < v.u.l->n)
      v = v.u.l->items[key.u.i];
    else if (key.kind == JV_STR) {
      if (jx_getattr(x, at, v, key.u.s->s, key.u.s->len, &v)) return -1;
    } else
      v = jv_undef_msg("no such item");
    i = j + 1;
  } while (i <= path->len);
  *out = v;
  return 0;
}

/* ---- tests ---- */

enum {
  T_BOOLEAN, T_CALLABLE, T_DEFINED, T_DIVISIBLEBY, T_EQ, T_EVEN, T_FALSE, T_FILTER, T_FLOAT,
  T_GE, T_GT, T_IN, T_INTEGER, T_ITERABLE, T_LE, T_LOWER, T_LT, T_MAPPING, T_NE, T_NONE,
  T_NUMBER, T_ODD, T_SAMEAS, T_SEQUENCE, T_STRING, T_TEST, T_TRUE, T_UNDEFINED, T_UPPER,
};

static const struct {
  const char *name;
  int id;
} TESTS[] = {
    {"boolean", T_BOOLEAN}, {"callable", T_CALLABLE}, {"defined", T_DEFINED},
    {"divisibleby", T_DIVISIBLEBY}, {"eq", T_EQ}, {"equalto", T_EQ}, {"==", T_EQ},
    {"even", T_EVEN}, {"false", T_FALSE}, {"filter", T_FILTER}, {"float", T_FLOAT},
    {"ge", T_GE}, {">=", T_GE}, {"gt", T_GT}, {"greaterthan", T_GT}, {">", T_GT},
    {"in", T_IN}, {"integer", T_INTEGER}, {"iterable", T_ITERABLE}, {"le", T_LE},
    {"<=", T_LE}, {"lower", T_LOWER}, {"lt", T_LT}, {"lessthan", T_LT}, {"<", T_LT},
    {"mapping", T_MAPPING}, {"ne", T_NE}, {"!=", T_NE}, {"none", T_NONE},
    {"number", T_NUMBER}, {"odd", T_ODD}, {"sameas", T_SAMEAS}, {"sequence", T_SEQUENCE},
    {"string", T_STRING}, {"test", T_TEST}, {"true", T_TRUE}, {"undefined", T_UNDEFINED},
    {"upper", T_UPPER},
};

int jb_test_id(const char *name) {
  for (size_t i = 0; i < sizeof TESTS / sizeof *TESTS; i++)
    if (!strcmp(TESTS[i].name, name)) return TESTS[i].id;
  return !strcmp(name, "escaped") ? JB_UNSUPPORTED : -1;
}

const char *jb_test_names(void) {
  return "boolean, callable, defined, divisibleby, eq/equalto/==, even, false, filter, float, ge/>=, "
         "gt/greaterthan/>, in, integer, iterable, le/<=, lower, lt/lessthan/<, mapping, ne/!=, none, "
         "number, odd, sameas, sequence, string, test, true, undefined, upper";
}

/* Python's x % 2 for the odd/even/divisibleby tests. */
static int modulo(jx *x, const jexpr *at, jv v, jv d, jv *out) {
  if (v.kind == JV_UNDEF) return jx_undefined(x, at, v);
  if (!jv_is_num(v) || !jv_is_num(d))
    return jx_fail(x, at, "unsupported operand type(s) for %%: '%s' and '%s'", jv_type_name(v), jv_type_name(d));
  if (v.kind != JV_FLOAT && d.kind != JV_FLOAT) {
    int64_t a = v.kind == JV_BOOL ? v.u.b : v.u.i, b = d.kind == JV_BOOL ? d.u.b : d.u.i;
    if (b == 0) return jx_fail(x, at, "integer modulo by zero");
    int64_t m = b == -1 ? 0 : a % b;
    if (m != 0 && ((m < 0) != (b < 0))) m += b;
    *out = jv_int(m);
    return 0;
  }
  double a = jv_num(v), b = jv_num(d);
  if (b == 0) return jx_fail(x, at, "float modulo");
  double m = fmod(a, b);
  if (m != 0 && ((m < 0) != (b < 0))) m += b;
  *out = jv_float(m);
  return 0;
}

/* Whether every cased character of s is upper (or lower) and there is one. */
static bool cased_all(const jstr *s, bool upper) {
  bool any = false;
  for (size_t i = 0; i < s->len;) {
    size_t n;
    int32_t c = txt_cp(s->s, s->len, i, &n);
    if (upper ? txt_lower(c) : txt_upper(c)) return false;
    any = any || (upper ? txt_upper(c) : txt_lower(c));
    i += n;
  }
  return any;
}

int jb_test_pos(jx *x, const jexpr *at, int id, jv v, const jv *args, size_t n, bool *out) {
  bool needs_arg = id == T_DIVISIBLEBY || id == T_EQ || id == T_NE || id == T_LT || id == T_LE || id == T_GT ||
                   id == T_GE || id == T_IN || id == T_SAMEAS;
  if (n > (needs_arg ? 1u : 0u)) return jx_fail(x, at, "the test takes %d argument(s), %zu given", needs_arg, n);
  if (needs_arg && n < 1) return jx_fail(x, at, "the test needs an argument");
  jv m;
  switch (id) {
  case T_BOOLEAN: *out = v.kind == JV_BOOL; return 0;
  case T_CALLABLE: *out = v.kind == JV_MACRO || v.kind == JV_FUNC; return 0;
  case T_DEFINED: *out = v.kind != JV_UNDEF; return 0;
  case T_UNDEFINED: *out = v.kind == JV_UNDEF; return 0;
  case T_DIVISIBLEBY:
    if (modulo(x, at, v, args[0], &m)) return -1;
    *out = jv_eq(m, jv_int(0));
    return 0;
  case T_EVEN:
  case T_ODD:
    if (modulo(x, at, v, jv_int(2), &m)) return -1;
    *out = jv_eq(m, jv_int(id == T_ODD));
    return 0;
  case T_FALSE: *out = v.kind == JV_BOOL && !v.u.b; return 0;
  case T_TRUE: *out = v.kind == JV_BOOL && v.u.b; return 0;
  case T_FILTER:
  case T_TEST:
    *out = v.kind == JV_STR && (id == T_FILTER ? jb_filter_id(v.u.s->s) : jb_test_id(v.u.s->s)) >= 0;
    return 0;
  case T_FLOAT: *out = v.kind == JV_FLOAT; return 0;
  case T_INTEGER: *out = v.kind == JV_INT; return 0;
  case T_NUMBER: *out = jv_is_num(v); return 0;
  case T_ITERABLE:
    *out = v.kind == JV_UNDEF || v.kind == JV_STR || v.kind == JV_LIST || v.kind == JV_DICT;
    return 0;
  case T_SEQUENCE:
    *out = v.kind == JV_UNDEF || v.kind == JV_STR || v.kind == JV_DICT ||
           (v.kind == JV_LIST && jlist_indexable(v.u.l));
    return 0;
  case T_MAPPING: *out = v.kind == JV_DICT; return 0;
  case T_NONE: *out = v.kind == JV_NONE; return 0;
  case T_STRING: *out = v.kind == JV_STR; return 0;
  case T_LOWER:
  case T_UPPER: {
    jv s;
    if (jx_tostr(x, at, v, &s)) return -1;
    *out = cased_all(s.u.s, id == T_UPPER);
    return 0;
  }
  case T_SAMEAS: {
    jv o = args[0];
    bool scalar = v.kind == JV_NONE || v.kind == JV_BOOL || v.kind == JV_UNDEF;
    *out = v.kind == o.kind && (scalar ? jv_eq(v, o) : v.kind == JV_LIST ? v.u.l == o.u.l
                                                     : v.kind == JV_DICT || v.kind == JV_NS ? v.u.d == o.u.d
                                                     : v.kind == JV_STR ? v.u.s == o.u.s
                                                                        : jv_eq(v, o));
    return 0;
  }
  case T_IN: {
    jv c = args[0];
    if (c.kind == JV_STR) {
      if (v.kind != JV_STR)
        return jx_fail(x, at, "'in <string>' requires string as left operand, not %s", jv_type_name(v));
      *out = v.u.s->len == 0 || txt_find(c.u.s->s, c.u.s->len, v.u.s->s, v.u.s->len);
      return 0;
    }
    if (c.kind == JV_DICT) {
      *out = jdict_get(c.u.d, v) != NULL;
      return 0;
    }
    jlist *l;
    if (jx_iter(x, at, c, &l)) return -1;
    *out = false;
    for (size_t i = 0; i < l->n && !*out; i++)
      if (jv_equal(v, l->items[i], out)) return jx_fail(x, at, "values nested deeper than %d", JV_DEPTH);
    return 0;
  }
  default: { /* comparisons */
    bool lt, eq;
    if (jv_equal(v, args[0], &eq)) return jx_fail(x, at, "values nested deeper than %d", JV_DEPTH);
    if (id == T_EQ || id == T_NE) {
      *out = id == T_EQ ? eq : !eq;
      return 0;
    }
    if (id == T_LT || id == T_GE) {
      if (jx_less(x, at, v, args[0], &lt)) return -1;
      *out = id == T_LT ? lt : !lt;
    } else {
      if (jx_less(x, at, args[0], v, &lt)) return -1;
      *out = id == T_GT ? lt : !lt;
    }
    return 0;
  }
  }
}

int jb_test(jx *x, const jexpr *at, int id, jv v, const jargs *args, bool *out) {
  if (args->nkw) return jx_fail(x, at, "test '%s' takes no keyword arguments", at->name);
  return jb_test_pos(x, at, id, v, args->pos, args->npos, out);
}

/* ---- globals ---- */

static const char *const GLOBALS[] = {[G_RANGE] = "range", [G_DICT] = "dict", [G_NAMESPACE] = "namespace",
                                      [G_RAISE] = "raise_exception", [G_STRFTIME] = "strftime_now",
                                      [G_CYCLER] = "cycler", [G_JOINER] = "joiner", [G_LIPSUM] = "lipsum"};

bool jb_global(const char *name, jv *out) {
  /* constants: the callables are never written, so renders may share them */
  static const jfunc fns[] = {{.id = G_RANGE},    {.id = G_DICT},     {.id = G_NAMESPACE}, {.id = G_RAISE},
                              {.id = G_STRFTIME}, {.id = G_CYCLER},   {.id = G_JOINER},    {.id = G_LIPSUM}};
  for (size_t i = 0; i < sizeof GLOBALS / sizeof *GLOBALS; i++)
    if (!strcmp(GLOBALS[i], name)) {
      *out = (jv){.kind = JV_FUNC, .u.fn = (jfunc *)&fns[i]};
      return true;
    }
  return false;
}

static int do_range(jx *x, const jexpr *at, const jargs *a, jv *out) {
  int64_t v[3] = {0, 0, 1};
  if (a->nkw) return jx_fail(x, at, "range() takes no keyword arguments");
  if (a->npos < 1 || a->npos > 3) return jx_fail(x, at, "range() expected 1 to 3 arguments, got %zu", a->npos);
  for (size_t i = 0; i < a->npos; i++)
    if (jb_int_arg(x, at, "range", a->pos[i], &v[a->npos == 1 ? 1 : i])) return -1;
  if (v[2] == 0) return jx_fail(x, at, "range() arg 3 must not be zero");
  /* the count, as Python's len(range(...)), without overflow */
  __int128 span = v[2] > 0 ? (__int128)v[1] - v[0] : (__int128)v[0] - v[1];
  __int128 step = v[2] > 0 ? v[2] : -(__int128)v[2];
  __int128 n = span <= 0 ? 0 : (span + step - 1) / step;
  if (n > JINJA_MAX_RANGE)
    return jx_fail(x, at, "Range too big. The sandbox blocks ranges larger than MAX_RANGE (%d).", JINJA_MAX_RANGE);
  jlist *l = jlist_new(&x->a, (size_t)n);
  if (!l) return jx_oom(x, at);
  for (int64_t i = 0; i < (int64_t)n; i++) l->items[i] = jv_int(v[0] + i * v[2]);
  l->n = (size_t)n;
  l->view = JL_RANGE;
  *out = (jv){.kind = JV_LIST, .u.l = l};
  return 0;
}

/* dict(...) and namespace(...): from one mapping or list of pairs, then
 * keywords. */
static int do_dict(jx *x, const jexpr *at, const char *fname, const jargs *a, jv *out) {
  if (a->npos > 1) return jx_fail(x, at, "%s() expected at most 1 positional argument, got %zu", fname, a->npos);
  jdict *d = jdict_new(&x->a, 0);
  if (!d) return jx_oom(x, at);
  if (a->npos) {
    jv src = a->pos[0];
    if (src.kind == JV_DICT || src.kind == JV_NS) {
      for (size_t i = 0; i < src.u.d->n; i++)
        if (jdict_set(&x->a, d, src.u.d->keys[i], src.u.d->vals[i])) return jx_oom(x, at);
    } else {
      jlist *l;
      if (jx_iter(x, at, src, &l)) return -1;
      for (size_t i = 0; i < l->n; i++) {
        jlist *pair;
        if (jx_iter(x, at, l->items[i], &pair)) return -1;
        if (pair->n != 2)
          return jx_fail(x, at, "%s(): sequence element #%zu has length %zu; 2 is required", fname, i, pair->n);
        if (jdict_set(&x->a, d, pair->items[0], pair->items[1])) return jx_oom(x, at);
      }
    }
  }
  for (size_t k = 0; k < a->nkw; k++) {
    jv key;
    if (jx_str(x, at, a->kwn[k], strlen(a->kwn[k]), &key) || jdict_set(&x->a, d, key, a->kwv[k]))
      return jx_oom(x, at);
  }
  *out = (jv){.kind = JV_DICT, .u.d = d};
  return 0;
}

int jb_call(jx *x, const jexpr *at, const jfunc *f, const jargs *args, jv *out) {
  if (f->id >= M_FIRST) return jb_call_method(x, at, f, args, out);
  switch (f->id) {
  case G_RANGE: return do_range(x, at, args, out);
  case G_DICT: return do_dict(x, at, "dict", args, out);
  case G_NAMESPACE:
    if (do_dict(x, at, "namespace", args, out)) return -1;
    for (size_t i = 0; i < out->u.d->n; i++) {
      jv k = out->u.d->keys[i];
      if (k.kind != JV_STR) return jx_fail(x, at, "namespace(): keywords must be strings");
      if (k.u.s->len && k.u.s->s[0] == '_') /* transformers' TemplateNamespace */
        return jx_fail(x, at, "Chat templates cannot store underscore-prefixed attributes on a namespace, but got '%s'",
                       k.u.s->s);
    }
    out->kind = JV_NS;
    return 0;
  case G_RAISE: {
    jv m = args->npos ? args->pos[0] : jv_undef(NULL);
    if (args->npos != 1 || args->nkw) return jx_fail(x, at, "raise_exception() takes exactly one argument");
    if (jx_tostr(x, at, m, &m)) return -1;
    return jx_fail(x, at, "the template raised an error: %s", m.u.s->s);
  }
  case G_STRFTIME: {
    const jstr *fmt = NULL;
    if (args->npos != 1 || args->nkw) return jx_fail(x, at, "strftime_now() takes exactly one argument");
    if (jb_str_arg(x, at, "strftime_now", args->pos[0], &fmt)) return -1;
    time_t now = time(NULL);
    struct tm tm;
    localtime_r(&now, &tm);
    char buf[1024];
    size_t n = fmt->len ? strftime(buf, sizeof buf, fmt->s, &tm) : 0;
    if (fmt->len && !n) return jx_fail(x, at, "strftime_now(): the formatted date is empty or longer than 1 KiB");
    return jx_str(x, at, buf, n, out);
  }
  default: return jx_fail(x, at, "%s() is not supported", GLOBALS[f->id]);
  }
}

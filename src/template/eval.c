/* The evaluator: statements and expressions over values, with Jinja2's
 * scoping (a loop iteration and a macro call are scopes, an if is not; a
 * {% set %} inside a loop does not outlive its iteration: namespace() is
 * how a template carries state out) and Python's operator semantics. */
#include "template/eval.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "common/status.h"
#include "template/builtins.h"
#include "template/text.h"

int jx_fail(jx *x, const jexpr *at, const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (at) return ml_err("%s:%d:%d: %s", x->origin, at->line, at->col, msg);
  return ml_err("%s: %s", x->origin, msg);
}

int jx_oom(jx *x, const jexpr *at) {
  return jx_fail(x, at, "the render needs more than %zu MiB for its values", JINJA_MAX_MEMORY >> 20);
}

int jx_str(jx *x, const jexpr *at, const char *p, size_t n, jv *out) {
  jstr *s = jstr_new(&x->a, p, n);
  if (!s) return jx_oom(x, at);
  *out = jv_strv(s);
  return 0;
}

/* A pyfmt failure as a message: its reason, or the buffer's. */
static int fmt_fail(jx *x, const jexpr *at, const jbuf *b, const char *why) {
  if (why) return jx_fail(x, at, "%s", why);
  if (b->over) return jx_fail(x, at, "the rendered text would pass %zu MiB", JINJA_MAX_OUTPUT >> 20);
  return jx_fail(x, at, "out of memory rendering a value");
}

int jx_tostr(jx *x, const jexpr *at, jv v, jv *out) {
  if (v.kind == JV_STR) {
    *out = v;
    return 0;
  }
  jbuf b = {.limit = JINJA_MAX_OUTPUT};
  const char *why;
  int rc = py_str(&b, v, &why) ? fmt_fail(x, at, &b, why) : jx_str(x, at, b.p ? b.p : "", b.len, out);
  jbuf_free(&b);
  return rc;
}

int jx_undefined(jx *x, const jexpr *at, jv v) {
  if (v.aux && v.u.i == 1) return jx_fail(x, at, "%s", (const char *)v.aux);
  if (v.aux) return jx_fail(x, at, "'%s' is undefined", (const char *)v.aux);
  return jx_fail(x, at, "a value is undefined");
}

int jx_iter(jx *x, const jexpr *at, jv v, jlist **out) {
  switch (v.kind) {
  case JV_UNDEF:
    if (!(*out = jlist_new(&x->a, 0))) return jx_oom(x, at);
    return 0;
  case JV_LIST: *out = v.u.l; return 0;
  case JV_DICT: {
    jlist *l = jlist_new(&x->a, v.u.d->n);
    if (!l) return jx_oom(x, at);
    jv_copy(l->items, v.u.d->keys, v.u.d->n);
    l->n = v.u.d->n;
    *out = l;
    return 0;
  }
  case JV_STR: { /* its characters: code points */
    const jstr *s = v.u.s;
    jlist *l = jlist_new(&x->a, s->len);
    if (!l) return jx_oom(x, at);
    for (size_t i = 0; i < s->len;) {
      size_t n = 1;
      while (i + n < s->len && ((unsigned char)s->s[i + n] & 0xC0) == 0x80) n++;
      if (jx_str(x, at, s->s + i, n, &l->items[l->n++])) return -1;
      i += n;
    }
    *out = l;
    return 0;
  }
  default: return jx_fail(x, at, "'%s' object is not iterable", jv_type_name(v));
  }
}

/* ---- scopes ---- */

static jframe *frame_new(jx *x, const jexpr *at, jframe *parent) {
  jframe *f = ja_alloc(&x->a, sizeof *f);
  if (!f) {
    jx_oom(x, at);
    return NULL;
  }
  f->parent = parent;
  return f;
}

static jv *frame_get(const jframe *f, const char *name) {
  for (size_t i = f->n; i-- > 0;)
    if (!strcmp(f->names[i], name)) return &f->vals[i];
  return NULL;
}

static int frame_set(jx *x, const jexpr *at, jframe *f, const char *name, jv v) {
  jv *old = frame_get(f, name);
  if (old) {
    *old = v;
    return 0;
  }
  if (f->n == f->cap) {
    size_t nc = f->cap ? f->cap * 2 : 8;
    const char **names = ja_alloc(&x->a, nc * sizeof *names);
    jv *vals = ja_alloc(&x->a, nc * sizeof *vals);
    if (!names || !vals) return jx_oom(x, at);
    if (f->n) {
      memcpy(names, f->names, f->n * sizeof *names);
      memcpy(vals, f->vals, f->n * sizeof *vals);
    }
    f->names = names;
    f->vals = vals;
    f->cap = nc;
  }
  f->names[f->n] = name;
  f->vals[f->n++] = v;
  return 0;
}

static jv lookup(jx *x, const jframe *f, const char *name) {
  for (; f; f = f->parent) {
    jv *v = frame_get(f, name);
    if (v) return *v;
  }
  jv *v = jdict_get_str(x->ctx, name, strlen(name));
  if (v) return *v;
  jv g;
  if (jb_global(name, &g)) return g;
  return jv_undef(name);
}

/* ---- attributes, items and slices ---- */

static int loop_attr(jx *x, const jexpr *at, jv v, const char *name, jv *out) {
  const jloop *l = v.u.loop;
  size_t n = l->items->n, i = l->index0;
  if (!strcmp(name, "index")) *out = jv_int((int64_t)i + 1);
  else if (!strcmp(name, "index0")) *out = jv_int((int64_t)i);
  else if (!strcmp(name, "revindex")) *out = jv_int((int64_t)(n - i));
  else if (!strcmp(name, "revindex0")) *out = jv_int((int64_t)(n - i - 1));
  else if (!strcmp(name, "first")) *out = jv_bool(i == 0);
  else if (!strcmp(name, "last")) *out = jv_bool(i + 1 == n);
  else if (!strcmp(name, "length")) *out = jv_int((int64_t)n);
  else if (!strcmp(name, "depth")) *out = jv_int(1);
  else if (!strcmp(name, "depth0")) *out = jv_int(0);
  else if (!strcmp(name, "previtem")) *out = i ? l->items->items[i - 1] : jv_undef_msg("there is no previous item");
  else if (!strcmp(name, "nextitem")) *out = i + 1 < n ? l->items->items[i + 1] : jv_undef_msg("there is no next item");
  else if (!strcmp(name, "cycle")) {
    if (jb_method(x, at, v, name, strlen(name), out) < 0) return -1;
  } else if (!strcmp(name, "changed")) {
    return jx_fail(x, at, "loop.changed is not supported");
  } else {
    *out = jv_undef(name);
  }
  return 0;
}

int jx_getattr(jx *x, const jexpr *at, jv v, const char *name, size_t len, jv *out) {
  if (v.kind == JV_UNDEF) return jx_undefined(x, at, v);
  /* the sandbox hides attributes named _...; a dict's keys are items, not
   * attributes, and stay visible */
  bool hidden = len && name[0] == '_';
  if (v.kind == JV_LOOP && !hidden) return loop_attr(x, at, v, name, out);
  if (v.kind != JV_NS && !hidden) {
    int m = jb_method(x, at, v, name, len, out);
    if (m) return m < 0 ? -1 : 0;
  }
  if (v.kind == JV_DICT || (v.kind == JV_NS && !hidden)) {
    jv *f = jdict_get_str(v.u.d, name, len);
    if (f) {
      *out = *f;
      return 0;
    }
  }
  *out = jv_undef(name);
  return 0;
}

/* Characters (code points) of s: their byte offsets, count in *n (the
 * offsets array has *n + 1 entries, the last being len). */
static int char_offsets(jx *x, const jexpr *at, const jstr *s, size_t **offs, size_t *n) {
  size_t *o = ja_alloc(&x->a, (s->len + 1) * sizeof *o);
  if (!o) return jx_oom(x, at);
  size_t k = 0;
  for (size_t i = 0; i < s->len; i++)
    if (((unsigned char)s->s[i] & 0xC0) != 0x80) o[k++] = i;
  o[k] = s->len;
  *offs = o;
  *n = k;
  return 0;
}

static bool as_index(jv k, int64_t *i) {
  if (k.kind == JV_INT) *i = k.u.i;
  else if (k.kind == JV_BOOL) *i = k.u.b;
  else return false;
  return true;
}

static int getitem(jx *x, const jexpr *at, jv v, jv k, jv *out) {
  if (v.kind == JV_UNDEF) return jx_undefined(x, at, v);
  int64_t i;
  if (v.kind == JV_DICT) {
    jv *f = jdict_get(v.u.d, k);
    if (f) {
      *out = *f;
      return 0;
    }
  } else if (v.kind == JV_LIST && jlist_indexable(v.u.l) && as_index(k, &i)) {
    int64_t n = (int64_t)v.u.l->n;
    if (i < 0) i += n;
    *out = i >= 0 && i < n ? v.u.l->items[i] : jv_undef_msg("list index out of range");
    return 0;
  } else if (v.kind == JV_STR && as_index(k, &i)) {
    size_t *o = NULL, n = 0;
    if (char_offsets(x, at, v.u.s, &o, &n)) return -1;
    if (i < 0) i += (int64_t)n;
    if (i < 0 || i >= (int64_t)n) {
      *out = jv_undef_msg("string index out of range");
      return 0;
    }
    return jx_str(x, at, v.u.s->s + o[i], o[i + 1] - o[i], out);
  }
  /* Jinja2 then tries the attribute of that name */
  if (k.kind == JV_STR) return jx_getattr(x, at, v, k.u.s->s, k.u.s->len, out);
  *out = jv_undef_msg("no such item");
  return 0;
}

/* Python's slice.indices(n) and the picked positions. */
static int slice_bounds(jx *x, const jexpr *at, jv *parts, int64_t n, int64_t *start, int64_t *stop,
                        int64_t *step) {
  int64_t v[3];
  bool given[3];
  for (int k = 0; k < 3; k++) {
    given[k] = parts[k].kind != JV_NONE && parts[k].kind != JV_UNDEF;
    if (given[k] && !as_index(parts[k], &v[k]))
      return jx_fail(x, at, "slice indices must be integers or None, not %s", jv_type_name(parts[k]));
  }
  *step = given[2] ? v[2] : 1;
  if (*step == 0) return jx_fail(x, at, "slice step cannot be zero");
  int64_t lo = *step < 0 ? -1 : 0, hi = *step < 0 ? n - 1 : n;
  for (int k = 0; k < 2; k++) {
    int64_t *dst = k == 0 ? start : stop;
    if (!given[k]) {
      *dst = (k == 0) == (*step > 0) ? lo : hi;
      continue;
    }
    int64_t w = v[k];
    if (w < 0) {
      w += n;
      if (w < lo) w = lo;
    } else if (w > hi) {
      w = hi;
    }
    *dst = w;
  }
  return 0;
}

static int do_slice(jx *x, const jexpr *at, jv v, jv *parts, jv *out) {
  if (v.kind == JV_UNDEF) return jx_undefined(x, at, v);
  int64_t start = 0, stop = 0, step = 1, n;
  size_t *o = NULL;
  size_t nc = 0;
  if (v.kind == JV_STR) {
    if (char_offsets(x, at, v.u.s, &o, &nc)) return -1;
    n = (int64_t)nc;
  } else if (v.kind == JV_LIST && jlist_indexable(v.u.l)) {
    n = (int64_t)v.u.l->n;
  } else {
    *out = jv_undef_msg("not sliceable");
    return 0;
  }
  if (slice_bounds(x, at, parts, n, &start, &stop, &step)) return -1;
  if (v.kind == JV_STR) {
    if (step == 1) return jx_str(x, at, v.u.s->s + o[start], start < stop ? o[stop] - o[start] : 0, out);
    jbuf b = {.limit = JINJA_MAX_OUTPUT};
    int rc = 0;
    for (int64_t i = start; !rc && (step > 0 ? i < stop : i > stop); i += step)
      rc = jbuf_put(&b, v.u.s->s + o[i], o[i + 1] - o[i]);
    rc = rc ? jx_oom(x, at) : jx_str(x, at, b.p ? b.p : "", b.len, out);
    jbuf_free(&b);
    return rc;
  }
  jlist *l = jlist_new(&x->a, 0);
  if (!l) return jx_oom(x, at);
  l->view = v.u.l->view;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step)
    if (jlist_push(&x->a, l, v.u.l->items[i])) return jx_oom(x, at);
  *out = (jv){.kind = JV_LIST, .u.l = l};
  return 0;
}

/* ---- operators ---- */

int jx_less(jx *x, const jexpr *at, jv a, jv b, bool *out) {
  if (jv_is_num(a) && jv_is_num(b)) {
    if (a.kind != JV_FLOAT && b.kind != JV_FLOAT) {
      int64_t p = a.kind == JV_BOOL ? a.u.b : a.u.i, q = b.kind == JV_BOOL ? b.u.b : b.u.i;
      *out = p < q;
    } else {
      *out = jv_num(a) < jv_num(b);
    }
    return 0;
  }
  if (a.kind == JV_STR && b.kind == JV_STR) {
    size_t n = a.u.s->len < b.u.s->len ? a.u.s->len : b.u.s->len;
    int c = memcmp(a.u.s->s, b.u.s->s, n);
    *out = c < 0 || (c == 0 && a.u.s->len < b.u.s->len);
    return 0;
  }
  if (a.kind == JV_LIST && b.kind == JV_LIST && a.u.l->view == b.u.l->view && a.u.l->view <= JL_TUPLE) {
    for (size_t i = 0; i < a.u.l->n && i < b.u.l->n; i++) {
      bool eq;
      if (jv_equal(a.u.l->items[i], b.u.l->items[i], &eq))
        return jx_fail(x, at, "values nested deeper than %d", JV_DEPTH);
      if (!eq) return jx_less(x, at, a.u.l->items[i], b.u.l->items[i], out);
    }
    *out = a.u.l->n < b.u.l->n;
    return 0;
  }
  if (a.kind == JV_UNDEF) return jx_undefined(x, at, a);
  if (b.kind == JV_UNDEF) return jx_undefined(x, at, b);
  return jx_fail(x, at, "'<' not supported between instances of '%s' and '%s'", jv_type_name(a),
                 jv_type_name(b));
}

static int compare(jx *x, const jexpr *at, const char *op, jv a, jv b, bool *out) {
  bool r = false;
  if (!strcmp(op, "==") || !strcmp(op, "!=")) {
    if (jv_equal(a, b, &r)) return jx_fail(x, at, "values nested deeper than %d", JV_DEPTH);
    *out = op[0] == '=' ? r : !r;
    return 0;
  }
  if (!strcmp(op, "in") || !strcmp(op, "not in")) {
    bool neg = op[0] == 'n';
    if (b.kind == JV_STR) {
      if (a.kind != JV_STR)
        return jx_fail(x, at, "'in <string>' requires string as left operand, not %s", jv_type_name(a));
      r = a.u.s->len == 0 || txt_find(b.u.s->s, b.u.s->len, a.u.s->s, a.u.s->len) != NULL;
    } else if (b.kind == JV_DICT) {
      if (a.kind == JV_DICT || a.kind == JV_NS || (a.kind == JV_LIST && a.u.l->view != JL_TUPLE))
        return jx_fail(x, at, "unhashable type: '%s'", jv_type_name(a));
      r = jdict_get(b.u.d, a) != NULL;
    } else if (b.kind == JV_LIST || b.kind == JV_UNDEF) {
      r = false;
      if (b.kind == JV_LIST)
        for (size_t i = 0; i < b.u.l->n && !r; i++)
          if (jv_equal(a, b.u.l->items[i], &r)) return jx_fail(x, at, "values nested deeper than %d", JV_DEPTH);
    } else {
      return jx_fail(x, at, "argument of type '%s' is not iterable", jv_type_name(b));
    }
    *out = neg ? !r : r;
    return 0;
  }
  /* < <= > >= through less */
  bool gt = op[0] == '>', eq = op[1] == '=';
  jv l = gt ? b : a, rr = gt ? a : b;
  if (jx_less(x, at, l, rr, &r)) return -1;
  if (!r && eq) {
    bool e;
    if (jv_equal(a, b, &e)) return jx_fail(x, at, "values nested deeper than %d", JV_DEPTH);
    r = e;
    if (!e && !(jv_is_num(a) && jv_is_num(b))) { /* a < b false, not equal: ordered types only */
      bool dummy;
      if (jx_less(x, at, rr, l, &dummy)) return -1;
    }
  }
  *out = r;
  return 0;
}

static const char *opname(int op) {
  switch (op) {
  case '+': return "+";
  case '-': return "-";
  case '*': return "*";
  case '/': return "/";
  case 'f': return "//";
  case '%': return "%";
  case 'p': return "**";
  default: return "~";
  }
}

static int type_error(jx *x, const jexpr *at, int op, jv a, jv b) {
  if (a.kind == JV_UNDEF) return jx_undefined(x, at, a);
  if (b.kind == JV_UNDEF) return jx_undefined(x, at, b);
  if (op == '+' && a.kind == JV_STR)
    return jx_fail(x, at, "can only concatenate str (not \"%s\") to str", jv_type_name(b));
  if (op == '+' && a.kind == JV_LIST && a.u.l->view == JL_LIST)
    return jx_fail(x, at, "can only concatenate list (not \"%s\") to list", jv_type_name(b));
  if (op == '%' && a.kind == JV_STR) return jx_fail(x, at, "string formatting with '%%' is not supported");
  return jx_fail(x, at, "unsupported operand type(s) for %s: '%s' and '%s'", opname(op), jv_type_name(a),
                 jv_type_name(b));
}

static int overflow(jx *x, const jexpr *at) {
  return jx_fail(x, at, "integer overflow: the result does not fit 64 bits");
}

/* a repeated n times (str or list; n <= 0 gives an empty one). */
static int repeat(jx *x, const jexpr *at, jv a, int64_t n, jv *out) {
  if (n < 0) n = 0;
  size_t unit = a.kind == JV_STR ? a.u.s->len : a.u.l->n * sizeof(jv);
  if (a.kind == JV_STR && unit && (uint64_t)n > JINJA_MAX_OUTPUT / unit) /* never renderable */
    return jx_fail(x, at, "a string of more than %zu MiB", JINJA_MAX_OUTPUT >> 20);
  if (unit && (uint64_t)n > JINJA_MAX_MEMORY / unit) return jx_oom(x, at);
  if (a.kind == JV_STR) {
    size_t len = a.u.s->len * (size_t)n;
    jstr *r = ja_alloc(&x->a, sizeof *r + len + 1);
    if (!r) return jx_oom(x, at);
    for (int64_t i = 0; i < n; i++) memcpy(r->s + (size_t)i * a.u.s->len, a.u.s->s, a.u.s->len);
    r->len = len;
    *out = jv_strv(r);
    return 0;
  }
  jlist *l = jlist_new(&x->a, a.u.l->n * (size_t)n);
  if (!l) return jx_oom(x, at);
  for (int64_t i = 0; i < n; i++) jv_copy(l->items + (size_t)i * a.u.l->n, a.u.l->items, a.u.l->n);
  l->n = a.u.l->n * (size_t)n;
  l->view = a.u.l->view;
  *out = (jv){.kind = JV_LIST, .u.l = l};
  return 0;
}

int jx_arith(jx *x, const jexpr *at, int op, jv a, jv b, jv *out) {
  if (op != '~' && (jv_is_markup(a) || jv_is_markup(b)))
    return jx_fail(x, at, "'%s' with a Markup string (from escape or safe) is not supported", opname(op));
  if (op == '~') {
    jv sa, sb;
    if (jx_tostr(x, at, a, &sa) || jx_tostr(x, at, b, &sb)) return -1;
    size_t n = sa.u.s->len + sb.u.s->len;
    if (n > JINJA_MAX_OUTPUT) return jx_fail(x, at, "a string of more than %zu MiB", JINJA_MAX_OUTPUT >> 20);
    jstr *r = ja_alloc(&x->a, sizeof *r + n + 1);
    if (!r) return jx_oom(x, at);
    memcpy(r->s, sa.u.s->s, sa.u.s->len);
    memcpy(r->s + sa.u.s->len, sb.u.s->s, sb.u.s->len);
    r->len = n;
    *out = jv_strv(r);
    return 0;
  }
  if (jv_is_num(a) && jv_is_num(b)) {
    bool ints = a.kind != JV_FLOAT && b.kind != JV_FLOAT;
    int64_t p = a.kind == JV_BOOL ? a.u.b : a.u.i, q = b.kind == JV_BOOL ? b.u.b : b.u.i, r;
    double f = jv_num(a), g = jv_num(b);
    switch (op) {
    case '+':
      if (!ints) break;
      if (__builtin_add_overflow(p, q, &r)) return overflow(x, at);
      *out = jv_int(r);
      return 0;
    case '-':
      if (!ints) break;
      if (__builtin_sub_overflow(p, q, &r)) return overflow(x, at);
      *out = jv_int(r);
      return 0;
    case '*':
      if (!ints) break;
      if (__builtin_mul_overflow(p, q, &r)) return overflow(x, at);
      *out = jv_int(r);
      return 0;
    case '/':
      if (g == 0) return jx_fail(x, at, "division by zero");
      *out = jv_float(f / g);
      return 0;
    case 'f':
    case '%':
      if (ints) {
        if (q == 0) return jx_fail(x, at, op == 'f' ? "integer division or modulo by zero" : "integer modulo by zero");
        if (p == INT64_MIN && q == -1) return overflow(x, at);
        int64_t d = p / q, m = p % q;
        if (m != 0 && ((m < 0) != (q < 0))) {
          d--;
          m += q;
        }
        *out = jv_int(op == 'f' ? d : m);
        return 0;
      }
      if (g == 0) return jx_fail(x, at, op == 'f' ? "float floor division by zero" : "float modulo");
      {
        double m = fmod(f, g);
        if (m != 0 && ((m < 0) != (g < 0))) m += g;
        *out = jv_float(op == 'f' ? floor(f / g) : m);
      }
      return 0;
    case 'p':
      if (ints && q >= 0) {
        int64_t acc = 1, base = p;
        for (int64_t e = q; e; e >>= 1) {
          if ((e & 1) && __builtin_mul_overflow(acc, base, &acc)) return overflow(x, at);
          if (e > 1 && __builtin_mul_overflow(base, base, &base)) return overflow(x, at);
        }
        *out = jv_int(acc);
        return 0;
      }
      if (f == 0 && g < 0) return jx_fail(x, at, "0.0 cannot be raised to a negative power");
      *out = jv_float(pow(f, g));
      return 0;
    default: break;
    }
    double v = op == '+' ? f + g : op == '-' ? f - g : f * g;
    *out = jv_float(v);
    return 0;
  }
  if (op == '+' && a.kind == JV_STR && b.kind == JV_STR) return jx_arith(x, at, '~', a, b, out);
  if (op == '+' && a.kind == JV_LIST && b.kind == JV_LIST && a.u.l->view == b.u.l->view &&
      a.u.l->view <= JL_TUPLE) {
    jlist *l = jlist_new(&x->a, a.u.l->n + b.u.l->n);
    if (!l) return jx_oom(x, at);
    jv_copy(l->items, a.u.l->items, a.u.l->n);
    jv_copy(l->items + a.u.l->n, b.u.l->items, b.u.l->n);
    l->n = a.u.l->n + b.u.l->n;
    l->view = a.u.l->view;
    *out = (jv){.kind = JV_LIST, .u.l = l};
    return 0;
  }
  if (op == '*') {
    bool seq_a = a.kind == JV_STR || (a.kind == JV_LIST && a.u.l->view <= JL_TUPLE);
    bool seq_b = b.kind == JV_STR || (b.kind == JV_LIST && b.u.l->view <= JL_TUPLE);
    if (seq_a && (b.kind == JV_INT || b.kind == JV_BOOL)) return repeat(x, at, a, b.kind == JV_INT ? b.u.i : b.u.b, out);
    if (seq_b && (a.kind == JV_INT || a.kind == JV_BOOL)) return repeat(x, at, b, a.kind == JV_INT ? a.u.i : a.u.b, out);
  }
  return type_error(x, at, op, a, b);
}

/* ---- expressions ---- */

static int eval(jx *x, jframe *f, const jexpr *e, jv *out);

static int eval_args(jx *x, jframe *f, const jexpr *e, jargs *args) {
  jv *pos = e->nargs ? ja_alloc(&x->a, e->nargs * sizeof(jv)) : NULL;
  jv *kwv = e->nkw ? ja_alloc(&x->a, e->nkw * sizeof(jv)) : NULL;
  if ((e->nargs && !pos) || (e->nkw && !kwv)) return jx_oom(x, e);
  for (size_t i = 0; i < e->nargs; i++)
    if (eval(x, f, e->args[i], &pos[i])) return -1;
  for (size_t i = 0; i < e->nkw; i++)
    if (eval(x, f, e->kwargs[i], &kwv[i])) return -1;
  *args = (jargs){.pos = pos, .npos = e->nargs, .kwn = e->kwnames, .kwv = kwv, .nkw = e->nkw};
  return 0;
}

static int exec_body(jx *x, jframe *f, const jbody *b);

static int call_macro(jx *x, const jexpr *at, jv m, const jargs *args, jv *out) {
  const jstmt *s = m.u.macro;
  const char *name = s->names[0];
  size_t nparams = s->nnames - 1;
  if (args->npos > nparams)
    return jx_fail(x, at, "macro '%s' takes not more than %zu argument(s)", name, nparams);
  if (x->calls >= JINJA_MAX_CALLS) return jx_fail(x, at, "macro calls nested deeper than %d", JINJA_MAX_CALLS);
  jframe *f = frame_new(x, at, (jframe *)m.aux);
  if (!f) return -1;
  for (size_t k = 0; k < args->nkw; k++) {
    size_t p = 0;
    while (p < nparams && strcmp(s->names[1 + p], args->kwn[k])) p++;
    if (p == nparams) return jx_fail(x, at, "macro '%s' takes no keyword argument '%s'", name, args->kwn[k]);
    if (p < args->npos) return jx_fail(x, at, "macro '%s' got multiple values for argument '%s'", name, args->kwn[k]);
  }
  for (size_t p = 0; p < nparams; p++) {
    const char *pn = s->names[1 + p];
    jv v = jv_undef(pn);
    bool given = p < args->npos;
    if (given) v = args->pos[p];
    for (size_t k = 0; !given && k < args->nkw; k++)
      if (!strcmp(args->kwn[k], pn)) {
        v = args->kwv[k];
        given = true;
      }
    if (!given && s->defaults[1 + p] && eval(x, f, s->defaults[1 + p], &v)) return -1;
    if (frame_set(x, at, f, pn, v)) return -1;
  }
  jbuf cap = {.limit = JINJA_MAX_OUTPUT}, *saved = x->cur;
  x->cur = &cap;
  x->calls++;
  int rc = exec_body(x, f, &s->body);
  x->calls--;
  x->cur = saved;
  if (!rc) rc = jx_str(x, at, cap.p ? cap.p : "", cap.len, out);
  jbuf_free(&cap);
  return rc;
}

int jx_call(jx *x, const jexpr *at, jv fn, const jargs *args, jv *out) {
  switch (fn.kind) {
  case JV_MACRO: return call_macro(x, at, fn, args, out);
  case JV_FUNC: return jb_call(x, at, fn.u.fn, args, out);
  case JV_UNDEF: return jx_undefined(x, at, fn);
  default: return jx_fail(x, at, "'%s' object is not callable", jv_type_name(fn));
  }
}

static int eval_seq(jx *x, jframe *f, const jexpr *e, jv *out) {
  if (e->kind == E_DICT) {
    jdict *d = jdict_new(&x->a, e->nargs / 2);
    if (!d) return jx_oom(x, e);
    for (size_t i = 0; i < e->nargs; i += 2) {
      jv k, v;
      if (eval(x, f, e->args[i], &k) || eval(x, f, e->args[i + 1], &v)) return -1;
      if (k.kind == JV_DICT || (k.kind == JV_LIST && k.u.l->view != JL_TUPLE) || k.kind == JV_UNDEF)
        return jx_fail(x, e->args[i], "unhashable type: '%s'", jv_type_name(k));
      if (jdict_set(&x->a, d, k, v)) return jx_oom(x, e);
    }
    *out = (jv){.kind = JV_DICT, .u.d = d};
    return 0;
  }
  jlist *l = jlist_new(&x->a, e->nargs);
  if (!l) return jx_oom(x, e);
  for (size_t i = 0; i < e->nargs; i++)
    if (eval(x, f, e->args[i], &l->items[i])) return -1;
  l->n = e->nargs;
  l->view = e->kind == E_TUPLE ? JL_TUPLE : JL_LIST;
  *out = (jv){.kind = JV_LIST, .u.l = l};
  return 0;
}

static int eval_node(jx *x, jframe *f, const jexpr *e, jv *out);

/* Every expression and statement goes through here: the recursion bound
 * (a left-deep chain such as a + b + ... parses without nesting). */
static int eval(jx *x, jframe *f, const jexpr *e, jv *out) {
  if (x->depth >= JINJA_MAX_EVAL_DEPTH)
    return jx_fail(x, e, "expressions, blocks and macro calls nested deeper than %d", JINJA_MAX_EVAL_DEPTH);
  x->depth++;
  int rc = eval_node(x, f, e, out);
  x->depth--;
  return rc;
}

static int eval_node(jx *x, jframe *f, const jexpr *e, jv *out) {
  jv a, b;
  switch (e->kind) {
  case E_CONST: *out = e->val; return 0;
  case E_NAME: *out = lookup(x, f, e->name); return 0;
  case E_ATTR:
    if (eval(x, f, e->a, &a)) return -1;
    return jx_getattr(x, e, a, e->name, strlen(e->name), out);
  case E_ITEM:
    if (eval(x, f, e->a, &a) || eval(x, f, e->b, &b)) return -1;
    return getitem(x, e, a, b, out);
  case E_SLICE: {
    jv parts[3] = {jv_none(), jv_none(), jv_none()};
    if (eval(x, f, e->a, &a)) return -1;
    const jexpr *pe[3] = {e->b, e->c, e->d};
    for (int k = 0; k < 3; k++)
      if (pe[k] && eval(x, f, pe[k], &parts[k])) return -1;
    return do_slice(x, e, a, parts, out);
  }
  case E_CALL: {
    jargs args;
    if (eval(x, f, e->a, &a) || eval_args(x, f, e, &args)) return -1;
    return jx_call(x, e, a, &args, out);
  }
  case E_FILTER: {
    jargs args;
    if (eval(x, f, e->a, &a) || eval_args(x, f, e, &args)) return -1;
    return jb_filter(x, e, e->fn, a, &args, out);
  }
  case E_TEST: {
    jargs args;
    bool r;
    if (eval(x, f, e->a, &a) || eval_args(x, f, e, &args) || jb_test(x, e, e->fn, a, &args, &r)) return -1;
    *out = jv_bool(e->negated ? !r : r);
    return 0;
  }
  case E_BIN:
    if (eval(x, f, e->a, &a) || eval(x, f, e->b, &b)) return -1;
    return jx_arith(x, e, e->fn, a, b, out);
  case E_NEG:
  case E_POS:
    if (eval(x, f, e->a, &a)) return -1;
    if (a.kind == JV_UNDEF) return jx_undefined(x, e, a);
    if (!jv_is_num(a))
      return jx_fail(x, e, "bad operand type for unary %c: '%s'", e->kind == E_NEG ? '-' : '+', jv_type_name(a));
    if (a.kind == JV_FLOAT) *out = jv_float(e->kind == E_NEG ? -a.u.f : a.u.f);
    else {
      int64_t i = a.kind == JV_BOOL ? a.u.b : a.u.i;
      if (e->kind == E_NEG && i == INT64_MIN) return overflow(x, e);
      *out = jv_int(e->kind == E_NEG ? -i : i);
    }
    return 0;
  case E_NOT:
    if (eval(x, f, e->a, &a)) return -1;
    *out = jv_bool(!jv_truthy(a));
    return 0;
  case E_AND:
  case E_OR:
    if (eval(x, f, e->a, &a)) return -1;
    if (jv_truthy(a) == (e->kind == E_OR)) {
      *out = a;
      return 0;
    }
    return eval(x, f, e->b, out);
  case E_CMP: {
    if (eval(x, f, e->args[0], &a)) return -1;
    for (size_t i = 1; i < e->nargs; i++) {
      bool r = false;
      if (eval(x, f, e->args[i], &b) || compare(x, e, e->ops[i - 1], a, b, &r)) return -1;
      if (!r) {
        *out = jv_bool(false);
        return 0;
      }
      a = b;
    }
    *out = jv_bool(true);
    return 0;
  }
  case E_COND:
    if (eval(x, f, e->a, &a)) return -1;
    if (jv_truthy(a)) return eval(x, f, e->b, out);
    if (e->c) return eval(x, f, e->c, out);
    *out = jv_undef_msg("the condition was false and there is no else");
    return 0;
  default: return eval_seq(x, f, e, out);
  }
}

/* ---- statements ---- */

static int emit(jx *x, const jexpr *at, const char *s, size_t n) {
  return jbuf_put(x->cur, s, n) ? fmt_fail(x, at, x->cur, NULL) : 0;
}

/* Bind the targets of a for or set to v (unpacking several). */
static int assign(jx *x, const jexpr *at, jframe *f, const jstmt *s, jv v) {
  if (s->nnames == 1) return frame_set(x, at, f, s->names[0], v);
  jlist *items;
  if (jx_iter(x, at, v, &items)) return -1;
  if (items->n != s->nnames)
    return jx_fail(x, at, items->n > s->nnames ? "too many values to unpack (expected %zu)"
                                               : "not enough values to unpack (expected %zu)",
                   s->nnames);
  for (size_t i = 0; i < s->nnames; i++)
    if (frame_set(x, at, f, s->names[i], items->items[i])) return -1;
  return 0;
}

static int exec_for(jx *x, jframe *f, const jstmt *s) {
  jv it;
  jlist *items;
  if (eval(x, f, s->expr, &it) || jx_iter(x, s->expr, it, &items)) return -1;
  jframe *g = frame_new(x, s->expr, f);
  if (!g) return -1;
  if (s->cond) { /* {% for a in b if c %}: c sees a, not loop */
    jlist *kept = jlist_new(&x->a, 0);
    if (!kept) return jx_oom(x, s->expr);
    for (size_t i = 0; i < items->n; i++) {
      jv c;
      g->n = 0;
      if (++x->iters > JINJA_MAX_ITERS)
        return jx_fail(x, s->expr, "more than %llu loop iterations", (unsigned long long)JINJA_MAX_ITERS);
      if (assign(x, s->expr, g, s, items->items[i]) || eval(x, g, s->cond, &c)) return -1;
      if (jv_truthy(c) && jlist_push(&x->a, kept, items->items[i])) return jx_oom(x, s->expr);
    }
    items = kept;
  }
  g->n = 0;
  if (!items->n) return exec_body(x, g, &s->orelse);
  jloop *lp = ja_alloc(&x->a, sizeof *lp);
  if (!lp) return jx_oom(x, s->expr);
  lp->items = items;
  for (size_t i = 0; i < items->n; i++) {
    if (++x->iters > JINJA_MAX_ITERS)
      return jx_fail(x, s->expr, "more than %llu loop iterations", (unsigned long long)JINJA_MAX_ITERS);
    lp->index0 = i;
    g->n = 0;
    if (assign(x, s->expr, g, s, items->items[i]) ||
        frame_set(x, s->expr, g, "loop", (jv){.kind = JV_LOOP, .u.loop = lp}) || exec_body(x, g, &s->body))
      return -1;
    if (x->ctl == 1) {
      x->ctl = 0;
      break;
    }
    x->ctl = 0;
  }
  return 0;
}

static int exec_stmt(jx *x, jframe *f, const jstmt *s) {
  jv v;
  switch (s->kind) {
  case S_TEXT: return emit(x, NULL, s->text, s->len);
  case S_OUT: {
    if (eval(x, f, s->expr, &v)) return -1;
    if (v.kind == JV_STR) return emit(x, s->expr, v.u.s->s, v.u.s->len);
    const char *why;
    size_t before = x->cur->len;
    if (py_str(x->cur, v, &why)) {
      x->cur->len = before;
      return fmt_fail(x, s->expr, x->cur, why);
    }
    return 0;
  }
  case S_IF:
    if (eval(x, f, s->expr, &v)) return -1;
    return exec_body(x, f, jv_truthy(v) ? &s->body : &s->orelse);
  case S_FOR: return exec_for(x, f, s);
  case S_SET:
    if (eval(x, f, s->expr, &v)) return -1;
    if (s->attr) {
      jv ns = lookup(x, f, s->names[0]);
      if (ns.kind != JV_NS)
        return jx_fail(x, s->expr, "cannot assign attribute '%s' of '%s': it is a %s, not a namespace()", s->attr,
                       s->names[0], jv_type_name(ns));
      if (s->attr[0] == '_') /* transformers' TemplateNamespace */
        return jx_fail(x, s->expr, "Chat templates cannot store underscore-prefixed attributes on a namespace, but got '%s'",
                       s->attr);
      jv k;
      if (jx_str(x, s->expr, s->attr, strlen(s->attr), &k)) return -1;
      if (jdict_set(&x->a, ns.u.d, k, v)) return jx_oom(x, s->expr);
      return 0;
    }
    return assign(x, s->expr, f, s, v);
  case S_SETBLOCK: {
    jbuf cap = {.limit = JINJA_MAX_OUTPUT}, *saved = x->cur;
    jframe *g = frame_new(x, NULL, f); /* the block's body is a scope of its own */
    if (!g) return -1;
    x->cur = &cap;
    int rc = exec_body(x, g, &s->body);
    x->cur = saved;
    if (!rc) rc = jx_str(x, NULL, cap.p ? cap.p : "", cap.len, &v) || frame_set(x, NULL, f, s->names[0], v);
    jbuf_free(&cap);
    return rc ? -1 : 0;
  }
  case S_MACRO:
    return frame_set(x, NULL, f, s->names[0], (jv){.kind = JV_MACRO, .u.macro = s, .aux = f});
  case S_BREAK: x->ctl = 1; return 0;
  case S_CONTINUE: x->ctl = 2; return 0;
  case S_GENERATION: { /* a call block: its body is a scope of its own, as a macro's */
    size_t begin = x->out.len;
    jframe *g = frame_new(x, NULL, f);
    if (!g || exec_body(x, g, &s->body)) return -1;
    if (x->ngen == x->capgen) {
      size_t nc = x->capgen ? x->capgen * 2 : 8;
      ml_jinja_span *g = ja_alloc(&x->a, nc * sizeof *g);
      if (!g) return jx_oom(x, NULL);
      if (x->ngen) memcpy(g, x->gen, x->ngen * sizeof *g);
      x->gen = g;
      x->capgen = nc;
    }
    x->gen[x->ngen++] = (ml_jinja_span){begin, x->out.len};
    return 0;
  }
  }
  return 0;
}

static int exec_body(jx *x, jframe *f, const jbody *b) {
  if (x->depth >= JINJA_MAX_EVAL_DEPTH)
    return jx_fail(x, NULL, "expressions, blocks and macro calls nested deeper than %d", JINJA_MAX_EVAL_DEPTH);
  x->depth++;
  int rc = 0;
  for (size_t i = 0; !rc && i < b->n && !x->ctl; i++) rc = exec_stmt(x, f, b->s[i]);
  x->depth--;
  return rc;
}

int jx_render(jx *x, const jbody *body) {
  jframe *top = frame_new(x, NULL, NULL);
  x->cur = &x->out;
  return top ? exec_body(x, top, body) : -1;
}

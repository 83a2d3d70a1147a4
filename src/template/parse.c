/* The parser: tokens into statements and expressions (ast.h), following
 * Jinja2's grammar (parser.py) and its operator precedence, lowest first:
 * `x if c else y`, or, and, not, comparisons (== != < <= > >= in, not in;
 * chained), + -, ~, * / // %, **, unary - +, then filters (|f), tests
 * (is t) and calls, and postfix . [] (). */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "common/status.h"
#include "template/ast.h"
#include "template/builtins.h"

typedef struct ps {
  jarena *a;
  const char *origin;
  const jtok *t;
  size_t n, i;
  int depth;
  int loops;    /* enclosing for loops (of this macro): where break/continue may be */
  int macros;   /* enclosing macros */
  int captures; /* enclosing macros, set blocks and generation blocks: a generation
                   block inside one would measure a text that is not the output */
  bool has_gen;
} ps;

static const jtok *cur(const ps *p) { return &p->t[p->i]; }
static const jtok *peek(const ps *p) { return &p->t[p->i + 1 < p->n ? p->i + 1 : p->i]; }
static bool is_op(const jtok *t, const char *op) { return t->kind == TK_OP && strcmp(t->s, op) == 0; }
static bool is_name(const jtok *t, const char *n) { return t->kind == TK_NAME && strcmp(t->s, n) == 0; }

/* How a token reads in a message. */
static void describe(const jtok *t, char *buf, size_t size) {
  switch (t->kind) {
  case TK_TEXT: snprintf(buf, size, "template text"); break;
  case TK_VAR_BEGIN: snprintf(buf, size, "'{{'"); break;
  case TK_VAR_END: snprintf(buf, size, "'}}'"); break;
  case TK_BLOCK_BEGIN: snprintf(buf, size, "'{%%'"); break;
  case TK_BLOCK_END: snprintf(buf, size, "'%%}'"); break;
  case TK_NAME: snprintf(buf, size, "'%.60s'", t->s); break;
  case TK_STRING: snprintf(buf, size, "a string"); break;
  case TK_INT:
  case TK_FLOAT: snprintf(buf, size, "a number"); break;
  case TK_OP: snprintf(buf, size, "'%s'", t->s); break;
  default: snprintf(buf, size, "the end of the template"); break;
  }
}

static int failat(const ps *p, const jtok *t, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int failat(const ps *p, const jtok *t, const char *fmt, ...) {
  char msg[768];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  return ml_err("%s:%d:%d: %s", p->origin, t->line, t->col, msg);
}

/* "found X, expected WHAT" at the current token. */
static int expected(const ps *p, const char *what) {
  char f[96];
  describe(cur(p), f, sizeof f);
  return failat(p, cur(p), "found %s, expected %s", f, what);
}

static int oom(const ps *p) {
  return failat(p, cur(p), "template too large: out of the parse's memory bound");
}

static int expect_op(ps *p, const char *op) {
  if (!is_op(cur(p), op)) {
    char w[16];
    snprintf(w, sizeof w, "'%s'", op);
    return expected(p, w);
  }
  p->i++;
  return 0;
}

static int expect_end(ps *p) {
  if (cur(p)->kind != TK_BLOCK_END) return expected(p, "'%}'");
  p->i++;
  return 0;
}

static int enter(ps *p) {
  if (++p->depth > JINJA_MAX_DEPTH)
    return failat(p, cur(p), "template nested deeper than %d levels", JINJA_MAX_DEPTH);
  return 0;
}

static jexpr *node(ps *p, jexpr_kind k, const jtok *at) {
  jexpr *e = ja_alloc(p->a, sizeof *e);
  if (!e) {
    oom(p);
    return NULL;
  }
  e->kind = k;
  e->line = at->line;
  e->col = at->col;
  return e;
}

/* A growing array of pointers in the arena. */
typedef struct pvec {
  void **v;
  size_t n, cap;
} pvec;

static int vpush(ps *p, pvec *v, void *x) {
  if (v->n == v->cap) {
    size_t nc = v->cap ? v->cap * 2 : 4;
    void **nv = ja_alloc(p->a, nc * sizeof *nv);
    if (!nv) return oom(p);
    if (v->n) memcpy(nv, v->v, v->n * sizeof *nv);
    v->v = nv;
    v->cap = nc;
  }
  v->v[v->n++] = x;
  return 0;
}

static jexpr *parse_expression(ps *p, bool condexpr);
static jexpr *parse_tuple(ps *p, bool condexpr, bool parens, const char *end_name);
static jexpr *parse_unary(ps *p, bool with_filter);
static jexpr *parse_primary(ps *p);
static jexpr *parse_postfix(ps *p, jexpr *e);

/* ( args ) after a callable, filter or test: positional and name=value. */
static int parse_args(ps *p, jexpr *e) {
  pvec pos = {0}, kwn = {0}, kwv = {0};
  if (expect_op(p, "(")) return -1;
  while (!is_op(cur(p), ")")) {
    if (pos.n + kwn.n && expect_op(p, ",")) return -1;
    if (is_op(cur(p), ")")) break;
    if (is_op(cur(p), "*") || is_op(cur(p), "**"))
      return failat(p, cur(p), "*args and **kwargs in a call are not supported");
    if (cur(p)->kind == TK_NAME && is_op(peek(p), "=")) {
      const char *name = cur(p)->s;
      p->i += 2;
      jexpr *v = parse_expression(p, true);
      if (!v || vpush(p, &kwn, (void *)name) || vpush(p, &kwv, v)) return -1;
    } else {
      if (kwn.n) return failat(p, cur(p), "a positional argument after a keyword argument");
      jexpr *v = parse_expression(p, true);
      if (!v || vpush(p, &pos, v)) return -1;
    }
  }
  p->i++;
  e->args = (jexpr **)pos.v;
  e->nargs = pos.n;
  e->kwnames = (const char **)kwn.v;
  e->kwargs = (jexpr **)kwv.v;
  e->nkw = kwn.n;
  return 0;
}

/* A dotted name after | or is (Jinja2 allows "a.b" names). */
static const char *parse_fname(ps *p) {
  if (cur(p)->kind != TK_NAME) {
    expected(p, "a name");
    return NULL;
  }
  const char *name = cur(p)->s;
  p->i++;
  if (is_op(cur(p), ".")) {
    failat(p, cur(p), "dotted filter and test names are not supported");
    return NULL;
  }
  return name;
}

static jexpr *parse_filter(ps *p, jexpr *e) {
  while (is_op(cur(p), "|")) {
    const jtok *at = cur(p);
    p->i++;
    const jtok *nt = cur(p);
    const char *name = parse_fname(p);
    if (!name) return NULL;
    int id = jb_filter_id(name);
    if (id == JB_UNSUPPORTED)
      return failat(p, nt, "filter '%s' is not supported (supported: %s)", name, jb_filter_names()), NULL;
    if (id < 0) return failat(p, nt, "no filter named '%s' (Jinja2 has none)", name), NULL;
    jexpr *f = node(p, E_FILTER, at);
    if (!f) return NULL;
    f->name = name;
    f->fn = id;
    f->a = e;
    if (is_op(cur(p), "(") && parse_args(p, f)) return NULL;
    e = f;
  }
  return e;
}

static jexpr *parse_test(ps *p, jexpr *e) {
  const jtok *at = cur(p);
  p->i++; /* is */
  bool neg = false;
  if (is_name(cur(p), "not")) {
    neg = true;
    p->i++;
  }
  const jtok *nt = cur(p);
  const char *name = parse_fname(p);
  if (!name) return NULL;
  int id = jb_test_id(name);
  if (id == JB_UNSUPPORTED)
    return failat(p, nt, "test '%s' is not supported (supported: %s)", name, jb_test_names()), NULL;
  if (id < 0) return failat(p, nt, "no test named '%s' (Jinja2 has none)", name), NULL;
  jexpr *t = node(p, E_TEST, at);
  if (!t) return NULL;
  t->name = name;
  t->fn = id;
  t->negated = neg;
  t->a = e;
  const jtok *c = cur(p);
  if (is_op(c, "(")) {
    if (parse_args(p, t)) return NULL;
  } else if ((c->kind == TK_NAME || c->kind == TK_STRING || c->kind == TK_INT || c->kind == TK_FLOAT ||
              is_op(c, "[") || is_op(c, "{")) &&
             !is_name(c, "else") && !is_name(c, "or") && !is_name(c, "and")) {
    if (is_name(c, "is")) return failat(p, c, "tests cannot be chained with 'is'"), NULL;
    jexpr *arg = parse_primary(p);
    if (!arg || !(arg = parse_postfix(p, arg))) return NULL;
    t->args = ja_alloc(p->a, sizeof *t->args);
    if (!t->args) return oom(p), NULL;
    t->args[0] = arg;
    t->nargs = 1;
  }
  return t;
}

/* The inside of [ ]: an expression or a slice. */
static jexpr *parse_subscribed(ps *p) {
  const jtok *at = cur(p);
  jexpr *parts[3] = {NULL, NULL, NULL};
  if (is_op(cur(p), ":")) {
    p->i++;
  } else {
    jexpr *e = parse_expression(p, true);
    if (!e) return NULL;
    if (!is_op(cur(p), ":")) return e;
    p->i++;
    parts[0] = e;
  }
  if (!is_op(cur(p), ":") && !is_op(cur(p), "]") && !is_op(cur(p), ",")) {
    if (!(parts[1] = parse_expression(p, true))) return NULL;
  }
  if (is_op(cur(p), ":")) {
    p->i++;
    if (!is_op(cur(p), "]") && !is_op(cur(p), ",") && !(parts[2] = parse_expression(p, true))) return NULL;
  }
  jexpr *s = node(p, E_SLICE, at);
  if (!s) return NULL;
  s->b = parts[0];
  s->c = parts[1];
  s->d = parts[2];
  return s;
}

static jexpr *parse_postfix(ps *p, jexpr *e) {
  for (;;) {
    const jtok *at = cur(p);
    if (is_op(at, ".")) {
      p->i++;
      if (cur(p)->kind == TK_NAME) {
        jexpr *g = node(p, E_ATTR, at);
        if (!g) return NULL;
        g->a = e;
        g->name = cur(p)->s;
        p->i++;
        e = g;
      } else if (cur(p)->kind == TK_INT) {
        jexpr *k = node(p, E_CONST, cur(p)), *g = node(p, E_ITEM, at);
        if (!k || !g) return NULL;
        k->val = jv_int(cur(p)->i);
        p->i++;
        g->a = e;
        g->b = k;
        e = g;
      } else {
        return expected(p, "an attribute name after '.'"), NULL;
      }
    } else if (is_op(at, "[")) {
      p->i++;
      pvec idx = {0};
      while (!is_op(cur(p), "]")) {
        if (idx.n && expect_op(p, ",")) return NULL;
        if (is_op(cur(p), "]")) break;
        jexpr *s = parse_subscribed(p);
        if (!s || vpush(p, &idx, s)) return NULL;
      }
      if (!idx.n) return expected(p, "a subscript"), NULL;
      p->i++;
      jexpr *key = idx.v[0];
      for (size_t k = 0; idx.n > 1 && k < idx.n; k++)
        if (((jexpr *)idx.v[k])->kind == E_SLICE)
          return failat(p, at, "a slice among several subscripts (x[a, b:c]) is not supported"), NULL;
      if (idx.n > 1) {
        if (!(key = node(p, E_TUPLE, at))) return NULL;
        key->args = (jexpr **)idx.v;
        key->nargs = idx.n;
      }
      jexpr *g;
      if (key->kind == E_SLICE) {
        g = key;
      } else {
        if (!(g = node(p, E_ITEM, at))) return NULL;
        g->b = key;
      }
      g->a = e;
      e = g;
    } else if (is_op(at, "(")) {
      jexpr *c = node(p, E_CALL, at);
      if (!c) return NULL;
      c->a = e;
      if (parse_args(p, c)) return NULL;
      e = c;
    } else {
      return e;
    }
  }
}

static jexpr *parse_seq(ps *p, jexpr_kind kind, const char *close) {
  jexpr *e = node(p, kind, cur(p));
  if (!e) return NULL;
  p->i++;
  pvec items = {0};
  size_t count = 0;
  while (!is_op(cur(p), close)) {
    if (count && expect_op(p, ",")) return NULL;
    if (is_op(cur(p), close)) break;
    jexpr *k = parse_expression(p, true);
    if (!k || vpush(p, &items, k)) return NULL;
    if (kind == E_DICT) {
      if (expect_op(p, ":")) return NULL;
      jexpr *v = parse_expression(p, true);
      if (!v || vpush(p, &items, v)) return NULL;
    }
    count++;
  }
  p->i++;
  e->args = (jexpr **)items.v;
  e->nargs = items.n;
  return e;
}

static jexpr *parse_primary(ps *p) {
  const jtok *t = cur(p);
  jexpr *e;
  switch (t->kind) {
  case TK_NAME:
    if (!(e = node(p, E_CONST, t))) return NULL;
    if (is_name(t, "true") || is_name(t, "True")) e->val = jv_bool(true);
    else if (is_name(t, "false") || is_name(t, "False")) e->val = jv_bool(false);
    else if (is_name(t, "none") || is_name(t, "None")) e->val = jv_none();
    else if (p->macros && (is_name(t, "varargs") || is_name(t, "kwargs") || is_name(t, "caller")))
      return failat(p, t, "a macro's '%s' is not supported", t->s), NULL;
    else {
      e->kind = E_NAME;
      e->name = t->s;
    }
    p->i++;
    return e;
  case TK_STRING: {
    /* adjacent literals join, as Python's */
    size_t len = 0, j = p->i;
    for (; p->t[j].kind == TK_STRING; j++) len += p->t[j].len;
    char *buf = ja_alloc(p->a, len + 1);
    if (!buf || !(e = node(p, E_CONST, t))) return oom(p), NULL;
    size_t o = 0;
    for (; p->i < j; p->i++) {
      memcpy(buf + o, p->t[p->i].s, p->t[p->i].len);
      o += p->t[p->i].len;
    }
    jstr *s = jstr_new(p->a, buf, len);
    if (!s) return oom(p), NULL;
    e->val = jv_strv(s);
    return e;
  }
  case TK_INT:
  case TK_FLOAT:
    if (!(e = node(p, E_CONST, t))) return NULL;
    e->val = t->kind == TK_INT ? jv_int(t->i) : jv_float(t->f);
    p->i++;
    return e;
  case TK_OP:
    if (is_op(t, "(")) {
      p->i++;
      e = parse_tuple(p, true, true, NULL);
      if (!e || expect_op(p, ")")) return NULL;
      return e;
    }
    if (is_op(t, "[")) return parse_seq(p, E_LIST, "]");
    if (is_op(t, "{")) return parse_seq(p, E_DICT, "}");
    break;
  default: break;
  }
  return expected(p, "an expression"), NULL;
}

static jexpr *parse_unary(ps *p, bool with_filter) {
  if (enter(p)) return NULL;
  const jtok *t = cur(p);
  jexpr *e;
  if (is_op(t, "-") || is_op(t, "+")) {
    p->i++;
    jexpr *x = parse_unary(p, false);
    if (!x || !(e = node(p, is_op(t, "-") ? E_NEG : E_POS, t))) return NULL;
    e->a = x;
  } else if (!(e = parse_primary(p))) {
    return NULL;
  }
  if (!(e = parse_postfix(p, e))) return NULL;
  while (with_filter) {
    if (is_op(cur(p), "|")) e = parse_filter(p, e);
    else if (is_name(cur(p), "is")) e = parse_test(p, e);
    else if (is_op(cur(p), "(")) {
      jexpr *c = node(p, E_CALL, cur(p));
      if (!c) return NULL;
      c->a = e;
      if (parse_args(p, c)) return NULL;
      e = c;
    } else break;
    if (!e) return NULL;
  }
  p->depth--;
  return e;
}

static jexpr *binary(ps *p, jexpr_kind k, int op, const jtok *at, jexpr *l, jexpr *r) {
  if (!l || !r) return NULL;
  jexpr *e = node(p, k, at);
  if (!e) return NULL;
  e->fn = op;
  e->a = l;
  e->b = r;
  return e;
}

/* Binary operators of one precedence level: ops[i] has the id ids[i]. */
static jexpr *parse_level(ps *p, int level);

static const char *const LEVEL_OPS[4][5] = {
    {"+", "-"}, {"~"}, {"*", "/", "//", "%"}, {"**"}};
static const int LEVEL_IDS[4][4] = {{'+', '-'}, {'~'}, {'*', '/', 'f', '%'}, {'p'}};

static jexpr *parse_level(ps *p, int level) {
  jexpr *l = level == 3 ? parse_unary(p, true) : parse_level(p, level + 1);
  for (;;) {
    if (!l) return NULL;
    int k = 0;
    while (LEVEL_OPS[level][k] && !is_op(cur(p), LEVEL_OPS[level][k])) k++;
    if (!LEVEL_OPS[level][k]) return l;
    const jtok *at = cur(p);
    p->i++;
    jexpr *r = level == 3 ? parse_unary(p, true) : parse_level(p, level + 1);
    l = binary(p, E_BIN, LEVEL_IDS[level][k], at, l, r);
  }
}

static jexpr *parse_compare(ps *p) {
  const jtok *at = cur(p);
  jexpr *first = parse_level(p, 0);
  if (!first) return NULL;
  pvec args = {0}, ops = {0};
  static const char *const CMP[] = {"==", "!=", "<", "<=", ">", ">="};
  for (;;) {
    const char *op = NULL;
    for (size_t k = 0; k < 6; k++)
      if (is_op(cur(p), CMP[k])) op = CMP[k];
    if (op) {
      p->i++;
    } else if (is_name(cur(p), "in")) {
      op = "in";
      p->i++;
    } else if (is_name(cur(p), "not") && is_name(peek(p), "in")) {
      op = "not in";
      p->i += 2;
    } else {
      break;
    }
    if (!args.n && vpush(p, &args, first)) return NULL;
    jexpr *r = parse_level(p, 0);
    if (!r || vpush(p, &args, r) || vpush(p, &ops, (void *)op)) return NULL;
  }
  if (!args.n) return first;
  jexpr *e = node(p, E_CMP, at);
  if (!e) return NULL;
  e->args = (jexpr **)args.v;
  e->nargs = args.n;
  e->ops = (const char **)ops.v;
  return e;
}

static jexpr *parse_not(ps *p) {
  if (is_name(cur(p), "not")) {
    const jtok *at = cur(p);
    p->i++;
    if (enter(p)) return NULL;
    jexpr *x = parse_not(p), *e;
    p->depth--;
    if (!x || !(e = node(p, E_NOT, at))) return NULL;
    e->a = x;
    return e;
  }
  return parse_compare(p);
}

static jexpr *parse_and(ps *p) {
  jexpr *l = parse_not(p);
  while (l && is_name(cur(p), "and")) {
    const jtok *at = cur(p);
    p->i++;
    l = binary(p, E_AND, 0, at, l, parse_not(p));
  }
  return l;
}

static jexpr *parse_or(ps *p) {
  jexpr *l = parse_and(p);
  while (l && is_name(cur(p), "or")) {
    const jtok *at = cur(p);
    p->i++;
    l = binary(p, E_OR, 0, at, l, parse_and(p));
  }
  return l;
}

static jexpr *parse_expression(ps *p, bool condexpr) {
  if (enter(p)) return NULL;
  jexpr *e = parse_or(p);
  while (condexpr && e && is_name(cur(p), "if")) {
    const jtok *at = cur(p);
    p->i++;
    jexpr *c = node(p, E_COND, at);
    if (!c || !(c->a = parse_or(p))) return NULL;
    c->b = e;
    if (is_name(cur(p), "else")) {
      p->i++;
      if (!(c->c = parse_expression(p, true))) return NULL;
    }
    e = c;
  }
  p->depth--;
  return e;
}

/* Comma-separated expressions: one alone, or a tuple of them (Jinja2's
 * parse_tuple); end_name is a name that ends it (the "in" of a for). */
static jexpr *parse_tuple(ps *p, bool condexpr, bool parens, const char *end_name) {
  const jtok *at = cur(p);
  pvec items = {0};
  bool tuple = false;
  for (;;) {
    if (items.n && expect_op(p, ",")) return NULL;
    const jtok *c = cur(p);
    if (c->kind == TK_VAR_END || c->kind == TK_BLOCK_END || is_op(c, ")") ||
        (end_name && is_name(c, end_name)))
      break;
    jexpr *e = parse_expression(p, condexpr);
    if (!e || vpush(p, &items, e)) return NULL;
    if (is_op(cur(p), ",")) tuple = true;
    else break;
  }
  if (!tuple) {
    if (items.n) return items.v[0];
    if (!parens) return expected(p, "an expression"), NULL;
  }
  jexpr *e = node(p, E_TUPLE, at);
  if (!e) return NULL;
  e->args = (jexpr **)items.v;
  e->nargs = items.n;
  return e;
}

/* Names assigned by for and set: a name or names separated by commas,
 * optionally in parentheses; never `loop` in a for loop (Jinja2 refuses it). */
static int parse_targets(ps *p, jstmt *s, bool for_target) {
  pvec names = {0};
  bool paren = is_op(cur(p), "(");
  if (paren) p->i++;
  for (;;) {
    if (cur(p)->kind != TK_NAME) return expected(p, "a variable name");
    if (is_name(cur(p), "loop") && (p->loops || for_target))
      return failat(p, cur(p), "Can't assign to special loop variable in for-loop target");
    if (vpush(p, &names, (void *)cur(p)->s)) return -1;
    p->i++;
    if (!is_op(cur(p), ",")) break;
    p->i++;
  }
  if (paren && expect_op(p, ")")) return -1;
  s->names = (const char **)names.v;
  s->nnames = names.n;
  return 0;
}

static int parse_body(ps *p, const char *const *ends, jbody *out, const char **found);

static jstmt *stmt(ps *p, jstmt_kind k, const jtok *at) {
  jstmt *s = ja_alloc(p->a, sizeof *s);
  if (!s) {
    oom(p);
    return NULL;
  }
  s->kind = k;
  s->line = at->line;
  s->col = at->col;
  return s;
}

static jstmt *parse_if(ps *p, const jtok *at) {
  static const char *const ends[] = {"elif", "else", "endif", NULL};
  static const char *const endif[] = {"endif", NULL};
  jstmt *s = stmt(p, S_IF, at);
  const char *found;
  if (!s || !(s->expr = parse_tuple(p, false, false, NULL)) || expect_end(p) ||
      parse_body(p, ends, &s->body, &found))
    return NULL;
  if (!strcmp(found, "elif")) {
    jstmt *e = parse_if(p, &p->t[p->i - 1]);
    if (!e || !(s->orelse.s = ja_alloc(p->a, sizeof(jstmt *)))) return oom(p), NULL;
    s->orelse.s[0] = e;
    s->orelse.n = 1;
    return s;
  }
  if (!strcmp(found, "else") && (expect_end(p) || parse_body(p, endif, &s->orelse, &found))) return NULL;
  return expect_end(p) ? NULL : s;
}

static jstmt *parse_for(ps *p, const jtok *at) {
  static const char *const ends[] = {"endfor", "else", NULL};
  static const char *const endfor[] = {"endfor", NULL};
  jstmt *s = stmt(p, S_FOR, at);
  if (!s || parse_targets(p, s, true)) return NULL;
  if (!is_name(cur(p), "in")) return expected(p, "'in'"), NULL;
  p->i++;
  if (!(s->expr = parse_tuple(p, false, false, "recursive"))) return NULL;
  if (is_name(cur(p), "if")) {
    p->i++;
    if (!(s->cond = parse_expression(p, true))) return NULL;
  }
  if (is_name(cur(p), "recursive")) return failat(p, cur(p), "recursive for loops are not supported"), NULL;
  const char *found;
  p->loops++;
  if (expect_end(p) || parse_body(p, ends, &s->body, &found)) return NULL;
  p->loops--;
  if (!strcmp(found, "else") && (expect_end(p) || parse_body(p, endfor, &s->orelse, &found))) return NULL;
  return expect_end(p) ? NULL : s;
}

static jstmt *parse_set(ps *p, const jtok *at) {
  jstmt *s = stmt(p, S_SET, at);
  if (!s) return NULL;
  if (cur(p)->kind == TK_NAME && is_op(peek(p), ".")) { /* ns.attr = ... */
    s->names = ja_alloc(p->a, sizeof *s->names);
    if (!s->names) return oom(p), NULL;
    s->names[0] = cur(p)->s;
    s->nnames = 1;
    p->i += 2;
    if (cur(p)->kind != TK_NAME) return expected(p, "an attribute name"), NULL;
    s->attr = cur(p)->s;
    p->i++;
  } else if (parse_targets(p, s, false)) {
    return NULL;
  }
  if (is_op(cur(p), "=")) {
    p->i++;
    if (!(s->expr = parse_tuple(p, true, false, NULL))) return NULL;
    return expect_end(p) ? NULL : s;
  }
  if (s->attr || s->nnames != 1) return expected(p, "'='"), NULL;
  if (is_op(cur(p), "|")) return failat(p, cur(p), "filters on a {%% set %%} block are not supported"), NULL;
  static const char *const ends[] = {"endset", NULL};
  const char *found;
  s->kind = S_SETBLOCK;
  p->captures++;
  if (expect_end(p) || parse_body(p, ends, &s->body, &found)) return NULL;
  p->captures--;
  return expect_end(p) ? NULL : s;
}

static jstmt *parse_macro(ps *p, const jtok *at) {
  jstmt *s = stmt(p, S_MACRO, at);
  pvec names = {0}, defs = {0};
  if (!s) return NULL;
  if (cur(p)->kind != TK_NAME) return expected(p, "a macro name"), NULL;
  if (vpush(p, &names, (void *)cur(p)->s) || vpush(p, &defs, NULL)) return NULL;
  p->i++;
  if (expect_op(p, "(")) return NULL;
  while (!is_op(cur(p), ")")) {
    if (names.n > 1 && expect_op(p, ",")) return NULL;
    if (cur(p)->kind != TK_NAME) return expected(p, "a parameter name"), NULL;
    if (vpush(p, &names, (void *)cur(p)->s)) return NULL;
    p->i++;
    jexpr *d = NULL;
    if (is_op(cur(p), "=")) {
      p->i++;
      if (!(d = parse_expression(p, true))) return NULL;
    } else if (defs.n > 1 && defs.v[defs.n - 1]) {
      return failat(p, cur(p), "a macro parameter without a default after one with a default"), NULL;
    }
    if (vpush(p, &defs, d)) return NULL;
  }
  p->i++;
  s->names = (const char **)names.v;
  s->nnames = names.n;
  s->defaults = (jexpr **)defs.v;
  static const char *const ends[] = {"endmacro", NULL};
  const char *found;
  int loops = p->loops;
  p->loops = 0;
  p->captures++;
  p->macros++;
  if (expect_end(p) || parse_body(p, ends, &s->body, &found)) return NULL;
  p->macros--;
  p->captures--;
  p->loops = loops;
  if (cur(p)->kind == TK_NAME) p->i++; /* {% endmacro name %} */
  return expect_end(p) ? NULL : s;
}

static const char *const UNSUPPORTED_TAGS[] = {
    "extends", "block", "include", "import", "from", "call", "filter", "with",
    "do", "autoescape", "trans", "pluralize", "print", NULL};

static jstmt *parse_stmt(ps *p) {
  const jtok *at = cur(p);
  if (at->kind != TK_NAME) return expected(p, "a tag name"), NULL;
  p->i++;
  jstmt *s;
  if (!strcmp(at->s, "if")) return parse_if(p, at);
  if (!strcmp(at->s, "for")) return parse_for(p, at);
  if (!strcmp(at->s, "set")) return parse_set(p, at);
  if (!strcmp(at->s, "macro")) return parse_macro(p, at);
  if (!strcmp(at->s, "break") || !strcmp(at->s, "continue")) {
    if (!p->loops) return failat(p, at, "'%s' outside a for loop", at->s), NULL;
    if (!(s = stmt(p, at->s[0] == 'b' ? S_BREAK : S_CONTINUE, at))) return NULL;
    return expect_end(p) ? NULL : s;
  }
  if (!strcmp(at->s, "generation")) {
    static const char *const ends[] = {"endgeneration", NULL};
    const char *found;
    if (p->captures)
      return failat(p, at, "{%% generation %%} inside a macro, a {%% set %%} block or another "
                           "generation block is not supported"),
             NULL;
    if (!(s = stmt(p, S_GENERATION, at)) || expect_end(p)) return NULL;
    int loops = p->loops; /* a call block's body: break and continue cannot leave it */
    p->loops = 0;
    p->captures++;
    if (parse_body(p, ends, &s->body, &found)) return NULL;
    p->captures--;
    p->loops = loops;
    p->has_gen = true;
    return expect_end(p) ? NULL : s;
  }
  for (size_t k = 0; UNSUPPORTED_TAGS[k]; k++)
    if (!strcmp(at->s, UNSUPPORTED_TAGS[k]))
      return failat(p, at,
                    "the tag '{%% %s %%}' is not supported (supported: if, for, set, macro, break, "
                    "continue, generation, raw)",
                    at->s),
             NULL;
  return failat(p, at, "unknown tag '%.60s' here", at->s), NULL;
}

/* Statements up to a tag named in ends (NULL: up to the end of the
 * template); *found is that name, with the parser after it. */
static int parse_body(ps *p, const char *const *ends, jbody *out, const char **found) {
  pvec v = {0};
  const jtok *open = p->i ? &p->t[p->i - 1] : cur(p);
  if (enter(p)) return -1;
  for (;;) {
    const jtok *t = cur(p);
    jstmt *s = NULL;
    if (t->kind == TK_EOF) {
      if (!ends) break;
      char want[128] = "";
      for (size_t k = 0; ends[k]; k++)
        snprintf(want + strlen(want), sizeof want - strlen(want), "%s'{%% %s %%}'", k ? " or " : "", ends[k]);
      return failat(p, open, "this block is not closed: the template ends where %s was expected", want);
    }
    if (t->kind == TK_TEXT) {
      if (!(s = stmt(p, S_TEXT, t))) return -1;
      s->text = t->s;
      s->len = t->len;
      p->i++;
    } else if (t->kind == TK_VAR_BEGIN) {
      p->i++;
      if (!(s = stmt(p, S_OUT, t)) || !(s->expr = parse_tuple(p, true, false, NULL))) return -1;
      if (cur(p)->kind != TK_VAR_END) return expected(p, "'}}'");
      p->i++;
    } else if (t->kind == TK_BLOCK_BEGIN) {
      p->i++;
      const jtok *name = cur(p);
      for (size_t k = 0; ends && ends[k]; k++)
        if (is_name(name, ends[k])) {
          *found = ends[k];
          p->i++;
          out->s = (jstmt **)v.v;
          out->n = v.n;
          p->depth--;
          return 0;
        }
      if (name->kind == TK_NAME && (!strncmp(name->s, "end", 3) || !strcmp(name->s, "else") ||
                                    !strcmp(name->s, "elif")))
        return failat(p, name, "unexpected '{%% %s %%}'%s", name->s,
                      ends ? " inside this block" : ": no block is open");
      if (!(s = parse_stmt(p))) return -1;
    } else {
      return expected(p, "template text, '{{' or '{%'");
    }
    if (vpush(p, &v, s)) return -1;
  }
  out->s = (jstmt **)v.v;
  out->n = v.n;
  p->depth--;
  return 0;
}

int jinja_parse_tokens(jarena *a, const char *origin, const jtok *toks, size_t ntok, jbody *out,
                       bool *has_gen) {
  ps p = {.a = a, .origin = origin, .t = toks, .n = ntok};
  const char *found;
  if (parse_body(&p, NULL, out, &found)) return -1;
  *has_gen = p.has_gen;
  return 0;
}

/* The evaluator: a render's state and what the builtins (builtins.c) use of
 * it: errors located at an expression, strings in the render's arena,
 * iteration, and rendering values as text. */
#ifndef ML_TEMPLATE_EVAL_H
#define ML_TEMPLATE_EVAL_H

#include <stdint.h>

#include "template/ast.h"
#include "template/jinja.h"
#include "template/jv.h"
#include "template/pyfmt.h"

struct jargs; /* builtins.h */

/* Bounds of one render. */
#define JINJA_MAX_OUTPUT ((size_t)64 << 20)  /* bytes of rendered text */
#define JINJA_MAX_MEMORY ((size_t)512 << 20) /* bytes of values made */
#define JINJA_MAX_ITERS 10000000ULL           /* for-loop iterations in all */
#define JINJA_MAX_RANGE 100000                /* range()'s length, as the sandbox's */
#define JINJA_MAX_CALLS 100                   /* nested macro calls */
#define JINJA_MAX_EVAL_DEPTH 2000             /* nested expressions, blocks and calls at once */

/* Variables of a scope: the template's top level, a loop iteration, a macro
 * call. Lookups go up the parents, then to the context and the globals.
 * Names point into the template (they outlive the render); a loop reuses
 * one frame for all its iterations, emptied before each. */
typedef struct jframe {
  struct jframe *parent;
  const char **names;
  jv *vals;
  size_t n, cap;
} jframe;

typedef struct jx {
  jarena a;
  const char *origin;
  const jdict *ctx;
  jbuf out;  /* the rendered text */
  jbuf *cur; /* where text goes now: out, or a macro's or set block's capture */
  ml_jinja_span *gen;
  size_t ngen, capgen;
  uint64_t iters;
  int calls;
  int depth; /* the evaluator's recursion now */
  int ctl; /* a pending {% break %} (1) or {% continue %} (2) */
} jx;

/* Record "origin:line:col: message" for the expression at (printf format);
 * returns -1. */
int jx_fail(jx *x, const jexpr *at, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* The message for an arena that refused: -1. */
int jx_oom(jx *x, const jexpr *at);

/* A new string value of n bytes from p: 0, or -1 with the message. */
int jx_str(jx *x, const jexpr *at, const char *p, size_t n, jv *out);
/* str(v) (pyfmt.h) as a string value: 0, or -1 with the message. */
int jx_tostr(jx *x, const jexpr *at, jv v, jv *out);

/* The items `for` iterates over v: a list or tuple itself, a dict's keys, a
 * string's characters, nothing for Undefined; -1 with a message for what
 * is not iterable (a number, None, ...). */
int jx_iter(jx *x, const jexpr *at, jv v, jlist **out);

/* The error of using an Undefined value: "'name' is undefined". */
int jx_undefined(jx *x, const jexpr *at, jv v);

/* Python's a < b (-1 with a TypeError-like message for types that do not
 * order), for sort and comparisons. */
int jx_less(jx *x, const jexpr *at, jv a, jv b, bool *out);

/* Python's a op b for op '+', '-', '*', '/', 'f' (//), '%', 'p' (**) and
 * '~' (Jinja2's concatenation of str(a) and str(b)); integers are int64
 * and their overflow an error. */
int jx_arith(jx *x, const jexpr *at, int op, jv a, jv b, jv *out);

/* v's attribute `name` as Jinja2's getattr (dict keys; methods of str,
 * dict and list; namespace and loop attributes); Undefined when none. */
int jx_getattr(jx *x, const jexpr *at, jv v, const char *name, size_t len, jv *out);

/* Call a macro or a callable with evaluated arguments. */
int jx_call(jx *x, const jexpr *at, jv fn, const struct jargs *args, jv *out);

/* Render body at top level with ctx's variables into x->out. */
int jx_render(jx *x, const jbody *body);

#endif

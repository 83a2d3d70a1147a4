/* The filters, tests, globals and methods a template can call, as Jinja2's
 * defaults with transformers' additions define them (jinja.h). Names are
 * resolved when parsing (a filter or test outside the subset is a parse
 * error naming it); the functions run during a render (eval.h). */
#ifndef ML_TEMPLATE_BUILTINS_H
#define ML_TEMPLATE_BUILTINS_H

#include <stdbool.h>
#include <stddef.h>

#include "template/ast.h"
#include "template/jv.h"

/* A name Jinja2 defines that this subset does not implement. */
#define JB_UNSUPPORTED (-2)

/* The id of filter / test `name`; -1 when Jinja2 has none of that name,
 * JB_UNSUPPORTED when it has one outside the subset. */
int jb_filter_id(const char *name);
int jb_test_id(const char *name);

/* The supported names, comma-separated, for messages. */
const char *jb_filter_names(void);
const char *jb_test_names(void);

/* The arguments of a call: positional, then keyword. */
typedef struct jargs {
  const jv *pos;
  size_t npos;
  const char *const *kwn;
  const jv *kwv;
  size_t nkw;
} jargs;

struct jx;

/* Apply filter `id` to v with args; at is the filter expression (its
 * position is the one errors name). 0 with *out, or -1 with the message:
 * a wrong argument (count, keyword or type) or a failure of the filter
 * itself (e.g. tojson of an Undefined), worded as Jinja2/Python word it. */
int jb_filter(struct jx *x, const jexpr *at, int id, jv v, const jargs *args, jv *out);

/* Test `id` on v: 0 with *out, or -1 with the message. */
int jb_test(struct jx *x, const jexpr *at, int id, jv v, const jargs *args, bool *out);

/* The global function `name` (range, dict, namespace, raise_exception,
 * strftime_now; cycler, joiner and lipsum refuse when called): true with
 * *out, false when there is none of that name. */
bool jb_global(const char *name, jv *out);

/* The attribute `name` of v when it is a method (str, dict and list
 * methods as Python's, through the sandbox: a method that modifies a list
 * or dict is an Undefined that fails when called): 1 with *out bound to v,
 * 0 when v has no such method, -1 with the message when the render's
 * memory is exhausted. */
int jb_method(struct jx *x, const jexpr *at, jv v, const char *name, size_t len, jv *out);

/* Call a global or bound method. 0 with *out, or -1 with the message. */
int jb_call(struct jx *x, const jexpr *at, const jfunc *f, const jargs *args, jv *out);

#endif

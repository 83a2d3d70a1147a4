/* What the builtins' files (builtins.c: tests, globals, arguments;
 * filters.c; methods.c) share. */
#ifndef ML_TEMPLATE_BI_H
#define ML_TEMPLATE_BI_H

#include "template/builtins.h"
#include "template/eval.h"

/* Callables' ids (jfunc.id): the globals, then the methods (methods.c). */
enum {
  G_RANGE,
  G_DICT,
  G_NAMESPACE,
  G_RAISE,
  G_STRFTIME,
  G_CYCLER,
  G_JOINER,
  G_LIPSUM,
  M_FIRST, /* methods.c's ids start here */
};

/* Bind args to the parameters `names` (Python's rules: positional first,
 * then keywords; fname for messages): out[i] is the value, or jb_missing()
 * when not given. -1 with a message for too many positional arguments, an
 * unknown keyword or one given twice. */
int jb_bind(jx *x, const jexpr *at, const char *fname, const jargs *args, const char *const *names, size_t n,
            jv *out);
jv jb_missing(void);
bool jb_given(jv v);

/* A string value of b's bytes (then b is freed): 0 or -1. */
int jb_take(jx *x, const jexpr *at, jbuf *b, jv *out);
/* The failure of a jbuf append: the bound or out of memory. */
int jb_buf_fail(jx *x, const jexpr *at, const jbuf *b);

/* The failure rc of txt_case into b (-1: the buffer; -2: the code point
 * bad has a special casing outside the subset) as a message; b is freed.
 * Returns -1. */
int jb_case_fail(jx *x, const jexpr *at, jbuf *b, int rc, int32_t bad);
/* Python's s.upper() ('u'), lower() ('l'), title() ('T'), capitalize()
 * ('C') as a string value: 0 or -1. */
int jb_case_str(jx *x, const jexpr *at, const jstr *s, char mode, jv *out);

/* An integer argument (int or bool): 0, or -1 naming fname and what. */
int jb_int_arg(jx *x, const jexpr *at, const char *fname, jv v, int64_t *out);
/* A string argument: 0, or -1. */
int jb_str_arg(jx *x, const jexpr *at, const char *fname, jv v, const jstr **out);

/* Test `id` on v with positional extra arguments (select, selectattr). */
int jb_test_pos(jx *x, const jexpr *at, int id, jv v, const jv *args, size_t n, bool *out);

/* Call a method (methods.c). */
int jb_call_method(jx *x, const jexpr *at, const jfunc *f, const jargs *args, jv *out);

/* A value with an attribute path "a.b.0" as Jinja2's attribute getter of
 * map/sort/selectattr reads it (items first, then attributes; an integer
 * part indexes). */
int jb_attr_path(jx *x, const jexpr *at, jv v, const jstr *path, jv *out);

#endif

/* The values a Jinja template computes with, as Python objects behave in
 * Jinja2: none, booleans, integers (int64; Python's big integers beyond are
 * an error, never a wrapped value), floats, strings (UTF-8 bytes), lists and
 * tuples, dicts (insertion-ordered, as Python's), Undefined, and what
 * templates create: namespace(), the loop object, macros and callables
 * (globals, bound methods). All of them live in an arena (ja_*): a render
 * allocates from one arena that it frees at its end, and a parse from the
 * template's own, so values are never freed one by one. Lists, dicts and
 * namespaces are shared by reference, as Python objects. */
#ifndef ML_TEMPLATE_JV_H
#define ML_TEMPLATE_JV_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

/* A bump allocator of chunks; `cap` bounds the bytes it hands out in all. */
typedef struct ja_chunk ja_chunk;
typedef struct jarena {
  ja_chunk *head;
  size_t used, cap;
} jarena;

/* `bytes` zeroed bytes aligned for any value, or NULL when the arena's cap
 * would be passed or malloc fails (no message: the caller names what it was
 * making). */
void *ja_alloc(jarena *a, size_t bytes);
void ja_free(jarena *a);

typedef enum jv_kind {
  JV_UNDEF, /* Jinja2's Undefined: falsy, renders "", iterates as empty */
  JV_NONE,
  JV_BOOL,
  JV_INT,
  JV_FLOAT,
  JV_STR,
  JV_LIST, /* also a tuple, dict view or generator (jlist.view) */
  JV_DICT,
  JV_NS,    /* namespace(): a dict whose keys are attributes */
  JV_LOOP,  /* a for loop's `loop` */
  JV_MACRO, /* a {% macro %} */
  JV_FUNC,  /* a global function or a bound method (jfunc) */
} jv_kind;

typedef struct jstr {
  size_t len;
  char s[]; /* len bytes and a NUL */
} jstr;

typedef struct jv jv;
typedef struct jlist jlist;
typedef struct jdict jdict;

struct jv {
  jv_kind kind;
  union {
    bool b;
    int64_t i;
    double f;
    const jstr *s;
    jlist *l;
    jdict *d; /* JV_DICT and JV_NS */
    struct jloop *loop;
    const struct jstmt *macro;
    struct jfunc *fn;
  } u;
  /* JV_UNDEF: the name or attribute that was missing (for messages), or
   * NULL, or with u.i == 1 the whole message (jv_undef_msg); JV_STR:
   * non-NULL for a Markup string; JV_MACRO: the frame the macro was
   * defined in. */
  const void *aux;
};

/* What a JV_LIST is in Python: they iterate alike, and differ in how they
 * render, compare and measure. A generator (what Jinja2's map, select...
 * return) is always true, has no len() and no text here (Python would show
 * its address); a range() renders as "range(0, 3)", which is refused here
 * too. */
typedef enum jlist_view { JL_LIST, JL_TUPLE, JL_ITEMS, JL_KEYS, JL_VALUES, JL_GEN, JL_RANGE } jlist_view;

struct jlist {
  jv *items;
  size_t n, cap;
  jlist_view view;
};

/* Copy n values (n may be 0 with NULL pointers, unlike memcpy). */
static inline void jv_copy(jv *dst, const jv *src, size_t n) {
  for (size_t i = 0; i < n; i++) dst[i] = src[i];
}

/* Whether l supports x[i] and slices (lists, tuples, ranges). */
static inline bool jlist_indexable(const jlist *l) { return l->view <= JL_TUPLE || l->view == JL_RANGE; }

struct jdict {
  jv *keys, *vals;
  size_t n, cap;
};

/* A callable that is not a macro: a global (range, dict, namespace,
 * raise_exception, strftime_now) or a method bound to `self`. `id` indexes
 * the builtins' table (builtins.h). */
typedef struct jfunc {
  int id;
  jv self;
} jfunc;

/* A for loop's state as `loop` shows it. */
typedef struct jloop {
  const jlist *items; /* the iterated values, filtered */
  size_t index0;
} jloop;

/* Constructors. */
static inline jv jv_undef(const char *what) { return (jv){.kind = JV_UNDEF, .aux = what}; }
/* An Undefined whose use fails with `msg` itself (e.g. the sandbox's
 * "access to attribute 'append' of 'list' object is unsafe"). */
static inline jv jv_undef_msg(const char *msg) { return (jv){.kind = JV_UNDEF, .u.i = 1, .aux = msg}; }
static inline jv jv_none(void) { return (jv){.kind = JV_NONE}; }
static inline jv jv_bool(bool b) { return (jv){.kind = JV_BOOL, .u.b = b}; }
static inline jv jv_int(int64_t i) { return (jv){.kind = JV_INT, .u.i = i}; }
static inline jv jv_float(double f) { return (jv){.kind = JV_FLOAT, .u.f = f}; }
static inline jv jv_strv(const jstr *s) { return (jv){.kind = JV_STR, .u.s = s}; }
/* A string marked as Jinja2's Markup (what escape and safe return): its
 * text renders alike, but Python shows it as Markup('...') inside a list,
 * escapes what is added to it and keeps it from being escaped twice. */
static inline jv jv_markupv(const jstr *s) { return (jv){.kind = JV_STR, .u.s = s, .aux = s}; }
static inline bool jv_is_markup(jv v) { return v.kind == JV_STR && v.aux != NULL; }

/* A string of len bytes copied from p (NULL when the arena refuses). */
jstr *jstr_new(jarena *a, const char *p, size_t len);
jlist *jlist_new(jarena *a, size_t cap);
jdict *jdict_new(jarena *a, size_t cap);
/* Append v (growing in the arena): 0, or -1 when the arena refuses. */
int jlist_push(jarena *a, jlist *l, jv v);
/* The value of key k (Python's dict lookup: 1 == 1.0 == True), or NULL. */
jv *jdict_get(const jdict *d, jv k);
jv *jdict_get_str(const jdict *d, const char *k, size_t len);
/* Set key k to v, keeping the position of an existing key: 0 or -1. */
int jdict_set(jarena *a, jdict *d, jv k, jv v);

/* Python's truth value (Undefined is false). */
bool jv_truthy(jv v);
/* Python's ==: numbers by value (True == 1 == 1.0), strings by bytes, lists
 * and tuples elementwise (a list never equals a tuple), dicts by keys and
 * values, Undefined equal to Undefined, other objects by identity. */
bool jv_eq(jv a, jv b);
/* jv_eq for comparisons a template makes: -1 when the values nest deeper
 * than JV_DEPTH (Python's RecursionError), else 0 with *eq set. */
int jv_equal(jv a, jv b, bool *eq);
/* The deepest nesting of lists and dicts that comparisons, rendering and
 * tojson walk. */
#define JV_DEPTH 512
/* The type's name as Python's type(x).__name__ says it ("str", "int",
 * "NoneType", "dict", "Undefined"...), for messages. */
const char *jv_type_name(jv v);
static inline bool jv_is_num(jv v) {
  return v.kind == JV_INT || v.kind == JV_FLOAT || v.kind == JV_BOOL;
}
/* A number as a double (bool as 0/1). */
double jv_num(jv v);

/* The JSON value `j` as a value (objects become dicts, arrays lists);
 * depth-bounded. 0, or -1 with *why set ("nesting deeper than N", "arena"). */
int jv_from_json(jarena *a, const json_t *j, jv *out, const char **why);

#endif

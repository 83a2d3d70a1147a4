/* A parsed template: the lexer's tokens (lex.c) and the tree the parser
 * builds of them (parse.c), which the evaluator (eval.c) walks. Everything
 * lives in the template's arena. */
#ifndef ML_TEMPLATE_AST_H
#define ML_TEMPLATE_AST_H

#include <stdbool.h>
#include <stddef.h>

#include "template/jv.h"

/* The deepest nesting of blocks and expressions a template may have; the
 * parser and the evaluator recurse once per level. */
#define JINJA_MAX_DEPTH 200

typedef enum jtok_kind {
  TK_TEXT,        /* template data, whitespace control applied */
  TK_VAR_BEGIN,   /* {{ */
  TK_VAR_END,     /* }} */
  TK_BLOCK_BEGIN, /* {% */
  TK_BLOCK_END,   /* %} */
  TK_NAME,
  TK_STRING, /* unescaped */
  TK_INT,
  TK_FLOAT,
  TK_OP, /* op: one of the operator spellings below, e.g. "//" */
  TK_EOF,
} jtok_kind;

typedef struct jtok {
  jtok_kind kind;
  int line, col;
  const char *s; /* TEXT, NAME, STRING, OP: the text (NUL-terminated) */
  size_t len;
  int64_t i;
  double f;
} jtok;

/* Split src (newlines already normalised, jinja.c) into tokens in a: 0, or
 * -1 with the message (origin:line:col: what was found, what was
 * expected). */
int jinja_lex(jarena *a, const char *origin, const char *src, size_t len, jtok **toks,
              size_t *ntok);

typedef enum jexpr_kind {
  E_CONST,   /* val */
  E_NAME,    /* name */
  E_ATTR,    /* a.name */
  E_ITEM,    /* a[b] */
  E_SLICE,   /* a[b:c:d], each of b, c, d may be NULL */
  E_CALL,    /* a(args, kw=...) */
  E_FILTER,  /* a | fn(args, kw=...) */
  E_TEST,    /* a is [not] fn args */
  E_BIN,     /* a op b: + - * / // % ** ~ (fn) */
  E_NEG,     /* -a */
  E_POS,     /* +a */
  E_NOT,     /* not a */
  E_AND,     /* a and b */
  E_OR,      /* a or b */
  E_CMP,     /* args[0] ops[0] args[1] ops[1] ...: == != < <= > >= in "not in" */
  E_COND,    /* b if a else c (c NULL: Undefined) */
  E_LIST,    /* [args] */
  E_TUPLE,   /* (args) */
  E_DICT,    /* {args[0]: args[1], ...} */
} jexpr_kind;

typedef struct jexpr jexpr;
struct jexpr {
  jexpr_kind kind;
  int line, col;
  jv val;               /* E_CONST */
  const char *name;     /* E_NAME, E_ATTR; E_FILTER/E_TEST: the function's name */
  int fn;               /* E_FILTER, E_TEST: the builtins' id; E_BIN: the operator, one of
                           '+' '-' '*' '/' '%' '~', 'f' (//), 'p' (**) */
  bool negated;         /* E_TEST: is not */
  jexpr *a, *b, *c, *d; /* operands */
  jexpr **args;         /* E_CALL/E_FILTER/E_TEST arguments, E_LIST/E_TUPLE items,
                           E_DICT keys and values alternating, E_CMP operands */
  size_t nargs;
  const char **kwnames; /* keyword arguments */
  jexpr **kwargs;
  size_t nkw;
  const char **ops; /* E_CMP: nargs - 1 operators */
};

typedef enum jstmt_kind {
  S_TEXT,       /* text */
  S_OUT,        /* {{ expr }} */
  S_IF,         /* if expr: body, else: orelse (an elif is an S_IF alone in orelse) */
  S_FOR,        /* for names in expr [if cond]: body, else: orelse */
  S_SET,        /* set names = expr; set names[0].attr = expr */
  S_SETBLOCK,   /* set names[0]: body */
  S_MACRO,      /* macro names[0](names[1..], defaults): body */
  S_BREAK,
  S_CONTINUE,
  S_GENERATION, /* generation: body */
} jstmt_kind;

typedef struct jstmt jstmt;
typedef struct jbody {
  jstmt **s;
  size_t n;
} jbody;

struct jstmt {
  jstmt_kind kind;
  int line, col;
  const char *text; /* S_TEXT */
  size_t len;
  jexpr *expr, *cond;
  const char **names; /* targets; S_MACRO: the name, then the parameters */
  size_t nnames;
  const char *attr;   /* S_SET of a namespace attribute */
  jexpr **defaults;   /* S_MACRO: per parameter, NULL when none */
  jbody body, orelse;
};

/* Parse the tokens into the template's top-level body. Errors name origin,
 * line and column, what was found and what was expected, and an unsupported
 * construct by name. *has_gen tells whether a {% generation %} block
 * occurs. */
int jinja_parse_tokens(jarena *a, const char *origin, const jtok *toks, size_t ntok, jbody *out,
                       bool *has_gen);

#endif

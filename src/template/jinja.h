/* Jinja templates as Hugging Face chat templates use them: the subset of
 * Jinja2 (https://jinja.palletsprojects.com/en/stable/templates/) that
 * transformers' apply_chat_template renders with its sandboxed
 * environment (transformers/utils/chat_template_utils.py:
 * _compile_jinja_template): trim_blocks = True, lstrip_blocks = True, the
 * loopcontrols extension ({% break %}, {% continue %}), the `tojson` filter
 * as transformers overrides it (json.dumps(x, ensure_ascii=False,
 * indent=None or the given indent, sort_keys=False)), the globals
 * `raise_exception(msg)` and `strftime_now(fmt)`, and the `{% generation %}
 * ... {% endgeneration %}` block (return_assistant_tokens_mask's marker).
 *
 * Values are JSON values (jansson) extended with what a template creates
 * (namespace(), loop, macros, ranges, none/undefined). The context of a
 * render is a JSON object: messages, add_generation_prompt, bos_token,
 * eos_token, tools, and whatever else the caller passes. To render as
 * apply_chat_template does (render_jinja_template), pass: "messages" (each
 * message with reasoning under "reasoning_content", "thinking" or
 * "reasoning" also carrying the other two names: _alias_reasoning_fields),
 * "tools" and "documents" (null when none: a template sees them defined),
 * "add_generation_prompt", the tokenizer's special tokens by name
 * (bos_token, eos_token, unk_token, pad_token, ...) and the caller's extra
 * arguments.
 *
 * A construct outside the subset is an error that names it (the template's
 * origin, line and column, the construct, what is supported): a parse
 * error, or a render error where only the values tell (a method, an
 * overflow, a value without text); never a silent mis-render.
 *
 * The subset (src/template; tests/fixtures/jinja holds the cases checked
 * against transformers): {{ }}, {% if/elif/else %}, {% for %} (else,
 * `if` filter, tuple unpacking, loop.index/index0/revindex/revindex0/
 * first/last/length/previtem/nextitem/cycle), {% set %} (tuples,
 * namespace attributes, {% set x %}...{% endset %}), {% macro %} and its
 * calls (defaults, keywords), {% break %}, {% continue %}, {% raw %},
 * {% generation %}, comments, whitespace control (- and +); literals,
 * lists, tuples, dicts, subscripts and slices, attributes, Python's
 * operators, `x if c else y`; Jinja2's tests and filters but batch,
 * filesizeformat, format, groupby, pprint, random, slice, striptags,
 * truncate, urlencode, urlize, wordcount, wordwrap, xmlattr, escaped; str
 * methods (strip/lstrip/rstrip, split/rsplit/splitlines, startswith,
 * endswith, replace, upper, lower, title, capitalize, join, find, rfind,
 * count, is*, format with plain fields), dict items/keys/values/get, list
 * index/count; globals range, dict, namespace, raise_exception,
 * strftime_now. Refused: the tags include, extends, block, import, from,
 * call, filter, with, do; recursive loops, loop.changed, a macro's varargs,
 * kwargs and caller, a {% generation %} block inside a macro, a set block
 * or another generation block, `str % args`, * and ** arguments, x[a, b:c],
 * cycler, joiner and lipsum, Python methods outside the list above,
 * integers beyond int64 (Python's are unbounded),
 * the case mapping of the few code points whose Unicode special casing is
 * not implemented, rendering what Python would show by address
 * (generators from map/select/..., range(), namespace, loop, macros), and
 * a Markup string (from escape or safe) anywhere its text would differ
 * from a str's (inside a rendered list, with +, its methods, most
 * filters). */
#ifndef ML_TEMPLATE_JINJA_H
#define ML_TEMPLATE_JINJA_H

#include <stdbool.h>
#include <stddef.h>

#include <jansson.h>

typedef struct ml_jinja ml_jinja; /* a parsed template */

/* Parse src[0, len) (UTF-8). origin names the template in messages (e.g.
 * "models/x/tokenizer_config.json: field 'chat_template'"). As Jinja2's
 * lexer: \r\n and \r read as \n, and one trailing newline is dropped
 * (keep_trailing_newline is off). Errors: syntax (line:column, what was
 * found, what was expected), an unterminated tag, comment or string, an
 * unsupported construct or filter/test name (named), a NUL byte, a source
 * over 16 MiB, allocation, nesting deeper than 200 levels. The template
 * can be rendered any number of times (not concurrently with ml_jinja_free). */
int ml_jinja_parse(const char *src, size_t len, const char *origin, ml_jinja **out);
void ml_jinja_free(ml_jinja *t);

/* Whether the template has a {% generation %} block. */
bool ml_jinja_has_generation(const ml_jinja *t);

/* A byte range [begin, end) of a rendered text. */
typedef struct ml_jinja_span {
  size_t begin, end;
} ml_jinja_span;

/* A render: text[0, len) (NUL-terminated), and the spans of the text that
 * {% generation %} blocks produced, in order (none without such blocks):
 * UTF-8 byte offsets where transformers' return_assistant_tokens_mask
 * counts characters. */
typedef struct ml_jinja_output {
  char *text;
  size_t len;
  ml_jinja_span *gen;
  size_t ngen;
} ml_jinja_output;

/* Render t with the variables of ctx (a JSON object; not modified) into
 * *out (zeroed on entry; free with ml_jinja_output_free). Semantics:
 * Jinja2's with transformers' environment (above), values rendered as
 * Python's str() (True, None, floats as repr, lists and dicts as repr);
 * undefined variables are Jinja2's default Undefined (falsy, render as "",
 * iterate as empty, length 0; an error when called, indexed or when an
 * attribute is taken, as in Jinja2). Reentrant: renders share nothing.
 * Errors (origin, line and column of the failing expression):
 * raise_exception(msg) (the template's own message), a type error worded
 * as Python's (e.g. "can only concatenate str (not \"int\") to str"),
 * using an undefined value, the sandbox's refusals (an unsafe attribute
 * such as list.append, range() over 100000 items), a refused construct
 * (above), and the bounds: 64 MiB of output and of any string, 512 MiB of
 * values, 10^7 loop iterations, 100 nested macro calls, 2000 nested
 * evaluations. */
int ml_jinja_render(const ml_jinja *t, const json_t *ctx, ml_jinja_output *out);
void ml_jinja_output_free(ml_jinja_output *o);

#endif

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
 * eos_token, tools, and whatever else the caller passes (transformers
 * passes the tokenizer's special tokens and the caller's kwargs).
 *
 * A construct outside the subset is a parse error that names it (the
 * template's origin, line and column, the construct, what is supported),
 * never a silent mis-render. */
#ifndef ML_TEMPLATE_JINJA_H
#define ML_TEMPLATE_JINJA_H

#include <stdbool.h>
#include <stddef.h>

#include <jansson.h>

typedef struct ml_jinja ml_jinja; /* a parsed template */

/* Parse src[0, len) (UTF-8). origin names the template in messages (e.g.
 * "models/x/tokenizer_config.json: field 'chat_template'"). Errors: syntax
 * (line:column, what was found, what was expected), an unsupported
 * construct or filter/test name (named), allocation, nesting deeper than a
 * fixed bound. */
int ml_jinja_parse(const char *src, size_t len, const char *origin, ml_jinja **out);
void ml_jinja_free(ml_jinja *t);

/* Whether the template has a {% generation %} block. */
bool ml_jinja_has_generation(const ml_jinja *t);

/* A byte range [begin, end) of a rendered text. */
typedef struct ml_jinja_span {
  size_t begin, end;
} ml_jinja_span;

/* A render: text[0, len) (NUL-terminated), and the spans of the text that
 * {% generation %} blocks produced, in order (none without such blocks). */
typedef struct ml_jinja_output {
  char *text;
  size_t len;
  ml_jinja_span *gen;
  size_t ngen;
} ml_jinja_output;

/* Render t with the variables of ctx (a JSON object; not modified) into
 * *out (zeroed on entry; free with ml_jinja_output_free). Semantics:
 * Jinja2's with transformers' environment (above); undefined variables are
 * Jinja2's Undefined (falsy, render as "", an error when iterated or
 * called, as the sandbox). Errors (origin, line and column of the failing
 * expression): raise_exception(msg) (the template's own message), a type
 * error (e.g. "'+' of a string and an integer"), calling/iterating an
 * undefined value, an output larger than a fixed bound, loop iterations
 * beyond a fixed bound, allocation. */
int ml_jinja_render(const ml_jinja *t, const json_t *ctx, ml_jinja_output *out);
void ml_jinja_output_free(ml_jinja_output *o);

#endif

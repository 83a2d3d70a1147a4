/* Conversational records, {"messages": [{"role": ..., "content": ...}, ...]}
 * (TRL's and NeMo RL's conversational format; an optional "tools" list),
 * rendered with the model's own chat template as transformers'
 * tokenizer.apply_chat_template renders them (transformers 5.23:
 * tokenization_utils_base.py, utils/chat_template_utils.py), the Jinja
 * interpreter being template/jinja.h.
 *
 * The template of a model directory, as from_pretrained finds it:
 * chat_template.jinja (transformers >= 4.43 saves it apart) and
 * additional_chat_templates/tool_use.jinja as "tool_use" — template files
 * that, when present, replace tokenizer_config.json's — else
 * tokenizer_config.json's
 * "chat_template": a string, or a list of {"name", "template"} of which the
 * one named "default" is used — "tool_use" instead for a record with tools
 * where the list has one (get_chat_template). The context of a render is
 * apply_chat_template's: messages, tools (null when the record has none),
 * documents (null), add_generation_prompt, and the tokenizer's named
 * special tokens as strings (bos_token, eos_token, unk_token, sep_token,
 * pad_token, cls_token, mask_token: special_tokens_map.json over
 * tokenizer_config.json, a string or an AddedToken {"content": ...}; null
 * or absent ones left out). Messages as transformers passes them: keys
 * whose value is null dropped, and a reasoning field (reasoning_content,
 * thinking, reasoning) copied to "thinking" and "reasoning_content".
 *
 * Targets (the text an SFT loss trains on): the assistant turns only, as
 * TRL's assistant_only_loss and NeMo RL's message log:
 *  - a template with {% generation %} blocks: the text they produce
 *    (transformers' return_assistant_tokens_mask);
 *  - otherwise by prefix rendering: for each assistant message i, the text
 *    render(messages[:i+1]) adds after render(messages[:i],
 *    add_generation_prompt = true) — what the policy generates after the
 *    generation prompt: the content and the end of turn. This requires
 *    each of these renderings to start with the previous one and the
 *    whole conversation's to start with them; a template that rewrites
 *    earlier turns is refused, naming the message. */
#ifndef ML_DATA_CHAT_H
#define ML_DATA_CHAT_H

#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "template/jinja.h"
#include "tokenizer/tokenizer.h"

typedef struct ml_chat ml_chat; /* a model's chat template(s) and render context */

/* The chat template of model directory `dir` (above) into *out (free with
 * ml_chat_free). Errors: no template anywhere (one message naming dir and
 * the files looked in), a tool_use.jinja without chat_template.jinja, a file unreadable or invalid JSON, "chat_template"
 * of another type or a list without "default", the template's parse error
 * (template/jinja.h: origin, line, column, the construct). */
int ml_chat_load(const char *dir, ml_chat **out);
void ml_chat_free(ml_chat *c);

/* A rendered conversation: text[0, len) (NUL-terminated) and the byte
 * spans of its targets, in order, not overlapping. */
typedef struct ml_chat_text {
  char *text;
  size_t len;
  ml_jinja_span *spans;
  size_t nspans;
} ml_chat_text;

/* Render record `rec` (a JSON object with "messages" and optionally
 * "tools") into *out (zeroed on entry; free with ml_chat_text_free).
 * `where` ("FILE:LINE") starts every message. Errors: "messages" missing,
 * not an array or empty; a message not an object, without a string
 * "role", or whose "content" is neither a string nor a list of
 * {"type": "text", "text": string} parts (missing content is allowed on a
 * message with "tool_calls") — each naming the field, e.g.
 * 'messages'[2].content; "tools" not a list of objects; the template's
 * render error (raise_exception's message); a template breaking the prefix
 * property (above), naming the assistant message's index. */
int ml_chat_render(const ml_chat *c, const char *where, const json_t *rec, ml_chat_text *out);
void ml_chat_text_free(ml_chat_text *t);

/* The tokens of a rendered conversation and which are targets: ids
 * (appended to `ids`, n of them) = encode(text, add_special = false), as
 * apply_chat_template(tokenize=True) encodes the rendered chat (the
 * template writes its special tokens itself); target[t] (malloc'd, n
 * entries; free it) = 1 when token t overlaps a span of the text, as
 * return_assistant_tokens_mask maps spans through char_to_token (the
 * token holding a span's first byte through the one holding its last).
 * A boundary's token is found by encoding the text before it: when that
 * encoding is a prefix of the whole one, its length (the boundary falls
 * between two tokens: chat templates put one after a role header's
 * newline or special token); otherwise the first token where they differ
 * straddles the boundary, unless the pre-tokenizer cut the text before it
 * otherwise (a whitespace run ending at it): the whole encoding's tokens
 * that decode to text ending at or before the boundary are counted before
 * it (where decoding reproduces the text, as for byte-level tokenizers).
 * `scratch` is work space. Errors: the tokenizer's (text not UTF-8),
 * allocation. */
int ml_chat_tokens(const ml_tokenizer *tok, const ml_chat_text *t, ml_tokens *ids,
                   ml_tokens *scratch, uint8_t **target);

#endif

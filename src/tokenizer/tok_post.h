/* Post-processors of tokenizer.json (tokenizers/src/processors/), for
 * single sequences: TemplateProcessing (template.rs: the `single` template,
 * special tokens before and after $A, each possibly several ids), ByteLevel
 * (byte_level.rs: offsets only, the ids unchanged), Sequence of these
 * (sequence.rs) with at most one template. Refused: other types, a single
 * template with $B or without exactly one $A, a template naming a special
 * token its special_tokens do not define, ids outside [0, 2 · tokens + 256)
 * (tok_id). */
#ifndef ML_TOK_POST_H
#define ML_TOK_POST_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct tok_post {
  int32_t *pre, *post; /* ids before and after the sequence under add_special */
  size_t n_pre, n_post, pre_cap, post_cap;
} tok_post;

/* Read tokenizer.json's "post_processor" (`j`: NULL or null for none) of a
 * tokenizer of `tokens` distinct tokens (the model's and the added ones). */
int tok_post_load(tok_post *p, const json_t *j, size_t tokens, const char *file);
void tok_post_free(tok_post *p);

#endif

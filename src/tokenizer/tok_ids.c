/* Ids back to text: tokenizers' Tokenizer::decode (tokenizers/src/tokenizer/mod.rs). */
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "tokenizer/tok_impl.h"

const char *ml_tokenizer_id_to_token(const ml_tokenizer *t, int32_t id, size_t *len) {
  const tok_added_token *a = tok_added_by_id(&t->added, id);
  if (a && a->normed) {
    *len = a->normed_len;
    return a->normed;
  }
  if (a) {
    *len = a->len;
    return a->content;
  }
  return tok_bpe_token(&t->bpe, id, len);
}

/* Whether token text s is the content of a special added token. */
static bool special(const ml_tokenizer *t, const char *s, size_t len) {
  for (size_t i = 0; i < t->added.n; i++) {
    const tok_added_token *a = &t->added.tok[i];
    if (a->special && a->len == len && memcmp(a->content, s, len) == 0) return true;
  }
  return false;
}

int ml_tokenizer_decode(const ml_tokenizer *t, const int32_t *ids, size_t n, bool skip_special,
                        char **out, size_t *len) {
  *out = NULL;
  *len = 0;
  tok_strs tokens = {0};
  tok_buf text = {0};
  int rc = 0;
  for (size_t i = 0; i < n && rc == 0; i++) {
    size_t tl;
    const char *s = ml_tokenizer_id_to_token(t, ids[i], &tl);
    if (!s || (skip_special && special(t, s, tl))) continue; /* as tokenizers: dropped */
    rc = tok_strs_push(&tokens, s, tl);
  }
  if (rc == 0) rc = tok_decoder_run(&t->decoder, &tokens, &text);
  if (rc == 0) rc = tok_buf_put(&text, "", 1); /* NUL-terminated */
  tok_strs_free(&tokens);
  if (rc) {
    tok_buf_free(&text);
    return -1;
  }
  *out = text.p;
  *len = text.n - 1;
  return 0;
}

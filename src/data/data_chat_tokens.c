/* ml_chat_tokens (data/data_chat.h): a rendered conversation's ids, and
 * its target spans mapped onto them as transformers' char_to_token does. */
#include <stdlib.h>
#include <string.h>

#include "common/checked.h"
#include "common/status.h"
#include "data/data_chat.h"

/* Tokens of whole[0, n) before byte p of the text: *lcp = how many lead
 * the encoding of text[0, p) and whole alike, *exact = whether that
 * encoding is all of them (p falls between two tokens). */
static int boundary(const ml_tokenizer *tok, const ml_chat_text *t, size_t p, const int32_t *whole,
                    size_t n, ml_tokens *scratch, size_t *lcp, bool *exact) {
  scratch->n = 0;
  ML_TRY(ml_tokenizer_encode(tok, t->text, p, false, scratch));
  size_t k = 0;
  while (k < n && k < scratch->n && scratch->ids[k] == whole[k]) k++;
  *lcp = k;
  *exact = k == scratch->n;
  return 0;
}

int ml_chat_tokens(const ml_tokenizer *tok, const ml_chat_text *t, ml_tokens *ids,
                   ml_tokens *scratch, uint8_t **target) {
  *target = NULL;
  size_t n0 = ids->n;
  ML_TRY(ml_tokenizer_encode(tok, t->text, t->len, false, ids));
  const int32_t *whole = ids->ids + n0;
  size_t n = ids->n - n0;
  uint8_t *tg = ml_calloc_array((int64_t)n, 1, "the targets of a conversation of %zu tokens", n);
  if (!tg) return -1;
  for (size_t s = 0; s < t->nspans; s++) {
    size_t begin, end;
    bool exact;
    if (boundary(tok, t, t->spans[s].begin, whole, n, scratch, &begin, &exact) ||
        boundary(tok, t, t->spans[s].end, whole, n, scratch, &end, &exact)) {
      free(tg);
      return -1;
    }
    if (!exact && end < n) end++; /* the token straddling the span's end */
    for (size_t k = begin; k < end; k++) tg[k] = 1;
  }
  *target = tg;
  return 0;
}

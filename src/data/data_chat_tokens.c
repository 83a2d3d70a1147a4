/* ml_chat_tokens (data/data_chat.h): a rendered conversation's ids, and
 * its target spans mapped onto them as transformers' char_to_token does. */
#include <stdlib.h>
#include <string.h>

#include "common/checked.h"
#include "common/status.h"
#include "data/data_chat.h"

/* Where byte p of the text falls among the whole encoding's n tokens. */
typedef struct place {
  size_t before; /* tokens lying wholly in text[0, p) */
  bool between;  /* they end at p: no token straddles p */
} place;

/* Whether the first k tokens decode to text[0, len) for some len <= p
 * (*len set): their text known exactly, as for byte-level tokenizers. */
static int decoded_within(const ml_tokenizer *tok, const ml_chat_text *t, const int32_t *whole,
                          size_t k, size_t p, bool *within, size_t *len) {
  char *s;
  ML_TRY(ml_tokenizer_decode(tok, whole, k, false, &s, len));
  *within = *len <= p && memcmp(s, t->text, *len) == 0;
  free(s);
  return 0;
}

/* The place of byte p: the text before p encoded; when that encoding
 * starts the whole one, p falls between tokens. Otherwise the encodings
 * part at the token straddling p — or earlier, where the pre-tokenizer
 * cut text[0, p) otherwise (a whitespace run ending at p): the tokens
 * after the parting point whose decoded text still ends at or before p
 * are counted in too, when decoding reproduces the text. */
static int place_of(const ml_tokenizer *tok, const ml_chat_text *t, size_t p,
                    const int32_t *whole, size_t n, ml_tokens *scratch, place *out) {
  scratch->n = 0;
  ML_TRY(ml_tokenizer_encode(tok, t->text, p, false, scratch));
  size_t k = 0;
  while (k < n && k < scratch->n && scratch->ids[k] == whole[k]) k++;
  if (k == scratch->n) {
    *out = (place){k, true};
    return 0;
  }
  bool within = true, between = false;
  size_t len;
  while (within && k < n) {
    ML_TRY(decoded_within(tok, t, whole, k + 1, p, &within, &len));
    if (within) {
      k++;
      between = len == p;
    }
  }
  *out = (place){k, between};
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
    place b, e;
    if (place_of(tok, t, t->spans[s].begin, whole, n, scratch, &b) ||
        place_of(tok, t, t->spans[s].end, whole, n, scratch, &e)) {
      free(tg);
      return -1;
    }
    /* from the token holding the span's first byte to the one holding its last */
    size_t end = e.before + (e.between ? 0 : 1);
    for (size_t k = b.before; k < end && k < n; k++) tg[k] = 1;
  }
  *target = tg;
  return 0;
}

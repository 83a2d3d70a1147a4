/* Small pieces the tokenizer files share: growable arrays, UTF-8 scanning,
 * and the message for a JSON field that holds what meshlm does not honour.
 * Internal to src/tokenizer. */
#ifndef ML_TOK_UTIL_H
#define ML_TOK_UTIL_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Make room for `need` elements of `elem` bytes in *p (capacity *cap, in
 * elements), growing geometrically with realloc. Returns 0, or -1 with an
 * out-of-memory message naming `what` (also when need · elem overflows). */
int tok_reserve(void *p, size_t *cap, size_t need, size_t elem, const char *what);

/* A growable byte string (not NUL-terminated). */
typedef struct tok_buf {
  char *p;
  size_t n, cap;
} tok_buf;

int tok_buf_put(tok_buf *b, const char *s, size_t len);
void tok_buf_free(tok_buf *b);

/* Byte length of the UTF-8 sequence that starts with byte `c` (a lead
 * byte of validated text). */
static inline size_t tok_utf8_len(unsigned char c) {
  return c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
}

/* The code point at s (valid UTF-8, at least one char). */
uint32_t tok_utf8_decode(const char *s);

/* Write code point cp as UTF-8 to out (4 bytes room); returns its length. */
size_t tok_utf8_encode(uint32_t cp, char *out);

/* Whether s[0..len) is valid UTF-8 (RFC 3629: no overlongs, no surrogates,
 * at most U+10FFFF). When not, *bad is the byte offset of the first byte of
 * the first invalid sequence. */
bool tok_utf8_valid(const char *s, size_t len, size_t *bad);

/* Error for JSON field `field` of `file` holding `found` where `expected`
 * was wanted: "FILE: field 'FIELD': found FOUND, expected EXPECTED".
 * Returns -1. */
int tok_bad(const char *file, const char *field, const json_t *found, const char *expected);

/* The components of a Sequence (normalizer, pre-tokenizer, post-processor,
 * decoder): fn(ctx, element, "FIELD.KEY[i]", file) for each element of the
 * array j[key], in order, stopping at the first error. Not an array:
 * tok_bad naming FIELD.KEY, expecting `what`. */
typedef int (*tok_item_fn)(void *ctx, const json_t *item, const char *field, const char *file);
int tok_each_item(const json_t *j, const char *key, const char *field, const char *file,
                  const char *what, tok_item_fn fn, void *ctx);

/* A string field: *out points into the JSON (jansson keeps the length: the
 * string may hold NUL). Missing or not a string: tok_bad. */
int tok_str(const char *file, const json_t *obj, const char *field, const char *key,
            const char **out, size_t *len);

/* Id `v` (field `field` of `file`) of a tokenizer of `tokens` tokens into
 * *out: an integer in [0, 2 · tokens + 256) (and in [0, 2^31)), else
 * tok_bad naming the bound. An id indexes dense tables (the vocabulary by
 * id, tok_bpe) and makes the vocabulary's size (ml_tokenizer_vocab_size),
 * so an id far beyond the number of tokens would cost memory and time out
 * of all proportion to the file (one id of 2·10^9 in a 2 MB file: an 8 GB
 * table). `tokenizers` writes dense vocabularies (ids 0 .. n−1, added
 * tokens after them); the bound leaves room for as many holes as tokens,
 * plus 256 for small hand-made vocabularies. */
int tok_id(const char *file, const char *field, const json_t *v, size_t tokens, int32_t *out);

/* A boolean field; `dflt` when missing or null. */
int tok_bool(const char *file, const json_t *obj, const char *field, const char *key, bool dflt,
             bool *out);

#endif

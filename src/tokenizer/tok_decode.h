/* Decoders of tokenizer.json (tokenizers/src/decoders/), for
 * ml_tokenizer_decode: ByteLevel (byte_level.rs: token chars back to
 * bytes, invalid UTF-8 replaced by U+FFFD as Rust's from_utf8_lossy),
 * Replace (a string pattern), ByteFallback (byte_fallback.rs: <0xNN> runs
 * to bytes, one U+FFFD per byte of a run that is not UTF-8), Fuse, Strip
 * (strip.rs), Sequence of these. Other types are refused at load. */
#ifndef ML_TOK_DECODE_H
#define ML_TOK_DECODE_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "tokenizer/tok_util.h"

typedef enum {
  TOK_DEC_BYTELEVEL,
  TOK_DEC_REPLACE,
  TOK_DEC_BYTEFALLBACK,
  TOK_DEC_FUSE,
  TOK_DEC_STRIP
} tok_dec_kind;

typedef struct tok_dec_step {
  tok_dec_kind kind;
  const char *pattern, *content; /* Replace; Strip: content (one char) */
  size_t pattern_len, content_len;
  size_t start, stop; /* Strip */
} tok_dec_step;

typedef struct tok_decoder {
  tok_dec_step *steps;
  size_t n, cap;
  bool present; /* false: tokens are joined with " " */
} tok_decoder;

/* A list of strings: string i is buf[off[i] .. off[i + 1]). Once a string
 * is pushed (an empty one too) buf.p is not NULL, so buf.p + off[i] is
 * defined for every i < n. */
typedef struct tok_strs {
  tok_buf buf;
  size_t *off;
  size_t n, cap; /* strings; off has n + 1 entries */
} tok_strs;

int tok_strs_push(tok_strs *l, const char *s, size_t len);
void tok_strs_free(tok_strs *l);

int tok_decoder_load(tok_decoder *d, const json_t *j, const char *file);
void tok_decoder_free(tok_decoder *d);

/* Run the decoder chain on `tokens` and join the result into *out. */
int tok_decoder_run(const tok_decoder *d, tok_strs *tokens, tok_buf *out);

#endif

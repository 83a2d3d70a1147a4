/* The tokenizer's parts (internal to src/tokenizer): what ml_tokenizer_load
 * reads from tokenizer.json, in the order encoding uses them (tokenizers'
 * TokenizerImpl::encode_single_sequence and post_process). */
#ifndef ML_TOK_IMPL_H
#define ML_TOK_IMPL_H

#include "tokenizer/tok_added.h"
#include "tokenizer/tok_bpe.h"
#include "tokenizer/tok_decode.h"
#include "tokenizer/tok_norm.h"
#include "tokenizer/tok_post.h"
#include "tokenizer/tok_pretok.h"
#include "tokenizer/tokenizer.h"

struct ml_tokenizer {
  json_t *doc;         /* tokenizer.json; the parts point into it */
  tok_added added;     /* split out first */
  tok_normalizer norm; /* then each piece between them normalized */
  tok_pretok pretok;   /* then cut into pre-tokens */
  tok_bpe bpe;         /* each pre-token encoded */
  tok_post post;       /* special tokens around the sequence */
  tok_decoder decoder; /* ids → text (ml_tokenizer_decode) */
  int32_t bos, eos;    /* −1: none */
  int64_t vocab_size;
};

#endif

/* Hugging Face tokenizer.json in C: text → token ids, exactly as the
 * `tokenizers` library's Tokenizer.encode(text, add_special_tokens=...)
 * (tokenizers/src/tokenizer/mod.rs: added tokens, normalizer,
 * pre-tokenizer, model, post-processor, in that order).
 *
 * Supported (anything else is refused at load with a message naming the
 * file, the JSON field, what was found and what was expected, never
 * silently different ids):
 * - model BPE (models/bpe/model.rs, word.rs), byte-level (GPT-2 / Llama 3 /
 *   Qwen2 / Qwen3 / SmolLM2): the ByteLevel pre-tokenizer (GPT-2 byte ↔
 *   unicode map, its regex when use_regex, add_prefix_space) last, after
 *   Split regexes (PCRE2, UTF + UCP, JIT, matching as Oniguruma:
 *   tok_regex.h); merges as "a b" strings or [a, b] pairs; ignore_merges;
 *   unk_token; dropout null (or 0); continuing_subword_prefix and
 *   end_of_word_suffix null or "";
 * - model BPE, SentencePiece style (Gemma 3): Replace(" " → "▁") / Prepend
 *   normalizers, no pre-tokenizer or a Split on " ", byte_fallback to
 *   <0xNN> tokens, fuse_unk;
 * - added tokens (special or not) split out of the text first, leftmost-
 *   longest, honouring `normalized`, `lstrip`, `rstrip`, `single_word`
 *   (tokenizer/added_vocabulary.rs; ids as tokenizers assigns them);
 * - normalizers NFC (utf8proc), Replace, Prepend, Sequence;
 * - pre-tokenizers Split (every behaviour, invert), ByteLevel, Digits,
 *   Sequence;
 * - post-processors TemplateProcessing (single sequence), ByteLevel
 *   (offsets only: ids unchanged), Sequence of those;
 * - decoders (for ml_tokenizer_decode) ByteLevel, Replace, ByteFallback,
 *   Fuse, Strip, Sequence.
 * Refused as well: non-null truncation or padding, a version other than
 * "1.0". tokenizer_config.json and special_tokens_map.json, where present,
 * name the BOS/EOS tokens (bos_token / eos_token, a string or {"content":
 * ...}, or null for none; special_tokens_map.json first, as transformers
 * reads them).
 * The one known gap: Unicode property tables (PCRE2's, utf8proc's) of
 * another Unicode version than tokenizers' may class characters assigned
 * in between differently.
 *
 * A tokenizer is immutable after load: encode may run on several threads at
 * once (each thread keeps its own cache of BPE results, tok_cache.h). */
#ifndef ML_TOKENIZER_H
#define ML_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct ml_tokenizer ml_tokenizer;

/* A growable array of token ids; encode appends to it. Zero-initialise,
 * free with ml_tokens_free. */
typedef struct ml_tokens {
  int32_t *ids;
  size_t n, cap;
} ml_tokens;

void ml_tokens_free(ml_tokens *t);

/* Load `dir`/tokenizer.json (and, where present, tokenizer_config.json /
 * special_tokens_map.json for BOS/EOS). *out is set on success; free with
 * ml_tokenizer_free. Errors: file missing or unreadable, invalid JSON, an
 * unsupported model / normalizer / pre-tokenizer / post-processor /
 * decoder type (named, with its JSON path), a merge naming a token not in
 * the vocabulary, ids out of range. */
int ml_tokenizer_load(const char *dir, ml_tokenizer **out);
void ml_tokenizer_free(ml_tokenizer *t);

/* Encode `len` bytes of UTF-8 `text` and append the ids to `out`.
 * add_special: apply the post-processor's template (BOS/EOS), as
 * `tokenizers`' add_special_tokens=True. Errors: text not valid UTF-8
 * (byte offset named), allocation. */
int ml_tokenizer_encode(const ml_tokenizer *t, const char *text, size_t len, bool add_special,
                        ml_tokens *out);

/* Ids back to text, as `tokenizers`' Tokenizer.decode(ids,
 * skip_special_tokens): each id's token (an added token's content, its
 * normalized form for a normalized one, else the vocabulary's), ids
 * without one dropped, special added tokens dropped under skip_special,
 * then tokenizer.json's decoder (tok_decode.h; none: tokens joined with
 * " "). *out: malloc'd, NUL-terminated, *len bytes before the NUL; free()
 * it. Errors: allocation. */
int ml_tokenizer_decode(const ml_tokenizer *t, const int32_t *ids, size_t n, bool skip_special,
                        char **out, size_t *len);

/* The token string of `id` (*len bytes, not NUL-terminated, owned by t), as
 * decoding reads it; NULL when no token has that id. */
const char *ml_tokenizer_id_to_token(const ml_tokenizer *t, int32_t id, size_t *len);

/* Number of ids (the model vocabulary plus added tokens: max id + 1). */
int64_t ml_tokenizer_vocab_size(const ml_tokenizer *t);

/* BOS / EOS ids (tokenizer_config.json / special_tokens_map.json, else the
 * post-processor template's special tokens); −1 when the tokenizer has none. */
int32_t ml_tokenizer_bos(const ml_tokenizer *t);
int32_t ml_tokenizer_eos(const ml_tokenizer *t);

/* Whether encode(add_special = true) puts BOS first / EOS last (from the
 * post-processor's single template). */
bool ml_tokenizer_adds_bos(const ml_tokenizer *t);
bool ml_tokenizer_adds_eos(const ml_tokenizer *t);

#endif

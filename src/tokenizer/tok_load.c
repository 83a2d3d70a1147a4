/* ml_tokenizer_load: tokenizer.json (tokenizers/src/tokenizer/serialization.rs)
 * and the BOS / EOS names of tokenizer_config.json / special_tokens_map.json. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "tokenizer/tok_impl.h"
#include "tokenizer/tok_util.h"

/* Load dir/name; *doc NULL (and 0 returned) when the file does not exist
 * and `optional` (a config file: its numbers read as reals, since
 * transformers writes model_max_length as a 31-digit integer). */
static int load_json(const char *dir, const char *name, bool optional, char *path, size_t cap,
                     json_t **doc) {
  *doc = NULL;
  if ((size_t)snprintf(path, cap, "%s/%s", dir, name) >= cap)
    return ml_err("%s/%s: path too long", dir, name);
  FILE *f = fopen(path, "rb");
  if (!f) {
    if (optional && errno == ENOENT) return 0;
    return ml_err("%s: cannot open: %s", path, strerror(errno));
  }
  json_error_t e;
  *doc = json_loadf(
      f, JSON_REJECT_DUPLICATES | JSON_ALLOW_NUL | (optional ? JSON_DECODE_INT_AS_REAL : 0), &e);
  fclose(f);
  if (!*doc) return ml_err("%s:%d:%d: invalid JSON: %s", path, e.line, e.column, e.text);
  if (!json_is_object(*doc)) {
    json_decref(*doc);
    *doc = NULL;
    return ml_err("%s: expected a JSON object at the top level", path);
  }
  return 0;
}

/* The id of token text s: an added token's, else the model's; −1 if none. */
static int32_t token_id(const ml_tokenizer *t, const char *s, size_t len) {
  for (size_t i = 0; i < t->added.n; i++)
    if (t->added.tok[i].len == len && memcmp(t->added.tok[i].content, s, len) == 0)
      return t->added.tok[i].id;
  return tok_strmap_get(&t->bpe.vocab, s, len);
}

/* `key` (bos_token / eos_token) of a config file: a string or an AddedToken
 * object {"content": ...} sets *id; null sets −1 (no such token); a
 * missing key leaves *id to the next file. */
static int config_token(const ml_tokenizer *t, const json_t *doc, const char *path,
                        const char *key, int32_t *id, bool *set) {
  const json_t *v = json_object_get(doc, key);
  if (!v) return 0;
  *set = true;
  *id = -1;
  if (json_is_null(v)) return 0;
  if (json_is_object(v)) v = json_object_get(v, "content");
  if (!json_is_string(v))
    return tok_bad(path, key, json_object_get(doc, key), "a string, {\"content\": ...} or null");
  int32_t found = token_id(t, json_string_value(v), json_string_length(v));
  if (found < 0) return tok_bad(path, key, v, "a token of tokenizer.json's vocabulary");
  *id = found;
  return 0;
}

/* BOS / EOS: special_tokens_map.json over tokenizer_config.json (as
 * transformers' from_pretrained reads them: the first file with the key
 * decides, null included), else the template's first / last token. */
static int load_bos_eos(ml_tokenizer *t, const char *dir) {
  static const char *const files[] = {"special_tokens_map.json", "tokenizer_config.json"};
  bool bos_set = false, eos_set = false;
  t->bos = t->eos = -1;
  for (int f = 0; f < 2; f++) {
    char path[4096];
    json_t *doc;
    ML_TRY(load_json(dir, files[f], true, path, sizeof path, &doc));
    if (!doc) continue;
    int rc = 0;
    if (!bos_set) rc = config_token(t, doc, path, "bos_token", &t->bos, &bos_set);
    if (!rc && !eos_set) rc = config_token(t, doc, path, "eos_token", &t->eos, &eos_set);
    json_decref(doc);
    ML_TRY(rc);
  }
  if (!bos_set && t->post.n_pre) t->bos = t->post.pre[0];
  if (!eos_set && t->post.n_post) t->eos = t->post.post[t->post.n_post - 1];
  return 0;
}

/* Top-level fields that would change the ids and that meshlm does not apply. */
static int refuse_top(const json_t *doc, const char *path) {
  const json_t *v = json_object_get(doc, "version");
  if (v && !(json_is_string(v) && strcmp(json_string_value(v), "1.0") == 0))
    return tok_bad(path, "version", v, "\"1.0\"");
  static const char *const keys[] = {"truncation", "padding"};
  for (int i = 0; i < 2; i++) {
    v = json_object_get(doc, keys[i]);
    if (v && !json_is_null(v)) return tok_bad(path, keys[i], v, "null (meshlm does not apply it)");
  }
  return 0;
}

static int load(ml_tokenizer *t, const char *dir) {
  char path[4096];
  ML_TRY(load_json(dir, "tokenizer.json", false, path, sizeof path, &t->doc));
  const json_t *d = t->doc;
  ML_TRY(refuse_top(d, path));
  ML_TRY(tok_norm_load(&t->norm, json_object_get(d, "normalizer"), path));
  ML_TRY(tok_pretok_load(&t->pretok, json_object_get(d, "pre_tokenizer"), path));
  ML_TRY(tok_bpe_load(&t->bpe, json_object_get(d, "model"), path));
  if (t->pretok.byte_level) ML_TRY(tok_bpe_set_byte_level(&t->bpe));
  ML_TRY(tok_added_load(&t->added, json_object_get(d, "added_tokens"), &t->bpe, &t->norm, path));
  ML_TRY(tok_post_load(&t->post, json_object_get(d, "post_processor"),
                       t->bpe.vocab_len + t->added.n, path));
  ML_TRY(tok_decoder_load(&t->decoder, json_object_get(d, "decoder"), path));
  int32_t max = t->bpe.max_id > t->added.max_id ? t->bpe.max_id : t->added.max_id;
  for (size_t i = 0; i < t->post.n_pre; i++) max = t->post.pre[i] > max ? t->post.pre[i] : max;
  for (size_t i = 0; i < t->post.n_post; i++) max = t->post.post[i] > max ? t->post.post[i] : max;
  t->vocab_size = (int64_t)max + 1;
  return load_bos_eos(t, dir);
}

int ml_tokenizer_load(const char *dir, ml_tokenizer **out) {
  *out = NULL;
  ml_tokenizer *t = ml_calloc(1, sizeof *t, "the tokenizer");
  if (!t) return -1;
  if (load(t, dir)) {
    ml_tokenizer_free(t);
    return -1;
  }
  *out = t;
  return 0;
}

void ml_tokenizer_free(ml_tokenizer *t) {
  if (!t) return;
  tok_added_free(&t->added);
  tok_norm_free(&t->norm);
  tok_pretok_free(&t->pretok);
  tok_bpe_free(&t->bpe);
  tok_post_free(&t->post);
  tok_decoder_free(&t->decoder);
  json_decref(t->doc);
  free(t);
}

int64_t ml_tokenizer_vocab_size(const ml_tokenizer *t) { return t->vocab_size; }
int32_t ml_tokenizer_bos(const ml_tokenizer *t) { return t->bos; }
int32_t ml_tokenizer_eos(const ml_tokenizer *t) { return t->eos; }

bool ml_tokenizer_adds_bos(const ml_tokenizer *t) {
  return t->bos >= 0 && t->post.n_pre > 0 && t->post.pre[0] == t->bos;
}

bool ml_tokenizer_adds_eos(const ml_tokenizer *t) {
  return t->eos >= 0 && t->post.n_post > 0 && t->post.post[t->post.n_post - 1] == t->eos;
}

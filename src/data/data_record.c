#include "data/data_record.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "common/checked.h"
#include "common/status.h"
#include "io/json.h"
#include "data/data_chat.h"
#include "data/data_lines.h"

const char *ml_data_format_name(ml_data_format f) {
  switch (f) {
  case ML_DATA_IDS: return "input_ids";
  case ML_DATA_TEXT: return "text";
  case ML_DATA_PROMPT: return "prompt/completion";
  case ML_DATA_CHAT: return "messages";
  case ML_DATA_RAW: return "raw text, tokenized";
  case ML_DATA_RAW_BYTES: return "raw text, bytes as token ids";
  }
  return "?";
}

ml_data_opts ml_data_opts_default(const char *dir) {
  return (ml_data_opts){.tokenizer_dir = dir,
                        .text_key = "text",
                        .prompt_key = "prompt",
                        .completion_key = "completion",
                        .packing = true,
                        .assistant_only_loss = true};
}

ml_record_reader ml_record_reader_open(const char *path, const ml_data_opts *opts, int64_t vocab) {
  return (ml_record_reader){.path = path, .opts = opts, .vocab = vocab};
}

void ml_record_reader_close(ml_record_reader *r) {
  ml_tokenizer_free(r->tok);
  ml_chat_free(r->chat);
  ml_tokens_free(&r->scratch);
  ml_tokens_free(&r->scratch2);
  r->tok = NULL;
  r->chat = NULL;
}

void ml_record_free(ml_record *rec) {
  free(rec->ids);
  free(rec->target);
  memset(rec, 0, sizeof *rec);
}

/* Append k tokens ids[0, k), each with target `target` (k = 0: nothing;
 * ids may then be NULL). */
static int push(ml_record *rec, const int32_t *ids, int64_t k, uint8_t target) {
  if (k == 0) return 0;
  int64_t need = ml_add_sat(rec->n, k);
  if (need > rec->cap) {
    int64_t cap = rec->cap ? rec->cap : 256;
    while (cap < need) cap = ml_mul_sat(cap, 2);
    int32_t *ni = ml_malloc_array(cap, sizeof *ni, "a data record of %lld tokens", (long long)need);
    uint8_t *nt = ni ? ml_malloc_array(cap, 1, "a data record of %lld tokens", (long long)need)
                     : NULL;
    if (!nt) {
      free(ni);
      return -1;
    }
    if (rec->n) {
      memcpy(ni, rec->ids, (size_t)rec->n * sizeof *ni);
      memcpy(nt, rec->target, (size_t)rec->n);
    }
    free(rec->ids);
    free(rec->target);
    rec->ids = ni;
    rec->target = nt;
    rec->cap = cap;
  }
  memcpy(rec->ids + rec->n, ids, (size_t)k * sizeof *ids);
  memset(rec->target + rec->n, target, (size_t)k);
  rec->n += k;
  return 0;
}

int ml_record_append(ml_record *dst, const ml_record *src) {
  int64_t n0 = dst->n;
  ML_TRY(push(dst, src->ids, src->n, 1));
  if (src->n) memcpy(dst->target + n0, src->target, (size_t)src->n);
  return 0;
}

int ml_record_append_bytes(ml_record *dst, const unsigned char *bytes, size_t n) {
  for (size_t i = 0; i < n; i++) {
    int32_t id = bytes[i];
    ML_TRY(push(dst, &id, 1, 1));
  }
  return 0;
}

/* ---- the tokenizer ------------------------------------------------------- */

/* DIR/tokenizer.json into buf[cap]. Errors: the path does not fit. */
static int tokenizer_file(const ml_record_reader *r, char *buf, size_t cap) {
  if (snprintf(buf, cap, "%s/tokenizer.json", r->opts->tokenizer_dir) >= (int)cap)
    return ml_err("%s: the model directory's path is too long (%zu bytes at most)",
                  r->opts->tokenizer_dir, cap - sizeof "/tokenizer.json");
  return 0;
}

int ml_record_tokenizer_present(const ml_record_reader *r, bool *present) {
  char file[4096];
  ML_TRY(tokenizer_file(r, file, sizeof file));
  FILE *f = fopen(file, "rb");
  *present = f != NULL;
  if (f) fclose(f);
  if (!f && errno != ENOENT)
    return ml_err("%s: cannot open the tokenizer: %s", file, strerror(errno));
  return 0;
}

/* Replace the recorded message by "WHERE: message". Returns -1. */
static int wrap_error(const char *where) {
  char msg[ML_ERROR_MSG_CAP];
  snprintf(msg, sizeof msg, "%s", ml_error_msg());
  ml_error_clear();
  return ml_err("%s: %s", where, msg);
}

/* Load the tokenizer for the data at `where` ("FILE:LINE: field 'text'"). */
static int need_tokenizer(ml_record_reader *r, const char *where) {
  if (r->tok) return 0;
  bool present;
  ML_TRY(ml_record_tokenizer_present(r, &present));
  char file[4096];
  ML_TRY(tokenizer_file(r, file, sizeof file));
  if (!present)
    return ml_err("%s: tokenizing text needs the model's tokenizer, and %s does not exist; "
                  "expected the checkpoint's tokenizer.json in the --model directory (or "
                  "token ids in input_ids records)",
                  where, file);
  if (ml_tokenizer_load(r->opts->tokenizer_dir, &r->tok)) return wrap_error(where);
  return 0;
}

/* The scratch list's ids checked against the model's vocabulary. */
static int check_vocab(const ml_record_reader *r, const char *where) {
  for (size_t t = 0; t < r->scratch.n; t++) {
    int32_t id = r->scratch.ids[t];
    if (id < 0 || id >= r->vocab)
      return ml_err("%s: token %zu has id %d (from %s/tokenizer.json), outside the model's "
                    "vocabulary [0, %lld) (config.json vocab_size); expected a tokenizer "
                    "that fits the model",
                    where, t, id, r->opts->tokenizer_dir, (long long)r->vocab);
  }
  return 0;
}

/* Encode text[0, len) (add_special: the template's BOS/EOS) into the
 * scratch list; its ids checked against the model's vocabulary. */
static int encode(ml_record_reader *r, const char *where, const char *text, size_t len,
                  bool add_special) {
  r->scratch.n = 0;
  if (ml_tokenizer_encode(r->tok, text, len, add_special, &r->scratch)) return wrap_error(where);
  return check_vocab(r, where);
}

/* The tokenizer's EOS appended with `target`, when it has one. */
static int push_eos(ml_record_reader *r, const char *where, ml_record *rec, uint8_t target) {
  int32_t eos = ml_tokenizer_eos(r->tok);
  if (eos < 0) return 0;
  if (eos >= r->vocab)
    return ml_err("%s: the EOS token id %d (from %s) is outside the model's vocabulary "
                  "[0, %lld) (config.json vocab_size)",
                  where, eos, r->opts->tokenizer_dir, (long long)r->vocab);
  return push(rec, &eos, 1, target);
}

/* A text document: encode(text, add_special = true), then EOS unless the
 * template ends with it; every token a target. */
static int read_document(ml_record_reader *r, const char *where, const char *text, size_t len,
                         ml_record *rec) {
  ML_TRY(need_tokenizer(r, where));
  ML_TRY(encode(r, where, text, len, true));
  ML_TRY(push(rec, r->scratch.ids, (int64_t)r->scratch.n, 1));
  if (!ml_tokenizer_adds_eos(r->tok)) ML_TRY(push_eos(r, where, rec, 1));
  if (rec->n == 0) return ml_err("%s: the text tokenizes to no token; expected at least 1", where);
  return 0;
}

/* Prompt (template applied, its trailing EOS dropped; no target), then the
 * completion (no special tokens) and EOS (targets). */
static int read_prompt(ml_record_reader *r, const char *where, const char *prompt, size_t plen,
                       const char *completion, size_t clen, ml_record *rec) {
  ML_TRY(need_tokenizer(r, where));
  ML_TRY(encode(r, where, prompt, plen, true));
  if (ml_tokenizer_adds_eos(r->tok) && r->scratch.n > 0) r->scratch.n--;
  ML_TRY(push(rec, r->scratch.ids, (int64_t)r->scratch.n, 0));
  rec->prompt_len = rec->n;
  ML_TRY(encode(r, where, completion, clen, false));
  ML_TRY(push(rec, r->scratch.ids, (int64_t)r->scratch.n, 1));
  ML_TRY(push_eos(r, where, rec, 1));
  if (rec->n == 0)
    return ml_err("%s: the prompt and completion tokenize to no token; expected at least 1",
                  where);
  return 0;
}

/* A conversation (data/data_chat.h): its rendering's tokens; targets the
 * assistant turns' (every token without opts->assistant_only_loss).
 * `line` is "FILE:LINE". */
static int read_chat(ml_record_reader *r, const char *line, const json_t *obj, ml_record *rec) {
  char where[1100];
  snprintf(where, sizeof where, "%s: field 'messages'", line);
  ML_TRY(need_tokenizer(r, where));
  if (!r->chat && ml_chat_load(r->opts->tokenizer_dir, &r->chat)) return wrap_error(where);
  ml_chat_text text;
  ML_TRY(ml_chat_render(r->chat, line, obj, &text));
  uint8_t *target = NULL;
  r->scratch.n = 0;
  int rc = ml_chat_tokens(r->tok, &text, &r->scratch, &r->scratch2, &target);
  if (rc != 0) rc = wrap_error(where);
  if (rc == 0) rc = check_vocab(r, where);
  if (rc == 0 && r->scratch.n == 0)
    rc = ml_err("%s: the conversation renders to no token; expected at least 1", where);
  if (rc == 0) rc = push(rec, r->scratch.ids, (int64_t)r->scratch.n, 1);
  if (rc == 0 && r->opts->assistant_only_loss) memcpy(rec->target, target, r->scratch.n);
  free(target);
  ml_chat_text_free(&text);
  return rc;
}

/* ---- fields -------------------------------------------------------------- */

/* The string field `key` of `obj` (n bytes), or NULL with a message naming
 * the line, the field and what was found. `missing` completes the message
 * when the field is absent. */
static const char *get_string(const ml_record_reader *r, int64_t lineno, const json_t *obj,
                              const char *key, const char *missing, size_t *n) {
  const json_t *v = json_object_get(obj, key);
  if (v && json_is_string(v)) {
    *n = json_string_length(v);
    return json_string_value(v);
  }
  char found[80];
  ml_json_brief(v, found, sizeof found);
  ml_err("%s:%lld: field '%s': expected a string%s, found %s", r->path, (long long)lineno, key,
         v ? "" : missing, v ? found : "the field missing");
  return NULL;
}

static int mask_value(const ml_record_reader *r, int64_t lineno, size_t i, const json_t *v,
                      uint8_t *out) {
  if (json_is_boolean(v)) {
    *out = json_is_true(v);
    return 0;
  }
  if (json_is_integer(v) && (json_integer_value(v) == 0 || json_integer_value(v) == 1)) {
    *out = (uint8_t)json_integer_value(v);
    return 0;
  }
  return ml_err("%s:%lld: field 'loss_mask'[%zu]: expected 0, 1, true or false", r->path,
                (long long)lineno, i);
}

/* "input_ids" (validated ids in [0, vocab), at least one) and the optional
 * "loss_mask" (0/1/bools, input_ids' length) as targets. */
static int read_ids(const ml_record_reader *r, int64_t lineno, const json_t *obj,
                    ml_record *rec) {
  const char *path = r->path;
  const json_t *arr = json_object_get(obj, "input_ids");
  if (!json_is_array(arr))
    return ml_err("%s:%lld: field 'input_ids': expected an array of token ids, found a value "
                  "that is not an array",
                  path, (long long)lineno);
  if (json_array_size(arr) == 0)
    return ml_err("%s:%lld: field 'input_ids': expected at least 1 token, found 0", path,
                  (long long)lineno);
  size_t i;
  const json_t *v;
  json_array_foreach(arr, i, v) {
    if (!json_is_integer(v))
      return ml_err("%s:%lld: field 'input_ids'[%zu]: expected an integer token id, found a "
                    "non-integer",
                    path, (long long)lineno, i);
    json_int_t id = json_integer_value(v);
    if (id < 0 || id >= r->vocab)
      return ml_err("%s:%lld: field 'input_ids'[%zu] = %lld: expected a token id in [0, %lld) "
                    "(vocab_size)",
                    path, (long long)lineno, i, (long long)id, (long long)r->vocab);
    int32_t id32 = (int32_t)id;
    ML_TRY(push(rec, &id32, 1, 1));
  }
  const json_t *lmask = json_object_get(obj, "loss_mask");
  if (!lmask || r->scoring) return 0;
  if (!json_is_array(lmask))
    return ml_err("%s:%lld: field 'loss_mask': expected an array of 0/1 or bools", path,
                  (long long)lineno);
  if (json_array_size(lmask) != json_array_size(arr))
    return ml_err("%s:%lld: field 'loss_mask': length %zu, expected %zu (the length of input_ids)",
                  path, (long long)lineno, json_array_size(lmask), json_array_size(arr));
  json_array_foreach(lmask, i, v) ML_TRY(mask_value(r, lineno, i, v, &rec->target[i]));
  return 0;
}

/* The format the fields of `obj` select (data/data.h); false for none. */
static bool select_format(const ml_record_reader *r, const json_t *obj, ml_data_format *f) {
  const ml_data_opts *o = r->opts;
  if (json_object_get(obj, "input_ids"))
    *f = ML_DATA_IDS;
  else if (json_object_get(obj, o->text_key))
    *f = ML_DATA_TEXT;
  else if (json_object_get(obj, o->prompt_key) || json_object_get(obj, o->completion_key))
    *f = ML_DATA_PROMPT;
  else if (json_object_get(obj, "messages"))
    *f = ML_DATA_CHAT;
  else
    return false;
  return true;
}

bool ml_record_peek_format(const ml_record_reader *r, const char *s, size_t n,
                           ml_data_format *f) {
  json_t *obj = json_loadb(s, n, JSON_REJECT_DUPLICATES, NULL);
  bool found = json_is_object(obj) && select_format(r, obj, f);
  json_decref(obj);
  return found;
}

void ml_record_reader_expect(ml_record_reader *r, ml_data_format f, int64_t first_line) {
  r->has_format = true;
  r->format = f;
  r->first_line = first_line;
}

/* The format the fields of `obj` select, or an error naming the fields. */
static int record_format(const ml_record_reader *r, int64_t lineno, const json_t *obj,
                         ml_data_format *f) {
  const ml_data_opts *o = r->opts;
  if (!select_format(r, obj, f))
    return ml_err("%s:%lld: no data field: expected field 'input_ids' (token ids), '%s' (text, "
                  "--text-key), '%s' + '%s' (--prompt-key, --completion-key) or 'messages' "
                  "(a conversation), found the fields missing",
                  r->path, (long long)lineno, o->text_key, o->prompt_key, o->completion_key);
  return 0;
}

const char *ml_record_fields(const ml_record_reader *r, char *buf, size_t cap) {
  const ml_data_opts *o = r->opts;
  if (r->format == ML_DATA_TEXT)
    snprintf(buf, cap, "'%s'", o->text_key);
  else if (r->format == ML_DATA_PROMPT)
    snprintf(buf, cap, "'%s' + '%s'", o->prompt_key, o->completion_key);
  else if (r->format == ML_DATA_CHAT)
    snprintf(buf, cap, "'messages'");
  else
    snprintf(buf, cap, "'input_ids'");
  return buf;
}

/* One format per file: the first record's. */
static int check_format(ml_record_reader *r, int64_t lineno, ml_data_format f) {
  if (!r->has_format) {
    r->has_format = true;
    r->format = f;
    r->first_line = lineno;
    return 0;
  }
  if (f == r->format) return 0;
  char first[160];
  ml_record_fields(r, first, sizeof first);
  return ml_err("%s:%lld: a record in the %s format, but line %lld's is in the %s format; "
                "expected every record of a file in one format (the first record's, field %s)",
                r->path, (long long)lineno, ml_data_format_name(f), (long long)r->first_line,
                ml_data_format_name(r->format), first);
}

static int read_fields(ml_record_reader *r, int64_t lineno, const json_t *obj, ml_record *rec) {
  ml_data_format f = ML_DATA_IDS;
  ML_TRY(record_format(r, lineno, obj, &f));
  ML_TRY(check_format(r, lineno, f));
  const ml_data_opts *o = r->opts;
  char where[1024], missing[256];
  if (f == ML_DATA_IDS) return read_ids(r, lineno, obj, rec);
  if (f == ML_DATA_CHAT) {
    snprintf(where, sizeof where, "%s:%lld", r->path, (long long)lineno);
    return read_chat(r, where, obj, rec);
  }
  if (f == ML_DATA_TEXT) {
    size_t n;
    const char *text = get_string(r, lineno, obj, o->text_key, "", &n);
    snprintf(where, sizeof where, "%s:%lld: field '%s'", r->path, (long long)lineno, o->text_key);
    return text ? read_document(r, where, text, n, rec) : -1;
  }
  size_t pn, cn;
  snprintf(missing, sizeof missing, " (the completion of field '%s')", o->prompt_key);
  const char *c = get_string(r, lineno, obj, o->completion_key, missing, &cn);
  snprintf(missing, sizeof missing, " (the prompt of field '%s')", o->completion_key);
  const char *p = c ? get_string(r, lineno, obj, o->prompt_key, missing, &pn) : NULL;
  snprintf(where, sizeof where, "%s:%lld: fields '%s' + '%s'", r->path, (long long)lineno,
           o->prompt_key, o->completion_key);
  return p ? read_prompt(r, where, p, pn, c, cn, rec) : -1;
}

int ml_record_read_line(ml_record_reader *r, int64_t lineno, const char *s, size_t n,
                        ml_record *rec) {
  rec->n = 0;
  rec->prompt_len = 0;
  json_t *obj = ml_data_parse_line(r->path, lineno, s, n);
  if (!obj) return -1;
  int rc = read_fields(r, lineno, obj, rec);
  json_decref(obj);
  return rc;
}

int ml_record_read_raw(ml_record_reader *r, const char *text, size_t len, ml_record *rec) {
  rec->n = 0;
  rec->prompt_len = 0;
  char where[1024];
  snprintf(where, sizeof where, "%s: raw text", r->path);
  return read_document(r, where, text, len, rec);
}

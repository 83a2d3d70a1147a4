/* meshlm tokenize: JSONL text or messages records → JSONL token ids with
 * the model's tokenizer.json (src/tokenizer), the ids of HF `tokenizers`'
 * encode. Each input line's object becomes one output line:
 * {"input_ids": [...]} then the record's other fields, the text field left
 * out. A record without the text field but with "messages" (a
 * conversation, data/data_chat.h) is rendered with the model's chat
 * template and encoded without special tokens, as transformers'
 * apply_chat_template(tokenize=True), and its line also gets
 * "loss_mask": [...] (1 on the assistant turns' tokens, as train takes
 * them), its "messages" and "tools" fields left out: the output trains as
 * the conversation does. Blank lines are skipped, as the data loader skips
 * them. The output appears only when complete (temp file + rename). One
 * process does the work: under mpirun rank 0 tokenizes and the others wait
 * for its result. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "common/file.h"
#include "common/status.h"
#include "data/data_chat.h"
#include "tokenizer/tokenizer.h"

typedef struct tok_job {
  const char *in, *out, *key, *model;
  bool add_special;
  ml_chat *chat;      /* the chat template, loaded for the first messages record */
  ml_tokens scratch;  /* a conversation's boundary encodings */
  int64_t records, tokens, text_bytes;
  double seconds; /* spent encoding */
} tok_job;

static bool blank(const char *s, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (s[i] != ' ' && s[i] != '\t' && s[i] != '\r' && s[i] != '\n') return false;
  return true;
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Replace the recorded message (the encoder's, the template's) by
 * "IN:LN: field 'FIELD': message", placing it in the file. Returns -1. */
static int place_error(const tok_job *j, int64_t ln, const char *field) {
  char msg[ML_ERROR_MSG_CAP];
  snprintf(msg, sizeof msg, "%s", ml_error_msg());
  ml_error_clear();
  return ml_err("%s:%lld: field '%s': %s", j->in, (long long)ln, field, msg);
}

/* Record `rec` of line `ln`, a conversation, into ids and *mask (n
 * entries, malloc'd); *bytes: its rendered text's. */
static int encode_chat(tok_job *j, const ml_tokenizer *t, const json_t *rec, int64_t ln,
                       ml_tokens *ids, uint8_t **mask, size_t *bytes) {
  char where[4200];
  snprintf(where, sizeof where, "%s:%lld", j->in, (long long)ln);
  if (!j->chat && ml_chat_load(j->model, &j->chat)) return place_error(j, ln, "messages");
  ml_chat_text text;
  ML_TRY(ml_chat_render(j->chat, where, rec, &text));
  int rc = ml_chat_tokens(t, &text, ids, &j->scratch, mask);
  if (rc != 0) rc = place_error(j, ln, "messages");
  *bytes = text.len;
  ml_chat_text_free(&text);
  return rc;
}

/* Record `rec` of line `ln` into ids (a text record) or ids and *mask (a
 * conversation); *bytes: the text encoded. */
static int encode(tok_job *j, const ml_tokenizer *t, const json_t *rec, int64_t ln,
                  ml_tokens *ids, uint8_t **mask, size_t *bytes) {
  const json_t *text = json_object_get(rec, j->key);
  *mask = NULL;
  if (!json_is_object(rec))
    return ml_err("%s:%lld: expected a JSON object, found another value", j->in, (long long)ln);
  if (json_object_get(rec, "input_ids"))
    return ml_err("%s:%lld: field 'input_ids': already present, expected text only", j->in,
                  (long long)ln);
  if (!text && json_object_get(rec, "messages"))
    return encode_chat(j, t, rec, ln, ids, mask, bytes);
  if (!text)
    return ml_err("%s:%lld: field '%s': missing, expected a string (--text-key) or a field "
                  "'messages' (a conversation)",
                  j->in, (long long)ln, j->key);
  if (!json_is_string(text))
    return ml_err("%s:%lld: field '%s': expected a string", j->in, (long long)ln, j->key);
  *bytes = json_string_length(text);
  if (ml_tokenizer_encode(t, json_string_value(text), json_string_length(text), j->add_special,
                          ids))
    return place_error(j, ln, j->key);
  return 0;
}

/* A JSON array of ids[0, n) (mask NULL) or of mask[0, n). */
static json_t *array_of(const ml_tokens *ids, const uint8_t *mask) {
  json_t *arr = json_array();
  for (size_t i = 0; arr && i < ids->n; i++) {
    if (json_array_append_new(arr, json_integer(mask ? mask[i] : ids->ids[i]))) {
      json_decref(arr);
      return NULL;
    }
  }
  return arr;
}

/* One input line (line number `ln`) → its output object in *res. */
static int convert(tok_job *j, const ml_tokenizer *t, const char *line, size_t n, int64_t ln,
                   ml_tokens *ids, json_t **res) {
  *res = NULL;
  json_error_t e;
  json_t *rec = json_loadb(line, n, JSON_REJECT_DUPLICATES | JSON_ALLOW_NUL, &e);
  if (!rec) return ml_err("%s:%lld:%d: invalid JSON: %s", j->in, (long long)ln, e.column, e.text);
  ids->n = 0;
  uint8_t *mask = NULL;
  size_t bytes = 0;
  double t0 = now();
  int rc = encode(j, t, rec, ln, ids, &mask, &bytes);
  j->seconds += now() - t0;
  json_t *obj = rc == 0 ? json_object() : NULL;
  if (rc == 0 && (!obj || json_object_set_new(obj, "input_ids", array_of(ids, NULL)) ||
                  (mask && json_object_set_new(obj, "loss_mask", array_of(ids, mask)))))
    rc = ml_err("out of memory writing line %lld", (long long)ln);
  const char *k;
  json_t *v;
  json_object_foreach(rec, k, v) {
    bool used = mask ? strcmp(k, "messages") == 0 || strcmp(k, "tools") == 0
                     : strcmp(k, j->key) == 0;
    if (rc == 0 && !used && json_object_set(obj, k, v))
      rc = ml_err("out of memory writing line %lld", (long long)ln);
  }
  if (rc == 0) {
    j->records++;
    j->tokens += (int64_t)ids->n;
    j->text_bytes += (int64_t)bytes;
  }
  free(mask);
  json_decref(rec);
  if (rc) json_decref(obj);
  *res = rc ? NULL : obj;
  return rc;
}

static int run(tok_job *j, const char *model) {
  ml_tokenizer *t = NULL;
  ML_TRY(ml_tokenizer_load(model, &t));
  FILE *in = fopen(j->in, "rb"), *out = NULL;
  char tmp[4096];
  int rc = in ? 0 : ml_err("%s: cannot open: %s", j->in, strerror(errno));
  if (rc == 0) rc = ml_file_open_tmp(j->out, tmp, sizeof tmp, &out);
  char *line = NULL;
  size_t cap = 0;
  ml_tokens ids = {0};
  ssize_t n;
  for (int64_t ln = 1; rc == 0 && (n = getline(&line, &cap, in)) >= 0; ln++) {
    if (blank(line, (size_t)n)) continue;
    json_t *obj = NULL;
    rc = convert(j, t, line, (size_t)n, ln, &ids, &obj);
    if (rc == 0 && (json_dumpf(obj, out, JSON_COMPACT) != 0 || fputc('\n', out) == EOF))
      rc = ml_err("%s: cannot write: %s", j->out, strerror(errno));
    json_decref(obj);
  }
  if (rc == 0 && ferror(in)) rc = ml_err("%s: read error: %s", j->in, strerror(errno));
  if (out && rc == 0)
    rc = ml_file_commit(out, tmp, j->out);
  else if (out)
    ml_file_abandon(out, tmp);
  if (in) fclose(in);
  free(line);
  ml_tokens_free(&ids);
  ml_tokens_free(&j->scratch);
  ml_chat_free(j->chat);
  ml_tokenizer_free(t);
  return rc;
}

int ml_cmd_tokenize(ml_host *world, int argc, char **argv) {
  const char *model = NULL, *data = NULL, *out = NULL, *key = "text";
  bool no_special = false;
  ml_arg spec[] = {
      {"--model", ML_ARG_STR, &model, "directory with tokenizer.json (a model directory)", true,
       "DIR"},
      {"--data", ML_ARG_STR, &data,
       "input JSONL, one object with a text field (or messages) per line", true, "IN.jsonl"},
      {"--out", ML_ARG_STR, &out,
       "output JSONL: {\"input_ids\": [...] (+ \"loss_mask\" for messages), other fields}",
       true, "OUT.jsonl"},
      {"--text-key", ML_ARG_STR, &key, "the field holding the text", false, "KEY"},
      {"--no-special", ML_ARG_FLAG, &no_special,
       "no special tokens (add_special_tokens=False: no BOS/EOS from the template; messages "
       "never get them)", false, NULL},
  };
  int rc = ml_cli_parse("tokenize",
                        "tokenize JSONL text (or messages, with the chat template) with the "
                        "model's tokenizer.json",
                        argc, argv, spec, sizeof spec / sizeof spec[0]);
  if (rc == 1) return 0;
  tok_job j = {.in = data, .out = out, .key = key, .model = model, .add_special = !no_special};
  if (rc == 0 && world->rank == 0) rc = run(&j, model);
  ML_TRY(ml_cli_agree(world, rc));
  ml_cli_print(
      "tokenize: %lld records, %lld tokens, %.2f MB of text encoded at %.1f MB/s; "
      "wrote %s\n",
      (long long)j.records, (long long)j.tokens, (double)j.text_bytes / 1e6,
      j.seconds > 0 ? (double)j.text_bytes / 1e6 / j.seconds : 0.0, out);
  return 0;
}

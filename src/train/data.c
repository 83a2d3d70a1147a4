#include "train/data.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "common/checked.h"
#include "common/status.h"

/* ---- file and line helpers ---------------------------------------------- */

static int read_file(const char *path, char **buf, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) return ml_err("%s: cannot open data file: %s", path, strerror(errno));
  size_t cap = 1 << 16, n = 0;
  char *b = NULL;
  int rc = 0;
  for (;;) {
    char *nb = realloc(b, cap);
    if (!nb) {
      rc = ml_err("out of memory reading %s (%zu bytes)", path, cap);
      break;
    }
    b = nb;
    n += fread(b + n, 1, cap - n, f);
    if (n < cap) break;
    cap *= 2;
  }
  if (rc == 0 && ferror(f)) rc = ml_err("%s: read error: %s", path, strerror(errno));
  fclose(f);
  if (rc != 0) {
    free(b);
    return -1;
  }
  *buf = b;
  *len = n;
  return 0;
}

static bool is_space(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; }

static bool is_jsonl(const char *buf, size_t len) {
  size_t i = 0;
  while (i < len && is_space(buf[i])) i++;
  return i < len && buf[i] == '{';
}

typedef struct line_iter {
  const char *buf;
  size_t len, pos;
  int64_t lineno; /* 1-based number of the line last returned */
} line_iter;

/* The next line holding something other than whitespace, or false at EOF. */
static bool line_next(line_iter *it, const char **s, size_t *n) {
  while (it->pos < it->len) {
    const char *start = it->buf + it->pos;
    const char *nl = memchr(start, '\n', it->len - it->pos);
    size_t l = nl ? (size_t)(nl - start) : it->len - it->pos;
    it->pos += l + (nl != NULL);
    it->lineno++;
    for (size_t i = 0; i < l; i++) {
      if (!is_space(start[i])) {
        *s = start;
        *n = l;
        return true;
      }
    }
  }
  return false;
}

static int64_t count_lines(const char *buf, size_t len) {
  line_iter it = {buf, len, 0, 0};
  const char *s;
  size_t n;
  int64_t count = 0;
  while (line_next(&it, &s, &n)) count++;
  return count;
}

/* ---- one JSONL line ------------------------------------------------------ */

static json_t *parse_line(const char *path, int64_t lineno, const char *s, size_t n) {
  json_error_t e;
  json_t *obj = json_loadb(s, n, JSON_REJECT_DUPLICATES, &e);
  if (!obj) {
    ml_err("%s:%lld: invalid JSON at column %d: %s", path, (long long)lineno, e.column, e.text);
    return NULL;
  }
  if (!json_is_object(obj)) {
    ml_err("%s:%lld: expected a JSON object per line, found another JSON value", path,
           (long long)lineno);
    json_decref(obj);
    return NULL;
  }
  return obj;
}

/* Validate "input_ids": an array of at least min_len ids in [0, vocab). */
static const json_t *get_ids(const char *path, int64_t lineno, const json_t *obj, int64_t vocab,
                             size_t min_len) {
  const json_t *arr = json_object_get(obj, "input_ids");
  if (!arr || !json_is_array(arr)) {
    ml_err("%s:%lld: field 'input_ids': expected an array of token ids, found %s", path,
           (long long)lineno, arr ? "a value that is not an array" : "the field missing");
    return NULL;
  }
  if (json_array_size(arr) < min_len) {
    ml_err("%s:%lld: field 'input_ids': expected at least %zu tokens, found %zu", path,
           (long long)lineno, min_len, json_array_size(arr));
    return NULL;
  }
  size_t i;
  const json_t *v;
  json_array_foreach(arr, i, v) {
    if (!json_is_integer(v)) {
      ml_err("%s:%lld: field 'input_ids'[%zu]: expected an integer token id, found a non-integer",
             path, (long long)lineno, i);
      return NULL;
    }
    json_int_t id = json_integer_value(v);
    if (id < 0 || id >= vocab) {
      ml_err("%s:%lld: field 'input_ids'[%zu] = %lld: expected a token id in [0, %lld) "
             "(vocab_size)",
             path, (long long)lineno, i, (long long)id, (long long)vocab);
      return NULL;
    }
  }
  return arr;
}

static int mask_value(const char *path, int64_t lineno, size_t i, const json_t *v, uint8_t *out) {
  if (json_is_boolean(v)) {
    *out = json_is_true(v);
    return 0;
  }
  if (json_is_integer(v) && (json_integer_value(v) == 0 || json_integer_value(v) == 1)) {
    *out = (uint8_t)json_integer_value(v);
    return 0;
  }
  return ml_err("%s:%lld: field 'loss_mask'[%zu]: expected 0, 1, true or false", path,
                (long long)lineno, i);
}

/* Optional "loss_mask": NULL (no error) when absent; validated otherwise. */
static int get_mask(const char *path, int64_t lineno, const json_t *obj, size_t n_ids,
                    const json_t **out) {
  const json_t *arr = json_object_get(obj, "loss_mask");
  *out = arr;
  if (!arr) return 0;
  if (!json_is_array(arr))
    return ml_err("%s:%lld: field 'loss_mask': expected an array of 0/1 or bools", path,
                  (long long)lineno);
  if (json_array_size(arr) != n_ids)
    return ml_err("%s:%lld: field 'loss_mask': length %zu, expected %zu (the length of input_ids)",
                  path, (long long)lineno, json_array_size(arr), n_ids);
  size_t i;
  const json_t *v;
  uint8_t m;
  json_array_foreach(arr, i, v) ML_TRY(mask_value(path, lineno, i, v, &m));
  return 0;
}

/* ---- training data ------------------------------------------------------- */

/* Fill one row (already zeroed) from a validated line. */
static void fill_row(const json_t *ids, const json_t *lmask, int64_t seq_len, int32_t *row_ids,
                     uint8_t *row_mask) {
  int64_t n = (int64_t)json_array_size(ids);
  if (n > seq_len) n = seq_len;
  for (int64_t t = 0; t < n; t++) {
    row_ids[t] = (int32_t)json_integer_value(json_array_get(ids, (size_t)t));
    const json_t *m = lmask ? json_array_get(lmask, (size_t)t) : NULL;
    bool target = m ? (json_is_true(m) || json_integer_value(m) == 1) : true;
    row_mask[t] = t > 0 && target;
  }
}

static int load_jsonl_row(const char *path, int64_t lineno, const char *s, size_t n,
                          int64_t vocab, int64_t seq_len, int32_t *row_ids, uint8_t *row_mask) {
  json_t *obj = parse_line(path, lineno, s, n);
  if (!obj) return -1;
  const json_t *ids = get_ids(path, lineno, obj, vocab, 1);
  const json_t *lmask = NULL;
  int rc = ids ? get_mask(path, lineno, obj, json_array_size(ids), &lmask) : -1;
  if (rc == 0) fill_row(ids, lmask, seq_len, row_ids, row_mask);
  json_decref(obj);
  return rc;
}

/* Zeroed [nseq, ds->seq_len] ids and mask of the dataset at `path`
 * (seq_len is meshlm train's --seq-len: the count saturates, and a failed
 * allocation names both). */
static int alloc_rows(const char *path, ml_dataset *ds, int64_t nseq) {
  int64_t n = ml_mul_sat(nseq, ds->seq_len);
  ds->nseq = nseq;
  ds->ids = ml_calloc_array(n, sizeof *ds->ids,
                            "the token ids of %s (%lld sequences x --seq-len %lld)", path,
                            (long long)nseq, (long long)ds->seq_len);
  if (!ds->ids) return -1;
  ds->mask = ml_calloc_array(n, 1, "the loss mask of %s (%lld sequences x --seq-len %lld)", path,
                             (long long)nseq, (long long)ds->seq_len);
  return ds->mask ? 0 : -1;
}

static int load_jsonl(const char *path, const char *buf, size_t len, int64_t vocab,
                      ml_dataset *ds) {
  ML_TRY(alloc_rows(path, ds, count_lines(buf, len)));
  line_iter it = {buf, len, 0, 0};
  const char *s;
  size_t n;
  for (int64_t r = 0; line_next(&it, &s, &n); r++) {
    int64_t off = r * ds->seq_len;
    ML_TRY(load_jsonl_row(path, it.lineno, s, n, vocab, ds->seq_len, ds->ids + off,
                          ds->mask + off));
  }
  return 0;
}

static int load_raw(const char *path, const unsigned char *buf, size_t len, int64_t vocab,
                    ml_dataset *ds) {
  if (vocab < 256)
    return ml_err("%s: raw text data uses bytes as token ids and needs vocab_size >= 256, found "
                  "vocab_size %lld (use JSONL input_ids for a smaller vocabulary)",
                  path, (long long)vocab);
  int64_t S = ds->seq_len, full = (int64_t)len / S, tail = (int64_t)len % S;
  ML_TRY(alloc_rows(path, ds, full + (tail >= 2)));
  for (int64_t r = 0; r < ds->nseq; r++) {
    int64_t n = r < full ? S : tail;
    for (int64_t t = 0; t < n; t++) {
      ds->ids[r * S + t] = buf[r * S + t];
      ds->mask[r * S + t] = t > 0;
    }
  }
  return 0;
}

int ml_dataset_load(const char *path, int64_t seq_len, int64_t vocab_size, ml_dataset *out) {
  memset(out, 0, sizeof *out);
  if (seq_len < 2) return ml_err("%s: seq_len %lld, expected >= 2", path, (long long)seq_len);
  if (vocab_size < 1)
    return ml_err("%s: vocab_size %lld, expected >= 1", path, (long long)vocab_size);
  char *buf;
  size_t len;
  ML_TRY(read_file(path, &buf, &len));
  out->seq_len = seq_len;
  int rc = is_jsonl(buf, len) ? load_jsonl(path, buf, len, vocab_size, out)
                              : load_raw(path, (const unsigned char *)buf, len, vocab_size, out);
  free(buf);
  if (rc == 0 && out->nseq == 0)
    rc = ml_err("%s: empty dataset: expected at least one JSONL line with input_ids or at least "
                "2 bytes of raw text",
                path);
  if (rc != 0) ml_dataset_free(out);
  return rc;
}

void ml_dataset_free(ml_dataset *ds) {
  free(ds->ids);
  free(ds->mask);
  memset(ds, 0, sizeof *ds);
}

/* Dataset row of element i of the global batch of `step`. */
static int64_t batch_row(const ml_dataset *ds, int64_t step, int64_t global_batch, int64_t i) {
  int64_t n = ds->nseq;
  int64_t base = (int64_t)(((unsigned __int128)(step % n) * (uint64_t)(global_batch % n)) % n);
  return (base + i % n) % n;
}

static int check_step(int64_t step, int64_t global_batch) {
  if (step < 0) return ml_err("data batch: step %lld, expected >= 0", (long long)step);
  if (global_batch < 1)
    return ml_err("data batch: global_batch %lld, expected >= 1", (long long)global_batch);
  return 0;
}

int ml_dataset_batch(const ml_dataset *ds, int64_t step, int64_t global_batch, int64_t dp_rank,
                     int64_t dp_size, int32_t *ids, uint8_t *mask) {
  ML_TRY(check_step(step, global_batch));
  if (dp_size < 1 || dp_rank < 0 || dp_rank >= dp_size)
    return ml_err("data batch: dp_rank %lld of dp_size %lld, expected 0 <= dp_rank < dp_size",
                  (long long)dp_rank, (long long)dp_size);
  if (global_batch % dp_size != 0)
    return ml_err("data batch: global_batch %lld is not divisible by dp size %lld",
                  (long long)global_batch, (long long)dp_size);
  int64_t local = global_batch / dp_size, S = ds->seq_len;
  for (int64_t j = 0; j < local; j++) {
    int64_t row = batch_row(ds, step, global_batch, dp_rank * local + j);
    memcpy(ids + j * S, ds->ids + row * S, (size_t)S * sizeof *ids);
    memcpy(mask + j * S, ds->mask + row * S, (size_t)S);
  }
  return 0;
}

int64_t ml_dataset_count_targets(const ml_dataset *ds, int64_t step, int64_t global_batch) {
  ML_TRY(check_step(step, global_batch));
  int64_t count = 0, S = ds->seq_len;
  for (int64_t i = 0; i < global_batch; i++) {
    const uint8_t *m = ds->mask + batch_row(ds, step, global_batch, i) * S;
    for (int64_t t = 0; t < S; t++) count += m[t];
  }
  return count;
}

/* ---- scoring data -------------------------------------------------------- */

static int load_seq(const char *path, int64_t lineno, const char *s, size_t n, int64_t vocab,
                    int64_t max_len, int64_t *len, int32_t **ids) {
  json_t *obj = parse_line(path, lineno, s, n);
  if (!obj) return -1;
  const json_t *arr = get_ids(path, lineno, obj, vocab, 2);
  if (arr && (int64_t)json_array_size(arr) > max_len) {
    ml_err("%s:%lld: field 'input_ids': %zu tokens, above the model's max_position_embeddings "
           "%lld (config.json); expected at most %lld tokens",
           path, (long long)lineno, json_array_size(arr), (long long)max_len, (long long)max_len);
    arr = NULL;
  }
  *ids = arr ? ml_malloc(json_array_size(arr) * sizeof **ids, "scoring sequence") : NULL;
  if (*ids) {
    *len = (int64_t)json_array_size(arr);
    for (int64_t t = 0; t < *len; t++)
      (*ids)[t] = (int32_t)json_integer_value(json_array_get(arr, (size_t)t));
  }
  json_decref(obj);
  return *ids ? 0 : -1;
}

static int load_seqs(const char *path, const char *buf, size_t len, int64_t vocab, int64_t max_len,
                     ml_seqs *out) {
  int64_t count = count_lines(buf, len);
  if (count == 0)
    return ml_err("%s: empty dataset: expected at least one JSONL line with input_ids", path);
  out->len = ml_calloc((size_t)count, sizeof *out->len, "scoring sequence lengths");
  out->ids = out->len ? ml_calloc((size_t)count, sizeof *out->ids, "scoring sequences") : NULL;
  if (!out->ids) return -1;
  line_iter it = {buf, len, 0, 0};
  const char *s;
  size_t n;
  while (line_next(&it, &s, &n)) {
    ML_TRY(load_seq(path, it.lineno, s, n, vocab, max_len, &out->len[out->n], &out->ids[out->n]));
    out->n++;
  }
  return 0;
}

int ml_seqs_load_jsonl(const char *path, int64_t vocab_size, int64_t max_len, ml_seqs *out) {
  memset(out, 0, sizeof *out);
  if (vocab_size < 1)
    return ml_err("%s: vocab_size %lld, expected >= 1", path, (long long)vocab_size);
  char *buf;
  size_t len;
  ML_TRY(read_file(path, &buf, &len));
  int rc = load_seqs(path, buf, len, vocab_size, max_len, out);
  free(buf);
  if (rc != 0) ml_seqs_free(out);
  return rc;
}

void ml_seqs_free(ml_seqs *s) {
  for (int64_t i = 0; i < s->n; i++) free(s->ids[i]);
  free(s->ids);
  free(s->len);
  memset(s, 0, sizeof *s);
}

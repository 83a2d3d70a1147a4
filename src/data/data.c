#include "data/data.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/checked.h"
#include "common/status.h"
#include "data/data_lines.h"
#include "data/data_record.h"

/* ---- a file's records ---------------------------------------------------- */

/* Every record's tokens and targets in file order, before they become rows:
 * record i is tokens [start[i], start[i + 1]) of `all`. */
typedef struct records {
  ml_record all;
  int64_t *start; /* [n + 1] */
  int64_t n;
  ml_data_format format;
} records;

static void records_free(records *rs) {
  ml_record_free(&rs->all);
  free(rs->start);
  memset(rs, 0, sizeof *rs);
}

/* Room for `count` records (start[0] = 0). */
static int records_alloc(records *rs, int64_t count) {
  rs->start = ml_calloc_array(ml_add_sat(count, 1), sizeof *rs->start, "data record offsets");
  return rs->start ? 0 : -1;
}

static int records_add(records *rs, const ml_record *rec) {
  ML_TRY(ml_record_append(&rs->all, rec));
  rs->start[++rs->n] = rs->all.n;
  return 0;
}

static int read_jsonl(ml_record_reader *r, const char *buf, size_t len, records *rs) {
  ML_TRY(records_alloc(rs, ml_data_count_lines(buf, len)));
  ml_line_iter it = ml_line_iter_start(buf, len);
  ml_record rec = {0};
  const char *s;
  size_t n;
  int rc = 0;
  while (rc == 0 && ml_line_next(&it, &s, &n)) {
    rc = ml_record_read_line(r, it.lineno, s, n, &rec);
    if (rc == 0) rc = records_add(rs, &rec);
  }
  ml_record_free(&rec);
  rs->format = r->format;
  return rc;
}

/* Raw text: one document tokenized with tokenizer.json, or without one its
 * bytes as ids (vocab >= 256), read straight into rs->all. An empty file
 * has no record. */
static int read_raw(ml_record_reader *r, const char *buf, size_t len, records *rs) {
  bool tokenize;
  ML_TRY(ml_record_tokenizer_present(r, &tokenize));
  rs->format = tokenize ? ML_DATA_RAW : ML_DATA_RAW_BYTES;
  ML_TRY(records_alloc(rs, 1));
  if (!tokenize && r->vocab < 256)
    return ml_err("%s: raw text data uses bytes as token ids (%s/tokenizer.json does not exist) "
                  "and needs vocab_size >= 256, found vocab_size %lld (use JSONL input_ids for a "
                  "smaller vocabulary)",
                  r->path, r->opts->tokenizer_dir, (long long)r->vocab);
  if (len == 0) return 0;
  ML_TRY(tokenize ? ml_record_read_raw(r, buf, len, &rs->all)
                  : ml_record_append_bytes(&rs->all, (const unsigned char *)buf, len));
  rs->start[++rs->n] = rs->all.n;
  return 0;
}

/* The records of `path` (JSONL or raw text). */
static int read_records(const char *path, int64_t vocab, const ml_data_opts *opts, records *rs) {
  char *buf;
  size_t len;
  ML_TRY(ml_data_read_file(path, &buf, &len));
  ml_record_reader r = ml_record_reader_open(path, opts, vocab);
  int rc = ml_data_is_jsonl(buf, len) ? read_jsonl(&r, buf, len, rs) : read_raw(&r, buf, len, rs);
  ml_record_reader_close(&r);
  free(buf);
  return rc;
}

/* ---- training data ------------------------------------------------------- */

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

/* Row r from n tokens of `all` at `from` (n <= seq_len): the targets but
 * the row's first position. */
static void fill_row(ml_dataset *ds, int64_t r, const ml_record *all, int64_t from, int64_t n) {
  int32_t *ids = ds->ids + r * ds->seq_len;
  uint8_t *mask = ds->mask + r * ds->seq_len;
  memcpy(ids, all->ids + from, (size_t)n * sizeof *ids);
  for (int64_t t = 1; t < n; t++) mask[t] = all->target[from + t];
}

/* Consecutive windows of seq_len tokens over every record; a tail of at
 * least 2 tokens padded, a 1-token tail dropped. */
static int pack_rows(const char *path, const records *rs, ml_dataset *ds) {
  int64_t S = ds->seq_len, full = rs->all.n / S, tail = rs->all.n % S;
  ML_TRY(alloc_rows(path, ds, full + (tail >= 2)));
  for (int64_t r = 0; r < ds->nseq; r++) fill_row(ds, r, &rs->all, r * S, r < full ? S : tail);
  return 0;
}

/* One row per record, truncated to seq_len. */
static int record_rows(const char *path, const records *rs, ml_dataset *ds) {
  ML_TRY(alloc_rows(path, ds, rs->n));
  for (int64_t i = 0; i < rs->n; i++) {
    int64_t n = rs->start[i + 1] - rs->start[i];
    fill_row(ds, i, &rs->all, rs->start[i], n < ds->seq_len ? n : ds->seq_len);
  }
  return 0;
}

static int build_rows(const char *path, const ml_data_opts *opts, const records *rs,
                      ml_dataset *ds) {
  ds->format = rs->format;
  ds->records = rs->n;
  ds->tokens = rs->all.n;
  ds->packed = rs->format == ML_DATA_RAW || rs->format == ML_DATA_RAW_BYTES ||
               (rs->format == ML_DATA_TEXT && opts->packing);
  return ds->packed ? pack_rows(path, rs, ds) : record_rows(path, rs, ds);
}

int ml_dataset_load(const char *path, int64_t seq_len, int64_t vocab_size,
                    const ml_data_opts *opts, ml_dataset *out) {
  memset(out, 0, sizeof *out);
  if (seq_len < 2) return ml_err("%s: seq_len %lld, expected >= 2", path, (long long)seq_len);
  if (vocab_size < 1)
    return ml_err("%s: vocab_size %lld, expected >= 1", path, (long long)vocab_size);
  out->seq_len = seq_len;
  records rs = {0};
  int rc = read_records(path, vocab_size, opts, &rs);
  if (rc == 0) rc = build_rows(path, opts, &rs, out);
  records_free(&rs);
  if (rc == 0 && out->nseq == 0)
    rc = ml_err("%s: empty dataset: expected at least one JSONL record or at least 2 tokens of "
                "raw text",
                path);
  if (rc != 0) ml_dataset_free(out);
  return rc;
}

void ml_dataset_free(ml_dataset *ds) {
  free(ds->ids);
  free(ds->mask);
  memset(ds, 0, sizeof *ds);
}

/* ---- batches ------------------------------------------------------------- */

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

/* Record `lineno` as sequence out->n: 2 to max_len tokens, never truncated. */
static int load_seq(ml_record_reader *r, int64_t lineno, const char *s, size_t n,
                    int64_t max_len, ml_record *rec, ml_seqs *out) {
  ML_TRY(ml_record_read_line(r, lineno, s, n, rec));
  char fields[160];
  ml_record_fields(r, fields, sizeof fields);
  const char *what = r->format == ML_DATA_PROMPT ? "fields" : "field";
  const char *tok = r->format == ML_DATA_IDS ? "" : " (after tokenization)";
  if (rec->n < 2)
    return ml_err("%s:%lld: %s %s: expected at least 2 tokens (log-probs score tokens 1..n-1), "
                  "found %lld%s",
                  r->path, (long long)lineno, what, fields, (long long)rec->n, tok);
  if (rec->n > max_len)
    return ml_err("%s:%lld: %s %s: %lld tokens%s, above the model's max_position_embeddings "
                  "%lld (config.json); expected at most %lld tokens",
                  r->path, (long long)lineno, what, fields, (long long)rec->n, tok,
                  (long long)max_len, (long long)max_len);
  int32_t *ids = ml_malloc_array(rec->n, sizeof *ids, "a scoring sequence of %lld tokens",
                                 (long long)rec->n);
  if (!ids) return -1;
  memcpy(ids, rec->ids, (size_t)rec->n * sizeof *ids);
  out->ids[out->n] = ids;
  out->len[out->n] = rec->n;
  out->prompt_len[out->n] = rec->prompt_len;
  out->n++;
  return 0;
}

static int load_seqs(ml_record_reader *r, const char *buf, size_t len, int64_t max_len,
                     ml_seqs *out) {
  int64_t count = ml_data_count_lines(buf, len);
  if (count == 0)
    return ml_err("%s: empty dataset: expected at least one JSONL record", r->path);
  out->len = ml_calloc_array(count, sizeof *out->len, "scoring sequence lengths");
  out->prompt_len = ml_calloc_array(count, sizeof *out->prompt_len, "scoring prompt lengths");
  out->ids = ml_calloc_array(count, sizeof *out->ids, "scoring sequences");
  if (!out->len || !out->prompt_len || !out->ids) return -1;
  ml_line_iter it = ml_line_iter_start(buf, len);
  ml_record rec = {0};
  const char *s;
  size_t n;
  int rc = 0;
  while (rc == 0 && ml_line_next(&it, &s, &n))
    rc = load_seq(r, it.lineno, s, n, max_len, &rec, out);
  ml_record_free(&rec);
  out->format = r->format;
  return rc;
}

int ml_seqs_load(const char *path, int64_t vocab_size, int64_t max_len, const ml_data_opts *opts,
                 ml_seqs *out) {
  memset(out, 0, sizeof *out);
  if (vocab_size < 1)
    return ml_err("%s: vocab_size %lld, expected >= 1", path, (long long)vocab_size);
  char *buf;
  size_t len;
  ML_TRY(ml_data_read_file(path, &buf, &len));
  ml_record_reader r = ml_record_reader_open(path, opts, vocab_size);
  r.scoring = true;
  int rc = load_seqs(&r, buf, len, max_len, out);
  ml_record_reader_close(&r);
  free(buf);
  if (rc != 0) ml_seqs_free(out);
  return rc;
}

void ml_seqs_free(ml_seqs *s) {
  for (int64_t i = 0; s->ids && i < s->n; i++) free(s->ids[i]);
  free(s->ids);
  free(s->len);
  free(s->prompt_len);
  memset(s, 0, sizeof *s);
}

#include "data/data.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/checked.h"
#include "common/status.h"
#include "data/data_records.h"

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
static int pack_rows(const char *path, const ml_records *rs, ml_dataset *ds) {
  int64_t S = ds->seq_len, full = rs->all.n / S, tail = rs->all.n % S;
  ML_TRY(alloc_rows(path, ds, full + (tail >= 2)));
  for (int64_t r = 0; r < ds->nseq; r++) fill_row(ds, r, &rs->all, r * S, r < full ? S : tail);
  return 0;
}

/* One row per record, truncated to seq_len. */
static int record_rows(const char *path, const ml_records *rs, ml_dataset *ds) {
  ML_TRY(alloc_rows(path, ds, rs->n));
  for (int64_t i = 0; i < rs->n; i++) {
    int64_t n = rs->start[i + 1] - rs->start[i];
    fill_row(ds, i, &rs->all, rs->start[i], n < ds->seq_len ? n : ds->seq_len);
  }
  return 0;
}

static int build_rows(const char *path, const ml_data_opts *opts, const ml_records *rs,
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
  ml_records rs;
  int rc = ml_records_load(path, vocab_size, 0, opts, &rs);
  if (rc == 0) rc = build_rows(path, opts, &rs, out);
  ml_records_free(&rs);
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

/* One sequence per record. */
static int build_seqs(const ml_records *rs, ml_seqs *out) {
  out->len = ml_calloc_array(rs->n, sizeof *out->len, "scoring sequence lengths");
  out->prompt_len = ml_calloc_array(rs->n, sizeof *out->prompt_len, "scoring prompt lengths");
  out->ids = ml_calloc_array(rs->n, sizeof *out->ids, "scoring sequences");
  if (!out->len || !out->prompt_len || !out->ids) return -1;
  out->format = rs->format;
  for (; out->n < rs->n; out->n++) {
    int64_t i = out->n, n = rs->start[i + 1] - rs->start[i];
    out->ids[i] = ml_malloc_array(n, sizeof *out->ids[i], "a scoring sequence of %lld tokens",
                                  (long long)n);
    if (!out->ids[i]) return -1;
    memcpy(out->ids[i], rs->all.ids + rs->start[i], (size_t)n * sizeof *out->ids[i]);
    out->len[i] = n;
    out->prompt_len[i] = rs->prompt_len[i];
  }
  return 0;
}

int ml_seqs_load(const char *path, int64_t vocab_size, int64_t max_len, const ml_data_opts *opts,
                 ml_seqs *out) {
  memset(out, 0, sizeof *out);
  if (vocab_size < 1)
    return ml_err("%s: vocab_size %lld, expected >= 1", path, (long long)vocab_size);
  if (max_len < 2)
    return ml_err("%s: max_len %lld, expected >= 2", path, (long long)max_len);
  ml_records rs;
  int rc = ml_records_load(path, vocab_size, max_len, opts, &rs);
  if (rc == 0 && rs.n == 0)
    rc = ml_err("%s: empty dataset: expected at least one JSONL record", path);
  if (rc == 0) rc = build_seqs(&rs, out);
  ml_records_free(&rs);
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

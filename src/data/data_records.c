#include "data/data_records.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "common/checked.h"
#include "common/status.h"
#include "data/data_gather.h"
#include "data/data_lines.h"
#include "data/data_split.h"

void ml_records_free(ml_records *rs) {
  ml_record_free(&rs->all);
  free(rs->start);
  free(rs->prompt_len);
  memset(rs, 0, sizeof *rs);
}

/* Room for `count` records (start[0] = 0). */
static int records_alloc(ml_records *rs, int64_t count) {
  rs->start = ml_calloc_array(ml_add_sat(count, 1), sizeof *rs->start, "data record offsets");
  rs->prompt_len = ml_calloc_array(count, sizeof *rs->prompt_len, "data record prompt lengths");
  return rs->start && rs->prompt_len ? 0 : -1;
}

static int records_add(ml_records *rs, const ml_record *rec) {
  ML_TRY(ml_record_append(&rs->all, rec));
  rs->prompt_len[rs->n] = rec->prompt_len;
  rs->start[++rs->n] = rs->all.n;
  return 0;
}

/* ---- reading ------------------------------------------------------------- */

/* Scoring: a record of 2 to max_len tokens, never truncated. */
static int check_scoring(const ml_record_reader *r, int64_t lineno, const ml_record *rec,
                         int64_t max_len) {
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
  return 0;
}

/* The records of JSONL text buf[0, len), its first line numbered first_line. */
static int read_lines(ml_record_reader *r, const char *buf, size_t len, int64_t first_line,
                      int64_t max_len, ml_records *rs) {
  ML_TRY(records_alloc(rs, ml_data_count_lines(buf, len)));
  ml_line_iter it = ml_line_iter_start(buf, len);
  it.lineno = first_line - 1;
  ml_record rec = {0};
  const char *s;
  size_t n;
  int rc = 0;
  while (rc == 0 && ml_line_next(&it, &s, &n)) {
    rc = ml_record_read_line(r, it.lineno, s, n, &rec);
    if (rc == 0 && max_len > 0) rc = check_scoring(r, it.lineno, &rec, max_len);
    if (rc == 0) rc = records_add(rs, &rec);
  }
  ml_record_free(&rec);
  rs->format = r->format;
  return rc;
}

/* Raw text: one document tokenized with tokenizer.json, or without one its
 * bytes as ids (vocab >= 256), read straight into rs->all. An empty file
 * has no record. */
static int read_raw(ml_record_reader *r, const char *buf, size_t len, ml_records *rs) {
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

/* ---- the parts ----------------------------------------------------------- */

/* What a rank tells the others of its part before reading its records. */
typedef struct part_info {
  int64_t size;      /* the file's size as this rank sees it */
  int64_t jsonl;     /* ml_data_part.jsonl */
  int64_t newlines;  /* in the part */
  int64_t peek;      /* the format of the part's first record, or one of: */
  int64_t peek_line; /* that record's line, 1-based within the part */
} part_info;
enum { PEEK_EMPTY = -1 /* no record */, PEEK_NONE = -2 /* a first record with no format */ };

static part_info peek_part(const ml_record_reader *r, const ml_data_part *p) {
  part_info in = {(int64_t)p->size, p->jsonl, p->newlines, PEEK_EMPTY, 0};
  ml_line_iter it = ml_line_iter_start(p->buf, p->len);
  const char *s;
  size_t n;
  ml_data_format f;
  if (p->jsonl && ml_line_next(&it, &s, &n)) {
    in.peek = ml_record_peek_format(r, s, n, &f) ? (int64_t)f : PEEK_NONE;
    in.peek_line = it.lineno;
  }
  return in;
}

/* What the parts tell this rank: its first line number, and the file's
 * format (its first record's; ML_DATA_IDS when it has none). */
typedef struct part_view {
  int64_t first_line;
  ml_data_format format;
} part_view;

/* The part infos of every rank, the same file on every rank checked (its
 * size and kind). Sets *view, and the reader's expected format when the
 * file's first record lies in an earlier rank's part. */
static int share_parts(const ml_data_group *g, ml_record_reader *r, const ml_data_part *p,
                       part_view *view) {
  part_info mine = peek_part(r, p), *all = NULL;
  int64_t *cnt = ml_calloc_array(g->size, sizeof *cnt, "data part counts"), total;
  int rc = cnt ? ml_data_gather(g, &mine, 1, sizeof mine, (void **)&all, cnt, &total) : -1;
  free(cnt);
  ML_TRY(rc);
  for (int q = 0; rc == 0 && q < g->size; q++)
    if (all[q].size != all[0].size || all[q].jsonl != all[0].jsonl)
      rc = ml_err("%s: %lld bytes (%s) on rank 0 but %lld bytes (%s) on rank %d; expected the "
                  "same data file on every rank (a shared file system, or the same copy on every "
                  "node)",
                  r->path, (long long)all[0].size, all[0].jsonl ? "JSONL" : "raw text",
                  (long long)all[q].size, all[q].jsonl ? "JSONL" : "raw text", q);
  *view = (part_view){1, ML_DATA_IDS};
  for (int q = 0; q < g->rank; q++) view->first_line += all[q].newlines;
  int64_t line = 1;
  for (int q = 0; rc == 0 && q < g->size; line += all[q++].newlines) {
    if (all[q].peek == PEEK_EMPTY) continue;
    if (all[q].peek >= 0) view->format = (ml_data_format)all[q].peek;
    if (all[q].peek >= 0 && q < g->rank)
      ml_record_reader_expect(r, view->format, line + all[q].peek_line - 1);
    break;
  }
  free(all);
  return rc;
}

/* Every rank's records, concatenated in rank order, into *out (zeroed). */
static int gather_records(const ml_data_group *g, const ml_records *mine, ml_records *out) {
  int64_t *cnt = ml_calloc_array(g->size, sizeof *cnt, "data part counts"), *lens = NULL;
  int64_t *len = ml_malloc_array(mine->n, sizeof *len, "data record lengths"), n = 0, t = 0;
  for (int64_t i = 0; len && i < mine->n; i++) len[i] = mine->start[i + 1] - mine->start[i];
  int rc = cnt && len ? 0 : -1;
  if (rc == 0) rc = ml_data_gather(g, len, mine->n, sizeof *len, (void **)&lens, cnt, &n);
  if (rc == 0)
    rc = ml_data_gather(g, mine->prompt_len, mine->n, sizeof *len, (void **)&out->prompt_len,
                        cnt, &n);
  if (rc == 0)
    rc = ml_data_gather(g, mine->all.ids, mine->all.n, sizeof *mine->all.ids,
                        (void **)&out->all.ids, cnt, &t);
  if (rc == 0)
    rc = ml_data_gather(g, mine->all.target, mine->all.n, 1, (void **)&out->all.target, cnt, &t);
  if (rc == 0)
    out->start = ml_calloc_array(ml_add_sat(n, 1), sizeof *out->start, "data record offsets");
  if (rc == 0 && !out->start) rc = -1;
  for (int64_t i = 0; rc == 0 && i < n; i++) out->start[i + 1] = out->start[i] + lens[i];
  out->n = n;
  out->all.n = out->all.cap = t;
  free(lens);
  free(len);
  free(cnt);
  return rc;
}

/* This rank's records: of its part (JSONL), or of the whole file (raw
 * text, scoring aside: log-probs read JSONL only, and fail on its first
 * line). */
static int read_mine(ml_record_reader *r, const ml_data_part *p, const part_view *view,
                     int64_t max_len, ml_records *mine) {
  if (!p->jsonl && max_len == 0) return read_raw(r, p->buf, p->len, mine);
  return read_lines(r, p->buf, p->len, view->first_line, max_len, mine);
}

int ml_records_load(const char *path, int64_t vocab, int64_t max_len, const ml_data_opts *opts,
                    ml_records *out) {
  memset(out, 0, sizeof *out);
  const ml_data_group *g = ml_data_group_or_solo(opts->group);
  ml_data_part part;
  ml_records mine = {0};
  ml_record_reader r = ml_record_reader_open(path, opts, vocab);
  r.scoring = max_len > 0;
  part_view view = {1, ML_DATA_IDS};
  int rc = g->agree(g->ctx, ml_data_part_read(path, g->rank, g->size, &part));
  if (rc == 0) rc = g->agree(g->ctx, share_parts(g, &r, &part, &view));
  if (rc == 0) rc = g->agree(g->ctx, read_mine(&r, &part, &view, max_len, &mine));
  ml_record_reader_close(&r);
  bool raw = !part.jsonl && max_len == 0;
  ml_data_part_free(&part);
  if (rc == 0 && raw) {
    *out = mine; /* every rank read the whole file */
    return 0;
  }
  if (rc == 0) rc = g->agree(g->ctx, gather_records(g, &mine, out));
  if (rc == 0) out->format = view.format;
  ml_records_free(&mine);
  if (rc != 0) ml_records_free(out);
  return rc;
}

/* One record of a data file as token ids and loss targets: the formats,
 * their tokens and their targets are those of data/data.h (token ids,
 * text, prompt/completion, messages; raw text as one document). The training and the
 * scoring loaders both read records here, so both build the same tokens
 * from a record. The tokenizer is loaded from the model directory on the
 * first record that needs it, so token-id data never needs (or loads) a
 * tokenizer.json. */
#ifndef ML_DATA_RECORD_H
#define ML_DATA_RECORD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tokenizer/tokenizer.h"
#include "data/data.h"
#include "data/data_chat.h"

typedef struct ml_record_reader {
  const char *path;         /* the data file, for messages */
  const ml_data_opts *opts; /* keys and tokenizer_dir */
  int64_t vocab;            /* token ids must lie in [0, vocab) (config.json vocab_size) */
  ml_tokenizer *tok;        /* NULL until a record needs it */
  bool scoring;             /* loss_mask ignored (log-probs score every token); set by the caller */
  ml_chat *chat;            /* the chat template: NULL until a messages record needs it */
  ml_tokens scratch;        /* encode's output */
  ml_tokens scratch2;       /* a conversation's boundary encodings (data_chat.h) */
  bool has_format;          /* a record has been read */
  ml_data_format format;    /* the file's format: its first record's */
  int64_t first_line;       /* that record's line */
} ml_record_reader;

/* A record's tokens: ids[t] and whether token t is a target of the record
 * (before a row's position-0 rule), t in [0, n). */
typedef struct ml_record {
  int32_t *ids;
  uint8_t *target;
  int64_t n, cap;
  int64_t prompt_len; /* prompt/completion records: tokens before the completion; else 0 */
} ml_record;

/* A reader of the records of `path` under `opts` (both must outlive it).
 * Close with ml_record_reader_close. */
ml_record_reader ml_record_reader_open(const char *path, const ml_data_opts *opts, int64_t vocab);
void ml_record_reader_close(ml_record_reader *r);

/* *present = whether opts->tokenizer_dir holds a tokenizer.json. Errors:
 * it exists but cannot be opened (the file and the reason named). */
int ml_record_tokenizer_present(const ml_record_reader *r, bool *present);

/* The format line s[0, n) selects (its fields, as ml_record_read_line),
 * into *f; false when the line is not a JSON object or has none of the
 * format fields (nothing recorded: ml_record_read_line names the error). */
bool ml_record_peek_format(const ml_record_reader *r, const char *s, size_t n,
                           ml_data_format *f);

/* The file's format as found on an earlier record, line `first_line`, by
 * another reader (another rank's part): records of another format are
 * refused as if this reader had read that record. */
void ml_record_reader_expect(ml_record_reader *r, ml_data_format f, int64_t first_line);

/* Parse line `lineno` of the file, s[0, n), into `rec` (its previous
 * contents replaced): the format its fields select, at least one token,
 * every id in [0, vocab). Sets the file's format on the first record.
 * Errors (file and line named, and the field): those listed for
 * ml_dataset_load's records in data/data.h. */
int ml_record_read_line(ml_record_reader *r, int64_t lineno, const char *s, size_t n,
                        ml_record *rec);

/* The whole raw text text[0, len) as one text document into `rec` (needs
 * tokenizer.json). Errors: no tokenizer.json, the tokenizer's (text not
 * UTF-8: the byte offset), no token, an id >= vocab; the file named. */
int ml_record_read_raw(ml_record_reader *r, const char *text, size_t len, ml_record *rec);

/* The field(s) that hold the file's format's data, for messages:
 * "'input_ids'", "'text'", "'prompt' + 'completion'" (the keys in use) or
 * "'messages'";
 * buf[cap]. Returns buf. */
const char *ml_record_fields(const ml_record_reader *r, char *buf, size_t cap);

/* Append src's tokens and targets to dst. Errors: allocation. */
int ml_record_append(ml_record *dst, const ml_record *src);
/* Append bytes[0, n) as token ids, each a target (raw text without a
 * tokenizer). Errors: allocation. */
int ml_record_append_bytes(ml_record *dst, const unsigned char *bytes, size_t n);

void ml_record_free(ml_record *rec);

#endif

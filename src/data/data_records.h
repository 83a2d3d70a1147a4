/* A data file's records as token ids and targets, in file order, before
 * they become rows (training) or sequences (scoring): read by one rank, or
 * by a group of ranks each reading its part and all-gathering the results
 * (data/data.h ml_data_group), with the same records and the same errors
 * either way. */
#ifndef ML_DATA_RECORDS_H
#define ML_DATA_RECORDS_H

#include <stdint.h>

#include "data/data.h"
#include "data/data_record.h"

typedef struct ml_records {
  ml_record all;       /* every record's tokens and targets, concatenated in file order */
  int64_t *start;      /* [n + 1]: record i is tokens [start[i], start[i + 1]) of all */
  int64_t *prompt_len; /* [n]: ml_record.prompt_len of each record */
  int64_t n;           /* records (raw text: 1 document, or 0 when empty) */
  ml_data_format format;
} ml_records;

/* Every record of `path` into *out (zeroed on entry; free with
 * ml_records_free), by opts->group's ranks together (NULL: this process):
 * each reads its part (data/data_split.h) with the line numbers of the
 * whole file and the format of the file's first record, then the parts
 * are all-gathered; raw text is read whole by each rank. max_len > 0:
 * scoring (ml_seqs_load): loss_mask ignored and each record 2..max_len
 * tokens. Collective over the group; every rank returns the same status
 * and, on failure, the message of the first failing line (or the first
 * failing rank's, for a file error). Errors: those of ml_dataset_load's
 * records (data/data.h), the file unreadable, a file whose size differs
 * between ranks (not the same file on every node), a record's length out
 * of [2, max_len] when scoring (line, field, count). */
int ml_records_load(const char *path, int64_t vocab, int64_t max_len, const ml_data_opts *opts,
                    ml_records *out);
void ml_records_free(ml_records *rs);

#endif

/* A data file cut into one part per rank (data/data.h's multi-rank load):
 * contiguous byte ranges cut at line starts, so that every rank reads
 * (pread) and parses only its own lines. Part q of n covers
 * [cut(q·size/n), cut((q+1)·size/n)), cut(b) being the first line start
 * >= b (0, or a byte after '\n'; the file's size when none), so the parts
 * tile the file in order and each line lies in exactly one part; a line
 * longer than a part leaves later parts empty. Every rank computes the
 * cuts from the file itself, with no communication. */
#ifndef ML_DATA_SPLIT_H
#define ML_DATA_SPLIT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* One rank's part of a data file. */
typedef struct ml_data_part {
  char *buf;        /* the part's bytes [begin, begin + len) (malloc'd; NULL when empty) */
  size_t len;
  uint64_t begin;   /* byte offset of the part in the file */
  uint64_t size;    /* the whole file's size */
  bool jsonl;       /* JSONL: the file's first non-whitespace byte is '{' */
  int64_t newlines; /* '\n' bytes in the part: the next part's first line number is this
                       part's + newlines */
} ml_data_part;

/* Read part `rank` of `nranks` of `path` into *out (zeroed on entry; free
 * with ml_data_part_free). A file that is not JSONL (raw text, one
 * document) is read whole by every rank: its part is the whole file. A
 * path that is not a regular file (a pipe) is read whole and cut in
 * memory. Errors: the file cannot be opened or read (path and reason),
 * out of memory, rank outside [0, nranks). */
int ml_data_part_read(const char *path, int rank, int nranks, ml_data_part *out);
void ml_data_part_free(ml_data_part *p);

#endif

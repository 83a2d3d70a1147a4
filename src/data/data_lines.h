/* The data loaders' file access (data/data.h): the whole file in memory,
 * and iteration over a JSONL file's non-empty
 * lines, each parsed into one JSON object. Messages name the file and the
 * 1-based line. */
#ifndef ML_DATA_LINES_H
#define ML_DATA_LINES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

/* Read the whole of `path` into *buf (malloc'd; free it) of *len bytes.
 * Errors: the file cannot be opened or read, out of memory. */
int ml_data_read_file(const char *path, char **buf, size_t *len);

typedef struct ml_line_iter {
  const char *buf;
  size_t len, pos;
  int64_t lineno; /* 1-based number of the line last returned */
} ml_line_iter;

/* An iterator at the start of buf[0, len). */
ml_line_iter ml_line_iter_start(const char *buf, size_t len);

/* The next line holding something other than whitespace, as s[0, n), or
 * false at the end. */
bool ml_line_next(ml_line_iter *it, const char **s, size_t *n);

/* Number of lines ml_line_next returns over buf[0, len). */
int64_t ml_data_count_lines(const char *buf, size_t len);

/* Line `lineno` of `path`, s[0, n), parsed (duplicate keys rejected) into a
 * JSON object (json_decref it), or NULL with a message naming file and line:
 * invalid JSON (column, jansson's reason) or a value that is not an object. */
json_t *ml_data_parse_line(const char *path, int64_t lineno, const char *s, size_t n);

#endif

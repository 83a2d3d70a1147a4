#include "data/data_lines.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"

int ml_data_read_file(const char *path, char **buf, size_t *len) {
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

ml_line_iter ml_line_iter_start(const char *buf, size_t len) {
  return (ml_line_iter){buf, len, 0, 0};
}

bool ml_line_next(ml_line_iter *it, const char **s, size_t *n) {
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

int64_t ml_data_count_lines(const char *buf, size_t len) {
  ml_line_iter it = ml_line_iter_start(buf, len);
  const char *s;
  size_t n;
  int64_t count = 0;
  while (ml_line_next(&it, &s, &n)) count++;
  return count;
}

json_t *ml_data_parse_line(const char *path, int64_t lineno, const char *s, size_t n) {
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

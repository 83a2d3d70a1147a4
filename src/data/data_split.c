#define _POSIX_C_SOURCE 200809L /* pread */
#include "data/data_split.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/checked.h"
#include "common/status.h"
#include "data/data_lines.h"

/* The file's bytes: pread on a regular file, else a copy in memory. */
typedef struct source {
  const char *path;
  int fd;
  char *mem; /* the whole stream, when not a regular file */
  uint64_t size;
} source;

/* buf[n] = bytes [off, off + n) of the file (n <= size − off). */
static int source_read(const source *s, uint64_t off, char *buf, size_t n) {
  if (s->mem) {
    memcpy(buf, s->mem + off, n);
    return 0;
  }
  for (size_t got = 0; got < n;) {
    ssize_t k = pread(s->fd, buf + got, n - got, (off_t)(off + got));
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0)
      return ml_err("%s: read error at byte %llu: %s", s->path,
                    (unsigned long long)(off + got), k < 0 ? strerror(errno) : "the file shrank");
    got += (size_t)k;
  }
  return 0;
}

enum { SCAN = 1 << 16 };

static bool is_space(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; }

/* Whether the first non-whitespace byte of the file is '{'. */
static int source_jsonl(const source *s, bool *jsonl) {
  char buf[SCAN];
  for (uint64_t at = 0; at < s->size; at += SCAN) {
    size_t n = s->size - at < SCAN ? (size_t)(s->size - at) : SCAN;
    ML_TRY(source_read(s, at, buf, n));
    for (size_t i = 0; i < n; i++) {
      if (!is_space(buf[i])) {
        *jsonl = buf[i] == '{';
        return 0;
      }
    }
  }
  *jsonl = false;
  return 0;
}

/* The first line start >= b (data_split.h). */
static int source_cut(const source *s, uint64_t b, uint64_t *cut) {
  char buf[SCAN];
  if (b == 0 || b >= s->size) {
    *cut = b == 0 ? 0 : s->size;
    return 0;
  }
  for (uint64_t at = b - 1; at < s->size; at += SCAN) {
    size_t n = s->size - at < SCAN ? (size_t)(s->size - at) : SCAN;
    ML_TRY(source_read(s, at, buf, n));
    const char *nl = memchr(buf, '\n', n);
    if (nl) {
      *cut = at + (uint64_t)(nl - buf) + 1;
      return 0;
    }
  }
  *cut = s->size;
  return 0;
}

/* [q·size/n] without overflow. */
static uint64_t nominal(uint64_t size, int q, int n) {
  return (uint64_t)((unsigned __int128)size * (unsigned)q / (unsigned)n);
}

static int read_part(const source *s, int rank, int nranks, ml_data_part *p) {
  p->size = s->size;
  ML_TRY(source_jsonl(s, &p->jsonl));
  uint64_t begin = 0, end = s->size;
  if (p->jsonl) {
    ML_TRY(source_cut(s, nominal(s->size, rank, nranks), &begin));
    ML_TRY(source_cut(s, nominal(s->size, rank + 1, nranks), &end));
  }
  p->begin = begin;
  p->len = (size_t)(end - begin);
  if (p->len == 0) return 0;
  p->buf = ml_malloc_array((int64_t)p->len, 1, "bytes %llu..%llu of %s (this rank's part)",
                           (unsigned long long)begin, (unsigned long long)end, s->path);
  if (!p->buf) return -1;
  ML_TRY(source_read(s, begin, p->buf, p->len));
  for (const char *c = p->buf, *e = p->buf + p->len; (c = memchr(c, '\n', (size_t)(e - c)));)
    c++, p->newlines++;
  return 0;
}

int ml_data_part_read(const char *path, int rank, int nranks, ml_data_part *out) {
  memset(out, 0, sizeof *out);
  if (nranks < 1 || rank < 0 || rank >= nranks)
    return ml_err("%s: data part %d of %d, expected 0 <= part < parts", path, rank, nranks);
  source s = {.path = path, .fd = open(path, O_RDONLY | O_CLOEXEC)};
  if (s.fd < 0) return ml_err("%s: cannot open data file: %s", path, strerror(errno));
  struct stat st;
  int rc = fstat(s.fd, &st) ? ml_err("%s: cannot stat data file: %s", path, strerror(errno)) : 0;
  if (rc == 0 && S_ISREG(st.st_mode)) {
    s.size = (uint64_t)st.st_size;
  } else if (rc == 0) {
    size_t n = 0;
    rc = ml_data_read_file(path, &s.mem, &n);
    s.size = n;
  }
  if (rc == 0) rc = read_part(&s, rank, nranks, out);
  close(s.fd);
  free(s.mem);
  if (rc != 0) ml_data_part_free(out);
  return rc;
}

void ml_data_part_free(ml_data_part *p) {
  free(p->buf);
  memset(p, 0, sizeof *p);
}

#include "common/checked.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

#include "common/status.h"

void *ml_alloc_array_at(const char *file, int line, int64_t count, size_t elem, int zero,
                        const char *what_fmt, ...) {
  int64_t bytes = 0;
  bool fits = count >= 0 && count != ML_SAT && elem <= (size_t)INT64_MAX &&
              !ml_mul_i64(count, (int64_t)elem, &bytes) && (uint64_t)bytes <= SIZE_MAX;
  void *p = NULL;
  if (fits && zero) p = calloc(count ? (size_t)count : 1, elem ? elem : 1);
  else if (fits) p = malloc(bytes ? (size_t)bytes : 1);
  if (p) return p;
  char what[512];
  va_list ap;
  va_start(ap, what_fmt);
  vsnprintf(what, sizeof what, what_fmt, ap);
  va_end(ap);
  if (fits)
    ml_error_set(file, line, "out of memory allocating %lld bytes (%.1f GiB) for %s",
                 (long long)bytes, (double)bytes / (1024.0 * 1024.0 * 1024.0), what);
  else
    ml_error_set(file, line, "out of memory: %s needs more than 2^63 bytes", what);
  return NULL;
}

#include "common/checked.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

#include "common/status.h"

void *ml_alloc_checked_v(const char *file, int line, int64_t count, size_t elem,
                         ml_raw_alloc raw, void *ctx, const char *what_fmt, va_list ap) {
  int64_t bytes = 0;
  bool fits = count >= 0 && count != ML_SAT && elem <= (size_t)INT64_MAX &&
              !ml_mul_i64(count, (int64_t)elem, &bytes) && (uint64_t)bytes <= SIZE_MAX;
  void *p = fits ? raw(ctx, (size_t)bytes) : NULL;
  if (p) return p;
  char what[512];
  vsnprintf(what, sizeof what, what_fmt, ap);
  if (fits)
    ml_error_set(file, line, "out of memory allocating %lld bytes (%.1f GiB) for %s",
                 (long long)bytes, (double)bytes / (1024.0 * 1024.0 * 1024.0), what);
  else
    ml_error_set(file, line, "out of memory: %s needs more than 2^63 bytes", what);
  return NULL;
}

static void *raw_malloc(void *ctx, size_t bytes) { return malloc(bytes ? bytes : 1); }
static void *raw_calloc(void *ctx, size_t bytes) { return calloc(bytes ? bytes : 1, 1); }

void *ml_alloc_array_at(const char *file, int line, int64_t count, size_t elem, int zero,
                        const char *what_fmt, ...) {
  va_list ap;
  va_start(ap, what_fmt);
  void *p = ml_alloc_checked_v(file, line, count, elem, zero ? raw_calloc : raw_malloc, NULL,
                               what_fmt, ap);
  va_end(ap);
  return p;
}

#include "common/status.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static char g_msg[2048];
static int g_set;

int ml_error_set(const char *file, int line, const char *fmt, ...) {
  if (g_set) return -1;
  const char *base = strrchr(file, '/');
  base = base ? base + 1 : file;
  int n = snprintf(g_msg, sizeof g_msg, "%s:%d: ", base, line);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_msg + n, sizeof g_msg - (size_t)n, fmt, ap);
  va_end(ap);
  g_set = 1;
  return -1;
}

const char *ml_error_msg(void) { return g_msg; }

void ml_error_clear(void) {
  g_msg[0] = '\0';
  g_set = 0;
}

void *ml_malloc(size_t bytes, const char *what) {
  void *p = malloc(bytes ? bytes : 1);
  if (!p) ml_err("out of memory allocating %zu bytes for %s", bytes, what);
  return p;
}

void *ml_calloc(size_t count, size_t size, const char *what) {
  void *p = calloc(count ? count : 1, size ? size : 1);
  if (!p) ml_err("out of memory allocating %zu x %zu bytes for %s", count, size, what);
  return p;
}

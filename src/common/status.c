#include "common/status.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static _Thread_local char g_msg[ML_ERROR_MSG_CAP];
static _Thread_local int g_origin = -1; /* −1: nothing recorded */
static int g_rank;

int ml_error_set(const char *file, int line, const char *fmt, ...) {
  if (g_origin >= 0) return -1;
  const char *base = strrchr(file, '/');
  base = base ? base + 1 : file;
  int n = snprintf(g_msg, sizeof g_msg, "%s:%d: ", base, line);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_msg + n, sizeof g_msg - (size_t)n, fmt, ap);
  va_end(ap);
  g_origin = g_rank;
  return -1;
}

const char *ml_error_msg(void) { return g_msg; }

int ml_error_origin(void) { return g_origin; }

void ml_error_clear(void) {
  g_msg[0] = '\0';
  g_origin = -1;
}

int ml_error_adopt(int origin, const char *msg) {
  snprintf(g_msg, sizeof g_msg, "%s", msg);
  g_origin = origin >= 0 ? origin : 0;
  return -1;
}

void ml_error_set_rank(int world_rank) { g_rank = world_rank; }

void ml_warn(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("meshlm: warning: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  fflush(stderr);
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

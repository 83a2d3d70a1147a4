/* Error reporting shared by every layer.
 *
 * Functions return int: 0 on success, -1 on error. On error they record one
 * message with ml_err() (file:line of the check, what was found, what was
 * expected); callers propagate -1 and the CLI prints ml_error_msg() on rank 0
 * before every rank exits non-zero. Like errno, the message is per process. */
#ifndef ML_STATUS_H
#define ML_STATUS_H

#include <stdarg.h>
#include <stddef.h>

/* Record an error message (printf format). Always returns -1 so that
 * `return ml_err(...)` reads naturally. The first message recorded since the
 * last ml_error_clear() wins: it is closest to the cause. */
#define ml_err(...) ml_error_set(__FILE__, __LINE__, __VA_ARGS__)
int ml_error_set(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* The recorded message ("" when none). */
const char *ml_error_msg(void);

/* Forget the recorded message. */
void ml_error_clear(void);

/* Propagate a failing call: ML_TRY(f(x)); returns -1 from the caller. */
#define ML_TRY(expr)                                                           \
  do {                                                                         \
    if ((expr) != 0) return -1;                                                \
  } while (0)

/* Allocation that records an error instead of crashing: returns NULL and
 * sets the message "out of memory allocating N bytes for WHAT". */
void *ml_malloc(size_t bytes, const char *what);
void *ml_calloc(size_t count, size_t size, const char *what);

#endif

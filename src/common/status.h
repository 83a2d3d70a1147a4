/* Error reporting shared by every layer.
 *
 * Functions return int: 0 on success, -1 on error. On error they record one
 * message with ml_err() (file:line of the check, what was found, what was
 * expected) and callers propagate -1. The record belongs to the failure
 * being propagated: the first message recorded since the last
 * ml_error_clear() wins, as it is closest to the cause. Whoever handles the
 * failure clears it, so the next one starts afresh: the CLI once it has
 * printed it (ml_cli_agree), an agreement across ranks that replaces it by
 * the group's first failing rank's message (ml_host_agree, comm/host.h), a
 * caller that recovers and carries on. One record per thread, like errno.
 *
 * A record carries its origin, the world rank of the process where it
 * arose (ml_error_set_rank), so a message that travelled to another rank
 * still names the rank that failed. */
#ifndef ML_STATUS_H
#define ML_STATUS_H

#include <stdarg.h>
#include <stddef.h>

/* Record an error message (printf format), unless one is recorded already.
 * Always returns -1 so that `return ml_err(...)` reads naturally. */
#define ml_err(...) ml_error_set(__FILE__, __LINE__, __VA_ARGS__)
int ml_error_set(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* The recorded message ("" when none). */
const char *ml_error_msg(void);

/* The world rank where the recorded message arose; −1 when none is recorded. */
int ml_error_origin(void);

/* Forget the recorded message: the failure has been handled. */
void ml_error_clear(void);

/* Replace the record by `msg`, a message that arose on world rank `origin`
 * (received from it: ml_host_agree). Returns -1. */
int ml_error_adopt(int origin, const char *msg);

/* This process's world rank, the origin of the messages it records (0 until
 * set; the CLI sets it after MPI_Init). */
void ml_error_set_rank(int world_rank);

/* Longest message kept, terminating NUL included; longer ones are cut. */
#define ML_ERROR_MSG_CAP 2048

/* A warning: "meshlm: warning: ..." and a newline on stderr (printf
 * format). The caller decides which rank warns (usually world rank 0). */
void ml_warn(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

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

/* Failures collected per rank and agreed after the collectives, so one
 * failing rank cannot leave the others waiting in a collective. Include
 * after <cmocka.h> and <mpi.h>. */
#ifndef ML_RANK_REPORT_H
#define ML_RANK_REPORT_H

#include <stdarg.h>
#include <stdio.h>

typedef struct report {
  int bad;
  char first[512];
} report;

/* Record a failure on this rank (the first message is kept). */
static inline void note(report *rep, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static inline void note(report *rep, const char *fmt, ...) {
  if (rep->bad++) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(rep->first, sizeof rep->first, fmt, ap);
  va_end(ap);
}

/* Fail on every rank when any rank noted a failure; `what` names it. */
static inline void agree(const report *rep, const char *what) {
  int any = 0, rank;
  MPI_Allreduce(&rep->bad, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rep->bad) fprintf(stderr, "rank %d: %d %s, first: %s\n", rank, rep->bad, what, rep->first);
  if (any) fail_msg("%s on some rank (see stderr)", what);
}

#endif

/* One writer per run-checkpoint directory: `meshlm train --save DIR` holds
 * an exclusive lock on DIR for the life of the run, so a second run saving
 * into the same DIR is refused at start instead of both runs overwriting
 * and pruning each other's step directories (torch's DCP leaves this to
 * the user; we enforce it).
 *
 * The lock is flock(2) LOCK_EX on DIR/.meshlm-lock, which records the
 * holder ("pid P on host H"). The kernel drops it when the holder exits,
 * however it exits (kill -9 included), so a stale lock file never blocks a
 * later run. flock needs a file system that supports it across the hosts
 * that share DIR (local disks, NFSv4, Lustre with -o flock). */
#ifndef ML_RUNLOCK_H
#define ML_RUNLOCK_H

typedef struct ml_run_lock {
  int fd; /* the open lock file; −1 when not held */
} ml_run_lock;

/* The lock file's name inside DIR. */
#define ML_RUN_LOCK_FILE ".meshlm-lock"

/* Create DIR (and parents) if needed and take its lock without waiting.
 * Call on one rank (world rank 0). Errors: another process holds it (the
 * message names DIR and the holder's pid and host as the lock file records
 * them), DIR or the lock file cannot be created (path and reason). On
 * error *out is not held. */
int ml_run_lock_take(const char *dir, ml_run_lock *out);

/* Release the lock (a no-op when not held). The lock file stays: removing
 * it could race with a run that is taking it. */
void ml_run_lock_release(ml_run_lock *l);

#endif

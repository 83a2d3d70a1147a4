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
 * that share DIR (local disks, NFSv4, Lustre with -o flock); where flock
 * fails with ENOLCK, EOPNOTSUPP or ENOSYS the run goes on without the lock
 * after one warning naming DIR (two runs saving into it would not be kept
 * apart). Test hook: MESHLM_TEST_FLOCK_UNSUPPORTED set to one of those
 * names makes flock fail so (tests/cli/test_run_faults.sh).
 *
 * A run that fails leaves DIR as it found it where it can: when it created
 * the lock file and nothing else was written into DIR, the lock file goes,
 * and DIR (with the parents the run created) when the run created it
 * (ml_run_lock_abandon). A run taking the lock removes the step directories
 * no latest.json commits (a save killed before its commit), naming them in
 * one warning. */
#ifndef ML_RUNLOCK_H
#define ML_RUNLOCK_H

#include <stdbool.h>
#include <stddef.h>

typedef struct ml_run_lock {
  int fd;          /* the open lock file; −1 when not held */
  const char *dir; /* DIR as given to ml_run_lock_take (the caller's string) */
  size_t created;  /* length of the shallowest of DIR and its parents that the
                      take created (a prefix of dir); 0: DIR existed */
  bool made_file;  /* the take created the lock file */
} ml_run_lock;

/* The lock file's name inside DIR. */
#define ML_RUN_LOCK_FILE ".meshlm-lock"

/* Create DIR (and parents) if needed, take its lock without waiting (or go
 * on unlocked, warning, where the file system has no flock), record
 * the holder, then remove DIR's uncommitted step directories (ml_rc_clean:
 * one warning names them). Call on one rank (world rank 0); `dir` must
 * outlive the lock. Errors: another process holds it (the message names
 * DIR and the holder's pid and host as the lock file records them), DIR or
 * the lock file cannot be created (path and reason), a malformed
 * DIR/latest.json, I/O. On error *out is not held and what the take
 * created is removed as ml_run_lock_abandon does. */
int ml_run_lock_take(const char *dir, ml_run_lock *out);

/* Release the lock (a no-op when not held). The lock file stays in DIR. */
void ml_run_lock_release(ml_run_lock *l);

/* Release the lock of a run that failed: when the take created the lock
 * file and DIR holds nothing else (nothing committed, nothing written), the
 * lock file is removed, and with it DIR and the parents the take created.
 * Best effort: the run's own error is what the user sees. A no-op when not
 * held. */
void ml_run_lock_abandon(ml_run_lock *l);

#endif

#define _DEFAULT_SOURCE /* flock, gethostname */

#include "ckpt/runlock.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

#include "common/status.h"
#include "io/checkpoint.h"

/* The holder as the lock file records it, one line ("" when unreadable). */
static void read_holder(int fd, char *out, size_t cap) {
  ssize_t n = pread(fd, out, cap - 1, 0);
  out[n > 0 ? n : 0] = '\0';
  out[strcspn(out, "\n")] = '\0';
}

int ml_run_lock_take(const char *dir, ml_run_lock *out) {
  out->fd = -1;
  ML_TRY(ml_ckpt_make_dirs(dir));
  char path[4096];
  if (snprintf(path, sizeof path, "%s/%s", dir, ML_RUN_LOCK_FILE) >= (int)sizeof path)
    return ml_err("%s: path too long for its lock file", dir);
  int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
  if (fd < 0) return ml_err("%s: cannot open the lock file: %s", path, strerror(errno));
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    int err = errno;
    char holder[256];
    read_holder(fd, holder, sizeof holder);
    close(fd);
    if (err != EWOULDBLOCK) return ml_err("%s: cannot lock: %s", path, strerror(err));
    return ml_err("%s: another meshlm run is saving into this checkpoint directory (%s, lock "
                  "file %s); expected one writer per directory: let it finish or save elsewhere",
                  dir, holder[0] ? holder : "holder unknown", path);
  }
  char host[256] = "?";
  gethostname(host, sizeof host - 1);
  host[sizeof host - 1] = '\0';
  char line[320];
  int n = snprintf(line, sizeof line, "pid %ld on host %s\n", (long)getpid(), host);
  if (ftruncate(fd, 0) != 0 || pwrite(fd, line, (size_t)n, 0) != n) {
    int err = errno;
    close(fd); /* drops the lock */
    return ml_err("%s: cannot record the lock holder: %s", path, strerror(err));
  }
  out->fd = fd;
  return 0;
}

void ml_run_lock_release(ml_run_lock *l) {
  if (l->fd >= 0) close(l->fd); /* closing the last descriptor drops the flock */
  l->fd = -1;
}

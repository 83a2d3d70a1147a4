#define _DEFAULT_SOURCE /* flock, gethostname */

#include "ckpt/runlock.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/status.h"
#include "io/checkpoint.h"
#include "ckpt/runckpt_format.h"

enum { PATH_CAP = 4096, OPEN_TRIES = 16 };

/* The errors of a file system without flock: the run goes on unlocked. */
static const struct {
  const char *name;
  int err;
} k_no_flock[] = {{"ENOLCK", ENOLCK}, {"EOPNOTSUPP", EOPNOTSUPP}, {"ENOSYS", ENOSYS}};
enum { N_NO_FLOCK = sizeof k_no_flock / sizeof k_no_flock[0] };

static bool flock_unsupported(int err) {
  for (int i = 0; i < N_NO_FLOCK; i++)
    if (k_no_flock[i].err == err) return true;
  return false;
}

/* flock(fd, LOCK_EX | LOCK_NB), or (test hook, runlock.h) the failure that
 * MESHLM_TEST_FLOCK_UNSUPPORTED names. */
static int lock_fd(int fd) {
  const char *v = getenv("MESHLM_TEST_FLOCK_UNSUPPORTED");
  for (int i = 0; v && i < N_NO_FLOCK; i++)
    if (strcmp(v, k_no_flock[i].name) == 0) {
      errno = k_no_flock[i].err;
      return -1;
    }
  return flock(fd, LOCK_EX | LOCK_NB);
}

/* The holder as the lock file records it, one line ("" when unreadable). */
static void read_holder(int fd, char *out, size_t cap) {
  ssize_t n = pread(fd, out, cap - 1, 0);
  out[n > 0 ? n : 0] = '\0';
  out[strcspn(out, "\n")] = '\0';
}

/* The length of dir's shallowest prefix (a whole path component: dir
 * itself or an ancestor) that does not exist; 0 when dir exists. */
static size_t first_missing(const char *dir) {
  char p[PATH_CAP];
  snprintf(p, sizeof p, "%s", dir);
  struct stat sb;
  for (size_t i = p[0] == '/';; i++) { /* i: the end of a prefix; "/" exists */
    if (p[i] != '/' && p[i] != '\0') continue;
    char c = p[i];
    p[i] = '\0';
    bool missing = stat(p, &sb) != 0 && errno == ENOENT;
    p[i] = c;
    if (missing) return i;
    if (!c) return 0;
  }
}

/* Open and lock path (the lock file of dir, created with dir when
 * missing): the descriptor (not locked where the file system has no flock,
 * after a warning), or −1 with the error recorded. The file is
 * checked to be still in place once locked: a run that failed may remove
 * its lock file (ml_run_lock_abandon) after another opened it, and a lock
 * on a removed file keeps nobody out; then the new file is taken. */
static int open_locked(const char *dir, const char *path, bool *made) {
  for (int t = 0; t < OPEN_TRIES; t++) {
    ML_TRY(ml_ckpt_make_dirs(dir));
    int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    *made = fd >= 0;
    if (fd < 0 && errno == EEXIST) fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0 && errno == ENOENT) continue; /* removed since: again */
    if (fd < 0) return ml_err("%s: cannot open the lock file: %s", path, strerror(errno));
    if (lock_fd(fd) != 0) {
      int err = errno;
      if (flock_unsupported(err)) {
        ml_warn("%s: the file system does not support flock (%s): two runs saving into %s "
                "would not be kept apart; going on without the lock",
                dir, strerror(err), dir);
        return fd;
      }
      char holder[256];
      read_holder(fd, holder, sizeof holder);
      close(fd);
      if (err != EWOULDBLOCK) return ml_err("%s: cannot lock: %s", path, strerror(err));
      return ml_err("%s: another meshlm run is saving into this checkpoint directory (%s, lock "
                    "file %s); expected one writer per directory: let it finish or save elsewhere",
                    dir, holder[0] ? holder : "holder unknown", path);
    }
    struct stat held, now;
    if (fstat(fd, &held) == 0 && stat(path, &now) == 0 && held.st_dev == now.st_dev &&
        held.st_ino == now.st_ino)
      return fd;
    close(fd);
  }
  return ml_err("%s: the lock file was removed under this run %d times while it took it; expected "
                "it to stay in place", path, OPEN_TRIES);
}

int ml_run_lock_take(const char *dir, ml_run_lock *out) {
  *out = (ml_run_lock){.fd = -1, .dir = dir};
  char path[PATH_CAP];
  if (snprintf(path, sizeof path, "%s/%s", dir, ML_RUN_LOCK_FILE) >= (int)sizeof path)
    return ml_err("%s: path too long for its lock file", dir);
  out->created = first_missing(dir);
  out->fd = open_locked(dir, path, &out->made_file);
  if (out->fd < 0) return -1;
  char host[256] = "?";
  gethostname(host, sizeof host - 1);
  host[sizeof host - 1] = '\0';
  char line[320];
  int n = snprintf(line, sizeof line, "pid %ld on host %s\n", (long)getpid(), host);
  int rc = 0;
  if (ftruncate(out->fd, 0) != 0 || pwrite(out->fd, line, (size_t)n, 0) != n)
    rc = ml_err("%s: cannot record the lock holder: %s", path, strerror(errno));
  if (rc == 0) rc = ml_rc_clean(dir); /* under the lock: no save of another run is under way */
  if (rc != 0) ml_run_lock_abandon(out);
  return rc;
}

/* DIR holds nothing but its lock file. */
static bool only_lock_file(const char *dir) {
  DIR *d = opendir(dir);
  if (!d) return false;
  struct dirent *ent;
  bool only = true;
  while (only && (ent = readdir(d)) != NULL)
    only = strcmp(ent->d_name, ".") == 0 || strcmp(ent->d_name, "..") == 0 ||
           strcmp(ent->d_name, ML_RUN_LOCK_FILE) == 0;
  closedir(d);
  return only;
}

/* rmdir dir, then its parents while they are at least `created` bytes long
 * (the directories ml_run_lock_take created); stops at the first that
 * cannot be removed. */
static void remove_created(const char *dir, size_t created) {
  char p[PATH_CAP];
  size_t n = (size_t)snprintf(p, sizeof p, "%s", dir);
  for (;;) {
    while (n > 1 && p[n - 1] == '/') p[--n] = '\0';
    if (n < created || rmdir(p) != 0) return;
    while (n > 0 && p[n - 1] != '/') n--;
    p[n] = '\0';
  }
}

void ml_run_lock_abandon(ml_run_lock *l) {
  char path[PATH_CAP];
  if (l->fd >= 0 && l->made_file && only_lock_file(l->dir) &&
      snprintf(path, sizeof path, "%s/%s", l->dir, ML_RUN_LOCK_FILE) < (int)sizeof path &&
      unlink(path) == 0 && l->created > 0)
    remove_created(l->dir, l->created); /* still locked: a run that opened the removed file
                                           fails its flock, or later finds it gone */
  ml_run_lock_release(l);
}

void ml_run_lock_release(ml_run_lock *l) {
  if (l->fd >= 0) close(l->fd); /* closing the last descriptor drops the flock */
  l->fd = -1;
}

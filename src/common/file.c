#include "common/file.h"

#include <errno.h>
#include <string.h>
#include <unistd.h>

#include "common/status.h"

int ml_file_open_tmp(const char *path, char *tmp, size_t cap, FILE **fp) {
  if ((size_t)snprintf(tmp, cap, "%s.tmp", path) >= cap)
    return ml_err("%s: path too long (%zu bytes at most)", path, cap - 5);
  *fp = fopen(tmp, "wb");
  if (!*fp) return ml_err("%s: cannot create %s: %s", path, tmp, strerror(errno));
  return 0;
}

int ml_file_commit(FILE *fp, const char *tmp, const char *path) {
  int bad = fflush(fp) != 0 || fsync(fileno(fp)) != 0;
  int err = errno;
  if (fclose(fp) != 0 && !bad) {
    bad = 1;
    err = errno;
  }
  if (bad || rename(tmp, path) != 0) {
    if (!bad) err = errno;
    unlink(tmp);
    return ml_err("%s: cannot write (via %s): %s", path, tmp, strerror(err));
  }
  return 0;
}

void ml_file_abandon(FILE *fp, const char *tmp) {
  fclose(fp);
  unlink(tmp);
}

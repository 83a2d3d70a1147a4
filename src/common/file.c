#include "common/file.h"

#include <errno.h>
#include <stdbool.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/status.h"

/* A special file (device, FIFO, socket), written in place: opened for
 * writing without O_CREAT or O_TRUNC. */
static int open_in_place(const char *path, FILE **fp) {
  int fd = open(path, O_WRONLY | O_CLOEXEC);
  if (fd < 0) return ml_err("%s: cannot open for writing: %s", path, strerror(errno));
  *fp = fdopen(fd, "wb");
  if (!*fp) {
    int err = errno;
    close(fd);
    return ml_err("%s: cannot open for writing: %s", path, strerror(err));
  }
  return 0;
}

int ml_file_open_tmp(const char *path, char *tmp, size_t cap, FILE **fp) {
  *fp = NULL;
  tmp[0] = '\0';
  struct stat sb;
  bool exists = stat(path, &sb) == 0;
  if (exists && S_ISDIR(sb.st_mode))
    return ml_err("%s: is a directory; expected a file to write (a new or regular file, a device "
                  "or a FIFO)", path);
  if (exists && !S_ISREG(sb.st_mode)) return open_in_place(path, fp);
  if ((size_t)snprintf(tmp, cap, "%s.tmp", path) >= cap) {
    tmp[0] = '\0';
    return ml_err("%s: path too long (%zu bytes at most)", path, cap - 5);
  }
  *fp = fopen(tmp, "wb");
  if (!*fp) return ml_err("%s: cannot create %s: %s", path, tmp, strerror(errno));
  return 0;
}

int ml_file_commit(FILE *fp, const char *tmp, const char *path) {
  bool in_place = tmp[0] == '\0';
  int bad = fflush(fp) != 0 || (!in_place && fsync(fileno(fp)) != 0);
  int err = errno;
  if (fclose(fp) != 0 && !bad) {
    bad = 1;
    err = errno;
  }
  if (in_place)
    return bad ? ml_err("%s: cannot write: %s", path, strerror(err)) : 0;
  if (bad || rename(tmp, path) != 0) {
    if (!bad) err = errno;
    unlink(tmp);
    return ml_err("%s: cannot write (via %s): %s", path, tmp, strerror(err));
  }
  return 0;
}

void ml_file_abandon(FILE *fp, const char *tmp) {
  fclose(fp);
  if (tmp[0]) unlink(tmp);
}

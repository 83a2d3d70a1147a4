/* Crash-safe file output. A regular file (or a path that does not exist
 * yet) is written to PATH.tmp, then committed with fflush + fsync + close +
 * rename, so PATH is either the old file or the complete new one (never
 * half-written). A special file (a character or block device such as
 * /dev/null, a FIFO) is written in place instead: renaming over it would
 * replace the device node with a regular file. A directory is refused. */
#ifndef ML_FILE_H
#define ML_FILE_H

#include <stdio.h>

/* Open `path` for writing. A regular or absent path: open `path`.tmp
 * (created or truncated), its name written to tmp[cap]. A special file:
 * open `path` itself for writing without creating or truncating it (a
 * FIFO's open waits for its reader), tmp[0] = '\0'. Errors: the path is a
 * directory, the path is too long, the open fails (message names the
 * file). */
int ml_file_open_tmp(const char *path, char *tmp, size_t cap, FILE **fp);

/* Flush, fsync and close `fp` (open on `tmp`), then rename tmp over path;
 * for a special file (tmp "") flush and close only. On error the temp file
 * is removed and the message names path (and tmp). */
int ml_file_commit(FILE *fp, const char *tmp, const char *path);

/* Close `fp` and remove its temp file (after an error); a special file
 * written in place (tmp "") keeps what reached it. */
void ml_file_abandon(FILE *fp, const char *tmp);

#endif

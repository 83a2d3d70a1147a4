/* Crash-safe file output: write to PATH.tmp, then commit with
 * fflush + fsync + close + rename, so PATH is either the old file or the
 * complete new one (never half-written). */
#ifndef ML_FILE_H
#define ML_FILE_H

#include <stdio.h>

/* Open `path`.tmp for writing; the temp path is written to tmp[cap].
 * Errors: the path is too long, fopen fails (message names the file). */
int ml_file_open_tmp(const char *path, char *tmp, size_t cap, FILE **fp);

/* Flush, fsync and close `fp` (open on `tmp`), then rename tmp over path.
 * On error the temp file is removed and the message names path and tmp. */
int ml_file_commit(FILE *fp, const char *tmp, const char *path);

/* Close `fp` and remove its temp file (after an error). */
void ml_file_abandon(FILE *fp, const char *tmp);

#endif

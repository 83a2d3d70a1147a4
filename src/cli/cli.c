#define _POSIX_C_SOURCE 200809L /* dirent, stat */

#include "cli/cli.h"

#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <mpi.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli/args.h"
#include "common/status.h"
#include "io/safetensors.h"

static int world_rank(void) {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

static int world_size(void) {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

/* "meshlm: error: MSG", with the rank it arose on when there are several. */
static void print_error(const char *how) {
  if (world_size() > 1)
    fprintf(stderr, "meshlm: error (rank %d%s): %s\n", ml_error_origin(), how, ml_error_msg());
  else
    fprintf(stderr, "meshlm: error: %s\n", ml_error_msg());
  fflush(stderr);
}

int ml_cli_agree(ml_host *world, int rc) {
  int first = -1;
  if (ml_host_first_failing(world, rc, &first)) first = world->rank; /* the channel failed */
  if (first < 0) return 0;
  if (world->rank == first) print_error("");
  ml_error_clear(); /* handled: printed once, by the lowest failing rank */
  return -1;
}

_Noreturn void ml_cli_abort(void) {
  print_error(world_size() > 1 ? ", aborting every rank" : "");
  MPI_Abort(MPI_COMM_WORLD, 1);
  exit(1);
}

void ml_cli_print(const char *fmt, ...) {
  if (world_rank() != 0) return;
  va_list ap;
  va_start(ap, fmt);
  vprintf(fmt, ap);
  va_end(ap);
  fflush(stdout);
}

int ml_cli_parse(const char *cmd, const char *summary, int argc, char **argv, const ml_arg *spec,
                 size_t n) {
  for (int i = 0; i < argc; i++) {
    bool help = strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0;
    if (!help && strcmp(argv[i], "--synopsis") != 0) continue;
    if (world_rank() == 0 && help) ml_args_usage(stdout, cmd, summary, spec, n);
    else if (world_rank() == 0) ml_args_synopsis(stdout, cmd, spec, n);
    return 1;
  }
  char word[64]; /* the command's name without its positional arguments, for messages */
  snprintf(word, sizeof word, "%.*s", (int)strcspn(cmd, " "), cmd);
  return ml_args_parse(word, argc, argv, spec, n);
}

const char *ml_cli_bytes(int64_t bytes, char *buf, size_t cap) {
  const char *u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = (double)bytes;
  int k = 0;
  while (v >= 1024.0 && k < 4) {
    v /= 1024.0;
    k++;
  }
  if (k == 0) snprintf(buf, cap, "%" PRId64 " B", bytes);
  else snprintf(buf, cap, "%.2f %s", v, u[k]);
  return buf;
}

static bool ends_with(const char *s, const char *tail) {
  size_t n = strlen(s), k = strlen(tail);
  return n >= k && strcmp(s + n - k, tail) == 0;
}

int ml_cli_export_summary(const char *dir, char *buf, size_t cap) {
  DIR *d = opendir(dir);
  if (!d) return ml_err("%s: cannot list the export: %s", dir, strerror(errno));
  int64_t files = 0, st_files = 0, tensors = 0, bytes = 0;
  int rc = 0;
  char path[4096];
  for (struct dirent *e; rc == 0 && (e = readdir(d));) {
    struct stat sb;
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    if (stat(path, &sb) != 0) {
      rc = ml_err("%s: cannot stat: %s", path, strerror(errno));
      break;
    }
    if (!S_ISREG(sb.st_mode)) continue;
    files++;
    bytes += (int64_t)sb.st_size;
    if (!ends_with(e->d_name, ".safetensors")) continue;
    ml_st_file f;
    rc = ml_st_open(path, &f);
    if (rc == 0) tensors += (int64_t)f.n;
    ml_st_close(&f);
    st_files++;
  }
  closedir(d);
  ML_TRY(rc);
  char h[32];
  snprintf(buf, cap,
           "%" PRId64 " tensor%s in %" PRId64 " safetensors file%s, %" PRId64 " file%s, %" PRId64
           " bytes (%s)",
           tensors, tensors == 1 ? "" : "s", st_files, st_files == 1 ? "" : "s", files,
           files == 1 ? "" : "s", bytes, ml_cli_bytes(bytes, h, sizeof h));
  return 0;
}

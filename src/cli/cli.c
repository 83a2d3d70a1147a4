#include "cli/cli.h"

#include <mpi.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include <string.h>

#include "cli/args.h"
#include "common/status.h"

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
  for (int i = 0; i < argc; i++)
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      if (world_rank() == 0) ml_args_usage(stdout, cmd, summary, spec, n);
      return 1;
    }
  return ml_args_parse(cmd, argc, argv, spec, n);
}

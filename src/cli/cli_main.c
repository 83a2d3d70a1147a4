/* The command-line program in the library: meshlm_cli_main
 * (include/meshlm/meshlm.h), which the meshlm binary calls. */
#include <mpi.h>
#include <stdio.h>
#include <string.h>

#include "backend/backend.h"
#include "cli/cli.h"
#include "common/status.h"
#include "meshlm/meshlm.h"

static void usage(FILE *f) {
  fprintf(f,
          "usage: meshlm <command> [flags]   (or: mpirun -np N meshlm <command> [flags])\n"
          "commands:\n"
          "  init      write a randomly initialised HF checkpoint (config.json + safetensors)\n"
          "  train     train a checkpoint on JSONL token ids or raw text over the mesh\n"
          "  logprobs  per-token log-probs of JSONL sequences (vocab-parallel)\n"
          "  plan      a mesh's plan, shards, collectives and memory (one process, config only)\n"
          "  export    the latest run checkpoint (train --save) as an HF checkpoint (one process)\n"
          "  tokenize  JSONL text to JSONL input_ids with the model's tokenizer.json (one process)\n"
          "  plot      a train --metrics curve: PNG with gnuplot, else a sparkline (one process)\n"
          "  version   print the version (also: meshlm --version)\n"
          "'meshlm <command> --help' lists a command's flags; 'meshlm --synopsis' every "
          "command's, in one block.\n");
}

/* meshlm version: takes no flag (but --help / --synopsis). */
static int cmd_version(ml_host *world, int argc, char **argv) {
  int rc =
      ml_cli_parse("version", "print the version (also: meshlm --version)", argc, argv, NULL, 0);
  if (rc == 1) return 0;
  ML_TRY(ml_cli_agree(world, rc));
  ml_cli_print("meshlm %s\n", meshlm_version());
  return 0;
}

static const struct {
  const char *name;
  int (*run)(ml_host *world, int argc, char **argv);
} k_commands[] = {{"init", ml_cmd_init},         {"train", ml_cmd_train},
                  {"logprobs", ml_cmd_logprobs}, {"plan", ml_cmd_plan},
                  {"export", ml_cmd_export},     {"tokenize", ml_cmd_tokenize},
                  {"plot", ml_cmd_plot},         {"version", cmd_version}};
enum { N_COMMANDS = sizeof k_commands / sizeof k_commands[0] };

/* meshlm --synopsis: every command's synopsis, the README's CLI block. */
static int synopsis(ml_host *world) {
  char flag[] = "--synopsis", *argv[] = {flag, NULL};
  for (int i = 0; i < N_COMMANDS; i++) ML_TRY(k_commands[i].run(world, 1, argv));
  return 0;
}

static int dispatch(ml_host *world, int argc, char **argv) {
  const char *cmd = argc > 1 ? argv[1] : "";
  for (int i = 0; i < N_COMMANDS; i++)
    if (strcmp(cmd, k_commands[i].name) == 0) return k_commands[i].run(world, argc - 2, argv + 2);
  if (strcmp(cmd, "--version") == 0) return cmd_version(world, argc - 2, argv + 2);
  if (strcmp(cmd, "--synopsis") == 0) return synopsis(world);
  if (strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0) {
    if (world->rank == 0) usage(stdout);
    return 0;
  }
  if (world->rank == 0) {
    fprintf(stderr,
            "meshlm: error: unknown command '%s'; expected init, train, logprobs, plan, "
            "export, tokenize, plot or version\n",
            cmd);
    usage(stderr);
  }
  return 1;
}

int meshlm_cli_main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  ml_error_set_rank(rank);
  ml_host *world = NULL;
  if (ml_host_create(MPI_COMM_WORLD, "world", &world)) ml_cli_abort();
  int rc = dispatch(world, argc, argv);
  ml_host_destroy(world);
  ml_backend_release_all();
  MPI_Finalize();
  return rc == 0 ? 0 : 1;
}

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
          "'meshlm <command> --help' lists a command's flags.\n");
}

int meshlm_cli_main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  ml_error_set_rank(rank);
  ml_host *world = NULL;
  if (ml_host_create(MPI_COMM_WORLD, "world", &world)) ml_cli_abort();
  int rc = 1;
  const char *cmd = argc > 1 ? argv[1] : "";
  if (strcmp(cmd, "init") == 0) rc = ml_cmd_init(world, argc - 2, argv + 2);
  else if (strcmp(cmd, "train") == 0) rc = ml_cmd_train(world, argc - 2, argv + 2);
  else if (strcmp(cmd, "logprobs") == 0) rc = ml_cmd_logprobs(world, argc - 2, argv + 2);
  else if (strcmp(cmd, "plan") == 0) rc = ml_cmd_plan(world, argc - 2, argv + 2);
  else if (strcmp(cmd, "export") == 0) rc = ml_cmd_export(world, argc - 2, argv + 2);
  else if (strcmp(cmd, "tokenize") == 0) rc = ml_cmd_tokenize(world, argc - 2, argv + 2);
  else if (strcmp(cmd, "plot") == 0) rc = ml_cmd_plot(world, argc - 2, argv + 2);
  else if (strcmp(cmd, "version") == 0 || strcmp(cmd, "--version") == 0) {
    ml_cli_print("meshlm %s\n", meshlm_version());
    rc = 0;
  } else if (strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0) {
    usage(stdout);
    rc = 0;
  } else {
    if (rank == 0) {
      fprintf(stderr,
              "meshlm: error: unknown command '%s'; expected init, train, logprobs, plan, "
              "export, tokenize, plot or version\n",
              cmd);
      usage(stderr);
    }
  }
  ml_host_destroy(world);
  ml_backend_release_all();
  MPI_Finalize();
  return rc == 0 ? 0 : 1;
}

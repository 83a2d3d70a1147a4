/* meshlm export: consolidate the latest committed run checkpoint (meshlm
 * train --save DIR) into an HF checkpoint that transformers'
 * from_pretrained loads (train/runckpt.h, ml_run_export). One process does
 * the work and runs no collective: launched under mpirun with several
 * ranks, rank 0 exports and the others only wait for its result. */
#include <stdint.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "common/status.h"
#include "train/runckpt.h"
#include "train/save.h"

int ml_cmd_export(ml_host *world, int argc, char **argv) {
  const char *ckpt = NULL, *out = NULL;
  int64_t max_shard = (int64_t)ML_HF_MAX_SHARD_BYTES;
  ml_arg spec[] = {
      {"--checkpoint", ML_ARG_STR, &ckpt, "run checkpoint directory (meshlm train --save)", true},
      {"--out", ML_ARG_STR, &out, "output directory (config.json + model.safetensors)", true},
      {"--max-shard-size", ML_ARG_INT, &max_shard,
       "bytes per safetensors file; above, shards + index (0 = one file)", false},
  };
  int rc = ml_cli_parse("export", "write the latest run checkpoint as an HF checkpoint", argc, argv,
                        spec, sizeof spec / sizeof spec[0]);
  if (rc == 1) return 0;
  if (rc == 0 && max_shard < 0)
    rc = ml_err("export: --max-shard-size %lld: expected a byte count >= 0", (long long)max_shard);
  if (rc == 0 && world->rank == 0) rc = ml_run_export(ckpt, out, (size_t)max_shard);
  ML_TRY(ml_cli_agree(world, rc));
  ml_cli_print("export: wrote %s from the latest checkpoint in %s\n", out, ckpt);
  return 0;
}

/* meshlm export: consolidate the latest committed run checkpoint (meshlm
 * train --save DIR) into an HF checkpoint that transformers'
 * from_pretrained loads, with the rest of the model the run started from
 * (ckpt/runckpt.h, ml_run_export; ckpt/hf_export.h). One process does
 * the work and runs no collective: launched under mpirun with several
 * ranks, rank 0 exports and the others only wait for its result. On
 * success it prints one line: the directory, its tensors, files and bytes. */
#include <stdint.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "common/status.h"
#include "ckpt/runckpt.h"
#include "ckpt/save.h"

int ml_cmd_export(ml_host *world, int argc, char **argv) {
  const char *ckpt = NULL, *out = NULL;
  int64_t max_shard = (int64_t)ML_HF_MAX_SHARD_BYTES;
  ml_arg_choice dtype = {ml_export_dtype_names, ML_EXPORT_DTYPE_SOURCE};
  ml_arg spec[] = {
      {"--checkpoint", ML_ARG_STR, &ckpt, "run checkpoint directory (meshlm train --save)", true,
       "DIR"},
      {"--out", ML_ARG_STR, &out, "output directory (an HF checkpoint: config.json, weights, "
       "tokenizer files)", true, "HFDIR"},
      {"--max-shard-size", ML_ARG_INT, &max_shard,
       "bytes per safetensors file; above, shards + index (0 = one file)", false, "BYTES"},
      {"--export-dtype", ML_ARG_CHOICE, &dtype,
       "dtype of the trained tensors (source: each as in the source model)", false, NULL},
  };
  int rc = ml_cli_parse("export", "write the latest run checkpoint as an HF checkpoint", argc, argv,
                        spec, sizeof spec / sizeof spec[0]);
  if (rc == 1) return 0;
  if (rc == 0 && max_shard < 0)
    rc = ml_err("export: --max-shard-size %lld: expected a byte count >= 0", (long long)max_shard);
  char what[256] = "";
  if (rc == 0 && world->rank == 0)
    rc = ml_run_export(ckpt, out, (size_t)max_shard, (ml_export_dtype)dtype.index);
  if (rc == 0 && world->rank == 0) rc = ml_cli_export_summary(out, what, sizeof what);
  ML_TRY(ml_cli_agree(world, rc));
  ml_cli_print("export: wrote %s from the latest checkpoint in %s: %s\n", out, ckpt, what);
  return 0;
}

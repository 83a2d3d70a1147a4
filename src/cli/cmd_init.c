/* meshlm init: a randomly initialised model in HF layout, initialised as
 * transformers' _init_weights does (Linear/Embedding weights ~ N(0, 0.02),
 * biases 0, RMSNorm weights 1 − offset: 1 for x·w, 0 for Gemma3's x·(1 + w)). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "common/rng.h"
#include "common/status.h"
#include "io/checkpoint.h"
#include "model/family.h"
#include "model/model.h"

static void init_param(const ml_param *p, float norm_offset, float *data, ml_rng *rng) {
  int64_t n = p->shape[0] * p->shape[1];
  const char *leaf = strrchr(p->name, '.');
  int is_bias = leaf && strcmp(leaf, ".bias") == 0;
  int is_norm = p->ndim == 1 && !is_bias;
  for (int64_t i = 0; i < n; i++)
    data[i] = is_norm ? 1.0f - norm_offset : is_bias ? 0.0f : (float)(0.02 * ml_rng_normal(rng));
}

/* Every checkpoint tensor of m (ml_model_ckpt_keys: a fused one holds its
 * parts' rows one after another), its parameters drawn in model order. */
static int write_model(const ml_model_config *cfg, const char *dir, int64_t seed) {
  ml_model m;
  ML_TRY(ml_model_create(cfg, &m));
  ml_ckpt_key *keys = ml_calloc((size_t)m.n_params, sizeof *keys, "init tensors");
  ml_st_entry *entries = ml_calloc((size_t)m.n_params, sizeof *entries, "init entries");
  int rc = entries && keys ? 0 : -1, n = rc ? 0 : ml_model_ckpt_keys(&m, keys);
  ml_rng rng = ml_rng_seed((uint64_t)seed);
  for (int k = 0; rc == 0 && k < n; k++) {
    const ml_ckpt_key *t = &keys[k];
    float *data = ml_malloc(sizeof(float) * (size_t)(t->rows * t->cols), t->key);
    if (!data) {
      rc = -1;
      break;
    }
    for (int i = t->first; i < t->first + t->n; i++)
      init_param(&m.params[i], cfg->family->norm_offset, data + m.params[i].key_row0 * t->cols,
                 &rng);
    entries[k] = (ml_st_entry){t->key, ML_F32, t->ndim, {t->rows, t->cols}, data};
  }
  if (rc == 0 && mkdir(dir, 0755) != 0 && errno != EEXIST)
    rc = ml_err("--out %s: cannot create the directory: %s", dir, strerror(errno));
  if (rc == 0) rc = ml_model_config_write(dir, cfg);
  if (rc == 0) rc = ml_ckpt_write(dir, entries, (size_t)n, 0);
  for (int k = 0; entries && k < n; k++) free((void *)entries[k].data);
  free(keys);
  free(entries);
  ml_model_destroy(&m);
  return rc;
}

int ml_cmd_init(ml_host *world, int argc, char **argv) {
  const char *arch = "llama", *preset = "tiny", *out = NULL;
  int64_t seed = 0;
  bool tie = false;
  char arch_help[1100];
  snprintf(arch_help, sizeof arch_help, "model family: %s", ml_family_list_names());
  ml_arg spec[] = {
      {"--arch", ML_ARG_STR, &arch, arch_help, false, "FAMILY"},
      {"--preset", ML_ARG_STR, &preset, "tiny (tests), small (~13M parameters, the demo), "
       "smollm2-135m or llama3.2-1b (benchmarks)", false, "PRESET"},
      {"--seed", ML_ARG_INT, &seed, "random seed of the initial weights", false, NULL},
      {"--tie-word-embeddings", ML_ARG_FLAG, &tie, "share embed_tokens and lm_head", false, NULL},
      {"--out", ML_ARG_STR, &out, "output directory (config.json + model.safetensors)", true,
       "DIR"},
  };
  int rc = ml_cli_parse("init", "write a randomly initialised HF checkpoint", argc, argv, spec,
                        sizeof spec / sizeof spec[0]);
  if (rc == 1) return 0;
  ml_model_config cfg;
  if (rc == 0) rc = ml_model_config_preset(arch, preset, &cfg);
  if (rc == 0 && tie) cfg.tie_embeddings = true;
  if (rc == 0 && world->rank == 0) rc = write_model(&cfg, out, seed);
  ML_TRY(ml_cli_agree(world, rc));
  ml_cli_print("init: wrote %s (%s %s, %lld parameters, seed %lld)\n", out, arch, preset,
               (long long)ml_model_config_num_params(&cfg), (long long)seed);
  return 0;
}

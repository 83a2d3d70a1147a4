/* Config files for the CLI: a JSON object holding the same settings as a
 * subcommand's flags (meshlm train --config FILE.json), as NeMo RL's
 * policy.dtensor_cfg and torchtitan's job config carry them.
 *
 * A flag's key is its name without the leading dashes and with '-' → '_'
 * ("--grad-accum" → "grad_accum"), unless an alias gives it another one
 * (NeMo's names: "tensor_parallel_size" for --tp). The file is translated
 * into "--flag=value" tokens placed before the command line's own
 * arguments and parsed once with ml_args_parse, so the values are checked
 * exactly as flags are and a flag on the command line overrides the file
 * (the last occurrence wins).
 *
 * JSON types per flag type: ML_ARG_INT an integer; ML_ARG_FLOAT a number;
 * ML_ARG_STR a string; ML_ARG_CHOICE one of its names as a string or an
 * integer (written in decimal: "grad_norm_type": 2), checked here so the
 * message names the key; ML_ARG_FLAG a boolean (false becomes
 * "--flag=false"). An alias may also let a string or choice flag take a
 * boolean (NeMo's "activation_checkpointing": true), or a string flag a
 * list of strings, joined with commas ("freeze": ["model.embed_tokens.*",
 * "model.layers.0.*"] is --freeze=model.embed_tokens.*,model.layers.0.*).
 * null leaves a setting
 * as it is (NeMo's "custom_parallel_plan": null). Other values (ranges)
 * are checked by the command as flags are, in messages naming the flag. */
#ifndef ML_CONFIG_FILE_H
#define ML_CONFIG_FILE_H

#include <stdbool.h>
#include <stddef.h>

#include "cli/args.h"

/* A key that is not the flag's own name (or the flag's own name where
 * only `list` matters), what JSON booleans stand for when the flag takes a
 * string (NULL: booleans refused), and whether a list of strings is taken
 * (joined with commas). */
typedef struct ml_config_alias {
  const char *key;                /* "activation_checkpointing" */
  const char *flag;               /* "--activation-checkpointing" */
  const char *if_true, *if_false; /* "layer", "none" */
  bool list;                      /* a JSON array of strings: their comma-separated join */
} ml_config_alias;

/* An argument vector of the config's tokens followed by the command line's. */
typedef struct ml_config_argv {
  int argc;
  char **argv; /* [argc]; the first n_file entries are owned tokens */
  int n_file;
} ml_config_argv;

/* Build out = the tokens of the JSON object in `path` (in the file's key
 * order), then argv[0..argc). With path NULL, out = argv alone. `spec`,
 * `aliases` as above; the flag named `exclude` (the config flag itself)
 * has no key. Errors (naming the file): unreadable or invalid JSON, not an
 * object, a duplicate key, an unknown key (the message lists the accepted
 * keys), a value of the wrong JSON type (key, type found and expected), a
 * choice that is not one of the flag's names (key, value, the names),
 * allocation. Free with ml_config_argv_free (also after an error). */
int ml_config_argv_build(const char *path, const ml_arg *spec, size_t n,
                         const ml_config_alias *aliases, size_t n_aliases, const char *exclude,
                         int argc, char **argv, ml_config_argv *out);
void ml_config_argv_free(ml_config_argv *a);

#endif

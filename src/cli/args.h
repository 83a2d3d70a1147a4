/* Table-driven long-flag parsing for the CLI subcommands (meshlm init |
 * train | logprobs | plan). Each subcommand declares an array of ml_arg whose
 * dst fields hold the defaults before parsing and the parsed values after.
 * Only long flags exist (GNU getopt_long style without abbreviations):
 * `--name value` or `--name=value`; ML_ARG_FLAG takes no value (`--name`
 * sets it) or an explicit `--name=true` / `--name=false`, so that a later
 * flag can switch off what an earlier one (or a config file) switched on. */
#ifndef ML_ARGS_H
#define ML_ARGS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

typedef enum {
  ML_ARG_INT,   /* dst: int64_t*, base-10 integer in the int64 range */
  ML_ARG_FLOAT, /* dst: double*, finite number (strtod syntax) */
  ML_ARG_STR,   /* dst: const char**, points into argv (not copied) */
  ML_ARG_FLAG,  /* dst: bool*, true when present; `=true` / `=false` explicit */
  ML_ARG_CHOICE /* dst: ml_arg_choice*, its index set to the value's */
} ml_arg_type;

/* The value of an ML_ARG_CHOICE flag: one of a fixed list of words. */
typedef struct ml_arg_choice {
  const char *const *names; /* the accepted values, NULL-terminated */
  int index;                /* names[index] is the value (the default before parsing) */
} ml_arg_choice;

typedef struct ml_arg {
  const char *name; /* with the dashes: "--tp" */
  ml_arg_type type;
  void *dst;        /* see ml_arg_type; holds the default on entry */
  const char *help; /* one line for the usage block */
  bool required;    /* error when absent from argv */
  const char *value; /* the value's name in the usage and synopsis ("DIR"); NULL: by type */
} ml_arg;

/* Parse argv[0..argc) — the arguments after the subcommand name `cmd`
 * (used in messages) — against spec[0..n), writing each value to its dst.
 * A value may not start with "--" (so `--out --tp 2` reports the missing
 * value of --out); negative numbers (`--x -1`) are fine. A flag given twice
 * keeps its last value. Returns 0, or -1 with a message (naming cmd, the
 * flag and the offending text) for: an unknown flag (the message lists the
 * accepted flags of cmd), a missing value, a value other than true/false
 * given to an ML_ARG_FLAG (`--flag=x`), a malformed or out-of-range number,
 * an ML_ARG_CHOICE value not among its choices (the message lists them), a
 * positional argument, a missing required flag. On error some dst may
 * already have been written. */
int ml_args_parse(const char *cmd, int argc, char **argv, const ml_arg *spec, size_t n);

/* c's names joined by `sep` into buf (truncated to fit size); returns buf. */
const char *ml_arg_choice_list(const ml_arg_choice *c, const char *sep, char *buf, size_t size);

/* The value of the last `--name VALUE` or `--name=VALUE` in argv[0..argc)
 * (pointing into argv), or NULL when absent or without a value. For a flag
 * that decides what else to parse (meshlm train --config FILE) before the
 * full parse; ml_args_parse then reports any malformation. */
const char *ml_args_value(int argc, char **argv, const char *name);

/* Print to f a usage block:
 *   usage: meshlm CMD [flags]
 *   SUMMARY
 *   flags:
 *     --name VALUE   help (required | default: VALUE)
 * (VALUE: the entry's value name, else by type: N (integer), X (number),
 * VALUE (string), an ML_ARG_CHOICE's names joined by '|'; none for an
 * ML_ARG_FLAG)
 * with defaults read from the current dst values (so call it before
 * ml_args_parse). A NULL string default and a false flag print no default. */
void ml_args_usage(FILE *f, const char *cmd, const char *summary, const ml_arg *spec, size_t n);

/* Print to f the synopsis of CMD, the form of the README's CLI block:
 * "meshlm CMD" padded to ML_ARGS_SYNOPSIS_INDENT columns, the required
 * flags (`--name VALUE`), then the others (`[--name VALUE]`, `[--name]` for
 * an ML_ARG_FLAG), each in table order, wrapped before ML_ARGS_SYNOPSIS_WIDTH
 * columns onto lines indented by ML_ARGS_SYNOPSIS_INDENT. */
enum { ML_ARGS_SYNOPSIS_INDENT = 16, ML_ARGS_SYNOPSIS_WIDTH = 100 };
void ml_args_synopsis(FILE *f, const char *cmd, const ml_arg *spec, size_t n);

#endif

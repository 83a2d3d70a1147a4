/* Shared pieces of the meshlm subcommands: error agreement across ranks
 * and the commands' entry points. */
#ifndef ML_CLI_H
#define ML_CLI_H

#include <stddef.h>
#include <stdint.h>

#include "comm/host.h"

struct ml_arg;

/* Collective over `world` (the host channel over MPI_COMM_WORLD that main
 * creates and hands to every command) at the end of a phase where any rank
 * may have failed before any collective of that phase could hang: returns
 * 0 when every rank's rc is 0, else −1 on every rank, and the lowest
 * failing rank prints its message to stderr ("meshlm: error: MSG", on
 * several ranks "meshlm: error (rank R): MSG" with R the rank where MSG
 * arose, which ml_host_agree may have carried to another rank). Every
 * rank's error record is cleared: the failure is handled. */
int ml_cli_agree(ml_host *world, int rc);

/* For a failure inside a phase whose peers may be blocked in a collective:
 * print this rank's message (with its origin rank, as ml_cli_agree) and
 * abort every rank with exit status 1 (MPI_Abort). */
_Noreturn void ml_cli_abort(void);

/* Parse the flags of `cmd` (with ml_args_parse; `cmd` may name positional
 * arguments after the command, "plot METRICS.jsonl": the usage and the
 * synopsis show them, messages name the command); "--help" prints the usage
 * on rank 0 and returns 1, as does "--synopsis" with the synopsis
 * (ml_args_synopsis; `meshlm --synopsis`: every command's, the README's CLI
 * block). Returns 0 when parsed, −1 on a bad flag (the message recorded;
 * every rank sees the same argv). */
int ml_cli_parse(const char *cmd, const char *summary, int argc, char **argv,
                 const struct ml_arg *spec, size_t n);

/* `bytes` for people: "123 B", else "1.23 KiB" (KiB, MiB, GiB, TiB); returns buf. */
const char *ml_cli_bytes(int64_t bytes, char *buf, size_t cap);

/* What the HF checkpoint directory `dir` (an export) holds, as the phrase of
 * a success line: "T tensors in S safetensors files, F files, B bytes (H)"
 * (tensors: in the safetensors files' headers; files and bytes: the regular
 * files in `dir`). Errors: `dir` or a file in it unreadable (named). */
int ml_cli_export_summary(const char *dir, char *buf, size_t cap);

/* Print `fmt` on world rank 0 only. */
void ml_cli_print(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* The commands: `world` is the host channel over every process (MPI_COMM_WORLD). */
int ml_cmd_init(ml_host *world, int argc, char **argv);
int ml_cmd_train(ml_host *world, int argc, char **argv);
int ml_cmd_logprobs(ml_host *world, int argc, char **argv);
/* meshlm plan: the plan, per-rank shards, one step's collectives and memory
 * for a mesh, predicted in one process from config.json (cmd_plan.c). */
int ml_cmd_plan(ml_host *world, int argc, char **argv);
/* meshlm export: the latest run checkpoint as an HF checkpoint, written by
 * rank 0 alone (cmd_export.c). */
int ml_cmd_export(ml_host *world, int argc, char **argv);
/* meshlm tokenize: JSONL text → JSONL input_ids with tokenizer.json, by rank 0 alone
 * (cmd_tokenize.c). */
int ml_cmd_tokenize(ml_host *world, int argc, char **argv);
/* meshlm plot: a train --metrics field over the steps, a PNG through
 * gnuplot or a sparkline, by rank 0 alone (cmd_plot.c). */
int ml_cmd_plot(ml_host *world, int argc, char **argv);

#endif

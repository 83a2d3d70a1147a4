/* README.md's "Defaults" table against the code, so that neither drifts:
 * every row's flag is one of meshlm train's, its --config key sets that
 * flag, and the two default columns are the values the flag holds before
 * parsing under the CLI's defaults (ml_train_opts_default) and under the
 * library's (ml_train_opts_with(ml_train_defaults(ML_DEFAULTS_API))), the
 * one table both front ends read (engine/settings.h). The API field column
 * is checked against meshlm_options by tests/python/test_binding.py. */
#define _XOPEN_SOURCE 700 /* tmpdir.h */
#define TMPDIR_PREFIX "ml_test_defaults"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "cli/config_file.h"
#include "cli/train_flags.h"
#include "common/status.h"
#include "tmpdir.h"

enum { COLS = 6, CELL = 128, MAX_ROWS = 64 };

/* A row: setting, flag, config key, API field, CLI default, library default. */
typedef struct row {
  char c[COLS][CELL];
} row;

/* The cells of a table line "| a | `b` | ... |" without backticks and blanks;
 * returns their number. */
static int split_cells(const char *line, row *r) {
  int n = 0;
  const char *p = strchr(line, '|');
  while (p && n < COLS) {
    const char *q = strchr(p + 1, '|');
    if (!q) break;
    size_t k = 0;
    for (const char *c = p + 1; c < q && k + 1 < CELL; c++)
      if (*c != '`') r->c[n][k++] = *c;
    r->c[n][k] = '\0';
    char *t = r->c[n];
    while (*t == ' ') memmove(t, t + 1, strlen(t));
    for (size_t e = strlen(t); e > 0 && t[e - 1] == ' '; e--) t[e - 1] = '\0';
    n++;
    p = q;
  }
  return n;
}

/* The rows of README.md's table under "## Defaults". */
static int read_table(row *rows) {
  FILE *f = fopen(ML_SOURCE_DIR "/README.md", "r");
  if (!f) fail_msg("cannot open %s/README.md", ML_SOURCE_DIR);
  char line[1024];
  int n = 0, state = 0; /* 0: before the section, 1: in it, 2: in its table */
  while (fgets(line, sizeof line, f)) {
    if (state == 0 && strncmp(line, "## Defaults", 11) == 0) state = 1;
    else if (state == 1 && strncmp(line, "| setting |", 11) == 0) state = 2;
    else if (state == 2 && line[0] != '|') break;
    else if (state == 2 && strncmp(line, "|---", 4) != 0) {
      assert_true(n < MAX_ROWS);
      if (split_cells(line, &rows[n]) != COLS)
        fail_msg("README Defaults: a malformed row: %s", line);
      n++;
    }
  }
  fclose(f);
  if (n == 0) fail_msg("README.md has no table under \"## Defaults\"");
  return n;
}

static const ml_arg *find_flag(const ml_arg *spec, size_t n, const char *flag) {
  for (size_t i = 0; i < n; i++)
    if (strcmp(spec[i].name, flag) == 0) return &spec[i];
  fail_msg("README Defaults: %s is not a flag of meshlm train", flag);
  return NULL;
}

/* Whether flag a holds the value README writes as `text`. An unset string
 * is the engine's "auto" (engine.h: parallel_plan NULL/"auto"), or for
 * --freeze "none" (engine.h: freeze NULL, nothing frozen), for --adapter
 * (engine/lora.h: no adapter to start from) and for --fp32-params
 * (engine/fp32_params.h: NULL, the MoE routers alone). */
static bool holds(const ml_arg *a, const char *text) {
  switch (a->type) {
  case ML_ARG_INT: return *(const int64_t *)a->dst == strtoll(text, NULL, 10);
  case ML_ARG_FLOAT: return *(const double *)a->dst == strtod(text, NULL);
  case ML_ARG_FLAG: return *(const bool *)a->dst == (strcmp(text, "true") == 0);
  case ML_ARG_CHOICE: {
    const ml_arg_choice *c = a->dst;
    return strcmp(c->names[c->index], text) == 0;
  }
  case ML_ARG_STR: {
    const char *v = *(const char *const *)a->dst;
    bool none = strcmp(a->name, "--freeze") == 0 || strcmp(a->name, "--adapter") == 0 ||
                strcmp(a->name, "--fp32-params") == 0;
    const char *unset = none ? "none" : "auto";
    return strcmp(v ? v : unset, text) == 0;
  }
  }
  return false;
}

/* The --config key of the row sets its flag: a file {key: value} becomes
 * the token "--flag=...". */
static void check_key(const ml_arg *spec, size_t n, const row *r) {
  const ml_arg *a = find_flag(spec, n, r->c[1]);
  bool quoted = a->type == ML_ARG_STR || a->type == ML_ARG_CHOICE;
  const char *path = tpath("key.json");
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  fprintf(f, quoted ? "{\"%s\": \"%s\"}\n" : "{\"%s\": %s}\n", r->c[2], r->c[4]);
  fclose(f);
  ml_config_argv args;
  ml_error_clear();
  if (ml_train_argv(2, (char *[]){"--config", (char *)path}, spec, n, &args) != 0)
    fail_msg("README Defaults: key %s: %s", r->c[2], ml_error_msg());
  char want[CELL + 2];
  snprintf(want, sizeof want, "%s=", r->c[1]);
  if (args.n_file != 1 || strncmp(args.argv[0], want, strlen(want)) != 0)
    fail_msg("README Defaults: key %s sets %s, not %s", r->c[2],
             args.n_file ? args.argv[0] : "nothing", r->c[1]);
  ml_config_argv_free(&args);
}

static void test_readme_defaults(void **state) {
  (void)state;
  row rows[MAX_ROWS];
  int n_rows = read_table(rows);
  ml_train_opts cli = ml_train_opts_default();
  ml_train_settings lib_defaults = ml_train_defaults(ML_DEFAULTS_API);
  ml_train_opts lib = ml_train_opts_with(&lib_defaults);
  ml_arg cli_spec[ML_TRAIN_MAX_FLAGS], lib_spec[ML_TRAIN_MAX_FLAGS];
  size_t n = ml_train_flags(&cli, cli_spec);
  assert_int_equal(ml_train_flags(&lib, lib_spec), n);
  for (int i = 0; i < n_rows; i++) {
    const row *r = &rows[i];
    printf("%-36s %-28s CLI %-9s library %s\n", r->c[0], r->c[1], r->c[4], r->c[5]);
    if (!holds(find_flag(cli_spec, n, r->c[1]), r->c[4]))
      fail_msg("README Defaults: %s's CLI default is not %s in the code", r->c[1], r->c[4]);
    if (!holds(find_flag(lib_spec, n, r->c[1]), r->c[5]))
      fail_msg("README Defaults: %s's library default is not %s in the code", r->c[1], r->c[5]);
    check_key(cli_spec, n, r);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_readme_defaults)};
  return cmocka_run_group_tests(tests, tmpdir_setup, tmpdir_teardown);
}

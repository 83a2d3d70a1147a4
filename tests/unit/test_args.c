/* Long-flag parser: both syntaxes, explicit booleans, choices, the value
 * lookup, every error, the usage block and the synopsis. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "cli/args.h"
#include "common/status.h"

typedef struct opts {
  int64_t tp;
  double lr;
  const char *model;
  bool verbose;
  ml_arg_choice dtype;
} opts;

enum { NSPEC = 5 };

static const char *const k_dtypes[] = {"fp32", "bf16", NULL};

static void make_spec(opts *o, ml_arg spec[NSPEC]) {
  *o = (opts){.tp = 1, .lr = 3e-4, .model = NULL, .verbose = false, .dtype = {k_dtypes, 0}};
  spec[0] = (ml_arg){"--tp", ML_ARG_INT, &o->tp, "tensor-parallel size", false, NULL};
  spec[1] = (ml_arg){"--lr", ML_ARG_FLOAT, &o->lr, "peak learning rate", false, NULL};
  spec[2] = (ml_arg){"--model", ML_ARG_STR, &o->model, "HF checkpoint directory", true, "DIR"};
  spec[3] = (ml_arg){"--verbose", ML_ARG_FLAG, &o->verbose, "print every step", false, NULL};
  spec[4] = (ml_arg){"--dtype", ML_ARG_CHOICE, &o->dtype, "compute dtype", false, NULL};
}

static int parse(opts *o, int argc, char **argv) {
  ml_arg spec[NSPEC];
  make_spec(o, spec);
  ml_error_clear();
  return ml_args_parse("train", argc, argv, spec, NSPEC);
}

#define ARGV(...) (sizeof((char *[]){__VA_ARGS__}) / sizeof(char *)), (char *[]){__VA_ARGS__}

static void expect_error(const char *want1, const char *want2, int argc, char **argv) {
  opts o;
  assert_int_equal(parse(&o, argc, argv), -1);
  const char *msg = ml_error_msg();
  if (!strstr(msg, want1) || !strstr(msg, want2))
    fail_msg("message '%s' lacks '%s' or '%s'", msg, want1, want2);
}

static void test_space_syntax(void **state) {
  opts o;
  assert_int_equal(parse(&o, ARGV("--tp", "4", "--lr", "-1.5e-3", "--model", "m/x", "--verbose")),
                   0);
  assert_int_equal(o.tp, 4);
  assert_true(o.lr == -1.5e-3);
  assert_string_equal(o.model, "m/x");
  assert_true(o.verbose);
}

static void test_equals_syntax(void **state) {
  opts o;
  assert_int_equal(parse(&o, ARGV("--model=a=b", "--tp=-2", "--lr=0.5")), 0);
  assert_int_equal(o.tp, -2);
  assert_true(o.lr == 0.5);
  assert_string_equal(o.model, "a=b");
  assert_false(o.verbose);
}

static void test_defaults_and_last_wins(void **state) {
  opts o;
  assert_int_equal(parse(&o, ARGV("--model", "m", "--tp", "2", "--tp=3")), 0);
  assert_int_equal(o.tp, 3);
  assert_true(o.lr == 3e-4);
  assert_int_equal(parse(&o, 0, NULL), -1);
}

static void test_unknown_flag(void **state) {
  expect_error("unknown flag '--bogus'", "accepted flags: --tp, --lr, --model, --verbose, --dtype",
               ARGV("--model", "m", "--bogus", "1"));
  expect_error("unknown flag '--tpx'", "train:", ARGV("--tpx=3"));
}

static void test_missing_value(void **state) {
  expect_error("--tp", "missing value", ARGV("--model", "m", "--tp"));
  expect_error("--model", "missing value", ARGV("--model", "--tp", "2"));
}

static void test_bad_numbers(void **state) {
  expect_error("--tp", "expected an integer, found 'abc'", ARGV("--model", "m", "--tp", "abc"));
  expect_error("--tp", "found '3x'", ARGV("--model", "m", "--tp=3x"));
  expect_error("--tp", "found ''", ARGV("--model", "m", "--tp="));
  expect_error("--tp", "'99999999999999999999' is out of range",
               ARGV("--model", "m", "--tp", "99999999999999999999"));
  expect_error("--lr", "expected a number, found 'fast'", ARGV("--model", "m", "--lr", "fast"));
  expect_error("--lr", "'1e999' is out of range", ARGV("--model", "m", "--lr", "1e999"));
  expect_error("--lr", "'nan' is out of range", ARGV("--model", "m", "--lr=nan"));
}

static void test_missing_required(void **state) {
  expect_error("train:", "missing required flag --model", ARGV("--tp", "2"));
}

static void test_positional(void **state) {
  expect_error("positional argument 'extra'", "train:", ARGV("--model", "m", "extra"));
  expect_error("positional argument '-t'", "train:", ARGV("-t", "2", "--model", "m"));
  expect_error("positional argument '--'", "train:", ARGV("--model", "m", "--"));
}

static void test_flag_with_value(void **state) {
  expect_error("--verbose takes no value or =true / =false", "found '1'",
               ARGV("--model", "m", "--verbose=1"));
  expect_error("--verbose", "found ''", ARGV("--model", "m", "--verbose="));
  opts o;
  assert_int_equal(parse(&o, ARGV("--model", "m", "--verbose=true")), 0);
  assert_true(o.verbose);
  assert_int_equal(parse(&o, ARGV("--model", "m", "--verbose", "--verbose=false")), 0);
  assert_false(o.verbose);
}

static void test_choice(void **state) {
  opts o;
  assert_int_equal(parse(&o, ARGV("--model", "m")), 0);
  assert_int_equal(o.dtype.index, 0);
  assert_int_equal(parse(&o, ARGV("--model", "m", "--dtype", "bf16")), 0);
  assert_int_equal(o.dtype.index, 1);
  assert_int_equal(parse(&o, ARGV("--model", "m", "--dtype=bf16", "--dtype=fp32")), 0);
  assert_int_equal(o.dtype.index, 0);
  expect_error("train: flag --dtype: expected one of fp32, bf16", "found 'fp16'",
               ARGV("--model", "m", "--dtype", "fp16"));
  expect_error("--dtype", "missing value", ARGV("--model", "m", "--dtype"));
}

static void test_value_lookup(void **state) {
  assert_string_equal(ml_args_value(ARGV("--a", "1", "--config", "x.json", "--b"), "--config"),
                      "x.json");
  assert_string_equal(ml_args_value(ARGV("--config=a", "--config", "b"), "--config"), "b");
  assert_string_equal(ml_args_value(ARGV("--config", "a", "--config=b"), "--config"), "b");
  assert_null(ml_args_value(ARGV("--configs", "a", "--tp", "2"), "--config"));
  assert_null(ml_args_value(ARGV("--config"), "--config"));
  assert_null(ml_args_value(ARGV("--config", "--tp", "2"), "--config"));
  assert_null(ml_args_value(0, NULL, "--config"));
}

/* What `print` wrote to a temporary file, into buf. */
static void printed(void (*print)(FILE *f, const ml_arg *spec), const ml_arg *spec, char *buf,
                    size_t cap) {
  FILE *f = tmpfile();
  assert_non_null(f);
  print(f, spec);
  rewind(f);
  buf[fread(buf, 1, cap - 1, f)] = '\0';
  fclose(f);
}

static void usage_of(FILE *f, const ml_arg *spec) {
  ml_args_usage(f, "train", "Train a model.", spec, NSPEC);
}

static void test_usage(void **state) {
  opts o;
  ml_arg spec[NSPEC];
  make_spec(&o, spec);
  o.verbose = true;
  o.dtype.index = 1;
  char buf[2048];
  printed(usage_of, spec, buf, sizeof buf);
  const char *want[] = {"usage: meshlm train [flags]\nTrain a model.\nflags:\n",
                        "--tp N", "tensor-parallel size (default: 1)\n",
                        "--lr X", "(default: 0.0003)\n",
                        "--model DIR", "HF checkpoint directory (required)\n",
                        "--verbose", "print every step (default: on)\n",
                        "--dtype fp32|bf16", "compute dtype (default: bf16)\n"};
  for (size_t i = 0; i < sizeof want / sizeof *want; i++)
    if (!strstr(buf, want[i])) fail_msg("usage lacks '%s':\n%s", want[i], buf);
}

static void synopsis_of(FILE *f, const ml_arg *spec) { ml_args_synopsis(f, "train", spec, NSPEC); }

/* Required flags first, then the others bracketed, in table order. */
static void test_synopsis(void **state) {
  opts o;
  ml_arg spec[NSPEC];
  make_spec(&o, spec);
  char buf[2048];
  printed(synopsis_of, spec, buf, sizeof buf);
  assert_string_equal(buf, "meshlm train    --model DIR [--tp N] [--lr X] [--verbose] "
                           "[--dtype fp32|bf16]\n");
}

/* Lines wrap before ML_ARGS_SYNOPSIS_WIDTH columns, indented. */
static void test_synopsis_wraps(void **state) {
  enum { N = 12 };
  int64_t v[N] = {0};
  char names[N][16];
  ml_arg spec[N];
  for (int i = 0; i < N; i++) {
    snprintf(names[i], sizeof names[i], "--flag-%02d", i);
    spec[i] = (ml_arg){names[i], ML_ARG_INT, &v[i], "", false, "VALUE"};
  }
  FILE *f = tmpfile();
  assert_non_null(f);
  ml_args_synopsis(f, "plan", spec, N);
  rewind(f);
  char line[256];
  int lines = 0;
  while (fgets(line, sizeof line, f)) {
    size_t len = strlen(line) - 1; /* the newline */
    assert_true(len < ML_ARGS_SYNOPSIS_WIDTH);
    if (lines++ == 0) assert_memory_equal(line, "meshlm plan     [--flag-00 VALUE] ", 34);
    else assert_memory_equal(line, "                [--flag-", 24);
  }
  fclose(f);
  assert_int_equal(lines, 3); /* items of 17 columns + a space: 4 a line */
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_space_syntax),     cmocka_unit_test(test_equals_syntax),
      cmocka_unit_test(test_defaults_and_last_wins), cmocka_unit_test(test_unknown_flag),
      cmocka_unit_test(test_missing_value),    cmocka_unit_test(test_bad_numbers),
      cmocka_unit_test(test_missing_required), cmocka_unit_test(test_positional),
      cmocka_unit_test(test_flag_with_value),  cmocka_unit_test(test_choice),
      cmocka_unit_test(test_value_lookup),     cmocka_unit_test(test_usage),
      cmocka_unit_test(test_synopsis),         cmocka_unit_test(test_synopsis_wraps),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

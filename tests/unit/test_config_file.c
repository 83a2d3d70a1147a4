/* Config files (cli/config_file.h) and meshlm train's settings
 * (cli/train_flags.h): JSON types onto flags, aliases and booleans, the
 * command line overriding the file, errors naming file and key; NeMo's
 * dtensor_cfg names and the train checks. */
#define _XOPEN_SOURCE 700
#define TMPDIR_PREFIX "ml_test_config"
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "cli/args.h"
#include "cli/config_file.h"
#include "cli/train_flags.h"
#include "common/status.h"
#include "tmpdir.h"

#define ARGV(...)                                                                                  \
  (sizeof((char *[]){__VA_ARGS__}) / sizeof(char *)), (char *[]) { __VA_ARGS__ }

/* A small spec of every flag type, with one alias. */
typedef struct opts {
  int64_t tp;
  double lr;
  const char *model;
  bool verbose;
  ml_arg_choice mode;
} opts;

static const char *const k_modes[] = {"none", "some", "all", NULL};
static const ml_config_alias k_aliases[] = {{"tp_size", "--tp", NULL, NULL, false},
                                            {"mode", "--mode", "all", "none", false}};
enum { NSPEC = 5 };

static void make_spec(opts *o, ml_arg spec[NSPEC]) {
  *o = (opts){.tp = 1, .lr = 3e-4, .mode = {k_modes, 1}};
  spec[0] = (ml_arg){"--tp", ML_ARG_INT, &o->tp, "tensor-parallel size", false, NULL};
  spec[1] = (ml_arg){"--lr", ML_ARG_FLOAT, &o->lr, "learning rate", false, NULL};
  spec[2] = (ml_arg){"--model", ML_ARG_STR, &o->model, "checkpoint", true, NULL};
  spec[3] = (ml_arg){"--verbose", ML_ARG_FLAG, &o->verbose, "talk", false, NULL};
  spec[4] = (ml_arg){"--mode", ML_ARG_CHOICE, &o->mode, "how much", false, NULL};
}

static const char *write_config(const char *name, const char *json) {
  const char *path = tpath(name);
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  fputs(json, f);
  fclose(f);
  return path;
}

/* The last parse's argument vector: its tokens back the string values. */
static ml_config_argv g_args;

/* Build the argv from `path` + argv, then parse it into *o. */
static int parse(const char *path, opts *o, int argc, char **argv) {
  ml_arg spec[NSPEC];
  make_spec(o, spec);
  ml_config_argv_free(&g_args);
  ml_error_clear();
  int rc = ml_config_argv_build(path, spec, NSPEC, k_aliases, 2, NULL, argc, argv, &g_args);
  if (rc == 0) rc = ml_args_parse("train", g_args.argc, g_args.argv, spec, NSPEC);
  return rc;
}

static void expect_error(const char *path, const char *want1, const char *want2, int argc,
                         char **argv) {
  opts o;
  assert_int_equal(parse(path, &o, argc, argv), -1);
  const char *msg = ml_error_msg();
  if (!strstr(msg, want1) || !strstr(msg, want2))
    fail_msg("message '%s' lacks '%s' or '%s'", msg, want1, want2);
}

static void test_types_and_aliases(void **state) {
  const char *p = write_config(
      "types.json",
      "{\"tp_size\": 4, \"lr\": 1, \"model\": \"m/x=y\", \"verbose\": true, \"mode\": \"all\"}");
  opts o;
  assert_int_equal(parse(p, &o, 0, NULL), 0);
  assert_int_equal(o.tp, 4);
  assert_true(o.lr == 1.0);
  assert_string_equal(o.model, "m/x=y");
  assert_true(o.verbose);
  assert_int_equal(o.mode.index, 2);
  /* booleans through the alias; an integer for a choice is its decimal text */
  p = write_config("bools.json", "{\"model\": \"m\", \"mode\": false, \"verbose\": false}");
  assert_int_equal(parse(p, &o, 0, NULL), 0);
  assert_int_equal(o.mode.index, 0);
  assert_false(o.verbose);
  p = write_config("real.json", "{\"model\": \"m\", \"lr\": 2.5e-4}");
  assert_int_equal(parse(p, &o, 0, NULL), 0);
  assert_true(o.lr == 2.5e-4);
}

static void test_null_keeps_default(void **state) {
  const char *p = write_config("null.json", "{\"model\": \"m\", \"tp_size\": null, \"lr\": null}");
  opts o;
  assert_int_equal(parse(p, &o, 0, NULL), 0);
  assert_int_equal(o.tp, 1);
  assert_true(o.lr == 3e-4);
}

/* The command line wins wherever it stands relative to --config. */
static void test_flags_override_file(void **state) {
  const char *p = write_config("over.json", "{\"model\": \"m\", \"lr\": 0.5, \"verbose\": true, "
                                            "\"tp_size\": 2}");
  opts o;
  assert_int_equal(parse(p, &o, ARGV("--lr", "0.25", "--verbose=false")), 0);
  assert_true(o.lr == 0.25);
  assert_false(o.verbose);
  assert_int_equal(o.tp, 2);
  assert_string_equal(o.model, "m");
}

static void test_without_file(void **state) {
  opts o;
  assert_int_equal(parse(NULL, &o, ARGV("--model", "m", "--tp=3")), 0);
  assert_int_equal(o.tp, 3);
}

static void test_unknown_key(void **state) {
  const char *p = write_config("unknown.json", "{\"model\": \"m\", \"tensor_parallel\": 2}");
  expect_error(p, "unknown.json: unknown key 'tensor_parallel'",
               "accepted keys: tp_size, lr, model, verbose, mode", 0, NULL);
}

static void test_wrong_types(void **state) {
  const char *p = write_config("t1.json", "{\"model\": \"m\", \"tp_size\": \"2\"}");
  expect_error(p, "t1.json: key 'tp_size'", "expected an integer, found a string (\"2\")", 0, NULL);
  p = write_config("t2.json", "{\"model\": \"m\", \"tp_size\": 2.5}");
  expect_error(p, "key 'tp_size'", "expected an integer, found a real number (2.5)", 0, NULL);
  p = write_config("t3.json", "{\"model\": \"m\", \"verbose\": 1}");
  expect_error(p, "key 'verbose'", "expected a boolean, found an integer (1)", 0, NULL);
  p = write_config("t4.json", "{\"model\": [\"m\"]}");
  expect_error(p, "key 'model'", "expected a string, found an array ([\"m\"])", 0, NULL);
  p = write_config("t5.json", "{\"model\": \"m\", \"mode\": {}}");
  expect_error(p, "key 'mode'", "expected a string, an integer or a boolean, found an object", 0,
               NULL);
  p = write_config("t6.json", "{\"model\": \"m\", \"lr\": \"fast\"}");
  expect_error(p, "key 'lr'", "expected a number, found a string", 0, NULL);
  p = write_config("t7.json", "{\"model\": \"m\", \"mode\": \"most\"}");
  expect_error(p, "t7.json: key 'mode'", "expected one of none, some, all, found \"most\"", 0,
               NULL);
  p = write_config("t8.json", "{\"model\": \"m\", \"mode\": 3}");
  expect_error(p, "t8.json: key 'mode'", "expected one of none, some, all, found 3", 0, NULL);
}

static void test_bad_files(void **state) {
  expect_error(tpath("missing.json"), "missing.json", "cannot open", 0, NULL);
  const char *p = write_config("array.json", "[1, 2]");
  expect_error(p, "array.json", "expected a JSON object", 0, NULL);
  p = write_config("broken.json", "{\"model\": ");
  expect_error(p, "broken.json:1", "invalid JSON", 0, NULL);
  p = write_config("dup.json", "{\"lr\": 1, \"lr\": 2}");
  expect_error(p, "dup.json", "duplicate", 0, NULL);
}

/* meshlm train's real table: NeMo's names map onto the flags, the file's
 * tokens come first, the engine options follow the choices. */
static int parse_train(ml_train_opts *o, int argc, char **argv, ml_config_argv *a) {
  *o = ml_train_opts_default();
  ml_arg spec[ML_TRAIN_MAX_FLAGS];
  size_t n = ml_train_flags(o, spec);
  ml_error_clear();
  int rc = ml_train_argv(argc, argv, spec, n, a);
  if (rc == 0) rc = ml_args_parse("train", a->argc, a->argv, spec, n);
  if (rc == 0) rc = ml_train_opts_check(o);
  return rc;
}

static void test_train_nemo_names(void **state) {
  const char *p = write_config(
      "nemo.json",
      "{\"model\": \"ckpt\", \"data\": \"d.jsonl\", \"tensor_parallel_size\": 2, "
      "\"sequence_parallel\": true, \"activation_checkpointing\": true, \"cpu_offload\": false, "
      "\"custom_parallel_plan\": null, \"dp_replicate_size\": 2, \"context_parallel_size\": 2, "
      "\"param_dtype\": \"bf16\", \"reduce_dtype\": \"fp32\", \"output_dtype\": \"bf16\", "
      "\"reshard_after_forward\": \"false\", \"zero\": 2, \"prefetch_forward\": 0, "
      "\"grad_accum\": 4, \"batch_size\": 16, \"lr_schedule\": \"cosine\", \"warmup_steps\": 3, "
      "\"min_lr\": 1e-5, \"max_grad_norm\": 0.5, \"grad_norm_type\": \"inf\", \"steps\": 7, "
      "\"save\": \"ck\", \"save_every\": 2, \"export_hf\": \"out\", \"beta1\": 0.8, "
      "\"beta2\": 0.95, \"eps\": 1e-6, \"weight_decay\": 0.1}");
  ml_train_opts o;
  ml_config_argv a;
  assert_int_equal(parse_train(&o, ARGV("--config", (char *)p, "--steps", "9"), &a), 0);
  assert_string_equal(o.model, "ckpt");
  assert_string_equal(o.data, "d.jsonl");
  assert_int_equal(o.tp, 2);
  assert_int_equal(o.dp_replicate, 2);
  assert_int_equal(o.cp, 2);
  assert_true(o.sp);
  assert_null(o.plan);
  assert_int_equal(o.grad_accum, 4);
  assert_int_equal(o.steps, 9); /* the flag overrides the file */
  assert_int_equal(o.save_every, 2);
  assert_string_equal(o.export_hf, "out");
  ml_train_settings set = ml_train_settings_of(&o);
  ml_engine_opts eo = set.engine;
  assert_int_equal(eo.ac, ML_AC_LAYER);
  assert_true(eo.sequence_parallel);
  assert_int_equal(eo.fsdp.param_dtype, ML_BF16);
  assert_int_equal(eo.fsdp.reduce_dtype, ML_F32);
  assert_int_equal(eo.output_dtype, ML_BF16);
  assert_int_equal(eo.fsdp.reshard_after_forward, ML_RESHARD_NEVER);
  assert_int_equal(eo.fsdp.zero, 2);
  assert_int_equal(eo.fsdp.prefetch_forward, 0);
  assert_int_equal(eo.fsdp.prefetch_backward, 2);
  ml_lr_schedule s = set.step.schedule;
  assert_int_equal(s.decay, ML_LR_COSINE);
  assert_int_equal(s.warmup_steps, 3);
  assert_int_equal(s.total_steps, 9);
  assert_true(s.min_lr == 1e-5);
  assert_true(isinf(set.step.norm_type));
  assert_true(set.step.beta1 == 0.8 && set.step.beta2 == 0.95 && set.step.eps == 1e-6);
  assert_true(set.step.weight_decay == 0.1 && set.step.max_grad_norm == 0.5);
  ml_config_argv_free(&a);

  p = write_config("ac.json", "{\"model\": \"m\", \"data\": \"d\", \"activation_checkpointing\": "
                              "false, \"grad_norm_type\": 2}");
  assert_int_equal(parse_train(&o, ARGV("--config", (char *)p), &a), 0);
  assert_int_equal(ml_train_settings_of(&o).engine.ac, ML_AC_NONE);
  assert_true(ml_train_settings_of(&o).step.norm_type == 2.0);
  ml_config_argv_free(&a);
  assert_int_equal(
      parse_train(&o, ARGV("--config", (char *)p, "--activation-checkpointing", "selective"), &a),
      0);
  assert_int_equal(ml_train_settings_of(&o).engine.ac, ML_AC_SELECTIVE);
  ml_config_argv_free(&a);

  /* the flag name of a NeMo-named setting is not a key: one name each */
  p = write_config("tp.json", "{\"model\": \"m\", \"data\": \"d\", \"tp\": 2}");
  assert_int_equal(parse_train(&o, ARGV("--config", (char *)p), &a), -1);
  assert_non_null(strstr(ml_error_msg(), "unknown key 'tp'"));
  assert_non_null(strstr(ml_error_msg(), "tensor_parallel_size"));
  ml_config_argv_free(&a);
}

static void expect_train_error(const char *want1, const char *want2, int argc, char **argv) {
  ml_train_opts o;
  ml_config_argv a;
  assert_int_equal(parse_train(&o, argc, argv, &a), -1);
  const char *msg = ml_error_msg();
  if (!strstr(msg, want1) || !strstr(msg, want2))
    fail_msg("message '%s' lacks '%s' or '%s'", msg, want1, want2);
  ml_config_argv_free(&a);
}

static void test_train_checks(void **state) {
  expect_train_error("--cp", "expected an integer in [1, 2147483647], found 0",
                     ARGV("--model", "m", "--data", "d", "--cp", "0"));
  expect_train_error("--cpu-offload", "takes no value or =true / =false, found 'maybe'",
                     ARGV("--model", "m", "--data", "d", "--cpu-offload=maybe"));
  expect_train_error("--batch-size 6 is not divisible by --grad-accum 4", "expected a multiple",
                     ARGV("--model", "m", "--data", "d", "--batch-size", "6", "--grad-accum", "4"));
  expect_train_error("--zero", "expected an integer in [1, 3], found 4",
                     ARGV("--model", "m", "--data", "d", "--zero", "4"));
  expect_train_error("--grad-accum", "expected an integer >= 1, found 0",
                     ARGV("--model", "m", "--data", "d", "--grad-accum", "0"));
  expect_train_error("--min-lr", "expected a number >= 0, found -1",
                     ARGV("--model", "m", "--data", "d", "--min-lr", "-1"));
  expect_train_error("--beta2", "expected a number in [0, 1), found 1",
                     ARGV("--model", "m", "--data", "d", "--beta2", "1"));
  expect_train_error("--eps", "expected a number > 0, found 0",
                     ARGV("--model", "m", "--data", "d", "--eps", "0"));
  expect_train_error("--save-every 2", "needs --save",
                     ARGV("--model", "m", "--data", "d", "--save-every", "2"));
  expect_train_error("--param-dtype", "expected one of fp32, bf16, found 'fp16'",
                     ARGV("--model", "m", "--data", "d", "--param-dtype", "fp16"));
  expect_train_error("--grad-norm-type", "expected one of 2, inf, found '1'",
                     ARGV("--model", "m", "--data", "d", "--grad-norm-type", "1"));
  /* --cpu-offload=false switches it off again; alone it reaches FSDP's options (any mesh and
   * device: torch's CPUOffloadPolicy has no requirement of its own) */
  ml_train_opts o;
  ml_config_argv a;
  assert_int_equal(
      parse_train(&o, ARGV("--model", "m", "--data", "d", "--cpu-offload", "--cpu-offload=false"),
                  &a),
      0);
  assert_false(ml_train_settings_of(&o).engine.fsdp.cpu_offload);
  ml_config_argv_free(&a);
  assert_int_equal(parse_train(&o, ARGV("--model", "m", "--data", "d", "--cpu-offload"), &a), 0);
  assert_int_equal(ml_train_opts_check(&o), 0);
  assert_true(ml_train_settings_of(&o).engine.fsdp.cpu_offload);
  ml_config_argv_free(&a);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_types_and_aliases),   cmocka_unit_test(test_null_keeps_default),
      cmocka_unit_test(test_flags_override_file), cmocka_unit_test(test_without_file),
      cmocka_unit_test(test_unknown_key),         cmocka_unit_test(test_wrong_types),
      cmocka_unit_test(test_bad_files),           cmocka_unit_test(test_train_nemo_names),
      cmocka_unit_test(test_train_checks),
  };
  int rc = cmocka_run_group_tests(tests, tmpdir_setup, tmpdir_teardown);
  ml_config_argv_free(&g_args);
  return rc;
}

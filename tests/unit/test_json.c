/* JSON documents: loading, typed getters and their messages, writing. */
#define _XOPEN_SOURCE 700
#define TMPDIR_PREFIX "ml_test_json"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/status.h"
#include "io/json.h"
#include "tmpdir.h"

static char g_cfg[512];

static void write_text(const char *path, const char *text) {
  FILE *fp = fopen(path, "w");
  assert_non_null(fp);
  fputs(text, fp);
  assert_int_equal(fclose(fp), 0);
}

static int group_setup(void **state) {
  if (tmpdir_setup(state)) return -1;
  snprintf(g_cfg, sizeof g_cfg, "%s/config.json", g_dir);
  write_text(g_cfg, "{\n"
                    "  \"hidden_size\": 64,\n"
                    "  \"rms_norm_eps\": 1e-06,\n"
                    "  \"rope_theta\": 10000,\n"
                    "  \"tie_word_embeddings\": true,\n"
                    "  \"model_type\": \"llama\",\n"
                    "  \"name\": \"abc\",\n"
                    "  \"sliding_window\": null,\n"
                    "  \"ratio\": 1.5,\n"
                    "  \"rope_scaling\": {\"factor\": 8.0, \"type\": \"llama3\", \"big\": 9007199254740993}\n"
                    "}\n");
  return 0;
}

/* The loaded g_cfg and one out-variable per getter type: the per-test
 * fixture of the getter tests (cfg_setup loads, cfg_teardown frees). */
typedef struct cfg {
  ml_json j;
  int64_t i;
  double d;
  bool b;
  const char *s;
} cfg;

static int cfg_setup(void **state) {
  static cfg c;
  memset(&c, 0, sizeof c);
  ml_error_clear();
  assert_int_equal(ml_json_load(g_cfg, &c.j), 0);
  *state = &c;
  return 0;
}

static int cfg_teardown(void **state) {
  ml_json_free(&((cfg *)*state)->j);
  return 0;
}

static void expect_msg(const char *a, const char *b, const char *c) {
  const char *msg = ml_error_msg();
  if (!strstr(msg, a) || !strstr(msg, b) || !strstr(msg, c))
    fail_msg("message \"%s\" lacks \"%s\", \"%s\" or \"%s\"", msg, a, b, c);
}

static void test_required(void **state) {
  cfg *c = *state;
  assert_int_equal(ml_json_int(&c->j, NULL, "hidden_size", &c->i), 0);
  assert_int_equal(c->i, 64);
  assert_int_equal(ml_json_num(&c->j, NULL, "rms_norm_eps", &c->d), 0);
  assert_true(c->d == 1e-6);
  assert_int_equal(ml_json_num(&c->j, NULL, "rope_theta", &c->d), 0); /* an int is a number */
  assert_true(c->d == 10000.0);
  assert_int_equal(ml_json_bool(&c->j, NULL, "tie_word_embeddings", &c->b), 0);
  assert_true(c->b);
  assert_int_equal(ml_json_str(&c->j, NULL, "model_type", &c->s), 0);
  assert_string_equal(c->s, "llama");
  const json_t *rs = json_object_get(c->j.root, "rope_scaling");
  assert_int_equal(ml_json_num(&c->j, rs, "factor", &c->d), 0);
  assert_true(c->d == 8.0);
  assert_int_equal(ml_json_int(&c->j, rs, "big", &c->i), 0);
  assert_int_equal(c->i, 9007199254740993LL); /* exact beyond 2^53 */
  assert_int_equal(ml_json_str(&c->j, rs, "type", &c->s), 0);
  assert_string_equal(c->s, "llama3");
  ml_json_free(&c->j);
  assert_null(c->j.root);
}

static void test_optional(void **state) {
  cfg *c = *state;
  assert_int_equal(ml_json_int_opt(&c->j, NULL, "num_kv_heads", 4, &c->i), 0); /* missing */
  assert_int_equal(c->i, 4);
  assert_int_equal(ml_json_int_opt(&c->j, NULL, "sliding_window", -1, &c->i), 0); /* null */
  assert_int_equal(c->i, -1);
  assert_int_equal(ml_json_int_opt(&c->j, NULL, "hidden_size", 4, &c->i), 0); /* present */
  assert_int_equal(c->i, 64);
  assert_int_equal(ml_json_num_opt(&c->j, NULL, "dropout", 0.25, &c->d), 0);
  assert_true(c->d == 0.25);
  assert_int_equal(ml_json_num_opt(&c->j, NULL, "ratio", 0.25, &c->d), 0);
  assert_true(c->d == 1.5);
  assert_int_equal(ml_json_bool_opt(&c->j, NULL, "use_cache", false, &c->b), 0);
  assert_false(c->b);
  assert_int_equal(ml_json_bool_opt(&c->j, NULL, "tie_word_embeddings", false, &c->b), 0);
  assert_true(c->b);
}

/* `call` fails (-1) with a message naming g_cfg, `a` and `b`. A macro so
 * that a failure reports the line of the check. */
#define expect_fail(call, a, b)   \
  do {                            \
    ml_error_clear();             \
    assert_int_equal((call), -1); \
    expect_msg(g_cfg, (a), (b));  \
  } while (0)

static void test_wrong_and_missing(void **state) {
  cfg *c = *state;
  const json_t *rs = json_object_get(c->j.root, "rope_scaling");
  expect_fail(ml_json_int(&c->j, NULL, "name", &c->i), "field 'name': expected an integer",
              "found \"abc\"");
  /* a real is not an int */
  expect_fail(ml_json_int(&c->j, NULL, "ratio", &c->i), "'ratio'", "found 1.5");
  expect_fail(ml_json_int(&c->j, NULL, "vocab_size", &c->i), "field 'vocab_size'", "missing");
  expect_fail(ml_json_num(&c->j, NULL, "model_type", &c->d), "'model_type'", "expected a number");
  expect_fail(ml_json_bool(&c->j, NULL, "hidden_size", &c->b), "'hidden_size'", "found 64");
  /* null is not a string */
  expect_fail(ml_json_str(&c->j, NULL, "sliding_window", &c->s), "'sliding_window'", "found null");
  expect_fail(ml_json_str(&c->j, rs, "factor", &c->s), "'factor'", "expected a string");
  expect_fail(ml_json_int_opt(&c->j, NULL, "model_type", 1, &c->i), "'model_type'",
              "expected an integer");
  expect_fail(ml_json_num_opt(&c->j, NULL, "tie_word_embeddings", 1, &c->d),
              "'tie_word_embeddings'", "found true");
  expect_fail(ml_json_bool_opt(&c->j, NULL, "rope_scaling", true, &c->b), "'rope_scaling'",
              "found {\"factor\"");
  ml_error_clear();
}

static void expect_load_err(const char *text, const char *word) {
  const char *path = tpath("bad.json");
  write_text(path, text);
  ml_json j;
  ml_error_clear();
  assert_int_equal(ml_json_load(path, &j), -1);
  expect_msg(path, word, "");
  assert_null(j.root);
}

static void test_load_errors(void **state) {
  (void)state;
  expect_load_err("{\"a\": 1,\n \"b\": }", "bad.json:2:");
  expect_load_err("{\"a\": 1, \"a\": 2}", "duplicate");
  expect_load_err("[1, 2]", "expected a JSON object");
  expect_load_err("{\"a\": \"\xff\"}", "invalid JSON");
  expect_load_err("", "invalid JSON");
  expect_load_err("{} {}", "invalid JSON");
  ml_json j;
  ml_error_clear();
  assert_int_equal(ml_json_load(tpath("missing.json"), &j), -1);
  expect_msg("missing.json", "cannot open", "");
}

static void test_write(void **state) {
  (void)state;
  json_t *root = json_pack("{s:i, s:s, s:{s:b}}", "zeta", 1, "alpha", "x", "mid", "flag", 1);
  assert_non_null(root);
  char path[512];
  snprintf(path, sizeof path, "%s", tpath("out.json"));
  ml_error_clear();
  assert_int_equal(ml_json_write(path, root), 0);
  assert_int_equal(access(tpath("out.json.tmp"), F_OK), -1);
  FILE *fp = fopen(path, "r");
  assert_non_null(fp);
  char text[256] = {0};
  size_t n = fread(text, 1, sizeof text - 1, fp);
  fclose(fp);
  const char *want = "{\n  \"zeta\": 1,\n  \"alpha\": \"x\",\n  \"mid\": {\n    \"flag\": true\n  }\n}\n";
  assert_int_equal(n, strlen(want));
  assert_string_equal(text, want); /* insertion order, indent 2, final newline */
  ml_json j;
  assert_int_equal(ml_json_load(path, &j), 0);
  assert_true(json_equal(j.root, root));
  ml_json_free(&j);

  ml_error_clear();
  assert_int_equal(ml_json_write(tpath("nodir/out.json"), root), -1);
  expect_msg("nodir/out.json", "cannot create", "");
  json_decref(root);
}

static void test_brief(void **state) {
  (void)state;
  char buf[16];
  json_t *v = json_string("a long string value here");
  ml_json_brief(v, buf, sizeof buf);
  assert_string_equal(buf, "\"a long stri...");
  json_decref(v);
  ml_json_brief(NULL, buf, sizeof buf);
  assert_string_equal(buf, "nothing");
  v = json_integer(-3);
  ml_json_brief(v, buf, sizeof buf);
  assert_string_equal(buf, "-3");
  json_decref(v);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_required, cfg_setup, cfg_teardown),
      cmocka_unit_test_setup_teardown(test_optional, cfg_setup, cfg_teardown),
      cmocka_unit_test_setup_teardown(test_wrong_and_missing, cfg_setup, cfg_teardown),
      cmocka_unit_test(test_load_errors),
      cmocka_unit_test(test_write),
      cmocka_unit_test(test_brief),
  };
  return cmocka_run_group_tests(tests, group_setup, tmpdir_teardown);
}

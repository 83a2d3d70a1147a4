/* JSON documents: loading, typed getters and their messages, writing. */
#define _XOPEN_SOURCE 700

#include <ftw.h>
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

static char g_dir[] = "/tmp/ml_test_json_XXXXXX";
static char g_cfg[512];

static const char *tpath(const char *name) {
  static char buf[512];
  snprintf(buf, sizeof buf, "%s/%s", g_dir, name);
  return buf;
}

static void write_text(const char *path, const char *text) {
  FILE *fp = fopen(path, "w");
  assert_non_null(fp);
  fputs(text, fp);
  assert_int_equal(fclose(fp), 0);
}

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
  (void)sb, (void)flag, (void)ftw;
  return remove(p);
}

static int group_setup(void **state) {
  (void)state;
  if (!mkdtemp(g_dir)) return -1;
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

static int group_teardown(void **state) {
  (void)state;
  return nftw(g_dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

static void expect_msg(const char *a, const char *b, const char *c) {
  const char *msg = ml_error_msg();
  if (!strstr(msg, a) || !strstr(msg, b) || !strstr(msg, c))
    fail_msg("message \"%s\" lacks \"%s\", \"%s\" or \"%s\"", msg, a, b, c);
}

static void test_required(void **state) {
  (void)state;
  ml_json j;
  ml_error_clear();
  assert_int_equal(ml_json_load(g_cfg, &j), 0);
  int64_t i;
  double d;
  bool b;
  const char *s;
  assert_int_equal(ml_json_int(&j, NULL, "hidden_size", &i), 0);
  assert_int_equal(i, 64);
  assert_int_equal(ml_json_num(&j, NULL, "rms_norm_eps", &d), 0);
  assert_true(d == 1e-6);
  assert_int_equal(ml_json_num(&j, NULL, "rope_theta", &d), 0); /* an int is a number */
  assert_true(d == 10000.0);
  assert_int_equal(ml_json_bool(&j, NULL, "tie_word_embeddings", &b), 0);
  assert_true(b);
  assert_int_equal(ml_json_str(&j, NULL, "model_type", &s), 0);
  assert_string_equal(s, "llama");
  const json_t *rs = json_object_get(j.root, "rope_scaling");
  assert_int_equal(ml_json_num(&j, rs, "factor", &d), 0);
  assert_true(d == 8.0);
  assert_int_equal(ml_json_int(&j, rs, "big", &i), 0);
  assert_int_equal(i, 9007199254740993LL); /* exact beyond 2^53 */
  assert_int_equal(ml_json_str(&j, rs, "type", &s), 0);
  assert_string_equal(s, "llama3");
  ml_json_free(&j);
  assert_null(j.root);
}

static void test_optional(void **state) {
  (void)state;
  ml_json j;
  ml_error_clear();
  assert_int_equal(ml_json_load(g_cfg, &j), 0);
  int64_t i;
  double d;
  bool b;
  assert_int_equal(ml_json_int_opt(&j, NULL, "num_kv_heads", 4, &i), 0); /* missing */
  assert_int_equal(i, 4);
  assert_int_equal(ml_json_int_opt(&j, NULL, "sliding_window", -1, &i), 0); /* null */
  assert_int_equal(i, -1);
  assert_int_equal(ml_json_int_opt(&j, NULL, "hidden_size", 4, &i), 0); /* present */
  assert_int_equal(i, 64);
  assert_int_equal(ml_json_num_opt(&j, NULL, "dropout", 0.25, &d), 0);
  assert_true(d == 0.25);
  assert_int_equal(ml_json_num_opt(&j, NULL, "ratio", 0.25, &d), 0);
  assert_true(d == 1.5);
  assert_int_equal(ml_json_bool_opt(&j, NULL, "use_cache", false, &b), 0);
  assert_false(b);
  assert_int_equal(ml_json_bool_opt(&j, NULL, "tie_word_embeddings", false, &b), 0);
  assert_true(b);
  ml_json_free(&j);
}

static void test_wrong_and_missing(void **state) {
  (void)state;
  ml_json j;
  ml_error_clear();
  assert_int_equal(ml_json_load(g_cfg, &j), 0);
  int64_t i;
  double d;
  bool b;
  const char *s;
  const json_t *rs = json_object_get(j.root, "rope_scaling");
  ml_error_clear();
  assert_int_equal(ml_json_int(&j, NULL, "name", &i), -1);
  expect_msg(g_cfg, "field 'name': expected an integer", "found \"abc\"");
  ml_error_clear();
  assert_int_equal(ml_json_int(&j, NULL, "ratio", &i), -1); /* a real is not an int */
  expect_msg(g_cfg, "'ratio'", "found 1.5");
  ml_error_clear();
  assert_int_equal(ml_json_int(&j, NULL, "vocab_size", &i), -1);
  expect_msg(g_cfg, "field 'vocab_size'", "missing");
  ml_error_clear();
  assert_int_equal(ml_json_num(&j, NULL, "model_type", &d), -1);
  expect_msg(g_cfg, "'model_type'", "expected a number");
  ml_error_clear();
  assert_int_equal(ml_json_bool(&j, NULL, "hidden_size", &b), -1);
  expect_msg(g_cfg, "'hidden_size'", "found 64");
  ml_error_clear();
  assert_int_equal(ml_json_str(&j, NULL, "sliding_window", &s), -1); /* null is not a string */
  expect_msg(g_cfg, "'sliding_window'", "found null");
  ml_error_clear();
  assert_int_equal(ml_json_str(&j, rs, "factor", &s), -1);
  expect_msg(g_cfg, "'factor'", "expected a string");
  ml_error_clear();
  assert_int_equal(ml_json_int_opt(&j, NULL, "model_type", 1, &i), -1);
  expect_msg(g_cfg, "'model_type'", "expected an integer");
  ml_error_clear();
  assert_int_equal(ml_json_num_opt(&j, NULL, "tie_word_embeddings", 1, &d), -1);
  expect_msg(g_cfg, "'tie_word_embeddings'", "found true");
  ml_error_clear();
  assert_int_equal(ml_json_bool_opt(&j, NULL, "rope_scaling", true, &b), -1);
  expect_msg(g_cfg, "'rope_scaling'", "found {\"factor\"");
  ml_error_clear();
  ml_json_free(&j);
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
      cmocka_unit_test(test_required),    cmocka_unit_test(test_optional),
      cmocka_unit_test(test_wrong_and_missing), cmocka_unit_test(test_load_errors),
      cmocka_unit_test(test_write),       cmocka_unit_test(test_brief),
  };
  return cmocka_run_group_tests(tests, group_setup, group_teardown);
}

/* Metrics: progress line, JSONL log read back with jansson, FLOPs and MFU. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>
#include <jansson.h>

#include "common/status.h"
#include "tolerance.h"
#include "cli/metrics.h"

static const ml_step_metrics k_example = {.step = 12,
                                          .loss = 3.4567,
                                          .grad_norm = 1.234,
                                          .lr = 3e-4,
                                          .tokens = 4096,
                                          .tokens_per_s = 1234.5,
                                          .mfu = 0.0123,
                                          .peak_tflops = 0.5,
                                          .peak_measured = true,
                                          .peak_rss_mib_min = 300.25,
                                          .peak_rss_mib_max = 345.6,
                                          .device_peak_mib = 123.5,
                                          .minor_faults = 7,
                                          .time_s = 83.25,
                                          .eta_s = 250.0};

/* The keys of a metrics line, in order. */
static const char *const k_keys[] = {
    "step",          "loss",          "grad_norm",        "lr",
    "tokens",        "tokens_per_s",  "mfu",              "peak_tflops",
    "peak_measured", "peak_rss_mib_min", "peak_rss_mib_max", "device_peak_mib",
    "skipped",       "fsdp_wait_ms",  "minor_faults",     "time"};

static void test_print(void **state) {
  FILE *f = tmpfile();
  assert_non_null(f);
  ml_metrics_print(f, &k_example);
  char buf[256] = "";
  rewind(f);
  buf[fread(buf, 1, sizeof buf - 1, f)] = '\0';
  fclose(f);
  assert_string_equal(buf, "step 12 | loss 3.4567 | grad_norm 1.234 | lr 3.00e-04 | "
                           "tok/s 1234.5 | mfu 1.23% of measured peak | peak_rss 345.6 MiB "
                           "(min 300.2) | elapsed 1m23s eta 4m10s\n");
}

/* Elapsed and ETA: a decimal below 10 s, then whole seconds, minutes and
 * hours (rounded to the second: 9.96 s is 10 s); a negative time as 0. */
static void test_print_durations(void **state) {
  static const struct {
    double s;
    const char *text;
  } cases[] = {{0.04, "0.0s"}, {3.25, "3.2s"},   {9.94, "9.9s"},     {9.96, "10s"},
               {59.4, "59s"},  {59.6, "1m00s"},  {65, "1m05s"},      {3599.4, "59m59s"},
               {3600, "1h00m00s"}, {7509, "2h05m09s"}, {-1, "0.0s"}, {NAN, "0.0s"}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    ml_step_metrics m = k_example;
    m.time_s = cases[i].s;
    m.eta_s = 0;
    char buf[256] = "", want[64];
    FILE *f = tmpfile();
    assert_non_null(f);
    ml_metrics_print(f, &m);
    rewind(f);
    buf[fread(buf, 1, sizeof buf - 1, f)] = '\0';
    fclose(f);
    snprintf(want, sizeof want, "| elapsed %s eta 0.0s\n", cases[i].text);
    if (!strstr(buf, want)) fail_msg("%g s: '%s' lacks '%s'", cases[i].s, buf, want);
  }
}

/* The line names the MFU's peak, or says n/a without one; one rank's RSS
 * (min = max) has no "(min ...)". */
static void test_print_peak_sources(void **state) {
  ml_step_metrics m = k_example;
  char buf[256];
  m.peak_measured = false;
  m.peak_rss_mib_min = m.peak_rss_mib_max;
  FILE *f = tmpfile();
  assert_non_null(f);
  ml_metrics_print(f, &m);
  m.peak_tflops = 0;
  m.mfu = 0;
  ml_metrics_print(f, &m);
  rewind(f);
  assert_non_null(fgets(buf, sizeof buf, f));
  assert_string_equal(buf, "step 12 | loss 3.4567 | grad_norm 1.234 | lr 3.00e-04 | "
                           "tok/s 1234.5 | mfu 1.23% of --peak-tflops | peak_rss 345.6 MiB | "
                           "elapsed 1m23s eta 4m10s\n");
  assert_non_null(fgets(buf, sizeof buf, f));
  assert_string_equal(buf, "step 12 | loss 3.4567 | grad_norm 1.234 | lr 3.00e-04 | "
                           "tok/s 1234.5 | mfu n/a | peak_rss 345.6 MiB | "
                           "elapsed 1m23s eta 4m10s\n");
  fclose(f);
}

static void test_print_skipped(void **state) {
  ml_step_metrics m = k_example;
  m.loss = NAN;
  m.grad_norm = NAN;
  m.skipped = true;
  FILE *f = tmpfile();
  assert_non_null(f);
  ml_metrics_print(f, &m);
  char buf[256] = "";
  rewind(f);
  buf[fread(buf, 1, sizeof buf - 1, f)] = '\0';
  fclose(f);
  assert_string_equal(buf, "step 12 | loss nan | grad_norm nan | lr 3.00e-04 | "
                           "tok/s 1234.5 | mfu 1.23% of measured peak | peak_rss 345.6 MiB "
                           "(min 300.2) | elapsed 1m23s eta 4m10s | skipped\n");
}

static json_t *read_line(FILE *f) {
  char line[1024];
  assert_non_null(fgets(line, sizeof line, f));
  assert_non_null(strchr(line, '\n'));
  json_error_t e;
  json_t *o = json_loads(line, JSON_REJECT_DUPLICATES, &e);
  if (!o) fail_msg("bad JSON line '%s': %s", line, e.text);
  assert_true(json_is_object(o));
  assert_int_equal(json_object_size(o), sizeof k_keys / sizeof k_keys[0]);
  return o;
}

static double num(const json_t *o, const char *key) {
  const json_t *v = json_object_get(o, key);
  assert_true(json_is_number(v));
  return json_number_value(v);
}

static void check_example(const json_t *o) {
  assert_true(json_is_integer(json_object_get(o, "step")));
  assert_true(json_is_integer(json_object_get(o, "tokens")));
  assert_int_equal(json_integer_value(json_object_get(o, "step")), 12);
  assert_int_equal(json_integer_value(json_object_get(o, "tokens")), 4096);
  assert_true(num(o, "loss") == 3.4567);
  assert_true(num(o, "grad_norm") == 1.234);
  assert_true(num(o, "lr") == 3e-4);
  assert_true(num(o, "tokens_per_s") == 1234.5);
  assert_true(num(o, "mfu") == 0.0123);
  assert_true(num(o, "peak_tflops") == 0.5);
  assert_true(json_is_true(json_object_get(o, "peak_measured")));
  assert_true(num(o, "peak_rss_mib_min") == 300.25);
  assert_true(num(o, "peak_rss_mib_max") == 345.6);
  assert_true(num(o, "device_peak_mib") == 123.5);
  assert_true(json_is_false(json_object_get(o, "skipped")));
  assert_true(json_is_integer(json_object_get(o, "minor_faults")));
  assert_int_equal(json_integer_value(json_object_get(o, "minor_faults")), 7);
  assert_true(num(o, "time") == 83.25);
}

/* README.md's field list of --metrics ("JSONL (`step, loss, ...`") is the keys. */
static void test_readme_fields(void **state) {
  FILE *f = fopen(ML_SOURCE_DIR "/README.md", "r");
  if (!f) fail_msg("cannot open %s/README.md", ML_SOURCE_DIR);
  static char text[1 << 18];
  text[fread(text, 1, sizeof text - 1, f)] = '\0';
  fclose(f);
  const char *at = strstr(text, "`--metrics` writes the same as JSONL (`");
  if (!at) fail_msg("README.md: no \"`--metrics` writes the same as JSONL (`\"");
  at = strchr(at, '(') + 2;
  size_t i = 0, n = sizeof k_keys / sizeof k_keys[0];
  for (;;) {
    at += strspn(at, ", \n");
    size_t len = strcspn(at, ", \n`");
    if (len == 0) break;
    if (i >= n) fail_msg("README.md's metrics field %.*s is not a key", (int)len, at);
    if (strlen(k_keys[i]) != len || strncmp(at, k_keys[i], len) != 0)
      fail_msg("README.md's metrics field %zu is %.*s, the key is %s", i, (int)len, at, k_keys[i]);
    i++;
    at += len;
  }
  if (i != n) fail_msg("README.md lists %zu metrics fields, the keys are %zu", i, n);
}

static void test_jsonl_roundtrip(void **state) {
  char dir[] = "/tmp/ml_test_metrics_XXXXXX", path[64];
  assert_non_null(mkdtemp(dir));
  snprintf(path, sizeof path, "%s/metrics.jsonl", dir);
  ml_metrics_writer w;
  assert_int_equal(ml_metrics_open(path, &w), 0);
  assert_int_equal(ml_metrics_write(&w, &k_example), 0);
  /* Flushed per line: readable before close. */
  FILE *f = fopen(path, "r");
  assert_non_null(f);
  json_t *o = read_line(f);
  check_example(o);
  const char *key;
  json_t *v;
  size_t i = 0;
  json_object_foreach(o, key, v) assert_string_equal(key, k_keys[i++]);
  json_decref(o);
  ml_step_metrics diverged = k_example;
  diverged.step = 13;
  diverged.loss = NAN;
  diverged.grad_norm = INFINITY;
  diverged.skipped = true;
  diverged.peak_tflops = 0; /* unknown peak: no MFU */
  assert_int_equal(ml_metrics_write(&w, &diverged), 0);
  o = read_line(f);
  assert_true(json_is_null(json_object_get(o, "mfu")));
  assert_true(json_is_null(json_object_get(o, "peak_tflops")));
  assert_true(json_is_null(json_object_get(o, "loss")));
  assert_true(json_is_null(json_object_get(o, "grad_norm")));
  assert_true(json_is_true(json_object_get(o, "skipped")));
  assert_int_equal(json_integer_value(json_object_get(o, "step")), 13);
  json_decref(o);
  fclose(f);
  ml_metrics_close(&w);
  ml_metrics_close(&w);
  assert_int_equal(unlink(path), 0);
  assert_int_equal(rmdir(dir), 0);
}

/* The eval line (train --eval-data): exactly {"step", "eval_loss",
 * "eval_tokens"} in that order, the loss round-tripped, null when not
 * finite. */
static void test_eval_line(void **state) {
  char dir[] = "/tmp/ml_test_metrics_XXXXXX", path[64], line[256];
  assert_non_null(mkdtemp(dir));
  snprintf(path, sizeof path, "%s/metrics.jsonl", dir);
  ml_metrics_writer w;
  assert_int_equal(ml_metrics_open(path, &w), 0);
  assert_int_equal(ml_metrics_write_eval(&w, 4, 2.0 / 3.0, 1234), 0);
  assert_int_equal(ml_metrics_write_eval(&w, 5, NAN, 0), 0);
  FILE *f = fopen(path, "r");
  assert_non_null(f);
  assert_non_null(fgets(line, sizeof line, f));
  json_t *o = json_loads(line, JSON_REJECT_DUPLICATES, NULL);
  assert_non_null(o);
  const char *keys[] = {"step", "eval_loss", "eval_tokens"}, *key;
  json_t *v;
  size_t i = 0;
  json_object_foreach(o, key, v) assert_string_equal(key, keys[i++]);
  assert_int_equal(i, 3);
  assert_int_equal(json_integer_value(json_object_get(o, "step")), 4);
  assert_true(json_real_value(json_object_get(o, "eval_loss")) == 2.0 / 3.0);
  assert_int_equal(json_integer_value(json_object_get(o, "eval_tokens")), 1234);
  json_decref(o);
  assert_non_null(fgets(line, sizeof line, f));
  assert_string_equal(line, "{\"step\":5,\"eval_loss\":null,\"eval_tokens\":0}\n");
  fclose(f);
  ml_metrics_close(&w);
  assert_int_equal(unlink(path), 0);
  assert_int_equal(rmdir(dir), 0);
}

static void test_open_error(void **state) {
  ml_metrics_writer w;
  ml_error_clear();
  assert_int_equal(ml_metrics_open("/nonexistent/meshlm/metrics.jsonl", &w), -1);
  assert_non_null(strstr(ml_error_msg(), "/nonexistent/meshlm/metrics.jsonl"));
  ml_metrics_close(&w);
}

static void test_peak_rss(void **state) {
  double mib = ml_peak_rss_mib();
  assert_true(mib > 0.5 && mib < 1e6);
}

/* The calibration returns a rate: positive and below any CPU's reach
 * (1 PFLOP/s); the time box bounds its run time, not its result. */
static void test_gemm_rate(void **state) {
  ml_backend *be;
  assert_int_equal(ml_backend_get("cpu", 0, &be), 0);
  for (int bf16 = 0; bf16 < 2; bf16++) {
    double r = ml_gemm_flops_per_s(be, bf16 ? ML_BF16 : ML_F32, 0.01);
    assert_true(r > 0 && r < 1e15);
  }
}

static void test_flops_and_mfu(void **state) {
  double fpt = ml_flops_per_token(1e9, 24, 2048, 1024);
  assert_true(fpt == 6e9 + 12.0 * 24 * 2048 * 1024);
  assert_true(ml_flops_per_token(0, 1, 1, 1) == 12.0);
  /* exact (tests/tolerance.h TOL_EXACT): 1e9·1000 = 1e12 is exact and
   * 1e12/1e13 rounds to the double nearest 0.1, the literal */
  assert_true(fabs(ml_mfu(1e9, 1000, 1e13) - 0.1) <= TOL_EXACT);
  assert_true(ml_mfu(1e9, 1000, 0) == 0.0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_print),      cmocka_unit_test(test_print_skipped),
      cmocka_unit_test(test_print_durations),
      cmocka_unit_test(test_print_peak_sources), cmocka_unit_test(test_gemm_rate),
      cmocka_unit_test(test_jsonl_roundtrip), cmocka_unit_test(test_readme_fields),
      cmocka_unit_test(test_open_error), cmocka_unit_test(test_eval_line),
      cmocka_unit_test(test_peak_rss), cmocka_unit_test(test_flops_and_mfu),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

/* The Jinja interpreter (src/template) against transformers: every case of
 * tests/fixtures/jinja/cases.json (tools/gen_jinja_fixtures.py) renders
 * byte for byte as transformers' compiled environment rendered it, with
 * the same {% generation %} spans; the real chat templates (SmolLM2,
 * Gemma 3, DeepSeek-R1-Distill, Command R7B) as render_jinja_template
 * (apply_chat_template) rendered them;
 * errors and refused constructs fail with a message containing the
 * expected words; bad input (unterminated tags, deep nesting, huge loops,
 * huge outputs, mutated templates) fails cleanly within the bounds. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/status.h"
#include "template/jinja.h"

#define FIXTURES ML_SOURCE_DIR "/tests/fixtures/jinja"

static json_t *g_fix;

static int group_setup(void **state) {
  json_error_t e;
  g_fix = json_load_file(FIXTURES "/cases.json", 0, &e);
  if (!g_fix) fprintf(stderr, "%s/cases.json:%d: %s\n", FIXTURES, e.line, e.text);
  return g_fix ? 0 : -1;
}

static int group_teardown(void **state) {
  json_decref(g_fix);
  return 0;
}

static char *read_file(const char *path, size_t *len) {
  FILE *fp = fopen(path, "rb");
  if (!fp) return NULL;
  fseek(fp, 0, SEEK_END);
  long n = ftell(fp);
  rewind(fp);
  char *buf = malloc((size_t)n + 1);
  *len = fread(buf, 1, (size_t)n, fp);
  buf[*len] = 0;
  fclose(fp);
  return buf;
}

/* Parse and render; 0 with *out, or -1 (the message recorded). */
static int render(const char *src, size_t len, const char *origin, const json_t *ctx, ml_jinja_output *out) {
  ml_jinja *t;
  ml_error_clear();
  memset(out, 0, sizeof *out);
  if (ml_jinja_parse(src, len, origin, &t)) return -1;
  int rc = ml_jinja_render(t, ctx, out);
  ml_jinja_free(t);
  return rc;
}

/* One fixture case: its text and spans, or its error words. Returns the
 * number of mismatches (printed). */
static int check_case(const json_t *c, const char *src, size_t len) {
  const char *name = json_string_value(json_object_get(c, "name"));
  const json_t *text = json_object_get(c, "text");
  const char *words = json_string_value(json_object_get(c, "error"));
  if (!words) words = json_string_value(json_object_get(c, "refused"));
  const json_t *ctx = json_object_get(c, "context");
  if (json_is_string(ctx)) ctx = json_object_get(json_object_get(g_fix, "contexts"), json_string_value(ctx));
  ml_jinja_output o;
  int rc = render(src, len, name, ctx, &o);
  int bad = 0;
  if (words) {
    if (rc == 0) {
      fprintf(stderr, "FAIL %s: rendered \"%s\", expected an error containing \"%s\"\n", name, o.text, words);
      bad = 1;
    } else if (!strstr(ml_error_msg(), words)) {
      fprintf(stderr, "FAIL %s: error \"%s\" lacks \"%s\"\n", name, ml_error_msg(), words);
      bad = 1;
    }
  } else if (rc) {
    fprintf(stderr, "FAIL %s: %s\n", name, ml_error_msg());
    bad = 1;
  } else {
    size_t want_len = json_string_length(text);
    if (o.len != want_len || memcmp(o.text, json_string_value(text), want_len) != 0) {
      fprintf(stderr, "FAIL %s:\n  got      \"%s\"\n  expected \"%s\"\n", name, o.text, json_string_value(text));
      bad = 1;
    }
    const json_t *gen = json_object_get(c, "gen");
    bool spans_ok = o.ngen == json_array_size(gen);
    for (size_t i = 0; spans_ok && i < o.ngen; i++) {
      const json_t *s = json_array_get(gen, i);
      spans_ok = (json_int_t)o.gen[i].begin == json_integer_value(json_array_get(s, 0)) &&
                 (json_int_t)o.gen[i].end == json_integer_value(json_array_get(s, 1));
    }
    if (!spans_ok) {
      fprintf(stderr, "FAIL %s: %zu generation spans differ from the %zu expected\n", name, o.ngen,
              json_array_size(gen));
      bad = 1;
    }
  }
  ml_jinja_output_free(&o);
  ml_error_clear();
  return bad;
}

/* The differential suite: small templates as transformers renders them. */
static void test_cases(void **state) {
  const json_t *cases = json_object_get(g_fix, "cases");
  assert_true(json_array_size(cases) > 500);
  int bad = 0;
  size_t i;
  const json_t *c;
  json_array_foreach(cases, i, c) {
    const json_t *t = json_object_get(c, "template");
    bad += check_case(c, json_string_value(t), json_string_length(t));
  }
  assert_int_equal(bad, 0);
}

/* The real chat templates over conversations, as apply_chat_template. */
static void test_real_templates(void **state) {
  const json_t *real = json_object_get(g_fix, "real");
  assert_true(json_array_size(real) >= 35);
  int bad = 0, smol = 0, gemma = 0, other = 0;
  size_t i;
  const json_t *c;
  json_array_foreach(real, i, c) {
    const char *name = json_string_value(json_object_get(c, "template"));
    char path[512];
    size_t len = 0;
    snprintf(path, sizeof path, "%s/templates/%s.jinja", FIXTURES, name);
    char *src = read_file(path, &len);
    assert_non_null(src);
    bad += check_case(c, src, len);
    smol += !strcmp(name, "smollm2");
    gemma += !strcmp(name, "gemma3");
    other += strcmp(name, "smollm2") && strcmp(name, "gemma3");
    free(src);
  }
  assert_int_equal(bad, 0);
  assert_true(smol >= 10 && gemma >= 10 && other >= 15);
}

/* The error names the template and a position. */
static void expect_error(const char *src, const json_t *ctx, const char *words) {
  ml_jinja_output o;
  json_t *empty = json_object();
  int rc = render(src, strlen(src), "bad.jinja", ctx ? ctx : empty, &o);
  json_decref(empty);
  if (rc == 0) fail_msg("\"%.80s\" rendered, expected an error containing \"%s\"", src, words);
  if (!strstr(ml_error_msg(), words) || !strstr(ml_error_msg(), "bad.jinja"))
    fail_msg("\"%.80s\": error \"%s\" lacks \"%s\" or the origin", src, ml_error_msg(), words);
  ml_error_clear();
}

static char *repeat(const char *head, const char *unit, size_t n, const char *tail) {
  size_t hl = strlen(head), ul = strlen(unit), tl = strlen(tail);
  char *s = malloc(hl + ul * n + tl + 1);
  memcpy(s, head, hl);
  for (size_t i = 0; i < n; i++) memcpy(s + hl + i * ul, unit, ul);
  memcpy(s + hl + ul * n, tail, tl + 1);
  return s;
}

static void test_bad_input(void **state) {
  expect_error("{{ x", NULL, "bad.jinja:1:1: unterminated '{{'");
  expect_error("ab\n  {% if x", NULL, "bad.jinja:2:3: unterminated '{%'");
  expect_error("{% for x in y %}", NULL, "'{% endfor %}'");
  expect_error("{% if x %}{% endfor %}", NULL, "unexpected '{% endfor %}'");
  expect_error("{{ 'a }}", NULL, "unterminated string");
  expect_error("{# x", NULL, "unterminated comment");
  expect_error("{% raw %}x", NULL, "endraw");
  expect_error("{{ }}", NULL, "expected an expression");
  expect_error("{{ a b }}", NULL, "found 'b', expected '}}'");
  expect_error("{% frobnicate %}", NULL, "unknown tag 'frobnicate'");
  expect_error("{% set x.y %}{% endset %}", NULL, "'='");
  expect_error("{{ 99999999999999999999 }}", NULL, "does not fit 64 bits");
  expect_error("{{ 9223372036854775807 + 1 }}", NULL, "overflow");
  expect_error("{{ 'a' * 1000000000000 }}", NULL, "MiB");
  /* nesting deeper than the bound, in brackets, operators and blocks */
  char *s = repeat("{{ ", "(", 100000, "1 }}");
  expect_error(s, NULL, "nested deeper");
  free(s);
  s = repeat("{{ ", "not ", 100000, "1 }}");
  expect_error(s, NULL, "nested deeper");
  free(s);
  s = repeat("{{ ", "-", 100000, "1 }}");
  expect_error(s, NULL, "nested deeper");
  free(s);
  s = repeat("", "{% if 1 %}", 100000, "");
  expect_error(s, NULL, "nested deeper");
  free(s);
  s = repeat("{{ x", "[0]", 100000, " }}"); /* left-deep chains: bounded when evaluated */
  expect_error(s, NULL, "nested deeper");
  free(s);
  s = repeat("{{ 1", " + 1", 100000, " }}");
  expect_error(s, NULL, "nested deeper");
  free(s);
  /* huge loops and outputs stop at the bounds */
  expect_error("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}", NULL,
               "loop iterations");
  expect_error("{% for a in range(100000) %}{{ 'x' * 100000 }}{% endfor %}", NULL, "MiB");
  expect_error("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", NULL, "macro calls nested deeper");
  expect_error("{% set ns = namespace(s='x') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
               NULL, "MiB");
  /* a NUL byte, a context that is not an object */
  ml_jinja *t;
  assert_int_equal(ml_jinja_parse("a\0b", 3, "nul.jinja", &t), -1);
  assert_non_null(strstr(ml_error_msg(), "NUL"));
  ml_error_clear();
  assert_int_equal(ml_jinja_parse("x", 1, "ok.jinja", &t), 0);
  ml_jinja_output o;
  json_t *arr = json_array();
  assert_int_equal(ml_jinja_render(t, arr, &o), -1);
  assert_null(o.text);
  json_decref(arr);
  ml_jinja_free(t);
  ml_error_clear();
}

/* Mutated templates (bytes replaced, dropped, inserted; a fixed seed):
 * every one parses and renders or fails with a message, never crashes,
 * hangs or leaks (the sanitizer builds check the last two). */
static void test_mutations(void **state) {
  static const char alphabet[] = "{}%#-+()[]'\"|.,:=~ \n\tabxyz019_ifendforsetloopnsis*/<>!\\";
  const json_t *cases = json_object_get(g_fix, "cases");
  const json_t *ctx = json_object_get(json_object_get(g_fix, "contexts"), "random");
  uint64_t seed = 0x9E3779B97F4A7C15u;
  int ok = 0, failed = 0;
  for (int it = 0; it < 3000; it++) {
    seed = seed * 6364136223846793005u + 1442695040888963407u;
    const json_t *c = json_array_get(cases, (size_t)(seed >> 33) % json_array_size(cases));
    const json_t *t = json_object_get(c, "template");
    size_t n = json_string_length(t);
    char *src = malloc(n + 16);
    memcpy(src, json_string_value(t), n);
    for (int m = 0; m < 1 + it % 4; m++) {
      seed = seed * 6364136223846793005u + 1442695040888963407u;
      size_t pos = n ? (size_t)(seed >> 20) % n : 0;
      char ch = alphabet[(seed >> 40) % (sizeof alphabet - 1)];
      unsigned op = (unsigned)(seed >> 60) % 3;
      if (op == 0 && n) { /* replace */
        src[pos] = ch;
      } else if (op == 1 && n) { /* drop */
        memmove(src + pos, src + pos + 1, n - pos - 1);
        n--;
      } else if (op == 2 && n < json_string_length(t) + 15) { /* insert */
        memmove(src + pos + 1, src + pos, n - pos);
        src[pos] = ch;
        n++;
      }
    }
    ml_jinja_output o;
    if (render(src, n, "mutant", ctx, &o) == 0) {
      ok++;
      assert_int_equal(strlen(o.text), o.len);
      ml_jinja_output_free(&o);
    } else {
      failed++;
      assert_true(ml_error_msg()[0] != 0);
    }
    ml_error_clear();
    free(src);
  }
  assert_true(ok > 100 && failed > 100);
}

/* The API around a render: has_generation, an empty output, reuse. */
static void test_api(void **state) {
  ml_jinja *t;
  const char *src = "{% for m in messages %}{% generation %}{{ m }}{% endgeneration %}{% endfor %}";
  assert_int_equal(ml_jinja_parse(src, strlen(src), "api", &t), 0);
  assert_true(ml_jinja_has_generation(t));
  json_t *ctx = json_pack("{s:[s,s]}", "messages", "ab", "c");
  for (int rep = 0; rep < 2; rep++) { /* a template renders any number of times */
    ml_jinja_output o;
    assert_int_equal(ml_jinja_render(t, ctx, &o), 0);
    assert_int_equal(o.len, 3);
    assert_string_equal(o.text, "abc");
    assert_int_equal(o.ngen, 2);
    assert_int_equal(o.gen[0].begin, 0);
    assert_int_equal(o.gen[0].end, 2);
    assert_int_equal(o.gen[1].begin, 2);
    assert_int_equal(o.gen[1].end, 3);
    ml_jinja_output_free(&o);
  }
  ml_jinja_free(t);
  json_t *empty = json_object();
  assert_int_equal(ml_jinja_parse("", 0, "empty", &t), 0);
  assert_false(ml_jinja_has_generation(t));
  ml_jinja_output o;
  assert_int_equal(ml_jinja_render(t, empty, &o), 0);
  assert_non_null(o.text);
  assert_int_equal(o.len, 0);
  assert_int_equal(o.ngen, 0);
  ml_jinja_output_free(&o);
  ml_jinja_free(t);
  assert_int_equal(ml_jinja_parse(NULL, 0, "null", &t), 0); /* an empty template may come as NULL */
  ml_jinja_free(t);
  ml_jinja_free(NULL);
  json_decref(ctx);
  json_decref(empty);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_cases),
      cmocka_unit_test(test_real_templates),
      cmocka_unit_test(test_bad_input),
      cmocka_unit_test(test_mutations),
      cmocka_unit_test(test_api),
  };
  return cmocka_run_group_tests(tests, group_setup, group_teardown);
}

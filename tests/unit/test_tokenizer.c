/* The tokenizer (src/tokenizer) against golden ids from Hugging Face
 * `tokenizers` (tests/fixtures/tokenizer/NAME/cases.json, made by
 * tools/gen_tokenizer_fixtures.py): every case's ids with and without
 * special tokens, its decoding, BOS / EOS; invalid UTF-8; load errors for
 * what meshlm does not implement. */
#define _XOPEN_SOURCE 700
#define TMPDIR_PREFIX "ml_test_tokenizer"

#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cmocka.h>
#include <jansson.h>

#include "common/status.h"
#include "tmpdir.h"
#include "tokenizer/tokenizer.h"

#define FIXTURES ML_SOURCE_DIR "/tests/fixtures/tokenizer"

/* Print a string with escapes, for failure messages. */
static void show(const char *what, const char *s, size_t len) {
  fprintf(stderr, "  %s: \"", what);
  for (size_t i = 0; i < len && i < 300; i++) {
    unsigned char c = (unsigned char)s[i];
    if (c < 0x20 || c == '"' || c == '\\')
      fprintf(stderr, "\\x%02X", c);
    else
      fputc(c, stderr);
  }
  fprintf(stderr, "%s\"\n", len > 300 ? "..." : "");
}

static void show_ids(const char *what, const int32_t *ids, size_t n) {
  fprintf(stderr, "  %s (%zu):", what, n);
  for (size_t i = 0; i < n && i < 60; i++) fprintf(stderr, " %d", ids[i]);
  fprintf(stderr, "%s\n", n > 60 ? " ..." : "");
}

/* Every case of fixture `name`: ids, decoding, BOS / EOS. */
static void check_fixture(const char *name) {
  char dir[1024], path[1100];
  snprintf(dir, sizeof dir, "%s/%s", FIXTURES, name);
  snprintf(path, sizeof path, "%s/cases.json", dir);
  json_error_t je;
  json_t *doc = json_load_file(path, JSON_ALLOW_NUL, &je);
  if (!doc) fail_msg("%s: %s", path, je.text);
  ml_tokenizer *t = NULL;
  if (ml_tokenizer_load(dir, &t)) fail_msg("load %s: %s", dir, ml_error_msg());
  const json_t *cases = json_object_get(doc, "cases");
  size_t n_cases = json_array_size(cases), bad = 0;
  assert_true(n_cases > 0);
  for (size_t i = 0; i < n_cases; i++) {
    const json_t *c = json_array_get(cases, i);
    const json_t *text = json_object_get(c, "text"), *ids = json_object_get(c, "ids");
    const char *s = json_string_value(text);
    size_t len = json_string_length(text);
    bool add_special = json_is_true(json_object_get(c, "add_special"));
    ml_tokens got = {0};
    if (ml_tokenizer_encode(t, s, len, add_special, &got))
      fail_msg("%s case %zu: encode: %s", name, i, ml_error_msg());
    size_t n = json_array_size(ids);
    bool same = got.n == n;
    for (size_t k = 0; same && k < n; k++)
      same = got.ids[k] == (int32_t)json_integer_value(json_array_get(ids, k));
    if (!same && bad++ < 5) {
      int32_t *want = malloc((n ? n : 1) * sizeof *want);
      for (size_t k = 0; k < n; k++) want[k] = (int32_t)json_integer_value(json_array_get(ids, k));
      fprintf(stderr, "%s case %zu (add_special %d) differs from tokenizers:\n", name, i,
              add_special);
      show("text", s, len);
      show_ids("want", want, n);
      show_ids("got ", got.ids, got.n);
      free(want);
    }
    const json_t *dec = json_object_get(c, "decoded");
    char *out = NULL;
    size_t out_len = 0;
    if (ml_tokenizer_decode(t, got.ids, got.n, false, &out, &out_len))
      fail_msg("%s case %zu: decode: %s", name, i, ml_error_msg());
    if (same &&
        (out_len != json_string_length(dec) || memcmp(out, json_string_value(dec), out_len) != 0) &&
        bad++ < 5) {
      fprintf(stderr, "%s case %zu: decoding differs from tokenizers:\n", name, i);
      show("want", json_string_value(dec), json_string_length(dec));
      show("got ", out, out_len);
    }
    free(out);
    ml_tokens_free(&got);
  }
  const json_t *bos = json_object_get(doc, "bos"), *eos = json_object_get(doc, "eos");
  if (json_is_integer(bos)) assert_int_equal(ml_tokenizer_bos(t), json_integer_value(bos));
  if (json_is_integer(eos)) assert_int_equal(ml_tokenizer_eos(t), json_integer_value(eos));
  fprintf(stderr, "%s: %zu cases, %zu differ\n", name, n_cases, bad);
  ml_tokenizer_free(t);
  json_decref(doc);
  assert_int_equal(bad, 0);
}

static void test_bytelevel(void **state) { check_fixture("bytelevel"); }
static void test_bytelevel_legacy(void **state) { check_fixture("bytelevel_legacy"); }
static void test_bytelevel_ignore(void **state) { check_fixture("bytelevel_ignore"); }
static void test_digits(void **state) { check_fixture("digits"); }
static void test_splits(void **state) { check_fixture("splits"); }
static void test_gpt2(void **state) { check_fixture("gpt2"); }
static void test_spm(void **state) { check_fixture("spm"); }
static void test_spm_prepend(void **state) { check_fixture("spm_prepend"); }

static void test_smollm2(void **state) {
  struct stat st;
  if (stat(FIXTURES "/smollm2/cases.json", &st) != 0) skip();
  check_fixture("smollm2");
}

/* Several threads encoding with one tokenizer at once (each with its own
 * BPE cache) give every case's ids. */
typedef struct thread_job {
  const ml_tokenizer *t;
  const json_t *cases;
  size_t bad;
} thread_job;

static void *encode_all(void *arg) {
  thread_job *j = arg;
  for (int round = 0; round < 3; round++) {
    for (size_t i = 0; i < json_array_size(j->cases); i++) {
      const json_t *c = json_array_get(j->cases, i), *text = json_object_get(c, "text");
      const json_t *ids = json_object_get(c, "ids");
      ml_tokens got = {0};
      bool ok = ml_tokenizer_encode(j->t, json_string_value(text), json_string_length(text),
                                    json_is_true(json_object_get(c, "add_special")), &got) == 0 &&
                got.n == json_array_size(ids);
      for (size_t k = 0; ok && k < got.n; k++)
        ok = got.ids[k] == json_integer_value(json_array_get(ids, k));
      j->bad += !ok;
      ml_tokens_free(&got);
    }
  }
  return NULL;
}

static void test_threads(void **state) {
  json_error_t je;
  json_t *doc = json_load_file(FIXTURES "/bytelevel/cases.json", JSON_ALLOW_NUL, &je);
  assert_non_null(doc);
  ml_tokenizer *t = NULL;
  assert_int_equal(ml_tokenizer_load(FIXTURES "/bytelevel", &t), 0);
  enum { N = 4 };
  pthread_t th[N];
  thread_job jobs[N];
  for (int i = 0; i < N; i++) {
    jobs[i] = (thread_job){t, json_object_get(doc, "cases"), 0};
    assert_int_equal(pthread_create(&th[i], NULL, encode_all, &jobs[i]), 0);
  }
  for (int i = 0; i < N; i++) {
    assert_int_equal(pthread_join(th[i], NULL), 0);
    assert_int_equal(jobs[i].bad, 0);
  }
  ml_tokenizer_free(t);
  json_decref(doc);
}

/* BOS / EOS and whether encode adds them, from the template and the config. */
static void test_bos_eos(void **state) {
  ml_tokenizer *t = NULL;
  assert_int_equal(ml_tokenizer_load(FIXTURES "/bytelevel_legacy", &t), 0);
  assert_true(ml_tokenizer_adds_bos(t));
  assert_true(ml_tokenizer_adds_eos(t));
  assert_true(ml_tokenizer_bos(t) >= 0 && ml_tokenizer_eos(t) >= 0);
  assert_true(ml_tokenizer_vocab_size(t) > ml_tokenizer_eos(t));
  ml_tokenizer_free(t);
  assert_int_equal(ml_tokenizer_load(FIXTURES "/gpt2", &t), 0);
  assert_false(ml_tokenizer_adds_bos(t));
  assert_int_equal(ml_tokenizer_bos(t), -1);
  assert_int_equal(ml_tokenizer_eos(t), -1);
  ml_tokenizer_free(t);
  assert_int_equal(ml_tokenizer_load(FIXTURES "/spm", &t), 0);
  assert_true(ml_tokenizer_adds_bos(t));
  assert_false(ml_tokenizer_adds_eos(t));
  assert_int_equal(ml_tokenizer_bos(t), 2);
  ml_tokenizer_free(t);
  /* special_tokens_map.json over tokenizer_config.json, as transformers 5 reads them */
  json_t *doc = json_load_file(FIXTURES "/bytelevel/tokenizer.json", 0, NULL);
  assert_int_equal(json_dump_file(doc, tpath("tokenizer.json"), 0), 0);
  json_decref(doc);
  FILE *f = fopen(tpath("tokenizer_config.json"), "w");
  fputs("{\"bos_token\": \"<|im_start|>\", \"eos_token\": \"<|im_end|>\", "
        "\"model_max_length\": 1000000000000000019884624838656}", f);
  fclose(f);
  f = fopen(tpath("special_tokens_map.json"), "w");
  fputs("{\"bos_token\": {\"content\": \"<|begin_of_text|>\"}, \"eos_token\": null}", f);
  fclose(f);
  assert_int_equal(ml_tokenizer_load(g_dir, &t), 0);
  assert_int_equal(ml_tokenizer_bos(t), 1500); /* <|begin_of_text|> */
  assert_int_equal(ml_tokenizer_eos(t), -1);   /* null, as transformers reads it */
  assert_true(ml_tokenizer_adds_bos(t));
  ml_tokenizer_free(t);
  remove(tpath("tokenizer_config.json"));
  remove(tpath("special_tokens_map.json"));
}

/* Invalid UTF-8 is an error naming the byte offset; the output is untouched. */
static void test_invalid_utf8(void **state) {
  ml_tokenizer *t = NULL;
  assert_int_equal(ml_tokenizer_load(FIXTURES "/bytelevel", &t), 0);
  static const struct {
    const char *s;
    size_t len, off;
  } bad[] = {
      {"abc\xFF", 4, 3},
      {"ok \xC3", 4, 3},
      {"\xED\xA0\x80 surrogate", 12, 0},
      {"x\xC0\xAF overlong", 12, 1},
      {"hi \xF4\x90\x80\x80", 7, 3},
      {"a\x80", 2, 1},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    ml_tokens out = {0};
    ml_error_clear();
    assert_int_equal(ml_tokenizer_encode(t, "fine", 4, false, &out), 0);
    size_t n0 = out.n;
    assert_int_equal(ml_tokenizer_encode(t, bad[i].s, bad[i].len, true, &out), -1);
    char want[64];
    snprintf(want, sizeof want, "at byte offset %zu", bad[i].off);
    if (!strstr(ml_error_msg(), want)) fail_msg("case %zu: %s", i, ml_error_msg());
    assert_int_equal(out.n, n0);
    ml_tokens_free(&out);
  }
  ml_error_clear();
  ml_tokenizer_free(t);
}

/* A copy of the bytelevel fixture's tokenizer.json with `edit` applied
 * (jansson), loaded: returns the load status; the message in ml_error_msg. */
static int load_edited(void (*edit)(json_t *doc)) {
  json_error_t je;
  json_t *doc = json_load_file(FIXTURES "/bytelevel/tokenizer.json", 0, &je);
  assert_non_null(doc);
  edit(doc);
  assert_int_equal(json_dump_file(doc, tpath("tokenizer.json"), 0), 0);
  json_decref(doc);
  ml_error_clear();
  ml_tokenizer *t = NULL;
  int rc = ml_tokenizer_load(g_dir, &t);
  ml_tokenizer_free(t);
  return rc;
}

static void expect_error(void (*edit)(json_t *doc), const char *const *parts) {
  assert_int_equal(load_edited(edit), -1);
  for (; *parts; parts++)
    if (!strstr(ml_error_msg(), *parts)) fail_msg("'%s' not in: %s", *parts, ml_error_msg());
  ml_error_clear();
}

static void wordpiece(json_t *d) {
  json_object_set_new(json_object_get(d, "model"), "type", json_string("WordPiece"));
}
static void metaspace(json_t *d) {
  json_object_set_new(d, "pre_tokenizer",
                      json_pack("{s:s,s:s}", "type", "Metaspace", "replacement", "_"));
}
static void lowercase(json_t *d) {
  json_object_set_new(d, "normalizer", json_pack("{s:s}", "type", "Lowercase"));
}
static void bad_merge(json_t *d) {
  json_t *merges = json_object_get(json_object_get(d, "model"), "merges");
  json_array_set_new(merges, 3, json_pack("[s,s]", "q", "nosuchtoken"));
}
static void bad_merge_string(json_t *d) {
  json_t *merges = json_object_get(json_object_get(d, "model"), "merges");
  json_array_set_new(merges, 0, json_pack("[s,s]", "a", "b"));
  json_array_set_new(merges, 1, json_string("a b c"));
}
static void dropout(json_t *d) {
  json_object_set_new(json_object_get(d, "model"), "dropout", json_real(0.1));
}
static void prefix(json_t *d) {
  json_object_set_new(json_object_get(d, "model"), "continuing_subword_prefix", json_string("##"));
}
static void roberta(json_t *d) {
  json_object_set_new(d, "post_processor", json_pack("{s:s}", "type", "RobertaProcessing"));
}
static void wordpiece_decoder(json_t *d) {
  json_object_set_new(d, "decoder", json_pack("{s:s}", "type", "WordPiece"));
}
static void truncation(json_t *d) {
  json_object_set_new(d, "truncation", json_pack("{s:i}", "max_length", 8));
}
static void bytelevel_first(json_t *d) {
  json_t *seq = json_object_get(json_object_get(d, "pre_tokenizer"), "pretokenizers");
  json_t *split = json_incref(json_array_get(seq, 0));
  json_array_remove(seq, 0);
  json_array_append_new(seq, split);
}
static void bad_regex(json_t *d) {
  json_t *seq = json_object_get(json_object_get(d, "pre_tokenizer"), "pretokenizers");
  json_object_set_new(json_array_get(seq, 0), "pattern", json_pack("{s:s}", "Regex", "\\bword"));
}

/* Sparse ids (tok_id): the bytelevel fixture's vocabulary has 1500
 * tokens; with one more, model.vocab's ids must lie below 2 · 1501 + 256 =
 * 3258, whatever the file's size (an id of 2·10^9 made a dense 8 GB table). */
static json_int_t g_sparse_id;
static void sparse_vocab_id(json_t *d) {
  json_t *vocab = json_object_get(json_object_get(d, "model"), "vocab");
  assert_int_equal(json_object_size(vocab), 1500);
  json_object_set_new(vocab, "zz_sparse", json_integer(g_sparse_id));
}
/* The template's BOS (1500 tokens and the added ones: the bound is above 3256). */
static void sparse_template_id(json_t *d) {
  json_t *procs = json_object_get(json_object_get(d, "post_processor"), "processors");
  json_t *specials = json_object_get(json_array_get(procs, 1), "special_tokens");
  json_t *bos = json_object_get(specials, "<|begin_of_text|>");
  json_object_set_new(bos, "ids", json_pack("[I]", g_sparse_id));
}

static void test_sparse_ids(void **state) {
  g_sparse_id = 3257; /* the largest id allowed */
  assert_int_equal(load_edited(sparse_vocab_id), 0);
  g_sparse_id = 3258;
  expect_error(sparse_vocab_id,
               (const char *const[]){"tokenizer.json", "model.vocab[\"zz_sparse\"]", "found 3258",
                                     "expected an id in [0, 3258)", "1501 tokens", NULL});
  g_sparse_id = 2000000000;
  expect_error(sparse_vocab_id, (const char *const[]){"model.vocab[\"zz_sparse\"]",
                                                      "found 2000000000", "[0, 3258)", NULL});
  expect_error(sparse_template_id,
               (const char *const[]){"tokenizer.json", "post_processor.processors[1].single[0]",
                                     "found 2000000000", "expected an id in [0, ", NULL});
}

/* The bytelevel fixture's template has nothing after $A (as SmolLM2's has
 * nothing around it): encoding with special tokens appends an empty side;
 * decoding nothing, or only special tokens skipped, runs the ByteLevel
 * decoder on no tokens. Both once read through NULL (UBSan). */
static void test_empty_template_side(void **state) {
  ml_tokenizer *t = NULL;
  assert_int_equal(ml_tokenizer_load(FIXTURES "/bytelevel", &t), 0);
  assert_true(ml_tokenizer_adds_bos(t));
  assert_false(ml_tokenizer_adds_eos(t));
  int32_t bos = ml_tokenizer_bos(t);
  ml_tokens plain = {0}, special = {0}, empty = {0};
  assert_int_equal(ml_tokenizer_encode(t, "hello world", 11, false, &plain), 0);
  assert_int_equal(ml_tokenizer_encode(t, "hello world", 11, true, &special), 0);
  assert_int_equal(special.n, plain.n + 1);
  assert_int_equal(special.ids[0], bos);
  assert_memory_equal(special.ids + 1, plain.ids, plain.n * sizeof *plain.ids);
  assert_int_equal(ml_tokenizer_encode(t, "", 0, true, &empty), 0);
  assert_int_equal(empty.n, 1);
  assert_int_equal(empty.ids[0], bos);
  char *out = NULL;
  size_t len = 1;
  assert_int_equal(ml_tokenizer_decode(t, special.ids, special.n, true, &out, &len), 0);
  assert_string_equal(out, "hello world");
  free(out);
  assert_int_equal(ml_tokenizer_decode(t, empty.ids, empty.n, true, &out, &len), 0);
  assert_int_equal(len, 0);
  assert_string_equal(out, "");
  free(out);
  assert_int_equal(ml_tokenizer_decode(t, NULL, 0, false, &out, &len), 0);
  assert_int_equal(len, 0);
  assert_string_equal(out, "");
  free(out);
  ml_tokens_free(&plain);
  ml_tokens_free(&special);
  ml_tokens_free(&empty);
  ml_tokenizer_free(t);
}

/* Unsupported components and malformed fields: one message naming the
 * file and the field, what was found and what was expected. */
static void test_load_errors(void **state) {
  expect_error(wordpiece,
               (const char *const[]){"tokenizer.json", "model.type", "WordPiece", "BPE", NULL});
  expect_error(metaspace, (const char *const[]){"tokenizer.json", "pre_tokenizer.type", "Metaspace",
                                                "expected", NULL});
  expect_error(lowercase, (const char *const[]){"normalizer.type", "Lowercase", NULL});
  expect_error(bad_merge, (const char *const[]){"model.merges[3]", "nosuchtoken", NULL});
  expect_error(bad_merge_string, (const char *const[]){"model.merges[1]", "a b c", NULL});
  expect_error(dropout, (const char *const[]){"model.dropout", "0.1", NULL});
  expect_error(prefix, (const char *const[]){"model.continuing_subword_prefix", "##", NULL});
  expect_error(roberta, (const char *const[]){"post_processor.type", "RobertaProcessing", NULL});
  expect_error(wordpiece_decoder, (const char *const[]){"decoder.type", "WordPiece", NULL});
  expect_error(truncation, (const char *const[]){"truncation", "max_length", NULL});
  expect_error(bytelevel_first,
               (const char *const[]){"pre_tokenizer.pretokenizers[1]", "ByteLevel", NULL});
  expect_error(bad_regex,
               (const char *const[]){"pre_tokenizer.pretokenizers[0].pattern.Regex", "\\b", NULL});
  ml_tokenizer *t = NULL;
  assert_int_equal(ml_tokenizer_load(g_dir, &t), -1); /* the last edit is refused too */
  ml_error_clear();
  assert_int_equal(ml_tokenizer_load(ML_SOURCE_DIR "/tests/fixtures/no_such_dir", &t), -1);
  if (!strstr(ml_error_msg(), "no_such_dir/tokenizer.json")) fail_msg("%s", ml_error_msg());
  assert_null(t);
  ml_error_clear();
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_bytelevel),
      cmocka_unit_test(test_bytelevel_legacy),
      cmocka_unit_test(test_bytelevel_ignore),
      cmocka_unit_test(test_digits),
      cmocka_unit_test(test_splits),
      cmocka_unit_test(test_gpt2),
      cmocka_unit_test(test_spm),
      cmocka_unit_test(test_spm_prepend),
      cmocka_unit_test(test_smollm2),
      cmocka_unit_test(test_threads),
      cmocka_unit_test(test_bos_eos),
      cmocka_unit_test(test_invalid_utf8),
      cmocka_unit_test(test_load_errors),
      cmocka_unit_test(test_sparse_ids),
      cmocka_unit_test(test_empty_template_side),
  };
  return cmocka_run_group_tests(tests, tmpdir_setup, tmpdir_teardown);
}

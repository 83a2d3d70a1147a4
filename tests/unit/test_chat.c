/* Conversational records (data/data_chat.h): {"messages": [...]} rendered
 * with the model's chat template and encoded, against transformers'
 * apply_chat_template(tokenize=True) on the same conversations
 * (tests/fixtures/chat/cases.json, tools/gen_chat_fixtures.py): the
 * rendered text, the ids and the assistant targets — the {% generation %}
 * spans (return_assistant_tokens_mask) or the prefix rule — through the
 * training loader (rows: the targets but position 0) and the scoring one
 * (ids). SmolLM2's real tokenizer with SmolLM2's and Gemma 3's real
 * templates and a {% generation %} variant, and the 256-id data_formats
 * tokenizer. Also: where the template is found (chat_template.jinja over
 * tokenizer_config.json's string or "default" of a list; none anywhere),
 * assistant_only_loss false, and every bad record and template named with
 * its file, line and field. */
#define _GNU_SOURCE /* asprintf */
#define _XOPEN_SOURCE 700
#define TMPDIR_PREFIX "ml_test_chat"
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
#include "data/data.h"
#include "data/data_chat.h"
#include "tmpdir.h"

#define FIX ML_SOURCE_DIR "/tests/fixtures"

static json_t *g_cases;

static void write_text(const char *path, const char *text) {
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  fwrite(text, 1, strlen(text), f);
  fclose(f);
}

static char *read_text(const char *path) {
  FILE *f = fopen(path, "rb");
  assert_non_null(f);
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *s = malloc((size_t)n + 1);
  assert_int_equal(fread(s, 1, (size_t)n, f), (size_t)n);
  s[n] = 0;
  fclose(f);
  return s;
}

/* A fresh model directory `name` under g_dir with the tokenizer fixture's
 * tokenizer.json and tokenizer_config.json (symlinked). */
static const char *model_dir(const char *name, const char *tokenizer) {
  static char dir[512];
  snprintf(dir, sizeof dir, "%s/%s", g_dir, name);
  mkdir(dir, 0755);
  char src[512], dst[600];
  for (int k = 0; k < 2; k++) {
    const char *f = k ? "tokenizer_config.json" : "tokenizer.json";
    snprintf(src, sizeof src, "%s/%s/%s", FIX, tokenizer, f);
    snprintf(dst, sizeof dst, "%s/%s", dir, f);
    unlink(dst);
    assert_int_equal(symlink(src, dst), 0);
  }
  return dir;
}

/* dir/chat_template.jinja = the fixture template `name` (a path under tests/fixtures). */
static void put_template(const char *dir, const char *name) {
  char src[512], dst[600];
  snprintf(src, sizeof src, "%s/%s", FIX, name);
  snprintf(dst, sizeof dst, "%s/chat_template.jinja", dir);
  char *t = read_text(src);
  write_text(dst, t);
  free(t);
}

/* A data file of one record per case, the case's messages and tools. */
static const char *record_file(const json_t *c) {
  json_t *rec = json_object();
  json_object_set(rec, "messages", json_object_get(c, "messages"));
  if (json_object_get(c, "tools")) json_object_set(rec, "tools", json_object_get(c, "tools"));
  char *line = json_dumps(rec, JSON_COMPACT);
  const char *path = tpath("chat.jsonl");
  write_text(path, line);
  free(line);
  json_decref(rec);
  return path;
}

static void check_case(const json_t *c) {
  const char *name = json_string_value(json_object_get(c, "name"));
  const char *tokenizer = json_string_value(json_object_get(c, "tokenizer"));
  const char *tmpl = json_string_value(json_object_get(c, "template"));
  const json_t *ids = json_object_get(c, "input_ids");
  const json_t *mask = json_object_get(c, "assistant_masks");
  int64_t n = (int64_t)json_array_size(ids), vocab = strstr(tokenizer, "smollm2") ? 49152 : 256;
  const char *dir = model_dir("m", tokenizer);
  put_template(dir, tmpl);
  /* the rendered text */
  ml_chat *chat;
  if (ml_chat_load(dir, &chat)) fail_msg("%s", ml_error_msg());
  ml_chat_text text;
  if (ml_chat_render(chat, "case", c, &text)) fail_msg("%s %s: %s", tmpl, name, ml_error_msg());
  if (strcmp(text.text, json_string_value(json_object_get(c, "text"))) != 0)
    fail_msg("%s %s: rendered\n%s\nexpected\n%s", tmpl, name, text.text,
             json_string_value(json_object_get(c, "text")));
  ml_chat_text_free(&text);
  ml_chat_free(chat);
  /* training rows: ids, targets but position 0 */
  ml_data_opts o = ml_data_opts_default(dir);
  o.packing = false;
  for (int all = 0; all < 2; all++) {
    o.assistant_only_loss = !all;
    ml_dataset ds;
    if (ml_dataset_load(record_file(c), n + 3, vocab, &o, &ds))
      fail_msg("%s %s: %s", tmpl, name, ml_error_msg());
    assert_int_equal(ds.nseq, 1);
    assert_int_equal(ds.tokens, n);
    assert_int_equal(ds.format, ML_DATA_CHAT);
    for (int64_t t = 0; t < n; t++) {
      int want = t == 0 ? 0 : all ? 1 : (int)json_integer_value(json_array_get(mask, (size_t)t));
      if (ds.ids[t] != json_integer_value(json_array_get(ids, (size_t)t)) || ds.mask[t] != want)
        fail_msg("%s %s (assistant_only_loss %s): token %lld: id %d mask %d, expected id %lld "
                 "mask %d",
                 tmpl, name, all ? "false" : "true", (long long)t, ds.ids[t], ds.mask[t],
                 (long long)json_integer_value(json_array_get(ids, (size_t)t)), want);
    }
    for (int64_t t = n; t < n + 3; t++) assert_int_equal(ds.mask[t], 0);
    ml_dataset_free(&ds);
  }
  /* scoring: the same ids */
  ml_seqs s;
  if (ml_seqs_load(record_file(c), vocab, 4096, &o, &s)) fail_msg("%s", ml_error_msg());
  assert_int_equal(s.n, 1);
  assert_int_equal(s.len[0], n);
  assert_int_equal(s.format, ML_DATA_CHAT);
  for (int64_t t = 0; t < n; t++)
    assert_int_equal(s.ids[0][t], json_integer_value(json_array_get(ids, (size_t)t)));
  ml_seqs_free(&s);
}

static void test_transformers_cases(void **state) {
  (void)state;
  const json_t *cases = json_object_get(g_cases, "cases");
  assert_true(json_array_size(cases) >= 10);
  size_t i;
  const json_t *c;
  json_array_foreach(cases, i, c) check_case(c);
}

/* The first case of template `tmpl`. */
static const json_t *case_of(const char *tmpl) {
  size_t i;
  const json_t *c;
  json_array_foreach(json_object_get(g_cases, "cases"), i, c) {
    if (strcmp(json_string_value(json_object_get(c, "template")), tmpl) == 0) return c;
  }
  fail_msg("no case of %s", tmpl);
  return NULL;
}

/* The text ml_chat renders for case c from model directory dir. */
static char *render_text(const char *dir, const json_t *c) {
  ml_chat *chat;
  if (ml_chat_load(dir, &chat)) fail_msg("%s", ml_error_msg());
  ml_chat_text t;
  if (ml_chat_render(chat, "case", c, &t)) fail_msg("%s", ml_error_msg());
  char *s = strdup(t.text);
  ml_chat_text_free(&t);
  ml_chat_free(chat);
  return s;
}

/* tokenizer_config.json of dir = {"bos_token": ..., "chat_template": <json>}. */
static void put_config(const char *dir, const char *chat_template_json) {
  char path[600], *text;
  snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
  unlink(path);
  assert_true(asprintf(&text, "{\"bos_token\": {\"content\": \"<|im_start|>\"}, "
                              "\"eos_token\": \"<|im_end|>\", \"pad_token\": null, "
                              "\"chat_template\": %s}",
                       chat_template_json) > 0);
  write_text(path, text);
  free(text);
}

static void test_template_sources(void **state) {
  (void)state;
  const json_t *c = case_of("jinja/templates/smollm2.jinja");
  const char *want = json_string_value(json_object_get(c, "text"));
  char *src = read_text(FIX "/jinja/templates/smollm2.jinja");
  json_t *s = json_string(src);
  char *js = json_dumps(s, JSON_ENCODE_ANY), *list;
  /* a string in tokenizer_config.json */
  const char *dir = model_dir("cfg", "tokenizer/smollm2");
  put_config(dir, js);
  char *got = render_text(dir, c);
  assert_string_equal(got, want);
  free(got);
  /* a list: "default" used */
  assert_true(asprintf(&list, "[{\"name\": \"rag\", \"template\": \"x\"}, {\"name\": \"default\", "
                              "\"template\": %s}]",
                       js) > 0);
  put_config(dir, list);
  got = render_text(dir, c);
  assert_string_equal(got, want);
  free(got);
  /* chat_template.jinja wins over the config's */
  put_config(dir, "\"{{ 'from the config' }}\"");
  put_template(dir, "jinja/templates/smollm2.jinja");
  got = render_text(dir, c);
  assert_string_equal(got, want);
  free(got);
  /* "tool_use" of a list for a record with tools; "default" for one without */
  free(list);
  assert_true(asprintf(&list, "[{\"name\": \"default\", \"template\": \"plain\"}, {\"name\": "
                              "\"tool_use\", \"template\": \"{{ tools[0].name }}\"}]") > 0);
  put_config(dir, list);
  unlink(tpath("cfg/chat_template.jinja"));
  json_t *rec = json_pack("{s:[{s:s,s:s}],s:[{s:s}]}", "messages", "role", "user", "content", "a",
                          "tools", "name", "get_weather");
  got = render_text(dir, rec);
  assert_string_equal(got, "get_weather");
  free(got);
  json_object_del(rec, "tools");
  got = render_text(dir, rec);
  assert_string_equal(got, "plain");
  free(got);
  json_decref(rec);
  /* messages as transformers passes them: null-valued keys dropped, the reasoning aliased */
  write_text(tpath("cfg/chat_template.jinja"), "{{ messages[0].x is defined }}|{{ messages[0]"
                                                ".thinking }}|{{ messages[0].reasoning_content }}");
  rec = json_pack("{s:[{s:s,s:s,s:n,s:s}]}", "messages", "role", "user", "content", "a", "x",
                  "reasoning", "r");
  got = render_text(dir, rec);
  assert_string_equal(got, "False|r|r");
  free(got);
  json_decref(rec);
  /* the special tokens: {"content"} and strings, null left out */
  write_text(tpath("cfg/chat_template.jinja"), "{{ bos_token }}|{{ eos_token }}|{{ pad_token is "
                                                "defined }}|{{ tools is none }}");
  got = render_text(dir, c);
  assert_string_equal(got, "<|im_start|>|<|im_end|>|False|True");
  free(got);
  free(list);
  free(js);
  json_decref(s);
  free(src);
}

/* ml_chat_load or ml_chat_render of `record` must fail naming each string. */
static void expect_chat_error(const char *dir, const char *record, ...) {
  ml_error_clear();
  ml_dataset ds;
  write_text(tpath("bad.jsonl"), record);
  ml_data_opts o = ml_data_opts_default(dir);
  assert_int_equal(ml_dataset_load(tpath("bad.jsonl"), 64, 49152, &o, &ds), -1);
  va_list ap;
  va_start(ap, record);
  for (const char *s = va_arg(ap, const char *); s; s = va_arg(ap, const char *))
    if (!strstr(ml_error_msg(), s)) fail_msg("message '%s' lacks '%s'", ml_error_msg(), s);
  va_end(ap);
}

static void test_missing_template(void **state) {
  (void)state;
  const char *dir = model_dir("none", "tokenizer/smollm2");
  expect_chat_error(dir, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}",
                    "bad.jsonl:1: field 'messages'", "no chat template", "chat_template.jinja",
                    "tokenizer_config.json", NULL);
  put_config(dir, "[{\"name\": \"rag\", \"template\": \"x\"}]");
  expect_chat_error(dir, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}",
                    "field 'chat_template'", "\"default\"", NULL);
  put_config(dir, "7");
  expect_chat_error(dir, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}",
                    "field 'chat_template'", "expected a string or a list", NULL);
  /* a tool_use template file replaces the config's, and has no default beside it */
  put_config(dir, "\"{{ 'from the config' }}\"");
  mkdir(tpath("none/additional_chat_templates"), 0755);
  write_text(tpath("none/additional_chat_templates/tool_use.jinja"), "{{ tools }}");
  expect_chat_error(dir, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}",
                    "tool_use.jinja without", "chat_template.jinja", "no default", NULL);
}

static void test_bad_records(void **state) {
  (void)state;
  const char *dir = model_dir("bad", "tokenizer/smollm2");
  put_template(dir, "jinja/templates/gemma3.jinja");
  const char *ok = "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n";
  char two[512];
  snprintf(two, sizeof two, "%s{\"messages\": []}\n", ok);
  expect_chat_error(dir, two, "bad.jsonl:2: field 'messages'", "at least one message", NULL);
  expect_chat_error(dir, "{\"messages\": {\"role\": \"user\"}}", "bad.jsonl:1: field 'messages'",
                    "expected a list", NULL);
  expect_chat_error(dir, "{\"messages\": [\"hi\"]}", "bad.jsonl:1: field 'messages'[0]",
                    "expected an object", NULL);
  expect_chat_error(dir, "{\"messages\": [{\"content\": \"hi\"}]}",
                    "bad.jsonl:1: field 'messages'[0].role", "expected a string",
                    "the field missing", NULL);
  expect_chat_error(dir, "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, "
                         "{\"role\": \"assistant\", \"content\": 3}]}",
                    "bad.jsonl:1: field 'messages'[1].content", "expected a string or a list",
                    "3", NULL);
  expect_chat_error(dir, "{\"messages\": [{\"role\": \"user\"}]}",
                    "field 'messages'[0].content", "the field missing", NULL);
  expect_chat_error(dir, "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": "
                         "\"image\", \"url\": \"x\"}]}]}",
                    "field 'messages'[0].content[0].type", "\"text\"", "\"image\"", NULL);
  expect_chat_error(dir, "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": "
                         "\"text\", \"text\": 5}]}]}",
                    "field 'messages'[0].content[0].text", "expected a string", NULL);
  expect_chat_error(dir, "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}], \"tools\": 1}",
                    "bad.jsonl:1: field 'tools'", "expected a list", NULL);
  /* the template's own raise_exception */
  expect_chat_error(dir, "{\"messages\": [{\"role\": \"assistant\", \"content\": \"a\"}]}",
                    "bad.jsonl:1: field 'messages'", "Conversation roles must alternate", NULL);
  /* a format of its own: a messages record after a text one */
  expect_chat_error(dir, "{\"text\": \"a\"}\n{\"messages\": []}", "bad.jsonl:2:",
                    "messages format", "line 1", NULL);
}

/* A template that rewrites earlier turns breaks the prefix rule: refused,
 * naming the assistant message. */
static void test_prefix_rule(void **state) {
  (void)state;
  const char *dir = model_dir("prefix", "tokenizer/smollm2");
  const char *conv = "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": "
                     "\"assistant\", \"content\": \"b\"}, {\"role\": \"user\", \"content\": "
                     "\"c\"}, {\"role\": \"assistant\", \"content\": \"d\"}]}";
  write_text(tpath("prefix/chat_template.jinja"),
             "{{ messages | length }}{% for m in messages %}<{{ m.role }}>{{ m.content }}"
             "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}");
  expect_chat_error(dir, conv, "bad.jsonl:1: field 'messages'[1]",
                    "does not start with its rendering of messages[0..1)", NULL);
  write_text(tpath("prefix/chat_template.jinja"),
             "{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' and not loop.last "
             "%}[earlier]{% else %}{{ m.content }}{% endif %}{% endfor %}"
             "{% if add_generation_prompt %}<assistant>{% endif %}");
  expect_chat_error(dir, conv, "bad.jsonl:1: field 'messages'[1]",
                    "the whole conversation", "rewrites earlier turns", NULL);
  /* real templates that break it: DeepSeek-R1-Distill's generation prompt opens a <think> its
   * assistant turns do not have; Command R7B's tool-use template opens a new chatbot turn after
   * every assistant message */
  put_template(dir, "jinja/templates/deepseek_r1_distill.jinja");
  expect_chat_error(dir, conv, "bad.jsonl:1: field 'messages'[1]",
                    "does not start with its rendering of messages[0..1)", NULL);
  put_template(dir, "jinja/templates/command_r7b_tool_use.jinja");
  expect_chat_error(dir, conv, "bad.jsonl:1: field 'messages'[1]", "the chat template", NULL);
}

static int setup(void **state) {
  json_error_t e;
  g_cases = json_load_file(FIX "/chat/cases.json", 0, &e);
  if (!g_cases) return -1;
  return tmpdir_setup(state);
}

static int teardown(void **state) {
  json_decref(g_cases);
  return tmpdir_teardown(state);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_transformers_cases), cmocka_unit_test(test_template_sources),
      cmocka_unit_test(test_missing_template),   cmocka_unit_test(test_bad_records),
      cmocka_unit_test(test_prefix_rule),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}

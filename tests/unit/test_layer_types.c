/* Which layers slide when config.json has no layer_types (the config
 * classes' __post_init__, transformers 5.23): Qwen2Config's layers from
 * max_window_layers on, Qwen2MoeConfig's even-indexed layers below
 * max_window_layers (bool((i + 1) % 2) and i < max_window_layers), both
 * only with use_sliding_window; and Qwen2-MoE's config keys (num_experts,
 * which its config class reads under that name only; its shared expert's
 * shared_expert_intermediate_size) written and read back. */
#define _XOPEN_SOURCE 700
#define TMPDIR_PREFIX "ml_test_layer_types"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include <cmocka.h>

#include "model/config.h"
#include "tmpdir.h"

/* A 5-layer config.json of `arch` in directory `name` with the MoE keys
 * Qwen2-MoE needs (other families ignore them) and `extra` keys, loaded. */
static void load(const char *name, const char *arch, const char *extra, ml_model_config *c) {
  const char *dir = tpath(name);
  mkdir(dir, 0777);
  char text[2048], path[600];
  snprintf(text, sizeof text,
           "{\"architectures\": [\"%s\"], \"hidden_size\": 32, \"intermediate_size\": 48, "
           "\"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"vocab_size\": 64, "
           "\"num_hidden_layers\": 5, \"rms_norm_eps\": 1e-6, \"num_experts\": 4, "
           "\"num_experts_per_tok\": 2, \"moe_intermediate_size\": 8, "
           "\"shared_expert_intermediate_size\": 12%s}",
           arch, extra);
  snprintf(path, sizeof path, "%s/config.json", dir);
  FILE *fp = fopen(path, "w");
  assert_non_null(fp);
  assert_true(fputs(text, fp) >= 0);
  assert_int_equal(fclose(fp), 0);
  assert_int_equal(ml_model_config_load(dir, c), 0);
}

/* c's sliding layers as a string of 0/1 per layer. */
static const char *pattern(const ml_model_config *c) {
  static char s[16];
  for (int64_t l = 0; l < c->n_layers; l++) s[l] = c->sliding[l] ? '1' : '0';
  s[c->n_layers] = '\0';
  return s;
}

static void test_sliding_rules(void **state) {
  (void)state;
  const char *on = ", \"use_sliding_window\": true, \"sliding_window\": 8, \"max_window_layers\": 3";
  ml_model_config c;
  load("qwen2", "Qwen2ForCausalLM", on, &c);
  assert_string_equal(pattern(&c), "00011"); /* i >= 3 */
  assert_int_equal(c.sliding_window, 8);
  load("qwen2_moe", "Qwen2MoeForCausalLM", on, &c);
  assert_string_equal(pattern(&c), "10100"); /* (i + 1) % 2 and i < 3 */
  assert_int_equal(c.sliding_window, 8);
  load("qwen2_moe_off", "Qwen2MoeForCausalLM", ", \"sliding_window\": 8", &c);
  assert_string_equal(pattern(&c), "00000"); /* use_sliding_window defaults to false */
  assert_int_equal(c.sliding_window, 0);
}

/* ml_model_config_write writes Qwen2-MoE's keys as Qwen2MoeConfig names them;
 * the written config loads back with the same MoE settings and layer types. */
static void test_qwen2_moe_keys(void **state) {
  (void)state;
  ml_model_config c, back;
  load("keys", "Qwen2MoeForCausalLM",
       ", \"use_sliding_window\": true, \"sliding_window\": 8, \"max_window_layers\": 4, "
       "\"mlp_only_layers\": [1]",
       &c);
  assert_int_equal(c.n_experts, 4);
  assert_int_equal(c.shared_inter, 12);
  assert_false(c.norm_topk); /* norm_topk_prob defaults to false */
  assert_true(c.qkv_bias);  /* qkv_bias defaults to true */
  assert_false(c.o_bias);
  const char *dir = tpath("written");
  mkdir(dir, 0777);
  assert_int_equal(ml_model_config_write(dir, &c), 0);
  assert_int_equal(ml_model_config_load(dir, &back), 0);
  assert_int_equal(back.n_experts, 4);
  assert_int_equal(back.shared_inter, 12);
  assert_int_equal(back.moe_inter, 8);
  assert_string_equal(pattern(&back), pattern(&c));
  assert_string_equal(pattern(&c), "10100");
  for (int64_t l = 0; l < c.n_layers; l++) assert_int_equal(back.moe[l], l != 1);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_sliding_rules),
      cmocka_unit_test(test_qwen2_moe_keys),
  };
  return cmocka_run_group_tests(tests, tmpdir_setup, tmpdir_teardown);
}

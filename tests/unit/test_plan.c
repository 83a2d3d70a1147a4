/* Plans: HF strings and aliases, placement parsing, custom plan files,
 * plan selection, and TP validation/propagation on a virtual tp group
 * (an ml_comm with no ops: ml_tp_apply never communicates). */
#define _XOPEN_SOURCE 700
#define TMPDIR_PREFIX "ml_test_plan"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/status.h"
#include "model/config.h"
#include "model/model.h"
#include "parallel/fsdp.h"
#include "parallel/plan.h"
#include "parallel/tp.h"
#include "tmpdir.h"

static void write_text(const char *path, const char *text) {
  FILE *fp = fopen(path, "w");
  assert_non_null(fp);
  fputs(text, fp);
  assert_int_equal(fclose(fp), 0);
}

static void expect_error(int rc, const char *needle) {
  assert_int_equal(rc, -1);
  if (!strstr(ml_error_msg(), needle))
    fail_msg("message '%s' lacks '%s'", ml_error_msg(), needle);
  ml_error_clear();
}

static void load_model(const char *fixture, ml_model *m) {
  char dir[512];
  snprintf(dir, sizeof dir, "%s/tests/fixtures/%s", ML_SOURCE_DIR, fixture);
  ml_model_config cfg;
  if (ml_model_config_load(dir, &cfg) || ml_model_create(&cfg, m)) fail_msg("%s", ml_error_msg());
}

static void test_hf_strings(void **state) {
  (void)state;
  ml_style s;
  assert_int_equal(ml_style_from_hf("colwise", "t", &s), 0);
  assert_int_equal(s.kind, ML_STYLE_COLWISE);
  assert_true(ml_placement_eq(s.input_layout, ml_replicate()));
  assert_true(ml_placement_eq(s.output_layout, ml_shard(-1)));
  assert_true(s.use_local_output);
  const char *rep[] = {"colwise_rep", "colwise_gather_output"};
  for (int i = 0; i < 2; i++) {
    assert_int_equal(ml_style_from_hf(rep[i], "t", &s), 0);
    assert_int_equal(s.kind, ML_STYLE_COLWISE);
    assert_true(ml_placement_eq(s.output_layout, ml_replicate()));
  }
  const char *split[] = {"rowwise_rep", "rowwise_split_input", "embedding_rowwise"};
  for (int i = 0; i < 3; i++) {
    assert_int_equal(ml_style_from_hf(split[i], "t", &s), 0);
    assert_int_equal(s.kind, ML_STYLE_ROWWISE);
    assert_true(ml_placement_eq(s.input_layout, ml_replicate()));
    assert_true(ml_placement_eq(s.output_layout, ml_replicate()));
  }
  assert_int_equal(ml_style_from_hf("rowwise", "t", &s), 0);
  assert_true(ml_placement_eq(s.input_layout, ml_shard(-1)));
  assert_int_equal(ml_style_from_hf("sequence_parallel", "t", &s), 0);
  assert_int_equal(s.kind, ML_STYLE_SEQUENCE_PARALLEL);
  assert_int_equal(ml_style_from_hf("local_rowwise", "t", &s), 0);
  assert_true(s.local);
  assert_int_equal(ml_style_from_hf("gather", "t", &s), 0);
  assert_int_equal(s.kind, ML_STYLE_GATHER);
  assert_int_equal(ml_style_from_hf("replicated_with_grad_allreduce", "t", &s), 0);
  assert_int_equal(s.kind, ML_STYLE_REPLICATE);
  assert_int_equal(ml_style_from_hf("replicate_computation", "plan.json: 'x'", &s), -1);
  assert_non_null(strstr(ml_error_msg(), "plan.json: 'x': unknown parallel style "
                                         "'replicate_computation'; expected one of: colwise, "));
  assert_non_null(strstr(ml_error_msg(), "colwise_rep"));
  ml_error_clear();
}

static void test_placements(void **state) {
  (void)state;
  ml_placement p;
  assert_int_equal(ml_placement_parse("Shard(1)", "t", &p), 0);
  assert_true(ml_placement_eq(p, ml_shard(1)));
  assert_int_equal(ml_placement_parse("Shard(-1)", "t", &p), 0);
  assert_true(ml_placement_eq(p, ml_shard(2)));
  assert_int_equal(ml_placement_parse("Replicate", "t", &p), 0);
  assert_int_equal(p.kind, ML_REPLICATE);
  assert_int_equal(ml_placement_parse("Partial()", "t", &p), 0);
  assert_int_equal(p.kind, ML_PARTIAL);
  expect_error(ml_placement_parse("Shard(7)", "t", &p), "unknown placement 'Shard(7)'");
  expect_error(ml_placement_parse("Shard(1", "t", &p), "unknown placement");
}

static void test_custom_file(void **state) {
  (void)state;
  write_text(tpath("p.json"),
             "{\"model.layers.*.self_attn.q_proj\": \"colwise\",\n"
             " \"model.layers.*.self_attn\": {\"style\": \"PrepareModuleInput\",\n"
             "    \"input_layouts\": [\"Shard(1)\", null], \"desired_input_layouts\": "
             "[\"Replicate()\", null], \"use_local_output\": true},\n"
             " \"lm_head\": {\"style\": \"ColwiseParallel\", \"input_layouts\": \"Shard(1)\",\n"
             "    \"output_layouts\": \"Shard(-1)\", \"use_local_output\": false},\n"
             " \"model.norm\": \"sequence_parallel\"}\n");
  ml_plan p;
  assert_int_equal(ml_plan_load(tpath("p.json"), &p), 0);
  assert_int_equal(p.n, 4);
  assert_string_equal(p.rules[0].pattern, "model.layers.*.self_attn.q_proj");
  assert_int_equal(p.rules[1].style.kind, ML_STYLE_PREPARE_INPUT);
  assert_true(ml_placement_eq(p.rules[1].style.input_layout, ml_shard(1)));
  assert_true(p.rules[1].style.use_local_output);
  assert_int_equal(p.rules[2].style.kind, ML_STYLE_COLWISE);
  assert_true(ml_placement_eq(p.rules[2].style.input_layout, ml_shard(1)));
  assert_false(p.rules[2].style.use_local_output);
  assert_true(p.sequence_parallel);
  assert_string_equal(p.name, "custom:p.json");
  ml_plan_free(&p);

  write_text(tpath("bad1.json"), "{\"lm_head\": \"colwize\"}");
  expect_error(ml_plan_load(tpath("bad1.json"), &p), "'lm_head': unknown parallel style 'colwize'");
  write_text(tpath("bad2.json"), "{\"lm_head\": {\"style\": \"ColwiseParallel\", \"oops\": 1}}");
  expect_error(ml_plan_load(tpath("bad2.json"), &p), "unknown key 'oops'");
  write_text(tpath("bad3.json"),
             "{\"lm_head\": {\"style\": \"colwise\", \"output_layouts\": \"S1\"}}");
  expect_error(ml_plan_load(tpath("bad3.json"), &p), "unknown placement 'S1'");
  write_text(tpath("bad4.json"), "{\"lm_head\": 3}");
  expect_error(ml_plan_load(tpath("bad4.json"), &p),
               "expected an HF plan string or a style object");
  write_text(tpath("bad5.json"), "{}");
  expect_error(ml_plan_load(tpath("bad5.json"), &p), "the plan is empty");
}

static void test_selection(void **state) {
  (void)state;
  ml_model m;
  load_model("llama_tied", &m);
  char dir[512];
  snprintf(dir, sizeof dir, "%s/tests/fixtures/llama_tied", ML_SOURCE_DIR);
  ml_plan p;
  assert_int_equal(ml_plan_select(&m, dir, NULL, false, &p), 0);
  assert_string_equal(p.name, "llama-optimized");
  assert_non_null(strstr(p.reason, "optimized plan of the llama family"));
  ml_plan_free(&p);
  assert_int_equal(ml_plan_select(&m, dir, "auto", true, &p), 0);
  assert_string_equal(p.name, "llama-optimized-sp");
  assert_true(p.sequence_parallel);
  ml_plan_free(&p);
  assert_int_equal(ml_plan_select(&m, dir, "default", false, &p), 0);
  assert_string_equal(p.name, "default-llama");
  ml_plan_free(&p);
  /* config.json carries none: LlamaConfig's class plan (transformers' default) */
  assert_int_equal(ml_plan_select(&m, dir, "hf", false, &p), 0);
  assert_string_equal(p.name, "hf-llama-base_model_tp_plan");
  assert_int_equal(p.n, 9); /* 7 + embed_tokens (rowwise_rep) + lm_head */
  assert_string_equal(p.rules[6].pattern, "model.layers.*.mlp.down_proj");
  assert_string_equal(p.rules[6].style.label, "rowwise");
  ml_plan_free(&p);
  /* a family without a class plan (a registered one) and none in config.json */
  ml_family bare = *m.cfg.family;
  bare.name = "bare_llama";
  bare.architecture = "BareLlamaForCausalLM";
  bare.hf_tp_plan = NULL;
  assert_int_equal(ml_family_register(&bare), 0);
  const ml_family *real = m.cfg.family;
  m.cfg.family = ml_family_by_name("bare_llama");
  expect_error(ml_plan_select(&m, dir, "hf", false, &p), "carries no base_model_tp_plan");
  m.cfg.family = real;

  /* a checkpoint whose config.json carries an HF plan */
  char cfg_in[600];
  snprintf(cfg_in, sizeof cfg_in, "%s/config.json", dir);
  FILE *f = fopen(cfg_in, "r");
  assert_non_null(f);
  char text[8192];
  size_t n = fread(text, 1, sizeof text - 1, f);
  fclose(f);
  text[n] = '\0';
  char *brace = strrchr(text, '}');
  assert_non_null(brace);
  *brace = '\0';
  char out[9000];
  snprintf(out, sizeof out,
           "%s, \"base_model_tp_plan\": {\"layers.*.self_attn.q_proj\": \"colwise\", "
           "\"layers.*.self_attn.k_proj\": \"colwise\", \"layers.*.self_attn.v_proj\": "
           "\"colwise\", \"layers.*.self_attn.o_proj\": \"rowwise\", \"layers.*.mlp.gate_proj\": "
           "\"colwise\", \"layers.*.mlp.up_proj\": \"colwise\", \"layers.*.mlp.down_proj\": "
           "\"rowwise\"}}\n",
           text);
  write_text(tpath("config.json"), out);
  assert_int_equal(ml_plan_select(&m, g_dir, "hf", false, &p), 0);
  assert_string_equal(p.name, "hf-base_model_tp_plan");
  assert_int_equal(p.n, 9); /* 7 + embed_tokens (rowwise_rep) + lm_head */
  assert_string_equal(p.rules[0].pattern, "model.layers.*.self_attn.q_proj");
  assert_string_equal(p.rules[7].pattern, "model.embed_tokens");
  assert_string_equal(p.rules[7].style.label, "rowwise_rep");
  assert_string_equal(p.rules[8].pattern, "lm_head");
  assert_false(p.rules[8].style.use_local_output);
  ml_plan_free(&p);
  expect_error(ml_plan_select(&m, g_dir, "hf", true, &p), "has no sequence-parallel variant");

  write_text(tpath("nosp.json"), "{\"model.layers.*.mlp.down_proj\": \"rowwise\"}");
  expect_error(ml_plan_select(&m, dir, tpath("nosp.json"), true, &p), "has no SequenceParallel");
  ml_model_destroy(&m);
}

/* A tp group that exists only on paper. */
static ml_comm virtual_group(int size, int rank) {
  ml_comm c = {0};
  c.size = size;
  c.rank = rank;
  snprintf(c.name, sizeof c.name, "tp");
  return c;
}

static int apply_named(const char *fixture, const char *choice, bool sp, int tp_size, ml_tp *tp,
                       ml_model *m) {
  memset(tp, 0, sizeof *tp);
  load_model(fixture, m);
  char dir[512];
  snprintf(dir, sizeof dir, "%s/tests/fixtures/%s", ML_SOURCE_DIR, fixture);
  ml_plan p;
  ml_comm g = virtual_group(tp_size, 1);
  int rc = ml_plan_select(m, dir, choice, sp, &p);
  if (rc == 0) rc = ml_tp_apply(tp, &p, m, &g);
  tp->comm = NULL;
  ml_plan_free(&p);
  return rc;
}

static void test_apply_sp(void **state) {
  (void)state;
  ml_model m;
  ml_tp tp;
  assert_int_equal(apply_named("llama_untied", NULL, true, 2, &tp, &m), 0);
  assert_true(ml_placement_eq(tp.residual, ml_shard(1)));
  assert_true(ml_placement_eq(tp.logits, ml_shard(-1)));
  /* 2 layer norms per layer + the final norm have Partial grads */
  assert_int_equal(tp.n_partial, 2 * 2 + 1);
  assert_true(ml_tp_grad_partial(&tp, ml_model_find_param(&m, "model.norm.weight")));
  assert_false(ml_tp_grad_partial(&tp, ml_model_find_param(&m, "lm_head.weight")));
  /* vocab 300 over 2: rank 1 holds rows 150..299 */
  ml_param *w = ml_model_find_param(&m, "lm_head.weight");
  assert_int_equal(ml_tp_param_dim(&tp, &m, w), 0);
  assert_int_equal(w->offset[0], 150);
  assert_int_equal(w->offset[1], 0);
  assert_int_equal(w->local[0], 150);
  /* the attention input edge: Shard(1) → Replicate, grad Partial */
  bool found = false;
  for (int i = 0; i < tp.n_edges; i++) {
    const ml_tp_edge *e = &tp.edges[i];
    if (strcmp(e->name, "model.layers.0.self_attn.q_proj input")) continue;
    found = true;
    assert_int_equal(e->n, 2);
    assert_true(ml_placement_eq(e->p[0], ml_shard(1)));
    assert_true(ml_placement_eq(e->p[1], ml_replicate()));
    assert_int_equal(e->grad_in.kind, ML_PARTIAL);
  }
  assert_true(found);
  ml_tp_destroy(&tp);
  ml_model_destroy(&m);
}

static void write_plan(const char *name, const char *text) { write_text(tpath(name), text); }

static void test_apply_errors(void **state) {
  (void)state;
  ml_model m;
  ml_tp tp;
  write_plan("norm.json", "{\"model.norm\": \"colwise\"}");
  expect_error(apply_named("llama_tied", tpath("norm.json"), false, 2, &tp, &m),
               "cannot apply to module 'model.norm'");
  ml_tp_destroy(&tp);
  ml_model_destroy(&m);

  write_plan("none.json", "{\"model.layers.*.attn.q_proj\": \"colwise\"}");
  expect_error(apply_named("llama_tied", tpath("none.json"), false, 2, &tp, &m),
               "pattern 'model.layers.*.attn.q_proj' matches no module");
  ml_tp_destroy(&tp);
  ml_model_destroy(&m);

  /* SequenceParallel norms while embed_tokens keeps the residual Replicate */
  write_plan("sp.json", "{\"model.embed_tokens\": \"embedding_rowwise\",\n"
                        " \"model.layers.*.input_layernorm\": \"sequence_parallel\"}");
  expect_error(apply_named("llama_tied", tpath("sp.json"), false, 2, &tp, &m),
               "is SequenceParallel (input Shard(1)) but receives a local Replicate()");
  ml_tp_destroy(&tp);
  ml_model_destroy(&m);

  /* a sequence-sharded residual reaching attention ungathered */
  write_plan("res.json",
             "{\"model.embed_tokens\": {\"style\": \"embedding_rowwise\", \"output_layouts\": "
             "\"Shard(1)\"}, \"model.layers.*.mlp.down_proj\": \"rowwise\"}");
  expect_error(apply_named("llama_tied", tpath("res.json"), false, 2, &tp, &m),
               "model.layers.0.self_attn needs whole sequences but receives Shard(1)");
  ml_tp_destroy(&tp);
  ml_model_destroy(&m);

  /* tied embeddings sharded on different dims */
  write_plan("tie.json", "{\"model.embed_tokens\": \"embedding_rowwise\", \"lm_head\": "
                         "\"rowwise_rep\"}");
  expect_error(apply_named("llama_tied", tpath("tie.json"), false, 2, &tp, &m),
               "tied embeddings must stay tied");
  ml_tp_destroy(&tp);
  ml_model_destroy(&m);

  /* a torch RowwiseParallel() on the embedding would all-gather token ids */
  write_plan("emb.json", "{\"model.embed_tokens\": {\"style\": \"RowwiseParallel\"}}");
  expect_error(apply_named("llama_tied", tpath("emb.json"), false, 2, &tp, &m),
               "an embedding reads token ids");
  ml_tp_destroy(&tp);
  ml_model_destroy(&m);

  /* more tp ranks (8) than attention heads (4) */
  expect_error(apply_named("llama_tied", NULL, false, 8, &tp, &m),
               "tp=8 exceeds num_attention_heads=4");
  ml_tp_destroy(&tp);
  ml_model_destroy(&m);

  /* kv heads (2) on tp 4: replicated, so no edge may gather the heads as torch.chunk pieces */
  write_plan("gather_q.json", "{\"model.layers.*.self_attn.q_proj\": \"colwise_rep\", "
                              "\"model.layers.*.self_attn.k_proj\": \"colwise_rep\", "
                              "\"model.layers.*.self_attn.v_proj\": \"colwise_rep\", "
                              "\"model.layers.*.self_attn.o_proj\": \"colwise\"}");
  expect_error(apply_named("llama_tied", tpath("gather_q.json"), false, 4, &tp, &m),
               "redistributes the attention heads");
  ml_tp_destroy(&tp);
  ml_model_destroy(&m);

  /* a module matched twice */
  write_plan("dup.json", "{\"model.layers.*.mlp.up_proj\": \"colwise\", "
                         "\"model.layers.0.mlp.up_proj\": \"colwise\"}");
  expect_error(apply_named("llama_tied", tpath("dup.json"), false, 2, &tp, &m),
               "is matched by 'model.layers.*.mlp.up_proj' and by 'model.layers.0.mlp.up_proj'");
  ml_tp_destroy(&tp);
  ml_model_destroy(&m);
}

/* The HF-style plan with an MLP-only custom plan: attention replicated,
 * gate/up colwise + down rowwise all-reduce. */
static void test_apply_partial_plan(void **state) {
  (void)state;
  ml_model m;
  ml_tp tp;
  write_plan("mlp.json", "{\"model.layers.*.mlp.gate_proj\": \"colwise\", "
                         "\"model.layers.*.mlp.up_proj\": \"colwise\", "
                         "\"model.layers.*.mlp.down_proj\": \"rowwise\"}");
  assert_int_equal(apply_named("qwen2", tpath("mlp.json"), false, 2, &tp, &m), 0);
  assert_true(ml_placement_eq(tp.residual, ml_replicate()));
  assert_true(ml_placement_eq(tp.logits, ml_replicate())); /* lm_head replicated: whole logits */
  assert_int_equal(tp.n_partial, 0);
  ml_param *q = ml_model_find_param(&m, "model.layers.0.self_attn.q_proj.weight");
  assert_int_equal(ml_tp_param_dim(&tp, &m, q), -1);
  ml_param *d = ml_model_find_param(&m, "model.layers.1.mlp.down_proj.weight");
  assert_int_equal(ml_tp_param_dim(&tp, &m, d), 1);
  /* intermediate 160 over 2: rank 1 holds columns 80..159 of every row */
  assert_int_equal(d->offset[0], 0);
  assert_int_equal(d->offset[1], 80);
  assert_int_equal(d->local[1], 80);
  assert_false(ml_tp_grad_partial(&tp, d));
  /* FSDP units: one per decoder layer, the root (embedding, norm, lm_head) last */
  assert_int_equal(d->layer, 1);
  assert_int_equal(ml_fsdp_unit_of(&m, d), 1);
  ml_param *head = ml_model_find_param(&m, "lm_head.weight");
  assert_int_equal(head->layer, -1);
  assert_int_equal(ml_fsdp_unit_of(&m, head), (int)m.cfg.n_layers);
  ml_param *unit1[64];
  int n1 = ml_fsdp_unit_params(&m, 1, unit1);
  assert_true(n1 > 0 && n1 < 64);
  for (int i = 0; i < n1; i++) assert_int_equal(unit1[i]->layer, 1);
  ml_tp_destroy(&tp);
  ml_model_destroy(&m);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_hf_strings),        cmocka_unit_test(test_placements),
      cmocka_unit_test(test_custom_file),       cmocka_unit_test(test_selection),
      cmocka_unit_test(test_apply_sp),          cmocka_unit_test(test_apply_errors),
      cmocka_unit_test(test_apply_partial_plan),
  };
  return cmocka_run_group_tests(tests, tmpdir_setup, tmpdir_teardown);
}

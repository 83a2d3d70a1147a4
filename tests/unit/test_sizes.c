/* Sizes bounded before arithmetic (issue 9, part 2): the checked and
 * saturating helpers, config.json's limits (one message naming the file and
 * the field, with what was found and what was expected), the largest
 * config the limits admit counted without overflow, activation sizes of a
 * batch beyond 2^63 bytes refused with a message, and run-checkpoint
 * metadata.json offsets/shapes checked without forming a sum that wraps;
 * and a decoder layer's cast flags that do not combine (model.h
 * ml_layer_cast) refused by name before anything is read or written. */
#define _XOPEN_SOURCE 700
#define TMPDIR_PREFIX "ml_test_sizes"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cmocka.h>

#include "common/checked.h"
#include "common/status.h"
#include "model/config.h"
#include "model/model.h"
#include "ckpt/runckpt_format.h"
#include "tmpdir.h"

static void write_text(const char *path, const char *text) {
  FILE *fp = fopen(path, "w");
  assert_non_null(fp);
  assert_true(fputs(text, fp) >= 0);
  assert_int_equal(fclose(fp), 0);
}

/* The message recorded since the last ml_error_clear holds every word. */
static void expect_msg(const char *const *words, int n) {
  const char *msg = ml_error_msg();
  for (int i = 0; i < n; i++)
    if (!strstr(msg, words[i])) fail_msg("message \"%s\" lacks \"%s\"", msg, words[i]);
}
#define EXPECT_MSG(...)                                                                    \
  do {                                                                                     \
    const char *w_[] = {__VA_ARGS__};                                                      \
    expect_msg(w_, (int)(sizeof w_ / sizeof w_[0]));                                       \
  } while (0)

/* ---- checked.h ---------------------------------------------------------- */

static void test_checked_arithmetic(void **state) {
  (void)state;
  int64_t r;
  assert_int_equal(ml_mul_i64(1 << 20, 1 << 24, &r), 0);
  assert_true(r == (int64_t)1 << 44);
  assert_int_not_equal(ml_mul_i64(INT64_MAX, 2, &r), 0);
  assert_int_not_equal(ml_mul_i64((int64_t)1 << 32, (int64_t)1 << 31, &r), 0);
  assert_int_equal(ml_add_i64(INT64_MAX - 1, 1, &r), 0);
  assert_true(r == INT64_MAX);
  assert_int_not_equal(ml_add_i64(INT64_MAX, 1, &r), 0);
  /* saturation is sticky through sums and products */
  assert_true(ml_mul_sat((int64_t)1 << 40, (int64_t)1 << 40) == ML_SAT);
  assert_true(ml_add_sat(ML_SAT, 5) == ML_SAT);
  assert_true(ml_mul_sat(ML_SAT, 3) == ML_SAT);
  assert_true(ml_mul_sat(ML_SAT, 0) == 0);
  assert_true(ml_mul_sat(3, 7) == 21 && ml_add_sat(3, 7) == 10);
}

static void test_alloc_array(void **state) {
  (void)state;
  ml_error_clear();
  assert_null(ml_malloc_array(ML_SAT, sizeof(float), "the %s of layer %d", "activations", 3));
  EXPECT_MSG("out of memory", "the activations of layer 3", "more than 2^63 bytes");
  ml_error_clear(); /* the count fits int64, its bytes do not */
  assert_null(ml_calloc_array(INT64_MAX / 2, sizeof(float), "a buffer"));
  EXPECT_MSG("a buffer", "more than 2^63 bytes");
  ml_error_clear();
  assert_null(ml_malloc_array(-1, 1, "a negative count"));
  EXPECT_MSG("a negative count", "more than 2^63 bytes");
  float *p = ml_calloc_array(4, sizeof(float), "four floats");
  assert_non_null(p);
  assert_true(p[3] == 0.0f);
  free(p);
  free(ml_malloc_array(0, sizeof(float), "nothing")); /* a valid block */
}

/* ---- config.json limits ------------------------------------------------- */

/* A Llama config.json with the given sizes (head_dim / positions NULL: the
 * key absent) in directory `name` under the test's tmpdir. */
static const char *write_config(const char *name, const char *hidden, const char *inter,
                                const char *heads, const char *kv, const char *head_dim,
                                const char *vocab, const char *layers, const char *positions) {
  const char *dir = tpath(name);
  mkdir(dir, 0777);
  char text[2048], path[600], extra[256] = "";
  if (head_dim) snprintf(extra, sizeof extra, "\"head_dim\": %s, ", head_dim);
  if (positions)
    snprintf(extra + strlen(extra), sizeof extra - strlen(extra),
             "\"max_position_embeddings\": %s, ", positions);
  snprintf(text, sizeof text,
           "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": %s, "
           "\"intermediate_size\": %s, \"num_attention_heads\": %s, \"num_key_value_heads\": %s, "
           "%s\"vocab_size\": %s, \"num_hidden_layers\": %s, \"rms_norm_eps\": 1e-5}",
           hidden, inter, heads, kv, extra, vocab, layers);
  snprintf(path, sizeof path, "%s/config.json", dir);
  write_text(path, text);
  return dir;
}

/* Loading fails with one message naming config.json, the field, the value
 * found and the limit expected. */
static void expect_limit(const char *dir, const char *field, const char *found,
                         const char *limit) {
  ml_model_config c;
  ml_error_clear();
  assert_int_equal(ml_model_config_load(dir, &c), -1);
  char quoted[64];
  snprintf(quoted, sizeof quoted, "field '%s'", field);
  EXPECT_MSG("config.json", quoted, found, limit);
}

static void test_config_limits(void **state) {
  (void)state;
  /* the reports: hidden_size 1e12 printed "-6422937842468171776 parameters";
   * intermediate_size 444444444444024 overflowed in the plan's memory prediction */
  expect_limit(write_config("hidden", "1000000000000", "160", "4", "2", NULL, "256", "2", NULL),
               "hidden_size", "found 1000000000000", "1048576");
  expect_limit(write_config("inter", "64", "444444444444024", "4", "2", NULL, "256", "2", NULL),
               "intermediate_size", "found 444444444444024", "16777216");
  expect_limit(write_config("vocab", "64", "160", "4", "2", NULL, "16777217", "2", NULL),
               "vocab_size", "found 16777217", "16777216");
  expect_limit(write_config("layers", "64", "160", "4", "2", NULL, "256", "1025", NULL),
               "num_hidden_layers", "found 1025", "1024");
  expect_limit(write_config("heads", "64", "160", "8192", "8192", "16", "256", "2", NULL),
               "num_attention_heads", "found 8192", "4096");
  expect_limit(write_config("kv", "64", "160", "4", "9223372036854775807", NULL, "256", "2", NULL),
               "num_key_value_heads", "found 9223372036854775807", "4096");
  expect_limit(write_config("head_dim", "64", "160", "4", "2", "1099511627776", "256", "2", NULL),
               "head_dim", "found 1099511627776", "4096");
  expect_limit(write_config("positions", "64", "160", "4", "2", NULL, "256", "2", "4294967296"),
               "max_position_embeddings", "found 4294967296", "16777216");
  expect_limit(write_config("positions0", "64", "160", "4", "2", NULL, "256", "2", "0"),
               "max_position_embeddings", "found 0", "from 1");
  expect_limit(write_config("hidden0", "-5", "160", "4", "2", NULL, "256", "2", NULL),
               "hidden_size", "found -5", "from 1");
}

/* Parameters of an untied Llama config without biases, counted in 128 bits. */
static __int128 params_wide(const ml_model_config *c) {
  __int128 H = c->hidden, I = c->intermediate;
  __int128 q = (__int128)c->n_heads * c->head_dim, kv = (__int128)c->n_kv_heads * c->head_dim;
  __int128 layer = 2 * H * q + 2 * H * kv + 3 * H * I + 2 * H; /* + 2 norms */
  return c->n_layers * layer + 2 * (__int128)c->vocab * H + H;
}

/* The largest config the limits admit: counted exactly, and within the
 * bound config.h derives (< 2^58 elements, so 16 bytes each < 2^62). */
static void test_config_at_limits(void **state) {
  (void)state;
  const char *dir = write_config("max", "1048576", "16777216", "4096", "4096", "4096", "16777216",
                                 "1024", "16777216");
  ml_model_config c;
  ml_error_clear();
  if (ml_model_config_load(dir, &c) != 0) fail_msg("%s", ml_error_msg());
  assert_false(c.tie_embeddings || c.qkv_bias || c.mlp_bias);
  int64_t n = ml_model_config_num_params(&c);
  assert_true((__int128)n == params_wide(&c));
  assert_true(n > 0 && n < (int64_t)1 << 58);
}

static void test_seq_len_check(void **state) {
  (void)state;
  ml_model_config c = {.max_positions = 256};
  assert_int_equal(ml_model_config_check_seq_len(&c, "m", 256, "train: flag --seq-len"), 0);
  ml_error_clear();
  assert_int_equal(ml_model_config_check_seq_len(&c, "m", 100000000, "train: flag --seq-len"),
                   -1);
  EXPECT_MSG("train: flag --seq-len", "100000000 tokens", "max_position_embeddings 256",
             "m/config.json", "at most 256");
}

/* The llama `tiny` preset's config and model, unlaid out, on the CPU backend. */
static void tiny_cpu_model(ml_model_config *cfg, ml_model *m) {
  assert_int_equal(ml_model_config_preset("llama", "tiny", cfg), 0);
  assert_int_equal(ml_model_create(cfg, m), 0);
  assert_int_equal(ml_backend_get("cpu", 0, &m->be), 0);
}

/* A batch whose activations exceed 2^63 bytes: refused with a message
 * naming the buffer, the batch and the config sizes, not a wrapped count
 * (B·S·S·heads used to wrap around to some other allocation size). */
static void test_activations_saturate(void **state) {
  (void)state;
  ml_model_config cfg;
  ml_model m;
  tiny_cpu_model(&cfg, &m);
  ml_error_clear();
  /* B·S = 2^62 tokens: T·H wraps in int64 */
  int64_t B = (int64_t)1 << 38, S = (int64_t)1 << 24;
  assert_int_equal(ml_model_begin(&m, B, S), -1);
  EXPECT_MSG("out of memory", "activations of layer 0",
             "274877906944 sequences x 16777216 tokens", "hidden_size 64", "more than 2^63 bytes");
  int64_t per_layer, work;
  ml_model_act_bytes(&m, B, S, &per_layer, &work);
  assert_true(per_layer == ML_SAT);
  snprintf(m.batch_what, sizeof m.batch_what, "%s",
           "2 sequences per rank (--batch-size 4) x --seq-len 8");
  ml_error_clear();
  assert_int_equal(ml_model_begin(&m, (int64_t)1 << 40, (int64_t)1 << 30), -1);
  EXPECT_MSG("activations of layer 0", "--batch-size 4) x --seq-len 8");
  ml_model_destroy(&m);
}

/* Under bf16 weights (FSDP param_dtype) the inputs of q/k/v, gate/up and
 * down_proj (h1, h2 [T, H], a [T, I]) are kept as their bf16 copy only
 * (ml_model_bf16_inputs), and gate's and up's outputs g, u [T, I] as bf16
 * (ml_model_bf16_mlp): a layer's saved activations shrink by exactly half
 * of those five buffers, 2 B per element (T·H and T·I are multiples of 32
 * here, so the 64-byte alignment of each buffer adds nothing), plus the
 * halves of attention's output att and inputs q, k, v that
 * test_bf16_att_bytes and test_bf16_qkv_bytes check. An output
 * edge on gate_proj or up_proj keeps g, u fp32 (the first three stay
 * bf16); LoRA dropout on one of the linears, or a down_proj computed
 * whole, keeps the first three fp32 (g, u stay bf16). */
/* An output edge hook that is never run here (ml_model_bf16_mlp reads
 * whether it is set). */
static int edge_unused(void *ctx, ml_act *a) {
  (void)ctx, (void)a;
  return ml_err("test_sizes: the edge hook is not run here");
}

/* Marks a linear as computed whole (ml_linear.whole); ml_model_bf16_inputs
 * reads whether it is set and never calls it. */
static int whole_cols_unused(void *ctx, const ml_param *p, const void *src, int64_t rows,
                             ml_dtype dt, void *dst) {
  (void)ctx, (void)src, (void)rows, (void)dt, (void)dst;
  return ml_err("test_sizes: %s's whole hook is not called here", p->name);
}

static void test_bf16_inputs_bytes(void **state) {
  (void)state;
  ml_model_config cfg;
  ml_model m;
  tiny_cpu_model(&cfg, &m);
  int64_t B = 2, S = 16, T = B * S, fp32_layer, bf16_layer, layer, work;
  assert_false(ml_model_bf16_inputs(&m));
  ml_model_act_bytes(&m, B, S, &fp32_layer, &work);
  m.bf16_params = true;
  assert_true(ml_model_bf16_inputs(&m));
  assert_true(ml_model_bf16_mlp(&m));
  ml_model_act_bytes(&m, B, S, &bf16_layer, &work);
  int64_t att = 2 * T * cfg.n_heads * cfg.head_dim; /* ml_model_bf16_att's half of att */
  att += 2 * T * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim; /* and bf16_qkv's */
  assert_int_equal(fp32_layer - bf16_layer,
                   2 * T * (2 * cfg.hidden + 3 * cfg.intermediate) + att);
  ml_linear *up = &m.layers[cfg.n_layers - 1].up_proj, *gate = &m.layers[0].gate_proj;
  gate->out.fwd.fn = edge_unused;
  assert_true(ml_model_bf16_inputs(&m));
  assert_false(ml_model_bf16_mlp(&m));
  ml_model_act_bytes(&m, B, S, &layer, &work);
  assert_int_equal(fp32_layer - layer, 2 * T * (2 * cfg.hidden + cfg.intermediate) + att);
  gate->out.fwd.fn = NULL;
  up->out.bwd.fn = edge_unused;
  assert_false(ml_model_bf16_mlp(&m));
  up->out.bwd.fn = NULL;
  assert_true(ml_model_bf16_mlp(&m));
  m.lora_drop.p = 0.1;
  up->lora_drop = &m.lora_drop;
  assert_false(ml_model_bf16_inputs(&m));
  ml_model_act_bytes(&m, B, S, &layer, &work);
  assert_int_equal(fp32_layer - layer, 2 * T * 2 * cfg.intermediate + att);
  up->lora_drop = NULL;
  ml_linear *down = &m.layers[0].down_proj;
  down->whole.cols = whole_cols_unused; /* a stays fp32; g, u bf16 still */
  assert_false(ml_model_bf16_inputs(&m));
  assert_true(ml_model_bf16_mlp(&m));
  ml_model_act_bytes(&m, B, S, &layer, &work);
  assert_int_equal(fp32_layer - layer, 2 * T * 2 * cfg.intermediate + att);
  down->whole.cols = NULL;
  assert_true(ml_model_bf16_inputs(&m));
  m.layers[0].k_proj.weight->fp32 = true; /* kept in fp32 (engine/fp32_params.h) */
  assert_false(ml_model_bf16_inputs(&m));
  ml_model_destroy(&m);
}

/* Under bf16 weights the GLU backward writes dg, du [T, I] in bf16
 * (ml_model_bf16_glu_grads): the backward scratch takes exactly 4·T·I bytes
 * less than with fp32 ones (its MLP row, da and dg, du, is 3·I floats or
 * 2·I; tiny's attention row, datt, dq [T, 64] and dk, dv [T, 32], is 192 =
 * I floats, narrower either way; the bf16 dq, dk of ml_model_bf16_rope_grads
 * fit in datt's room, kv <= q). A bias on up_proj (its gradient sums the fp32
 * dy) keeps dg, du fp32 and bf16_mlp as it is; q_norm (its backward reads
 * the fp32 dq), a LoRA adapter on k_proj or an fp32-kept q_proj keep dq, dk
 * fp32. */
static void test_bf16_grads_scratch(void **state) {
  (void)state;
  ml_model_config cfg;
  ml_model m;
  tiny_cpu_model(&cfg, &m);
  int64_t B = 2, S = 16, T = B * S;
  assert_false(ml_model_bf16_glu_grads(&m));
  assert_false(ml_model_bf16_rope_grads(&m));
  m.bf16_params = true;
  assert_true(ml_model_bf16_glu_grads(&m));
  assert_true(ml_model_bf16_rope_grads(&m));
  assert_int_equal(ml_model_begin(&m, B, S), 0);
  size_t bf16 = ml_be_memory_stats(m.be).in_use;
  ml_layer *last = &m.layers[cfg.n_layers - 1];
  last->up_proj.bias = last->up_proj.weight; /* only its presence is read */
  assert_false(ml_model_bf16_glu_grads(&m));
  assert_true(ml_model_bf16_mlp(&m));
  assert_int_equal(ml_model_begin(&m, B, S), 0); /* laid out again: the rule's answer changed */
  assert_int_equal(ml_be_memory_stats(m.be).in_use - bf16, 4 * T * cfg.intermediate);
  last->up_proj.bias = NULL;
  assert_true(ml_model_bf16_glu_grads(&m));
  last->q_norm.weight = last->q_proj.weight;
  assert_false(ml_model_bf16_rope_grads(&m));
  last->q_norm.weight = NULL;
  m.layers[0].k_proj.lora_a = m.layers[0].k_proj.weight;
  assert_false(ml_model_bf16_rope_grads(&m));
  m.layers[0].k_proj.lora_a = NULL;
  m.layers[0].q_proj.weight->fp32 = true;
  assert_false(ml_model_bf16_rope_grads(&m));
  m.layers[0].q_proj.weight->fp32 = false;
  assert_true(ml_model_bf16_rope_grads(&m));
  ml_model_destroy(&m);
}

/* The cast flags of ml_layer_forward / ml_layer_backward that do not combine
 * (model.h ml_layer_cast) are refused with a message naming the layer and the
 * flags, before the layer reads or writes anything (x NULL): the input cast
 * twice, ML_CAST_FP32 with a rounding input cast or in a backward, the
 * backward's ML_CAST_OUT on layer 0. */
static void test_layer_cast_flags(void **state) {
  (void)state;
  ml_model_config cfg;
  ml_model m;
  tiny_cpu_model(&cfg, &m);
  ml_error_clear();
  assert_int_equal(ml_layer_forward(&m, 1, NULL, ML_CAST_IN | ML_CAST_IN_FUSED), -1);
  expect_msg((const char *const[]){"decoder layer 1", "ML_CAST_IN_FUSED", "at most one"}, 3);
  ml_error_clear();
  assert_int_equal(ml_layer_forward(&m, 0, NULL, ML_CAST_FP32 | ML_CAST_IN | ML_CAST_OUT), -1);
  expect_msg((const char *const[]){"decoder layer 0", "ML_CAST_FP32", "ML_CAST_IN",
                                   "expected it in a forward without ML_CAST_IN"},
             4);
  ml_error_clear();
  assert_int_equal(ml_layer_backward(&m, 1, NULL, ML_CAST_FP32), -1);
  expect_msg((const char *const[]){"decoder layer 1", "ML_CAST_FP32", "in the backward"}, 3);
  ml_error_clear();
  assert_int_equal(ml_layer_backward(&m, 0, NULL, ML_CAST_IN | ML_CAST_OUT), -1);
  expect_msg((const char *const[]){"decoder layer 0", "ML_CAST_OUT in the backward"}, 2);
  ml_model_destroy(&m);
}

/* A hook that is never run: marks an edge as active (ml_model_bf16_att reads
 * whether o_proj's input edge has a forward hook). */
static int hook_unused(void *ctx, ml_act *a) {
  (void)ctx, (void)a;
  return ml_err("test_sizes: the hook is not run here");
}

/* An attention core that is never called: marks one as set. */
static int core_unused(void *ctx, const ml_attn_call *c, float *out, float *saved) {
  (void)ctx, (void)c, (void)out, (void)saved;
  return ml_err("test_sizes: the attention core is not called here");
}

/* Under bf16 weights attention's output att [T, nh·hd] (o_proj's input) is
 * kept as bf16 only (ml_model_bf16_att): the layer's saved activations
 * shrink by exactly 2 B per element of att beyond what bf16_inputs saves
 * (T·nh·hd a multiple of 32). Off, att fp32 again (and q, k, v with it:
 * ml_model_bf16_qkv needs block attention's bf16 out), under an attention core
 * (context parallelism, packing, the KV cache), a forward hook on o_proj's
 * input edge (a tp redistribute), LoRA dropout on o_proj, an o_proj
 * computed whole, a q_proj kept in fp32 (attention's compute dtype). */
static void test_bf16_att_bytes(void **state) {
  (void)state;
  ml_model_config cfg;
  ml_model m;
  tiny_cpu_model(&cfg, &m);
  int64_t B = 2, S = 16, T = B * S, att = 2 * T * cfg.n_heads * cfg.head_dim, on, layer, work;
  att += 2 * T * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim; /* q, k, v: bf16_qkv's */
  assert_false(ml_model_bf16_att(&m));
  m.bf16_params = true;
  assert_true(ml_model_bf16_att(&m));
  ml_model_act_bytes(&m, B, S, &on, &work);
  ml_layer *L = &m.layers[cfg.n_layers - 1];
  for (int c = 0; c < 5; c++) {
    if (c == 0) m.attn_core.fwd = core_unused;
    if (c == 1) L->o_proj.in.fwd.fn = hook_unused;
    if (c == 2) m.lora_drop.p = 0.1, L->o_proj.lora_drop = &m.lora_drop;
    if (c == 3) L->o_proj.whole.cols = whole_cols_unused;
    if (c == 4) L->q_proj.weight->fp32 = true;
    assert_false(ml_model_bf16_att(&m));
    if (c < 2) assert_true(ml_model_bf16_inputs(&m)); /* the GEMM inputs' rule is another */
    ml_model_act_bytes(&m, B, S, &layer, &work);
    /* a q_proj in fp32 keeps h1, h2, a in fp32 too (ml_model_bf16_inputs) */
    assert_int_equal(layer - on, c == 4 ? att + 2 * T * (2 * cfg.hidden + cfg.intermediate) : att);
    m.attn_core.fwd = NULL;
    L->o_proj.in.fwd.fn = NULL;
    L->o_proj.lora_drop = NULL;
    L->o_proj.whole.cols = NULL;
    L->q_proj.weight->fp32 = false;
    assert_true(ml_model_bf16_att(&m));
  }
  ml_model_destroy(&m);
}

/* Under bf16 weights attention's inputs q [T, nh·hd], k, v [T, nkv·hd]
 * (after RoPE) are kept as bf16 only (ml_model_bf16_qkv): the layer's
 * saved activations shrink by exactly 2 B per element of the three (T·hd a
 * multiple of 32), q_raw and k_raw (q_norm/k_norm families) untouched. Off,
 * q, k, v fp32 again, under an output edge hook (forward or backward) on
 * q_proj, k_proj or v_proj (a tp or sp redistribute of the fp32 views), a
 * v_proj computed whole or a k_proj kept in fp32 (either turns the GEMM
 * inputs' rule off too: h1, h2, a fp32), and wherever ml_model_bf16_att is off (an
 * attention core). A core that declares both (ml_attn_core.bf16_out, .bf16_qkv:
 * packed documents' varlen core) keeps both on, the same bytes as no core; one that
 * declares only bf16_out keeps att bf16 and q, k, v fp32; one that declares only
 * bf16_qkv (context parallelism's ring) keeps q, k, v bf16 and att fp32. */
static void test_bf16_qkv_bytes(void **state) {
  (void)state;
  ml_model_config cfg;
  ml_model m;
  tiny_cpu_model(&cfg, &m);
  int64_t B = 2, S = 16, T = B * S, on, layer, work;
  int64_t qkv = 2 * T * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim;
  assert_false(ml_model_bf16_qkv(&m));
  m.bf16_params = true;
  assert_true(ml_model_bf16_qkv(&m));
  ml_model_act_bytes(&m, B, S, &on, &work);
  ml_layer *L = &m.layers[cfg.n_layers - 1];
  for (int c = 0; c < 6; c++) {
    if (c == 0) L->q_proj.out.fwd.fn = edge_unused;
    if (c == 1) L->k_proj.out.bwd.fn = edge_unused;
    if (c == 2) L->v_proj.out.fwd.fn = edge_unused;
    if (c == 3) L->v_proj.whole.cols = whole_cols_unused;
    if (c == 4) L->k_proj.weight->fp32 = true;
    if (c == 5) m.attn_core.fwd = core_unused;
    assert_false(ml_model_bf16_qkv(&m));
    assert_true(c == 5 ? !ml_model_bf16_att(&m) : ml_model_bf16_att(&m));
    ml_model_act_bytes(&m, B, S, &layer, &work);
    int64_t more = c == 3 || c == 4 ? 2 * T * (2 * cfg.hidden + cfg.intermediate) /* h1, h2, a */
                   : c == 5 ? 2 * T * cfg.n_heads * cfg.head_dim           /* att fp32 */
                            : 0;
    assert_int_equal(layer - on, qkv + more);
    L->q_proj.out.fwd.fn = L->k_proj.out.bwd.fn = L->v_proj.out.fwd.fn = NULL;
    L->v_proj.whole.cols = NULL;
    L->k_proj.weight->fp32 = false;
    m.attn_core.fwd = NULL;
    assert_true(ml_model_bf16_qkv(&m));
  }
  m.attn_core = (ml_attn_core){.fwd = core_unused, .bf16_out = true, .bf16_qkv = true};
  assert_true(ml_model_bf16_att(&m) && ml_model_bf16_qkv(&m));
  ml_model_act_bytes(&m, B, S, &layer, &work);
  assert_int_equal(layer, on);
  m.attn_core.bf16_qkv = false;
  assert_true(ml_model_bf16_att(&m) && !ml_model_bf16_qkv(&m));
  ml_model_act_bytes(&m, B, S, &layer, &work);
  assert_int_equal(layer - on, qkv);
  m.attn_core = (ml_attn_core){.fwd = core_unused, .bf16_qkv = true};
  assert_true(!ml_model_bf16_att(&m) && ml_model_bf16_qkv(&m));
  ml_model_act_bytes(&m, B, S, &layer, &work);
  assert_int_equal(layer - on, 2 * T * cfg.n_heads * cfg.head_dim); /* att fp32 */
  m.attn_core = (ml_attn_core){0};
  ml_model_destroy(&m);
}

/* An attention core set after the activations were laid out, which does not
 * take the layout's bf16 q, k, v or bf16 att (ml_attn_core.bf16_qkv,
 * .bf16_out), is refused before it runs (layer.c check_core: it would read or
 * write those buffers in the wrong dtype), with a message naming the layer's
 * o_proj, the layout's bf16 buffers and the remedy (ml_model_begin after
 * setting the core). Reached through selective activation checkpointing's
 * recompute, which reruns the core first in ml_layer_backward (no weight is
 * read before it). A core that declares both passes the check and is called
 * (its own error comes back). */
static void test_core_after_layout(void **state) {
  (void)state;
  ml_model_config cfg;
  ml_model m;
  tiny_cpu_model(&cfg, &m);
  m.bf16_params = true;
  m.ac = ML_AC_SELECTIVE;
  int64_t B = 2, S = 16;
  assert_int_equal(ml_model_begin(&m, B, S), 0); /* laid out with no core: bf16 q, k, v, att */
  assert_true(m.bf16_qkv && m.bf16_att);
  float *dx = ml_calloc_array(B * S * cfg.hidden, sizeof(float), "dx");
  assert_non_null(dx);
  int l = (int)cfg.n_layers - 1;
  const struct {
    ml_attn_core core;
    const char *what;
  } cases[] = {
      {{.fwd = core_unused, .bf16_out = true}, "laid out for bf16 q, k, v"},
      {{.fwd = core_unused, .bf16_qkv = true}, "laid out for a bf16 attention output"}, /* ring */
      {{.fwd = core_unused}, "laid out for a bf16 attention output"},
      {{.fwd = core_unused, .bf16_qkv = true, .bf16_out = true}, "the attention core is not "
                                                                 "called here"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    m.attn_core = cases[i].core;
    ml_error_clear();
    assert_int_equal(ml_layer_backward(&m, l, dx, 0), -1);
    const char *words[] = {cases[i].what, m.layers[l].o_proj.weight->name,
                           "expected ml_model_begin after setting ml_model.attn_core"};
    expect_msg(words, i + 1 < sizeof cases / sizeof cases[0] ? 3 : 1);
  }
  m.attn_core = (ml_attn_core){0};
  free(dx);
  ml_model_destroy(&m);
}

/* ---- run-checkpoint metadata.json -------------------------------------- */

/* A committed run checkpoint under directory `name` whose metadata.json
 * lists tensor "w" [4, 2] with one piece at `offset` of `shape`, and
 * run_state.consumed = `consumed`. Returns the directory. */
static const char *write_run_ckpt(const char *name, const char *offset, const char *shape,
                                  const char *consumed) {
  char dir[512], step[600], path[700], text[2048];
  snprintf(dir, sizeof dir, "%s", tpath(name));
  mkdir(dir, 0777);
  snprintf(step, sizeof step, "%s/step-00000001", dir);
  mkdir(step, 0777);
  snprintf(path, sizeof path, "%s/latest.json", dir);
  write_text(path, "{\"format\": \"meshlm-run-checkpoint\", \"version\": 1, "
                   "\"step_dir\": \"step-00000001\", \"step\": 1}");
  snprintf(text, sizeof text,
           "{\"format\": \"meshlm-run-checkpoint\", \"version\": 1, \"dtype\": \"F32\", "
           "\"optimizer_step\": 1, "
           "\"run_state\": {\"step\": 1, \"consumed\": %s, \"seed\": \"5\", \"nseq\": 3}, "
           "\"mesh\": {\"world_size\": 1, \"dp_replicate\": 1, \"dp_shard\": 1, \"cp\": 1, "
           "\"tp\": 1}, "
           "\"config\": \"config.json\", \"files\": {\"rank-00000.safetensors\": 0}, "
           "\"tensors\": {\"w\": {\"shape\": [4, 2], "
           "\"keys\": {\"param\": \"w\", \"exp_avg\": \"optim.state.w.exp_avg\", "
           "\"exp_avg_sq\": \"optim.state.w.exp_avg_sq\"}, "
           "\"pieces\": [{\"file\": \"rank-00000.safetensors\", \"offset\": %s, \"shape\": %s}]}}}",
           consumed, offset, shape);
  snprintf(path, sizeof path, "%s/metadata.json", step);
  write_text(path, text);
  return tpath(name);
}

/* The piece is refused by ml_rc_tensor_get, naming metadata.json, the
 * tensor, the field and what was found. */
static void expect_bad_piece(const char *name, const char *offset, const char *shape,
                             const char *field, const char *found) {
  ml_rc_ckpt c;
  ml_error_clear();
  if (ml_rc_open(write_run_ckpt(name, offset, shape, "2"), &c) != 0)
    fail_msg("%s", ml_error_msg());
  ml_rc_tensor t;
  int rc = ml_rc_tensor_get(&c, "w", &t);
  if (rc == 0) ml_rc_tensor_free(&t);
  assert_int_equal(rc, -1);
  EXPECT_MSG("metadata.json", "tensor 'w'", field, found, "[4, 2]");
  ml_rc_close(&c);
}

static void test_runckpt_piece_bounds(void **state) {
  (void)state;
  /* offset + shape used to wrap: INT64_MAX + 1 < 4 passed the bounds check */
  expect_bad_piece("off_max", "[9223372036854775807, 0]", "[1, 2]", "field 'offset'",
                   "[9223372036854775807, 0]");
  expect_bad_piece("shape_max", "[1, 0]", "[9223372036854775807, 2]", "field 'shape'",
                   "[9223372036854775807, 2]");
  expect_bad_piece("outside", "[3, 0]", "[2, 2]", "field 'shape'", "[3, 0]");
  /* a piece at the edge is fine */
  ml_rc_ckpt c;
  assert_int_equal(ml_rc_open(write_run_ckpt("edge", "[3, 0]", "[1, 2]", "2"), &c), 0);
  ml_rc_tensor t;
  assert_int_equal(ml_rc_tensor_get(&c, "w", &t), 0);
  assert_true(t.n == 1 && t.pieces[0].b.off[0] == 3);
  ml_rc_tensor_free(&t);
  ml_rc_close(&c);
}

static void test_runckpt_state_range(void **state) {
  (void)state;
  ml_rc_ckpt c;
  ml_error_clear();
  assert_int_equal(ml_rc_open(write_run_ckpt("consumed", "[0, 0]", "[4, 2]", "-1"), &c), -1);
  EXPECT_MSG("metadata.json", "field 'run_state.consumed'", "found -1");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_checked_arithmetic),   cmocka_unit_test(test_alloc_array),
      cmocka_unit_test(test_config_limits),        cmocka_unit_test(test_config_at_limits),
      cmocka_unit_test(test_seq_len_check),        cmocka_unit_test(test_activations_saturate),
      cmocka_unit_test(test_bf16_inputs_bytes), cmocka_unit_test(test_bf16_att_bytes),
      cmocka_unit_test(test_bf16_qkv_bytes),       cmocka_unit_test(test_core_after_layout),
      cmocka_unit_test(test_bf16_grads_scratch),   cmocka_unit_test(test_layer_cast_flags),
      cmocka_unit_test(test_runckpt_piece_bounds), cmocka_unit_test(test_runckpt_state_range),
  };
  return cmocka_run_group_tests(tests, tmpdir_setup, tmpdir_teardown);
}

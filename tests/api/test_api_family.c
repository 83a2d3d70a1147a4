/* test_api_family: meshlm_register_family — families registered from
 * outside the tree (the Llama and the Qwen2 block, q/k/v biases included,
 * stored with Phi-3-style fused self_attn.qkv_proj and mlp.gate_up_proj
 * tensors, with their own tp plan naming the fused modules) score bitwise
 * as their built-in base on the same weights and mesh and export their
 * fused tensors back byte for byte; every registration error is refused
 * with its reason.
 * The suite, its meshes and its helpers: api_util.h. */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api_util.h"

/* The plan names the fused modules (HF's Phi-3 names): each rule applies to
 * the parts (q/k/v, gate/up), so it is the Llama-optimized plan. */
static const char plan_json[] =
    "{\"embed_tokens\": {\"style\": \"RowwiseParallel\", \"input_layouts\": \"Replicate()\"},"
    " \"layers.*.self_attn.qkv_proj\": \"colwise\", \"layers.*.self_attn.o_proj\": \"rowwise\","
    " \"layers.*.mlp.gate_up_proj\": \"colwise\", \"layers.*.mlp.down_proj\": \"rowwise\","
    " \"lm_head\": {\"style\": \"ColwiseParallel\", \"output_layouts\": \"Shard(-1)\","
    " \"use_local_output\": false}}";

/* A built-in family's block under another name, its q/k/v and gate/up
 * stored fused; the fixture it is checked on. Qwen2's q/k/v have biases,
 * which the checkpoint fuses as the weights. */
typedef struct case_ {
  const char *fixture, *base, *arch, *model_type;
} case_;
static const case_ cases[] = {
    {"llama_untied", "llama", "FusedLlamaForCausalLM", "fused_llama"},
    {"qwen2", "qwen2", "FusedQwen2ForCausalLM", "fused_qwen2"},
};

static meshlm_family fused_family(const case_ *c) {
  meshlm_family f = {.struct_size = sizeof f, .architecture = c->arch,
                     .model_type = c->model_type, .name = c->model_type, .base = c->base,
                     .tp_plan_json = plan_json};
  f.fused[0] = (meshlm_fused){"self_attn.qkv_proj",
                              {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", NULL}};
  f.fused[1] = (meshlm_fused){"mlp.gate_up_proj", {"mlp.gate_proj", "mlp.up_proj", NULL}};
  return f;
}

/* Registers the families once per process. */
static void register_once(void) {
  static int done;
  if (done) return;
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    meshlm_family f = fused_family(&cases[i]);
    char err[512];
    if (meshlm_register_family(&f, err, sizeof err) != 0) fail_msg("register: %s", err);
  }
  done = 1;
}

/* A tensor of the fused checkpoint: the bytes of its parts one after
 * another (rows stacked on dim 0). */
typedef struct out_tensor {
  char name[200];
  int ndim;
  int64_t shape[2];
  const void *part[3];
  size_t bytes[3];
  int n;
} out_tensor;

/* The fused tensors: their parts in stacking order. */
static const char *const groups[2][4] = {
    {"self_attn.qkv_proj", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"},
    {"mlp.gate_up_proj", "mlp.gate_proj", "mlp.up_proj", NULL},
};

/* Which group part j of `key` (…layers.N.<part>.<weight|bias>) is, with the
 * key's prefix (…layers.N.) and suffix (weight|bias); −1 for other keys. */
static int part_of(const char *key, int *j, char *prefix, const char **suffix) {
  for (int g = 0; g < 2; g++)
    for (*j = 1; *j < 4 && groups[g][*j]; (*j)++) {
      const char *at = strstr(key, groups[g][*j]);
      size_t n = strlen(groups[g][*j]);
      if (!at || at[n] != '.') continue;
      snprintf(prefix, 96, "%.*s", (int)(at - key), key);
      *suffix = at + n + 1;
      return g;
    }
  return -1;
}

/* fixture's weights as the fused family stores them (every other tensor as
 * it is), and its config.json as `arch`, into dir. */
static void write_fused(const case_ *c, const char *dir) {
  char src[4200], path[4300];
  snprintf(src, sizeof src, "%s/tests/fixtures/%s", ML_SOURCE_DIR, c->fixture);
  snprintf(path, sizeof path, "%s/model.safetensors", src);
  st_file in;
  st_open(path, &in);
  out_tensor *t = xcalloc(json_object_size(in.hdr) + 1, sizeof *t);
  int n = 0;
  const char *key;
  json_t *v;
  json_object_foreach(in.hdr, key, v) {
    if (!strcmp(key, "__metadata__")) continue;
    const char *dtype, *suffix = NULL;
    char prefix[96];
    int ndim, j = 0, g = part_of(key, &j, prefix, &suffix);
    if (g >= 0 && j > 1) continue; /* joined to its first part below */
    out_tensor *o = &t[n++];
    o->part[0] = st_tensor(&in, key, &dtype, &ndim, o->shape, &o->bytes[0]);
    o->ndim = ndim;
    o->n = 1;
    snprintf(o->name, sizeof o->name, "%s", key);
    if (g < 0) continue;
    snprintf(o->name, sizeof o->name, "%s%s.%s", prefix, groups[g][0], suffix);
    for (j = 2; j < 4 && groups[g][j]; j++) {
      char nm[200];
      int64_t sh[2];
      snprintf(nm, sizeof nm, "%s%s.%s", prefix, groups[g][j], suffix);
      o->part[o->n] = st_tensor(&in, nm, &dtype, &ndim, sh, &o->bytes[o->n]);
      assert_non_null(o->part[o->n]);
      o->shape[0] += sh[0];
      o->n++;
    }
  }
  json_t *hdr = json_object();
  size_t off = 0;
  for (int i = 0; i < n; i++) {
    size_t nb = 0;
    for (int j = 0; j < t[i].n; j++) nb += t[i].bytes[j];
    json_t *shape = json_array();
    for (int d = 0; d < t[i].ndim; d++) json_array_append_new(shape, json_integer(t[i].shape[d]));
    json_object_set_new(hdr, t[i].name, json_pack("{s:s, s:o, s:[I, I]}", "dtype", "F32", "shape",
                                                  shape, "data_offsets", (json_int_t)off,
                                                  (json_int_t)(off + nb)));
    off += nb;
  }
  char *text = json_dumps(hdr, JSON_COMPACT);
  size_t len = strlen(text), padded = (len + 7) / 8 * 8;
  snprintf(path, sizeof path, "%s/model.safetensors", dir);
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  uint64_t hlen = padded;
  fwrite(&hlen, 8, 1, f);
  fwrite(text, 1, len, f);
  for (size_t i = len; i < padded; i++) fputc(' ', f);
  for (int i = 0; i < n; i++)
    for (int j = 0; j < t[i].n; j++) fwrite(t[i].part[j], 1, t[i].bytes[j], f);
  assert_int_equal(fclose(f), 0);
  free(text);
  json_decref(hdr);
  free(t);
  st_close(&in);

  snprintf(path, sizeof path, "%s/config.json", src);
  json_t *cfg = json_load_file(path, 0, NULL);
  assert_non_null(cfg);
  json_object_set_new(cfg, "architectures", json_pack("[s]", c->arch));
  json_object_set_new(cfg, "model_type", json_string(c->model_type));
  snprintf(path, sizeof path, "%s/config.json", dir);
  assert_int_equal(json_dump_file(cfg, path, JSON_INDENT(2)), 0);
  json_decref(cfg);
}

/* Each registered family on the world mesh (tp 2 × dp_shard 2 on four
 * ranks) scores bitwise as its base on the same weights: the fused tensors
 * split into the same parameters, the plan on the fused names is the
 * Llama-optimized plan, so every kernel and collective runs on the same
 * numbers (TOL_EXACT). Its export writes the fused tensors (weights and
 * Qwen2's biases) back byte for byte (no step taken: the weights are the
 * loaded fp32). */
static void test_registered_family(void **state) {
  (void)state;
  register_once();
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    const case_ *k = &cases[c];
    char dir[4200], exp[4200], base[4200];
    tmp_path(dir, sizeof dir, k->model_type);
    snprintf(exp, sizeof exp, "%.4000s_export", dir);
    snprintf(base, sizeof base, "%s/tests/fixtures/%s", ML_SOURCE_DIR, k->fixture);
    if (g_rank == 0) {
      char cmd[4300];
      snprintf(cmd, sizeof cmd, "mkdir -p '%s'", dir);
      assert_int_equal(system(cmd), 0);
      write_fused(k, dir);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    meshlm_options o = mesh_opts();
    meshlm_session *ref = open_ok(base, &o, MPI_COMM_WORLD);
    meshlm_session *fused = open_ok(dir, &o, MPI_COMM_WORLD);
    gbatch g = gbatch_make(7);
    int64_t n = g.all.npred;
    float *a = xcalloc((size_t)n, 4), *b = xcalloc((size_t)n, 4);
    global_lp(ref, &g, NULL, a);
    global_lp(fused, &g, NULL, b);
    assert_memory_equal(a, b, sizeof(float) * (size_t)n);

    OK(fused, meshlm_export(fused, exp, MESHLM_DTYPE_SOURCE));
    if (g_rank == 0) {
      char p1[4300], p2[4300];
      snprintf(p1, sizeof p1, "%s/model.safetensors", dir);
      snprintf(p2, sizeof p2, "%s/model.safetensors", exp);
      st_file x, y;
      st_open(p1, &x);
      st_open(p2, &y);
      size_t tensors = 0;
      const char *key;
      json_t *v;
      json_object_foreach(x.hdr, key, v) { /* every tensor, fused ones included */
        if (!strcmp(key, "__metadata__")) continue;
        const char *dt;
        int nd;
        int64_t s1[2], s2[2];
        size_t nb1, nb2;
        const void *d1 = st_tensor(&x, key, &dt, &nd, s1, &nb1);
        const void *d2 = st_tensor(&y, key, &dt, &nd, s2, &nb2);
        if (!d2) fail_msg("%s: the export lacks %s", k->arch, key);
        assert_int_equal(nb1, nb2);
        assert_memory_equal(d1, d2, nb1);
        tensors++;
      }
      assert_int_equal(tensors, json_object_size(y.hdr) - (json_object_get(y.hdr,
                                                              "__metadata__") != NULL));
      st_close(&x);
      st_close(&y);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    free(a);
    free(b);
    batch_free(&g.all);
    meshlm_close(ref);
    meshlm_close(fused);
  }
}

/* expect: the registration of f fails and the message names `needle`. */
static void refused(meshlm_family f, const char *needle) {
  char err[512] = "";
  assert_int_equal(meshlm_register_family(&f, err, sizeof err), -1);
  if (!strstr(err, needle)) fail_msg("expected '%s' in: %s", needle, err);
}

static void test_register_errors(void **state) {
  (void)state;
  register_once();
  meshlm_family f = fused_family(&cases[0]);
  f.struct_size = 8;
  refused(f, "struct_size 8");
  f = fused_family(&cases[0]);
  f.architecture = "OtherForCausalLM";
  f.name = "other";
  f.base = NULL;
  refused(f, "field 'base' is missing");
  f.base = "gpt2";
  refused(f, "base 'gpt2' is not a built-in text family");
  f.base = "llama";
  f.fused[0].parts[1] = "self_attn.v_proj";
  f.fused[0].parts[2] = NULL;
  refused(f, "part 'self_attn.v_proj' is not the linear after 'self_attn.q_proj'");
  f = fused_family(&cases[0]);
  f.architecture = "OtherForCausalLM";
  f.name = "other";
  f.tp_plan_json = "{\"layers.*.mlp.down_proj\": \"sideways\"}";
  refused(f, "'layers.*.mlp.down_proj'");
  f.tp_plan_json = "[1]";
  refused(f, "expected a JSON object");
  f = fused_family(&cases[0]);
  refused(f, "already registered");
  f.architecture = "LlamaForCausalLM";
  f.name = "llama2";
  refused(f, "already registered");
  assert_int_equal(meshlm_register_family(NULL, NULL, 0), -1);
}

int main(int argc, char **argv) {
  api_init(&argc, &argv);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_registered_family),
      cmocka_unit_test(test_register_errors),
  };
  return api_finish(cmocka_run_group_tests(tests, NULL, NULL));
}

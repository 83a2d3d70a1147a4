/* test_api_family: meshlm_register_family — a family registered from
 * outside the tree (a Llama block stored with Phi-3-style fused
 * self_attn.qkv_proj and mlp.gate_up_proj tensors, with its own tp plan
 * naming the fused modules) scores bitwise as the built-in Llama on the
 * same weights and mesh, exports its fused tensors back byte for byte; and
 * every registration error is refused with its reason.
 * The suite, its meshes and its helpers: api_util.h. */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api_util.h"

#define ARCH "FusedLlamaForCausalLM"

/* The plan names the fused modules (HF's Phi-3 names): each rule applies to
 * the parts (q/k/v, gate/up), so it is the Llama-optimized plan. */
static const char plan_json[] =
    "{\"embed_tokens\": {\"style\": \"RowwiseParallel\", \"input_layouts\": \"Replicate()\"},"
    " \"layers.*.self_attn.qkv_proj\": \"colwise\", \"layers.*.self_attn.o_proj\": \"rowwise\","
    " \"layers.*.mlp.gate_up_proj\": \"colwise\", \"layers.*.mlp.down_proj\": \"rowwise\","
    " \"lm_head\": {\"style\": \"ColwiseParallel\", \"output_layouts\": \"Shard(-1)\","
    " \"use_local_output\": false}}";

static meshlm_family fused_family(void) {
  meshlm_family f = {.struct_size = sizeof f, .architecture = ARCH, .model_type = "fused_llama",
                     .name = "fused_llama", .base = "llama", .tp_plan_json = plan_json};
  f.fused[0] = (meshlm_fused){"self_attn.qkv_proj",
                              {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", NULL}};
  f.fused[1] = (meshlm_fused){"mlp.gate_up_proj", {"mlp.gate_proj", "mlp.up_proj", NULL}};
  return f;
}

/* Registers the family once per process. */
static void register_once(void) {
  static int done;
  if (done) return;
  meshlm_family f = fused_family();
  char err[512];
  if (meshlm_register_family(&f, err, sizeof err) != 0) fail_msg("register: %s", err);
  done = 1;
}

/* The fixture's weights as the fused family stores them: per layer
 * [q; k; v] in qkv_proj, [gate; up] in gate_up_proj (rows stacked, the
 * bytes of the parts one after another); every other tensor as it is. */
typedef struct out_tensor {
  char name[160];
  int ndim;
  int64_t shape[2];
  const void *part[3];
  size_t bytes[3];
  int n;
} out_tensor;

static void write_fused(const char *dir) {
  char path[4300];
  snprintf(path, sizeof path, "%s/model.safetensors", g_fixture);
  st_file in;
  st_open(path, &in);
  out_tensor *t = xcalloc(json_object_size(in.hdr) + 1, sizeof *t);
  int n = 0;
  const char *key;
  json_t *v;
  json_object_foreach(in.hdr, key, v) {
    if (!strcmp(key, "__metadata__")) continue;
    const char *dtype;
    int ndim;
    int64_t shape[2];
    size_t nb;
    const void *data = st_tensor(&in, key, &dtype, &ndim, shape, &nb);
    const char *leaf = strstr(key, "self_attn.") ? strstr(key, "self_attn.") : strstr(key, "mlp.");
    int first = leaf && (!strncmp(leaf, "self_attn.q_proj", 16) || !strncmp(leaf, "mlp.gate", 8));
    int later = leaf && (!strncmp(leaf, "self_attn.k_proj", 16) ||
                         !strncmp(leaf, "self_attn.v_proj", 16) || !strncmp(leaf, "mlp.up_", 7));
    if (later) continue; /* joined to its first part below */
    out_tensor *o = &t[n++];
    snprintf(o->name, sizeof o->name, "%s", key);
    o->ndim = ndim;
    memcpy(o->shape, shape, sizeof shape);
    o->part[0] = data;
    o->bytes[0] = nb;
    o->n = 1;
    if (!first) continue;
    int attn = !strncmp(leaf, "self_attn.", 10);
    const char *rest[2] = {attn ? "k_proj" : "up_proj", attn ? "v_proj" : NULL};
    char prefix[96];
    snprintf(prefix, sizeof prefix, "%.*s", (int)(leaf - key), key);
    for (int j = 0; j < 2 && rest[j]; j++) {
      char nm[200];
      snprintf(nm, sizeof nm, "%s%s.%s.weight", prefix, attn ? "self_attn" : "mlp", rest[j]);
      int64_t sh[2];
      o->part[o->n] = st_tensor(&in, nm, &dtype, &ndim, sh, &o->bytes[o->n]);
      assert_non_null(o->part[o->n]);
      o->shape[0] += sh[0];
      o->n++;
    }
    snprintf(o->name, sizeof o->name, "%s%s.weight", prefix,
             attn ? "self_attn.qkv_proj" : "mlp.gate_up_proj");
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

  /* config.json: the fixture's, as the registered architecture */
  snprintf(path, sizeof path, "%s/config.json", g_fixture);
  json_t *cfg = json_load_file(path, 0, NULL);
  assert_non_null(cfg);
  json_object_set_new(cfg, "architectures", json_pack("[s]", ARCH));
  json_object_set_new(cfg, "model_type", json_string("fused_llama"));
  snprintf(path, sizeof path, "%s/config.json", dir);
  assert_int_equal(json_dump_file(cfg, path, JSON_INDENT(2)), 0);
  json_decref(cfg);
}

/* The registered family on the world mesh (tp 2 × dp_shard 2 on four
 * ranks) scores bitwise as the built-in Llama on the same weights: the
 * fused tensors split into the same parameters, the plan on the fused
 * names is the Llama-optimized plan, so every kernel and collective runs
 * on the same numbers (TOL_EXACT). Its export writes the fused tensors
 * back byte for byte (no step taken: the weights are the loaded fp32). */
static void test_registered_family(void **state) {
  (void)state;
  register_once();
  char dir[4200], exp[4200];
  tmp_path(dir, sizeof dir, "fused");
  tmp_path(exp, sizeof exp, "fused_export");
  if (g_rank == 0) {
    char cmd[4300];
    snprintf(cmd, sizeof cmd, "mkdir -p '%s'", dir);
    assert_int_equal(system(cmd), 0);
    write_fused(dir);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  meshlm_options o = mesh_opts();
  meshlm_session *llama = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  meshlm_session *fused = open_ok(dir, &o, MPI_COMM_WORLD);
  gbatch g = gbatch_make(7);
  int64_t n = g.all.npred;
  float *a = xcalloc((size_t)n, 4), *b = xcalloc((size_t)n, 4);
  global_lp(llama, &g, NULL, a);
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
    const char *names[] = {"model.layers.1.self_attn.qkv_proj.weight",
                           "model.layers.0.mlp.gate_up_proj.weight"};
    for (int i = 0; i < 2; i++) {
      const char *dt;
      int nd1, nd2;
      int64_t s1[2], s2[2];
      size_t nb1, nb2;
      const void *d1 = st_tensor(&x, names[i], &dt, &nd1, s1, &nb1);
      const void *d2 = st_tensor(&y, names[i], &dt, &nd2, s2, &nb2);
      assert_non_null(d1);
      assert_non_null(d2);
      assert_int_equal(nb1, nb2);
      assert_memory_equal(d1, d2, nb1);
    }
    assert_null(st_tensor(&y, "model.layers.0.self_attn.q_proj.weight", NULL, NULL, NULL, NULL));
    st_close(&x);
    st_close(&y);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  free(a);
  free(b);
  batch_free(&g.all);
  meshlm_close(llama);
  meshlm_close(fused);
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
  meshlm_family f = fused_family();
  f.struct_size = 8;
  refused(f, "struct_size 8");
  f = fused_family();
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
  f = fused_family();
  f.architecture = "OtherForCausalLM";
  f.name = "other";
  f.tp_plan_json = "{\"layers.*.mlp.down_proj\": \"sideways\"}";
  refused(f, "'layers.*.mlp.down_proj'");
  f.tp_plan_json = "[1]";
  refused(f, "expected a JSON object");
  f = fused_family();
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

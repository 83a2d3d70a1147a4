/* Module tree construction, lookup and activation buffers. */
#include "model/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"

static ml_param *add_param(ml_model *m, int unit, int64_t d0, int64_t d1, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

static ml_param *add_param(ml_model *m, int unit, int64_t d0, int64_t d1, const char *fmt, ...) {
  ml_param *p = &m->params[m->n_params++];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(p->name, sizeof p->name, fmt, ap);
  va_end(ap);
  p->ndim = d1 ? 2 : 1;
  p->shape[0] = p->local[0] = d0;
  p->shape[1] = p->local[1] = d1 ? d1 : 1;
  p->tp_dim = -1;
  p->unit = unit;
  return p;
}

static void add_module(ml_model *m, ml_module_kind kind, void *ptr, const char *name) {
  ml_module *mod = &m->modules[m->n_modules++];
  snprintf(mod->name, sizeof mod->name, "%s", name);
  mod->kind = kind;
  mod->ptr = ptr;
}

/* A Linear `name` [out, in] with an optional bias. */
static void make_linear(ml_model *m, ml_linear *lin, int unit, const char *name, int64_t in,
                        int64_t out, bool bias) {
  lin->weight = add_param(m, unit, out, in, "%s.weight", name);
  lin->bias = bias ? add_param(m, unit, out, 0, "%s.bias", name) : NULL;
  lin->bias_in_forward = true;
  add_module(m, ML_MOD_LINEAR, lin, name);
}

static void make_norm(ml_model *m, ml_rmsnorm *n, int unit, const char *name) {
  n->weight = add_param(m, unit, m->cfg.hidden, 0, "%s.weight", name);
  n->eps = (float)m->cfg.rms_eps;
  n->offset = m->cfg.family->norm_offset;
  add_module(m, ML_MOD_RMSNORM, n, name);
}

static void make_layer(ml_model *m, int l) {
  const ml_model_config *c = &m->cfg;
  ml_layer *L = &m->layers[l];
  char base[64], name[128];
  snprintf(base, sizeof base, "%slayers.%d", c->family->prefix, l);
  int64_t q = c->n_heads * c->head_dim, kv = c->n_kv_heads * c->head_dim;
#define SUB(s) (snprintf(name, sizeof name, "%s.%s", base, s), name)
  make_norm(m, &L->input_layernorm, l, SUB("input_layernorm"));
  make_linear(m, &L->q_proj, l, SUB("self_attn.q_proj"), c->hidden, q, c->qkv_bias);
  make_linear(m, &L->k_proj, l, SUB("self_attn.k_proj"), c->hidden, kv, c->qkv_bias);
  make_linear(m, &L->v_proj, l, SUB("self_attn.v_proj"), c->hidden, kv, c->qkv_bias);
  make_linear(m, &L->o_proj, l, SUB("self_attn.o_proj"), q, c->hidden, false);
  make_norm(m, &L->post_attention_layernorm, l, SUB("post_attention_layernorm"));
  make_linear(m, &L->gate_proj, l, SUB("mlp.gate_proj"), c->hidden, c->intermediate, c->mlp_bias);
  make_linear(m, &L->up_proj, l, SUB("mlp.up_proj"), c->hidden, c->intermediate, c->mlp_bias);
  make_linear(m, &L->down_proj, l, SUB("mlp.down_proj"), c->intermediate, c->hidden, c->mlp_bias);
#undef SUB
}

int ml_model_create(const ml_model_config *cfg, ml_model *m) {
  memset(m, 0, sizeof *m);
  m->cfg = *cfg;
  int L = (int)cfg->n_layers, root = L;
  int max_params = 16 * L + 4, max_modules = 10 * L + 4;
  m->params = ml_calloc((size_t)max_params, sizeof *m->params, "parameters");
  m->modules = ml_calloc((size_t)max_modules, sizeof *m->modules, "modules");
  m->layers = ml_calloc((size_t)L, sizeof *m->layers, "layers");
  if (!m->params || !m->modules || !m->layers) {
    ml_model_destroy(m);
    return -1;
  }
  const char *pre = cfg->family->prefix;
  char name[128];
  snprintf(name, sizeof name, "%sembed_tokens", pre);
  m->embed_tokens.weight = add_param(m, root, cfg->vocab, cfg->hidden, "%s.weight", name);
  m->embed_tokens.scale = 1.0f;
  add_module(m, ML_MOD_EMBEDDING, &m->embed_tokens, name);
  for (int l = 0; l < L; l++) make_layer(m, l);
  snprintf(name, sizeof name, "%snorm", pre);
  make_norm(m, &m->norm, root, name);
  if (cfg->tie_embeddings) {
    m->lm_head.weight = m->embed_tokens.weight;
    m->lm_head.bias_in_forward = true;
    add_module(m, ML_MOD_LINEAR, &m->lm_head, "lm_head");
  } else {
    make_linear(m, &m->lm_head, root, "lm_head", cfg->hidden, cfg->vocab, false);
  }
  return 0;
}

static void free_acts(ml_model *m) {
  for (int l = 0; m->layers && l < m->cfg.n_layers; l++) {
    free(m->layers[l].acts.x_in); /* one block per layer, see ml_model_begin */
    memset(&m->layers[l].acts, 0, sizeof m->layers[l].acts);
  }
  free(m->x_final);
  free(m->scratch);
  free(m->inv_freq);
  m->x_final = m->scratch = m->inv_freq = NULL;
}

void ml_model_destroy(ml_model *m) {
  free_acts(m);
  free(m->params);
  free(m->modules);
  free(m->layers);
  memset(m, 0, sizeof *m);
}

ml_module *ml_model_find_module(ml_model *m, const char *name) {
  for (int i = 0; i < m->n_modules; i++)
    if (strcmp(m->modules[i].name, name) == 0) return &m->modules[i];
  return NULL;
}

ml_param *ml_model_find_param(ml_model *m, const char *name) {
  for (int i = 0; i < m->n_params; i++)
    if (strcmp(m->params[i].name, name) == 0) return &m->params[i];
  return NULL;
}

/* Carve consecutive named buffers out of one allocation. */
static float *carve(float **cursor, int64_t n) {
  float *p = *cursor;
  *cursor += n;
  return p;
}

static int alloc_layer_acts(ml_model *m, ml_layer *L) {
  int64_t T = m->B * m->S, H = m->cfg.hidden, hd = m->cfg.head_dim;
  int64_t q = L->q_proj.weight->local[0], kv = L->k_proj.weight->local[0];
  int64_t I = L->gate_proj.weight->local[0], nh = q / hd;
  int64_t total = T * (4 * H + 2 + 2 * q + 2 * kv + 3 * I) + m->B * nh * m->S * m->S;
  float *cur = ml_malloc(sizeof(float) * (size_t)total, "layer activations");
  if (!cur) return -1;
  ml_layer_acts *a = &L->acts;
  a->x_in = carve(&cur, T * H);
  a->h1 = carve(&cur, T * H);
  a->x_mid = carve(&cur, T * H);
  a->h2 = carve(&cur, T * H);
  a->rstd1 = carve(&cur, T);
  a->rstd2 = carve(&cur, T);
  a->q = carve(&cur, T * q);
  a->att = carve(&cur, T * q);
  a->k = carve(&cur, T * kv);
  a->v = carve(&cur, T * kv);
  a->g = carve(&cur, T * I);
  a->u = carve(&cur, T * I);
  a->a = carve(&cur, T * I);
  a->P = carve(&cur, m->B * nh * m->S * m->S);
  return 0;
}

static int alloc_rope(ml_model *m) {
  int64_t half = m->cfg.head_dim / 2;
  m->inv_freq = ml_malloc(sizeof(float) * (size_t)(half + 2 * m->S * half), "rope tables");
  if (!m->inv_freq) return -1;
  m->rope_cos = m->inv_freq + half;
  m->rope_sin = m->rope_cos + m->S * half;
  k_rope_inv_freq(m->cfg.rope_theta, m->cfg.head_dim, &m->cfg.rope, m->inv_freq);
  k_rope_tables(m->inv_freq, m->cfg.head_dim, m->S, m->rope_cos, m->rope_sin);
  return 0;
}

int ml_model_begin(ml_model *m, int64_t B, int64_t S) {
  if (m->B == B && m->S == S && m->x_final) return 0;
  free_acts(m);
  m->B = B;
  m->S = S;
  int64_t T = B * S, H = m->cfg.hidden, wide = H;
  for (int l = 0; l < m->cfg.n_layers; l++) {
    ML_TRY(alloc_layer_acts(m, &m->layers[l]));
    ml_layer *L = &m->layers[l];
    int64_t dims[] = {L->q_proj.weight->local[0], L->gate_proj.weight->local[0]};
    for (int i = 0; i < 2; i++) wide = dims[i] > wide ? dims[i] : wide;
  }
  m->x_final = ml_malloc(sizeof(float) * (size_t)(T * (3 * H + 1)), "final norm activations");
  /* backward temporaries: two [T, H] and four [T, wide] */
  m->scratch = ml_malloc(sizeof(float) * (size_t)(T * (2 * H + 4 * wide)), "backward scratch");
  if (!m->x_final || !m->scratch) return -1;
  m->xn_final = m->x_final + T * H;
  m->dxn_final = m->xn_final + T * H;
  m->rstd_final = m->dxn_final + T * H;
  return alloc_rope(m);
}

void ml_model_vocab_shard(const ml_model *m, int64_t *v0, int64_t *nv) {
  const ml_param *w = m->lm_head.weight;
  *v0 = w->tp_dim == 0 ? w->tp_start : 0;
  *nv = w->local[0];
}

/* Module tree construction, lookup and activation buffers. */
#include "model/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/checked.h"
#include "common/status.h"
#include "model/block.h"
#include "model/linear.h"
#include "model/moe.h"
#include "tensor/placement.h"

ml_param *ml_model_add_param(ml_model *m, int layer, int64_t d0, int64_t d1, const char *fmt, ...) {
  ml_param *p = &m->params[m->n_params++];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(p->name, sizeof p->name, fmt, ap);
  va_end(ap);
  p->ndim = d1 ? 2 : 1;
  p->shape[0] = p->local[0] = d0;
  p->shape[1] = p->local[1] = d1 ? d1 : 1;
  p->layer = layer;
  snprintf(p->key, sizeof p->key, "%s", p->name); /* unfused: the adapter may change it */
  p->key_rows = d0;
  return p;
}

const char *ml_module_kind_name(ml_module_kind k) {
  static const char *const names[] = {"Linear", "Embedding", "RMSNorm", "Attention", "MLP"};
  return names[k];
}

static void add_module(ml_model *m, ml_module_kind kind, void *ptr, const char *name) {
  ml_module *mod = &m->modules[m->n_modules++];
  snprintf(mod->name, sizeof mod->name, "%.*s", (int)sizeof mod->name - 1, name);
  mod->kind = kind;
  mod->ptr = ptr;
}

/* A module's HF name (model.language_model.layers.0.self_attn.q_proj) and
 * the checkpoint key stem of its parameters (language_model.model.layers.0.
 * self_attn.q_proj); the two differ only for composite checkpoints. */
typedef struct mod_name {
  char mod[128], key[128];
} mod_name;

/* mod_base.leaf / key_base.leaf in n, or NULL when leaf is NULL (a module
 * the family lacks). */
static const mod_name *name_of(mod_name *n, const char *mod_base, const char *key_base,
                               const char *leaf) {
  if (!leaf) return NULL;
  snprintf(n->mod, sizeof n->mod, "%s%s", mod_base, leaf);
  snprintf(n->key, sizeof n->key, "%s%s", key_base, leaf);
  return n;
}

/* A Linear [out, in]; its bias [out] (when it has one) is added by
 * make_bias, at once or after the other parts of its fused tensor. */
static void make_linear(ml_model *m, ml_linear *lin, int layer, const mod_name *n, int64_t in,
                        int64_t out) {
  lin->weight = ml_model_add_param(m, layer, out, in, "%s.weight", n->key);
  lin->bias = NULL;
  lin->bias_in_forward = true;
  add_module(m, ML_MOD_LINEAR, lin, n->mod);
}

/* The bias of lin, whose weight is key_stem.weight. */
static void make_bias(ml_model *m, ml_linear *lin, const char *key_stem) {
  lin->bias =
      ml_model_add_param(m, lin->weight->layer, lin->weight->shape[0], 0, "%s.bias", key_stem);
}

/* Whether `leaf` is a part of one of f's fused tensors, and the last one. */
static bool fused_part(const ml_family *f, const char *leaf, bool *last) {
  for (int i = 0; i < ML_FAMILY_MAX_FUSED && f->fused[i].leaf; i++)
    for (int j = 0; f->fused[i].parts[j]; j++)
      if (strcmp(f->fused[i].parts[j], leaf) == 0) {
        *last = !f->fused[i].parts[j + 1];
        return true;
      }
  return false;
}

/* An RMSNorm over `dim` features, or none (weight NULL) when n is NULL. */
static void make_norm(ml_model *m, ml_rmsnorm *norm, int layer, const mod_name *n, int64_t dim) {
  norm->weight = NULL;
  norm->eps = (float)m->cfg.rms_eps;
  norm->offset = m->cfg.family->norm_offset;
  if (!n) return;
  norm->weight = ml_model_add_param(m, layer, dim, 0, "%s.weight", n->key);
  add_module(m, ML_MOD_RMSNORM, norm, n->mod);
}

/* The checkpoint-key adapter for one fused tensor of layer L: each part's
 * weight (and bias) becomes its rows of key_base.leaf.weight (.bias), the
 * parts stacked in order. */
static void fuse(ml_layer *L, const ml_fused *fz, const char *key_base) {
  for (int b = 0; b < 2; b++) { /* weight, bias */
    ml_param *ps[ML_FUSED_MAX_PARTS] = {0};
    int64_t rows = 0;
    int n = 0;
    for (; fz->parts[n]; n++) { /* parts are Linear rows (ml_family_register checks) */
      ml_linear *lin = ml_block_at(L, ml_block_linear(fz->parts[n]));
      ps[n] = b ? lin->bias : lin->weight;
    }
    for (int j = 0; j < n; j++) rows += ps[j] ? ps[j]->shape[0] : 0;
    for (int j = 0, row0 = 0; j < n; j++) {
      if (!ps[j]) continue;
      snprintf(ps[j]->key, sizeof ps[j]->key, "%s%s.%s", key_base, fz->leaf,
               b ? "bias" : "weight");
      ps[j]->key_row0 = row0;
      ps[j]->key_rows = rows;
      row0 += ps[j]->shape[0];
    }
  }
}

/* The fused module's HF name (mod_base.leaf) as the alias of its parts: the
 * modules from m->modules[first] on named mod_base.part. */
static void alias(ml_model *m, int first, const ml_fused *fz, const char *mod_base) {
  char name[128];
  for (int j = 0; fz->parts[j]; j++) {
    snprintf(name, sizeof name, "%s%s", mod_base, fz->parts[j]);
    for (int i = first; i < m->n_modules; i++)
      if (strcmp(m->modules[i].name, name) == 0)
        snprintf(m->modules[i].alias, sizeof m->modules[i].alias, "%s%s", mod_base, fz->leaf);
  }
}

/* Sparse layer l's block after its container `mod_base` + moe_block: the
 * router <moe_block>.gate [E, H], then expert e's gate, up [I_e, H] and
 * down [H, I_e] (<moe_block>.experts.<e>.<family expert_leaves>), then the
 * family's shared expert, gate, up [I_s, H] and down [H, I_s]
 * (<moe_block>.<shared_expert>.<expert_leaves>), and its gate [1, H]
 * (<moe_block>.<shared_gate>), as save_pretrained names them. */
static void make_moe(ml_model *m, int l, const char *mod_base, const char *key_base) {
  const ml_model_config *c = &m->cfg;
  const ml_family *f = c->family;
  ml_moe *moe = &m->layers[l].moe;
  int64_t E = c->n_experts, H = c->hidden, I = c->moe_inter;
  char leaf[64]; /* "block_sparse_moe.experts.4095.gate_proj" */
  mod_name n;
  snprintf(leaf, sizeof leaf, "%s.gate", f->moe_block);
  make_linear(m, &moe->gate, l, name_of(&n, mod_base, key_base, leaf), H, E);
  moe->experts = m->experts + (size_t)l * (size_t)(3 * E);
  for (int64_t e = 0; e < E; e++)
    for (int j = 0; j < 3; j++) {
      snprintf(leaf, sizeof leaf, "%s.experts.%lld.%s", f->moe_block, (long long)e,
               f->expert_leaves[j]);
      make_linear(m, &moe->experts[3 * e + j], l, name_of(&n, mod_base, key_base, leaf),
                  j == 2 ? I : H, j == 2 ? H : I);
    }
  if (!f->shared_expert) return;
  int64_t Is = c->shared_inter; /* then the shared expert's MLP and its gate */
  for (int j = 0; j < 3; j++) {
    snprintf(leaf, sizeof leaf, "%s.%s.%s", f->moe_block, f->shared_expert, f->expert_leaves[j]);
    make_linear(m, &moe->shared[j], l, name_of(&n, mod_base, key_base, leaf), j == 2 ? Is : H,
                j == 2 ? H : Is);
  }
  snprintf(leaf, sizeof leaf, "%s.%s", f->moe_block, f->shared_gate);
  make_linear(m, &moe->shared_gate, l, name_of(&n, mod_base, key_base, leaf), H, 1);
}

/* Layer l's modules: the present rows of the block table (model/block.h),
 * in its order, named as HF's decoder layer, a sparse layer's block after
 * its container; then the family's fused checkpoint tensors. */
static void make_layer(ml_model *m, int l) {
  const ml_model_config *c = &m->cfg;
  const ml_family *f = c->family;
  ml_layer *L = &m->layers[l];
  char mod[64], key[64];
  mod_name n;
  snprintf(mod, sizeof mod, "%slayers.%d.", f->prefix, l);
  snprintf(key, sizeof key, "%slayers.%d.", f->ckpt_prefix, l);
  int first = m->n_modules;
  /* the parts of a fused tensor with biases: their weights, then their biases, so
   * each fused tensor's parts are consecutive parameters (ml_model_ckpt_keys) */
  ml_linear *held[ML_FUSED_MAX_PARTS];
  char held_key[ML_FUSED_MAX_PARTS][128];
  int n_held = 0;
  for (int i = 0; i < ML_ROLE_COUNT; i++) {
    const ml_block_row *r = &ml_block_rows[i];
    const mod_name *nm = name_of(&n, mod, key, ml_block_leaf_at(c, r, l));
    void *at = (char *)L + r->field;
    int64_t out = ml_block_dim(c, r->out), in = ml_block_dim(c, r->in);
    if (!nm && r->kind == ML_MOD_LINEAR) continue; /* a sparse layer's dense MLP: weight NULL */
    if (r->kind == ML_MOD_LINEAR) {
      bool last = true, part = fused_part(f, r->leaf, &last);
      make_linear(m, at, l, nm, in, out);
      if (ml_block_has_bias(c, r)) {
        held[n_held] = at;
        snprintf(held_key[n_held++], sizeof held_key[0], "%s", nm->key);
      }
      for (int j = 0; last && j < n_held; j++) make_bias(m, held[j], held_key[j]);
      if (last || !part) n_held = 0;
    } else if (r->kind == ML_MOD_RMSNORM) {
      make_norm(m, at, l, nm, out);
    } else {
      add_module(m, r->kind, L, nm->mod);
      if (r->role == ML_ROLE_MLP && ml_config_moe_layer(c, l)) make_moe(m, l, mod, key);
    }
  }
  for (int i = 0; i < ML_FAMILY_MAX_FUSED && f->fused[i].leaf; i++) {
    fuse(L, &f->fused[i], key);
    alias(m, first, &f->fused[i], mod);
  }
  L->window = c->sliding[l] ? c->sliding_window : 0;
}

int ml_model_create(const ml_model_config *cfg, ml_model *m) {
  memset(m, 0, sizeof *m);
  m->cfg = *cfg;
  const ml_family *f = cfg->family;
  int L = (int)cfg->n_layers, root = -1; /* root modules: in no layer */
  /* the block's per layer (model/block.h); the root: embed_tokens, norm, lm_head */
  /* ... and two LoRA adapters (lora_A, lora_B) per weight of a layer (model/lora.h) */
  int max_params = 3 * ml_block_n_params(cfg) * L + 3;
  int max_modules = ml_block_n_modules(cfg) * L + 3;
  m->params = ml_calloc((size_t)max_params, sizeof *m->params, "parameters");
  m->modules = ml_calloc((size_t)max_modules, sizeof *m->modules, "modules");
  m->layers = ml_calloc((size_t)L, sizeof *m->layers, "layers");
  /* the experts of every layer (<= 2^10 · 3 · 2^12 linears: config.h) */
  if (cfg->n_experts > 0)
    m->experts = ml_calloc((size_t)(L * 3 * cfg->n_experts), sizeof *m->experts, "experts");
  if (!m->params || !m->modules || !m->layers || (cfg->n_experts > 0 && !m->experts)) {
    ml_model_destroy(m);
    return -1;
  }
  mod_name n;
  name_of(&n, f->prefix, f->ckpt_prefix, "embed_tokens");
  m->embed_tokens.weight =
      ml_model_add_param(m, root, cfg->vocab, cfg->hidden, "%s.weight", n.key);
  m->embed_tokens.scale = f->embed_scale_sqrt_hidden ? (float)sqrt((double)cfg->hidden) : 1.0f;
  add_module(m, ML_MOD_EMBEDDING, &m->embed_tokens, n.mod);
  for (int l = 0; l < L; l++) make_layer(m, l);
  make_norm(m, &m->norm, root, name_of(&n, f->prefix, f->ckpt_prefix, "norm"), cfg->hidden);
  name_of(&n, "", "", "lm_head"); /* top-level module in every family */
  snprintf(n.key, sizeof n.key, "%s", f->ckpt_lm_head);
  if (cfg->tie_embeddings) {
    m->lm_head.weight = m->embed_tokens.weight;
    m->lm_head.bias_in_forward = true;
    add_module(m, ML_MOD_LINEAR, &m->lm_head, n.mod);
  } else {
    make_linear(m, &m->lm_head, root, &n, cfg->hidden, cfg->vocab);
  }
  return 0;
}

int ml_model_ckpt_keys(const ml_model *m, ml_ckpt_key *out) {
  int n = 0;
  for (int i = 0; i < m->n_params; i++) {
    const ml_param *p = &m->params[i];
    if (p->adapter) continue; /* LoRA adapters are no tensors of the base checkpoint */
    if (n > 0 && p->key_row0 > 0 && strcmp(out[n - 1].key, p->key) == 0) {
      out[n - 1].n++; /* the next part of the fused tensor before */
      continue;
    }
    out[n++] = (ml_ckpt_key){p->key, i, 1, p->ndim, p->key_rows, p->shape[1]};
  }
  return n;
}

/* Every activation buffer back to the backend's pool (none without a backend). */
static void free_acts(ml_model *m) {
  if (!m->be) return;
  for (int l = 0; m->layers && l < m->cfg.n_layers; l++) {
    /* the layer's block (see carve_layer), unless x_in is in the shared one */
    if (!m->acts_shared) ml_be_free(m->be, m->layers[l].acts.x_in);
    memset(&m->layers[l].acts, 0, sizeof m->layers[l].acts);
    ml_moe_release(m, &m->layers[l]);
  }
  m->acts_shared = false;
  ml_be_free(m->be, m->ac_work);
  ml_be_free(m->be, m->x_final);
  ml_be_free(m->be, m->scratch);
  ml_be_free(m->be, m->rope_cos);
  m->ac_work = m->x_final = m->scratch = m->rope_cos = NULL;
  m->attn_work = NULL;
  m->rope_sin = m->rope_local_cos = m->rope_local_sin = NULL;
}

void ml_model_destroy(ml_model *m) {
  free_acts(m);
  free(m->params);
  free(m->modules);
  free(m->layers);
  free(m->experts);
  free(m->aux.sums);
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

/* The parts kept per layer under ac (model/block.h ml_block_part); the
 * input always. */
static int kept_parts(const ml_model *m) {
  if (m->forward_only) return 0; /* every layer's buffers in the one shared block */
  switch (m->ac) {
  case ML_AC_MLP: return ML_PART_INPUT | ML_PART_ATTN | ML_PART_CORE;
  case ML_AC_LAYER: return ML_PART_INPUT;
  case ML_AC_SELECTIVE: return ML_PART_ALL & ~ML_PART_CORE;
  default: return ML_PART_ALL;
  }
}

/* Extents the buffers are sized for: tokens T = B·S, and the widest local
 * views of q/att, k/v and gate/up/act on any layer, through their edges (a
 * gathering edge widens them). B and S come from the caller's flags or
 * data, so every count built from them saturates (common/checked.h): a
 * batch too large to address fails its allocation with a message, never
 * wraps. */
typedef struct act_dims {
  int64_t B, S, T, Tr, H, hd, q, kv, I; /* Tr: tokens of the residual stream's piece */
  int64_t attn_saved;                    /* floats attention's forward saves */
} act_dims;

static int64_t max3(int64_t a, int64_t b, int64_t c) {
  int64_t m = a > b ? a : b;
  return m > c ? m : c;
}

static act_dims act_dims_of(const ml_model *m, int64_t B, int64_t S) {
  int64_t s0, s = S;
  if (m->res_parts > 1) ml_chunk(S, m->res_parts, m->res_index, &s0, &s);
  act_dims d = {B, S, ml_mul_sat(B, S), ml_mul_sat(B, s), m->cfg.hidden, m->cfg.head_dim,
                0, 0, 0, 0};
  for (int l = 0; l < m->cfg.n_layers; l++) {
    const ml_layer *L = &m->layers[l];
    int64_t q = max3(L->q_proj.weight->local[0], L->q_proj.out.cap_c, L->o_proj.in.cap_c);
    int64_t kv = max3(L->k_proj.weight->local[0], L->k_proj.out.cap_c, L->v_proj.out.cap_c);
    /* a sparse layer's g, u, a: its T·k rows of moe_inter in [T, k·moe_inter]; none under
     * expert parallelism, whose rows live where they are computed (model/moe.h) */
    int64_t i = L->moe.gate.weight ? (m->moe_ep.ranks > 1 ? 0 : m->cfg.top_k * m->cfg.moe_inter)
                                   : max3(L->gate_proj.weight->local[0], L->gate_proj.out.cap_c,
                                          L->down_proj.in.cap_c);
    d.q = max3(d.q, q, 0);
    d.kv = max3(d.kv, kv, 0);
    d.I = max3(d.I, i, L->up_proj.out.cap_c);
  }
  d.attn_saved = m->attn_core.saved ? m->attn_core.saved(m->attn_core.ctx, B, S, d.q / d.hd)
                                    : ml_be_attention_saved(m->be, B, S, d.q / d.hd);
  return d;
}

/* Carves a layer's buffers out of two blocks: those of the kept parts out
 * of the layer's own, the others out of the workspace. A NULL block only
 * counts. */
typedef struct carver {
  int kept;
  bool bf16_inputs; /* ml_model_bf16_inputs: the shared GEMM inputs take bf16 */
  bool bf16_att;    /* ml_model_bf16_att: attention's output takes bf16 */
  bool bf16_mlp;    /* ml_model_bf16_mlp: gate/up's outputs take bf16 */
  bool bf16_qkv;    /* ml_model_bf16_qkv: attention's q, k, v take bf16 */
  float *block[2];  /* [0] the layer's, [1] the workspace */
  int64_t used[2];  /* floats taken from each */
} carver;

/* The next n floats for `part` from the block it goes to (NULL while
 * counting), or NULL (nothing taken) when the module they serve is absent. */
static float *take(carver *c, int part, bool present, int64_t n) {
  if (!present) return NULL;
  int w = !(c->kept & part);
  float *p = c->block[w] ? c->block[w] + c->used[w] : NULL;
  /* every buffer starts on a 64-byte boundary: device kernels load rows as
   * 16-byte vectors and cuBLASLt picks faster kernels for aligned operands */
  c->used[w] = ml_add_sat(c->used[w], n > ML_SAT - 15 ? ML_SAT : (n + 15) / 16 * 16);
  return p;
}

/* Layer L's buffers (ml_layer_acts) as the block table lists them
 * (model/block.h ml_block_acts), x_in first: it is always kept and frees the
 * layer's block. `out` is there when the MLP is recomputed. */
static void carve_layer(const act_dims *d, const ml_model *m, carver *c, ml_layer_acts *a) {
  int64_t nh = d->q / d->hd, nkv = d->kv / d->hd;
  const int64_t cols[] = {[ML_COLS_ONE] = 1, [ML_COLS_H] = d->H, [ML_COLS_Q] = d->q,
                          [ML_COLS_KV] = d->kv, [ML_COLS_I] = d->I, [ML_COLS_NH] = nh,
                          [ML_COLS_NKV] = nkv, [ML_COLS_E] = m->cfg.n_experts,
                          [ML_COLS_K] = m->cfg.top_k, [ML_COLS_KH] = m->cfg.top_k * d->H,
                          [ML_COLS_SI] = m->cfg.shared_inter};
  for (int i = 0; i < ml_block_n_acts; i++) {
    const ml_block_act *b = &ml_block_acts[i];
    bool present = b->needs == ML_NEEDS_SPARSE   ? m->cfg.n_experts > 0
                   : b->needs == ML_NEEDS_SHARED ? m->cfg.shared_inter > 0
                   : b->needs < 0 || ml_block_present(&m->cfg, ml_block_row_of(b->needs));
    /* out: for the recompute of a dropped MLP, never in a forward-only pass */
    if (b->part == ML_PART_OUT) present = !(c->kept & ML_PART_MLP) && !m->forward_only;
    int64_t n = b->cols == ML_COLS_CORE
                    ? d->attn_saved
                    : ml_mul_sat(b->rows == ML_ROWS_T ? d->T : d->Tr, cols[b->cols]);
    if ((b->bf16_input && c->bf16_inputs) || (b->bf16_att && c->bf16_att) ||
        (b->bf16_mlp && c->bf16_mlp) || (b->bf16_qkv && c->bf16_qkv))
      n = n / 2 + n % 2; /* n bf16 in floats */
    *(float **)((char *)a + b->field) = take(c, (int)b->part, present, n);
  }
}

/* Floats of the largest layer block and of the workspace under m->ac. */
static void act_floats(const ml_model *m, const act_dims *d, int64_t *block, int64_t *work) {
  *block = *work = 0;
  for (int l = 0; l < m->cfg.n_layers; l++) {
    carver c = {.kept = kept_parts(m), .bf16_inputs = ml_model_bf16_inputs(m),
                .bf16_att = ml_model_bf16_att(m), .bf16_mlp = ml_model_bf16_mlp(m),
                .bf16_qkv = ml_model_bf16_qkv(m)};
    ml_layer_acts a;
    carve_layer(d, m, &c, &a);
    *block = max3(*block, c.used[0], 0);
    *work = max3(*work, c.used[1], 0);
  }
}

void ml_model_act_bytes(const ml_model *m, int64_t B, int64_t S, int64_t *per_layer,
                        int64_t *workspace) {
  act_dims d = act_dims_of(m, B, S);
  act_floats(m, &d, per_layer, workspace);
  *per_layer = ml_mul_sat(*per_layer, (int64_t)sizeof(float));
  *workspace = ml_mul_sat(*workspace, (int64_t)sizeof(float));
}

/* Whether lin's GEMMs read its input only in bf16 (ml_model_bf16_inputs). */
static bool bf16_only(const ml_linear *lin) {
  return !lin->weight->fp32 && !(lin->lora_drop && lin->lora_drop->p > 0) && !lin->whole.cols;
}

/* ml_model_bf16_att's rule but for the attention core's part. */
static bool bf16_att_but_core(const ml_model *m) {
  if (!m->bf16_params || m->cfg.n_layers < 1 || !m->layers || !m->be ||
      !ml_be_supports(m->be, ML_OP_ATTENTION_BLOCK)) /* a bf16 out is a block call's */
    return false;
  for (int l = 0; l < m->cfg.n_layers; l++) {
    const ml_layer *L = &m->layers[l];
    /* q_proj's dtype is attention's compute (layer.c attn_compute) */
    if (!bf16_only(&L->q_proj) || !bf16_only(&L->o_proj) || L->o_proj.in.fwd.fn) return false;
  }
  return true;
}

bool ml_model_bf16_att(const ml_model *m) {
  return (!m->attn_core.fwd || m->attn_core.bf16_out) && bf16_att_but_core(m);
}

bool ml_model_bf16_inputs(const ml_model *m) {
  if (!m->bf16_params || m->cfg.n_experts > 0 || m->cfg.n_layers < 1 || !m->layers) return false;
  for (int l = 0; l < m->cfg.n_layers; l++) {
    const ml_layer *L = &m->layers[l];
    const ml_linear *lin[] = {&L->q_proj,    &L->k_proj,  &L->v_proj,
                              &L->gate_proj, &L->up_proj, &L->down_proj};
    for (size_t i = 0; i < sizeof lin / sizeof lin[0]; i++)
      if (!bf16_only(lin[i])) return false;
  }
  return true;
}

bool ml_model_bf16_mlp(const ml_model *m) {
  if (!m->bf16_params || m->cfg.n_experts > 0 || m->cfg.n_layers < 1 || !m->layers) return false;
  for (int l = 0; l < m->cfg.n_layers; l++) {
    const ml_linear *lin[] = {&m->layers[l].gate_proj, &m->layers[l].up_proj};
    for (int i = 0; i < 2; i++)
      if (lin[i]->weight->fp32 || lin[i]->whole.cols || lin[i]->out.fwd.fn || lin[i]->out.bwd.fn)
        return false;
  }
  return true;
}

bool ml_model_bf16_qkv(const ml_model *m) {
  /* block attention in bf16 compute, as ml_model_bf16_att has it, under no core or one taking
   * bf16 q, k, v (whether or not it takes a bf16 out: context parallelism's ring) */
  if (!bf16_att_but_core(m) || (m->attn_core.fwd && !m->attn_core.bf16_qkv)) return false;
  for (int l = 0; l < m->cfg.n_layers; l++) {
    const ml_layer *L = &m->layers[l];
    const ml_linear *lin[] = {&L->q_proj, &L->k_proj, &L->v_proj};
    for (int i = 0; i < 3; i++)
      if (lin[i]->weight->fp32 || lin[i]->whole.cols || lin[i]->out.fwd.fn || lin[i]->out.bwd.fn)
        return false;
  }
  return true;
}

bool ml_model_bf16_glu_grads(const ml_model *m) {
  if (!ml_model_bf16_mlp(m)) return false;
  for (int l = 0; l < m->cfg.n_layers; l++)
    if (!ml_linear_dy_bf16(&m->layers[l].gate_proj) || !ml_linear_dy_bf16(&m->layers[l].up_proj))
      return false;
  return true;
}

bool ml_model_bf16_rope_grads(const ml_model *m) {
  if (!m->bf16_params || m->cfg.n_layers < 1 || !m->layers) return false;
  for (int l = 0; l < m->cfg.n_layers; l++) {
    const ml_layer *L = &m->layers[l];
    if (L->q_norm.weight || !ml_linear_dy_bf16(&L->q_proj) || !ml_linear_dy_bf16(&L->k_proj))
      return false;
  }
  return true;
}

/* How allocation messages name the batch: the caller's words
 * (m->batch_what), else the plain geometry. */
static const char *batch_words(const ml_model *m, char *buf, size_t cap) {
  if (m->batch_what[0]) return m->batch_what;
  snprintf(buf, cap, "%lld sequence%s x %lld tokens per rank", (long long)m->B,
           m->B == 1 ? "" : "s", (long long)m->S);
  return buf;
}

/* Per layer its block of kept buffers; one workspace for the dropped ones,
 * the same pointers in every layer. */
static int alloc_layer_acts(ml_model *m, const act_dims *d) {
  const ml_model_config *c = &m->cfg;
  char buf[96], dims[160];
  const char *batch = batch_words(m, buf, sizeof buf);
  snprintf(dims, sizeof dims, "hidden_size %lld, intermediate_size %lld, num_attention_heads %lld",
           (long long)c->hidden, (long long)c->intermediate, (long long)c->n_heads);
  int64_t block, work;
  m->bf16_inputs = ml_model_bf16_inputs(m);
  m->bf16_att = ml_model_bf16_att(m);
  m->bf16_mlp = ml_model_bf16_mlp(m);
  m->bf16_qkv = ml_model_bf16_qkv(m);
  act_floats(m, d, &block, &work);
  if (work) {
    m->ac_work = ml_be_alloc(m->be, work, sizeof(float),
                             m->forward_only ? "the forward-only activations (%s; %s)"
                                             : "the activation recompute workspace (%s; %s)",
                             batch, dims);
    if (!m->ac_work) return -1;
  }
  m->acts_shared = m->forward_only;
  for (int l = 0; l < m->cfg.n_layers; l++) {
    ml_layer *L = &m->layers[l];
    carver count = {.kept = kept_parts(m), .bf16_inputs = m->bf16_inputs,
                    .bf16_att = m->bf16_att, .bf16_mlp = m->bf16_mlp,
                    .bf16_qkv = m->bf16_qkv};
    carve_layer(d, m, &count, &L->acts);
    float *block = NULL; /* forward-only: nothing of the layer's own */
    if (count.used[0]) {
      block = ml_be_alloc(m->be, count.used[0], sizeof(float),
                          "the activations of layer %d (%s; %s)", l, batch, dims);
      if (!block) return -1;
    }
    carver c = {.kept = count.kept, .bf16_inputs = count.bf16_inputs,
                .bf16_att = count.bf16_att, .bf16_mlp = count.bf16_mlp,
                .bf16_qkv = count.bf16_qkv, .block = {block, m->ac_work}};
    carve_layer(d, m, &c, &L->acts);
  }
  return 0;
}

/* Rows of the RoPE tables for m->position_ids: the tables of positions 0
 * .. max built in `tmp` [2, max+1, hd/2], then each run of consecutive
 * positions copied into cos_t, sin_t [S, hd/2] with one strided copy. */
static int rope_at_positions(ml_model *m, double theta, const ml_rope_scaling *sc, float *cos_t,
                             float *sin_t) {
  int64_t half = m->cfg.head_dim / 2, S = m->S, top = 0;
  for (int64_t i = 0; i < S; i++) top = m->position_ids[i] > top ? m->position_ids[i] : top;
  int64_t n = ml_mul_sat(top + 1, half);
  float *tmp = ml_be_alloc(m->be, ml_mul_sat(2, n), sizeof(float),
                           "the RoPE tables of positions 0 .. %lld", (long long)top);
  if (!tmp) return -1;
  int64_t len = m->rope_len ? m->rope_len : top + 1;
  int rc = ml_be_rope_tables(m->be, theta, m->cfg.head_dim, sc, len, top + 1, tmp, tmp + n);
  size_t row = sizeof(float) * (size_t)half;
  for (int64_t i = 0, run; rc == 0 && i < S; i += run) {
    int64_t p = m->position_ids[i];
    for (run = 1; i + run < S && m->position_ids[i + run] == p + run;) run++;
    for (int t = 0; rc == 0 && t < 2; t++)
      rc = ml_be_copy2d(m->be, (t ? sin_t : cos_t) + i * half, row, tmp + t * n + p * half, row,
                        row, (size_t)run);
  }
  ml_be_free(m->be, tmp);
  return rc;
}

/* The cos/sin tables [S, hd/2] of base theta for the local positions, the
 * length-dependent scalings computed for m->rope_len (HF: max(position_ids)
 * + 1). */
static int rope_tables(ml_model *m, double theta, const ml_rope_scaling *sc, float *cos_t,
                       float *sin_t) {
  if (m->position_ids) return rope_at_positions(m, theta, sc, cos_t, sin_t);
  int64_t len = m->rope_len ? m->rope_len : m->S;
  return ml_be_rope_tables(m->be, theta, m->cfg.head_dim, sc, len, m->S, cos_t, sin_t);
}

/* cos/sin tables of the global (full-attention) and local (sliding) RoPE;
 * each layer points at the tables of its type. */
static int alloc_rope(ml_model *m) {
  const ml_model_config *c = &m->cfg;
  int64_t one = ml_mul_sat(c->head_dim / 2, m->S); /* [S, hd/2] */
  m->rope_cos = ml_be_alloc(m->be, ml_mul_sat(4, one), sizeof(float),
                            "the RoPE tables (%lld tokens x head_dim %lld)", (long long)m->S,
                            (long long)c->head_dim);
  if (!m->rope_cos) return -1;
  m->rope_sin = m->rope_cos + one;
  m->rope_local_cos = m->rope_sin + one;
  m->rope_local_sin = m->rope_local_cos + one;
  ML_TRY(rope_tables(m, c->rope_theta, &c->rope, m->rope_cos, m->rope_sin));
  ML_TRY(rope_tables(m, c->rope_local_theta, &c->rope_local, m->rope_local_cos,
                     m->rope_local_sin));
  for (int l = 0; l < c->n_layers; l++) {
    ml_layer *L = &m->layers[l];
    L->rope_cos = c->sliding[l] ? m->rope_local_cos : m->rope_cos;
    L->rope_sin = c->sliding[l] ? m->rope_local_sin : m->rope_sin;
  }
  return 0;
}

int ml_model_set_positions(ml_model *m, const int64_t *position_ids) {
  m->position_ids = position_ids;
  if (!m->rope_cos) return 0; /* ml_model_begin builds them */
  const ml_model_config *c = &m->cfg;
  ML_TRY(rope_tables(m, c->rope_theta, &c->rope, m->rope_cos, m->rope_sin));
  return rope_tables(m, c->rope_local_theta, &c->rope_local, m->rope_local_cos,
                     m->rope_local_sin);
}

void ml_model_reset_acts(ml_model *m) {
  free_acts(m);
  m->B = m->S = 0;
}

int ml_model_begin(ml_model *m, int64_t B, int64_t S) {
  /* a training geometry serves a forward-only pass too, not the reverse */
  if (m->B == B && m->S == S && m->x_final && (m->forward_only || !m->acts_shared) &&
      m->bf16_inputs == ml_model_bf16_inputs(m) && m->bf16_att == ml_model_bf16_att(m) &&
      m->bf16_mlp == ml_model_bf16_mlp(m) && m->bf16_qkv == ml_model_bf16_qkv(m) &&
      m->bf16_glu_grads == ml_model_bf16_glu_grads(m) &&
      m->bf16_rope_grads == ml_model_bf16_rope_grads(m))
    return 0;
  if (!m->be) return ml_err("ml_model_begin: no backend set (ml_model.be)");
  free_acts(m);
  ml_be_trim(m->be); /* the old geometry's buffers go back to the system */
  m->B = B;
  m->S = S;
  int64_t H = m->cfg.hidden;
  act_dims d = act_dims_of(m, B, S);
  int64_t T = d.T; /* saturated when B·S does not fit: then the first allocation fails */
  m->s_res_cap = d.Tr / (B > 0 ? B : 1);
  m->cap_q = d.q;
  m->cap_kv = d.kv;
  m->cap_i = d.I;
  ML_TRY(alloc_layer_acts(m, &d));
  char buf[96];
  const char *batch = batch_words(m, buf, sizeof buf);
  /* widths: config sizes or edge widths, each <= 2^24 (config.h), so 3·H + 1 and
   * 2·H + wide below are plain */
  m->x_final = ml_be_alloc(m->be, ml_mul_sat(T, 3 * H + 1), sizeof(float),
                               "the final norm's activations (%s x hidden_size %lld)", batch,
                               (long long)H);
  if (!m->x_final) return -1;
  m->xn_final = m->x_final + T * H;
  m->dxn_final = m->xn_final + T * H;
  m->rstd_final = m->dxn_final + T * H;
  /* set forward-only too: the reuse check above compares them */
  m->bf16_glu_grads = ml_model_bf16_glu_grads(m);
  m->bf16_rope_grads = ml_model_bf16_rope_grads(m);
  if (m->forward_only) return alloc_rope(m); /* no backward: no scratch */
  /* backward temporaries: two [T, H], then attention's datt, dq [T, cap_q] and dk, dv
   * [T, cap_kv] (datt's room holding the bf16 dq, dk [T, cap_q + cap_kv] under
   * bf16_rope_grads), or the MLP's da, dg, du [T, cap_i] (dg, du bf16 under
   * bf16_glu_grads); then the attention backward's workspace */
  int64_t datt = m->cap_q; /* floats a row of datt's room takes */
  if (m->bf16_rope_grads && m->cap_kv > m->cap_q) datt = (m->cap_q + m->cap_kv + 1) / 2;
  int64_t att_w = datt + m->cap_q + 2 * m->cap_kv, mlp_w = (m->bf16_glu_grads ? 2 : 3) * m->cap_i;
  int64_t temps = ml_mul_sat(T, 2 * H + (att_w > mlp_w ? att_w : mlp_w));
  size_t attn = ml_be_attention_work(m->be, B, S, m->cap_q / m->cfg.head_dim,
                                     m->cap_kv / m->cfg.head_dim, m->cfg.head_dim);
  int64_t attn_floats = attn >= (size_t)ML_SAT ? ML_SAT : (int64_t)((attn + 3) / 4);
  m->scratch = ml_be_alloc(m->be, ml_add_sat(temps, attn_floats), sizeof(float),
                               "the backward scratch (%s x hidden_size %lld, intermediate_size "
                               "%lld)",
                               batch, (long long)H, (long long)m->cfg.intermediate);
  if (!m->scratch) return -1;
  m->attn_work = m->scratch + temps;
  return alloc_rope(m);
}

void ml_model_vocab_shard(const ml_model *m, int64_t *v0, int64_t *nv) {
  const ml_param *w = m->lm_head.weight;
  *v0 = w->offset[0];
  *nv = w->local[0];
}

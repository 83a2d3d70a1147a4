/* LoRA adapters attached to the decoder's linears (model/lora.h). */
#include "model/lora.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "common/status.h"

double ml_lora_scaling(int64_t rank, double alpha, bool rslora) {
  return rslora ? alpha / sqrt((double)rank) : alpha / (double)rank;
}

/* Whether module name `mod` is matched by the target `t` of length n (PEFT's
 * check_target_module_exists for a list: the name itself, or its last
 * dot-separated components). */
static bool matches(const char *mod, const char *t, size_t n) {
  size_t len = strlen(mod);
  if (len < n || strncmp(mod + len - n, t, n) != 0) return false;
  return len == n || mod[len - n - 1] == '.';
}

/* The module name PEFT sees for linear module mod: the fused checkpoint
 * linear's for a part of one (Phi-3's qkv_proj for q_proj), else its own. */
static const char *peft_name(const ml_module *mod) {
  return mod->alias[0] ? mod->alias : mod->name;
}

/* Whether linear module mod is a target: every linear of a layer under
 * all-linear, else one whose PEFT name matches a name of the list. */
static bool is_target(const ml_module *mod, const char *targets, bool all) {
  if (all) return true;
  for (const char *t = targets; *t;) {
    size_t n = strcspn(t, ",");
    if (matches(peft_name(mod), t, n)) return true;
    t += n + (t[n] == ',');
  }
  return false;
}

/* A linear of a decoder layer (not lm_head), and its layer index. */
static bool layer_linear(const ml_module *mod, const ml_model *m, int *layer) {
  if (mod->kind != ML_MOD_LINEAR) return false;
  const ml_linear *lin = mod->ptr;
  if (lin == &m->lm_head) return false;
  *layer = lin->weight->layer;
  return *layer >= 0;
}

/* The last name components of the linears fused into `alias`, comma-separated, into buf. */
static void fused_parts(const ml_model *m, const char *alias, char *buf, size_t cap) {
  buf[0] = 0;
  for (int i = 0; i < m->n_modules; i++) {
    if (strcmp(m->modules[i].alias, alias) != 0) continue;
    const char *leaf = strrchr(m->modules[i].name, '.');
    size_t at = strlen(buf);
    snprintf(buf + at, cap - at, "%s%s", at ? ", " : "", leaf ? leaf + 1 : m->modules[i].name);
  }
}

/* The refusal of a target naming a part of the fused checkpoint linear `alias`. */
static int refuse_part(const ml_model *m, const char *target, int n, const char *alias) {
  char parts[160];
  fused_parts(m, alias, parts, sizeof parts);
  const char *leaf = strrchr(alias, '.');
  return ml_err("lora_targets (--lora-targets): target module '%.*s' is a part of the fused %s "
                "(one checkpoint linear for %s), which PEFT adapts as one module; expected "
                "'%s' (its lora_A shared by the parts, its lora_B over their rows)",
                n, target, alias, parts, leaf ? leaf + 1 : alias);
}

/* Whether lin is the router or an expert (a shared expert's linears and
 * gate included) of a layer's mixture-of-experts block. */
static bool in_moe(const ml_model *m, const ml_linear *lin) {
  int64_t n = (int64_t)m->cfg.n_layers * 3 * m->cfg.n_experts;
  if (m->experts && lin >= m->experts && lin < m->experts + n) return true;
  for (int l = 0; l < m->cfg.n_layers; l++) {
    const ml_moe *moe = &m->layers[l].moe;
    if (lin == &moe->gate || lin == &moe->shared_gate || (lin >= moe->shared && lin < moe->shared + 3))
      return true;
  }
  return false;
}

/* Each name of the list matches some linear of a layer. */
static int check_names(const ml_model *m, const char *targets) {
  for (const char *t = targets; *t;) {
    size_t n = strcspn(t, ",");
    if (n == 0)
      return ml_err("lora_targets (--lora-targets) '%s': an empty module name; expected "
                    "comma-separated names such as q_proj,v_proj, or all-linear", targets);
    bool found = false;
    int layer;
    for (int i = 0; i < m->n_modules && !found; i++)
      found = layer_linear(&m->modules[i], m, &layer) && matches(peft_name(&m->modules[i]), t, n);
    for (int i = 0; i < m->n_modules && !found; i++) /* a part's name: PEFT finds none */
      if (layer_linear(&m->modules[i], m, &layer) && m->modules[i].alias[0] &&
          matches(m->modules[i].name, t, n))
        return refuse_part(m, t, (int)n, m->modules[i].alias);
    if (!found)
      return ml_err("lora_targets (--lora-targets): target module '%.*s' not found in the %s "
                    "model; expected names of its decoder linears such as q_proj, k_proj, "
                    "v_proj, o_proj, gate_proj, up_proj, down_proj, or all-linear",
                    (int)n, t, m->cfg.family->architecture);
    t += n + (t[n] == ',');
  }
  return 0;
}

int ml_lora_attach(ml_model *m, int64_t rank, double scaling, const char *targets) {
  if (rank < 1 || rank > (1 << 20))
    return ml_err("lora_rank (--lora-rank) %lld: expected 1 .. 1048576", (long long)rank);
  if (!targets || !*targets)
    return ml_err("lora_targets (--lora-targets) is empty; expected module names such as "
                  "q_proj,v_proj, or all-linear");
  bool all = strcmp(targets, "all-linear") == 0;
  if (!all) ML_TRY(check_names(m, targets));
  int n_modules = m->n_modules, first = -1; /* first: the fused group's first part */
  for (int i = 0; i < n_modules; i++) {
    ml_module *mod = &m->modules[i];
    int layer;
    if (!layer_linear(mod, m, &layer) || !is_target(mod, targets, all)) continue;
    ml_linear *lin = mod->ptr;
    if (in_moe(m, lin))
      return ml_err("lora_targets (--lora-targets) '%s': %s is a linear of the "
                    "mixture-of-experts block (its router or an expert) of the %s model; LoRA "
                    "there is not supported (PEFT adapts the router as a linear and the "
                    "experts through target_parameters); expected targets outside it, such as "
                    "q_proj,k_proj,v_proj,o_proj", targets, mod->name,
                    m->cfg.family->architecture);
    int64_t out = lin->weight->shape[0], in = lin->weight->shape[1];
    bool next_part =
        mod->alias[0] && first >= 0 && strcmp(m->modules[first].alias, mod->alias) == 0;
    if (!next_part) {
      first = mod->alias[0] ? i : -1;
      lin->lora_a = ml_model_add_param(m, layer, rank, in, "%s.lora_A.weight", peft_name(mod));
    } else { /* the fused module's one lora_A */
      lin->lora_a = ((ml_linear *)m->modules[first].ptr)->lora_a;
    }
    lin->lora_b = ml_model_add_param(m, layer, out, rank, "%s.lora_B.weight", mod->name);
    if (mod->alias[0]) { /* this part's rows of the fused module's lora_B */
      snprintf(lin->lora_b->key, sizeof lin->lora_b->key, "%s.lora_B.weight", mod->alias);
      lin->lora_b->key_row0 = lin->weight->key_row0;
      lin->lora_b->key_rows = lin->weight->key_rows;
    }
    lin->lora_a->adapter = lin->lora_b->adapter = true;
    lin->lora_scale = (float)scaling;
    lin->lora_drop = &m->lora_drop;
    lin->lora_id = (uint64_t)(first >= 0 ? first : i); /* one dropout mask per PEFT module */
  }
  return 0;
}

int ml_lora_count(const ml_model *m) {
  int n = 0;
  for (int i = 0; i < m->n_modules; i++)
    n += m->modules[i].kind == ML_MOD_LINEAR && ((const ml_linear *)m->modules[i].ptr)->lora_a;
  return n;
}

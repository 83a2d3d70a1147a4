#include "parallel/tp.h"

#include <stdio.h>
#include <string.h>

#include "common/status.h"

void ml_chunk(int64_t n, int parts, int rank, int64_t *start, int64_t *len) {
  int64_t c = (n + parts - 1) / parts;
  int64_t s = c * rank < n ? c * rank : n;
  int64_t e = s + c < n ? s + c : n;
  *start = s;
  *len = e - s;
}

static int all_reduce_hook(void *ctx, float *x, int64_t rows, int64_t cols) {
  return ml_all_reduce(ctx, x, (size_t)(rows * cols), ML_ELEM_F32, ML_RED_SUM);
}

/* Shard parameter p on dim d over tp (torch.chunk); every shard non-empty. */
static int shard_param(ml_param *p, int d, ml_comm *tp) {
  int64_t n = p->shape[d], start, len;
  int64_t c = (n + tp->size - 1) / tp->size;
  if (c * (tp->size - 1) >= n)
    return ml_err("%s: dim %d of size %lld cannot be split into %d non-empty torch.chunk "
                  "shards; expected a size > %lld",
                  p->name, d, (long long)n, tp->size, (long long)(c * (tp->size - 1)));
  ml_chunk(n, tp->size, tp->rank, &start, &len);
  p->tp_dim = d;
  p->tp_start = start;
  p->local[d] = len;
  return 0;
}

static int unsupported_layout(const char *module, const char *which, ml_placement p) {
  char buf[32];
  return ml_err("module '%s': %s %s changes the local activation shape (sequence parallel / "
                "gathered layouts); this build supports Replicate inputs of colwise, Shard(-1) "
                "inputs of rowwise, and the default outputs",
                module, which, ml_placement_str(p, buf, sizeof buf));
}

static bool is_last_shard(ml_placement p) { return p.kind == ML_SHARD && p.dim == -1; }

static int apply_colwise_linear(const ml_module *mod, const ml_style *s, ml_comm *tp) {
  ml_linear *lin = mod->ptr;
  if (s->input_layout.kind != ML_REPLICATE)
    return unsupported_layout(mod->name, "input_layouts", s->input_layout);
  if (!is_last_shard(s->output_layout))
    return unsupported_layout(mod->name, "output_layouts", s->output_layout);
  if (tp->size == 1) return 0;
  ML_TRY(shard_param(lin->weight, 0, tp));
  if (lin->bias) ML_TRY(shard_param(lin->bias, 0, tp));
  lin->in_bwd = (ml_hook){all_reduce_hook, tp};
  return 0;
}

static int apply_rowwise_linear(const ml_module *mod, const ml_style *s, ml_comm *tp) {
  ml_linear *lin = mod->ptr;
  if (!is_last_shard(s->input_layout))
    return unsupported_layout(mod->name, "input_layouts", s->input_layout);
  if (s->output_layout.kind != ML_REPLICATE)
    return unsupported_layout(mod->name, "output_layouts", s->output_layout);
  if (tp->size == 1) return 0;
  ML_TRY(shard_param(lin->weight, 1, tp));
  lin->bias_in_forward = tp->rank == 0; /* Replicate bias, added once to the Partial sum */
  lin->out_fwd = (ml_hook){all_reduce_hook, tp};
  return 0;
}

static int apply_rowwise_embedding(const ml_module *mod, const ml_style *s, ml_comm *tp) {
  ml_embedding *e = mod->ptr;
  if (s->input_layout.kind != ML_REPLICATE)
    return unsupported_layout(mod->name, "input_layouts", s->input_layout);
  if (s->output_layout.kind != ML_REPLICATE)
    return unsupported_layout(mod->name, "output_layouts", s->output_layout);
  if (tp->size == 1) return 0;
  ML_TRY(shard_param(e->weight, 0, tp));
  e->out_fwd = (ml_hook){all_reduce_hook, tp};
  return 0;
}

static const char *kind_name(ml_module_kind k) {
  return k == ML_MOD_LINEAR ? "Linear" : k == ML_MOD_EMBEDDING ? "Embedding" : "RMSNorm";
}

static int apply_style(const ml_module *mod, const ml_style *s, ml_comm *tp) {
  if (mod->kind == ML_MOD_LINEAR)
    return s->kind == ML_STYLE_COLWISE ? apply_colwise_linear(mod, s, tp)
                                       : apply_rowwise_linear(mod, s, tp);
  if (mod->kind == ML_MOD_EMBEDDING && s->kind == ML_STYLE_ROWWISE)
    return apply_rowwise_embedding(mod, s, tp);
  return ml_err("%s cannot shard module '%s' (%s)%s", ml_style_name(s->kind), mod->name,
                kind_name(mod->kind),
                mod->kind == ML_MOD_EMBEDDING ? ": only RowwiseParallel (vocab-parallel) "
                                                "embeddings are supported"
                                              : "");
}

static int check_heads(const ml_model_config *c, int tp) {
  if (c->n_heads % tp != 0)
    return ml_err("tp=%d does not divide num_attention_heads=%lld; expected a tp size that "
                  "divides the number of heads",
                  tp, (long long)c->n_heads);
  if (c->n_kv_heads % tp != 0)
    return ml_err("tp=%d does not divide num_key_value_heads=%lld; expected a tp size that "
                  "divides the number of key/value heads",
                  tp, (long long)c->n_kv_heads);
  return 0;
}

static bool same_hook(ml_hook a, ml_hook b) { return a.fn == b.fn && a.ctx == b.ctx; }

/* Siblings reading one activation must prepare it the same way. */
static int check_siblings(const ml_linear *a, const ml_linear *b) {
  if (same_hook(a->in_fwd, b->in_fwd) && same_hook(a->in_bwd, b->in_bwd)) return 0;
  return ml_err("'%s' and '%s' read the same activation but the plan gives them different "
                "input layouts; expected the same style on both",
                a->weight->name, b->weight->name);
}

int ml_tp_apply(const ml_plan *plan, ml_model *m, ml_comm *tp) {
  ML_TRY(check_heads(&m->cfg, tp->size));
  for (size_t r = 0; r < plan->n; r++) {
    const ml_plan_rule *rule = &plan->rules[r];
    int matched = 0;
    for (int i = 0; i < m->n_modules; i++) {
      if (!ml_pattern_match(rule->pattern, m->modules[i].name)) continue;
      matched++;
      ML_TRY(apply_style(&m->modules[i], &rule->style, tp));
    }
    if (!matched)
      return ml_err("plan '%s': pattern '%s' matches no module of this %s model; expected an HF "
                    "module name such as %s",
                    plan->name, rule->pattern, m->cfg.family->name, m->modules[1].name);
  }
  for (int l = 0; l < m->cfg.n_layers; l++) {
    ml_layer *L = &m->layers[l];
    ML_TRY(check_siblings(&L->q_proj, &L->k_proj));
    ML_TRY(check_siblings(&L->q_proj, &L->v_proj));
    ML_TRY(check_siblings(&L->gate_proj, &L->up_proj));
  }
  return 0;
}

#include "parallel/plan.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "io/json.h"
#include "model/block.h"

static const char *const kind_names[ML_STYLE_KINDS] = {
    [ML_STYLE_COLWISE] = "ColwiseParallel",
    [ML_STYLE_ROWWISE] = "RowwiseParallel",
    [ML_STYLE_SEQUENCE_PARALLEL] = "SequenceParallel",
    [ML_STYLE_PREPARE_INPUT] = "PrepareModuleInput",
    [ML_STYLE_PREPARE_OUTPUT] = "PrepareModuleOutput",
    [ML_STYLE_PREPARE_INPUT_OUTPUT] = "PrepareModuleInputOutput",
    [ML_STYLE_REPLICATE] = "ReplicateParallel",
    [ML_STYLE_GATHER] = "GatherParallel",
};

const char *ml_style_kind_name(ml_style_kind k) { return kind_names[k]; }

ml_style ml_style_default(ml_style_kind kind) {
  ml_style s = {.kind = kind};
  ml_placement R = ml_replicate();
  s.input_layout = s.desired_input_layout = s.output_layout = s.desired_output_layout = R;
  switch (kind) {
    case ML_STYLE_COLWISE:
      s.output_layout = ml_shard(-1);
      s.use_local_output = true;
      break;
    case ML_STYLE_ROWWISE:
      s.input_layout = s.desired_input_layout = ml_shard(-1);
      s.use_local_output = true;
      break;
    case ML_STYLE_SEQUENCE_PARALLEL:
      s.input_layout = s.desired_input_layout = s.output_layout = ml_shard(1);
      break;
    case ML_STYLE_GATHER:
      s.input_layout = s.desired_input_layout = ml_partial(); /* what it expects out of the module */
      s.use_local_output = true;
      break;
    default:
      break;
  }
  snprintf(s.label, sizeof s.label, "%s", kind_names[kind]);
  return s;
}

/* HF plan strings (transformers 4.5x ParallelInterface and 5.x names). */
typedef struct hf_entry {
  const char *name;
  ml_style_kind kind;
  bool out_replicate, in_replicate, local;
} hf_entry;

static const hf_entry hf_table[] = {
    {"colwise", ML_STYLE_COLWISE, false, false, false},
    {"rowwise", ML_STYLE_ROWWISE, false, false, false},
    {"colwise_rep", ML_STYLE_COLWISE, true, false, false},
    {"colwise_gather_output", ML_STYLE_COLWISE, true, false, false},
    {"rowwise_rep", ML_STYLE_ROWWISE, false, true, false},
    {"rowwise_split_input", ML_STYLE_ROWWISE, false, true, false},
    {"embedding_rowwise", ML_STYLE_ROWWISE, false, true, false},
    {"embedding_colwise", ML_STYLE_COLWISE, true, false, false},
    {"sequence_parallel", ML_STYLE_SEQUENCE_PARALLEL, false, false, false},
    {"local_colwise", ML_STYLE_COLWISE, false, false, true},
    {"local_rowwise", ML_STYLE_ROWWISE, false, false, true},
    {"gather", ML_STYLE_GATHER, false, false, false},
    {"all_reduce", ML_STYLE_GATHER, false, false, false},
    {"replicated_with_grad_allreduce", ML_STYLE_REPLICATE, false, false, false},
    {"replicate", ML_STYLE_REPLICATE, false, false, false},
};
enum { N_HF = sizeof hf_table / sizeof hf_table[0] };

const char *ml_style_hf_names(void) {
  static char buf[512];
  if (!buf[0])
    for (int i = 0; i < N_HF; i++) {
      if (i) strcat(buf, ", ");
      strcat(buf, hf_table[i].name);
    }
  return buf;
}

int ml_style_from_hf(const char *s, const char *where, ml_style *out) {
  for (int i = 0; i < N_HF; i++) {
    const hf_entry *h = &hf_table[i];
    if (strcmp(h->name, s) != 0) continue;
    *out = ml_style_default(h->kind);
    if (h->out_replicate) out->output_layout = ml_replicate();
    if (h->in_replicate) out->input_layout = ml_replicate();
    out->local = h->local;
    out->hf = true;
    snprintf(out->label, sizeof out->label, "%s", s);
    return 0;
  }
  return ml_err("%s: unknown parallel style '%s'; expected one of: %s, or an object with a torch "
                "style (ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput, "
                "PrepareModuleOutput, PrepareModuleInputOutput)",
                where, s, ml_style_hf_names());
}

int ml_placement_parse(const char *s, const char *where, ml_placement *out) {
  int d;
  char tail;
  if (!strcmp(s, "Replicate()") || !strcmp(s, "Replicate")) *out = ml_replicate();
  else if (!strcmp(s, "Partial()") || !strcmp(s, "Partial") || !strcmp(s, "Partial(sum)"))
    *out = ml_partial();
  else if (sscanf(s, "Shard(%d%c", &d, &tail) == 2 && tail == ')' && d >= -1 && d <= 2)
    *out = ml_shard(d);
  else
    return ml_err("%s: unknown placement '%s'; expected Replicate(), Shard(d) with d in "
                  "{0, 1, 2, -1} or Partial()",
                  where, s);
  return 0;
}

int ml_plan_add(ml_plan *p, const char *pattern, ml_style s) {
  if (p->n == p->cap) {
    size_t cap = p->cap ? 2 * p->cap : 16;
    ml_plan_rule *r = realloc(p->rules, cap * sizeof *r);
    if (!r) return ml_err("out of memory growing plan '%s'", p->name);
    p->rules = r;
    p->cap = cap;
  }
  ml_plan_rule *r = &p->rules[p->n++];
  memset(r, 0, sizeof *r);
  snprintf(r->pattern, sizeof r->pattern, "%s", pattern);
  r->style = s;
  return 0;
}

void ml_plan_free(ml_plan *p) {
  free(p->rules);
  memset(p, 0, sizeof *p);
}

/* ---- built-in plans -------------------------------------------------- */

static int add(ml_plan *p, const char *prefix, const char *suffix, ml_style s) {
  char pat[160];
  snprintf(pat, sizeof pat, "%s%s", prefix, suffix);
  return ml_plan_add(p, pat, s);
}

/* Every RMSNorm of layer 0 as a per-layer pattern: layer norms (on the
 * residual stream) get `layer_style`, norms inside self_attn (q_norm /
 * k_norm, on head-sharded activations) `head_style` (skipped when NULL). */
static int add_norms(ml_plan *p, const ml_model *m, const ml_style *layer_style,
                     const ml_style *head_style) {
  const char *pre = m->cfg.family->prefix;
  char layer0[96];
  snprintf(layer0, sizeof layer0, "%slayers.0.", pre);
  size_t n0 = strlen(layer0);
  for (int i = 0; i < m->n_modules; i++) {
    const ml_module *mod = &m->modules[i];
    if (mod->kind != ML_MOD_RMSNORM || strncmp(mod->name, layer0, n0) != 0) continue;
    const char *suffix = mod->name + n0;
    bool head = strncmp(suffix, "self_attn.", 10) == 0;
    const ml_style *s = head ? head_style : layer_style;
    if (!s) continue;
    char pat[160];
    snprintf(pat, sizeof pat, "%slayers.*.%s", pre, suffix);
    ML_TRY(ml_plan_add(p, pat, *s));
  }
  if (layer_style) ML_TRY(add(p, pre, "norm", *layer_style));
  return 0;
}

static int llama_style(const ml_model *m, bool sp, bool head_norms, ml_plan *p) {
  const char *pre = m->cfg.family->prefix;
  ml_style col = ml_style_default(ML_STYLE_COLWISE), row = ml_style_default(ML_STYLE_ROWWISE);
  ml_style embed = row, head = col, out_row = row;
  embed.input_layout = ml_replicate();
  head.use_local_output = false;
  if (sp) {
    embed.output_layout = ml_shard(1);
    out_row.output_layout = ml_shard(1);
    head.input_layout = ml_shard(1);
  }
  ML_TRY(add(p, pre, "embed_tokens", embed));
  if (sp) {
    ml_style prep = ml_style_default(ML_STYLE_PREPARE_INPUT);
    prep.input_layout = ml_shard(1);
    prep.desired_input_layout = ml_replicate();
    snprintf(prep.label, sizeof prep.label, "PrepareModuleInput");
    ML_TRY(add(p, pre, "layers.*.self_attn", prep));
    ML_TRY(add(p, pre, "layers.*.mlp", prep));
  }
  for (int i = 0; i < ML_ROLE_COUNT; i++) { /* the block's linears by their tp style */
    const ml_block_row *r = &ml_block_rows[i];
    if (r->tp == ML_TP_NONE || !ml_block_present(&m->cfg, r)) continue;
    char suffix[96];
    snprintf(suffix, sizeof suffix, "layers.*.%s", r->leaf);
    ML_TRY(add(p, pre, suffix, r->tp == ML_TP_COLWISE ? col : out_row));
  }
  ml_style seq = ml_style_default(ML_STYLE_SEQUENCE_PARALLEL);
  ml_style rep = ml_style_default(ML_STYLE_REPLICATE);
  snprintf(rep.label, sizeof rep.label, "replicated_with_grad_allreduce");
  ML_TRY(add_norms(p, m, sp ? &seq : NULL, head_norms ? &rep : NULL));
  ML_TRY(ml_plan_add(p, "lm_head", head));
  p->sequence_parallel = sp;
  return 0;
}

int ml_plan_optimized(const ml_model *m, bool sp, ml_plan *out) {
  const ml_family *f = m->cfg.family;
  if (f->tp_plan) { /* the family's own (a registered one's) */
    char what[96];
    snprintf(what, sizeof what, "the tp plan of family %s", f->name);
    ML_TRY(ml_plan_parse(f->tp_plan, what, f->prefix, out));
    snprintf(out->name, sizeof out->name, "%s-optimized", f->name);
    return 0;
  }
  memset(out, 0, sizeof *out);
  snprintf(out->name, sizeof out->name, "%s-optimized%s", f->name, sp ? "-sp" : "");
  int rc = llama_style(m, sp, true, out);
  if (rc) ml_plan_free(out);
  return rc;
}

int ml_plan_default(const ml_model *m, bool sp, ml_plan *out) {
  memset(out, 0, sizeof *out);
  snprintf(out->name, sizeof out->name, "default-llama%s", sp ? "-sp" : "");
  int rc = llama_style(m, sp, false, out);
  if (rc) ml_plan_free(out);
  return rc;
}

/* ---- HF base_model_tp_plan ------------------------------------------- */

static int hf_rules(const ml_model *m, const ml_json *j, json_t *plan, ml_plan *out) {
  const char *pre = m->cfg.family->prefix, *key;
  json_t *v;
  bool has_embed = false;
  json_object_foreach(plan, key, v) {
    char where[256];
    snprintf(where, sizeof where, "%s: base_model_tp_plan['%s']", j->path, key);
    if (!json_is_string(v)) {
      char buf[64];
      ml_json_brief(v, buf, sizeof buf);
      return ml_err("%s: expected a plan string, found %s", where, buf);
    }
    ml_style s;
    ML_TRY(ml_style_from_hf(json_string_value(v), where, &s));
    if (!strcmp(key, "embed_tokens")) has_embed = true;
    ML_TRY(add(out, pre, key, s));
  }
  if (!has_embed) { /* NeMo get_hf_tp_plan: vocab-parallel embedding */
    ml_style s;
    ML_TRY(ml_style_from_hf("rowwise_rep", "embed_tokens", &s));
    ML_TRY(add(out, pre, "embed_tokens", s));
  }
  /* the class plan's lm_head "colwise_rep", kept vocab-sharded (NeMo) */
  ml_style head = ml_style_default(ML_STYLE_COLWISE);
  head.use_local_output = false;
  snprintf(head.label, sizeof head.label, "colwise_rep→Shard(-1)");
  return ml_plan_add(out, "lm_head", head);
}

int ml_plan_hf(const ml_model *m, const char *model_dir, ml_plan *out, bool *found) {
  memset(out, 0, sizeof *out);
  *found = false;
  char path[4096];
  snprintf(path, sizeof path, "%s/config.json", model_dir);
  ml_json j;
  ML_TRY(ml_json_load(path, &j));
  json_t *plan = json_object_get(j.root, "base_model_tp_plan");
  json_t *text = json_object_get(j.root, "text_config");
  if (!plan && json_is_object(text)) plan = json_object_get(text, "base_model_tp_plan");
  json_t *cls = NULL; /* the family's class attribute, when config.json has none */
  const char *hf = m->cfg.family->hf_tp_plan;
  int rc = 0;
  if ((!plan || json_is_null(plan)) && hf && !(plan = cls = json_loads(hf, 0, NULL)))
    rc = ml_err("family %s: its base_model_tp_plan is not JSON", m->cfg.family->name);
  if (rc == 0 && plan && !json_is_null(plan)) {
    if (!json_is_object(plan) || json_object_size(plan) == 0) {
      rc = ml_err("%s: field 'base_model_tp_plan': expected a non-empty object of "
                  "{module pattern: style string}",
                  path);
    } else {
      *found = true;
      if (cls)
        snprintf(out->name, sizeof out->name, "hf-%s-base_model_tp_plan", m->cfg.family->name);
      else
        snprintf(out->name, sizeof out->name, "hf-base_model_tp_plan");
      rc = hf_rules(m, &j, plan, out);
    }
  }
  json_decref(cls);
  ml_json_free(&j);
  if (rc) ml_plan_free(out);
  return rc;
}

/* ---- custom plan files ----------------------------------------------- */

static int style_kind_by_name(const char *s, ml_style_kind *k) {
  for (int i = 0; i < ML_STYLE_KINDS; i++)
    if (!strcmp(kind_names[i], s)) {
      *k = (ml_style_kind)i;
      return 1;
    }
  return 0;
}

/* A placement field: a string, or [placement, null, ...] (torch's tuples
 * of per-input layouts; only the first input is an activation here). */
static int layout_field(const char *where, const char *key, json_t *v, ml_placement *out) {
  char w[320];
  snprintf(w, sizeof w, "%s.%s", where, key);
  if (json_is_array(v)) {
    size_t n = json_array_size(v);
    for (size_t i = 1; i < n; i++)
      if (!json_is_null(json_array_get(v, i)))
        return ml_err("%s: only the first input/output is an activation here; expected "
                      "[placement, null, ...]",
                      w);
    v = n ? json_array_get(v, 0) : NULL;
  }
  if (!json_is_string(v)) {
    char buf[64];
    ml_json_brief(v, buf, sizeof buf);
    return ml_err("%s: expected a placement string such as \"Shard(1)\", found %s", w, buf);
  }
  return ml_placement_parse(json_string_value(v), w, out);
}

static int style_object(const char *where, json_t *o, ml_style *s) {
  json_t *name = json_object_get(o, "style");
  if (!json_is_string(name))
    return ml_err("%s: expected a \"style\" string (a torch style class or an HF plan string)",
                  where);
  ml_style_kind k;
  if (style_kind_by_name(json_string_value(name), &k)) *s = ml_style_default(k);
  else ML_TRY(ml_style_from_hf(json_string_value(name), where, s));
  const char *key;
  json_t *v;
  json_object_foreach(o, key, v) {
    if (!strcmp(key, "style")) continue;
    if (!strcmp(key, "input_layouts")) ML_TRY(layout_field(where, key, v, &s->input_layout));
    else if (!strcmp(key, "desired_input_layouts"))
      ML_TRY(layout_field(where, key, v, &s->desired_input_layout));
    else if (!strcmp(key, "output_layouts")) ML_TRY(layout_field(where, key, v, &s->output_layout));
    else if (!strcmp(key, "desired_output_layouts"))
      ML_TRY(layout_field(where, key, v, &s->desired_output_layout));
    else if (!strcmp(key, "use_local_output")) {
      if (!json_is_boolean(v)) return ml_err("%s.use_local_output: expected true or false", where);
      s->use_local_output = json_is_true(v);
    } else if (!strcmp(key, "sequence_dim")) {
      if (!json_is_integer(v) || json_integer_value(v) != 1)
        return ml_err("%s.sequence_dim: only 1 (activations are [B, S, H]) is supported", where);
    } else {
      return ml_err("%s: unknown key '%s'; expected style, input_layouts, desired_input_layouts, "
                    "output_layouts, desired_output_layouts, use_local_output, sequence_dim",
                    where, key);
    }
  }
  if (s->kind == ML_STYLE_SEQUENCE_PARALLEL) s->input_layout = s->desired_input_layout = ml_shard(1);
  return 0;
}

static const char *base_name(const char *path) {
  const char *b = strrchr(path, '/');
  return b ? b + 1 : path;
}

/* The rules of plan object `root` ({pattern: style}) appended to out, each
 * pattern behind `prefix` but "lm_head…" (a top-level module); `what`
 * names the plan in messages. */
static int plan_rules(const json_t *root, const char *what, const char *prefix, ml_plan *out) {
  const char *key;
  json_t *v;
  json_object_foreach((json_t *)root, key, v) {
    char where[256];
    snprintf(where, sizeof where, "%s: '%s'", what, key);
    ml_style s;
    if (json_is_string(v)) ML_TRY(ml_style_from_hf(json_string_value(v), where, &s));
    else if (json_is_object(v)) ML_TRY(style_object(where, v, &s));
    else return ml_err("%s: expected an HF plan string or a style object", where);
    ML_TRY(add(out, strncmp(key, "lm_head", 7) == 0 ? "" : prefix, key, s));
    if (s.kind == ML_STYLE_SEQUENCE_PARALLEL) out->sequence_parallel = true;
  }
  if (out->n == 0) return ml_err("%s: the plan is empty; expected {pattern: style, ...}", what);
  return 0;
}

int ml_plan_load(const char *path, ml_plan *out) {
  memset(out, 0, sizeof *out);
  ml_json j;
  ML_TRY(ml_json_load(path, &j));
  snprintf(out->name, sizeof out->name, "custom:%s", base_name(path));
  int rc = plan_rules(j.root, path, "", out);
  ml_json_free(&j);
  if (rc) ml_plan_free(out);
  return rc;
}

int ml_plan_parse(const char *text, const char *what, const char *prefix, ml_plan *out) {
  memset(out, 0, sizeof *out);
  json_error_t e;
  json_t *root = json_loads(text, JSON_REJECT_DUPLICATES, &e);
  int rc = root ? 0 : ml_err("%s:%d:%d: invalid JSON: %s", what, e.line, e.column, e.text);
  if (rc == 0 && !json_is_object(root))
    rc = ml_err("%s: expected a JSON object {pattern: style, ...}", what);
  if (rc == 0) rc = plan_rules(root, what, prefix, out);
  json_decref(root);
  if (rc) ml_plan_free(out);
  return rc;
}

/* ---- selection -------------------------------------------------------- */

int ml_plan_select(const ml_model *m, const char *model_dir, const char *choice, bool sp,
                   ml_plan *out) {
  const char *fam = m->cfg.family->name;
  bool is_auto = !choice || !strcmp(choice, "auto");
  if (is_auto || !strcmp(choice, "optimized")) {
    ML_TRY(ml_plan_optimized(m, sp, out));
    snprintf(out->reason, sizeof out->reason,
             "%s: the optimized plan of the %s family (%s%s); it ranks above the checkpoint's HF "
             "plan and the default",
             is_auto ? "no --parallel-plan" : "--parallel-plan optimized", fam,
             m->cfg.family->tp_plan ? "the family's registered plan"
                                    : "the block table's styles, as NeMo's _parallelize_llama",
             sp ? ", sequence-parallel variant" : "");
    return 0;
  }
  if (!strcmp(choice, "hf")) {
    bool found;
    ML_TRY(ml_plan_hf(m, model_dir, out, &found));
    if (!found)
      return ml_err("--parallel-plan hf: %s/config.json carries no base_model_tp_plan and family "
                    "%s has no class plan; expected that field, or use auto, optimized, default "
                    "or a plan file",
                    model_dir, fam);
    if (sp) {
      ml_plan_free(out);
      return ml_err("--sequence-parallel: the HF base_model_tp_plan has no sequence-parallel "
                    "variant (as in NeMo); use the optimized plan or a custom plan with "
                    "SequenceParallel norms");
    }
    snprintf(out->reason, sizeof out->reason,
             "--parallel-plan hf: %s, with embed_tokens vocab-parallel and lm_head kept "
             "vocab-sharded (NeMo get_hf_tp_plan)",
             strcmp(out->name, "hf-base_model_tp_plan") == 0
                 ? "config.json's base_model_tp_plan"
                 : "the config class's base_model_tp_plan (config.json has none)");
    return 0;
  }
  if (!strcmp(choice, "default")) {
    ML_TRY(ml_plan_default(m, sp, out));
    snprintf(out->reason, sizeof out->reason,
             "--parallel-plan default: the Llama-style default plan (NeMo Automodel's base plan)");
    return 0;
  }
  ML_TRY(ml_plan_load(choice, out));
  snprintf(out->reason, sizeof out->reason,
           "--parallel-plan %s: a custom plan ranks above the optimized, HF and default plans",
           choice);
  if (sp && !out->sequence_parallel) {
    ml_plan_free(out);
    return ml_err("--sequence-parallel: custom plan %s has no SequenceParallel module; expected "
                  "SequenceParallel norms and Shard(1) residual layouts (or drop the flag)",
                  choice);
  }
  return 0;
}

bool ml_pattern_match(const char *pattern, const char *name) {
  while (*pattern && *name) {
    if (*pattern == '*') {
      pattern++;
      while (*name && *name != '.') name++;
      continue;
    }
    if (*pattern != *name) return false;
    pattern++;
    name++;
  }
  return *pattern == '\0' && *name == '\0';
}

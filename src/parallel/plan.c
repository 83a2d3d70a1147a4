#include "parallel/plan.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"

ml_style ml_style_colwise(void) {
  return (ml_style){ML_STYLE_COLWISE, {ML_REPLICATE, 0}, {ML_SHARD, -1}, true};
}

ml_style ml_style_rowwise(void) {
  return (ml_style){ML_STYLE_ROWWISE, {ML_SHARD, -1}, {ML_REPLICATE, 0}, true};
}

const char *ml_style_name(ml_style_kind k) {
  return k == ML_STYLE_COLWISE ? "ColwiseParallel" : "RowwiseParallel";
}

static void add_rule(ml_plan *p, const char *prefix, const char *suffix, ml_style s) {
  ml_plan_rule *r = &p->rules[p->n++];
  snprintf(r->pattern, sizeof r->pattern, "%s%s", prefix, suffix);
  r->style = s;
}

int ml_plan_llama_base(const ml_model_config *c, ml_plan *out) {
  memset(out, 0, sizeof *out);
  out->rules = ml_calloc(9, sizeof *out->rules, "plan");
  if (!out->rules) return -1;
  snprintf(out->name, sizeof out->name, "%s-base", c->family->name);
  const char *pre = c->family->prefix;
  ml_style col = ml_style_colwise(), row = ml_style_rowwise();
  ml_style embed = row;
  embed.input_layout = (ml_placement){ML_REPLICATE, 0};
  ml_style head = col;
  head.use_local_output = false;
  add_rule(out, pre, "embed_tokens", embed);
  add_rule(out, pre, "layers.*.self_attn.q_proj", col);
  add_rule(out, pre, "layers.*.self_attn.k_proj", col);
  add_rule(out, pre, "layers.*.self_attn.v_proj", col);
  add_rule(out, pre, "layers.*.self_attn.o_proj", row);
  add_rule(out, pre, "layers.*.mlp.gate_proj", col);
  add_rule(out, pre, "layers.*.mlp.up_proj", col);
  add_rule(out, pre, "layers.*.mlp.down_proj", row);
  add_rule(out, "", "lm_head", head);
  return 0;
}

void ml_plan_free(ml_plan *p) {
  free(p->rules);
  memset(p, 0, sizeof *p);
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

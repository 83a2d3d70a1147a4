#include "engine/fp32_params.h"

#include "engine/param_match.h"

static void keep_fp32(ml_param *p) { p->fp32 = true; }

int ml_fp32_params_apply(ml_model *m, const char *patterns) {
  for (int i = 0; i < m->n_params; i++) m->params[i].fp32 = false;
  for (int64_t l = 0; l < m->cfg.n_layers; l++) /* the family's mark: every router */
    if (m->layers[l].moe.gate.weight) keep_fp32(m->layers[l].moe.gate.weight);
  return ml_param_match_each(m, patterns, "fp32_params (--fp32-params)", keep_fp32);
}

void ml_fp32_params_count(const ml_model *m, int *n, int64_t *numel) {
  *n = 0;
  *numel = 0;
  for (int i = 0; i < m->n_params; i++) {
    const ml_param *p = &m->params[i];
    if (!p->fp32) continue;
    (*n)++;
    *numel += p->shape[0] * p->shape[1]; /* bounded: config sizes fit int64 (model/config.h) */
  }
}

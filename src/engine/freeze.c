#include "engine/freeze.h"

#include "common/status.h"
#include "engine/param_match.h"

static void freeze_one(ml_param *p) { p->frozen = true; }

int ml_freeze_apply(ml_model *m, const char *patterns) {
  for (int i = 0; i < m->n_params; i++) m->params[i].frozen = false;
  ML_TRY(ml_param_match_each(m, patterns, "freeze (--freeze)", freeze_one));
  int n;
  int64_t numel;
  ml_freeze_count(m, &n, &numel);
  if (n == m->n_params)
    return ml_err("freeze (--freeze) '%s' matches all %d parameters; expected at least one "
                  "trainable parameter (nothing would train)",
                  patterns, n);
  return 0;
}

void ml_freeze_count(const ml_model *m, int *n_frozen, int64_t *numel) {
  *n_frozen = 0;
  *numel = 0;
  for (int i = 0; i < m->n_params; i++) {
    const ml_param *p = &m->params[i];
    if (!p->frozen) continue;
    (*n_frozen)++;
    *numel += p->shape[0] * p->shape[1]; /* bounded: config sizes fit int64 (model/config.h) */
  }
}

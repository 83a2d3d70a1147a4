#include "engine/step.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "backend/profile.h"
#include "common/status.h"

int ml_step_accumulate(ml_engine *e, const ml_step_source *src, ml_step_result *r) {
  r->loss = 0.0;
  r->sums = (ml_obj_sums){0};
  /* with an objective: the micro-batches' MoE load-balancing terms, each already the whole
     batch's on every rank (engine.h ml_engine_forward_backward; 0 without router_aux) */
  double aux = 0.0;
  for (int64_t m = 0; m < src->n_micro; m++) {
    ml_engine_batch b;
    ML_TRY(src->fill(src->ctx, m, &b));
    if (m == src->n_micro - 1) ml_engine_norm_ahead(e, src->norm_type);
    if (src->objective) {
      ml_loss_out nll;
      ML_TRY(ml_engine_forward_backward_batch(e, &b, src->objective, 0.0f, &r->sums, &nll));
      aux += e->model.cfg.aux_coef * e->model.aux.value;
      continue;
    }
    if (b.docs || b.obj)
      return ml_err("training step: micro-batch %lld has packed documents or objective inputs "
                    "but the step has no objective; expected plain rows under the NLL",
                    (long long)m);
    double part;
    ML_TRY(ml_engine_forward_backward(e, b.ids, b.mask, b.B, b.S, src->global_targets, &part));
    r->loss += part;
  }
  if (!src->objective) return 0;
  /* the sums over the data ranks (cp ranks hold pieces of the same sequences) */
  ml_obj_sums *s = &r->sums;
  double v[5] = {s->loss, s->kl, (double)s->trained, (double)s->clipped, s->entropy};
  ML_TRY(ml_host_all_reduce_f64(ml_mesh_host(e->mesh, ML_GROUP_DP_CP), v, 5, ML_RED_SUM));
  *s = (ml_obj_sums){v[0], v[1], (int64_t)v[2], (int64_t)v[3], v[4]};
  s->loss += aux;
  r->loss = s->loss;
  return 0;
}

int ml_step_apply(ml_engine *e, const ml_step_opts *o, int64_t k, const char *skip,
                  ml_step_result *r) {
  r->lr = ml_lr_at(&o->schedule, k);
  ML_TRY(ml_engine_grad_norm(e, o->norm_type, &r->grad_norm));
  r->skipped = skip || !isfinite(r->grad_norm);
  if (skip) snprintf(r->reason, sizeof r->reason, "%s", skip);
  if (!isfinite(r->grad_norm)) {
    if (!skip)
      snprintf(r->reason, sizeof r->reason, "the grad norm is not finite (%g)", r->grad_norm);
    /* r->nonfinite stays "" (zeroed) when no gradient is found */
    return ml_engine_find_nonfinite(e, r->nonfinite, sizeof r->nonfinite) < 0 ? -1 : 0;
  }
  if (r->skipped) return 0;
  ml_adamw_cfg adam = {r->lr, o->beta1, o->beta2, o->eps, o->weight_decay};
  return ml_engine_clip_adamw(e, r->grad_norm, o->max_grad_norm, &adam);
}

int ml_step_run(ml_engine *e, const ml_step_opts *o, int64_t k, const ml_step_source *src,
                ml_step_result *r) {
  memset(r, 0, sizeof *r);
  if (ml_be_profile_on()) ml_be_profile_restart(e->be); /* the table is the last step's */
  ML_TRY(ml_engine_zero_grad(e));
  ml_step_source norm_last = *src;
  norm_last.norm_type = o->norm_type;
  ML_TRY(ml_step_accumulate(e, &norm_last, r));
  char why[64];
  /* r->loss is the same on every rank (summed over the data ranks): an agreed decision */
  if (!isfinite(r->loss)) snprintf(why, sizeof why, "the loss is not finite (%g)", r->loss);
  return ml_step_apply(e, o, k, isfinite(r->loss) ? NULL : why, r);
}

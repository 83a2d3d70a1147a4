/* The split steps (include/meshlm/meshlm.h meshlm_zero_grad,
 * meshlm_forward_backward, meshlm_optimizer_step, meshlm_eval_loss):
 * meshlm_train_step's parts (api/train.c), the results accumulated in the
 * session between zero_grad and the optimizer step. */
#include <string.h>

#include "api/train.h"

int meshlm_zero_grad(meshlm_session *s) {
  ML_TRY(api_enter(s, API_CALL_ZERO_GRAD));
  if (ml_engine_zero_grad(&s->e)) api_abort(s);
  s->acc = (api_acc){0};
  return 0;
}

/* One call's result into out (NULL: not wanted; its size checked before). */
static void write_call(meshlm_session *s, const char *name, const api_acc *a,
                       meshlm_step_result *out) {
  if (!out) return;
  ml_step_result none = {0};
  none.skipped = a->skip[0] != 0;
  memcpy(none.reason, a->skip, sizeof none.reason);
  meshlm_step_result full;
  api_result_fill(a, &none, s->steps, &full);
  api_write_struct(name, "meshlm_step_result", out, API_MIN(meshlm_step_result), sizeof full,
                   &full);
}

/* forward_backward and eval_loss: one loss call, with or without the
 * backward. */
static int loss_call(meshlm_session *s, api_call call, const char *name,
                     const meshlm_train_batch *b, const meshlm_loss *loss,
                     meshlm_step_result *out, bool backward) {
  ML_TRY(api_enter(s, call));
  api_loss_call c;
  if (api_loss_begin(s, name, b, loss, out, backward, &c)) {
    api_loss_free(&c);
    return -1;
  }
  ml_step_result r = {0};
  if (backward)
    api_loss_backward(s, &c, &r);
  else
    api_loss_forward(s, &c, &r);
  api_acc a;
  int rc = api_loss_result(s, &c, &r, &a);
  api_loss_free(&c);
  if (backward) api_acc_add(&s->acc, &a);
  write_call(s, name, &a, out);
  return api_agree(s, rc);
}

int meshlm_forward_backward(meshlm_session *s, const meshlm_train_batch *b,
                            const meshlm_loss *loss, meshlm_step_result *out) {
  return loss_call(s, API_CALL_FORWARD_BACKWARD, "meshlm_forward_backward", b, loss, out, true);
}

int meshlm_eval_loss(meshlm_session *s, const meshlm_train_batch *b, const meshlm_loss *loss,
                     meshlm_step_result *out) {
  return loss_call(s, API_CALL_EVAL_LOSS, "meshlm_eval_loss", b, loss, out, false);
}

int meshlm_optimizer_step(meshlm_session *s, meshlm_step_result *out) {
  ML_TRY(api_enter(s, API_CALL_OPTIMIZER_STEP));
  int rc = out ? API_STRUCT_SIZE("meshlm_optimizer_step", meshlm_step_result, out->struct_size)
               : 0;
  if (api_agree(s, rc)) return -1;
  ml_step_result r = {0};
  if (ml_step_apply(&s->e, &s->set.step, s->steps, s->acc.skip[0] ? s->acc.skip : NULL, &r))
    api_abort(s);
  s->version += !r.skipped;
  s->steps++;
  if (out) {
    meshlm_step_result full;
    api_result_fill(&s->acc, &r, s->steps, &full);
    api_write_struct("meshlm_optimizer_step", "meshlm_step_result", out,
                     API_MIN(meshlm_step_result), sizeof full, &full);
  }
  s->acc = (api_acc){0};
  return 0;
}

/* meshlm plan: the attention heads over tp (plan_heads.h). */
#include "cli/plan_heads.h"

#include <inttypes.h>

#include "cli/cli.h"

bool ml_plan_heads_split(const ml_tp *tp, const ml_model *m) {
  return tp->size > 1 && m->cfg.n_layers > 0 &&
         ml_tp_param_dim(tp, m, m->layers[0].q_proj.weight) == 0;
}

/* Tp rank r's heads into *h; returns the parameters of the kv heads it
 * holds as copies (a lower rank owns them), over every layer: k_proj and
 * v_proj rows (and biases). */
static int64_t rank_heads(const ml_tp *tp, const ml_model *m, int r, ml_tp_heads *h) {
  ml_tp_heads_of(&m->cfg, tp->size, r, h);
  const ml_layer *L = &m->layers[0];
  int64_t per_row = L->k_proj.weight->shape[1] + (L->k_proj.bias ? 1 : 0);
  return (h->kv_own0 - h->kv0) * m->cfg.head_dim * per_row * 2 * m->cfg.n_layers;
}

void ml_plan_heads_text(const ml_tp *tp, const ml_model *m) {
  ml_cli_print("attention heads over tp=%d (query heads as torch.tensor_split; each rank holds "
               "the kv heads its query heads read):\n",
               tp->size);
  int64_t total = 0;
  for (int r = 0; r < tp->size; r++) {
    ml_tp_heads h;
    int64_t copies = rank_heads(tp, m, r, &h);
    total += copies;
    ml_cli_print("  tp%d: query heads %" PRId64 "-%" PRId64 " (%" PRId64 "), kv heads %" PRId64
                 "-%" PRId64 " (%" PRId64 ")",
                 r, h.q0, h.q0 + h.nq - 1, h.nq, h.kv0, h.kv0 + h.nkv - 1, h.nkv);
    if (copies) ml_cli_print(", %" PRId64 " of them copies", h.kv_own0 - h.kv0);
    ml_cli_print("\n");
  }
  if (tp->n_kv_shared == 0) return;
  ml_cli_print("  kv heads held by several tp ranks:");
  for (int j = 0; j < tp->n_kv_shared; j++) ml_cli_print(" %" PRId64, tp->kv_shared[j]);
  ml_cli_print("; their copies add %" PRId64 " parameters (%.2f MiB fp32) over the tp group, "
               "and their gradients an all-reduce over tp and over the FSDP group per "
               "micro-batch\n",
               total, (double)total * 4.0 / 1048576.0);
}

json_t *ml_plan_heads_json(const ml_tp *tp, const ml_model *m) {
  json_t *o = json_object(), *per = json_array(), *shared = json_array();
  if (!o || !per || !shared) {
    json_decref(o);
    json_decref(per);
    json_decref(shared);
    return NULL;
  }
  int64_t total = 0;
  for (int r = 0; r < tp->size; r++) {
    ml_tp_heads h;
    int64_t copies = rank_heads(tp, m, r, &h);
    total += copies;
    json_array_append_new(
        per, json_pack("{s:I, s:I, s:I, s:I, s:I, s:I}", "q0", (json_int_t)h.q0, "query_heads",
                       (json_int_t)h.nq, "kv0", (json_int_t)h.kv0, "kv_heads", (json_int_t)h.nkv,
                       "kv_owned", (json_int_t)(h.kv0 + h.nkv - h.kv_own0), "kv_copy_params",
                       (json_int_t)copies));
  }
  for (int j = 0; j < tp->n_kv_shared; j++)
    json_array_append_new(shared, json_integer(tp->kv_shared[j]));
  json_object_set_new(o, "per_tp_rank", per);
  json_object_set_new(o, "kv_shared", shared);
  json_object_set_new(o, "kv_copy_params", json_integer(total));
  json_object_set_new(o, "kv_copy_bytes_fp32", json_integer(total * 4));
  return o;
}

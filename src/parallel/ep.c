/* Expert parallelism's hooks (parallel/ep.h). */
#include "parallel/ep.h"

#include "common/status.h"

/* The counts: the group's host channel (host memory, blocking). */
static int ep_counts(void *ctx, const int64_t *send, int n, int64_t *recv) {
  return ml_host_all_to_all_i64(((const ml_mesh_group *)ctx)->host, send, n, recv);
}

/* The rows: the group's data comm, fp32. */
static int ep_rows(void *ctx, const float *send, const int64_t *send_counts, float *recv,
                   const int64_t *recv_counts) {
  return ml_all_to_all_v(((const ml_mesh_group *)ctx)->comm, send, send_counts, recv, recv_counts,
                         ML_ELEM_F32);
}

int ml_ep_apply(ml_model *m, const ml_mesh *mesh) {
  const ml_mesh_group *g = &mesh->groups[ML_GROUP_EP];
  int64_t E = m->cfg.n_experts;
  if (g->size <= 1) return 0;
  if (E == 0)
    return ml_err("--ep (ep_size) %d: %s has no mixture-of-experts layers (num_experts 0); "
                  "expected ep = 1, or a mixture-of-experts model (qwen3_moe, qwen2_moe, mixtral)",
                  g->size, m->cfg.family->architecture);
  if (E % g->size != 0)
    return ml_err("--ep (ep_size) %d: %s has %lld experts per layer, not a multiple of it; "
                  "expected ep dividing num_experts (each ep rank computes E / ep of them)",
                  g->size, m->cfg.family->architecture, (long long)E);
  m->moe_ep = (ml_moe_ep){.ranks = g->size, .rank = g->rank, .counts = ep_counts,
                          .rows = ep_rows, .ctx = (void *)g};
  return 0;
}

/* Whether p is one of linear l's parameters. */
static bool linear_has(const ml_linear *l, const ml_param *p) {
  return p && (l->weight == p || l->bias == p || l->lora_a == p || l->lora_b == p);
}

int64_t ml_ep_expert_of(const ml_model *m, const ml_param *p) {
  if (p->layer < 0 || !m->layers[p->layer].moe.experts) return -1;
  const ml_linear *ex = m->layers[p->layer].moe.experts;
  for (int64_t i = 0; i < 3 * m->cfg.n_experts; i++)
    if (linear_has(&ex[i], p)) return i / 3;
  return -1;
}

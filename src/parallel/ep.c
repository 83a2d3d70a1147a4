/* Expert parallelism's hooks (parallel/ep.h). */
#include "parallel/ep.h"

#include "common/status.h"
#include "parallel/redistribute.h"
#include "tensor/placement.h"

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

/* The Replicate rows [T, cols] from every tp rank's torch.chunk of them
 * (model.h ml_moe_ep.gather): this rank's chunk copied out and all-gathered
 * padded to the largest chunk (ml_all_gather_padded), each rank's block
 * copied back to its rows. T·cols is the size of a layer's saved [T, H]
 * buffer (int64, model.c's saturating sizes; tp <= 2^16), so the scratch,
 * (tp + 1) blocks of ceil(T / tp)·cols <= (2·T + tp + 1)·cols floats, fits
 * too (one float more: never a zero-size request). */
static int ep_gather(void *ctx, ml_backend *be, float *rows, int64_t T, int64_t cols) {
  const ml_mesh_group *g = ctx;
  int P = g->size;
  int64_t chunk = ml_chunk_size(T, P) * cols, t0, n;
  float *buf = ml_be_alloc(be, (P + 1) * chunk + 1, sizeof(float),
                           "the all-gather over tp of a sparse block's %lld rows", (long long)T);
  if (!buf) return -1;
  float *send = buf + P * chunk;
  const size_t f = sizeof(float);
  ml_chunk(T, P, g->rank, &t0, &n);
  int rc = ml_be_copy(be, send, rows + t0 * cols, f * (size_t)(n * cols), ML_COPY_D2D);
  if (!rc) rc = ml_all_gather_padded(be, g->comm, send, (size_t)(n * cols), (size_t)chunk, buf);
  for (int q = 0; !rc && q < P; q++) {
    ml_chunk(T, P, q, &t0, &n);
    rc = ml_be_copy(be, rows + t0 * cols, buf + q * chunk, f * (size_t)(n * cols), ML_COPY_D2D);
  }
  ml_be_free(be, buf);
  return rc;
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
  const ml_mesh_group *tp = &mesh->groups[ML_GROUP_TP];
  if (tp->size > 1) { /* each tp rank dispatches its chunk of the Replicate tokens */
    m->moe_ep.slices = tp->size;
    m->moe_ep.slice = tp->rank;
    m->moe_ep.gather = ep_gather;
    m->moe_ep.gather_ctx = (void *)tp;
  }
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

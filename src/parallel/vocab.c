/* Vocab parallelism over FSDP's group (vocab.h). */
#include "parallel/vocab.h"

#include <string.h>

#include "common/checked.h"
#include "common/status.h"

void ml_vocab_init(ml_vocab *v, ml_comm *comm, ml_backend *be) {
  memset(v, 0, sizeof *v);
  v->comm = comm;
  v->be = be;
}

void ml_vocab_destroy(ml_vocab *v) {
  if (v->be) {
    ml_be_free(v->be, v->ids);
    ml_be_free(v->be, v->work);
  }
  memset(v, 0, sizeof *v);
}

int ml_vocab_reserve(ml_vocab *v, int64_t T, int64_t hidden) {
  if (T <= v->cap && hidden <= v->hidden) return 0;
  ml_be_free(v->be, v->ids);
  ml_be_free(v->be, v->work);
  v->ids = NULL;
  v->work = NULL;
  v->cap = v->hidden = 0;
  /* ids and targets [d·T] each, send [2T], wire [d·2T]; then [2, d·T, hidden] floats; T and
   * hidden from the caller's batch and config: saturating */
  int64_t d = v->comm->size, dT = ml_mul_sat(d, T);
  v->ids = ml_be_alloc(v->be, ml_mul_sat(ml_add_sat(ml_mul_sat(4, d), 2), T), sizeof(int32_t),
                       "the token ids of the FSDP group (%lld tokens per rank x %lld ranks)",
                       (long long)T, (long long)d);
  if (!v->ids) return -1;
  v->work = ml_be_alloc(v->be, ml_mul_sat(ml_mul_sat(2, dT), hidden), sizeof(float),
                        "the activations of the FSDP group's tokens (%lld tokens per rank x %lld "
                        "ranks x hidden_size %lld, twice)",
                        (long long)T, (long long)d, (long long)hidden);
  if (!v->work) return -1;
  v->cap = T;
  v->hidden = hidden;
  return 0;
}

int ml_vocab_gather_tokens(ml_vocab *v, const int32_t *ids, const int32_t *targets, int64_t T) {
  if (T > v->cap)
    return ml_err("vocab parallelism: a batch of %lld tokens per rank, room for %lld; expected "
                  "ml_vocab_reserve first",
                  (long long)T, (long long)v->cap);
  int64_t d = v->comm->size;
  size_t w = sizeof(int32_t);
  // send: [ids | targets] (2T) → wire: [d, 2T] → ids, targets: [d, T] each
  v->targets = v->ids + d * T; /* the block (ml_vocab_reserve) laid out for this T */
  v->send = v->targets + d * T;
  v->wire = v->send + 2 * T;
  ML_TRY(ml_be_copy(v->be, v->send, ids, w * (size_t)T, ML_COPY_D2D));
  ML_TRY(ml_be_copy(v->be, v->send + T, targets, w * (size_t)T, ML_COPY_D2D));
  ML_TRY(ml_all_gather_t(v->comm, v->send, v->wire, (size_t)(2 * T), ML_ELEM_F32));
  ML_TRY(ml_be_copy2d(v->be, v->ids, w * (size_t)T, v->wire, 2 * w * (size_t)T, w * (size_t)T,
                      (size_t)d));
  ML_TRY(ml_be_copy2d(v->be, v->targets, w * (size_t)T, v->wire + T, 2 * w * (size_t)T,
                      w * (size_t)T, (size_t)d));
  v->T = T;
  return 0;
}

int ml_vocab_check(const ml_vocab *v, const ml_model *m, int64_t c) {
  if (m->B * m->S != v->T)
    return ml_err("vocab parallelism: the model runs a batch of %lld tokens per rank, but %lld "
                  "were gathered; expected ml_vocab_gather_tokens of the same batch first",
                  (long long)(m->B * m->S), (long long)v->T);
  if (c > v->hidden)
    return ml_err("vocab parallelism: %lld features per token, room for %lld", (long long)c,
                  (long long)v->hidden);
  return 0;
}

// x: [B, s_res, H] ← this rank's tokens' rows of the group's lookup
int ml_vocab_embed_forward(ml_vocab *v, ml_model *m, const ml_rows *w, float *x) {
  int64_t T = v->T, c = w->cols, d = v->comm->size;
  ML_TRY(ml_vocab_check(v, m, c));
  // work: [d·T, c] = scale · W[ids] for the ids in this rank's rows, else 0 (Partial)
  ML_TRY(ml_embed_lookup(m, v->ids, d * T, w, v->work));
  // x: [T, c] = sum over the group of its rows for this rank's tokens
  ML_TRY(ml_reduce_scatter(v->comm, v->work, x, (size_t)(T * c)));
  return ml_embed_edge_forward(m, x);  // x: [B, S, c] → [B, s_res, H]
}

// dx: [B, s_res, H] → w->grad (+=)
int ml_vocab_embed_backward(ml_vocab *v, ml_model *m, const ml_rows *w, float *dx) {
  int64_t T = v->T, c = w->cols, d = v->comm->size;
  ML_TRY(ml_vocab_check(v, m, c));
  ML_TRY(ml_embed_edge_backward(m, dx));  // dx: [B, S, c]
  // work: [d·T, c] = every rank's dx
  ML_TRY(ml_all_gather(v->comm, dx, v->work, (size_t)(T * c)));
  return ml_embed_lookup_backward(m, v->ids, d * T, v->work, w);
}

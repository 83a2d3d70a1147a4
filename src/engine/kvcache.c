/* The KV cache of generation: slots and the step's attention core (kvcache.h). */
#include "engine/kvcache.h"

#include "common/checked.h"
#include "common/status.h"

int ml_kv_pool_create(ml_kv_pool *p, ml_backend *be, const ml_model_config *c, int64_t nkv,
                      int64_t slots, int64_t cap) {
  *p = (ml_kv_pool){.be = be, .L = c->n_layers, .slots = slots, .cap = cap, .nkv = nkv,
                    .hd = c->head_dim, .half = c->head_dim / 2};
  int64_t seq = ml_mul_sat(ml_mul_sat(slots, cap), nkv * c->head_dim);
  p->mem = ml_be_alloc(be, ml_mul_sat(2 * c->n_layers, seq), sizeof(float),
                       "the KV cache (%lld layers x %lld sequence slots x %lld positions x %lld "
                       "kv heads x head_dim %lld, K and V)",
                       (long long)c->n_layers, (long long)slots, (long long)cap,
                       (long long)nkv, (long long)c->head_dim);
  p->rope = ml_be_alloc(be, ml_mul_sat(ml_mul_sat(4 * slots, cap), p->half), sizeof(float),
                        "the RoPE tables (%lld sequence slots x %lld positions x head_dim %lld)",
                        (long long)slots, (long long)cap, (long long)c->head_dim);
  return p->mem && p->rope ? 0 : -1;
}

void ml_kv_pool_destroy(ml_kv_pool *p) {
  ml_be_free(p->be, p->mem);
  ml_be_free(p->be, p->rope);
  p->mem = p->rope = NULL;
}

/* Slot s's table t (0 full cos, 1 full sin, 2 sliding cos, 3 sliding sin). */
static float *slot_table(const ml_kv_pool *p, int64_t s, int t) {
  return p->rope + ((s * 4 + t) * p->cap) * p->half;
}

int ml_kv_slot_rope(ml_kv_pool *p, const ml_model_config *c, int64_t s, int64_t P) {
  ML_TRY(ml_be_rope_tables(p->be, c->rope_theta, c->head_dim, &c->rope, P, p->cap,
                           slot_table(p, s, 0), slot_table(p, s, 1)));
  return ml_be_rope_tables(p->be, c->rope_local_theta, c->head_dim, &c->rope_local, P, p->cap,
                           slot_table(p, s, 2), slot_table(p, s, 3));
}

/* Layer l's keys (kv 0) or values (kv 1) of slot s: [cap][nkv·hd]. */
static float *slot_kv(const ml_kv_pool *p, int64_t l, int kv, int64_t s) {
  return p->mem + (((l * 2 + kv) * p->slots + s) * p->cap) * p->nkv * p->hd;
}

int ml_kv_copy_prefix(ml_kv_pool *p, int64_t from, int64_t to, int64_t n) {
  size_t bytes = sizeof(float) * (size_t)(n * p->nkv * p->hd);
  for (int64_t l = 0; l < p->L; l++)
    for (int kv = 0; kv < 2; kv++)
      ML_TRY(ml_be_copy(p->be, slot_kv(p, l, kv, to), slot_kv(p, l, kv, from), bytes,
                        ML_COPY_D2D));
  return ml_be_copy(p->be, slot_table(p, to, 0), slot_table(p, from, 0),
                    sizeof(float) * (size_t)(4 * p->cap * p->half), ML_COPY_D2D);
}

int ml_kv_gather_rope(const ml_kv_pool *p, float *dst, int64_t T) {
  size_t row = sizeof(float) * (size_t)p->half;
  for (int64_t i = 0; i < p->nseg; i++) {
    const ml_kv_seg *g = &p->seg[i];
    for (int t = 0; t < 4; t++)
      ML_TRY(ml_be_copy(p->be, dst + (t * T + g->t0) * p->half,
                        slot_table(p, g->slot, t) + g->pos * p->half, row * (size_t)g->n,
                        ML_COPY_D2D));
  }
  return 0;
}

static int64_t kv_saved(void *ctx, int64_t B, int64_t S, int64_t nh) {
  const ml_kv_pool *p = ctx;
  int64_t lse = ml_mul_sat(ml_mul_sat(B, S), nh), own = ml_be_attention_saved(p->be, B, S, nh);
  return lse > own ? lse : own;
}

/* The call against the pool and the segments. */
static int check_call(const ml_kv_pool *p, const ml_attn_call *c) {
  int64_t T = p->nseg ? p->seg[p->nseg - 1].t0 + p->seg[p->nseg - 1].n : 0;
  if (c->layer < 0 || c->layer >= p->L || c->B != 1 || c->S != T || c->nkv != p->nkv ||
      c->hd != p->hd)
    return ml_err("generate: layer %lld's attention of [%lld, %lld] tokens (%lld kv heads of "
                  "%lld) does not fit the step ([1, %lld] tokens) or the KV cache (%lld layers, "
                  "%lld kv heads of %lld)",
                  (long long)c->layer, (long long)c->B, (long long)c->S, (long long)c->nkv,
                  (long long)c->hd, (long long)T, (long long)p->L, (long long)p->nkv,
                  (long long)p->hd);
  for (int64_t i = 0; i < p->nseg; i++) {
    const ml_kv_seg *g = &p->seg[i];
    if (g->slot < 0 || g->slot >= p->slots || g->pos < 0 || g->n < 1 || g->pos + g->n > p->cap)
      return ml_err("generate: step segment %lld (slot %lld, positions %lld .. %lld) outside "
                    "the KV cache's %lld slots x %lld positions",
                    (long long)i, (long long)g->slot, (long long)g->pos,
                    (long long)(g->pos + g->n - 1), (long long)p->slots, (long long)p->cap);
  }
  return 0;
}

/* Segments i .. of one block attention call: a run of decode tokens (n =
 * 1) at one position in consecutive slots and consecutive tokens is one
 * call over B of them (q rows at pitch nh·hd, keys at the slots' pitch
 * cap·nkv·hd); any other segment is a call of its own. The kernel computes
 * each (sequence, head) of a call alone, so the run gives each sequence
 * what its own call gives; one call saves the per-call cost (a parallel
 * region) of every decode token of every layer. */
static int64_t run_of(const ml_kv_pool *p, int64_t i) {
  const ml_kv_seg *g = &p->seg[i];
  int64_t B = 1;
  while (g->n == 1 && i + B < p->nseg) {
    const ml_kv_seg *h = &p->seg[i + B];
    if (h->n != 1 || h->pos != g->pos || h->slot != g->slot + B || h->t0 != g->t0 + B) break;
    B++;
  }
  return B;
}

// q [1, T, nh, hd], k, v [1, T, nkv, hd]: each segment's k, v appended to its slot;
// out [1, T, nh·hd], lse [1, T, nh] = each segment's queries over its slot's keys
static int kv_fwd(void *ctx, const ml_attn_call *c, float *out, float *lse) {
  ml_kv_pool *p = ctx;
  ML_TRY(check_call(p, c));
  int64_t qr = c->nh * c->hd, kr = c->nkv * c->hd;
  for (int64_t i = 0; i < p->nseg; i++) {
    const ml_kv_seg *g = &p->seg[i];
    size_t bytes = sizeof(float) * (size_t)(g->n * kr);
    ML_TRY(ml_be_copy(p->be, slot_kv(p, c->layer, 0, g->slot) + g->pos * kr, c->k + g->t0 * kr,
                      bytes, ML_COPY_D2D));
    ML_TRY(ml_be_copy(p->be, slot_kv(p, c->layer, 1, g->slot) + g->pos * kr, c->v + g->t0 * kr,
                      bytes, ML_COPY_D2D));
  }
  for (int64_t i = 0, B; i < p->nseg; i += B) {
    const ml_kv_seg *g = &p->seg[i];
    B = run_of(p, i);
    ml_attn_block blk = {.B = B, .sq = g->n, .sk = g->pos + g->n, .nh = c->nh, .nkv = c->nkv,
                         .hd = c->hd, .q_pos = g->pos, .k_pos = 0, .q_bs = g->n * qr,
                         .k_bs = p->cap * kr, .l_bs = g->n * c->nh, .scale = c->scale,
                         .window = c->window, .group = c->group, .head_off = c->head_off};
    ML_TRY(ml_be_attention_block_fwd(p->be, &blk, c->q + g->t0 * qr,
                                     slot_kv(p, c->layer, 0, g->slot),
                                     slot_kv(p, c->layer, 1, g->slot), out + g->t0 * qr,
                                     lse + g->t0 * c->nh, false, c->compute));
  }
  return 0;
}

ml_attn_core ml_kv_core(ml_kv_pool *p) {
  return (ml_attn_core){.saved = kv_saved, .fwd = kv_fwd, .ctx = p};
}

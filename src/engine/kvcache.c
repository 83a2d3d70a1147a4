/* The KV cache of generation: paged blocks, block tables and the step's
 * attention core (kvcache.h). */
#include "engine/kvcache.h"

#include <stdlib.h>

#include "common/checked.h"
#include "common/status.h"

/* Elements of one block of one layer's keys (or values): positions x nkv·hd. */
static int64_t block_elems(const ml_kv_pool *p) { return ML_KV_BLOCK * p->nkv * p->hd; }
static size_t esz(const ml_kv_pool *p) { return p->bf16 ? sizeof(uint16_t) : sizeof(float); }

int64_t ml_kv_block_bytes(const ml_model_config *c, int64_t nkv, bool bf16) {
  int64_t e = ml_mul_sat(ml_mul_sat(2 * c->n_layers, ML_KV_BLOCK), ml_mul_sat(nkv, c->head_dim));
  return ml_mul_sat(e, bf16 ? 2 : 4);
}

int64_t ml_kv_blocks(int64_t positions) { return (positions + ML_KV_BLOCK - 1) / ML_KV_BLOCK; }

int ml_kv_pool_create(ml_kv_pool *p, ml_backend *be, const ml_model_config *c, int64_t nkv,
                      int64_t slots, int64_t cap, int64_t nblocks, bool bf16) {
  *p = (ml_kv_pool){.be = be, .L = c->n_layers, .slots = slots, .cap = cap, .nkv = nkv,
                    .hd = c->head_dim, .half = c->head_dim / 2, .nblocks = nblocks,
                    .maxb = ml_kv_blocks(cap), .bf16 = bf16};
  if (nblocks > INT32_MAX / ML_KV_BLOCK)
    return ml_err("generate: %lld KV blocks; expected at most %d (int32 row ids of %d-position "
                  "blocks)",
                  (long long)nblocks, INT32_MAX / ML_KV_BLOCK, ML_KV_BLOCK);
  int64_t per_layer = ml_mul_sat(nblocks, block_elems(p));
  p->mem = ml_be_alloc(be, ml_mul_sat(2 * c->n_layers, per_layer), esz(p),
                       "the KV cache (%lld layers x %lld blocks of %d positions x %lld kv heads "
                       "x head_dim %lld, K and V, %s)",
                       (long long)c->n_layers, (long long)nblocks, ML_KV_BLOCK, (long long)nkv,
                       (long long)c->head_dim, bf16 ? "bf16" : "fp32");
  int64_t entries = ml_mul_sat(slots, p->maxb);
  p->table = ml_be_alloc(be, entries, sizeof(int32_t),
                         "the KV cache's block tables (%lld sequence slots x %lld blocks)",
                         (long long)slots, (long long)p->maxb);
  p->host_table = ml_malloc_array(entries, sizeof(int32_t),
                                  "the KV cache's block tables (%lld sequence slots x %lld "
                                  "blocks)", (long long)slots, (long long)p->maxb);
  p->nb = ml_malloc_array(slots, sizeof(int64_t), "the block counts (%lld slots)",
                          (long long)slots);
  p->ref = ml_malloc_array(nblocks, sizeof(int32_t), "the blocks' counts (%lld blocks)",
                           (long long)nblocks);
  p->free_list = ml_malloc_array(nblocks, sizeof(int32_t), "the free blocks (%lld blocks)",
                                 (long long)nblocks);
  p->rope = ml_be_alloc(be, ml_mul_sat(ml_mul_sat(4 * slots, cap), p->half), sizeof(float),
                        "the RoPE tables (%lld sequence slots x %lld positions x head_dim %lld)",
                        (long long)slots, (long long)cap, (long long)c->head_dim);
  if (!p->mem || !p->table || !p->host_table || !p->nb || !p->ref || !p->free_list || !p->rope)
    return -1;
  for (int64_t s = 0; s < slots; s++) p->nb[s] = 0;
  for (int64_t b = 0; b < nblocks; b++) { /* a stack: block 0 on top */
    p->ref[b] = 0;
    p->free_list[b] = (int32_t)(nblocks - 1 - b);
  }
  p->nfree = nblocks;
  return 0;
}

void ml_kv_pool_destroy(ml_kv_pool *p) {
  ml_be_free(p->be, p->mem);
  ml_be_free(p->be, p->table);
  ml_be_free(p->be, p->rope);
  ml_be_free(p->be, p->rows);
  free(p->host_rows);
  p->rows = NULL, p->host_rows = NULL, p->rows_cap = 0;
  free(p->host_table);
  free(p->nb);
  free(p->ref);
  free(p->free_list);
  p->mem = NULL, p->table = NULL, p->rope = NULL, p->host_table = NULL, p->nb = NULL;
  p->ref = NULL, p->free_list = NULL;
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

/* Layer l's keys (kv 0) or values (kv 1) of block b: [ML_KV_BLOCK][nkv·hd]. */
static void *block_kv(const ml_kv_pool *p, int64_t l, int kv, int64_t b) {
  return (char *)p->mem + (size_t)(((l * 2 + kv) * p->nblocks + b) * block_elems(p)) * esz(p);
}

/* Block id appended to slot s's table (host and device). */
static int push_block(ml_kv_pool *p, int64_t s, int32_t b) {
  int64_t at = s * p->maxb + p->nb[s]++;
  p->host_table[at] = b;
  p->ref[b]++;
  return ml_be_copy(p->be, p->table + at, &p->host_table[at], sizeof(int32_t), ML_COPY_H2D);
}

/* A free block for slot s's next table entry (errors: none free, no entry left). */
static int take_block(ml_kv_pool *p, int64_t s, int32_t *b) {
  if (p->nb[s] >= p->maxb || p->nfree == 0)
    return ml_err("generate: slot %lld needs KV block %lld: %s (%lld blocks of %d positions, "
                  "cap %lld positions a sequence); expected the admission to have kept it one",
                  (long long)s, (long long)p->nb[s],
                  p->nb[s] >= p->maxb ? "beyond its cap" : "no free block",
                  (long long)p->nblocks, ML_KV_BLOCK, (long long)p->cap);
  *b = p->free_list[--p->nfree];
  return push_block(p, s, *b);
}

int ml_kv_reserve(ml_kv_pool *p, int64_t s, int64_t positions, int64_t *taken) {
  int64_t need = ml_kv_blocks(positions), n = 0;
  for (int32_t b; p->nb[s] < need; n++) ML_TRY(take_block(p, s, &b));
  if (taken) *taken = n;
  return 0;
}

int ml_kv_fork(ml_kv_pool *p, int64_t from, int64_t to, int64_t n, int64_t *taken) {
  int64_t full = n / ML_KV_BLOCK;
  for (int64_t i = 0; i < full; i++) ML_TRY(push_block(p, to, p->host_table[from * p->maxb + i]));
  *taken = 0;
  if (n % ML_KV_BLOCK) {
    int32_t src = p->host_table[from * p->maxb + full], dst = -1;
    ML_TRY(take_block(p, to, &dst));
    *taken = 1;
    size_t bytes = (size_t)((n % ML_KV_BLOCK) * p->nkv * p->hd) * esz(p);
    for (int64_t l = 0; l < p->L; l++)
      for (int kv = 0; kv < 2; kv++)
        ML_TRY(ml_be_copy(p->be, block_kv(p, l, kv, dst), block_kv(p, l, kv, src), bytes,
                          ML_COPY_D2D));
  }
  return ml_be_copy(p->be, slot_table(p, to, 0), slot_table(p, from, 0),
                    sizeof(float) * (size_t)(4 * p->cap * p->half), ML_COPY_D2D);
}

int64_t ml_kv_release(ml_kv_pool *p, int64_t s) {
  int64_t freed = 0;
  for (int64_t i = 0; i < p->nb[s]; i++) {
    int32_t b = p->host_table[s * p->maxb + i];
    if (--p->ref[b] == 0) p->free_list[p->nfree++] = b, freed++;
  }
  p->nb[s] = 0;
  return freed;
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
  if (p->bf16 && c->compute != ML_BF16)
    return ml_err("generate: layer %lld's attention computes in %s over a bf16 KV cache; "
                  "expected BF16 products (the cache is bf16 where param_dtype is)",
                  (long long)c->layer, ml_dtype_name(c->compute));
  for (int64_t i = 0; i < p->nseg; i++) {
    const ml_kv_seg *g = &p->seg[i];
    if (g->slot < 0 || g->slot >= p->slots || g->pos < 0 || g->n < 1 ||
        g->pos + g->n > p->nb[g->slot] * ML_KV_BLOCK)
      return ml_err("generate: step segment %lld (slot %lld, positions %lld .. %lld) outside "
                    "the KV cache's %lld slots or its slot's %lld blocks of %d positions",
                    (long long)i, (long long)g->slot, (long long)g->pos,
                    (long long)(g->pos + g->n - 1), (long long)p->slots,
                    (long long)(g->slot >= 0 && g->slot < p->slots ? p->nb[g->slot] : 0),
                    ML_KV_BLOCK);
  }
  return 0;
}

/* Segments i .. of one block attention call: a run of decode tokens (n =
 * 1) at one position in consecutive slots and consecutive tokens is one
 * call over B of them (q rows at pitch nh·hd, block tables at maxb
 * entries); any other segment is a call of its own. The kernel computes
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

/* The step's rows (ml_kv_pool.rows) for its T tokens: token t0 + j of
 * segment g goes to position pos + j of its slot, row table[pos / block] ·
 * block + pos % block of the layer's blocks; copied to the device once a
 * step, for every layer's appends. */
static int step_rows(ml_kv_pool *p, int64_t T) {
  if (T > p->rows_cap) {
    ml_be_free(p->be, p->rows);
    free(p->host_rows);
    p->rows_cap = 0;
    p->rows = ml_be_alloc(p->be, T, sizeof(int32_t), "the KV cache's step rows (%lld tokens)",
                          (long long)T);
    p->host_rows = ml_malloc_array(T, sizeof(int32_t), "the KV cache's step rows (%lld tokens)",
                                   (long long)T);
    if (!p->rows || !p->host_rows) return -1;
    p->rows_cap = T;
  }
  for (int64_t i = 0; i < p->nseg; i++) {
    const ml_kv_seg *g = &p->seg[i];
    for (int64_t j = 0; j < g->n; j++) {
      int64_t pos = g->pos + j;
      p->host_rows[g->t0 + j] =
          p->host_table[g->slot * p->maxb + pos / ML_KV_BLOCK] * ML_KV_BLOCK + pos % ML_KV_BLOCK;
    }
  }
  return ml_be_copy(p->be, p->rows, p->host_rows, sizeof(int32_t) * (size_t)T, ML_COPY_H2D);
}

// q [1, T, nh, hd], k, v [1, T, nkv, hd]: each segment's k, v appended to its slot's blocks;
// out [1, T, nh·hd], lse [1, T, nh] = each segment's queries over its slot's keys
static int kv_fwd(void *ctx, const ml_attn_call *c, float *out, float *lse) {
  ml_kv_pool *p = ctx;
  ML_TRY(check_call(p, c));
  int64_t qr = c->nh * c->hd, kr = c->nkv * c->hd, T = c->S;
  /* the step's k, v rows into their blocks (in the pool's dtype: bf16 rounded to nearest-even);
   * the forward runs the layers in order, so layer 0 sets the step's rows for all */
  if (c->layer == 0) ML_TRY(step_rows(p, T));
  ml_dtype dt = p->bf16 ? ML_BF16 : ML_F32;
  ML_TRY(ml_be_scatter_rows(p->be, block_kv(p, c->layer, 0, 0), dt, p->rows, c->k, T, kr));
  ML_TRY(ml_be_scatter_rows(p->be, block_kv(p, c->layer, 1, 0), dt, p->rows, c->v, T, kr));
  for (int64_t i = 0, B; i < p->nseg; i += B) {
    const ml_kv_seg *g = &p->seg[i];
    B = run_of(p, i);
    ml_attn_block blk = {.B = B, .sq = g->n, .sk = g->pos + g->n, .nh = c->nh, .nkv = c->nkv,
                         .hd = c->hd, .q_pos = g->pos, .k_pos = 0, .q_bs = g->n * qr,
                         .l_bs = g->n * c->nh, .scale = c->scale, .window = c->window,
                         .group = c->group, .head_off = c->head_off,
                         .kv_table = p->table + g->slot * p->maxb, .kv_block = ML_KV_BLOCK,
                         .table_bs = p->maxb, .kv_bf16 = p->bf16};
    ML_TRY(ml_be_attention_block_fwd(p->be, &blk, c->q + g->t0 * qr,
                                     block_kv(p, c->layer, 0, 0), block_kv(p, c->layer, 1, 0),
                                     out + g->t0 * qr, lse + g->t0 * c->nh, false, c->compute));
  }
  return 0;
}

ml_attn_core ml_kv_core(ml_kv_pool *p) {
  return (ml_attn_core){.saved = kv_saved, .fwd = kv_fwd, .ctx = p};
}

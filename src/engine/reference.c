/* The reference policy's weights (reference.h). */
#include "engine/reference.h"

#include <stdlib.h>

#include "common/status.h"

size_t ml_engine_reference_unit_bytes(const ml_fsdp *f, const ml_fsdp_unit *unit) {
  return (ml_fsdp_bf16_weights(f, unit) ? sizeof(uint16_t) : sizeof(float)) *
         (size_t)unit->shard_numel;
}

/* Unit u's reference buffer: bf16 on the device where the unit computes
 * from bf16 weights (ml_fsdp_bf16_weights), else fp32 where the shards live. */
static void *ref_alloc(ml_fsdp *f, int u) {
  const ml_fsdp_unit *unit = &f->units[u];
  if (ml_fsdp_bf16_weights(f, unit))
    return ml_be_alloc(f->be, unit->shard_numel, sizeof(uint16_t),
                       "the reference policy's bf16 weights of FSDP unit %d", u);
  return ml_fsdp_shard_alloc(f, unit->shard_numel, sizeof(float),
                             "the reference policy's shard of FSDP unit %d", u);
}

static void ref_free(ml_fsdp *f, int u, void *p) {
  if (ml_fsdp_bf16_weights(f, &f->units[u])) ml_be_free(f->be, p);
  else ml_fsdp_shard_free(f, p);
}

/* Unit u's current weights into its reference buffer: the fp32 shard as it
 * is, or the bf16 weights the unit's unshard gathers — its bf16 shard where
 * that is current (lp_fresh: the inference-only weights, or kept by AdamW),
 * else the fp32 shard rounded as the unshard rounds it (the backend's
 * conversion, parallel/fsdp.c lp_refresh), so the same bits. */
static int ref_capture(ml_fsdp *f, int u, void *ref) {
  const ml_fsdp_unit *unit = &f->units[u];
  size_t n = (size_t)unit->shard_numel;
  if (!ml_fsdp_bf16_weights(f, unit)) /* shard to shard, on the backend computing there */
    return ml_be_copy(f->shard_be, ref, unit->shard, sizeof(float) * n, ML_COPY_D2D);
  if (unit->lp && unit->lp_fresh)
    return ml_be_copy(f->be, ref, unit->lp, sizeof(uint16_t) * n, ML_COPY_D2D);
  return ml_be_convert(f->be, ref, ML_BF16, unit->shard, ML_F32, n);
}

int ml_engine_reference_set(ml_engine *e) {
  ml_fsdp *f = &e->fsdp;
  if (e->ref_swapped)
    return ml_err("the reference policy cannot be captured while it is swapped in");
  if (!e->ref) {
    e->ref = ml_calloc((size_t)f->n_units, sizeof *e->ref, "the reference policy's weights");
    if (!e->ref) return -1;
    for (int u = 0; u < f->n_units; u++)
      if (!(e->ref[u] = ref_alloc(f, u))) {
        ml_engine_reference_free(e);
        return -1;
      }
  }
  for (int u = 0; u < f->n_units; u++) ML_TRY(ref_capture(f, u, e->ref[u]));
  ML_TRY(ml_be_sync(f->be));
  return ml_be_sync(f->shard_be);
}

bool ml_engine_has_reference(const ml_engine *e) { return e->ref != NULL; }

int ml_engine_reference_swap(ml_engine *e) {
  if (!e->ref)
    return ml_err("no reference policy: capture one first (meshlm_set_reference, "
                  "Policy.set_reference or Policy(reference=True))");
  ML_TRY(ml_fsdp_swap_weights(&e->fsdp, e->ref, !e->ref_swapped, true));
  e->ref_swapped = !e->ref_swapped;
  return 0;
}

void ml_engine_reference_free(ml_engine *e) {
  if (!e->ref) return;
  if (e->ref_swapped) /* the policy's weights back, locally (a teardown: no re-gather) */
    ml_fsdp_swap_weights(&e->fsdp, e->ref, false, false);
  e->ref_swapped = false;
  for (int u = 0; u < e->fsdp.n_units; u++) ref_free(&e->fsdp, u, e->ref[u]);
  free(e->ref);
  e->ref = NULL;
}

size_t ml_engine_reference_bytes(const ml_engine *e) {
  size_t n = 0;
  for (int u = 0; e->ref && u < e->fsdp.n_units; u++)
    n += ml_engine_reference_unit_bytes(&e->fsdp, &e->fsdp.units[u]);
  return n;
}

/* The vocab-parallel parameters whole for a generation call (gen_vocab.h). */
#include "engine/gen_vocab.h"

#include "common/checked.h"
#include "common/status.h"

static int64_t numel(const ml_param *p) { return p->local[0] * p->local[1]; }

/* The unit's every parameter unsharded in fp32 into full (ml_fsdp_gather_flat):
 * from its fp32 shard, or an inference-only unit's bf16 shard widened (exact;
 * parallel/fsdp.h lp_only), so the rounding below gives its bits back. */
static int gather_unit(ml_fsdp *f, ml_fsdp_unit *unit, float *full) {
  int u = (int)(unit - f->units);
  if (!unit->lp_only) return ml_fsdp_gather_flat(f, u, unit->shard, full);
  float *wide = ml_be_alloc(f->be, unit->shard_numel, sizeof(float),
                            "generate: the vocab-parallel unit's bf16 shard widened");
  if (!wide) return -1;
  int rc = ml_be_convert(f->be, wide, ML_F32, unit->lp, ML_BF16, (size_t)unit->shard_numel);
  if (rc == 0) rc = ml_fsdp_gather_flat(f, u, wide, full);
  ml_be_free(f->be, wide);
  return rc;
}

int ml_gen_vocab_whole(ml_fsdp *f, ml_gen_vocab *v) {
  *v = (ml_gen_vocab){0};
  if (!f->vocab_parallel) return 0;
  for (int u = 0; u < f->n_units && !v->unit; u++)
    for (int i = 0; i < f->units[u].n; i++)
      if (f->units[u].vocab[i]) v->unit = &f->units[u];
  if (!v->unit) return 0;
  ml_fsdp_unit *unit = v->unit;
  v->full = ml_be_alloc(f->be, unit->full_numel, sizeof(float),
                        "generate: the vocab-parallel unit unsharded (%lld floats)",
                        (long long)unit->full_numel);
  if (!v->full) return -1;
  ML_TRY(gather_unit(f, unit, v->full));
  ml_dtype pt = f->opts.param_dtype;
  int64_t total = 0; /* the vocab-parallel parameters' elements, laid out one after another */
  for (int i = 0; i < unit->n; i++)
    if (unit->vocab[i] && !unit->params[i]->fp32) total = ml_add_sat(total, numel(unit->params[i]));
  if (pt != ML_F32 && total > 0) {
    v->cast = ml_be_alloc(f->be, total, ml_dtype_size(pt),
                          "generate: the vocab-parallel parameters in %s (%lld elements)",
                          ml_dtype_name(pt), (long long)total);
    if (!v->cast) return -1;
  }
  int64_t at = 0;
  for (int i = 0; i < unit->n; i++) {
    if (!unit->vocab[i]) continue;
    ml_param *p = unit->params[i];
    float *whole = v->full + unit->full_off[i];
    if (pt == ML_F32 || p->fp32) { /* kept in fp32 (engine/fp32_params.h): as it is */
      p->data = whole;
      continue;
    }
    void *dst = (char *)v->cast + ml_dtype_size(pt) * (size_t)at;
    ML_TRY(ml_be_convert(f->be, dst, pt, whole, ML_F32, (size_t)numel(p)));
    p->data = dst;
    at += numel(p);
  }
  return 0;
}

void ml_gen_vocab_release(ml_fsdp *f, ml_gen_vocab *v) {
  for (int i = 0; v->unit && i < v->unit->n; i++)
    if (v->unit->vocab[i]) v->unit->params[i]->data = NULL;
  ml_be_free(f->be, v->full);
  ml_be_free(f->be, v->cast);
  *v = (ml_gen_vocab){0};
}

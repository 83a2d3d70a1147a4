#include "train/save.h"

#include <stdlib.h>

#include "common/status.h"
#include "io/checkpoint.h"
#include "parallel/redistribute.h"
#include "parallel/tp.h"

enum { NAME_CAP = sizeof ((ml_param *)0)->name }; /* exported tensor names */

/* The global tensor of p (Shard on `dim` over tp, −1: Replicate) from the
 * tp group's local tensors `local` [p->local] (device memory) into `out`
 * [p->shape] (host memory) on every rank: one padded all-gather of the
 * torch.chunk pieces (ml_all_gather_padded), unpadded into place on the
 * device (Shard(1) pieces as strided column blocks, ml_be_copy2d), then
 * copied to the host. */
static int gather_tp(ml_backend *be, ml_comm *tp, const ml_param *p, int dim, const float *local,
                     float *out) {
  const size_t f = sizeof(float);
  int64_t numel = p->shape[0] * p->shape[1];
  if (dim < 0 || tp->size == 1) return ml_be_copy(be, out, local, f * (size_t)numel, ML_COPY_D2H);
  int64_t other = p->shape[1 - dim], n = ml_param_numel(p);
  int64_t chunk = ml_chunk_size(p->shape[dim], tp->size) * other;
  /* device: send [chunk] | pieces [tp · chunk] | the global tensor [numel] */
  float *send = ml_be_alloc(be, (1 + tp->size) * chunk + numel, f, "the export of '%s'", p->name);
  if (!send) return -1;
  float *pieces = send + chunk, *global = pieces + tp->size * chunk;
  int rc = ml_be_copy(be, send, local, f * (size_t)n, ML_COPY_D2D);
  if (rc == 0) rc = ml_all_gather_padded(be, tp, send, (size_t)n, (size_t)chunk, pieces);
  for (int r = 0; rc == 0 && r < tp->size; r++) {
    int64_t s, len;
    ml_chunk(p->shape[dim], tp->size, r, &s, &len);
    const float *piece = pieces + r * chunk;
    if (dim == 0) /* rows s .. s+len−1 */
      rc = ml_be_copy(be, global + s * other, piece, f * (size_t)(len * other), ML_COPY_D2D);
    else /* columns s .. s+len−1 of every row */
      rc = ml_be_copy2d(be, global + s, f * (size_t)p->shape[1], piece, f * (size_t)len,
                        f * (size_t)len, (size_t)p->shape[0]);
  }
  if (rc == 0) rc = ml_be_copy(be, out, global, f * (size_t)numel, ML_COPY_D2H);
  ml_be_free(be, send);
  return rc;
}

const ml_param *ml_engine_export_param(const ml_engine *e, int i) {
  for (int u = 0; u < e->fsdp.n_units; u++) {
    if (i < e->fsdp.units[u].n) return e->fsdp.units[u].params[i];
    i -= e->fsdp.units[u].n;
  }
  return NULL;
}

/* The flat per-rank array of unit holding `what`. */
static const float *unit_array(const ml_fsdp_unit *unit, ml_export_what what) {
  switch (what) {
  case ML_EXPORT_GRADS: return unit->shard_grad;
  case ML_EXPORT_EXP_AVG: return unit->adam_m;
  case ML_EXPORT_EXP_AVG_SQ: return unit->adam_v;
  case ML_EXPORT_PARAMS: break;
  }
  return unit->shard;
}

int ml_engine_export(ml_engine *e, ml_export_what what, float **out) {
  ml_comm *tp = ml_mesh_comm(e->mesh, ML_GROUP_TP);
  int n = 0;
  for (int u = 0; u < e->fsdp.n_units; u++) {
    ml_fsdp_unit *unit = &e->fsdp.units[u];
    float *full = ml_be_alloc(e->be, unit->full_numel, sizeof(float), "the export of a unit");
    if (!full) return -1;
    int rc = ml_fsdp_gather_flat(&e->fsdp, u, unit_array(unit, what), full);
    for (int i = 0; rc == 0 && i < unit->n; i++, n++) {
      const ml_param *p = unit->params[i];
      out[n] = ml_be_host_alloc(e->be, p->shape[0] * p->shape[1], sizeof(float),
                                "the export of '%s'", p->name);
      rc = out[n] ? gather_tp(e->be, tp, p, ml_tp_param_dim(&e->tp, &e->model, p),
                              full + unit->full_off[i], out[n])
                  : -1;
    }
    ml_be_free(e->be, full);
    ML_TRY(rc);
  }
  return 0;
}

int ml_hf_write(const char *dir, const ml_model_config *cfg, const ml_param *const *params,
                float *const *tensors, int n, size_t max_shard_bytes) {
  ML_TRY(ml_ckpt_make_dirs(dir));
  ml_model_config saved = *cfg;
  saved.family = ml_family_saved(cfg->family);
  saved.dtype = ML_F32;
  ML_TRY(ml_model_config_write(dir, &saved));
  ml_st_entry *entries = ml_calloc((size_t)n, sizeof *entries, "export entries");
  char(*names)[NAME_CAP] = ml_calloc((size_t)n, sizeof *names, "export names");
  int rc = entries && names ? 0 : -1;
  for (int i = 0; rc == 0 && i < n; i++) {
    const ml_param *p = params[i];
    rc = ml_family_rename(cfg->family, saved.family, p->name, names[i], sizeof names[i]);
    entries[i] = (ml_st_entry){names[i], ML_F32, p->ndim, {p->shape[0], p->shape[1]}, tensors[i]};
  }
  if (rc == 0) rc = ml_ckpt_write(dir, entries, (size_t)n, max_shard_bytes);
  free(entries);
  free(names);
  return rc;
}

int ml_engine_save_hf(ml_engine *e, const char *dir) {
  int n = e->model.n_params;
  float **tensors = ml_calloc((size_t)n, sizeof *tensors, "export tensors");
  const ml_param **params = ml_calloc((size_t)n, sizeof *params, "export params");
  int rc = tensors && params ? ml_engine_export(e, ML_EXPORT_PARAMS, tensors) : -1;
  for (int i = 0; rc == 0 && i < n; i++) params[i] = ml_engine_export_param(e, i);
  if (rc == 0 && e->mesh->rank == 0)
    rc = ml_hf_write(dir, &e->model.cfg, params, tensors, n, ML_HF_MAX_SHARD_BYTES);
  for (int i = 0; tensors && i < n; i++) ml_be_host_free(e->be, tensors[i]);
  free(tensors);
  free(params);
  return ml_host_agree(ml_mesh_host(e->mesh, ML_GROUP_WORLD), rc);
}

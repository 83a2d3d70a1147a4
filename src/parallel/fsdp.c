#include "parallel/fsdp.h"

#include <stdlib.h>
#include <string.h>

#include "comm/comm_null.h"
#include "common/status.h"
#include "parallel/ep.h"
#include "parallel/fsdp_impl.h"

void ml_fsdp_param_rows(const ml_fsdp *f, const ml_fsdp_unit *unit, int i, int64_t *r0,
                        int64_t *nr) {
  int64_t rows = unit->params[i]->local[0], c = unit->chunk_rows[i];
  int64_t s = c * unit->dp->rank;
  *r0 = s < rows ? s : rows;
  *nr = (s + c < rows ? s + c : rows) - *r0;
}

int ml_fsdp_unit_of(const ml_model *m, const ml_param *p) {
  return p->layer >= 0 ? p->layer : (int)m->cfg.n_layers;
}

int ml_fsdp_unit_params(const ml_model *m, int u, ml_param **out) {
  int n = 0;
  for (int i = 0; i < m->n_params; i++)
    if (ml_fsdp_unit_of(m, &m->params[i]) == u) out[n++] = &m->params[i];
  return n;
}

bool ml_fsdp_find(const ml_fsdp *f, const ml_param *p, int *u, int *i) {
  int k = (int)(p - f->params);
  if (!f->held_unit || f->held_unit[k] < 0) return false;
  *u = f->held_unit[k];
  *i = f->held_index[k];
  return true;
}

int ml_fsdp_param_index(const ml_fsdp_unit *unit, const ml_param *p) {
  for (int i = 0; i < unit->n; i++)
    if (unit->params[i] == p) return i;
  return -1;
}

bool ml_fsdp_reshard_after_forward(ml_reshard_policy policy, int u, int n_units) {
  if (u == n_units - 1) return false; /* the root: its head runs forward and backward per chunk */
  if (policy != ML_RESHARD_DEFAULT) return policy == ML_RESHARD_ALWAYS;
  return u < n_units - 2;
}

/* The unit's flat-shard layout: per parameter its chunk of ceil(local[0]
 * / u->dp) rows, the param_dtype ones first, then those kept in fp32 (the fp32
 * part: ml_param.fp32 under a bf16 param_dtype), then the vocab-parallel
 * ones, so that what is gathered and reduced is the shard's leading part.
 * Plain int64 sums: the parameters come from a config that passed
 * ml_model_config_load's limits (config.h), so a unit holds < 2^47
 * elements, and its padded shard c·cols summed over the unit is at most
 * that / dp + (its columns, < 2^30). */
static int unit_layout(ml_fsdp *f, ml_fsdp_unit *u, const ml_model *m) {
  u->chunk_rows = ml_calloc((size_t)u->n * 3, sizeof(int64_t), "fsdp layout");
  u->vocab = ml_calloc((size_t)u->n * 2, sizeof(bool), "fsdp layout");
  if (!u->chunk_rows || !u->vocab) return -1;
  u->shard_off = u->chunk_rows + u->n;
  u->full_off = u->shard_off + u->n;
  u->f32 = u->vocab + u->n;
  for (int i = 0; i < u->n; i++) {
    u->vocab[i] = f->vocab_parallel &&
                  (u->params[i] == m->embed_tokens.weight || u->params[i] == m->lm_head.weight);
    u->f32[i] = !u->vocab[i] && fsdp_param_dtype_of(f, u->params[i]) != f->opts.param_dtype;
  }
  int64_t shard = 0, full = 0, lo = 0, lo_full = 0;
  /* param_dtype gathered parameters, fp32 ones, then vocab-parallel ones; each trainable
   * first, then frozen */
  for (int pass = 0; pass < 6; pass++) {
    for (int i = 0; i < u->n; i++) {
      const ml_param *p = u->params[i];
      int part = u->vocab[i] ? 2 : u->f32[i] ? 1 : 0;
      if (part != pass / 2 || p->frozen != (pass % 2 == 1)) continue;
      int64_t c = (p->local[0] + u->dp->size - 1) / u->dp->size;
      u->chunk_rows[i] = c;
      u->shard_off[i] = shard;
      u->full_off[i] = full;
      shard += c * p->local[1];
      full += ml_param_numel(p);
      if (!p->frozen) {
        u->grad_numel = shard;
        if (part < 2) u->grad_full = full;
      }
    }
    if (pass == 1) {
      lo = shard;
      lo_full = full;
    }
    if (pass == 3) {
      u->gather_numel = shard;
      u->gather_full = full;
      u->f32_numel = shard - lo;
      u->f32_full = full - lo_full;
    }
  }
  u->shard_numel = shard;
  u->full_numel = full;
  return 0;
}

void ml_fsdp_shard_free(const ml_fsdp *f, void *p) {
  if (fsdp_offload(f)) ml_be_host_free(f->be, p);
  else ml_be_free(f->be, p);
}
ml_copy_kind ml_fsdp_shard_to_device(const ml_fsdp *f) {
  return fsdp_offload(f) ? ML_COPY_H2D : ML_COPY_D2D;
}
ml_copy_kind ml_fsdp_device_to_shard(const ml_fsdp *f) {
  return fsdp_offload(f) ? ML_COPY_D2H : ML_COPY_D2D;
}

/* An lp_only unit's parameter i (fsdp.h) on a device whose memory is not
 * the host's: its n staged fp32 values (host) copied to the device and
 * rounded into its chunk of the bf16 shard by the backend's conversion, the
 * one an unshard of the fp32 shard runs (gather_start), so the same bits as
 * ml_st_read_block_to's rounding on the host (both ml_f32_to_bf16). */
static int load_rounded(ml_fsdp *f, ml_fsdp_unit *u, int i, const float *stage, int64_t n) {
  uint16_t *dst = u->lp + u->shard_off[i];
  float *dev = ml_be_alloc(f->be, n, sizeof(float), "loading '%s' into its bf16 shard",
                           u->params[i]->name);
  if (!dev) return -1;
  int rc = ml_be_copy(f->be, dev, stage, sizeof(float) * (size_t)n, ML_COPY_H2D);
  if (rc == 0) rc = ml_be_convert(f->be, dst, ML_BF16, dev, ML_F32, (size_t)n);
  ml_be_free(f->be, dev);
  return rc;
}

/* Rows row0 .. row0+nr−1 of t, just read, leave this process's resident set
 * where t lies in one of ck's mapped files (ml_st_release; the mapping
 * stays): a checkpoint read parameter by parameter then holds about one
 * parameter of it at a time, not the whole file on top of the shards
 * (issue 30: the load was the process's peak RSS). Tensors in memory (a
 * ckpt over tensors the caller built: LoRA's initialisation, the library's
 * weight updates) are left alone. */
static void release_rows(const ml_ckpt *ck, const ml_st_tensor *t, int64_t row0, int64_t nr) {
  for (size_t k = 0; k < ck->nfiles; k++) {
    const ml_st_file *f = &ck->files[k];
    const uint8_t *map = f->map;
    if (!map || t->data < map || t->data >= map + f->map_size) continue;
    size_t row_bytes = (size_t)(t->ndim == 2 ? t->shape[1] : 1) * ml_dtype_size(t->dtype);
    ml_st_release(t->data + (size_t)row0 * row_bytes, (size_t)nr * row_bytes);
    return;
  }
}

/* Read this rank's rows of p's TP-local tensor from the checkpoint (p's
 * rows of its tensor p->key: ml_param.key_row0) into its chunk of the
 * shard: the unit's nr·cols first elements of the chunk (the rest, rows
 * past the tensor's end, are padding: zero_unloaded). Where the shard is
 * host memory, straight into it (fp32, or for an lp_only unit bf16 rounded
 * as ml_be_convert would: ml_st_read_block_to); else through host staging
 * and a copy to the device. */
static int load_param(ml_fsdp *f, ml_fsdp_unit *u, int i, const ml_ckpt *ck) {
  const ml_param *p = u->params[i];
  const ml_st_tensor *t = ml_ckpt_find(ck, p->key);
  if (!t) return ml_err("%s: checkpoint has no tensor '%s'", ck->dir, p->key);
  const int64_t want[2] = {p->key_rows, p->shape[1]}; /* p's tensor: key_rows rows */
  if (t->ndim != p->ndim || t->shape[0] != want[0] || (p->ndim == 2 && t->shape[1] != want[1])) {
    char got_s[ML_ST_SHAPE_CAP], want_s[ML_ST_SHAPE_CAP];
    ml_st_shape_str(got_s, sizeof got_s, t->ndim, t->shape);
    ml_st_shape_str(want_s, sizeof want_s, p->ndim, want);
    return ml_err("%s: tensor '%s' has shape %s; expected %s from config.json", ck->dir, p->key,
                  got_s, want_s);
  }
  int64_t r0, nr;
  ml_fsdp_param_rows(f, u, i, &r0, &nr);
  if (nr == 0) return 0;
  if (!u->lp_only) u->lp_fresh = false; /* the master changes (or may, on a failed read) */
  /* in the checkpoint's tensor */
  int64_t row0 = p->key_row0 + p->offset[0] + r0, col0 = p->offset[1], cols = p->local[1];
  int64_t n = nr * cols; /* rows of a parameter's chunk: bounded (unit_layout) */
  if (u->lp_only ? ml_be_host_memory(f->be) : ml_be_host_memory(f->shard_be)) {
    void *dst = u->lp_only ? (void *)(u->lp + u->shard_off[i])
                           : (void *)(u->shard + u->shard_off[i]);
    int rc = ml_st_read_block_to(t, row0, nr, col0, cols, dst, u->lp_only ? ML_BF16 : ML_F32);
    release_rows(ck, t, row0, nr);
    return rc;
  }
  float *stage = ml_be_host_alloc(f->be, n, sizeof(float), "loading '%s'", p->name);
  if (!stage) return -1;
  int rc = ml_st_read_block(t, row0, nr, col0, cols, stage);
  release_rows(ck, t, row0, nr);
  if (rc == 0)
    rc = u->lp_only ? load_rounded(f, u, i, stage, n)
                    : ml_be_copy(f->shard_be, u->shard + u->shard_off[i], stage,
                                 sizeof(float) * (size_t)n, ML_COPY_H2D);
  ml_be_host_free(f->be, stage);
  return rc;
}

int ml_fsdp_load(ml_fsdp *f, const ml_ckpt *ck, bool all) {
  for (int u = 0; u < f->n_units; u++)
    for (int i = 0; i < f->units[u].n; i++)
      if (all || ml_ckpt_find(ck, f->units[u].params[i]->key))
        ML_TRY(load_param(f, &f->units[u], i, ck));
  return 0;
}

/* Point the unit's gathered parameters at their places in `base`, the
 * unsharded buffer of `type` (NULL: not materialised), those of the fp32
 * part in full32; the vocab-parallel ones are never whole (NULL). */
static void point_data(ml_fsdp_unit *u, void *base, ml_dtype type) {
  for (int i = 0; i < u->n; i++) {
    ml_param *p = u->params[i];
    bool at = base && !u->vocab[i];
    if (u->f32[i] || (u->vocab[i] && p->fp32)) {
      p->data = at ? u->full32 + (u->full_off[i] - fsdp_lo_full(u)) : NULL;
      p->dtype = ML_F32;
      continue;
    }
    p->data = at ? (char *)base + ml_dtype_size(type) * (size_t)u->full_off[i] : NULL;
    p->dtype = type;
  }
}

bool ml_fsdp_bf16_weights(const ml_fsdp *f, const ml_fsdp_unit *u) {
  if (f->opts.param_dtype != ML_BF16 || fsdp_offload(f)) return false;
  for (int i = 0; i < u->n; i++) /* a parameter kept in fp32: its fp32 part, or vocab rows */
    if (u->params[i]->fp32) return false;
  return true;
}

/* Zero what of the unit's fresh shard (its weights: the fp32 shard, or the
 * bf16 one of an lp_only unit) the load will not write, so that every
 * element is defined: the whole shard without a checkpoint (ck NULL), else
 * per parameter (unit_layout: the chunks tile the shard) its padding rows
 * past the tensor's end (load_param writes the first nr·cols elements of
 * its chunk), and the whole chunk of a LoRA adapter (no checkpoint tensor:
 * engine/lora.h sets it). Zeroing only these instead of the whole shard
 * spares a pass over it: its pages are first touched by the load. */
static int zero_unloaded(ml_fsdp *f, ml_fsdp_unit *u, const ml_ckpt *ck) {
  ml_backend *be = u->lp_only ? f->be : f->shard_be;
  char *base = u->lp_only ? (char *)u->lp : (char *)u->shard;
  size_t es = u->lp_only ? sizeof(uint16_t) : sizeof(float);
  if (!ck) return ml_be_zero(be, base, es * (size_t)u->shard_numel);
  for (int i = 0; i < u->n; i++) {
    const ml_param *p = u->params[i];
    int64_t r0, nr, cols = p->local[1];
    ml_fsdp_param_rows(f, u, i, &r0, &nr);
    int64_t written = p->adapter ? 0 : nr * cols, chunk = u->chunk_rows[i] * cols;
    if (written < chunk)
      ML_TRY(ml_be_zero(be, base + es * (size_t)(u->shard_off[i] + written),
                        es * (size_t)(chunk - written)));
  }
  return 0;
}

/* The unit's weights where the shards live: the fp32 shard, or for an
 * lp_only unit (fsdp.h) the bf16 shard alone; what ck will not fill is
 * zeroed (zero_unloaded: padding rows stay 0). */
static int unit_weights_alloc(ml_fsdp *f, ml_fsdp_unit *u, const ml_ckpt *ck) {
  size_t n = (size_t)u->shard_numel; /* bounded (unit_layout): 4n floats fit */
  u->lp_only = f->opts.inference_only && ml_fsdp_bf16_weights(f, u);
  if (u->lp_only) {
    u->lp = ml_be_alloc(f->be, (int64_t)n, sizeof(uint16_t),
                        "the bf16 shard of an inference-only FSDP unit (%d parameters)", u->n);
    u->lp_fresh = true; /* the weights themselves */
    return u->lp ? zero_unloaded(f, u, ck) : -1;
  }
  u->shard = ml_fsdp_shard_alloc(f, (int64_t)n, sizeof(float),
                                 u->frozen ? "the FSDP shard of a frozen unit (%d parameters%s)"
                                           : "the FSDP shard (%d parameters%s)",
                                 u->n, fsdp_offload(f) ? ", offloaded to host memory" : "");
  if (!u->shard) return -1;
  return zero_unloaded(f, u, ck);
}

static int unit_init(ml_fsdp *f, ml_fsdp_unit *u, const ml_model *m, const ml_ckpt *ck) {
  ML_TRY(unit_layout(f, u, m));
  u->frozen = u->grad_numel == 0; /* every parameter frozen (unit_layout: no trainable chunk) */
  /* the gradient and AdamW state come at the first training call (ml_fsdp_train_state) */
  ML_TRY(unit_weights_alloc(f, u, ck));
  /* LoRA adapters are no base checkpoint tensors: engine/lora.h sets them */
  for (int i = 0; ck && i < u->n; i++)
    if (!u->params[i]->adapter) ML_TRY(load_param(f, u, i, ck));
  if (fsdp_params_alias(f, u)) { /* the shard is the whole TP-local tensor */
    u->full = u->shard;
    point_data(u, u->full, ML_F32);
  }
  return 0;
}

static int check_opts(const ml_fsdp_opts *o) {
  if (o->param_dtype != ML_F32 && o->param_dtype != ML_BF16)
    return ml_err("fsdp param_dtype %s: expected fp32 or bf16", ml_dtype_name(o->param_dtype));
  if (o->reduce_dtype != ML_F32 && o->reduce_dtype != ML_BF16)
    return ml_err("fsdp reduce_dtype %s: expected fp32 or bf16", ml_dtype_name(o->reduce_dtype));
  if (o->zero < 1 || o->zero > 3) return ml_err("zero stage %d: expected 1, 2 or 3", o->zero);
  if (o->prefetch_forward < 0 || o->prefetch_backward < 0)
    return ml_err("fsdp prefetch depths %d (forward), %d (backward): expected >= 0",
                  o->prefetch_forward, o->prefetch_backward);
  return 0;
}

int ml_fsdp_init(ml_fsdp *f, ml_model *m, ml_comm *dp, ml_comm *rep, const ml_fsdp_opts *opts,
                 bool vocab_parallel, const ml_ckpt *ck) {
  return ml_fsdp_init_ep(f, m, dp, rep, NULL, opts, vocab_parallel, ck);
}

/* The unit holding m->params[k] under ep (NULL: no expert units): an
 * expert's, its layer's expert unit (xu[layer]) when this rank holds the
 * expert, else −1; any other parameter's, ml_fsdp_unit_of. */
static int holder(const ml_model *m, const ml_fsdp_ep *ep, const int *xu, int k) {
  const ml_param *p = &m->params[k];
  int64_t e = ep ? ml_ep_expert_of(m, p) : -1;
  if (e < 0) return ml_fsdp_unit_of(m, p);
  int64_t local = m->cfg.n_experts / ep->ranks; /* experts per ep rank */
  return e / local == ep->rank ? xu[p->layer] : -1;
}

/* The units' members (f->units[u].params, .n, in m->params order) and the
 * lookup f->held_*: the layers and the root (ml_fsdp_unit_of), then under
 * ep one expert unit per sparse layer, carried along by its layer's unit
 * (ml_fsdp_unit.with) and resharded after forward as it is. */
static int assign(ml_fsdp *f, ml_model *m, const ml_fsdp_ep *ep, ml_comm *dp, ml_comm *rep) {
  int L = (int)m->cfg.n_layers, n = m->n_params;
  int *xu = ml_calloc((size_t)L + 1, sizeof *xu, "fsdp units"); /* layer → its expert unit */
  if (!xu) return -1;
  f->n_units = L + 1;
  for (int l = 0; l < L; l++) xu[l] = ep && m->layers[l].moe.experts ? f->n_units++ : -1;
  f->units = ml_calloc((size_t)f->n_units, sizeof *f->units, "fsdp units");
  ml_param **slots = ml_calloc((size_t)n + 1, sizeof *slots, "fsdp units");
  f->held_unit = ml_calloc(2 * (size_t)n + 1, sizeof *f->held_unit, "fsdp units");
  f->params = m->params;
  if (!f->units || !slots || !f->held_unit) {
    free(xu);
    free(slots);
    return -1;
  }
  f->held_index = f->held_unit + n;
  for (int k = 0; k < n; k++) f->held_unit[k] = holder(m, ep, xu, k);
  int used = 0; /* slots holds every parameter of a unit, grouped by unit */
  for (int u = 0; u < f->n_units; u++) {
    ml_fsdp_unit *unit = &f->units[u];
    unit->params = slots + used;
    for (int k = 0; k < n; k++)
      if (f->held_unit[k] == u) {
        f->held_index[k] = unit->n;
        unit->params[unit->n++] = &m->params[k];
      }
    used += unit->n;
    unit->dp = dp;
    unit->rep = rep;
    unit->with = u < L ? xu[u] : -1;
    unit->layer = -1;
    unit->reshard_after_forward =
        ml_fsdp_reshard_after_forward(f->opts.reshard_after_forward, u, L + 1);
  }
  for (int l = 0; l < L; l++) {
    if (xu[l] < 0) continue;
    ml_fsdp_unit *x = &f->units[xu[l]];
    *x = (ml_fsdp_unit){.params = x->params, .n = x->n, .dp = ep->shard, .rep = f->solo,
                        .with = -1, .layer = l,
                        .reshard_after_forward = f->units[l].reshard_after_forward};
  }
  free(xu);
  return 0;
}

/* ep against the model (ml_fsdp_init_ep); NULL when it places nothing. */
static int check_ep(const ml_model *m, const ml_fsdp_ep *ep, const ml_fsdp_ep **out) {
  *out = NULL;
  if (!ep || ep->ranks <= 1) return 0;
  int64_t E = m->cfg.n_experts;
  if (E == 0 || E % ep->ranks != 0 || ep->rank < 0 || ep->rank >= ep->ranks || !ep->shard)
    return ml_err("fsdp experts: ep rank %d of %d ranks over %lld experts per layer; expected "
                  "0 <= rank < ranks, ranks dividing num_experts > 0, and an ep_shard group",
                  ep->rank, ep->ranks, (long long)E);
  *out = ep;
  return 0;
}

int ml_fsdp_init_ep(ml_fsdp *f, ml_model *m, ml_comm *dp, ml_comm *rep, const ml_fsdp_ep *ep,
                    const ml_fsdp_opts *opts, bool vocab_parallel, const ml_ckpt *ck) {
  memset(f, 0, sizeof *f);
  ML_TRY(check_opts(opts));
  ML_TRY(check_ep(m, ep, &ep));
  if (!m->be) return ml_err("ml_fsdp_init: the model has no backend (ml_model.be)");
  f->be = m->be;
  f->shard_be = m->be;
  if (opts->cpu_offload) ML_TRY(ml_be_host_peer(m->be, &f->shard_be));
  f->dp = dp;
  f->rep = rep;
  f->opts = *opts;
  f->vocab_parallel = vocab_parallel && dp->size > 1;
  if (ep) ML_TRY(ml_comm_null_create(0, 1, "fsdp experts' replicas", &f->solo));
  ML_TRY(assign(f, m, ep, dp, rep));
  /* the staging serves the gathered parts only, each unit's over its own group */
  int64_t max_gather = 0, max_staged = 0, max_shard = 0;
  bool staged = false; /* some unit's gradients are reduced (not accumulated in place) */
  for (int u = 0; u < f->n_units; u++) {
    ml_fsdp_unit *unit = &f->units[u];
    ML_TRY(unit_init(f, unit, m, ck));
    /* a unit's dp shards: its elements plus at most dp − 1 padding rows (bounded, see
     * unit_layout) */
    int64_t g = unit->gather_numel, all = g * unit->dp->size;
    if (g > max_gather) max_gather = g;
    if (all > max_staged) max_staged = all;
    if (unit->shard_numel > max_shard) max_shard = unit->shard_numel;
    staged = staged || !fsdp_grads_in_place(f, unit);
  }
  staged = staged && !opts->inference_only; /* nothing is ever reduced: no staging */
  if (fsdp_offload(f) && staged) {
    f->host_grad = ml_be_host_alloc(f->be, max_shard, sizeof(float),
                                    "the host staging of offloaded gradients");
    if (!f->host_grad) return -1;
  }
  if (staged) {
    f->comm_buf = ml_be_alloc(f->be, max_staged, sizeof(float), "the FSDP communication buffer");
    f->grad_buf = ml_be_alloc(f->be, max_gather, sizeof(float), "the FSDP gradient buffer");
    if (opts->reduce_dtype == ML_BF16)
      f->wire = ml_be_alloc(f->be, max_staged, sizeof(uint16_t), "the FSDP bf16 gradient buffer");
    if (!f->comm_buf || !f->grad_buf || (opts->reduce_dtype == ML_BF16 && !f->wire)) return -1;
  }
  return ml_fsdp_sync_params(f);
}

void ml_fsdp_destroy(ml_fsdp *f) {
  if (f->units) {
    for (int u = 0; u < f->n_units; u++) {
      ml_fsdp_unit *unit = &f->units[u];
      if (unit->in_flight) ml_wait(unit->dp, &unit->req);
      if (unit->in_flight && unit->recv32 && unit->dp->size > 1) ml_wait(unit->dp, &unit->req32);
      if (unit->dp->size > 1) ml_be_free(f->be, unit->recv32);
      ml_be_free(f->be, unit->full32);
      if (unit->grad_pending) ml_be_event_sync(f->be, &unit->grad_ev);
      if (unit->send != fsdp_shard_on_device(unit)) fsdp_free_unless_lp(f, unit, unit->send);
      if (unit->recv != unit->send) ml_be_free(f->be, unit->recv); /* one rank: the same */
      if (!fsdp_params_alias(f, unit)) fsdp_free_unless_lp(f, unit, unit->full);
      if (!fsdp_grads_alias(f, unit)) ml_be_free(f->be, unit->full_grad);
      if (!fsdp_rows_grad_alias(f, unit)) ml_be_free(f->be, unit->rows_grad);
      fsdp_free_unless_lp(f, unit, unit->rows);
      ml_be_free(f->be, unit->lp);
      ml_be_free(f->be, unit->dev_shard);
      ml_fsdp_shard_free(f, unit->shard);
      ml_fsdp_shard_free(f, unit->shard_grad); /* the training state's block (fsdp_state.c) */
      free(unit->chunk_rows);
      free(unit->vocab);
    }
    free(f->units[0].params); /* the slots array */
  }
  free(f->units);
  if (f->be) {
    ml_be_free(f->be, f->comm_buf);
    ml_be_free(f->be, f->grad_buf);
    ml_be_free(f->be, f->wire);
    ml_be_host_free(f->be, f->host_grad);
  }
  ml_comm_destroy(f->solo);
  free(f->held_unit);
  memset(f, 0, sizeof *f);
}

/* fsdp_impl.h */
int fsdp_copy_rank_major(const ml_fsdp *f, const ml_fsdp_unit *u, void *wire, ml_elem elem,
                         void *full, ml_dtype type, int to_full, int64_t stride) {
  return fsdp_copy_part(f, u, wire, elem, full, type, to_full, 0, stride, 0, false);
}

int fsdp_copy_part(const ml_fsdp *f, const ml_fsdp_unit *u, void *wire, ml_elem elem, void *full,
                   ml_dtype type, int to_full, int64_t lo, int64_t stride, int64_t full_lo,
                   bool round) {
  int dp = u->dp->size;
  size_t es = ml_elem_size(elem), fs = ml_dtype_size(type);
  ml_dtype wt = fsdp_dtype_of(elem);
  for (int r = 0; r < dp; r++) {
    char *block = (char *)wire + es * (size_t)(r * stride);
    for (int i = 0; i < u->n; i++) {
      const ml_param *p = u->params[i];
      int64_t c = u->chunk_rows[i], cols = p->local[1], rows = p->local[0];
      if (u->shard_off[i] < lo || u->shard_off[i] + c * cols > lo + stride) continue; /* beyond */
      int64_t r0 = c * r < rows ? c * r : rows, nr = (c * r + c < rows ? c * r + c : rows) - r0;
      char *full_rows = (char *)full + fs * (size_t)(u->full_off[i] - full_lo + r0 * cols);
      char *chunk = block + es * (size_t)(u->shard_off[i] - lo);
      size_t n = (size_t)(nr * cols), pad = (size_t)((c - nr) * cols);
      if (to_full) {
        ML_TRY(ml_be_convert(f->be, full_rows, type, chunk, wt, n));
      } else {
        if (round && !u->f32[i] && wt == ML_F32 && type == ML_F32)
          ML_TRY(ml_be_round_bf16_to(f->be, (const float *)full_rows, (float *)chunk, NULL, n));
        else
          ML_TRY(ml_be_convert(f->be, chunk, wt, full_rows, type, n));
        ML_TRY(ml_be_zero(f->be, chunk + es * n, es * pad));
      }
    }
  }
  return 0;
}

int ml_fsdp_gather_flat(ml_fsdp *f, int u, const float *src, float *dst) {
  ml_fsdp_unit *unit = &f->units[u];
  if (!src) /* an lp_only unit's shard (fsdp.h): the callers check ml_fsdp_has_masters */
    return ml_err("FSDP unit %d holds no fp32 shard (an inference_only session keeps its "
                  "weights in bf16 alone); expected a session without inference_only", u);
  size_t bytes = sizeof(float) * (size_t)unit->shard_numel;
  if (unit->dp->size == 1) return ml_be_copy(f->be, dst, src, bytes, ml_fsdp_shard_to_device(f));
  /* dp shards of a unit: bounded (unit_layout); under cpu_offload this rank's shard copied
   * to the device after them */
  int64_t n = unit->shard_numel * (unit->dp->size + (fsdp_offload(f) ? 1 : 0));
  float *all = ml_be_alloc(f->be, n, sizeof(float), "the gathered shards of a unit");
  if (!all) return -1;
  const float *mine = src;
  int rc = 0;
  if (fsdp_offload(f)) {
    float *staged = all + unit->shard_numel * unit->dp->size;
    rc = ml_be_copy(f->be, staged, src, bytes, ML_COPY_H2D);
    mine = staged;
  }
  if (rc == 0) rc = ml_all_gather(unit->dp, mine, all, (size_t)unit->shard_numel);
  if (rc == 0)
    rc = fsdp_copy_rank_major(f, unit, all, ML_ELEM_F32, dst, ML_F32, 1, unit->shard_numel);
  ml_be_free(f->be, all);
  return rc;
}

/* The persistent param_dtype shard (fsdp.h lp) at the shard's current
 * values: rounded from it where stale. */
static int lp_refresh(ml_fsdp *f, ml_fsdp_unit *unit) {
  if (unit->lp_fresh) return 0;
  ML_TRY(ml_be_convert(f->be, unit->lp, ML_BF16, unit->shard, ML_F32,
                       (size_t)unit->shard_numel));
  unit->lp_fresh = true;
  return 0;
}

/* The vocab-parallel rows in param_dtype (bf16: rounded from the shard
 * into unit->rows, as the gathered parameters are, or the persistent
 * shard's rows part; fp32 reads the shard). */
static int rows_materialise(ml_fsdp *f, ml_fsdp_unit *unit) {
  int64_t n = fsdp_rows_numel(unit);
  ml_dtype pt = f->opts.param_dtype;
  if (n == 0 || pt == ML_F32) return 0;
  if (unit->lp) { /* rounded already (gather_start: lp_refresh) */
    fsdp_free_unless_lp(f, unit, unit->rows); /* one rounded before lp existed (ZeRO-1/2) */
    unit->rows = unit->lp + unit->gather_numel;
    return 0;
  }
  if (!unit->rows) {
    unit->rows = ml_be_alloc(f->be, n, ml_dtype_size(pt), "the %s vocab rows of a unit",
                             ml_dtype_name(pt));
    if (!unit->rows) return -1;
  }
  return ml_be_convert(f->be, unit->rows, pt, fsdp_shard_on_device(unit) + unit->gather_numel,
                       ML_F32, (size_t)n);
}

/* cpu_offload: the shard on the device (dev_shard), copied without blocking
 * the host (the compute stream orders the all-gather after it). */
static int shard_upload(ml_fsdp *f, ml_fsdp_unit *unit) {
  if (!unit->dev_shard) {
    unit->dev_shard = ml_be_alloc(f->be, unit->shard_numel, sizeof(float),
                                  "the device copy of an offloaded FSDP shard");
    if (!unit->dev_shard) return -1;
  }
  return ml_be_copy_async(f->be, unit->dev_shard, unit->shard,
                          sizeof(float) * (size_t)unit->shard_numel, ML_COPY_H2D);
}

/* Whether the unit's vocab-parallel rows are read from the shard itself:
 * param_dtype fp32, or a vocab-parallel parameter kept in fp32. */
static bool rows_read_shard(const ml_fsdp *f, const ml_fsdp_unit *unit) {
  bool any = fsdp_rows_numel(unit) > 0 && f->opts.param_dtype == ML_F32;
  for (int i = 0; i < unit->n && !any; i++) any = unit->vocab[i] && unit->params[i]->fp32;
  return any;
}

/* Free the shard's device copy once nothing reads it: fp32 vocab rows
 * read it while the unit is materialised (keep: until reshard). */
static void shard_release(ml_fsdp *f, ml_fsdp_unit *unit, bool keep) {
  if (keep && rows_read_shard(f, unit)) return;
  ml_be_free(f->be, unit->dev_shard);
  unit->dev_shard = NULL;
}

/* The fp32 part's all-gather (mixed-dtype units, fsdp.h): the shard's
 * (or its device copy's) fp32 part as it is, into recv32. */
static int gather32_start(ml_fsdp *f, ml_fsdp_unit *unit) {
  if (unit->f32_numel == 0) return 0;
  float *send = fsdp_shard_on_device(unit) + fsdp_lo_numel(unit);
  if (unit->dp->size == 1) { /* nothing to gather: the shard's part is the block */
    unit->recv32 = send;
    return 0;
  }
  /* dp shards of a unit: bounded (unit_layout) */
  unit->recv32 = ml_be_alloc(f->be, unit->f32_numel * unit->dp->size, sizeof(float),
                             "the gathered fp32 parameters of a unit");
  if (!unit->recv32) return -1;
  return ml_iall_gather(unit->dp, send, unit->recv32, (size_t)unit->f32_numel, ML_ELEM_F32,
                        &unit->req32);
}

/* Wait for the fp32 part's all-gather (started when the unit's gather is
 * in flight) and copy it out into full32; rc: the unit's status so far. */
static int gather32_finish(ml_fsdp *f, ml_fsdp_unit *unit, int rc) {
  if (!unit->recv32) return rc;
  bool waited = unit->dp->size > 1;
  if (waited && unit->in_flight) {
    int w = ml_wait(unit->dp, &unit->req32);
    if (rc == 0) rc = w;
  }
  if (rc == 0 && !unit->full32) {
    unit->full32 = ml_be_alloc(f->be, unit->f32_full, sizeof(float),
                               "the unsharded fp32 parameters of a unit");
    if (!unit->full32) rc = -1;
  }
  if (rc == 0)
    rc = fsdp_copy_part(f, unit, unit->recv32, ML_ELEM_F32, unit->full32, ML_F32, 1,
                        fsdp_lo_numel(unit), unit->f32_numel, fsdp_lo_full(unit), false);
  if (waited) ml_be_free(f->be, unit->recv32);
  unit->recv32 = NULL;
  return rc;
}

/* Start the all-gather of unit u's gathered part in param_dtype into
 * unit->recv, and of its fp32 part into recv32; its vocab-parallel rows in
 * param_dtype. The param_dtype part is sent from the persistent shard (lp:
 * no conversion while it is fresh), else rounded into a send buffer. */
static int gather_start(ml_fsdp *f, ml_fsdp_unit *unit) {
  int64_t n = fsdp_lo_numel(unit);
  ml_dtype pt = f->opts.param_dtype;
  size_t es = ml_dtype_size(pt);
  if (fsdp_offload(f)) ML_TRY(shard_upload(f, unit));
  if (unit->lp) ML_TRY(lp_refresh(f, unit));
  ML_TRY(rows_materialise(f, unit));
  unit->send = fsdp_shard_on_device(unit);
  if (unit->lp) {
    unit->send = unit->lp;
  } else if (pt != ML_F32) {
    unit->send = ml_be_alloc(f->be, n, es, "a %s parameter shard", ml_dtype_name(pt));
    if (!unit->send) return -1;
    ML_TRY(ml_be_convert(f->be, unit->send, pt, fsdp_shard_on_device(unit), ML_F32, (size_t)n));
  }
  if (unit->dp->size == 1) { /* nothing to gather: the "gathered" block is the shard */
    unit->recv = unit->send;
    return gather32_start(f, unit);
  }
  /* dp shards of a unit: bounded (unit_layout) */
  unit->recv = ml_be_alloc(f->be, n * unit->dp->size, es, "the gathered parameters of a unit");
  if (!unit->recv) return -1;
  ML_TRY(ml_iall_gather(unit->dp, unit->send, unit->recv, (size_t)n, fsdp_param_elem(f),
                        &unit->req));
  ML_TRY(gather32_start(f, unit));
  unit->in_flight = true;
  return 0;
}

/* Wait for unit u's all-gather and copy it out into the unsharded buffer,
 * which keeps param_dtype (the GEMMs read it as it is). On one rank the
 * converted shard (or under cpu_offload its device copy) is that buffer
 * already (same layout: no padding rows), unless one is kept between steps
 * (ZeRO-1/2); where that buffer is the persistent shard (lp) itself, there
 * is nothing to copy. */
static int gather_finish(ml_fsdp *f, ml_fsdp_unit *unit) {
  int rc = unit->in_flight ? ml_wait(unit->dp, &unit->req) : 0;
  rc = gather32_finish(f, unit, rc); /* before the shard's device copy goes */
  unit->in_flight = false;
  ml_dtype pt = f->opts.param_dtype;
  void *adopt = unit->dp->size == 1 && !unit->full && unit->send != unit->shard ? unit->send : NULL;
  if (rc == 0 && adopt) {
    unit->full = adopt;
    if (adopt == unit->dev_shard) unit->dev_shard = NULL; /* now the unsharded buffer */
  } else {
    if (rc == 0 && !unit->full) {
      unit->full = ml_be_alloc(f->be, fsdp_lo_full(unit), ml_dtype_size(pt),
                               "the unsharded parameters of a unit");
      if (!unit->full) rc = -1;
    }
    if (rc == 0 && unit->full != unit->recv)
      rc = fsdp_copy_rank_major(f, unit, unit->recv, fsdp_param_elem(f), unit->full, pt, 1,
                                fsdp_lo_numel(unit));
    if (unit->send != fsdp_shard_on_device(unit)) fsdp_free_unless_lp(f, unit, unit->send);
    if (unit->recv != unit->send) ml_be_free(f->be, unit->recv);
  }
  shard_release(f, unit, rc == 0);
  if (rc == 0) point_data(unit, unit->full, pt);
  unit->send = unit->recv = NULL;
  return rc;
}

static int prefetch_one(ml_fsdp *f, ml_fsdp_unit *unit) {
  if (unit->full || unit->recv) return 0; /* materialised, or its gather started */
  return gather_start(f, unit);
}

int ml_fsdp_prefetch(ml_fsdp *f, int u) {
  if (u < 0 || u >= f->n_units || f->units[u].layer >= 0) return 0; /* the layers and the root */
  ML_TRY(prefetch_one(f, &f->units[u]));
  int w = f->units[u].with; /* its expert unit along */
  return w >= 0 ? prefetch_one(f, &f->units[w]) : 0;
}

static int unshard_one(ml_fsdp *f, ml_fsdp_unit *unit) {
  if (unit->full && !unit->recv) return 0;
  if (!unit->recv) ML_TRY(gather_start(f, unit));
  return gather_finish(f, unit);
}

int ml_fsdp_unshard(ml_fsdp *f, int u) {
  int w = f->units[u].with;
  if (w >= 0) ML_TRY(prefetch_one(f, &f->units[w])); /* both gathers in flight at once */
  ML_TRY(unshard_one(f, &f->units[u]));
  return w >= 0 ? unshard_one(f, &f->units[w]) : 0;
}

static void reshard_one(ml_fsdp *f, ml_fsdp_unit *unit) {
  if (fsdp_params_alias(f, unit) || fsdp_persistent(f) || !unit->full) return;
  fsdp_free_unless_lp(f, unit, unit->full);
  fsdp_free_unless_lp(f, unit, unit->rows);
  ml_be_free(f->be, unit->full32);
  unit->full = unit->rows = NULL;
  unit->full32 = NULL;
  shard_release(f, unit, false);
  point_data(unit, NULL, f->opts.param_dtype);
}

void ml_fsdp_reshard(ml_fsdp *f, int u) {
  reshard_one(f, &f->units[u]);
  if (f->units[u].with >= 0) reshard_one(f, &f->units[f->units[u].with]);
}

int ml_fsdp_sync_params(ml_fsdp *f) {
  if (!fsdp_persistent(f)) return 0;
  for (int u = 0; u < f->n_units; u++) {
    if (fsdp_params_alias(f, &f->units[u])) continue;
    ML_TRY(gather_start(f, &f->units[u]));
    ML_TRY(gather_finish(f, &f->units[u]));
  }
  return 0;
}

/* Forget the unit's unsharded buffers that are its bf16 shard (lp) or lie in
 * it (the one-rank unsharded parameters, the vocab rows), before lp changes
 * hands: they are lp's memory, not theirs. */
static void lp_detach(ml_fsdp_unit *unit, ml_dtype pt) {
  if (!unit->lp) return;
  if (unit->rows == unit->lp + unit->gather_numel) unit->rows = NULL;
  if (unit->full != unit->lp) return;
  unit->full = NULL;
  point_data(unit, NULL, pt);
}

int ml_fsdp_swap_weights(ml_fsdp *f, void **other, bool in, bool regather) {
  for (int u = 0; u < f->n_units; u++) {
    ml_fsdp_unit *unit = &f->units[u];
    reshard_one(f, unit); /* no-op where the unsharded parameters persist or alias */
    if (ml_fsdp_bf16_weights(f, unit)) {
      lp_detach(unit, f->opts.param_dtype);
      uint16_t *mine = unit->lp;
      unit->lp = other[u];
      other[u] = mine;
      unit->lp_fresh = in || unit->lp_only;
      continue;
    }
    float *mine = unit->shard;
    unit->shard = other[u];
    other[u] = mine;
    unit->lp_fresh = false;
    if (fsdp_params_alias(f, unit)) {
      unit->full = unit->shard;
      point_data(unit, unit->full, ML_F32);
    }
  }
  return regather ? ml_fsdp_sync_params(f) : 0;
}

void ml_fsdp_params_changed(ml_fsdp *f) {
  for (int u = 0; u < f->n_units; u++) f->units[u].lp_fresh = f->units[u].lp_only;
}

bool ml_fsdp_has_masters(const ml_fsdp *f) {
  for (int u = 0; u < f->n_units; u++)
    if (f->units[u].lp_only) return false;
  return true;
}

int ml_fsdp_rows(const ml_fsdp *f, const ml_param *p, ml_rows *w) {
  for (int u = 0; u < f->n_units; u++) {
    const ml_fsdp_unit *unit = &f->units[u];
    int i = ml_fsdp_param_index(unit, p);
    if (i < 0) continue;
    if (!unit->vocab[i])
      return ml_err("%s is not vocab-parallel over FSDP's group; expected embed_tokens.weight "
                    "or lm_head.weight with vocab parallelism on",
                    p->name);
    if (!unit->full)
      return ml_err("%s: its FSDP unit is not materialised; expected ml_fsdp_unshard first",
                    p->name);
    int64_t r0, nr, at = unit->shard_off[i] - unit->gather_numel; /* in the rows' part */
    ml_fsdp_param_rows(f, unit, i, &r0, &nr);
    ml_dtype pt = fsdp_param_dtype_of(f, p);
    const float *shard = fsdp_shard_on_device(unit);
    *w = (ml_rows){.data = pt == ML_F32 ? (const void *)(shard + unit->shard_off[i])
                                        : (const void *)((uint16_t *)unit->rows + at),
                   .dtype = pt,
                   .grad = unit->rows_grad && !p->frozen ? unit->rows_grad + at : NULL,
                   .row0 = p->offset[0] + r0,
                   .rows = nr,
                   .cols = p->local[1]};
    return 0;
  }
  return ml_err("%s is in no FSDP unit", p->name);
}

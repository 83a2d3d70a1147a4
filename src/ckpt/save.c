#include "ckpt/save.h"

#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "ckpt/hf_source.h"
#include "ckpt/lora_export.h"
#include "parallel/ep.h"
#include "parallel/redistribute.h"
#include "parallel/tp.h"

/* The global tensor of p (Shard on its dim over tp, or Replicate) from
 * the tp group's local tensors `local` [p->local] (device memory) into
 * `out` [p->shape] (host memory) on every rank: one padded all-gather of
 * the pieces (ml_tp_param_slice: torch.chunk's, or whole heads, kv heads
 * held by several ranks landing on the same rows with the same values),
 * unpadded into place on the device (Shard(1) pieces as strided column
 * blocks, ml_be_copy2d), then copied to the host. */
static int gather_tp(const ml_engine *e, ml_comm *tp, const ml_param *p, const float *local,
                     float *out) {
  ml_backend *be = e->be;
  const size_t f = sizeof(float);
  int dim = ml_tp_param_dim(&e->tp, &e->model, p);
  int64_t numel = p->shape[0] * p->shape[1];
  if (dim < 0 || tp->size == 1) return ml_be_copy(be, out, local, f * (size_t)numel, ML_COPY_D2H);
  int64_t other = p->shape[1 - dim], n = ml_param_numel(p), s, len, own, chunk = 0;
  for (int r = 0; r < tp->size; r++) {
    ml_tp_param_slice(&e->tp, &e->model, p, r, &s, &len, &own);
    if (len * other > chunk) chunk = len * other;
  }
  /* device: send [chunk] | pieces [tp · chunk] | the global tensor [numel] */
  float *send = ml_be_alloc(be, (1 + tp->size) * chunk + numel, f, "the export of '%s'", p->name);
  if (!send) return -1;
  float *pieces = send + chunk, *global = pieces + tp->size * chunk;
  int rc = ml_be_copy(be, send, local, f * (size_t)n, ML_COPY_D2D);
  if (rc == 0) rc = ml_all_gather_padded(be, tp, send, (size_t)n, (size_t)chunk, pieces);
  for (int r = 0; rc == 0 && r < tp->size; r++) {
    ml_tp_param_slice(&e->tp, &e->model, p, r, &s, &len, &own);
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
  return i >= 0 && i < e->model.n_params ? e->order[i] : NULL;
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

/* `what` of unit laid out as its shard [shard_numel] in *out: the array
 * itself, or where it covers only the leading grad_numel elements (frozen
 * chunks have no gradient or AdamW state: torch's grad None, exported as
 * zeros) or does not exist yet (no training call: ml_engine_train_state;
 * exported as the zeros it would start from) a zero-padded copy in *tmp
 * (ml_fsdp_shard_free it). */
static int unit_array_padded(ml_engine *e, ml_fsdp_unit *unit, ml_export_what what,
                             const float **out, float **tmp) {
  *tmp = NULL;
  if (what == ML_EXPORT_GRADS && unit->shard_grad) /* a fresh unit's reads as zeros */
    ML_TRY(ml_fsdp_settle_grad(&e->fsdp, unit));
  *out = unit_array(unit, what);
  if (what == ML_EXPORT_PARAMS || (*out && unit->grad_numel == unit->shard_numel)) return 0;
  ml_fsdp *f = &e->fsdp;
  *tmp = ml_fsdp_shard_alloc(f, unit->shard_numel, sizeof(float),
                             "the zero-padded gradients or AdamW state of a unit");
  if (!*tmp) return -1;
  ML_TRY(ml_be_zero(f->shard_be, *tmp, sizeof(float) * (size_t)unit->shard_numel));
  if (*out && unit->grad_numel > 0)
    ML_TRY(ml_be_copy(f->shard_be, *tmp, *out, sizeof(float) * (size_t)unit->grad_numel,
                      ML_COPY_D2D));
  *out = *tmp;
  return 0;
}

/* Under expert parallelism, the experts this rank does not hold: each
 * expert parameter's global tensor (out[k], export order; the holder's
 * already there) from its ep rank, the holder of expert x being ep rank
 * x / (E / ep) of every ep group (an all-gather over the group, whose other
 * ranks send zeros). */
static int export_experts(ml_engine *e, float **out) {
  ml_comm *ep = ml_mesh_comm(e->mesh, ML_GROUP_EP);
  const ml_model *m = &e->model;
  if (ep->size == 1 || m->cfg.n_experts == 0) return 0;
  int64_t local = m->cfg.n_experts / ep->size; /* experts per ep rank */
  for (int k = 0; k < m->n_params; k++) {
    const ml_param *p = e->order[k];
    int64_t x = ml_ep_expert_of(m, p), numel = p->shape[0] * p->shape[1];
    if (x < 0) continue;
    int holder = (int)(x / local);
    bool mine = holder == ep->rank;
    /* [ep] received blocks, then the one sent (a parameter: < 2^44 elements, ep < 2^24) */
    float *buf = ml_be_alloc(e->be, numel * (ep->size + 1), sizeof(float),
                             "the export of '%s' over the ep group", p->name);
    if (!buf) return -1;
    float *send = buf + numel * ep->size;
    size_t bytes = sizeof(float) * (size_t)numel;
    int rc = mine ? ml_be_copy(e->be, send, out[k], bytes, ML_COPY_H2D)
                  : ml_be_zero(e->be, send, bytes);
    if (rc == 0) rc = ml_all_gather(ep, send, buf, (size_t)numel);
    if (rc == 0 && !mine && !(out[k] = ml_be_host_alloc(e->be, numel, sizeof(float),
                                                        "the export of '%s'", p->name)))
      rc = -1;
    if (rc == 0 && !mine) rc = ml_be_copy(e->be, out[k], buf + numel * holder, bytes, ML_COPY_D2H);
    ml_be_free(e->be, buf);
    ML_TRY(rc);
  }
  return 0;
}

int ml_engine_export(ml_engine *e, ml_export_what what, float **out) {
  ml_comm *tp = ml_mesh_comm(e->mesh, ML_GROUP_TP);
  for (int u = 0; u < e->fsdp.n_units; u++) {
    ml_fsdp_unit *unit = &e->fsdp.units[u];
    float *full = ml_be_alloc(e->be, unit->full_numel, sizeof(float), "the export of a unit");
    if (!full) return -1;
    const float *src;
    float *tmp;
    int rc = unit_array_padded(e, unit, what, &src, &tmp);
    if (rc == 0) rc = ml_fsdp_gather_flat(&e->fsdp, u, src, full);
    ml_fsdp_shard_free(&e->fsdp, tmp);
    for (int i = 0; rc == 0 && i < unit->n; i++) {
      const ml_param *p = unit->params[i];
      int k = e->order_k[p - e->model.params];
      out[k] = ml_be_host_alloc(e->be, p->shape[0] * p->shape[1], sizeof(float),
                                "the export of '%s'", p->name);
      rc = out[k] ? gather_tp(e, tp, p, full + unit->full_off[i], out[k]) : -1;
    }
    ml_be_free(e->be, full);
    ML_TRY(rc);
  }
  return export_experts(e, out);
}

bool ml_engine_piece(const ml_engine *e, const ml_fsdp_unit *unit, int i, int64_t off[2],
                     int64_t shape[2], int64_t *at) {
  const ml_param *p = unit->params[i];
  int64_t r0, n, skip, nr;
  ml_fsdp_param_rows(&e->fsdp, unit, i, &r0, &n);
  ml_engine_owned_rows(e, unit, i, &skip, &nr);
  off[0] = p->offset[0] + r0 + skip;
  off[1] = p->offset[1];
  shape[0] = nr;
  shape[1] = p->local[1];
  *at = unit->shard_off[i] + skip * p->local[1];
  return nr > 0;
}

/* ------------------------------------------------------ streamed export */

/* What every rank tells the writer about its piece of the current tensor. */
typedef struct piece_note {
  int64_t off[2], shape[2]; /* shape[0] = 0: none */
  int32_t rc;               /* 0, or −1: its copy to the host failed (nothing is sent) */
} piece_note;

/* One stream's buffers. Receiver (world rank `root`): `global` [largest
 * tensor] in host staging memory, `piece` [largest piece of any rank]
 * (pageable, touched only by column blocks: row blocks land in `global`
 * directly). Other ranks: `piece` [their largest piece] in host staging
 * memory, and `global` too when every rank receives. */
typedef struct stream {
  ml_engine *e;
  ml_host *w;
  int root;  /* the rank that assembles each tensor */
  bool all;  /* then broadcast to every rank */
  ml_param_sink sink;
  void *ctx;
  float *global, *piece;
} stream;

static bool whole_rows(const piece_note *n, const ml_param *p) {
  return n->shape[1] == p->shape[1];
}

/* Receiver: place piece n (row-major [n->shape]) into global [p->shape]. */
static void place(float *global, const ml_param *p, const piece_note *n, const float *src) {
  for (int64_t r = 0; r < n->shape[0]; r++)
    memcpy(global + (n->off[0] + r) * p->shape[1] + n->off[1], src + r * n->shape[1],
           sizeof(float) * (size_t)n->shape[1]);
}

/* Where the receiver receives piece n of p. */
static float *landing(const stream *s, const ml_param *p, const piece_note *n) {
  return whole_rows(n, p) ? s->global + n->off[0] * p->shape[1] : s->piece;
}

/* The receiver assembles p from every rank's piece (notes). */
static int assemble(stream *s, const ml_param *p, const piece_note *notes) {
  int64_t covered = 0;
  for (int q = 0; q < s->w->size; q++) {
    const piece_note *n = &notes[q];
    int64_t numel = n->shape[0] * n->shape[1];
    if (numel == 0) continue;
    float *dst = landing(s, p, n);
    if (q != s->root) ML_TRY(ml_host_recv(s->w, dst, sizeof(float) * (size_t)numel, q));
    if (!whole_rows(n, p)) place(s->global, p, n, dst);
    covered += numel;
  }
  if (covered != p->shape[0] * p->shape[1])
    return ml_err("export: the pieces of '%s' cover %lld of its %lld elements", p->name,
                  (long long)covered, (long long)(p->shape[0] * p->shape[1]));
  return 0;
}

/* Parameter k (export order) to the receiver(s): a rank holding none of
 * it (another ep rank's expert) sends no piece. Every rank
 * copies its piece to the host first (the receiver's straight to where it
 * lands), then the notes are exchanged, so that a failed copy stops every
 * rank before any transfer. */
static int stream_param(stream *s, int k) {
  ml_engine *e = s->e;
  const ml_param *p = e->order[k];
  int u, i;
  bool held = ml_fsdp_find(&e->fsdp, p, &u, &i);
  const ml_fsdp_unit *unit = held ? &e->fsdp.units[u] : NULL;
  const bool receiver = s->w->rank == s->root;
  piece_note mine = {{0, 0}, {0, 0}, 0};
  int64_t at = 0;
  if (!held || !ml_engine_piece(e, unit, i, mine.off, mine.shape, &at)) mine.shape[0] = 0;
  size_t bytes = sizeof(float) * (size_t)(mine.shape[0] * mine.shape[1]);
  float *host = receiver && mine.shape[0] ? landing(s, p, &mine) : s->piece;
  if (mine.shape[0] > 0)
    mine.rc = ml_be_copy(e->fsdp.shard_be, host, unit->shard + at, bytes, ML_COPY_D2H);
  piece_note *notes = ml_calloc((size_t)s->w->size, sizeof *notes, "the export's piece notes");
  int rc = notes ? ml_host_all_gather(s->w, &mine, sizeof mine, notes) : -1;
  bool go = rc == 0; /* every copy succeeded (a failed one's rank reports it) */
  for (int q = 0; go && q < s->w->size; q++) go = notes[q].rc == 0;
  if (rc == 0) rc = mine.rc;
  if (go && !receiver && mine.shape[0] > 0) rc = ml_host_send(s->w, host, bytes, s->root);
  if (go && rc == 0 && receiver) rc = assemble(s, p, notes);
  free(notes);
  if (!s->all) /* a failed copy's rank returns its error; the caller agrees */
    return go && rc == 0 && receiver ? s->sink(s->ctx, k, p, s->global) : rc;
  /* every rank receiving: the assembled tensor from the root to all, once all succeeded */
  ML_TRY(ml_host_agree(s->w, rc));
  ML_TRY(ml_host_broadcast(s->w, s->global, sizeof(float) * (size_t)(p->shape[0] * p->shape[1]),
                           s->root));
  return s->sink(s->ctx, k, p, s->global);
}

/* Largest global tensor of the model and largest piece of this rank, in
 * elements. */
static void sizes(const ml_engine *e, int64_t *tensor, int64_t *piece) {
  *tensor = *piece = 0;
  int64_t off[2], shape[2], at;
  for (int k = 0; k < e->model.n_params; k++) { /* every tensor, held here or not */
    const ml_param *p = &e->model.params[k];
    if (p->shape[0] * p->shape[1] > *tensor) *tensor = p->shape[0] * p->shape[1];
  }
  for (int u = 0; u < e->fsdp.n_units; u++)
    for (int i = 0; i < e->fsdp.units[u].n; i++)
      if (ml_engine_piece(e, &e->fsdp.units[u], i, off, shape, &at) &&
          shape[0] * shape[1] > *piece)
        *piece = shape[0] * shape[1];
}

int ml_engine_stream_params(ml_engine *e, int root, ml_param_sink sink, void *ctx) {
  return ml_engine_stream_selected(e, root, NULL, sink, ctx);
}

int ml_engine_stream_selected(ml_engine *e, int root, ml_param_filter want, ml_param_sink sink,
                              void *ctx) {
  stream s = {e, ml_mesh_host(e->mesh, ML_GROUP_WORLD), root < 0 ? 0 : root, root < 0, sink, ctx,
              NULL, NULL};
  if (s.root >= s.w->size)
    return ml_err("refit: root rank %d; expected < %d ranks (or < 0: every rank)", root,
                  s.w->size);
  int64_t tensor, piece;
  sizes(e, &tensor, &piece);
  int64_t max_piece = piece;
  int rc = ml_host_all_reduce_i64(s.w, &max_piece, 1, ML_RED_MAX);
  bool receiver = s.w->rank == s.root;
  if (rc == 0 && (receiver || s.all) &&
      !(s.global = ml_be_host_alloc(e->be, tensor, sizeof(float), "the export's tensor buffer")))
    rc = -1;
  if (rc == 0 && receiver && !(s.piece = ml_malloc(sizeof(float) * (size_t)max_piece,
                                                   "the export's piece buffer")))
    rc = -1;
  if (rc == 0 && !receiver && !(s.piece = ml_be_host_alloc(e->be, piece, sizeof(float),
                                                           "the export's piece buffer")))
    rc = -1;
  rc = ml_host_agree(s.w, rc);
  for (int k = 0; rc == 0 && k < e->model.n_params; k++)
    if (!want || want(e->order[k])) rc = ml_host_agree(s.w, stream_param(&s, k));
  ml_be_host_free(e->be, s.global);
  if (receiver) free(s.piece);
  else ml_be_host_free(e->be, s.piece);
  return rc;
}

/* ------------------------------------------------------ the HF export */

static int put_tensor(void *x, int k, const ml_param *p, const float *global) {
  return ml_hf_export_put(x, global);
}

int ml_engine_save_hf(ml_engine *e, const char *dir, ml_export_dtype dtype) {
  if (e->lora.on) return ml_engine_save_lora(e, dir, false, dtype); /* a PEFT adapter */
  ml_host *w = ml_mesh_host(e->mesh, ML_GROUP_WORLD);
  int n = e->model.n_params;
  json_t *source = NULL;
  ml_hf_export *x = NULL;
  const ml_param **params = ml_calloc((size_t)n + 1, sizeof *params, "export params");
  for (int i = 0; params && i < n; i++) params[i] = ml_engine_export_param(e, i);
  int rc = params ? 0 : -1;
  if (rc == 0 && w->rank == 0) rc = ml_hf_source_describe(e->model_dir, &e->model, &source);
  if (rc == 0 && w->rank == 0) {
    ml_hf_export_spec spec = {dir,     &e->model.cfg, params,       n, source,
                              e->model_dir, dtype,    ML_HF_MAX_SHARD_BYTES};
    rc = ml_hf_export_begin(&spec, &x);
  }
  rc = ml_host_agree(w, rc);
  if (rc == 0) rc = ml_engine_stream_params(e, 0, put_tensor, x);
  if (x && rc == 0) rc = ml_hf_export_end(x);
  else ml_hf_export_abandon(x);
  json_decref(source);
  free(params);
  return ml_host_agree(w, rc);
}

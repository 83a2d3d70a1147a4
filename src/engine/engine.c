#define _POSIX_C_SOURCE 200809L /* strdup */

#include "engine/engine.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/checked.h"
#include "engine/fp32_params.h"
#include "engine/freeze.h"
#include "engine/reference.h"
#include "common/status.h"
#include "io/checkpoint.h"
#include "model/moe.h"
#include "parallel/ep.h"
#include "parallel/tp.h"
#include "parallel/tp_whole.h"

ml_engine_opts ml_engine_opts_default(void) {
  ml_engine_opts o = {0};
  o.fsdp = (ml_fsdp_opts){.param_dtype = ML_F32, .reduce_dtype = ML_F32,
                          .reshard_after_forward = ML_RESHARD_DEFAULT, .zero = 3,
                          .prefetch_forward = 1, .prefetch_backward = 2, .cpu_offload = false};
  o.output_dtype = ML_F32;
  o.ac = ML_AC_NONE;
  return o;
}

/* Warn (mesh rank 0) about checkpoint tensors no parameter of the model
 * reads, as transformers' from_pretrained does ("Some weights of the model
 * checkpoint ... were not used"): e.g. the vision tower of a
 * Gemma3ForConditionalGeneration checkpoint, or a stray tensor. */
static void warn_unused(const ml_engine *e, const ml_ckpt *ck) {
  enum { SHOWN = 4 };
  char names[SHOWN * 96] = "";
  size_t unused = 0, at = 0;
  for (size_t f = 0; f < ck->nfiles; f++)
    for (size_t t = 0; t < ck->files[f].n; t++) {
      const char *name = ck->files[f].tensors[t].name;
      bool used = false;
      for (int i = 0; !used && i < e->model.n_params; i++)
        used = strcmp(e->model.params[i].key, name) == 0;
      if (used || unused++ >= SHOWN) continue;
      int n = snprintf(names + at, sizeof names - at, "%s%.80s", at ? ", " : "", name);
      at += n > 0 && (size_t)n < sizeof names - at ? (size_t)n : 0;
    }
  if (unused == 0) return;
  ml_warn("%s: %zu checkpoint tensor%s not used by the %s model and ignored: %s%s", ck->dir, unused,
          unused == 1 ? " is" : "s are", e->model.cfg.family->architecture, names,
          unused > SHOWN ? ", ..." : "");
}

int ml_engine_batch_mode(ml_engine *e) {
  bool on = e->opts.batch_invariant, has = ml_be_supports(e->be, ML_OP_BATCH_INVARIANT);
  if (on && !has)
    return ml_err("batch_invariant (--batch-invariant): backend '%s' has no batch-invariant "
                  "mode; expected --device cpu, or the mode off",
                  e->be->ops->name);
  return has ? ml_be_set_batch_invariant(e->be, on) : 0;
}

/* The lowest decoder layer backward must run through (ml_engine.bwd_first). */
static int first_backward_layer(const ml_model *m) {
  if (!m->embed_tokens.weight->frozen) return 0;
  int first = 0, L = (int)m->cfg.n_layers;
  while (first < L) {
    bool frozen = true;
    for (int i = 0; i < m->n_params && frozen; i++)
      if (m->params[i].layer == first) frozen = m->params[i].frozen;
    if (!frozen) break;
    first++;
  }
  return first;
}

/* e->order and e->order_k (engine.h): the parameters of unit u = 0 ..
 * n_layers by ml_fsdp_unit_params. */
static int export_order(ml_engine *e) {
  const ml_model *m = &e->model;
  int n = m->n_params, k = 0;
  e->order = ml_calloc((size_t)n + 1, sizeof *e->order, "the export order");
  e->order_k = ml_calloc((size_t)n + 1, sizeof *e->order_k, "the export order");
  if (!e->order || !e->order_k) return -1;
  for (int u = 0; u <= m->cfg.n_layers; u++)
    k += ml_fsdp_unit_params(m, u, e->order + k);
  for (int i = 0; i < n; i++) e->order_k[e->order[i] - m->params] = i;
  return 0;
}

int ml_engine_open(ml_engine *e, ml_mesh *mesh, const char *model_dir,
                   const ml_engine_opts *opts) {
  memset(e, 0, sizeof *e);
  e->mesh = mesh;
  ml_engine_opts def = ml_engine_opts_default();
  if (!opts) opts = &def;
  e->opts = *opts;
  if (!(e->model_dir = strdup(model_dir))) return ml_err("%s: out of memory", model_dir);
  if (opts->freeze && !(e->opts.freeze = e->freeze = strdup(opts->freeze)))
    return ml_err("freeze (--freeze): out of memory copying '%s'", opts->freeze);
  if (opts->fp32_params && !(e->opts.fp32_params = e->fp32_params = strdup(opts->fp32_params)))
    return ml_err("fp32_params (--fp32-params): out of memory copying '%s'", opts->fp32_params);
  e->be = opts->backend;
  if (!e->be) ML_TRY(ml_backend_get("cpu", 0, &e->be));
  ML_TRY(ml_engine_batch_mode(e));
  ml_model_config cfg;
  ML_TRY(ml_model_config_load(model_dir, &cfg));
  ML_TRY(ml_model_create(&cfg, &e->model));
  e->model.be = e->be;
  e->model.ac = opts->ac;
  e->model.bf16_params = opts->fsdp.param_dtype == ML_BF16;
  ML_TRY(ml_moe_check(&e->model, e->be->ops->name));
  ML_TRY(ml_lora_setup(&e->lora, &opts->lora, &e->model));
  if (cfg.n_experts > 0 && mesh->tp > 1 && opts->sequence_parallel)
    return ml_err("--sequence-parallel with tp = %d: %s has expert layers, which take a "
                  "Replicate() residual stream under tp (not yet a Shard(1) one); expected "
                  "--sequence-parallel off",
                  mesh->tp, cfg.family->architecture);
  /* before tp's walk: under ep with tp the routers' gradients are Partial over tp
   * (parallel/tp_walk.c sparse_block) */
  ML_TRY(ml_ep_apply(&e->model, mesh));
  ML_TRY(ml_plan_select(&e->model, model_dir, opts->parallel_plan, opts->sequence_parallel,
                        &e->plan));
  ML_TRY(ml_tp_apply(&e->tp, &e->plan, &e->model, ml_mesh_comm(mesh, ML_GROUP_TP)));
  ML_TRY(ml_tp_check_sequence_parallel(&e->tp, &e->plan, opts->sequence_parallel));
  if (opts->batch_invariant) ML_TRY(ml_tp_whole_apply(&e->tp, &e->model)); /* tp's bits = 1's */
  ML_TRY(ml_cp_apply(&e->cp, &e->model, ml_mesh_comm(mesh, ML_GROUP_CP), e->be,
                     opts->batch_invariant));
  ML_TRY(ml_freeze_apply(&e->model, opts->freeze));
  if (e->lora.on) ml_lora_freeze_base(&e->model); /* PEFT: only the adapters train */
  ML_TRY(ml_fp32_params_apply(&e->model, opts->fp32_params)); /* fully_shard_by_dtype's */
  e->bwd_first = first_backward_layer(&e->model);
  ml_ckpt ck;
  if (!opts->no_weights) ML_TRY(ml_ckpt_open(model_dir, &ck));
  /* FSDP shards over dp_shard_cp (Automodel: cp ranks hold parameter shards too), HSDP
   * replicas over dp_replicate; the vocab rows stay where they are sharded unless lm_head's
   * output edge reassembles the vocab over tp (engine.h) */
  ml_comm *group = ml_mesh_comm(mesh, ML_GROUP_DP_SHARD_CP);
  bool vocab = (e->tp.size == 1 || !e->model.lm_head.out.fwd.fn) && !opts->batch_invariant;
  /* the experts Shard(0) over ep, FSDP over ep_shard (parallel/ep.h) */
  ml_fsdp_ep ep = {.ranks = mesh->groups[ML_GROUP_EP].size, .rank = mesh->groups[ML_GROUP_EP].rank,
                   .shard = ml_mesh_comm(mesh, ML_GROUP_EP_SHARD)};
  int rc = ml_fsdp_init_ep(&e->fsdp, &e->model, group, ml_mesh_comm(mesh, ML_GROUP_DP_REPLICATE),
                           cfg.n_experts > 0 ? &ep : NULL, &opts->fsdp, vocab,
                           opts->no_weights ? NULL : &ck);
  if (rc == 0) rc = export_order(e);
  if (rc == 0 && e->fsdp.vocab_parallel) ml_vocab_init(&e->vocab, group, e->be);
  if (rc == 0 && !opts->no_weights) rc = ml_lora_load(&e->lora, &e->fsdp, &e->model);
  if (opts->no_weights) return rc;
  if (rc == 0 && mesh->rank == 0) warn_unused(e, &ck);
  ml_ckpt_close(&ck);
  return rc;
}

void ml_engine_close(ml_engine *e) {
  ml_grads_free(&e->grads); /* in the shards' memory: before FSDP goes */
  ml_norm_parts_free(e);    /* likewise */
  ml_engine_reference_free(e); /* likewise (the policy's shards swapped back) */
  if (e->fsdp.units) ml_fsdp_destroy(&e->fsdp);
  ml_vocab_destroy(&e->vocab);
  ml_tp_destroy(&e->tp);
  ml_cp_destroy(&e->cp);
  ml_model_destroy(&e->model);
  ml_plan_free(&e->plan);
  ml_varlen_destroy(&e->varlen);
  free(e->positions);
  if (e->be) {
    ml_be_free(e->be, e->x);
    ml_be_free(e->be, e->ids);
    ml_be_host_free(e->be, e->host_ids);
    ml_be_host_free(e->be, e->host_shifted);
  }
  free(e->model_dir);
  free(e->freeze);
  free(e->order);
  free(e->order_k);
  free(e->fp32_params);
  ml_lora_free(&e->lora);
  memset(e, 0, sizeof *e);
}

/* Buffers and activations for a local batch of B sequences of S tokens
 * (this rank's piece of s of them under context parallelism): the model's
 * first (the largest, their messages naming the batch), then the residual
 * stream, the token ids and targets (device), and their host staging. B·S
 * saturates (common/checked.h): a batch beyond int64 fails its first
 * allocation. */
static int prepare(ml_engine *e, int64_t B, int64_t S) {
  int64_t s;
  ML_TRY(ml_cp_geometry(&e->cp, &e->model, S, &s));
  ML_TRY(ml_model_begin(&e->model, B, s));
  int64_t T = ml_mul_sat(B, s), H = e->model.cfg.hidden;
  if (T > e->cap_tokens) {
    ml_be_free(e->be, e->x);
    ml_be_free(e->be, e->ids);
    ml_be_host_free(e->be, e->host_ids);
    e->ids = e->host_ids = NULL;
    e->cap_tokens = 0;
    e->x = ml_be_alloc(e->be, ml_mul_sat(T, H), sizeof(float),
                       "the residual stream (%lld tokens per rank x hidden_size %lld)",
                       (long long)T, (long long)H);
    if (!e->x) return -1;
    /* ids then targets, T each (T fits: the residual stream's T·H did) */
    e->ids = ml_be_alloc(e->be, 2 * T, sizeof(int32_t), "the token ids (%lld tokens per rank)",
                         (long long)T);
    e->host_ids = ml_be_host_alloc(e->be, 2 * T, sizeof(int32_t),
                                   "the token ids (%lld tokens per rank)", (long long)T);
    if (!e->ids || !e->host_ids) return -1;
    e->targets = e->ids + T;
    e->cap_tokens = T;
  }
  if (e->vocab.comm) ML_TRY(ml_vocab_reserve(&e->vocab, T, H));
  int64_t full = ml_mul_sat(B, S);
  if (full > e->cap_shifted) {
    ml_be_host_free(e->be, e->host_shifted);
    e->cap_shifted = 0;
    e->host_shifted = ml_be_host_alloc(e->be, full, sizeof(int32_t),
                                       "the targets (%lld tokens)", (long long)full);
    if (!e->host_shifted) return -1;
    e->cap_shifted = full;
  }
  return 0;
}

static int document_positions(ml_engine *e, const ml_engine_batch *b);

int ml_engine_reserve(ml_engine *e, int64_t B, int64_t S, bool forward_only, const char *what) {
  e->model.forward_only = forward_only;
  snprintf(e->model.batch_what, sizeof e->model.batch_what, "%s", what ? what : "");
  if (e->packed) { /* the packed layout stays: positions for S tokens (one document) */
    int64_t whole[2] = {0, S};
    ML_TRY(document_positions(e, &(ml_engine_batch){.B = 1, .S = S, .docs = whole, .ndocs = 1}));
    e->model.position_ids = e->positions;
  }
  return prepare(e, B, S);
}

/* targets[b, t] = ids[b, t+1] where that token is a target, else −1. */
static void shift_targets(const int32_t *ids, const uint8_t *mask, int64_t B, int64_t S,
                          int32_t *targets) {
  for (int64_t b = 0; b < B; b++)
    for (int64_t t = 0; t < S; t++) {
      int64_t i = b * S + t;
      int ok = t + 1 < S && (!mask || mask[i + 1]);
      targets[i] = ok ? ids[i + 1] : -1;
    }
}

/* Where the loss finds its vocab columns: the tp group the logits are
 * vocab-sharded over (NULL when they are whole over tp), and under vocab
 * parallelism the FSDP group and lm_head's rows there. */
static int loss_split(ml_engine *e, ml_loss_split *s) {
  *s = (ml_loss_split){.tile_floats = e->opts.loss_tile_floats,
                       .batch_invariant = e->opts.batch_invariant};
  s->tp = e->tp.logits.kind == ML_SHARD ? ml_mesh_comm(e->mesh, ML_GROUP_TP) : NULL;
  if (!e->vocab.comm) return 0;
  s->group = &e->vocab;
  return ml_fsdp_rows(&e->fsdp, e->model.lm_head.weight, &s->rows);
}

bool ml_engine_casts_units(const ml_engine *e) { return e->opts.fsdp.param_dtype == ML_BF16; }

unsigned ml_engine_layer_cast(const ml_engine *e, int l, bool backward) {
  bool cast = ml_engine_casts_units(e);
  if (!backward) /* every layer's output into the next one's x_in, layer 0's input from x */
    return (l == 0 ? (cast ? ML_CAST_IN : 0u) : ML_CAST_IN_FUSED) | ML_CAST_OUT |
           (cast ? 0u : ML_CAST_FP32);
  if (!cast) return 0;
  unsigned in = l == e->model.cfg.n_layers - 1 ? ML_CAST_IN : ML_CAST_IN_FUSED;
  return in | (l > e->bwd_first ? ML_CAST_OUT : 0u);
}

/* Packed documents: the last token of each predicts nothing (the next
 * document is not its continuation), nor does the padding after them. */
static void cut_documents(const ml_engine_batch *b, int32_t *targets) {
  if (!b->docs) return;
  for (int64_t d = 0; d < b->ndocs; d++) targets[b->docs[d + 1] - 1] = -1;
  for (int64_t i = b->docs[b->ndocs]; i < b->B * b->S; i++) targets[i] = -1;
}

/* The batch on the device: this rank's piece of ids [B, S] and of their
 * targets, shifted on the whole sequences first (NeMo RL's seq_index
 * convention: a piece's last position scores the next piece's first token),
 * pads with id 0 and no target (host staging, then one copy). */
static int upload_batch(ml_engine *e, const ml_engine_batch *b) {
  int64_t B = b->B, T = B * e->model.S; /* fits: prepare allocated it */
  shift_targets(b->ids, b->mask, B, b->S, e->host_shifted);
  cut_documents(b, e->host_shifted);
  ml_cp_local_tokens(&e->cp, b->ids, B, 0, e->host_ids);
  ml_cp_local_tokens(&e->cp, e->host_shifted, B, -1, e->host_ids + T);
  /* ids and targets are one block of 2·cap_tokens; copy both halves in use */
  ML_TRY(ml_be_copy(e->be, e->ids, e->host_ids, sizeof(int32_t) * (size_t)T, ML_COPY_H2D));
  ML_TRY(ml_be_copy(e->be, e->targets, e->host_ids + T, sizeof(int32_t) * (size_t)T,
                    ML_COPY_H2D));
  /* vocab parallelism: every rank's tokens meet the vocab rows this rank holds */
  return e->vocab.comm ? ml_vocab_gather_tokens(&e->vocab, e->ids, e->targets, T) : 0;
}

bool ml_engine_can_pack(const ml_engine *e) {
  return e->cp.size == 1 && ml_be_supports(e->be, ML_OP_ATTENTION_BLOCK);
}

/* Each packed token's position in its document (padding from 0 too). */
static int document_positions(ml_engine *e, const ml_engine_batch *b) {
  if (b->S > e->cap_positions) {
    int64_t *p = ml_malloc_array(b->S, sizeof *p, "the position ids (%lld tokens)",
                                 (long long)b->S);
    if (!p) return -1;
    free(e->positions);
    e->positions = p;
    e->cap_positions = b->S;
  }
  for (int64_t d = 0; d <= b->ndocs; d++) {
    int64_t a = b->docs[d], z = d < b->ndocs ? b->docs[d + 1] : b->S;
    for (int64_t i = a; i < z; i++) e->positions[i] = i - a;
  }
  return 0;
}

/* The attention layout of batch b, then its geometry (prepare): packed
 * documents (their positions, the varlen core) or whole sequences per row.
 * A switch drops the activations: the cores' saved sizes may differ.
 * forward_only: no backward follows (ml_model.forward_only). */
static int begin_batch(ml_engine *e, const ml_engine_batch *b, bool forward_only) {
  e->model.forward_only = forward_only;
  bool packed = b->docs != NULL;
  if (packed && (!ml_engine_can_pack(e) || b->B != 1))
    return ml_err("packed documents need one row (B = %lld given), no context parallelism "
                  "(cp = %d) and a backend with block attention (%s)",
                  (long long)b->B, e->cp.size, e->be->ops->name);
  if (packed != e->packed) {
    ml_model_reset_acts(&e->model);
    e->model.attn_core = (ml_attn_core){0};
    e->model.position_ids = NULL;
    e->packed = packed;
  }
  if (packed) {
    e->varlen.be = e->be;
    e->varlen.ndocs = b->ndocs;
    e->varlen.cu = b->docs;
    e->varlen.used = NULL;
    ML_TRY(ml_varlen_check(&e->varlen, b->B, b->S));
    ML_TRY(document_positions(e, b));
    e->model.attn_core = ml_varlen_core(&e->varlen);
    e->model.position_ids = e->positions;
  }
  ML_TRY(prepare(e, b->B, b->S));
  /* the same geometry keeps its RoPE tables: rebuild them for these documents */
  return packed ? ml_model_set_positions(&e->model, e->positions) : 0;
}

/* Start the all-gathers of the `depth` units after u in `dir` (+1 forward,
 * −1 backward): FSDP2's prefetch, overlapping them with u's compute. Units
 * out of range or already materialised (the root) are skipped. */
static int prefetch(ml_engine *e, int u, int dir, int depth) {
  for (int k = 1; k <= depth; k++) ML_TRY(ml_fsdp_prefetch(&e->fsdp, u + dir * k));
  return 0;
}

/* The embedding of the uploaded batch into e->x: on the weight's local
 * view, or vocab-parallel on this rank's rows. */
static int embed_forward(ml_engine *e, const int32_t *ids) {
  if (!e->vocab.comm) return ml_embed_forward(&e->model, ids, e->x);
  ml_rows w;
  ML_TRY(ml_fsdp_rows(&e->fsdp, e->model.embed_tokens.weight, &w));
  return ml_vocab_embed_forward(&e->vocab, &e->model, &w, e->x);
}

// e->x: d(embedding output) → the embedding's weight gradient (+=); none when it is frozen
static int embed_backward(ml_engine *e, const int32_t *ids) {
  if (e->model.embed_tokens.weight->frozen) return 0;
  if (!e->vocab.comm) return ml_embed_backward(&e->model, ids, e->x);
  ml_rows w;
  ML_TRY(ml_fsdp_rows(&e->fsdp, e->model.embed_tokens.weight, &w));
  return ml_vocab_embed_backward(&e->vocab, &e->model, &w, e->x);
}

static int forward_layers(ml_engine *e, const int32_t *ids) {
  ml_fsdp *f = &e->fsdp;
  int L = (int)e->model.cfg.n_layers, root = L, depth = e->opts.fsdp.prefetch_forward;
  ML_TRY(ml_engine_batch_mode(e));
  ML_TRY(ml_fsdp_unshard(f, root));
  ML_TRY(prefetch(e, -1, 1, depth)); /* layers 0 .. depth−1 during the embedding */
  ML_TRY(embed_forward(e, ids));
  for (int l = 0; l < L; l++) {
    ML_TRY(ml_fsdp_unshard(f, l));
    ML_TRY(prefetch(e, l, 1, depth));
    ML_TRY(ml_layer_forward(&e->model, l, e->x, ml_engine_layer_cast(e, l, false)));
    if (f->units[l].reshard_after_forward && !e->hold) ml_fsdp_reshard(f, l);
  }
  return ml_head_begin(&e->model, e->x);
}

/* Backward's prefetch: as prefetch(), never below e->bwd_first (layers
 * backward does not run through). */
static int prefetch_backward(ml_engine *e, int u, int depth) {
  for (int k = 1; k <= depth && u - k >= e->bwd_first; k++)
    ML_TRY(ml_fsdp_prefetch(&e->fsdp, u - k));
  return 0;
}

static int backward_layers(ml_engine *e, const int32_t *ids) {
  ml_fsdp *f = &e->fsdp;
  int L = (int)e->model.cfg.n_layers, root = L, depth = e->opts.fsdp.prefetch_backward;
  ML_TRY(prefetch_backward(e, L, depth)); /* the last layers during the head's backward */
  ML_TRY(ml_head_end_backward(&e->model, e->x));  // x now holds d(residual)
  for (int l = L - 1; l >= e->bwd_first; l--) {
    ML_TRY(ml_fsdp_unshard(f, l));
    ML_TRY(prefetch_backward(e, l, depth));
    ML_TRY(ml_fsdp_grad_begin(f, l));
    ML_TRY(ml_layer_backward(&e->model, l, e->x, ml_engine_layer_cast(e, l, true)));
    ML_TRY(ml_fsdp_reduce_grads(f, l));
    ML_TRY(ml_norm_parts_unit(e, l));
    ml_fsdp_reshard(f, l);
  }
  for (int l = 0; l < e->bwd_first; l++) ml_fsdp_reshard(f, l); /* kept after forward (last) */
  ML_TRY(embed_backward(e, ids));
  ML_TRY(ml_fsdp_reduce_grads(f, root));
  ML_TRY(ml_norm_parts_unit(e, root));
  ml_fsdp_reshard(f, root);
  ML_TRY(ml_fsdp_finish_backward(f));
  ML_TRY(ml_grads_tp_reduce(&e->grads, &e->tp, f));
  return ml_norm_parts_finish(e);
}

/* The objective's inputs of the targets the loss runs over: this rank's
 * positions (host, [T]), or under vocab parallelism every rank's of the
 * group, in rank order as the targets are gathered ([d·T]). *buf: free. */
static int stage_objective(ml_engine *e, const ml_engine_batch *b, ml_obj_in **buf,
                           const ml_obj_in **in) {
  int64_t T = b->B * e->model.S;
  int d = e->vocab.comm ? e->vocab.comm->size : 1;
  *buf = ml_malloc_array(ml_mul_sat(T, d + 1), sizeof **buf,
                         "the objective's inputs (%lld tokens x %d ranks)", (long long)T, d);
  if (!*buf) return -1;
  ml_obj_in none = {.idx = -1};
  ml_cp_local_values(&e->cp, b->obj, b->B, sizeof none, &none, *buf);
  *in = *buf;
  if (d == 1) return 0;
  *in = *buf + T;
  return ml_host_all_gather(ml_mesh_host(e->mesh, ML_GROUP_DP_SHARD_CP), *buf,
                            sizeof none * (size_t)T, *buf + T);
}

/* Open the load-balancing loss's sums for a forward of b (model/moe.h): packed
 * documents' tokens from docs[ndocs] on are padding (HF attention_mask 0), and
 * so are context parallelism's past the sequence's end (its pieces' global
 * positions decide). */
static int aux_open(ml_engine *e, const ml_engine_batch *b) {
  ML_TRY(ml_moe_aux_begin(&e->model, b->docs ? b->docs[b->ndocs] : b->S));
  e->model.aux.pos = e->cp.size > 1 ? e->cp.position_ids : NULL; /* cp's padding: >= S */
  return 0;
}

/* The load-balancing loss of the forward that just ran (model/moe.h): its
 * sums over every data rank's tokens of the micro-batch (dp_cp), so that
 * every mesh computes the aux term of the whole batch, as one rank does. */
static int aux_close(ml_engine *e) {
  ml_moe_aux *x = &e->model.aux;
  if (!x->open) return 0;
  ML_TRY(ml_host_all_reduce_f64(ml_mesh_host(e->mesh, ML_GROUP_DP_CP), x->sums,
                                (int)(2 * e->model.cfg.n_experts + 1), ML_RED_SUM));
  ml_moe_aux_close(&e->model);
  return 0;
}

static int run_forward_backward(ml_engine *e, const ml_engine_batch *b, const ml_loss_grad *g,
                                ml_loss_out *nll) {
  ML_TRY(upload_batch(e, b));
  ml_norm_parts_begin(e);
  ML_TRY(ml_grads_tp_begin(&e->grads, &e->tp, &e->fsdp));
  ML_TRY(aux_open(e, b));
  ML_TRY(forward_layers(e, e->ids));
  ML_TRY(aux_close(e));
  ML_TRY(ml_fsdp_grad_begin(&e->fsdp, (int)e->model.cfg.n_layers));
  ml_loss_split split;
  ML_TRY(loss_split(e, &split));
  ML_TRY(ml_vocab_parallel_loss(&e->model, &split, e->targets, e->opts.output_dtype, g, NULL,
                                nll));
  return backward_layers(e, e->ids);
}

int ml_engine_forward_backward_batch(ml_engine *e, const ml_engine_batch *b,
                                     const ml_objective *o, float global_scale,
                                     ml_obj_sums *sums, ml_loss_out *nll) {
  ML_TRY(ml_engine_train_state(e));
  ML_TRY(begin_batch(e, b, false));
  /* LoRA dropout's mask context; under cp the model's positions are the sequence's */
  ML_TRY(ml_lora_dropout_begin(&e->lora, &e->model, ml_mesh_host(e->mesh, ML_GROUP_DP), e->step,
                               b->B, b->S, e->cp.size > 1 ? e->model.position_ids : NULL));
  ml_loss_grad g = {global_scale, o, NULL, sums};
  ml_obj_in *buf = NULL;
  if (o && !b->obj) return ml_err("an objective without its inputs (ml_engine_batch.obj)");
  int rc = o ? stage_objective(e, b, &buf, &g.in) : 0;
  if (rc == 0) rc = run_forward_backward(e, b, &g, nll);
  ml_lora_dropout_end(&e->model);
  free(buf);
  return rc;
}

int ml_engine_forward_backward(ml_engine *e, const int32_t *ids, const uint8_t *mask, int64_t B,
                               int64_t S, int64_t global_targets, double *loss) {
  ml_engine_batch b = {.ids = ids, .mask = mask, .B = B, .S = S};
  float scale = global_targets > 0 ? 1.0f / (float)global_targets : 0.0f;
  ml_loss_out lo;
  ML_TRY(ml_engine_forward_backward_batch(e, &b, NULL, scale, NULL, &lo));
  double sum = lo.loss_sum;
  /* control plane: the loss sum over the data ranks (dp_cp: cp ranks see the same sequences) */
  ML_TRY(ml_host_all_reduce_f64(ml_mesh_host(e->mesh, ML_GROUP_DP_CP), &sum, 1, ML_RED_SUM));
  *loss = global_targets > 0 ? sum / (double)global_targets : 0.0;
  *loss += e->model.cfg.aux_coef * e->model.aux.value; /* 0 without cfg.router_aux */
  return 0;
}

/* Log-probs lp [B, s] of this cp rank's positions → out [B, S−1] in the
 * original order: with cp > 1 gathered over the cp group. */
static int logprobs_out(ml_engine *e, const float *lp, int64_t B, int64_t S, float *out) {
  int64_t s = e->model.S;
  if (e->cp.size == 1) {
    for (int64_t b = 0; b < B; b++)
      ML_TRY(ml_be_copy(e->be, out + b * (S - 1), lp + b * s, sizeof(float) * (size_t)(S - 1),
                        ML_COPY_D2H));
    return 0;
  }
  int64_t n = ml_mul_sat(B * s, e->cp.size); /* every cp rank's pieces */
  float *work = ml_be_alloc(e->be, n, sizeof(float), "the gathered log-probs (%lld)", (long long)n);
  float *host = ml_be_host_alloc(e->be, ml_add_sat(n, B * S), sizeof(float),
                                 "the gathered log-probs (%lld)", (long long)n);
  int rc = work && host ? 0 : -1;
  float *full = host ? host + n : NULL; /* [B, S] */
  if (!rc) rc = ml_cp_gather_tokens(&e->cp, lp, B, work, host, full);
  for (int64_t b = 0; rc == 0 && b < B; b++)
    memcpy(out + b * (S - 1), full + b * S, sizeof(float) * (size_t)(S - 1));
  ml_be_free(e->be, work);
  ml_be_host_free(e->be, host);
  return rc;
}

/* Forward only over batch b: the loss pass's NLL of this rank's targets
 * and, with lp, this rank's log-probs (*lp: [B·s] on the device, the
 * caller's to free); then the gathered units are resharded (what the
 * backward would have done), unless held. */
/* The device buffers of what `want` asks for beyond the log-probs, for T
 * tokens, into *ex (zeroed; the caller frees them, also after an error). */
static int extras_alloc(ml_engine *e, int64_t T, const ml_engine_scores *want,
                        ml_loss_extra *ex) {
  int64_t k = want->topk, n = ml_mul_sat(T, k);
  ex->topk = k;
  if (want->entropy && !(ex->entropy = ml_be_alloc(e->be, T, sizeof(float),
                                                   "the entropies (%lld tokens)", (long long)T)))
    return -1;
  if (k && !(ex->topk_logprobs = ml_be_alloc(e->be, n, sizeof(float),
                                             "the top-k log-probs (%lld tokens x k %lld)",
                                             (long long)T, (long long)k)))
    return -1;
  if (k && !(ex->topk_ids = ml_be_alloc(e->be, n, sizeof(int32_t),
                                        "the top-k ids (%lld tokens x k %lld)", (long long)T,
                                        (long long)k)))
    return -1;
  return 0;
}

static int forward_only(ml_engine *e, const ml_engine_batch *b, float **lp,
                        const ml_engine_scores *want, ml_loss_extra *ex, ml_loss_out *nll) {
  bool aux = want && want->aux;
  ML_TRY(begin_batch(e, b, true));
  ML_TRY(upload_batch(e, b));
  if (aux) ML_TRY(aux_open(e, b));
  ML_TRY(forward_layers(e, e->ids));
  if (aux) {
    ML_TRY(aux_close(e));
    *want->aux = e->model.cfg.aux_coef * e->model.aux.value; /* 0 without router_aux */
  }
  int64_t T = b->B * e->model.S; /* fits: prepare allocated B·s·H floats */
  ml_loss_split split;
  int rc = want ? extras_alloc(e, T, want, ex) : 0;
  if (!rc && lp && !(*lp = ml_be_alloc(e->be, T, sizeof(float),
                                       "the log-probs (%lld tokens per rank)", (long long)T)))
    rc = -1;
  if (!rc) rc = loss_split(e, &split);
  if (!rc)
    rc = ml_vocab_parallel_scores(&e->model, &split, e->targets, e->opts.output_dtype, NULL,
                                  lp ? *lp : NULL, want ? ex : NULL, nll);
  for (int u = 0; !e->hold && u < e->fsdp.n_units; u++) ml_fsdp_reshard(&e->fsdp, u);
  return rc;
}

int ml_engine_logprobs_batch(ml_engine *e, const ml_engine_batch *b, float *out) {
  float *lp = NULL;
  ml_loss_out lo;
  int rc = forward_only(e, b, &lp, NULL, NULL, &lo);
  if (!rc) rc = logprobs_out(e, lp, b->B, b->S, out);
  ml_be_free(e->be, lp);
  return rc;
}

/* The top-k lists [B, s, k] on the device → out [B, S−1, k] (cp = 1). */
static int topk_out(ml_engine *e, const void *dev, int64_t B, int64_t S, int64_t k, void *out) {
  int64_t s = e->model.S;
  size_t row = sizeof(float) * (size_t)((S - 1) * k);
  for (int64_t b = 0; b < B; b++)
    ML_TRY(ml_be_copy(e->be, (char *)out + (size_t)b * row,
                      (const char *)dev + sizeof(float) * (size_t)(b * s * k), row, ML_COPY_D2H));
  return 0;
}

int ml_engine_scores_batch(ml_engine *e, const ml_engine_batch *b, const ml_engine_scores *out) {
  int64_t k = out->topk;
  if (k < 0) return ml_err("top-k: k is %lld; expected k >= 0", (long long)k);
  if (k > 0 && e->cp.size > 1)
    return ml_err("top-k log-probs under context parallelism (cp %d): not implemented; "
                  "expected cp = 1",
                  e->cp.size);
  if (k > 0 && (!out->topk_logprobs || !out->topk_ids))
    return ml_err("top-k: k is %lld but topk_logprobs or topk_ids is NULL", (long long)k);
  ml_loss_extra ex = {0};
  float *lp = NULL;
  ml_loss_out lo;
  int rc = forward_only(e, b, out->logprobs ? &lp : NULL, out, &ex, &lo);
  if (!rc && out->logprobs) rc = logprobs_out(e, lp, b->B, b->S, out->logprobs);
  if (!rc && out->entropy) rc = logprobs_out(e, ex.entropy, b->B, b->S, out->entropy);
  if (!rc && k) rc = topk_out(e, ex.topk_logprobs, b->B, b->S, k, out->topk_logprobs);
  if (!rc && k) rc = topk_out(e, ex.topk_ids, b->B, b->S, k, out->topk_ids);
  ml_be_free(e->be, ex.topk_ids);
  ml_be_free(e->be, ex.topk_logprobs);
  ml_be_free(e->be, ex.entropy);
  ml_be_free(e->be, lp);
  return rc;
}

int ml_engine_nll_batch(ml_engine *e, const ml_engine_batch *b, ml_loss_out *nll) {
  if (b->obj) return ml_err("ml_engine_nll_batch: the NLL takes no objective inputs (obj)");
  return forward_only(e, b, NULL, NULL, NULL, nll);
}

int ml_engine_logprobs(ml_engine *e, const int32_t *ids, int64_t B, int64_t S, float *out) {
  ml_engine_batch b = {.ids = ids, .B = B, .S = S};
  return ml_engine_logprobs_batch(e, &b, out);
}

void ml_engine_hold_params(ml_engine *e, bool hold) {
  e->hold = hold;
  for (int u = 0; !hold && u < e->fsdp.n_units; u++) ml_fsdp_reshard(&e->fsdp, u);
}

int ml_engine_train_state(ml_engine *e) {
  ML_TRY(ml_fsdp_train_state(&e->fsdp));
  return ml_norm_parts_alloc(e);
}

int ml_engine_zero_grad(ml_engine *e) {
  e->lora.micro = 0; /* LoRA dropout numbers the step's micro-batches from 0 */
  ML_TRY(ml_engine_train_state(e));
  ml_norm_parts_drop(e);
  ml_fsdp_zero_grads(&e->fsdp);
  return 0;
}

void ml_engine_owned_rows(const ml_engine *e, const ml_fsdp_unit *unit, int i, int64_t *skip,
                          int64_t *nr) {
  const ml_param *p = unit->params[i];
  int64_t r0, start, len, own;
  ml_fsdp_param_rows(&e->fsdp, unit, i, &r0, nr);
  ml_tp_param_slice(&e->tp, &e->model, p, e->mesh->tp_rank, &start, &len, &own);
  if (ml_tp_param_dim(&e->tp, &e->model, p) == 1) own = start; /* column cuts own their rows */
  if (unit->layer >= 0) own = start; /* an expert unit: its rows on this rank alone (ep.h) */
  *skip = own - start - r0; /* local rows before `own` belong to a lower tp rank */
  if (*skip < 0) *skip = 0;
  if (unit->rep->rank != 0 || *skip > *nr) *skip = *nr; /* an HSDP replica > 0 of the unit */
  *nr -= *skip;
}

int ml_engine_find_nonfinite(ml_engine *e, char *name, size_t cap) {
  ml_fsdp *f = &e->fsdp;
  double first = INFINITY; /* export index of this rank's first non-finite gradient */
  ML_TRY(ml_engine_train_state(e));
  ML_TRY(ml_fsdp_settle_grads(f)); /* a fresh unit's gradient reads as zeros */
  for (int u = 0; u < f->n_units; u++) {
    const ml_fsdp_unit *unit = &f->units[u];
    for (int i = 0; i < unit->n; i++) {
      const ml_param *p = unit->params[i];
      double k = e->order_k[p - e->model.params];
      if (p->frozen || k >= first) continue; /* no gradient, or a later one */
      bool found;
      ML_TRY(ml_be_find_nonfinite(f->shard_be, unit->shard_grad + unit->shard_off[i],
                                  unit->chunk_rows[i] * p->local[1], &found));
      if (found) first = k;
    }
  }
  ML_TRY(ml_host_all_reduce_f64(ml_mesh_host(e->mesh, ML_GROUP_WORLD), &first, 1, ML_RED_MIN));
  if (isinf(first)) return 0;
  snprintf(name, cap, "%s", e->order[(int)first]->name);
  return 1;
}

/* The factor clip_grad_norm_ multiplies the gradients by: max_norm /
 * (norm + 1e-6) in fp32 when that is < 1; else 1 (no clipping). */
static float clip_coef(double norm, double max_norm) {
  double coef = max_norm / (norm + 1e-6);
  return max_norm > 0 && coef < 1.0 ? (float)coef : 1.0f;
}

int ml_engine_clip(ml_engine *e, double norm, double max_norm) {
  float coef = clip_coef(norm, max_norm);
  if (coef == 1.0f) return 0;
  ML_TRY(ml_engine_train_state(e));
  ML_TRY(ml_fsdp_settle_grads(&e->fsdp));
  ml_norm_parts_drop(e);
  for (int u = 0; u < e->fsdp.n_units; u++) {
    ml_fsdp_unit *unit = &e->fsdp.units[u];
    if (unit->frozen) continue; /* no gradient (a partly frozen unit: its leading grad_numel) */
    ML_TRY(ml_be_scale(e->fsdp.shard_be, unit->shard_grad, unit->grad_numel, coef));
  }
  return 0;
}

/* AdamW (elementwise) on elements [at, at + n) of unit's shard; where the
 * unit's persistent bf16 shard is current (parallel/fsdp.h lp_fresh) the
 * same pass rounds the updated weights into it, so it stays current (a
 * stale one is rounded whole at the next unshard). */
static int adamw_range(ml_engine *e, ml_fsdp_unit *unit, int64_t at, int64_t n, float grad_scale,
                       const ml_adamw_cfg *c) {
  uint16_t *lp = unit->lp && unit->lp_fresh ? unit->lp + at : NULL;
  return ml_be_adamw(e->fsdp.shard_be, unit->shard + at, unit->shard_grad + at, unit->adam_m + at,
                     unit->adam_v + at, lp, n, grad_scale, c->lr, c->beta1, c->beta2, c->eps,
                     c->weight_decay, e->step);
}

/* AdamW on every unit's shard, its gradients first scaled by grad_scale in
 * the same pass (ml_be_adamw); then the parameters' sync. Frozen
 * parameters are not stepped (torch.optim skips a parameter whose grad is
 * None: no weight decay, no state): a frozen unit is skipped, a partly
 * frozen one stepped chunk by chunk over its trainable parameters (the
 * same elementwise update, so the same bits; their chunks lie within
 * grad_numel, parallel/fsdp.h). */
static int adamw_scaled(ml_engine *e, float grad_scale, const ml_adamw_cfg *c) {
  ML_TRY(ml_engine_train_state(e));
  ML_TRY(ml_fsdp_settle_grads(&e->fsdp)); /* a step without a backward: zero gradients */
  e->step++;
  for (int u = 0; u < e->fsdp.n_units; u++) {
    ml_fsdp_unit *unit = &e->fsdp.units[u];
    if (unit->frozen) continue;
    bool partly = false;
    for (int i = 0; i < unit->n; i++) partly = partly || unit->params[i]->frozen;
    if (!partly) {
      ML_TRY(adamw_range(e, unit, 0, unit->shard_numel, grad_scale, c));
      continue;
    }
    for (int i = 0; i < unit->n; i++)
      if (!unit->params[i]->frozen)
        ML_TRY(adamw_range(e, unit, unit->shard_off[i],
                           unit->chunk_rows[i] * unit->params[i]->local[1], grad_scale, c));
  }
  return ml_engine_sync_params(e);
}

int ml_engine_adamw(ml_engine *e, const ml_adamw_cfg *c) { return adamw_scaled(e, 1.0f, c); }

int ml_engine_clip_adamw(ml_engine *e, double norm, double max_norm, const ml_adamw_cfg *c) {
  ml_norm_parts_drop(e); /* the gradients are scaled in place */
  return adamw_scaled(e, clip_coef(norm, max_norm), c);
}

int ml_engine_sync_params(ml_engine *e) { return ml_fsdp_sync_params(&e->fsdp); }

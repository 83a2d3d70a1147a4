/* Mesh parity: `mpiexec -n N test_parity FIXTURE TP [sp] [cp=C] [ep=P] [dpr=R] [bi]`.
 * The mesh (dp_shard = N / (C·TP) × cp = C × tp = TP, sequence-parallel with `sp`, context
 * parallel with cp=C: ring attention, parallel/cp.h; expert parallel with ep=P: the sparse
 * layers' experts split over ep groups of P ranks, parallel/ep.h; HSDP with dpr=R replicas,
 * dp_shard = N / (R·C·TP); both runs in the batch-invariant mode with bi, where tp computes
 * each row-parallel linear whole, parallel/tp_whole.h, and backward stays the default's) must
 * reproduce HF
 * transformers' fixture and the single-rank run (a mesh over MPI_COMM_SELF, computed on every
 * rank): the loss, the per-token log-probs (rel L2), every parameter gradient (rel L2) within the
 * bounds tolerance.h §3 derives from the model's sizes; 3 AdamW steps on the mesh, each against
 * AdamW in double on the mesh's own state (§5), then one step against one rank on the same
 * parameters (train_check.h). It also checks the collectives of one step
 * against the counts the base plan, FSDP and vocab parallelism over FSDP's
 * group imply (ARCHITECTURE.md §5, §6, parallel/vocab.h).
 * grads.safetensors must hold exactly the built parameters; checkpoint
 * tensors without a gradient are allowed only in a vision-language fixture
 * (expected.json "text_prefix") and only outside its text tower. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "engine_run.h"
#include "parallel/ep.h"
#include "parallel/loss.h"
#include "tensor/placement.h"
#include "parity_util.h"
#include "train_check.h"

static const char *g_fixture;
static int g_tp;
static bool g_sp; /* the mesh run uses --sequence-parallel */
static int g_cp = 1;
static int g_ep = 1;
static int g_dpr = 1; /* dp_replicate of the mesh run */
static bool g_bi;    /* both runs in the batch-invariant mode (ml_engine_opts.batch_invariant) */

/* The fixture over `base` with tp; the mesh run (MPI_COMM_WORLD) is
 * sequence-parallel with `sp`. */
static void open_on(run *r, MPI_Comm base, int tp, const fixture *fx) {
  ml_engine_opts opts = ml_engine_opts_default();
  opts.sequence_parallel = base == MPI_COMM_WORLD && g_sp;
  opts.batch_invariant = g_bi;
  bool world = base == MPI_COMM_WORLD;
  run_open_ep(r, base, world ? g_dpr : 1, world ? g_cp : 1, tp, world ? g_ep : 1, &opts, fx->dir,
              NULL, NULL);
}

/* This dp rank's rows of the fixture batch. */
static void local_batch(const run *r, const fixture *fx, const int32_t **ids, const uint8_t **mask,
                        int64_t *Bl) {
  int dp = r->mesh.groups[ML_GROUP_DP].size, d = r->mesh.groups[ML_GROUP_DP].rank;
  assert_int_equal(fx->B % dp, 0);
  *Bl = fx->B / dp;
  *ids = fx->ids + d * *Bl * fx->S;
  *mask = fx->mask + d * *Bl * fx->S;
}

static double step(run *r, const fixture *fx) {
  const int32_t *ids;
  const uint8_t *mask;
  int64_t Bl;
  local_batch(r, fx, &ids, &mask, &Bl);
  double loss;
  ml_engine_zero_grad(&r->e);
  if (ml_engine_forward_backward(&r->e, ids, mask, Bl, fx->S, fx->targets, &loss))
    fail_msg("step: %s", ml_error_msg());
  return loss;
}

/* Load the fixture and open both runs on it: `one` over MPI_COMM_SELF (tp 1)
 * and `mesh` over MPI_COMM_WORLD (tp g_tp). */
static void open_pair(fixture *fx, run *one, run *mesh) {
  fixture_load(g_fixture, fx);
  open_on(one, MPI_COMM_SELF, 1, fx);
  open_on(mesh, MPI_COMM_WORLD, g_tp, fx);
}

static void close_pair(fixture *fx, run *one, run *mesh) {
  run_close(mesh);
  run_close(one);
  fixture_free(fx);
}

/* Whether some parameter of m is (a part of) checkpoint tensor `key`. */
static bool is_key(const ml_model *m, const char *key) {
  for (int i = 0; i < m->n_params; i++)
    if (strcmp(m->params[i].key, key) == 0) return true;
  return false;
}

/* Every gradient of the fixture belongs to built parameters (a fused
 * tensor's to its parts: ml_param.key), and every
 * checkpoint tensor without one is outside the text tower of a
 * vision-language fixture (the vision tower and projector, never built). */
static void check_grad_names(const fixture *fx, ml_model *m, const ml_st_file *ref) {
  for (size_t i = 0; i < ref->n; i++)
    if (!is_key(m, ref->tensors[i].name))
      fail_msg("grads.safetensors has %s, a parameter this model does not build",
               ref->tensors[i].name);
  ml_ckpt ck;
  if (ml_ckpt_open(fx->dir, &ck)) fail_msg("%s", ml_error_msg());
  size_t np = strlen(fx->text_prefix), skipped = 0;
  char bad[512] = "";
  for (size_t f = 0; f < ck.nfiles && !bad[0]; f++)
    for (size_t i = 0; i < ck.files[f].n && !bad[0]; i++) {
      const char *name = ck.files[f].tensors[i].name;
      if (ml_st_find(ref, name)) continue;
      if (!np)
        snprintf(bad, sizeof bad,
                 "checkpoint tensor %s has no gradient in grads.safetensors; only a "
                 "vision-language fixture (\"text_prefix\") may have such tensors",
                 name);
      else if (strncmp(name, fx->text_prefix, np) == 0)
        snprintf(bad, sizeof bad,
                 "text-tower tensor %s (prefix %s) has no gradient in "
                 "grads.safetensors",
                 name, fx->text_prefix);
      else
        skipped++;
    }
  ml_ckpt_close(&ck);
  if (bad[0]) fail_msg("%s", bad);
  if (np && rank0())
    printf("checkpoint tensors outside the text tower (not built): %zu\n", skipped);
}

static void st_release(void *p) { ml_st_close(p); }

/* The sizes tolerance.h §3 counts for r on the fixture batch. */
static tol_model dims(const run *r, const fixture *fx) {
  return tol_model_of(r, fx->S, fx->B * fx->S);
}

/* Loss and gradients vs the fixture and vs the single-rank run. */
static void test_loss_and_grads(void **state) {
  (void)state;
  static fixture fx; /* held: static, see held.h */
  static run one, mesh;
  open_pair(&fx, &one, &mesh);
  double l1 = step(&one, &fx), lm = step(&mesh, &fx);
  tol_model tm = dims(&mesh, &fx);
  double tl_hf = tol_model_vs_ref(&tm, TOL_LOSS), tl_pair = tol_model_pair(&tm, TOL_LOSS);
  double tg_hf = tol_model_vs_ref(&tm, TOL_GRADS), tg_pair = tol_model_pair(&tm, TOL_GRADS);
  double e1 = fabs(l1 - fx.loss) / fx.loss, em = fabs(lm - fx.loss) / fx.loss;
  double e1m = fabs(lm - l1) / fabs(l1);
  if (rank0())
    printf(
        "loss: hf %.9f one %.9f mesh %.9f (rel err one %.3g, mesh %.3g, bound %.3g; mesh vs "
        "one %.3g, bound %.3g)\n",
        fx.loss, l1, lm, e1, em, tl_hf, e1m, tl_pair);
  assert_true(e1 <= tl_hf);
  assert_true(em <= tl_hf);
  assert_true(e1m <= tl_pair);
  float **g1 = export_all(&one, ML_EXPORT_GRADS), **gm = export_all(&mesh, ML_EXPORT_GRADS);
  char path[600];
  snprintf(path, sizeof path, "%s/grads.safetensors", fx.dir);
  static ml_st_file ref;
  if (ml_st_open(path, &ref)) fail_msg("%s", ml_error_msg());
  hold(&ref, st_release);
  check_grad_names(&fx, &one.e.model, &ref);
  double worst_hf = 0, worst_one = 0;
  char bad[512] = "";
  for (int i = 0; i < one.e.model.n_params && !bad[0]; i++) {
    const ml_param *p = ml_engine_export_param(&mesh.e, i);
    const ml_st_tensor *t = ml_st_find(&ref, p->key); /* p: rows key_row0.. of it */
    if (!t) {
      snprintf(bad, sizeof bad, "grads.safetensors has no %s", p->key);
      break;
    }
    int64_t n = p->shape[0] * p->shape[1];
    float *want = malloc(sizeof(float) * (size_t)n);
    if (ml_st_read_block(t, p->key_row0, p->shape[0], 0, p->shape[1], want))
      snprintf(bad, sizeof bad, "%s: %s", p->name, ml_error_msg());
    double e_hf = rel_l2(gm[i], want, n), e_one = rel_l2(gm[i], g1[i], n);
    double e_1hf = rel_l2(g1[i], want, n);
    free(want);
    worst_hf = fmax(worst_hf, fmax(e_hf, e_1hf));
    worst_one = fmax(worst_one, e_one);
    if (!bad[0] && (e_hf > tg_hf || e_1hf > tg_hf || e_one > tg_pair))
      snprintf(bad, sizeof bad,
               "%s: grad rel L2 mesh-vs-hf %.3g, one-vs-hf %.3g (bound %.3g), mesh-vs-one %.3g "
               "(bound %.3g)",
               p->name, e_hf, e_1hf, tg_hf, e_one, tg_pair);
  }
  if (rank0())
    printf("grads: worst rel L2 vs hf %.3g (bound %.3g), mesh vs one rank %.3g (bound %.3g)\n",
           worst_hf, tg_hf, worst_one, tg_pair);
  if (bad[0]) fail_msg("%s", bad);
  unhold(&ref);
  ml_st_close(&ref);
  free_all(g1);
  free_all(gm);
  close_pair(&fx, &one, &mesh);
}

static void test_logprobs(void **state) {
  (void)state;
  static fixture fx;
  fixture_load(g_fixture, &fx);
  static run mesh;
  open_on(&mesh, MPI_COMM_WORLD, g_tp, &fx);
  int64_t n = fx.B * (fx.S - 1);
  float *out = malloc(sizeof(float) * (size_t)n);
  hold(out, free);
  if (ml_engine_logprobs(&mesh.e, fx.ids, fx.B, fx.S, out)) fail_msg("%s", ml_error_msg());
  /* rel L2 over the batch's log-probs: the norm tolerance.h §3 bounds */
  double num = 0, den = 0, worst = 0;
  for (int64_t i = 0; i < n; i++) {
    double d = out[i] - fx.logprobs[i];
    num += d * d;
    den += fx.logprobs[i] * fx.logprobs[i];
    worst = fmax(worst, fabs(d));
  }
  tol_model tm = dims(&mesh, &fx);
  double rel = sqrt(num / den), bound = tol_model_vs_ref(&tm, TOL_LOGPROBS);
  if (rank0())
    printf("logprobs: rel L2 vs hf %.3g (bound %.3g), max abs error %.3g\n", rel, bound, worst);
  assert_true(rel <= bound);
  unhold(out);
  free(out);
  run_close(&mesh);
  fixture_free(&fx);
}

/* Three AdamW steps on the mesh, each checked against AdamW in double on
 * the mesh's own state; then the mesh's next step against one rank on the
 * same parameters. */
static void test_adamw_steps(void **state) {
  (void)state;
  static fixture fx;
  fixture_load(g_fixture, &fx);
  static batch b;
  batch_make(&fx, fx.B, &b);
  static run mesh;
  open_on(&mesh, MPI_COMM_WORLD, g_tp, &fx);
  ml_adamw_cfg adam = {1e-3, 0.9, 0.999, 1e-8, 0.1};
  double worst = 0;
  for (int s = 0; s < 3; s++) checked_step(&mesh, &b, &adam, 1.0, &worst);
  if (rank0())
    printf("3 AdamW steps on the mesh: worst error/bound vs AdamW in double %.3g\n", worst);
  check_replay_one_rank(&mesh, &b);
  run_close(&mesh);
  batch_free(&b);
  fixture_free(&fx);
}

/* Context parallelism on a sequence whose length 2·cp does not divide and
 * whose chunks are longer than Gemma3's sliding window: the fixture's two
 * rows joined and cut to 2·S − 1 tokens (47: padded to 48, parallel/cp.h),
 * the same sequence on every dp rank. Also under ep with tp (no cp): a
 * sparse layer's 47 tokens then split unevenly over tp (torch.chunk: 24 and
 * 23 under tp 2, model/moe.h). The mesh against one rank: loss,
 * every gradient and the log-probs within the pair bounds of tolerance.h §3
 * (two fp32 evaluations in different orders). */
static void test_long_uneven(void **state) {
  (void)state;
  if (g_cp == 1 && (g_ep == 1 || g_tp == 1)) skip();
  static fixture fx;
  fixture_load(g_fixture, &fx);
  int64_t S = 2 * fx.S - 1;
  int32_t *ids = malloc(sizeof(int32_t) * (size_t)S);
  uint8_t *mask = malloc((size_t)S);
  float *lp1 = malloc(sizeof(float) * (size_t)(2 * (S - 1))), *lpm = lp1 + S - 1;
  hold(ids, free);
  hold(mask, free);
  hold(lp1, free);
  memcpy(ids, fx.ids, sizeof(int32_t) * (size_t)S); /* rows 0 and 1 are consecutive */
  memset(mask, 1, (size_t)S);
  static run one, mesh;
  open_on(&one, MPI_COMM_SELF, 1, &fx);
  open_on(&mesh, MPI_COMM_WORLD, g_tp, &fx);
  int dp = mesh.mesh.groups[ML_GROUP_DP].size;
  double l1, lm;
  ml_engine_zero_grad(&one.e);
  ml_engine_zero_grad(&mesh.e);
  if (ml_engine_forward_backward(&one.e, ids, mask, 1, S, S - 1, &l1) ||
      ml_engine_forward_backward(&mesh.e, ids, mask, 1, S, dp * (S - 1), &lm))
    fail_msg("step: %s", ml_error_msg());
  tol_model tm = tol_model_of(&mesh, S, dp * S);
  double tl = tol_model_pair(&tm, TOL_LOSS), tg = tol_model_pair(&tm, TOL_GRADS);
  double el = fabs(lm - l1) / fabs(l1), eg = 0;
  float **g1 = export_all(&one, ML_EXPORT_GRADS), **gm = export_all(&mesh, ML_EXPORT_GRADS);
  for (int i = 0; i < one.e.model.n_params; i++) {
    const ml_param *p = ml_engine_export_param(&one.e, i);
    eg = fmax(eg, rel_l2(gm[i], g1[i], p->shape[0] * p->shape[1]));
  }
  free_all(g1);
  free_all(gm);
  if (ml_engine_logprobs(&one.e, ids, 1, S, lp1) || ml_engine_logprobs(&mesh.e, ids, 1, S, lpm))
    fail_msg("logprobs: %s", ml_error_msg());
  double num = 0, den = 0, worst = 0;
  for (int64_t t = 0; t < S - 1; t++) {
    double d = (double)lpm[t] - lp1[t];
    num += d * d;
    den += (double)lp1[t] * lp1[t];
    worst = fmax(worst, fabs(d));
  }
  double elp = sqrt(num / den), tlp = tol_model_pair(&tm, TOL_LOGPROBS);
  if (rank0())
    printf("S=%lld (cp %d pads to a multiple of %d; tp %d, ep %d), mesh vs one rank: loss rel "
           "%.3g (bound %.3g), grads worst rel L2 %.3g (bound %.3g), logprobs rel L2 %.3g "
           "(bound %.3g), max abs %.3g\n",
           (long long)S, g_cp, 2 * g_cp, g_tp, g_ep, el, tl, eg, tg, elp, tlp, worst);
  assert_true(el <= tl);
  assert_true(eg <= tg);
  assert_true(elp <= tlp);
  run_close(&mesh);
  run_close(&one);
  unhold(lp1);
  unhold(mask);
  unhold(ids);
  free(lp1);
  free(mask);
  free(ids);
  fixture_free(&fx);
}

/* The sparse (mixture-of-experts) layers of m. */
static int64_t sparse_layers(const ml_model *m) {
  int64_t n = 0;
  for (int64_t l = 0; l < m->cfg.n_layers; l++) n += m->layers[l].moe.experts != NULL;
  return n;
}

static int64_t calls(ml_comm *c, ml_coll k) { return ml_comm_stats_of(c)->calls[k]; }
static int64_t bytes(ml_comm *c, ml_coll k) { return ml_comm_stats_of(c)->bytes[k]; }

/* Bytes of the one all-reduce that sums tp-replicated params' Partial
 * grads (SP norms, q_norm/k_norm on head-sharded q/k): their shard rows. */
static int64_t partial_bytes(const run *r) {
  int64_t n = 0;
  for (int u = 0; u < r->e.fsdp.n_units; u++) {
    const ml_fsdp_unit *unit = &r->e.fsdp.units[u];
    for (int i = 0; i < unit->n; i++)
      if (ml_tp_grad_partial(&r->e.tp, unit->params[i]))
        n += 4 * unit->chunk_rows[i] * unit->params[i]->local[1];
  }
  return n;
}

/* Bytes of the all-reduce (over tp, and again over dp_shard_cp) that sums
 * the partial grads of kv heads several tp ranks hold (parallel/tp.h): the
 * shared heads counted here from the head split (query heads as
 * torch.tensor_split; rank r > 0 shares its first kv head with rank r − 1
 * when its first query head is inside a group), their hd rows of k_proj
 * and v_proj (weight and bias) in every layer. */
static int64_t kv_shared_bytes(const run *r) {
  const ml_model_config *c = &r->e.model.cfg;
  int tp = r->mesh.tp;
  int64_t g = c->n_heads / c->n_kv_heads, shared = 0, last = -1;
  if (ml_tp_param_dim(&r->e.tp, &r->e.model, r->e.model.layers[0].q_proj.weight) != 0) return 0;
  for (int k = 1; k < tp; k++) {
    int64_t q0 = k * (c->n_heads / tp) + (k < c->n_heads % tp ? k : c->n_heads % tp);
    if (q0 % g && q0 / g != last) shared++, last = q0 / g;
  }
  const ml_linear *kp = &r->e.model.layers[0].k_proj;
  int64_t row = kp->weight->shape[1] + (kp->bias ? 1 : 0);
  return 4 * c->n_layers * 2 * shared * c->head_dim * row;
}

/* One training step's collectives, per mesh group, vs ARCHITECTURE.md §5/§6 and
 * vocab parallelism over FSDP's group (parallel/vocab.h) for L layers,
 * local tokens Tl, the FSDP group's fs = dp_shard·cp ranks and their
 * N = fs·Tl tokens (N = Tl without FSDP), one logits chunk (asserted),
 * P = 1 when some tp-replicated param has Partial grads (one packed
 * all-reduce):
 *  without SP, tp all-reduce: embedding 1 + o_proj L + down_proj Ld
 *    forward (Ld: the dense layers; a sparse block is replicated over tp and
 *    needs none), loss 2 (max; sum-exp with target logit, over the N tokens
 *    the loss runs on), (q/k/v L, gate/up Ld input grads) + lm_head input
 *    grad 1 backward = 2L + 2Ld + 4 + P; bytes (2L + 2Ld + 2)·Tl·H + 3·N
 *    floats + the Partial grads (under ep the routers' too); under ep each
 *    sparse layer all-gathers its output forward and its input gradient
 *    backward over tp (model/moe.h), each tp·ceil(Tl/tp)·H floats padded;
 *  with SP, per layer 2 all-gathers + 2 reduce-scatters each way, plus the
 *    embedding (reduce-scatter forward, all-gather backward) and lm_head's
 *    input (all-gather forward, reduce-scatter backward): 4L + 2 of each,
 *    each moving Tw·H floats, Tw = Tl with the sequence padded to
 *    tp·ceil(S/tp) (comm.h: the padded chunk is on the wire; Tw = Tl when
 *    tp divides S); all-reduces: the loss 2 + the norms' grads 1;
 *  dp_shard_cp (fs > 1), the units: all-gather L + 1 forward, L − 1 again
 *    in backward (the last layer and the root stay unsharded),
 *    reduce-scatter L + 1, each moving fs × the unit's gathered part in
 *    fp32: a layer's whole shard, the root's final norm only (ceil(H/fs)
 *    per rank: embed_tokens and lm_head are vocab-parallel, never gathered);
 *  ep_shard (es > 1, under ep: parallel/ep.h), the X expert units (one per
 *    sparse layer, after the root): all-gather X forward, X − 1 again in
 *    backward when the last layer is sparse (else X), reduce-scatter X, each
 *    moving es × the unit's whole shard; nothing over ep but the all-to-alls
 *    (test_expert_parallel);
 *    vocab parallelism: all-gathers of the token ids with their targets
 *    (2·Tl words), lm_head's input (Tl·H) and the embedding's output
 *    gradient (Tl·H), reduce-scatters of the embedding's lookup (Tl·H) and
 *    lm_head's input gradient (Tl·H), each fs × that, and the loss's 2
 *    all-reduces (3·N floats);
 *  K = 1 when some kv head is held by several tp ranks: one more tp
 *    all-reduce of their rows' grads, and one over dp_shard_cp when FSDP
 *    shards (kv_shared_bytes each);
 *  cp (ring attention, parallel/cp.h), per layer: forward cp − 1 passes of
 *    the local K and V, backward cp − 1 of K and V and cp of dK and dV, each
 *    2·Tl·kv floats (kv = the local k_proj rows), Tl = the padded piece;
 *  no dp or world all-reduce: the reported loss and the grad norm travel on
 *  the host channel (comm/host.h). */
static void test_collective_counts(void **state) {
  (void)state;
  if (g_dpr > 1) skip(); /* the counts below are those of one replica (HSDP's: fsdp.cmake) */
  if (g_bi) skip(); /* the counts below are the default mode's (vocab parallelism on) */
  static fixture fx;
  fixture_load(g_fixture, &fx);
  static run r;
  open_on(&r, MPI_COMM_WORLD, g_tp, &fx);
  ml_mesh_stats_reset(&r.mesh);
  double norm;
  step(&r, &fx);
  assert_int_equal(ml_engine_grad_norm(&r.e, 2.0, &norm), 0);
  int64_t L = r.e.model.cfg.n_layers, H = r.e.model.cfg.hidden, V = r.e.model.cfg.vocab;
  int64_t Ld = 0; /* the dense layers (not mixture-of-experts) */
  for (int64_t l = 0; l < L; l++) Ld += !r.e.model.layers[l].moe.gate.weight;
  int tp = r.mesh.tp, dp = r.mesh.dp_shard, cp = r.mesh.cp;
  int64_t s = cp > 1 ? (fx.S + 2 * cp - 1) / (2 * cp) * 2 : fx.S; /* local positions */
  int64_t Tl = fx.B / dp * s, Tw = fx.B / dp * tp * ((s + tp - 1) / tp);
  ml_mesh *m = &r.mesh;
  ml_comm *tpc = ml_mesh_comm(m, ML_GROUP_TP), *dps = ml_mesh_comm(m, ML_GROUP_DP_SHARD_CP);
  ml_comm *cpc = ml_mesh_comm(m, ML_GROUP_CP);
  int fs = dp * cp; /* FSDP shards over dp_shard_cp */
  int64_t N = fs * Tl;
  assert_int_equal(r.e.fsdp.vocab_parallel, fs > 1);
  assert_int_equal(ml_loss_tiling(N, V, tp * fs, true, 0).block, N); /* one logits block */
  int64_t kv = r.e.model.layers[0].k_proj.weight->local[0];
  assert_int_equal(calls(cpc, ML_COLL_SEND_RECV), L * (3 * cp - 2) * (cp > 1));
  assert_int_equal(bytes(cpc, ML_COLL_SEND_RECV), 4 * L * (3 * cp - 2) * (cp > 1) * 2 * Tl * kv);
  assert_int_equal(calls(cpc, ML_COLL_ALL_GATHER) + calls(cpc, ML_COLL_ALL_REDUCE) +
                       calls(cpc, ML_COLL_REDUCE_SCATTER),
                   0);
  int64_t pb = partial_bytes(&r), P = pb > 0;
  int64_t kb = kv_shared_bytes(&r), K = kb > 0;
  if (tp > 1 && g_sp) {
    assert_int_equal(calls(tpc, ML_COLL_ALL_GATHER), 4 * L + 2);
    assert_int_equal(calls(tpc, ML_COLL_REDUCE_SCATTER), 4 * L + 2);
    assert_int_equal(bytes(tpc, ML_COLL_ALL_GATHER), 4 * (4 * L + 2) * Tw * H);
    assert_int_equal(bytes(tpc, ML_COLL_REDUCE_SCATTER), 4 * (4 * L + 2) * Tw * H);
    assert_int_equal(P, 1);
    assert_int_equal(calls(tpc, ML_COLL_ALL_REDUCE), 2 + 1 + K);
    assert_int_equal(bytes(tpc, ML_COLL_ALL_REDUCE), 4 * 3 * N + pb + kb);
  } else {
    assert_int_equal(calls(tpc, ML_COLL_ALL_REDUCE), tp > 1 ? 2 * L + 2 * Ld + 4 + P + K : 0);
    assert_int_equal(bytes(tpc, ML_COLL_ALL_REDUCE),
                     tp > 1 ? 4 * ((2 * L + 2 * Ld + 2) * Tl * H + 3 * N) + pb + kb : 0);
    int64_t Xs = g_ep > 1 && tp > 1 ? L - Ld : 0; /* sparse layers all-gathering over tp */
    assert_int_equal(calls(tpc, ML_COLL_ALL_GATHER), 2 * Xs);
    assert_int_equal(bytes(tpc, ML_COLL_ALL_GATHER), 4 * 2 * Xs * tp * ((Tl + tp - 1) / tp) * H);
    assert_int_equal(calls(tpc, ML_COLL_REDUCE_SCATTER), 0);
  }
  /* the units' parts: every layer's whole shard, the root's final norm; the expert units'
   * whole shards over ep_shard */
  ml_comm *eps = ml_mesh_comm(m, ML_GROUP_EP_SHARD);
  int es = eps->size;
  int64_t unit_bytes = 0, regather_bytes = 0, x_bytes = 0, x_regather = 0, X = 0, x_kept = 0;
  for (int u = 0; u < r.e.fsdp.n_units; u++) {
    const ml_fsdp_unit *unit = &r.e.fsdp.units[u];
    if (unit->layer >= 0) { /* an expert unit: resharded after forward as its layer */
      assert_int_equal(unit->gather_numel, unit->shard_numel);
      X++;
      x_bytes += 4 * es * unit->gather_numel;
      if (unit->layer < L - 1) x_regather += 4 * es * unit->gather_numel;
      else x_kept = 1;
      continue;
    }
    int64_t want = u < L || fs == 1 ? unit->shard_numel : (H + fs - 1) / fs;
    assert_int_equal(unit->gather_numel, want);
    unit_bytes += 4 * fs * unit->gather_numel;
    if (u < L - 1) regather_bytes += 4 * fs * unit->gather_numel;
  }
  int64_t tokens_ag = 4 * fs * (2 * Tl + 2 * Tl * H), tokens_rs = 4 * fs * 2 * Tl * H;
  assert_int_equal(calls(dps, ML_COLL_ALL_GATHER), fs > 1 ? 2 * L + 3 : 0);
  assert_int_equal(bytes(dps, ML_COLL_ALL_GATHER),
                   fs > 1 ? unit_bytes + regather_bytes + tokens_ag : 0);
  assert_int_equal(calls(dps, ML_COLL_REDUCE_SCATTER), fs > 1 ? L + 3 : 0);
  assert_int_equal(bytes(dps, ML_COLL_REDUCE_SCATTER), fs > 1 ? unit_bytes + tokens_rs : 0);
  assert_int_equal(calls(dps, ML_COLL_ALL_REDUCE), fs > 1 ? 2 + K : 0);
  assert_int_equal(bytes(dps, ML_COLL_ALL_REDUCE), fs > 1 ? 4 * 3 * N + kb : 0);
  assert_int_equal(X, g_ep > 1 ? sparse_layers(&r.e.model) : 0);
  assert_int_equal(calls(eps, ML_COLL_ALL_GATHER), es > 1 ? 2 * X - x_kept : 0);
  assert_int_equal(bytes(eps, ML_COLL_ALL_GATHER), es > 1 ? x_bytes + x_regather : 0);
  assert_int_equal(calls(eps, ML_COLL_REDUCE_SCATTER), es > 1 ? X : 0);
  assert_int_equal(bytes(eps, ML_COLL_REDUCE_SCATTER), es > 1 ? x_bytes : 0);
  assert_int_equal(calls(eps, ML_COLL_ALL_REDUCE), 0);
  /* the loss and grad-norm scalars go over the host channel, not the data comms */
  assert_int_equal(calls(ml_mesh_comm(m, ML_GROUP_DP), ML_COLL_ALL_REDUCE), 0);
  assert_int_equal(calls(ml_mesh_comm(m, ML_GROUP_WORLD), ML_COLL_ALL_REDUCE), 0);
  if (rank0())
    printf("collectives per step: tp all-reduce %lld (%lld B), all-gather %lld (%lld B), "
           "reduce-scatter %lld (%lld B); dp_shard_cp all-gather %lld (%lld B), reduce-scatter "
           "%lld (%lld B), all-reduce %lld (%lld B); cp send_recv %lld (%lld B)\n",
           (long long)calls(tpc, ML_COLL_ALL_REDUCE),
           (long long)bytes(tpc, ML_COLL_ALL_REDUCE),
           (long long)calls(tpc, ML_COLL_ALL_GATHER),
           (long long)bytes(tpc, ML_COLL_ALL_GATHER),
           (long long)calls(tpc, ML_COLL_REDUCE_SCATTER),
           (long long)bytes(tpc, ML_COLL_REDUCE_SCATTER),
           (long long)calls(dps, ML_COLL_ALL_GATHER), (long long)bytes(dps, ML_COLL_ALL_GATHER),
           (long long)calls(dps, ML_COLL_REDUCE_SCATTER),
           (long long)bytes(dps, ML_COLL_REDUCE_SCATTER),
           (long long)calls(dps, ML_COLL_ALL_REDUCE), (long long)bytes(dps, ML_COLL_ALL_REDUCE),
           (long long)calls(cpc, ML_COLL_SEND_RECV), (long long)bytes(cpc, ML_COLL_SEND_RECV));
  run_close(&r);
  fixture_free(&fx);
}

/* The tokens [t0, t0 + n) of a sparse layer's T local ones that this rank
 * dispatches under ep: its tp rank's torch.chunk under tp (model/moe.h),
 * else all. */
static void dispatched(const run *r, int64_t T, int64_t *t0, int64_t *n) {
  ml_chunk(T, r->mesh.tp, r->mesh.tp_rank, t0, n);
}

/* cnt [E] (=): the choices of r's last forward that sparse layer l routes to
 * each expert from tokens [t0, t0 + n) of its local ones. */
static void routed(const run *r, int l, int64_t t0, int64_t n, int64_t *cnt) {
  const ml_model *m = &r->e.model;
  int64_t k = m->cfg.top_k;
  memset(cnt, 0, sizeof(int64_t) * (size_t)m->cfg.n_experts);
  for (int64_t i = t0 * k; i < (t0 + n) * k; i++) cnt[(int64_t)m->layers[l].acts.top_e[i]]++;
}

/* The experts placed Shard(0) over ep and FSDP-sharded over ep_shard
 * (parallel/ep.h), counted from the engine's tensors: every expert
 * parameter this rank holds is one of its ep rank's E / ep experts and
 * lies in an expert unit (the layers' units hold none), this rank's
 * resident expert bytes (its chunks' rows) are the model's expert bytes /
 * ep / ep_shard (the fixtures' expert rows divide by ep_shard: no padding),
 * and a sparse layer's gathered expert buffer holds E / ep experts. */
static void expert_residency(const run *r) {
  const ml_model *m = &r->e.model;
  int ep = r->mesh.groups[ML_GROUP_EP].size, er = r->mesh.groups[ML_GROUP_EP].rank;
  int es = r->mesh.groups[ML_GROUP_EP_SHARD].size;
  int64_t El = m->cfg.n_experts / ep, total = 0, held = 0;
  for (int i = 0; i < m->n_params; i++)
    if (ml_ep_expert_of(m, &m->params[i]) >= 0) total += 4 * ml_param_numel(&m->params[i]);
  for (int u = 0; u < r->e.fsdp.n_units; u++) {
    const ml_fsdp_unit *unit = &r->e.fsdp.units[u];
    for (int i = 0; i < unit->n; i++) {
      int64_t x = ml_ep_expert_of(m, unit->params[i]);
      if (x < 0) continue;
      assert_true(unit->layer >= 0);
      assert_int_equal(x / El, er);
      held += 4 * unit->chunk_rows[i] * unit->params[i]->local[1];
    }
    if (unit->layer < 0) continue;
    const ml_linear *ex = m->layers[unit->layer].moe.experts; /* one expert's three weights */
    int64_t one = 0;
    for (int j = 0; j < 3; j++) one += ml_param_numel(ex[j].weight);
    assert_int_equal(unit->gather_full, El * one);
  }
  if (rank0())
    printf("experts: %lld B resident per rank of %lld B (ep %d x ep_shard %d)\n",
           (long long)held, (long long)total, ep, es);
  assert_int_equal(held * ep * es, total);
}

/* Expert parallelism (ep=P, parallel/ep.h): the all-to-alls of one step
 * over the ep group, per sparse layer a dispatch and a combine in forward
 * and in backward, each rank sending its Td·k rows of H floats (Td = its T
 * local tokens, or under tp its tp rank's torch.chunk of them, model/moe.h)
 * and getting back the R rows its experts computed, R = the (token, choice)
 * pairs of the tokens the ep group's ranks dispatch that the routing sends
 * to them; the routing is the mesh's own, equal to the one-rank run's
 * routing of the same tokens where the local tokens are whole batch rows
 * (cp 1; the fixtures keep the router's k-th choice 1e-4 clear of the
 * next, tools/gen_fixtures.py, so every mesh routes alike), asserted
 * bitwise; and the log-probs against the same mesh without expert
 * parallelism, bitwise, both in the backend's batch-invariant mode (a
 * GEMM row's bits independent of the rows beside it): every row's expert
 * GEMMs and the per-token sums then run in the same order on the same
 * values, only the rank computing them differs. Outside that mode a GEMM
 * over more rows may round differently (measured: OpenBLAS's Haswell
 * kernel, 1 ulp), which the tolerances of the tests above cover. */
static void test_expert_parallel(void **state) {
  (void)state;
  if (g_ep == 1) skip();
  static fixture fx;
  fixture_load(g_fixture, &fx);
  static run one, r;
  open_on(&one, MPI_COMM_SELF, 1, &fx);
  open_on(&r, MPI_COMM_WORLD, g_tp, &fx);
  step(&one, &fx);
  ml_mesh_stats_reset(&r.mesh);
  step(&r, &fx);
  const ml_model *m = &r.e.model;
  int64_t H = m->cfg.hidden, k = m->cfg.top_k, E = m->cfg.n_experts, El = E / g_ep;
  int dp = r.mesh.groups[ML_GROUP_DP].size, er = r.mesh.groups[ML_GROUP_EP].rank;
  int cp = r.mesh.cp, d = r.mesh.groups[ML_GROUP_DP].rank;
  assert_int_equal(r.mesh.groups[ML_GROUP_EP].size, g_ep);
  int64_t s = cp > 1 ? (fx.S + 2 * cp - 1) / (2 * cp) * 2 : fx.S; /* local positions */
  int64_t Bl = fx.B / dp, T = Bl * s, t0, Td, sparse = 0, want_bytes = 0;
  dispatched(&r, T, &t0, &Td);
  int64_t *cnt = malloc(sizeof(int64_t) * (size_t)E);
  hold(cnt, free);
  bool same = true; /* the routing one rank's (asserted after the collectives) */
  for (int l = 0; l < m->cfg.n_layers; l++) {
    if (!m->layers[l].moe.gate.weight) continue;
    sparse++;
    const float *te = m->layers[l].acts.top_e, *te1 = one.e.model.layers[l].acts.top_e;
    if (cp == 1) /* this dp rank's batch rows, as one rank routed them */
      same = same && memcmp(te, te1 + d * T * k, sizeof(float) * (size_t)(T * k)) == 0;
    routed(&r, l, t0, Td, cnt);
    if (ml_host_all_reduce_i64(ml_mesh_host(&r.mesh, ML_GROUP_EP), cnt, (int)E, ML_RED_SUM))
      fail_msg("%s", ml_error_msg());
    int64_t R = 0; /* the group's choices routed to this rank's experts */
    for (int64_t e = er * El; e < (er + 1) * El; e++) R += cnt[e];
    want_bytes += 2 * 4 * (Td * k + R) * H;
  }
  unhold(cnt);
  free(cnt);
  ml_comm *epc = ml_mesh_comm(&r.mesh, ML_GROUP_EP);
  if (rank0())
    printf("expert parallel: %lld all-to-alls (%lld B) per step on rank 0\n",
           (long long)calls(epc, ML_COLL_ALL_TO_ALL), (long long)bytes(epc, ML_COLL_ALL_TO_ALL));
  assert_true(same);
  assert_int_equal(calls(epc, ML_COLL_ALL_TO_ALL), 4 * sparse);
  assert_int_equal(bytes(epc, ML_COLL_ALL_TO_ALL), want_bytes);
  expert_residency(&r);
  run_close(&one);
  run_close(&r);
  /* batch-invariant, with and without expert parallelism: the same log-probs, bit for bit */
  static run plain;
  ml_engine_opts bi = ml_engine_opts_default();
  bi.batch_invariant = true;
  run_open_ep(&r, MPI_COMM_WORLD, 1, 1, g_tp, g_ep, &bi, fx.dir, NULL, NULL);
  run_open_mesh(&plain, MPI_COMM_WORLD, g_dpr, 1, g_tp, &bi, fx.dir, NULL, NULL);
  const int32_t *ids;
  const uint8_t *mask;
  local_batch(&r, &fx, &ids, &mask, &Bl); /* this mesh's rows (cp 1: dp takes cp's ranks) */
  int64_t n = Bl * (fx.S - 1);
  float *lp = malloc(sizeof(float) * (size_t)n * 2);
  hold(lp, free);
  if (ml_engine_logprobs(&r.e, ids, Bl, fx.S, lp) ||
      ml_engine_logprobs(&plain.e, ids, Bl, fx.S, lp + n))
    fail_msg("%s", ml_error_msg());
  assert_memory_equal(lp, lp + n, sizeof(float) * (size_t)n);
  unhold(lp);
  free(lp);
  run_close(&plain);
  run_close(&r);
  fixture_free(&fx);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  bool ok = argc >= 3;
  for (int i = 3; ok && i < argc; i++) {
    if (!strcmp(argv[i], "sp")) g_sp = true;
    else if (!strncmp(argv[i], "cp=", 3)) g_cp = atoi(argv[i] + 3);
    else if (!strncmp(argv[i], "ep=", 3)) g_ep = atoi(argv[i] + 3);
    else if (!strncmp(argv[i], "dpr=", 4)) g_dpr = atoi(argv[i] + 4);
    else if (!strcmp(argv[i], "bi")) g_bi = true;
    else ok = false;
  }
  if (!ok || g_cp < 1 || g_ep < 1 || g_dpr < 1) {
    fprintf(stderr, "usage: test_parity FIXTURE TP [sp] [cp=C] [ep=P] [dpr=R] [bi]\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  g_fixture = argv[1];
  g_tp = atoi(argv[2]);
  const struct CMUnitTest tests[] = {
      held_test(test_loss_and_grads),
      held_test(test_logprobs),
      held_test(test_adamw_steps),
      held_test(test_collective_counts),
      held_test(test_long_uneven),
      held_test(test_expert_parallel),
  };
  return held_finish(cmocka_run_group_tests(tests, NULL, NULL));
}

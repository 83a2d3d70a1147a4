/* Predicted vs counted collectives and predicted vs measured memory:
 * `mpiexec -n N test_predict FIXTURE TP SP [OPTION...]`, OPTION one of
 * rep-logits (a custom plan whose lm_head is HF colwise_rep: logits
 * all-gathered per chunk, the loss on whole rows; with FSDP and tp > 1 the
 * root is then gathered whole, not vocab-parallel), hsdp (dp_replicate = 2,
 * dp_shard inferred), ac=mlp|layer|selective (activation checkpointing),
 * bf16 (param_dtype bf16), accum=K (K micro-batches per step), cp=C
 * (context parallelism: ring attention's send_recv over the cp group),
 * offload (FSDP's cpu_offload), freeze=PATTERNS (frozen parameters,
 * engine/freeze.h: a unit whose parameters are all frozen holds its fp32
 * parameter shard alone, 4 B per element, and reduces nothing), lora=R
 * (rank-R LoRA adapters on every linear, engine/lora.h: the base frozen,
 * the adapters' GEMMs and temporaries in the step), dropout=P (their
 * LoRA dropout, model/lora_drop.h: the dropped inputs' temporaries, and the
 * host all-gather of the data ranks' rows, which is no counted collective),
 * targets=LIST (their lora_targets; all-linear unless given), ep=P (expert
 * parallelism, parallel/ep.h: the experts held by their ep rank alone in
 * units of their own over ep_shard; the meta backend routes balanced,
 * model/moe.h, so the ep group's all-to-all bytes are the one count not
 * compared: test_parity checks them against the routing), fp32=PATTERNS
 * (parameters kept in fp32 under bf16 besides the MoE routers,
 * engine/fp32_params.h: their units' fp32 all-gathers beside the bf16 ones).
 * Opens the engine on the fixture over MPI_COMM_WORLD (dp_shard = N /
 * (C·TP), tp = TP, sequence parallel when SP =
 * 1), runs one training step (zero_grad, forward_backward, grad_norm,
 * AdamW) and one logprobs pass of the fixture batch, and compares on
 * every rank:
 *  - for every mesh group and collective kind, the calls and bytes the
 *    counting comm recorded with ml_predict_step's (engine/predict.h: the
 *    same step on the meta backend), exactly;
 *  - vocab parallelism over FSDP's group (parallel/vocab.h) where the
 *    engine says it is on: whenever the group has more than one rank,
 *    except for rep-logits on tp > 1;
 *  - the device pool's bytes in use once an inference-only engine (as
 *    `meshlm logprobs` opens it: under bf16 its bf16 shards alone,
 *    parallel/fsdp.h) is open, before the logprobs pass, with the predicted
 *    logprobs_opened, exactly;
 *  - the device pool's peak bytes of the step and of the pass
 *    (ml_be_memory_stats) with the predicted peaks, within 5 % (the
 *    issue's bound for `meshlm plan`): the prediction allocates exactly
 *    what the step allocates, a GEMM's temporaries included (the meta
 *    backend takes ml_be_gemm_temp's bytes); what it does not model is the
 *    other kernels' own temporaries (a widened norm weight), live only
 *    inside one kernel call;
 *  - what the device pool holds after the step and after the pass (its
 *    reserved bytes, cached blocks included: on the CPU the resident set
 *    less the libraries; the first forward's ml_model_begin, and the
 *    prediction's ml_engine_reserve, give the cached blocks back first),
 *    with the predicted step_reserved and logprobs_reserved, within the
 *    same 5 %: the meta backend takes each GEMM's temporaries as the blocks
 *    the CPU backend takes (ml_be_gemm_temp_blocks), so the pools cache the
 *    same blocks; the other kernels' temporaries (above) may take or leave
 *    blocks of their own. Not under ep: the experts' all-to-all buffers are
 *    sized by how the data routes its tokens, which the meta run (no
 *    weights, no data) does not know, and the size of each block decides
 *    which cached block serves the next request (measured: the pass 6.6 to
 *    11.9 % off on the fixtures, the step −1.7 to +10.0 %, their peaks
 *    already up to 3.7 % off);
 *  - the shards' bytes: 16 B per shard element (the shards, their gradients
 *    and AdamW state, fp32), 4 B in a unit whose parameters are all frozen;
 *  - with offload, that the device pool holds no shard: opening the engine
 *    and its first training call (ml_engine_zero_grad, which allocates the
 *    gradients and AdamW state) take exactly the shards' bytes less of it
 *    than without offload (the shards, their gradients and AdamW state,
 *    fp32) and exactly the predicted host bytes of the host pool (the same
 *    bytes, and the gradients' host staging), and the prediction's device
 *    memory once open is the one without offload less the parameter shards
 *    (all that opening allocates of them);
 *  - a reference policy (engine/reference.h) takes exactly the predicted
 *    bytes (the parameter shards: fp32, or bf16 for the units computing
 *    from bf16 weights) of the pool where they live.
 * Mismatches are collected per rank and agreed on after the collectives,
 * so a failure never leaves other ranks waiting. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/status.h"
#include "held.h"
#include "rank_report.h"
#include "engine/predict.h"
#include "engine/reference.h"
#include "engine_run.h"
#include "parity_util.h"
#include "tensor/placement.h"
#include "engine/engine.h"

static const char *g_fixture;
static int g_tp, g_sp, g_dpr = 1; /* g_dpr: dp_replicate (HSDP with "hsdp") */
static int g_cp = 1;                /* context parallelism ("cp=C") */
static ml_ac_mode g_ac = ML_AC_NONE;
static ml_dtype g_param_dtype = ML_F32;
static int g_accum = 1; /* micro-batches per step ("accum=K") */
static bool g_offload;  /* FSDP's cpu_offload ("offload") */
static const char *g_freeze; /* frozen parameters' patterns ("freeze=PATTERNS"), or NULL */
static const char *g_fp32;   /* parameters kept in fp32 ("fp32=PATTERNS"), or NULL */
static int64_t g_lora;       /* LoRA rank ("lora=R"), or 0 */
static double g_dropout;     /* its lora_dropout ("dropout=P"), or 0 */
static const char *g_targets = "all-linear"; /* its lora_targets ("targets=LIST") */
static char g_plan[64]; /* a custom plan file, or "" for the automatic choice */
static int g_ep = 1;    /* expert parallelism ("ep=P") */

/* The HF-style plan with lm_head colwise_rep (Replicate logits). Each
 * process writes its own copy. */
static void write_rep_logits_plan(void) {
  snprintf(g_plan, sizeof g_plan, "/tmp/test_predict_%ld.json", (long)getpid());
  FILE *f = fopen(g_plan, "w");
  if (!f) {
    perror(g_plan);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  fputs("{\"model.embed_tokens\": \"embedding_rowwise\",\n"
        " \"model.layers.*.self_attn.q_proj\": \"colwise\",\n"
        " \"model.layers.*.self_attn.k_proj\": \"colwise\",\n"
        " \"model.layers.*.self_attn.v_proj\": \"colwise\",\n"
        " \"model.layers.*.self_attn.o_proj\": \"rowwise\",\n"
        " \"model.layers.*.mlp.gate_proj\": \"colwise\",\n"
        " \"model.layers.*.mlp.up_proj\": \"colwise\",\n"
        " \"model.layers.*.mlp.down_proj\": \"rowwise\",\n"
        " \"lm_head\": \"colwise_rep\"}\n",
        f);
  fclose(f);
}


typedef struct setup {
  fixture fx;
  ml_mesh mesh;
  ml_engine e;
  int64_t Bl;
  const int32_t *ids;
  const uint8_t *mask;
  ml_prediction pred;
} setup;

static void setup_release(void *p) {
  setup *s = p;
  ml_engine_close(&s->e);
  ml_mesh_destroy(&s->mesh);
}

/* s is held (held.h): static in the tests. inference_only: the session
 * `meshlm logprobs` opens (parallel/fsdp.h inference_only), else a training
 * one. */
static void setup_open(setup *s, bool inference_only) {
  memset(s, 0, sizeof *s);
  fixture_load(g_fixture, &s->fx);
  hold(s, setup_release);
  ml_engine_opts opts = ml_engine_opts_default();
  opts.parallel_plan = g_plan[0] ? g_plan : NULL;
  opts.sequence_parallel = g_sp != 0;
  opts.ac = g_ac;
  opts.fsdp.param_dtype = g_param_dtype;
  opts.fsdp.cpu_offload = g_offload;
  opts.fsdp.inference_only = inference_only;
  opts.freeze = g_freeze;
  opts.fp32_params = g_fp32;
  opts.lora = (ml_lora_opts){.rank = g_lora, .alpha = 8, .dropout = g_dropout,
                             .targets = g_targets, .seed = 1};
  if (ml_mesh_create(MPI_COMM_WORLD, g_dpr, 0, g_cp, g_tp, NULL, NULL, &s->mesh) ||
      ml_mesh_set_ep(&s->mesh, MPI_COMM_WORLD, g_ep, NULL, NULL) ||
      ml_engine_open(&s->e, &s->mesh, s->fx.dir, &opts))
    fail_msg("setup: %s", ml_error_msg());
  int dp = s->mesh.groups[ML_GROUP_DP].size, d = s->mesh.groups[ML_GROUP_DP].rank;
  assert_int_equal(s->fx.B % dp, 0);
  s->Bl = s->fx.B / dp;
  s->ids = s->fx.ids + d * s->Bl * s->fx.S;
  s->mask = s->fx.mask + d * s->Bl * s->fx.S;
  ml_predict_shape shape = {s->mesh.dp_replicate, s->mesh.dp_shard, s->mesh.cp, s->mesh.tp,
                            s->mesh.rank, s->Bl, s->fx.S, g_accum, NULL, g_ep};
  if (ml_predict_step(s->fx.dir, &opts, &shape, &s->pred))
    fail_msg("predict: %s", ml_error_msg());
  int fs = s->mesh.groups[ML_GROUP_DP_SHARD_CP].size;
  bool vocab = fs > 1 && !(g_plan[0] && g_tp > 1);
  assert_int_equal(s->e.fsdp.vocab_parallel, vocab);
  assert_int_equal(s->pred.vocab_group, vocab ? fs : 1);
}

static void setup_close(setup *s) {
  unhold(s);
  setup_release(s);
  fixture_free(&s->fx);
}

/* The bytes of e's FSDP shards where they live: per unit 4 B per shard
 * element (the fp32 parameters) and 12 B more (gradients, exp_avg,
 * exp_avg_sq) per element up to the end of its last trainable chunk (the
 * frozen chunks come after the trainable ones of their part, parallel/
 * fsdp.h: 16 B per element when nothing is frozen, 4 B in a unit whose
 * parameters are all frozen); *frozen: the units of that kind, *partly:
 * the units whose frozen chunks this saves bytes of. */
static int64_t shard_bytes(const ml_engine *e, int *frozen, int *partly) {
  int64_t bytes = 0;
  *frozen = *partly = 0;
  for (int u = 0; u < e->fsdp.n_units; u++) {
    const ml_fsdp_unit *unit = &e->fsdp.units[u];
    int64_t end = 0;
    for (int i = 0; i < unit->n; i++) {
      const ml_param *p = unit->params[i];
      int64_t chunk_end = unit->shard_off[i] + unit->chunk_rows[i] * p->local[1];
      if (!p->frozen && chunk_end > end) end = chunk_end;
    }
    *frozen += end == 0;
    *partly += end > 0 && end < unit->shard_numel;
    bytes += 4 * unit->shard_numel + 12 * end;
  }
  return bytes;
}

/* The bytes of the persistent bf16 shards (parallel/fsdp.h lp: 2 B per
 * shard element) a training call gives e's units under param_dtype bf16
 * without cpu_offload (with it: none). */
static int64_t lp_bytes(const ml_engine *e) {
  int64_t bytes = 0;
  for (int u = 0; e->opts.fsdp.param_dtype == ML_BF16 && u < e->fsdp.n_units; u++)
    bytes += 2 * e->fsdp.units[u].shard_numel;
  return bytes;
}

/* The bytes of e's fp32 parameter shards (4 B per shard element): what
 * opening allocates of shard_bytes, the rest coming at the first training
 * call. */
static int64_t param_bytes(const ml_engine *e) {
  int64_t bytes = 0;
  for (int u = 0; u < e->fsdp.n_units; u++) bytes += 4 * e->fsdp.units[u].shard_numel;
  return bytes;
}

/* Every group and kind: counted (this rank's counting comms) vs predicted. */
static void compare(setup *s, const ml_comm_stats want[ML_GROUP_KINDS], const char *what,
                    report *rep) {
  for (int g = 0; g < ML_GROUP_KINDS; g++) {
    ml_comm *c = ml_mesh_comm(&s->mesh, (ml_group)g);
    const ml_comm_stats *got = ml_comm_stats_of(c);
    if (!got) {
      note(rep, "group %s is not a counting comm", ml_group_name((ml_group)g));
      continue;
    }
    if (strcmp(c->name, ml_group_name((ml_group)g)))
      note(rep, "group %d is called '%s', predict calls it '%s'", g, c->name,
           ml_group_name((ml_group)g));
    for (int k = 0; k < ML_COLL_KINDS; k++) {
      /* the routing's bytes: balanced in the prediction, the fixture's in the run (header) */
      bool routed = g == ML_GROUP_EP && k == ML_COLL_ALL_TO_ALL;
      if (got->calls[k] != want[g].calls[k] || (!routed && got->bytes[k] != want[g].bytes[k]))
        note(rep, "%s: %s %s: counted %lld calls / %lld B, predicted %lld calls / %lld B", what,
             ml_group_name((ml_group)g), ml_coll_name((ml_coll)k), (long long)got->calls[k],
             (long long)got->bytes[k], (long long)want[g].calls[k], (long long)want[g].bytes[k]);
    }
  }
}

static void print_counts(const ml_comm_stats st[ML_GROUP_KINDS], const char *what) {
  if (!rank0()) return;
  printf("%s (rank 0):", what);
  for (int g = 0; g < ML_GROUP_KINDS; g++)
    for (int k = 0; k < ML_COLL_KINDS; k++)
      if (st[g].calls[k])
        printf(" %s %s x%lld (%lld B)", ml_group_name((ml_group)g), ml_coll_name((ml_coll)k),
               (long long)st[g].calls[k], (long long)st[g].bytes[k]);
  printf("\n");
}

/* The measured peak against the predicted one: within 5 % (header). */
static void compare_peak(int64_t measured, int64_t predicted, const char *what, report *rep) {
  double rel = (double)(measured - predicted) / (double)measured;
  if (rank0())
    printf("%s peak (rank 0): measured %lld B, predicted %lld B (%+.3f %%)\n", what,
           (long long)measured, (long long)predicted, 100.0 * rel);
  if (rel > 0.05 || rel < -0.05)
    note(rep, "%s: measured peak %lld B, predicted %lld B: off by %.2f %% (bound 5 %%)", what,
         (long long)measured, (long long)predicted, 100.0 * rel);
}

/* One training step: zero_grad, forward + backward, grad norm, AdamW. */
static void test_train_step(void **state) {
  (void)state;
  static setup s;
  setup_open(&s, false);
  ml_mesh_stats_reset(&s.mesh);
  double loss, norm;
  report rep = {0};
  ml_adamw_cfg adam = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8};
  ml_be_reset_peak(s.e.be);
  if (ml_engine_zero_grad(&s.e)) fail_msg("zero_grad: %s", ml_error_msg());
  for (int k = 0; k < g_accum; k++)
    if (ml_engine_forward_backward(&s.e, s.ids, s.mask, s.Bl, s.fx.S, s.fx.targets, &loss))
      fail_msg("micro-batch %d: %s", k, ml_error_msg());
  if (ml_engine_grad_norm(&s.e, 2.0, &norm) || ml_engine_adamw(&s.e, &adam))
    fail_msg("step: %s", ml_error_msg());
  compare(&s, s.pred.train, "train step", &rep);
  ml_memory_stats ms = ml_be_memory_stats(s.e.be);
  compare_peak((int64_t)ms.peak, s.pred.mem.train_peak, "train step", &rep);
  if (g_ep <= 1) /* under ep the dispatched rows' buffers follow the data's routing (header) */
    compare_peak((int64_t)ms.reserved, s.pred.mem.step_reserved, "train step pool reserved",
                 &rep);
  int frozen, partly;
  int64_t shards = shard_bytes(&s.e, &frozen, &partly);
  if (s.pred.mem.shards != shards)
    note(&rep, "shard memory: predicted %lld B, FSDP holds %lld B",
         (long long)s.pred.mem.shards, (long long)shards);
  if (rank0() && g_freeze)
    printf("freeze=%s: %d frozen unit(s), %d partly frozen with smaller state; shards %lld B per "
           "rank\n", g_freeze, frozen, partly, (long long)shards);
  if (rank0() && s.pred.fp32_params)
    printf("fp32 under bf16: %d parameters (%lld elements), %d unit(s) with an fp32 part, %lld B "
           "of fp32 all-gather per pass\n", s.pred.fp32_params, (long long)s.pred.fp32_numel,
           s.pred.fp32_units, (long long)s.pred.fp32_gather_bytes);
  print_counts(s.pred.train, "train step");
  agree(&rep, "mismatches between prediction and counting comm");
  setup_close(&s);
}

/* The reference policy's shards: the predicted bytes of the device pool,
 * or of the host pool under offload, exactly (the pool counts the bytes
 * asked for). */
static void test_reference_memory(void **state) {
  (void)state;
  static setup s;
  setup_open(&s, false);
  report rep = {0};
  ml_memory_stats a = ml_be_memory_stats(s.e.be);
  if (ml_engine_reference_set(&s.e)) fail_msg("reference: %s", ml_error_msg());
  ml_memory_stats b = ml_be_memory_stats(s.e.be);
  int64_t took = g_offload ? (int64_t)(b.host_in_use - a.host_in_use)
                           : (int64_t)(b.in_use - a.in_use);
  if (rank0())
    printf("reference policy: %lld B per rank (predicted %lld B)\n", (long long)took,
           (long long)s.pred.mem.reference);
  if (took != s.pred.mem.reference || took != (int64_t)ml_engine_reference_bytes(&s.e))
    note(&rep, "the reference policy took %lld B of the %s pool; predicted %lld B",
         (long long)took, g_offload ? "host" : "device", (long long)s.pred.mem.reference);
  agree(&rep, "mismatches between predicted and measured reference memory");
  setup_close(&s);
}

/* One forward-only logprobs pass; the device memory in use once its
 * inference-only session is open (no training micro-batch reserved; under
 * bf16 the bf16 shards alone), exactly. */
static void test_logprobs(void **state) {
  (void)state;
  static setup s;
  setup_open(&s, true);
  float *out = malloc(sizeof(float) * (size_t)(s.Bl * (s.fx.S - 1)));
  assert_non_null(out);
  hold(out, free);
  ml_mesh_stats_reset(&s.mesh);
  report rep = {0};
  int64_t opened = (int64_t)ml_be_memory_stats(s.e.be).in_use; /* a scoring session, open */
  if (opened != s.pred.mem.logprobs_opened)
    note(&rep, "in use once open for logprobs: %lld B; predicted %lld B", (long long)opened,
         (long long)s.pred.mem.logprobs_opened);
  ml_be_reset_peak(s.e.be);
  if (ml_engine_logprobs(&s.e, s.ids, s.Bl, s.fx.S, out)) fail_msg("logprobs: %s", ml_error_msg());
  compare(&s, s.pred.logprobs, "logprobs", &rep);
  ml_memory_stats ms = ml_be_memory_stats(s.e.be);
  compare_peak((int64_t)ms.peak, s.pred.mem.logprobs_peak, "logprobs", &rep);
  if (g_ep <= 1) /* under ep the dispatched rows' buffers follow the data's routing (header) */
    compare_peak((int64_t)ms.reserved, s.pred.mem.logprobs_reserved, "logprobs pool reserved",
                 &rep);
  print_counts(s.pred.logprobs, "logprobs");
  unhold(out);
  free(out);
  agree(&rep, "mismatches between prediction and counting comm");
  setup_close(&s);
}

/* Sequence parallelism saves activation memory: with SP the residual
 * stream's saved buffers hold this rank's s = torch.chunk(S) positions
 * instead of S; among them each layer's input [B, s, H] fp32, kept per
 * layer under every AC mode, so the saved activations shrink by at least
 * L · B · (S − s) · H · 4 bytes against the same mesh without SP. Both
 * sides from the prediction (the same step on the meta backend, exact
 * against a real run by the tests above). */
static void test_sp_saves_memory(void **state) {
  (void)state;
  if (!g_sp || g_tp == 1) skip();
  static setup s;
  setup_open(&s, false);
  ml_engine_opts opts = s.e.opts;
  opts.backend = NULL;
  opts.sequence_parallel = false;
  opts.parallel_plan = g_plan[0] ? g_plan : NULL;
  ml_prediction no_sp;
  if (ml_predict_step(s.fx.dir, &opts, &s.pred.shape, &no_sp))
    fail_msg("predict without SP: %s", ml_error_msg());
  const ml_model_config *c = &s.e.model.cfg;
  int64_t start, piece;
  int64_t s_local = s.pred.s_local; /* this cp rank's positions per sequence */
  ml_chunk(s_local, g_tp, s.mesh.tp_rank, &start, &piece);
  int64_t least = c->n_layers * s.Bl * (s_local - piece) * c->hidden * 4;
  int64_t saved = no_sp.mem.activations - s.pred.mem.activations;
  if (rank0())
    printf("SP saves %lld B of %lld B of saved activations (at least %lld expected)\n",
           (long long)saved, (long long)no_sp.mem.activations, (long long)least);
  report rep = {0};
  if (saved < least)
    note(&rep, "SP saves %lld B of activations; expected at least %lld B", (long long)saved,
         (long long)least);
  agree(&rep, "SP activation memory");
  setup_close(&s);
}

/* Context parallelism divides activation memory: every saved activation
 * is per token (attention saves its log-sum-exp, no [S, S] tensor), so the
 * prediction at cp is the one at cp = 1 scaled by the local share of
 * positions s_local / S, up to the padding that starts every buffer on 64
 * bytes (model.c take: < 64 B per buffer, 23 buffers in a layer's block
 * and as many in the AC workspace). An [S, S] term would be off by a
 * factor of S / s_local. One buffer changes dtype with the attention core:
 * where cp = 1 keeps attention's output att [B·s, nh·hd] in bf16
 * (ml_model_bf16_att, under bf16 weights), ring attention keeps it in fp32
 * (the core declares bf16 q, k, v but no bf16 out: it merges fp32 outs
 * across the ring's blocks, parallel/cp.c), so the cp prediction holds 2 B
 * more per element of att (nh the widest tp rank's heads, torch.chunk's
 * first) for every layer that saves it (ML_PART_ATTN: each layer's block
 * but under ac=layer, where the one workspace holds it). */
static void test_cp_divides_activations(void **state) {
  (void)state;
  if (g_cp == 1) skip();
  static setup s;
  setup_open(&s, false);
  ml_engine_opts opts = s.e.opts;
  opts.backend = NULL;
  opts.parallel_plan = g_plan[0] ? g_plan : NULL;
  ml_predict_shape one = s.pred.shape;
  one.cp = 1;
  one.dp_shard *= g_cp; /* the same world */
  one.rank = s.mesh.tp_rank;
  ml_prediction no_cp;
  if (ml_predict_step(s.fx.dir, &opts, &one, &no_cp))
    fail_msg("predict without CP: %s", ml_error_msg());
  int64_t act = s.pred.mem.activations, act1 = no_cp.mem.activations;
  if (rank0())
    printf("saved activations per rank: %lld B at cp=%d (%lld of %lld positions), %lld B at "
           "cp=1\n",
           (long long)act, g_cp, (long long)s.pred.s_local, (long long)s.pred.S_pad,
           (long long)act1);
  report rep = {0};
  double want = (double)act1 * (double)s.pred.s_local / (double)s.fx.S;
  /* att fp32 under the ring where cp = 1 has it bf16 (header): the rule asked without the core */
  ml_model *m = &s.e.model;
  ml_attn_core ring = m->attn_core;
  m->attn_core = (ml_attn_core){0};
  bool att16_cp1 = ml_model_bf16_att(m);
  m->attn_core = ring;
  if (att16_cp1 && !ml_model_bf16_att(m)) {
    int64_t h0, heads, layers = g_ac == ML_AC_LAYER ? 1 : m->cfg.n_layers;
    ml_chunk(m->cfg.n_heads, g_tp, 0, &h0, &heads);
    double extra = 2.0 * (double)(layers * s.Bl * s.pred.s_local * heads * m->cfg.head_dim);
    if (rank0())
      printf("att fp32 under the ring (bf16 at cp=1): %.0f B more expected\n", extra);
    want += extra;
  }
  double pad = 64.0 * 23.0 * (double)(s.e.model.cfg.n_layers + 1);
  if (fabs((double)act - want) > pad)
    note(&rep, "activations at cp=%d: %lld B; expected %lld B x %lld / %lld (+ an fp32 att under "
         "the ring where cp=1 has it bf16) = %.0f B within %.0f B", g_cp, (long long)act,
         (long long)act1, (long long)s.pred.s_local, (long long)s.fx.S, want, pad);
  agree(&rep, "CP activation memory");
  setup_close(&s);
}

/* The device and host pool bytes opening an engine on s's mesh and its
 * first training call take with (offload) or without FSDP's cpu_offload
 * (what a training session holds before its first step). */
static void open_bytes(setup *s, bool offload, int64_t *dev, int64_t *host) {
  ml_engine_opts opts = s->e.opts;
  opts.fsdp.cpu_offload = offload;
  ml_memory_stats a = ml_be_memory_stats(s->e.be);
  ml_engine e;
  if (ml_engine_open(&e, &s->mesh, s->fx.dir, &opts) || ml_engine_zero_grad(&e))
    fail_msg("open: %s", ml_error_msg());
  ml_memory_stats b = ml_be_memory_stats(s->e.be);
  ml_engine_close(&e);
  *dev = (int64_t)b.in_use - (int64_t)a.in_use;
  *host = (int64_t)b.host_in_use - (int64_t)a.host_in_use;
}

/* cpu_offload: the shards in the host pool, none in the device pool
 * (header), measured and predicted. */
static void test_offload_memory(void **state) {
  (void)state;
  if (!g_offload) skip();
  static setup s;
  setup_open(&s, false);
  int64_t dev_off, host_off, dev_on, host_on;
  int frozen, partly;
  open_bytes(&s, true, &dev_off, &host_off);
  open_bytes(&s, false, &dev_on, &host_on);
  /* the device pool without offload also holds the persistent bf16 shards (zero_grad) */
  int64_t shards = shard_bytes(&s.e, &frozen, &partly) + lp_bytes(&s.e);
  ml_engine_opts opts = s.e.opts;
  opts.backend = NULL;
  opts.fsdp.cpu_offload = false;
  ml_prediction on;
  if (ml_predict_step(s.fx.dir, &opts, &s.pred.shape, &on))
    fail_msg("predict without offload: %s", ml_error_msg());
  if (rank0())
    printf("opening (rank 0): device pool %lld B offloaded, %lld B not (shards %lld B); host "
           "pool %lld B offloaded (predicted %lld B), %lld B not\n",
           (long long)dev_off, (long long)dev_on, (long long)shards, (long long)host_off,
           (long long)s.pred.mem.host, (long long)host_on);
  report rep = {0};
  if (dev_on - dev_off != shards)
    note(&rep, "the device pool holds %lld B less once open with offload; expected the shards' "
         "(and the persistent bf16 shards') %lld B", (long long)(dev_on - dev_off), (long long)shards);
  if (host_off != s.pred.mem.host || host_on != 0)
    note(&rep, "the host pool holds %lld B once open with offload (predicted %lld B), %lld B "
         "without (expected 0)", (long long)host_off, (long long)s.pred.mem.host,
         (long long)host_on);
  if (on.mem.opened - s.pred.mem.opened != param_bytes(&s.e) || on.mem.host != 0)
    note(&rep, "predicted device memory once open: %lld B offloaded, %lld B not; expected the "
         "parameter shards' %lld B apart (and no host bytes without offload: %lld B)",
         (long long)s.pred.mem.opened, (long long)on.mem.opened, (long long)param_bytes(&s.e),
         (long long)on.mem.host);
  agree(&rep, "offloaded memory");
  setup_close(&s);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  if (argc < 4) {
    fprintf(stderr, "usage: test_predict FIXTURE TP SP(0|1) [rep-logits|hsdp|ac=MODE|bf16|"
                    "accum=K|cp=C|offload|freeze=PATTERNS|lora=R|dropout=P|targets=LIST|"
                    "ep=P|fp32=PATTERNS]...\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  g_fixture = argv[1];
  g_tp = atoi(argv[2]);
  g_sp = atoi(argv[3]);
  static const char *const ac_names[] = {"ac=none", "ac=mlp", "ac=layer", "ac=selective"};
  for (int i = 4; i < argc; i++) {
    bool known = false;
    for (int a = 0; a < 4; a++)
      if (!strcmp(argv[i], ac_names[a])) {
        g_ac = (ml_ac_mode)a; /* ml_ac_mode's order */
        known = true;
      }
    if (!strcmp(argv[i], "hsdp")) g_dpr = 2;
    else if (!strcmp(argv[i], "bf16")) g_param_dtype = ML_BF16;
    else if (!strcmp(argv[i], "offload")) g_offload = true;
    else if (!strncmp(argv[i], "accum=", 6) && atoi(argv[i] + 6) >= 1) g_accum = atoi(argv[i] + 6);
    else if (!strncmp(argv[i], "cp=", 3) && atoi(argv[i] + 3) >= 1) g_cp = atoi(argv[i] + 3);
    else if (!strcmp(argv[i], "rep-logits")) write_rep_logits_plan();
    else if (!strncmp(argv[i], "freeze=", 7) && argv[i][7]) g_freeze = argv[i] + 7;
    else if (!strncmp(argv[i], "lora=", 5) && atoi(argv[i] + 5) >= 1) g_lora = atoi(argv[i] + 5);
    else if (!strncmp(argv[i], "dropout=", 8)) g_dropout = atof(argv[i] + 8);
    else if (!strncmp(argv[i], "targets=", 8)) g_targets = argv[i] + 8;
    else if (!strncmp(argv[i], "ep=", 3) && atoi(argv[i] + 3) >= 1) g_ep = atoi(argv[i] + 3);
    else if (!strncmp(argv[i], "fp32=", 5) && argv[i][5]) g_fp32 = argv[i] + 5;
    else if (!known) {
      fprintf(stderr, "test_predict: unknown option '%s'\n", argv[i]);
      MPI_Abort(MPI_COMM_WORLD, 2);
    }
  }
  const struct CMUnitTest tests[] = {
      held_test(test_reference_memory),
      held_test(test_train_step),
      held_test(test_logprobs),
      held_test(test_sp_saves_memory),
      held_test(test_cp_divides_activations),
      held_test(test_offload_memory),
  };
  int failed = cmocka_run_group_tests(tests, NULL, NULL);
  int any = 0;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (g_plan[0]) remove(g_plan);
  MPI_Finalize();
  return any ? 1 : 0;
}

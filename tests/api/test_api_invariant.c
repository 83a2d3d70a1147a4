/* test_api_invariant: meshlm_options.batch_invariant. On every fixture
 * family, fp32 and bf16 param_dtype, the log-prob of a token is the same
 * bit pattern (memcmp, never a tolerance) (a) alone, inside a batch of
 * other sequences of other lengths, and under another micro_batch_tokens;
 * (b) in meshlm_generate's out_logprobs (KV-cache prefill and decode,
 * greedy and sampled) and in meshlm_logprobs of prompt + generation on the
 * same weights; (c) on a dp_shard = world session (each rank its share of a
 * batch) and on one rank scoring the whole batch; (d) the training
 * forward's log-probs (a meshlm_train_step of the clipped policy gradient
 * with a k3 KL penalty, whose reference and old log-probs are one rank's
 * meshlm_logprobs): the KL is exactly 0 (k3 = e^d − d − 1 of d = ref −
 * logp in fp64 is 0 only where the two floats are equal). Registered on one, two
 * and four ranks (api_invariant_1rank, _2ranks, _4ranks: dp_shard 2, where the default mode
 * differs from one rank by 1–2 ulp through vocab parallelism's split sum);
 * (e) on a cp = world session (2 ranks: ring attention, whose merges by
 * log-sum-exp differ from one rank's pass in the default mode) the
 * log-probs and the training forward's equal one rank's, and generation's
 * (on the replica) equal the cp session's meshlm_logprobs, bitwise;
 * (f) on a tp = world session the log-probs, the training forward's and
 * generation on the tp mesh (tokens and out_logprobs) equal one rank's,
 * under three plans: a vocab-parallel one (embed_tokens rowwise, lm_head
 * colwise with vocab-sharded logits, whose split sum of exp the mode
 * gathers into whole rows), the default plan (q/k/v, gate/up colwise,
 * o_proj and down_proj rowwise: the mode computes each row-parallel linear
 * whole, parallel/tp_whole.h) and the default plan with sequence
 * parallelism; llama_h9kv3's 9 heads split unevenly (5 + 4 on tp 2,
 * 3 + 2 + 2 + 2 on tp 4); (g) with a PEFT adapter on every linear
 * (llama_h9kv3_lora: non-zero lora_B, so the adapters move every log-prob),
 * the default plan on tp = world = one rank, bitwise, in meshlm_logprobs,
 * generation and the training forward.
 * RoPE types whose tables HF computes for the longest sequence of the
 * forward (dynamic, longrope: their numbers depend on the batch by
 * definition) are run within their original context, where the tables
 * depend on the position alone. The suite, its meshes and its helpers:
 * api_util.h. */

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "api_util.h"

enum { MAX_FIXTURES = 32, GEN = 6, PATH = 4352 };

/* The fixture families: every directory of tests/fixtures with a model and its
 * expected.json (tools/compare_builds.sh's rule), sorted. */
static int fixtures(char names[MAX_FIXTURES][PATH]) {
  char root[4096], f[4096 + 2 * 256];
  snprintf(root, sizeof root, "%s/tests/fixtures", ML_SOURCE_DIR);
  DIR *d = opendir(root);
  if (!d) fail_msg("cannot open %s", root);
  int n = 0;
  struct dirent *e;
  struct stat st;
  while ((e = readdir(d)) && n < MAX_FIXTURES) {
    snprintf(f, sizeof f, "%s/%s/expected.json", root, e->d_name);
    if (e->d_name[0] == '.' || stat(f, &st)) continue;
    snprintf(f, sizeof f, "%s/%s/model.safetensors", root, e->d_name);
    if (stat(f, &st)) continue;
    snprintf(names[n++], PATH, "%s/%s", root, e->d_name);
  }
  closedir(d);
  qsort(names, (size_t)n, PATH, (int (*)(const void *, const void *))strcmp);
  if (n < 5) fail_msg("%s: %d fixture families; expected every family's", root, n);
  return n;
}

/* The longest sequence whose RoPE tables depend on positions alone: HF's
 * dynamic NTK and longrope tables change with the forward's longest
 * sequence past the original context (max_position_embeddings, or
 * original_max_position_embeddings); INT64_MAX for the other types. */
static int64_t rope_cap(const char *fx) {
  char path[4096];
  snprintf(path, sizeof path, "%s/config.json", fx);
  json_error_t err;
  json_t *c = json_load_file(path, 0, &err);
  if (!c) fail_msg("%s: %s", path, err.text);
  json_t *r = json_object_get(c, "rope_scaling");
  if (!r) r = json_object_get(c, "rope_parameters");
  const char *type = json_string_value(json_object_get(r, "rope_type"));
  int64_t cap = INT64_MAX;
  if (type && (!strcmp(type, "dynamic") || !strcmp(type, "longrope"))) {
    json_t *o = json_object_get(r, "original_max_position_embeddings");
    if (!o) o = json_object_get(c, "original_max_position_embeddings");
    if (!o) o = json_object_get(c, "max_position_embeddings");
    cap = json_integer_value(o);
  }
  json_decref(c);
  return cap;
}

/* Whether the fixture has expert layers (num_experts / num_local_experts in
 * config.json): they refuse cp > 1 (engine.c). */
static int has_experts(const char *fx) {
  char path[PATH + 16];
  if (snprintf(path, sizeof path, "%s/config.json", fx) >= (int)sizeof path)
    fail_msg("%s: path too long", fx);
  json_error_t err;
  json_t *c = json_load_file(path, 0, &err);
  if (!c) fail_msg("%s: %s", path, err.text);
  int e = json_integer_value(json_object_get(c, "num_experts")) > 0 ||
          json_integer_value(json_object_get(c, "num_local_experts")) > 0;
  json_decref(c);
  return e;
}

static meshlm_options invariant_opts(meshlm_dtype param, int64_t micro_batch_tokens) {
  meshlm_options o;
  meshlm_options_default(&o);
  o.batch_invariant = 1;
  o.param_dtype = param;
  o.micro_batch_tokens = micro_batch_tokens;
  return o;
}

/* n sequences of the given lengths (at most cap), tokens drawn below vocab. */
static batch seqs_make(const int64_t *lens, int64_t n, int64_t cap, int64_t vocab,
                       uint64_t seed) {
  batch b = {.n = n};
  b.lens = xcalloc((size_t)n, sizeof *b.lens);
  for (int64_t k = 0; k < n; k++) {
    b.lens[k] = lens[k] < cap ? lens[k] : cap;
    b.ntok += b.lens[k];
    b.npred += b.lens[k] - 1;
  }
  b.tok = xcalloc((size_t)b.ntok, sizeof *b.tok);
  b.mask = xcalloc((size_t)(b.npred ? b.npred : 1), 1);
  rng_seed(seed);
  for (int64_t t = 0; t < b.ntok; t++) b.tok[t] = (int32_t)(rnd() % (uint64_t)vocab);
  return b;
}

/* meshlm_logprobs of b on s (a one-rank session: local_ok) into a new array. */
static float *score(meshlm_session *s, const batch *b) {
  float *lp = xcalloc((size_t)(b->npred ? b->npred : 1), sizeof *lp);
  meshlm_seqs q = seqs_of(b);
  local_ok(s, meshlm_logprobs(s, &q, NULL, lp, NULL), "meshlm_logprobs");
  return lp;
}

/* Sequence k of b alone, as a batch of one. */
static batch one_of(const batch *b, int64_t k) {
  batch o = {.n = 1, .ntok = b->lens[k], .npred = b->lens[k] - 1};
  o.lens = xcalloc(1, sizeof *o.lens);
  o.lens[0] = b->lens[k];
  o.tok = xcalloc((size_t)o.ntok, sizeof *o.tok);
  o.mask = xcalloc(1, 1);
  memcpy(o.tok, b->tok + tok_at(b, k), sizeof(int32_t) * (size_t)o.ntok);
  return o;
}

/* memcmp of n log-probs, the first differing one named on failure; every
 * rank calls it in the same order and all fail together (no rank runs
 * ahead into a world collective). */
static void same_bits(const float *got, const float *ref, int64_t n, const char *fx,
                      const char *what) {
  int bad = n > 0 && memcmp(got, ref, sizeof(float) * (size_t)n) != 0, any = 0;
  MPI_Allreduce(&bad, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (!bad && any) fail_msg("%s, %s: log-probs differ on another rank", fx, what);
  if (!bad) return;
  int64_t i = 0;
  while (memcmp(&got[i], &ref[i], sizeof(float)) == 0) i++;
  fail_msg("%s, %s: log-prob %lld is %.9g, expected %.9g bit for bit", fx, what, (long long)i,
           got[i], ref[i]);
}

static const char *dtype_name(meshlm_dtype d) { return d == MESHLM_DTYPE_BF16 ? "bf16" : "fp32"; }

static const int64_t k_lens[] = {23, 5, 17, 2, 40, 11, 9};
enum { NSEQ = sizeof k_lens / sizeof k_lens[0] };

/* (a) alone = in the batch = under micro_batch_tokens 16 (one or two
 * sequences per micro-batch, packed) and 4096 (all in one). */
static void check_batches(const char *fx, meshlm_dtype param) {
  meshlm_options big = invariant_opts(param, 4096), small = invariant_opts(param, 16);
  meshlm_session *s = open_ok(fx, &big, MPI_COMM_SELF), *t = open_ok(fx, &small, MPI_COMM_SELF);
  int64_t V = info_of(s).vocab_size;
  batch b = seqs_make(k_lens, NSEQ, rope_cap(fx), V, 71);
  float *all = score(s, &b), *packed = score(t, &b);
  char what[128];
  snprintf(what, sizeof what, "%s, micro_batch_tokens 16 vs 4096", dtype_name(param));
  same_bits(packed, all, b.npred, fx, what);
  for (int64_t k = 0; k < b.n; k++) {
    batch o = one_of(&b, k);
    float *alone = score(s, &o);
    snprintf(what, sizeof what, "%s, sequence %lld alone vs in the batch", dtype_name(param),
             (long long)k);
    same_bits(alone, all + pred_at(&b, k), o.npred, fx, what);
    free(alone);
    batch_free(&o);
  }
  free(all);
  free(packed);
  batch_free(&b);
  meshlm_close(s);
  meshlm_close(t);
}

/* The prompts of the generation checks: three, drawn below s's vocabulary. */
static batch prompts_of(meshlm_session *s, const char *fx) {
  static const int64_t want[] = {7, 3, 12};
  return seqs_make(want, 3, rope_cap(fx) - GEN, info_of(s).vocab_size, 97);
}

/* meshlm_generate of the prompts p on s (greedy or sampled; replica:
 * meshlm_sampling.replica, else on s's own mesh) into tok [3 GEN], len
 * [3], lp [3 GEN]. */
static void generate_into(meshlm_session *s, const batch *p, int greedy, int replica,
                          int32_t *tok, int64_t *len, float *lp) {
  meshlm_seqs q = seqs_of(p);
  meshlm_sampling sp;
  meshlm_sampling_default(&sp);
  sp.greedy = greedy;
  sp.max_new_tokens = GEN;
  sp.eos_token_id = -2;
  sp.seed = 5;
  sp.replica = replica;
  memset(lp, 0, sizeof(float) * 3 * GEN);
  memset(tok, 0, sizeof(int32_t) * 3 * GEN);
  OK(s, meshlm_generate(s, &q, &sp, tok, len, lp));
}

/* generate's log-probs on session s (every rank the same prompts; replica:
 * meshlm_sampling.replica) = meshlm_logprobs of prompt + generation on s. */
static void generate_vs_logprobs(meshlm_session *s, const char *fx, meshlm_dtype param,
                                 int greedy, int replica, const char *where) {
  int64_t V = info_of(s).vocab_size;
  batch p = prompts_of(s, fx);
  const int64_t *plens = p.lens;
  int32_t tok[3 * GEN];
  int64_t len[3];
  float glp[3 * GEN];
  generate_into(s, &p, greedy, replica, tok, len, glp);
  int64_t lens[3], n = 0;
  for (int k = 0; k < 3; k++) lens[k] = plens[k] + len[k];
  batch c = seqs_make(lens, 3, INT64_MAX, V, 1);
  for (int k = 0; k < 3; k++) {
    memcpy(c.tok + n, p.tok + tok_at(&p, k), sizeof(int32_t) * (size_t)plens[k]);
    memcpy(c.tok + n + plens[k], tok + k * GEN, sizeof(int32_t) * (size_t)len[k]);
    n += lens[k];
  }
  float *lp = xcalloc((size_t)c.npred, sizeof *lp);
  meshlm_seqs cq = seqs_of(&c);
  OK(s, meshlm_logprobs(s, &cq, NULL, lp, NULL));
  char what[160];
  for (int k = 0; k < 3; k++) {
    snprintf(what, sizeof what, "%s, %s%s generation of prompt %d vs meshlm_logprobs",
             dtype_name(param), where, greedy ? "greedy" : "sampled", k);
    same_bits(glp + k * GEN, lp + pred_at(&c, k) + plens[k] - 1, len[k], fx, what);
  }
  free(lp);
  batch_free(&c);
  batch_free(&p);
}

/* (b) generate's log-probs = meshlm_logprobs of prompt + generation. */
static void check_generate(const char *fx, meshlm_dtype param, int greedy) {
  meshlm_options o = invariant_opts(param, 4096);
  meshlm_session *s = open_ok(fx, &o, MPI_COMM_SELF);
  generate_vs_logprobs(s, fx, param, greedy, 0, "");
  meshlm_close(s);
}

/* Data-parallel rank in.dp_rank's share of b (sequences dp_rank, dp_rank +
 * dp_size, ...) as a batch of its own, and *ref (xcalloc'd) its entries of
 * all, b's log-probs scored on one rank. */
static batch dp_share(const batch *b, const float *all, const meshlm_info *in, float **ref) {
  int64_t lens[NSEQ], n = 0;
  for (int64_t k = in->dp_rank; k < b->n; k += in->dp_size) lens[n++] = b->lens[k];
  batch mine = seqs_make(lens, n, INT64_MAX, in->vocab_size, 1);
  *ref = xcalloc((size_t)(mine.npred ? mine.npred : 1), sizeof **ref);
  for (int64_t k = in->dp_rank, j = 0; k < b->n; k += in->dp_size, j++) {
    memcpy(mine.tok + tok_at(&mine, j), b->tok + tok_at(b, k),
           sizeof(int32_t) * (size_t)b->lens[k]);
    memcpy(*ref + pred_at(&mine, j), all + pred_at(b, k), sizeof(float) * (size_t)(b->lens[k] - 1));
  }
  return mine;
}

/* (c) each rank's share scored on a dp_shard = world session = the whole
 * batch scored on one rank. */
static void check_dp(const char *fx, meshlm_dtype param) {
  meshlm_options o = invariant_opts(param, 4096);
  meshlm_session *w = open_ok(fx, &o, MPI_COMM_WORLD), *s = open_ok(fx, &o, MPI_COMM_SELF);
  meshlm_info in = info_of(w);
  assert_int_equal(in.dp_size, g_world);
  batch b = seqs_make(k_lens, NSEQ, rope_cap(fx), in.vocab_size, 33);
  float *all = score(s, &b);
  float *ref;
  batch mine = dp_share(&b, all, &in, &ref);
  float *got = xcalloc((size_t)(mine.npred ? mine.npred : 1), sizeof *got);
  meshlm_seqs q = seqs_of(&mine);
  OK(w, meshlm_logprobs(w, &q, NULL, got, NULL));
  char what[128];
  snprintf(what, sizeof what, "%s, dp_shard %d rank %d vs one rank", dtype_name(param), g_world,
           in.dp_rank);
  same_bits(got, ref, mine.npred, fx, what);
  free(got);
  free(ref);
  free(all);
  batch_free(&mine);
  batch_free(&b);
  meshlm_close(s);
  meshlm_close(w);
}

/* A train step on w of q (meshlm_train_step, clipped policy gradient with a
 * k3 KL penalty) whose ref and old log-probs are ref, one rank's
 * meshlm_logprobs of q: the KL must be exactly 0 (k3 = e^d − d − 1 of d =
 * ref − logp in fp64 is 0 only where the two floats are equal). */
static void kl_zero(meshlm_session *w, meshlm_seqs q, const float *ref, const char *fx,
                    meshlm_dtype param, const char *where) {
  meshlm_loss l;
  meshlm_loss_default(&l);
  l.kind = MESHLM_LOSS_CLIPPED_PG;
  l.kl_penalty = 0.5f;
  meshlm_train_batch tb = {.struct_size = sizeof tb, .seqs = q, .old_logprobs = ref,
                           .ref_logprobs = ref};
  meshlm_step_result r = {.struct_size = sizeof r};
  OK(w, meshlm_train_step(w, &tb, &l, &r));
  if (r.kl != 0.0)
    fail_msg("%s, %s: the training forward's KL on %s %d to one rank's meshlm_logprobs is "
             "%.3g, expected exactly 0 (equal log-probs)",
             fx, dtype_name(param), where, g_world, r.kl);
}

/* (d) a train step on a dp_shard = world session under micro_batch_tokens
 * 16 (several micro-batches per rank) whose ref and old log-probs are one
 * rank's meshlm_logprobs of the whole batch: KL exactly 0. */
static void check_train(const char *fx, meshlm_dtype param) {
  meshlm_options o = invariant_opts(param, 4096), t = invariant_opts(param, 16);
  meshlm_session *w = open_ok(fx, &t, MPI_COMM_WORLD), *s = open_ok(fx, &o, MPI_COMM_SELF);
  meshlm_info in = info_of(w);
  batch b = seqs_make(k_lens, NSEQ, rope_cap(fx), in.vocab_size, 45);
  float *all = score(s, &b);
  float *ref;
  batch mine = dp_share(&b, all, &in, &ref);
  kl_zero(w, seqs_of(&mine), ref, fx, param, "dp_shard");
  free(ref);
  free(all);
  batch_free(&mine);
  batch_free(&b);
  meshlm_close(s);
  meshlm_close(w);
}

/* (e) a cp = world session (ring attention's K/V passes; every rank holds
 * two chunks of each sequence) = one rank, in meshlm_logprobs and in the
 * training forward (KL exactly 0 against one rank's log-probs, as (d)),
 * under micro_batch_tokens 16; sampled generation on the replica = the cp
 * session's meshlm_logprobs. Families with expert layers refuse cp. */
static void check_cp(const char *fx, meshlm_dtype param) {
  meshlm_options o = invariant_opts(param, 4096), t = invariant_opts(param, 16);
  t.cp = g_world;
  meshlm_session *w = open_ok(fx, &t, MPI_COMM_WORLD), *s = open_ok(fx, &o, MPI_COMM_SELF);
  meshlm_info in = info_of(w);
  assert_int_equal(in.cp, g_world);
  /* and sequences over several of attention's 128-key tiles */
  int64_t lens[NSEQ + 2], cap = rope_cap(fx) < in.max_seq_len ? rope_cap(fx) : in.max_seq_len;
  memcpy(lens, k_lens, sizeof k_lens);
  lens[NSEQ] = 300;
  lens[NSEQ + 1] = 141;
  batch b = seqs_make(lens, NSEQ + 2, cap, in.vocab_size, 59);
  float *all = score(s, &b);
  float *got = xcalloc((size_t)b.npred, sizeof *got);
  meshlm_seqs q = seqs_of(&b);
  OK(w, meshlm_logprobs(w, &q, NULL, got, NULL));
  char what[128];
  snprintf(what, sizeof what, "%s, cp %d rank %d vs one rank", dtype_name(param), g_world,
           in.cp_rank);
  same_bits(got, all, b.npred, fx, what);
  /* generation on a cp mesh runs on each rank's one-rank replica */
  snprintf(what, sizeof what, "cp %d, replica, ", g_world);
  generate_vs_logprobs(w, fx, param, 0, 1, what);
  kl_zero(w, q, all, fx, param, "cp");
  free(got);
  free(all);
  batch_free(&b);
  meshlm_close(s);
  meshlm_close(w);
}

/* The vocab-parallel plan of (f) for fixture fx: embed_tokens rowwise
 * (Replicate output) and lm_head colwise with vocab-sharded logits (loss
 * parallel), no other module sharded. The text
 * tower of a VLM (config.json's text_config) is model.language_model.
 * Each rank writes its own copy; path receives it. */
static void write_vocab_plan(const char *fx, char *path, size_t cap) {
  char cfg[PATH + 16], leaf[64];
  if (snprintf(cfg, sizeof cfg, "%s/config.json", fx) >= (int)sizeof cfg)
    fail_msg("%s: path too long", fx);
  json_error_t err;
  json_t *c = json_load_file(cfg, 0, &err);
  if (!c) fail_msg("%s: %s", cfg, err.text);
  const char *embed = json_object_get(c, "text_config") ? "model.language_model.embed_tokens"
                                                        : "model.embed_tokens";
  json_decref(c);
  snprintf(leaf, sizeof leaf, "vocab_plan_%d.json", g_rank);
  tmp_path(path, cap, leaf);
  FILE *f = fopen(path, "w");
  if (!f) fail_msg("cannot write %s", path);
  fprintf(f,
          "{\"%s\": \"embedding_rowwise\",\n"
          " \"lm_head\": {\"style\": \"ColwiseParallel\", \"output_layouts\": \"Shard(-1)\",\n"
          "             \"use_local_output\": false}}\n",
          embed);
  fclose(f);
}

/* The plans (f) runs: the vocab-parallel one (write_vocab_plan), the default ("auto") plan and
 * the default plan with sequence parallelism. */
typedef enum { TP_VOCAB, TP_AUTO, TP_AUTO_SP, TP_PLANS } tp_plan;
static const char *const k_tp_plan_name[TP_PLANS] = {"the vocab-parallel plan", "the default plan",
                                                     "the default plan with SP"};

/* Generation on the tp session w (greedy and sampled) = on the one-rank session s, bitwise:
 * tokens, lengths and out_logprobs. what: the case, for the failure message. */
static void generate_same(meshlm_session *w, meshlm_session *s, const char *fx,
                          const char *what) {
  for (int greedy = 0; greedy < 2; greedy++) {
    int32_t tw[3 * GEN], ts[3 * GEN];
    int64_t lw[3], ls[3];
    float pw[3 * GEN], ps[3 * GEN];
    batch p = prompts_of(s, fx);
    generate_into(w, &p, greedy, 0, tw, lw, pw);
    generate_into(s, &p, greedy, 0, ts, ls, ps);
    batch_free(&p);
    char msg[256];
    snprintf(msg, sizeof msg, "%s generation (%s) vs one rank", greedy ? "greedy" : "sampled",
             what);
    if (memcmp(lw, ls, sizeof lw) || memcmp(tw, ts, sizeof tw))
      fail_msg("%s, %s: the generated tokens differ", fx, msg);
    same_bits(pw, ps, 3 * GEN, fx, msg);
  }
}

/* (f) a tp = world session on plan `kind` = one rank, bitwise: meshlm_logprobs, the training
 * forward (KL exactly 0, as (d)) and generation on the tp mesh (greedy and sampled: tokens and
 * out_logprobs equal the one-rank session's). Families with expert layers run the first two
 * plans (their sparse block is replicated over tp; SP with experts is refused). */
static void check_tp(const char *fx, meshlm_dtype param, tp_plan kind) {
  char plan[4096];
  write_vocab_plan(fx, plan, sizeof plan);
  meshlm_options o = invariant_opts(param, 4096), t = invariant_opts(param, 16);
  t.tp = g_world;
  t.parallel_plan = kind == TP_VOCAB ? plan : NULL;
  t.sequence_parallel = kind == TP_AUTO_SP;
  meshlm_session *w = open_ok(fx, &t, MPI_COMM_WORLD), *s = open_ok(fx, &o, MPI_COMM_SELF);
  meshlm_info in = info_of(w);
  assert_int_equal(in.tp, g_world);
  batch b = seqs_make(k_lens, NSEQ, rope_cap(fx), in.vocab_size, 61);
  float *all = score(s, &b);
  float *got = xcalloc((size_t)b.npred, sizeof *got);
  meshlm_seqs q = seqs_of(&b);
  OK(w, meshlm_logprobs(w, &q, NULL, got, NULL));
  char what[192];
  snprintf(what, sizeof what, "%s, tp %d on %s vs one rank", dtype_name(param), g_world,
           k_tp_plan_name[kind]);
  same_bits(got, all, b.npred, fx, what);
  snprintf(what, sizeof what, "%s, tp %d, %s", dtype_name(param), g_world, k_tp_plan_name[kind]);
  generate_same(w, s, fx, what);
  snprintf(what, sizeof what, "tp (%s)", k_tp_plan_name[kind]);
  kl_zero(w, q, all, fx, param, what);
  free(got);
  free(all);
  batch_free(&b);
  meshlm_close(s);
  meshlm_close(w);
}

static void test_batches(void **state) {
  (void)state;
  char fx[MAX_FIXTURES][PATH];
  int n = fixtures(fx);
  for (int i = 0; i < n; i++) {
    check_batches(fx[i], MESHLM_DTYPE_F32);
    check_batches(fx[i], MESHLM_DTYPE_BF16);
  }
  printf("[rank %d] %d fixture families, fp32 and bf16: alone = in a batch = packed, bitwise\n",
         g_rank, n);
}

static void test_generate(void **state) {
  (void)state;
  char fx[MAX_FIXTURES][PATH];
  int n = fixtures(fx);
  for (int i = 0; i < n; i++)
    for (int greedy = 0; greedy < 2; greedy++) {
      check_generate(fx[i], MESHLM_DTYPE_F32, greedy);
      check_generate(fx[i], MESHLM_DTYPE_BF16, greedy);
    }
  printf("[rank %d] %d fixture families, fp32 and bf16, greedy and sampled: generate's "
         "log-probs = meshlm_logprobs', bitwise\n", g_rank, n);
}

static void test_dp(void **state) {
  (void)state;
  char fx[MAX_FIXTURES][PATH];
  int n = fixtures(fx);
  for (int i = 0; i < n; i++) {
    check_dp(fx[i], MESHLM_DTYPE_F32);
    check_dp(fx[i], MESHLM_DTYPE_BF16);
  }
  printf("[rank %d] %d fixture families, fp32 and bf16: dp_shard %d = one rank, bitwise\n",
         g_rank, n, g_world);
}

static void test_train(void **state) {
  (void)state;
  char fx[MAX_FIXTURES][PATH];
  int n = fixtures(fx);
  for (int i = 0; i < n; i++) {
    check_train(fx[i], MESHLM_DTYPE_F32);
    check_train(fx[i], MESHLM_DTYPE_BF16);
  }
  printf("[rank %d] %d fixture families, fp32 and bf16: the training forward's log-probs on "
         "dp_shard %d = one rank's meshlm_logprobs (KL exactly 0)\n", g_rank, n, g_world);
}

static void test_cp(void **state) {
  (void)state;
  if (g_world == 1) skip(); /* cp 1 is one rank */
  char fx[MAX_FIXTURES][PATH];
  int n = fixtures(fx), dense = 0;
  for (int i = 0; i < n; i++) {
    if (has_experts(fx[i])) continue;
    check_cp(fx[i], MESHLM_DTYPE_F32);
    check_cp(fx[i], MESHLM_DTYPE_BF16);
    dense++;
  }
  printf("[rank %d] %d fixture families without experts, fp32 and bf16: cp %d = one rank, "
         "bitwise, in meshlm_logprobs and the training forward; generation on the replica = "
         "meshlm_logprobs on cp %d\n", g_rank, dense, g_world, g_world);
}

static void test_tp(void **state) {
  (void)state;
  if (g_world == 1) skip(); /* tp 1 is one rank */
  char fx[MAX_FIXTURES][PATH];
  int n = fixtures(fx), experts = 0;
  for (int i = 0; i < n; i++) {
    int e = has_experts(fx[i]); /* SP with expert layers is refused (tp_walk.c) */
    experts += e;
    for (int kind = 0; kind < (e ? TP_AUTO_SP : TP_PLANS); kind++) {
      check_tp(fx[i], MESHLM_DTYPE_F32, kind);
      check_tp(fx[i], MESHLM_DTYPE_BF16, kind);
    }
  }
  printf("[rank %d] %d fixture families (%d with experts: their sparse block replicated over "
         "tp, no SP), fp32 and bf16, the vocab-parallel plan, the default plan and the default "
         "plan with SP: tp %d = one rank, bitwise, in meshlm_logprobs, the training forward and "
         "generation\n", g_rank, n, experts, g_world);
}

/* (g) llama_h9kv3 with its PEFT adapter (every linear, lora_B non-zero) on a tp = world
 * session of the default plan, fp32 and bf16: meshlm_logprobs, generation (tokens and
 * out_logprobs) and the training forward (KL exactly 0, as (d)) equal one rank's with the
 * same adapter. The row-parallel linears'
 * adapters are computed whole as their weights are (lora_A's columns and its input
 * gathered). */
static void check_tp_lora(meshlm_dtype param) {
  char fx[PATH], ad[PATH];
  snprintf(fx, sizeof fx, "%s/tests/fixtures/llama_h9kv3", ML_SOURCE_DIR);
  snprintf(ad, sizeof ad, "%s/tests/fixtures/llama_h9kv3_lora", ML_SOURCE_DIR);
  meshlm_options o = invariant_opts(param, 4096), t = invariant_opts(param, 16);
  o.adapter = t.adapter = ad;
  t.tp = g_world;
  meshlm_session *w = open_ok(fx, &t, MPI_COMM_WORLD), *s = open_ok(fx, &o, MPI_COMM_SELF);
  meshlm_info in = info_of(w);
  batch b = seqs_make(k_lens, NSEQ, INT64_MAX, in.vocab_size, 67);
  float *all = score(s, &b);
  float *got = xcalloc((size_t)b.npred, sizeof *got);
  meshlm_seqs q = seqs_of(&b);
  OK(w, meshlm_logprobs(w, &q, NULL, got, NULL));
  char what[128];
  snprintf(what, sizeof what, "%s, LoRA adapter, tp %d on the default plan vs one rank",
           dtype_name(param), g_world);
  same_bits(got, all, b.npred, fx, what);
  snprintf(what, sizeof what, "%s, LoRA adapter, tp %d, the default plan", dtype_name(param),
           g_world);
  generate_same(w, s, fx, what);
  kl_zero(w, q, all, fx, param, "tp with a LoRA adapter");
  free(got);
  free(all);
  batch_free(&b);
  meshlm_close(s);
  meshlm_close(w);
}

static void test_tp_lora(void **state) {
  (void)state;
  if (g_world == 1) skip(); /* tp 1 is one rank */
  check_tp_lora(MESHLM_DTYPE_F32);
  check_tp_lora(MESHLM_DTYPE_BF16);
  printf("[rank %d] llama_h9kv3 with its LoRA adapter, fp32 and bf16, the default plan: tp %d = "
         "one rank, bitwise, in meshlm_logprobs, generation and the training forward\n", g_rank,
         g_world);
}

int main(int argc, char **argv) {
  api_init(&argc, &argv);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_batches),
      cmocka_unit_test(test_generate),
      cmocka_unit_test(test_dp),
      cmocka_unit_test(test_train),
      cmocka_unit_test(test_cp),
      cmocka_unit_test(test_tp),
      cmocka_unit_test(test_tp_lora),
  };
  return api_finish(cmocka_run_group_tests(tests, NULL, NULL));
}

/* Router replay through the library (meshlm_scores.routing, meshlm_train_batch.routing;
 * model/moe.h), on the qwen3_moe fixture (8 experts, top 2, layer 0 dense), sessions on
 * MPI_COMM_SELF (every rank alone):
 * - test_record: meshlm_score's routing holds −1 at the dense layer and k distinct experts
 *   in 0 .. E − 1 at each sparse layer for every token.
 * - test_replay_own: a train step replaying the routing meshlm_score recorded gives
 *   bitwise the loss and grad norm of the same step without it, and bitwise the same
 *   weights after it (the next log-probs, memcmp); meshlm_eval_loss likewise.
 * - test_replay_other: the routing shifted by one expert changes the train step's loss and
 *   meshlm_eval_loss's (the replayed routing is what the layers use on both paths).
 * - test_eval_aux: meshlm_eval_loss = meshlm_forward_backward's loss bitwise at the same
 *   weights, the fixture's load-balancing term (output_router_logits, coef 0.25) included in
 *   both, summed over the several micro-batches the same way (without it in eval the two
 *   differ by that term).
 * - test_refused: routing on a model without experts, and with objective_seq_logprobs, is
 *   refused naming the field.
 * - test_tp_ep (api_moe_2ranks): a session on both ranks with tp 2 × ep 2 (each tp rank
 *   dispatching its chunk of the tokens, model/moe.h), both it and the one-rank session in
 *   the batch-invariant mode (tp's bits one rank's): meshlm_score's routing equals the
 *   one-rank session's (memcmp), and replaying it gives bitwise the train step's loss and
 *   grad norm without it. On one rank: skipped. */
#include "api_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { NSEQ = 3 };
static const int64_t LENS[NSEQ] = {9, 14, 6};

/* The qwen3_moe fixture's directory. */
static const char *moe_dir(void) {
  static char dir[4096];
  snprintf(dir, sizeof dir, "%s/tests/fixtures/qwen3_moe", ML_SOURCE_DIR);
  return dir;
}

typedef struct moe_batch {
  int32_t tok[9 + 14 + 6];
  int64_t ntok, npred, cols; /* cols: layers · k */
  int64_t layers, k, experts;
} moe_batch;

/* Deterministic tokens below the vocabulary, and the model's routing sizes. */
static void moe_batch_make(meshlm_session *s, moe_batch *b) {
  meshlm_info in = info_of(s);
  memset(b, 0, sizeof *b);
  for (int64_t q = 0; q < NSEQ; q++) {
    b->ntok += LENS[q];
    b->npred += LENS[q] - 1;
  }
  for (int64_t i = 0; i < b->ntok; i++) b->tok[i] = (int32_t)((i * 7919 + 13) % in.vocab_size);
  char path[4200];
  snprintf(path, sizeof path, "%s/config.json", moe_dir());
  json_error_t err;
  json_t *c = json_load_file(path, 0, &err);
  if (!c) fail_msg("%s: %s", path, err.text);
  b->layers = json_integer_value(json_object_get(c, "num_hidden_layers"));
  b->k = json_integer_value(json_object_get(c, "num_experts_per_tok"));
  json_t *e = json_object_get(c, "num_local_experts"); /* Mixtral's name, as the fixture's */
  b->experts = json_integer_value(e ? e : json_object_get(c, "num_experts"));
  json_decref(c);
  b->cols = b->layers * b->k;
}

static meshlm_seqs seqs(const moe_batch *b) {
  return (meshlm_seqs){NSEQ, LENS, b->tok};
}

/* A session whose micro-batches hold at most 16 tokens: the batch's sequences (9, 14, 6)
 * go into several, so the routing's packing into them is exercised. */
static meshlm_session *moe_open(void) {
  meshlm_options o;
  meshlm_options_default(&o);
  o.micro_batch_tokens = 16;
  return open_ok(moe_dir(), &o, MPI_COMM_SELF);
}

/* The routing meshlm_score records for b: [ntok, layers, k], caller frees. */
static int32_t *record(meshlm_session *s, const moe_batch *b) {
  int32_t *rt = xcalloc((size_t)(b->ntok * b->cols), sizeof(int32_t));
  float *lp = xcalloc((size_t)b->npred, sizeof(float));
  meshlm_seqs q = seqs(b);
  meshlm_scores out = {.struct_size = sizeof out, .logprobs = lp, .routing = rt};
  local_ok(s, meshlm_score(s, &q, NULL, &out), "meshlm_score with routing");
  free(lp);
  return rt;
}

static void test_record(void **state) {
  (void)state;
  meshlm_session *s = moe_open();
  moe_batch b;
  moe_batch_make(s, &b);
  int32_t *rt = record(s, &b);
  for (int64_t t = 0; t < b.ntok; t++)
    for (int64_t l = 0; l < b.layers; l++) {
      const int32_t *r = rt + (t * b.layers + l) * b.k;
      for (int64_t j = 0; j < b.k; j++) {
        if (l == 0) { /* the fixture's mlp_only_layers [0] */
          assert_int_equal(r[j], -1);
          continue;
        }
        assert_true(r[j] >= 0 && r[j] < b.experts);
        for (int64_t i = 0; i < j; i++) assert_int_not_equal(r[i], r[j]);
      }
    }
  free(rt);
  meshlm_close(s);
}

/* One train step of b on s (routing NULL: the model's own): the result. */
static meshlm_step_result train(meshlm_session *s, const moe_batch *b, const int32_t *routing) {
  meshlm_train_batch tb = {.struct_size = sizeof tb, .seqs = seqs(b), .routing = routing};
  meshlm_step_result r = {.struct_size = sizeof r};
  local_ok(s, meshlm_train_step(s, &tb, NULL, &r), "meshlm_train_step");
  return r;
}

static double eval(meshlm_session *s, const moe_batch *b, const int32_t *routing) {
  meshlm_train_batch tb = {.struct_size = sizeof tb, .seqs = seqs(b), .routing = routing};
  meshlm_step_result r = {.struct_size = sizeof r};
  local_ok(s, meshlm_eval_loss(s, &tb, NULL, &r), "meshlm_eval_loss");
  return r.loss;
}

static float *logprobs(meshlm_session *s, const moe_batch *b) {
  float *lp = xcalloc((size_t)b->npred, sizeof(float));
  meshlm_seqs q = seqs(b);
  local_ok(s, meshlm_logprobs(s, &q, NULL, lp, NULL), "meshlm_logprobs");
  return lp;
}

static void test_replay_own(void **state) {
  (void)state;
  meshlm_session *a = moe_open(), *c = moe_open();
  moe_batch b;
  moe_batch_make(a, &b);
  int32_t *rt = record(a, &b);
  double ea = eval(a, &b, NULL), ec = eval(c, &b, rt);
  assert_memory_equal(&ea, &ec, sizeof ea);
  meshlm_step_result ra = train(a, &b, NULL), rc = train(c, &b, rt);
  printf("loss %.17g / replayed %.17g, grad norm %.17g / %.17g\n", ra.loss, rc.loss,
         ra.grad_norm, rc.grad_norm);
  assert_memory_equal(&ra.loss, &rc.loss, sizeof ra.loss);
  assert_memory_equal(&ra.grad_norm, &rc.grad_norm, sizeof ra.grad_norm);
  float *la = logprobs(a, &b), *lc = logprobs(c, &b);
  assert_memory_equal(la, lc, sizeof(float) * (size_t)b.npred);
  free(la);
  free(lc);
  free(rt);
  meshlm_close(c);
  meshlm_close(a);
}

static void test_replay_other(void **state) {
  (void)state;
  meshlm_session *a = moe_open(), *c = moe_open();
  moe_batch b;
  moe_batch_make(a, &b);
  int32_t *rt = record(a, &b);
  for (int64_t i = 0; i < b.ntok * b.cols; i++)
    if (rt[i] >= 0) rt[i] = (int32_t)((rt[i] + 1) % b.experts);
  double e_own = eval(a, &b, NULL), e_other = eval(c, &b, rt);
  meshlm_step_result ra = train(a, &b, NULL), rc = train(c, &b, rt);
  printf("loss %.17g, replaying another routing %.17g; eval_loss %.17g, %.17g\n", ra.loss,
         rc.loss, e_own, e_other);
  assert_true(ra.loss != rc.loss);
  assert_true(e_own != e_other); /* the forward-only path replays too */
  free(rt);
  meshlm_close(c);
  meshlm_close(a);
}

static void test_eval_aux(void **state) {
  (void)state;
  meshlm_session *s = moe_open();
  moe_batch b;
  moe_batch_make(s, &b);
  meshlm_train_batch tb = {.struct_size = sizeof tb, .seqs = seqs(&b)};
  meshlm_step_result ev = {.struct_size = sizeof ev}, fb = ev;
  local_ok(s, meshlm_eval_loss(s, &tb, NULL, &ev), "meshlm_eval_loss");
  local_ok(s, meshlm_zero_grad(s), "meshlm_zero_grad");
  local_ok(s, meshlm_forward_backward(s, &tb, NULL, &fb), "meshlm_forward_backward");
  printf("eval_loss %.17g, forward_backward %.17g\n", ev.loss, fb.loss);
  assert_memory_equal(&ev.loss, &fb.loss, sizeof ev.loss);
  assert_int_equal(ev.tokens, fb.tokens);
  meshlm_close(s);
}

/* A custom objective the refused call never reaches. */
static int never(void *ctx, const meshlm_objective_chunk *c) {
  (void)ctx;
  (void)c;
  fail_msg("the objective ran on a refused call");
  return -1;
}

static void test_refused(void **state) {
  (void)state;
  meshlm_session *s = moe_open();
  moe_batch b;
  moe_batch_make(s, &b);
  int32_t *rt = record(s, &b);
  meshlm_train_batch tb = {.struct_size = sizeof tb, .seqs = seqs(&b), .routing = rt};
  meshlm_loss l;
  meshlm_loss_default(&l);
  l.kind = MESHLM_LOSS_CUSTOM;
  l.objective_seq_logprobs = 1;
  l.objective = never;
  meshlm_step_result r = {.struct_size = sizeof r};
  expect_fail(s, meshlm_forward_backward(s, &tb, &l, &r), "batch->routing with "
              "loss.objective_seq_logprobs", "routing with objective_seq_logprobs");
  meshlm_close(s);
  meshlm_options o;
  meshlm_options_default(&o);
  meshlm_session *dense = open_ok(g_fixture, &o, MPI_COMM_SELF);
  float lp[64];
  int64_t len = 8;
  int32_t tok[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  meshlm_seqs q = {1, &len, tok};
  meshlm_scores out = {.struct_size = sizeof out, .logprobs = lp, .routing = rt};
  expect_fail(dense, meshlm_score(dense, &q, NULL, &out), "out->routing is set but",
              "routing on a dense model");
  free(rt);
  meshlm_close(dense);
}

static void test_tp_ep(void **state) {
  (void)state;
  if (g_world != 2) skip();
  meshlm_options o;
  meshlm_options_default(&o);
  o.micro_batch_tokens = 16;
  o.batch_invariant = 1;
  meshlm_session *one = open_ok(moe_dir(), &o, MPI_COMM_SELF);
  o.tp = 2;
  o.ep = 2;
  meshlm_session *a = open_ok(moe_dir(), &o, MPI_COMM_WORLD), *c = open_ok(moe_dir(), &o,
                                                                           MPI_COMM_WORLD);
  moe_batch b;
  moe_batch_make(a, &b);
  int32_t *r1 = record(one, &b), *rt = record(a, &b);
  assert_memory_equal(r1, rt, sizeof(int32_t) * (size_t)(b.ntok * b.cols));
  meshlm_step_result ra = train(a, &b, NULL), rc = train(c, &b, rt);
  printf("tp 2 x ep 2: routing = one rank's; loss %.17g / replayed %.17g, grad norm %.17g / "
         "%.17g\n", ra.loss, rc.loss, ra.grad_norm, rc.grad_norm);
  assert_memory_equal(&ra.loss, &rc.loss, sizeof ra.loss);
  assert_memory_equal(&ra.grad_norm, &rc.grad_norm, sizeof ra.grad_norm);
  free(r1);
  free(rt);
  meshlm_close(c);
  meshlm_close(a);
  meshlm_close(one);
}

int main(int argc, char **argv) {
  api_init(&argc, &argv);
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_record),
                                     cmocka_unit_test(test_replay_own),
                                     cmocka_unit_test(test_replay_other),
                                     cmocka_unit_test(test_eval_aux),
                                     cmocka_unit_test(test_refused),
                                     cmocka_unit_test(test_tp_ep)};
  return api_finish(cmocka_run_group_tests(tests, NULL, NULL));
}

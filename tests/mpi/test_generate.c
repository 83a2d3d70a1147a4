/* Generation with a KV cache (engine/generate.h) on one rank:
 * `test_generate FIXTURE`. Prompts are pieces of the fixture's rows.
 *  - greedy against the full forward: each generated token's log-prob is
 *    the engine's log-prob of prompt + generated tokens at that position,
 *    and the token is the argmax of the full forward's distribution, both
 *    within tolerance.h's bounds; in fp32 and with bf16 parameters; the
 *    engine's log-probs before and after the call are bitwise equal;
 *  - greedy tokens = transformers' generate (the fixture's generate.json);
 *  - batching (continuous), in the batch-invariant mode: prompts of
 *    different lengths and a repeated prompt give each row bitwise what it
 *    gets alone, in another order,
 *    arriving one or two at a time, with chunked prefill (greedy), and a
 *    sampled row (top_k, top_p, min_p, 3 samples per prompt) what it gets
 *    in another batch or arrival;
 *  - preemption: rows in a pool too small for all bitwise a roomy pool's;
 *  - n samples per prompt, max_new per prompt, stop ids, finish reasons;
 *  - seeds, top_p → 0 (greedy), eos, max_new 1;
 *  - argument errors. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <jansson.h>
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine_run.h"
#include "parity_util.h"
#include "engine/generate.h"
#include "engine/kvcache.h"

enum { NMAX = 4, RMAX = 12, NEW = 16 };

static const char *g_fixture;

/* Prompts: n pieces of the fixture's rows, concatenated. */
typedef struct prompts {
  int64_t n, lens[NMAX];
  int32_t tokens[NMAX * 24];
} prompts;

/* Add fixture row `row`'s tokens off .. off+len−1 as the next prompt. */
static void add(prompts *p, const fixture *fx, int64_t row, int64_t off, int64_t len) {
  int64_t at = 0;
  for (int64_t k = 0; k < p->n; k++) at += p->lens[k];
  memcpy(p->tokens + at, fx->ids + row * fx->S + off, sizeof(int32_t) * (size_t)len);
  p->lens[p->n++] = len;
}

/* The first token of prompt k. */
static const int32_t *prompt_at(const prompts *p, int64_t k) {
  int64_t at = 0;
  for (int64_t i = 0; i < k; i++) at += p->lens[i];
  return p->tokens + at;
}

typedef struct result { /* up to RMAX rows (prompts x samples) */
  int32_t tok[RMAX * NEW];
  int64_t len[RMAX];
  float lp[RMAX * NEW];
  int32_t fin[RMAX];
} result;

static ml_gen_opts greedy(void) {
  return (ml_gen_opts){.max_new = NEW, .n_samples = 1, .sampler = {.greedy = true}};
}

static ml_gen_opts sampled(float temperature, float top_p, uint64_t seed) {
  return (ml_gen_opts){.max_new = NEW, .n_samples = 1, .seed = seed,
                       .sampler = {.temperature = temperature, .top_p = top_p}};
}

static void generate(run *r, const prompts *p, const ml_gen_opts *o, result *out) {
  if (ml_generate(&r->e, p->n, p->lens, p->tokens, o, out->tok, out->len, out->lp, out->fin))
    fail_msg("generate: %s", ml_error_msg());
}

/* The engine on the fixture; invariant: the batch-invariant mode, where a
 * row's GEMMs and attention reduce in an order that does not depend on the
 * step's other rows (engine.h batch_invariant): the tests asserting a row
 * bitwise the same in any batch run there, so that the claim holds by
 * construction on every CPU rather than by a BLAS's choice of kernel. */
static void open_fixture(run *r, fixture *fx, ml_dtype param_dtype, bool invariant) {
  fixture_load(g_fixture, fx);
  ml_engine_opts opts = ml_engine_opts_default();
  opts.fsdp.param_dtype = param_dtype;
  opts.batch_invariant = invariant;
  run_open(r, MPI_COMM_SELF, 1, 1, &opts, fx->dir);
}

/* The engine's log-probs of the fixture batch [B, S−1] into lp (malloc'd). */
static float *fixture_logprobs(run *r, const fixture *fx) {
  float *lp = malloc(sizeof(float) * (size_t)(fx->B * (fx->S - 1)));
  if (!lp || ml_engine_logprobs(&r->e, fx->ids, fx->B, fx->S, lp))
    fail_msg("logprobs: %s", lp ? ml_error_msg() : "out of memory");
  return lp;
}

/* The full forward's log-probs f [V] of every token v after prompt k and
 * its first j generated tokens: V sequences (that prefix, then v) through
 * ml_engine_logprobs, each's last position. */
static void full_distribution(run *r, const prompts *p, int64_t k, const result *g, int64_t j,
                              float *f) {
  int64_t V = r->e.model.cfg.vocab, P = p->lens[k], S = P + j + 1;
  int32_t *ids = malloc(sizeof(int32_t) * (size_t)(V * S));
  float *lp = malloc(sizeof(float) * (size_t)(V * (S - 1)));
  if (!ids || !lp) fail_msg("out of memory");
  for (int64_t v = 0; v < V; v++) {
    memcpy(ids + v * S, prompt_at(p, k), sizeof(int32_t) * (size_t)P);
    memcpy(ids + v * S + P, g->tok + k * NEW, sizeof(int32_t) * (size_t)j);
    ids[v * S + S - 1] = (int32_t)v;
  }
  int rc = ml_engine_logprobs(&r->e, ids, V, S, lp);
  for (int64_t v = 0; rc == 0 && v < V; v++) f[v] = lp[v * (S - 1) + S - 2];
  free(ids);
  free(lp);
  if (rc) fail_msg("logprobs: %s", ml_error_msg());
}

/* Greedy generation against the full forward, with parameters in
 * param_dtype. The compared quantities are two evaluations of the same
 * log-probs: in fp32 in different orders (the cache's attention over one
 * query row, tolerance.h §3 tol_model_pair, relative L2), with bf16
 * parameters each also with its own rounding sites (§4 tol_bf16_pair).
 * Argmax: the cache path's log-probs c [V] and the full path's f [V] at a
 * position satisfy ||c − f|| <= tol·||f|| (the bound applied to that
 * tensor); the generated t maximises c, so for every v, f_t >= f_v −
 * |c_t − f_t| − |c_v − f_v| >= f_v − sqrt(2)·tol·||f||. */
static void check_greedy(ml_dtype param_dtype) {
  static fixture fx;
  static run r;
  open_fixture(&r, &fx, param_dtype, false);
  prompts p = {0};
  add(&p, &fx, 0, 0, 5);
  add(&p, &fx, 1, 2, 9);
  float *before = fixture_logprobs(&r, &fx);
  result g;
  ml_gen_opts o = greedy();
  generate(&r, &p, &o, &g);
  float *after = fixture_logprobs(&r, &fx);
  /* the engine is restored: the same kernels on the same inputs (TOL_EXACT) */
  assert_memory_equal(before, after, sizeof(float) * (size_t)(fx.B * (fx.S - 1)));
  free(before);
  free(after);
  int64_t V = r.e.model.cfg.vocab;
  tol_model tm = tol_model_of(&r, p.lens[1] + NEW, V * (p.lens[1] + NEW));
  double tol = param_dtype == ML_BF16 ? tol_bf16_pair(&tm, TOL_LOGPROBS)
                                      : tol_model_pair(&tm, TOL_LOGPROBS);
  float *f = malloc(sizeof(float) * (size_t)V), ref[NMAX * NEW], got[NMAX * NEW];
  if (!f) fail_msg("out of memory");
  int64_t m = 0;
  double worst_gap = 0;
  for (int64_t k = 0; k < p.n; k++) {
    assert_int_equal(g.len[k], NEW);
    for (int64_t j = 0; j < NEW; j++) {
      full_distribution(&r, &p, k, &g, j, f);
      int32_t t = g.tok[k * NEW + j];
      double best = -INFINITY, norm = 0;
      for (int64_t v = 0; v < V; v++) {
        best = fmax(best, f[v]);
        norm += (double)f[v] * f[v];
      }
      double gap = (best - f[t]) / (sqrt(2.0) * tol * sqrt(norm));
      worst_gap = fmax(worst_gap, gap);
      if (gap > 1.0)
        fail_msg("prompt %lld step %lld: token %d has log-prob %.7g, the full forward's max is "
                 "%.7g (gap %.3g of the bound)",
                 (long long)k, (long long)j, t, f[t], best, gap);
      ref[m] = f[t];
      got[m++] = g.lp[k * NEW + j];
    }
  }
  free(f);
  double err = rel_l2(got, ref, m);
  printf("%s %s greedy vs full forward: log-probs rel L2 %.3g (bound %.3g); argmax gap %.3g of "
         "its bound\n",
         g_fixture, param_dtype == ML_BF16 ? "bf16" : "fp32", err, tol, worst_gap);
  assert_true(err <= tol);
  run_close(&r);
  fixture_free(&fx);
}

static void test_greedy_fp32(void **state) {
  (void)state;
  check_greedy(ML_F32);
}

static void test_greedy_bf16(void **state) {
  (void)state;
  check_greedy(ML_BF16);
}

/* Greedy tokens = transformers' (tools/gen_generate_fixture.py: generate
 * with do_sample=False on the fixture in float64, each prompt alone; the
 * fixture's generate.json): all three prompts in one call, fp32. Exact
 * tokens: a token could differ only where two candidates tie within fp32
 * rounding, which the fixtures' random weights do not produce (the greedy
 * tests above bound the gap of every generated token). */
static void test_greedy_transformers(void **state) {
  (void)state;
  static fixture fx;
  static run r;
  open_fixture(&r, &fx, ML_F32, false);
  char path[600];
  snprintf(path, sizeof path, "%s/generate.json", fx.dir);
  json_error_t err;
  json_t *root = json_load_file(path, 0, &err);
  if (!root) fail_msg("%s: %s (tools/gen_generate_fixture.py writes it)", path, err.text);
  json_t *jp = json_object_get(root, "prompts"), *jt = json_object_get(root, "tokens");
  assert_int_equal(json_integer_value(json_object_get(root, "new")), NEW);
  prompts p = {0};
  for (size_t k = 0; k < json_array_size(jp); k++) {
    json_t *row = json_array_get(jp, k);
    int64_t at = 0;
    for (int64_t i = 0; i < p.n; i++) at += p.lens[i];
    for (size_t i = 0; i < json_array_size(row); i++)
      p.tokens[at + (int64_t)i] = (int32_t)json_integer_value(json_array_get(row, i));
    p.lens[p.n++] = (int64_t)json_array_size(row);
  }
  assert_int_equal(p.n, 3);
  result g;
  ml_gen_opts o = greedy();
  generate(&r, &p, &o, &g);
  for (int64_t k = 0; k < p.n; k++) {
    assert_int_equal(g.len[k], NEW);
    for (int64_t j = 0; j < NEW; j++) {
      int32_t want = (int32_t)json_integer_value(json_array_get(json_array_get(jt, k), j));
      if (g.tok[k * NEW + j] != want)
        fail_msg("prompt %lld, token %lld: %d; transformers' greedy generate gives %d",
                 (long long)k, (long long)j, g.tok[k * NEW + j], want);
    }
  }
  printf("%s: greedy tokens = transformers' (3 prompts x %d)\n", g_fixture, NEW);
  json_decref(root);
  run_close(&r);
  fixture_free(&fx);
}

/* Row k of a equals row kb of b bitwise: length, tokens, log-probs and
 * finish reason. generate.h: a sequence's computation is the same block
 * attention calls and row-wise kernels whatever its batch, and its draws
 * its own stream's; the GEMMs see other M (tokens per step) — bitwise when
 * their rows do not depend on M (oneDNN's fp32/bf16 matmul on this CPU;
 * this test is the check). */
static void same_row(const result *a, int64_t k, const result *b, int64_t kb) {
  assert_int_equal(a->len[k], b->len[kb]);
  assert_int_equal(a->fin[k], b->fin[kb]);
  assert_memory_equal(a->tok + k * NEW, b->tok + kb * NEW, sizeof(int32_t) * NEW);
  assert_memory_equal(a->lp + k * NEW, b->lp + kb * NEW, sizeof(float) * NEW);
}

/* Prompt k of p alone, as a batch. */
static prompts alone(const prompts *p, int64_t k) {
  prompts q = {.n = 1, .lens = {p->lens[k]}};
  memcpy(q.tokens, prompt_at(p, k), sizeof(int32_t) * (size_t)p->lens[k]);
  return q;
}

/* p's prompts in the order perm. */
static prompts permuted(const prompts *p, const int64_t *perm) {
  prompts q = {0};
  for (int64_t i = 0; i < p->n; i++) {
    int64_t at = 0;
    for (int64_t k = 0; k < i; k++) at += q.lens[k];
    q.lens[i] = p->lens[perm[i]];
    memcpy(q.tokens + at, prompt_at(p, perm[i]), sizeof(int32_t) * (size_t)q.lens[i]);
    q.n++;
  }
  return q;
}

/* The batch of four prompts (lengths 4, 7, 4 repeated, 4) the invariance tests run. */
static prompts four(const fixture *fx) {
  prompts p = {0};
  add(&p, fx, 0, 0, 4);
  add(&p, fx, 1, 0, 7);
  add(&p, fx, 0, 0, 4);
  add(&p, fx, 1, 5, 4);
  return p;
}

/* max_kv_bytes of `blocks` KV blocks of r's model in the storage generate
 * picks for its parameters (kvcache.h: bf16 with bf16 parameters, half the
 * bytes of fp32: were the cache fp32 there, `blocks` bf16 blocks would hold
 * half as many and the calls below would be refused). */
static int64_t kv_bytes(const run *r, int64_t blocks) {
  const ml_model_config *c = &r->e.model.cfg;
  return blocks * ml_kv_block_bytes(c, c->n_kv_heads, r->e.opts.fsdp.param_dtype == ML_BF16);
}

/* Greedy: every row as its prompt alone, in any order of the prompts, and
 * whatever the order of arrival — all at once, one at a time
 * (max_running 1: each enters when the previous finished), two at a time
 * with prefill chunks of 3 tokens mixed into decode steps, one at a time
 * for want of KV blocks (max_kv_bytes of 2 blocks: a prompt of 4 or 7
 * tokens + 15 fed tokens needs 2 of 16 positions) — bitwise; with
 * parameters in param_dtype (fp32, bf16). */
static void check_invariance_greedy(ml_dtype param_dtype) {
  static fixture fx;
  static run r;
  open_fixture(&r, &fx, param_dtype, true);
  prompts p = four(&fx);
  result all, one;
  ml_gen_opts o = greedy();
  generate(&r, &p, &o, &all);
  for (int64_t k = 0; k < p.n; k++) {
    prompts q = alone(&p, k);
    generate(&r, &q, &o, &one);
    same_row(&all, k, &one, 0);
  }
  static const int64_t perm[] = {3, 1, 0, 2};
  prompts q = permuted(&p, perm);
  generate(&r, &q, &o, &one);
  for (int64_t i = 0; i < p.n; i++) same_row(&all, perm[i], &one, i);
  static const int64_t running[] = {1, 2, 0}, chunk[] = {0, 3, 0}, blocks[] = {0, 0, 2};
  for (int i = 0; i < 3; i++) {
    o.max_running = running[i];
    o.prefill_tokens = chunk[i];
    o.max_kv_bytes = kv_bytes(&r, blocks[i]);
    generate(&r, &p, &o, &one);
    for (int64_t k = 0; k < p.n; k++) same_row(&all, k, &one, k);
  }
  run_close(&r);
  fixture_free(&fx);
}

static void test_batch_invariance_greedy(void **state) {
  (void)state;
  check_invariance_greedy(ML_F32);
}

static void test_batch_invariance_greedy_bf16(void **state) {
  (void)state;
  check_invariance_greedy(ML_BF16);
}

/* Sampled (temperature, top_k, top_p, min_p together), 3 samples per
 * prompt: a row's draws depend on the seed and its row only, so each row
 * is bitwise the same whatever its arrival (all at once, one prompt's
 * group at a time, chunked prefill) and whatever the other prompts (rows of
 * prompt 0 with prompts 1 .. 3 replaced by others); a prompt's samples
 * differ from one another (their own streams); the repeated prompt's rows
 * differ from the first's. */
static void test_batch_invariance_sampled(void **state) {
  (void)state;
  static fixture fx;
  static run r;
  open_fixture(&r, &fx, ML_F32, true);
  prompts p = four(&fx);
  result all, one;
  ml_gen_opts o = sampled(0.8f, 0.9f, 11);
  o.sampler.top_k = 20;
  o.sampler.min_p = 0.02f;
  o.n_samples = 3;
  generate(&r, &p, &o, &all);
  int64_t R = p.n * 3;
  /* one prompt's group at a time: for want of slots, then of KV blocks (its 3
     samples share no full block of a 4- or 7-token prompt: 3 x 2 blocks) */
  static const int64_t running[] = {3, 4, 0}, chunk[] = {0, 3, 0}, blocks[] = {0, 0, 6};
  for (int i = 0; i < 3; i++) {
    o.max_running = running[i];
    o.prefill_tokens = chunk[i];
    o.max_kv_bytes = kv_bytes(&r, blocks[i]);
    generate(&r, &p, &o, &one);
    for (int64_t k = 0; k < R; k++) same_row(&all, k, &one, k);
  }
  o.max_running = o.prefill_tokens = o.max_kv_bytes = 0;
  prompts q = {0};
  add(&q, &fx, 0, 0, 4);
  add(&q, &fx, 1, 3, 6);
  generate(&r, &q, &o, &one);
  for (int64_t j = 0; j < 3; j++) same_row(&all, j, &one, j);
  assert_memory_not_equal(all.tok, all.tok + NEW, sizeof(int32_t) * NEW);
  assert_memory_not_equal(all.tok, all.tok + 6 * NEW, sizeof(int32_t) * NEW);
  run_close(&r);
  fixture_free(&fx);
}

/* Preemption (vLLM's recompute preemption, generate.h): in a pool too small
 * for every running sequence to its end, sequences enter on their current
 * need and the last-arrived running one is preempted when another finds no
 * free block, re-entering later by prefilling its prompt and its generated
 * tokens again. In the batch-invariant mode every row is bitwise the row of
 * a pool with room for all (tokens, log-probs, lengths, finish reasons):
 * greedy and sampled (temperature, top_k, top_p, min_p), 3 samples a prompt
 * (an 18-token prompt's samples share its full block), and with chunked
 * prefill (a resumed row's prefill in chunks of 5); preemptions > 0 is
 * asserted for each tight pool (ml_gen_stats), none with room for all. */
static void test_preemption(void **state) {
  (void)state;
  static fixture fx;
  static run r;
  open_fixture(&r, &fx, ML_F32, true);
  prompts p = {0};
  add(&p, &fx, 0, 0, 18);
  add(&p, &fx, 1, 0, 7);
  add(&p, &fx, 0, 2, 4);
  ml_gen_opts modes[2] = {greedy(), sampled(0.8f, 0.9f, 5)};
  modes[1].sampler.top_k = 20;
  modes[1].sampler.min_p = 0.02f;
  for (int m = 0; m < 2; m++) {
    ml_gen_stats st;
    ml_gen_opts o = modes[m];
    o.n_samples = 3;
    o.stats = &st;
    result all, one;
    generate(&r, &p, &o, &all);
    assert_int_equal(st.preemptions, 0);
    /* least_blocks of these prompts, 3 samples each: the 18-token prompt's
       group enters on 2 + 1 + 1 blocks, one of its rows alone ends in 3 */
    static const int64_t blocks[] = {4, 5, 4}, running[] = {0, 0, 4}, chunk[] = {0, 0, 5};
    for (int i = 0; i < 3; i++) {
      o.max_kv_bytes = kv_bytes(&r, blocks[i]);
      o.max_running = running[i];
      o.prefill_tokens = chunk[i];
      generate(&r, &p, &o, &one);
      if (st.preemptions < 1)
        fail_msg("%s, %lld blocks: no preemption; expected some (a pool of %lld blocks for "
                 "rows needing up to 3 each)", m ? "sampled" : "greedy", (long long)blocks[i],
                 (long long)blocks[i]);
      printf("  %s, %lld KV blocks, max_running %lld, prefill_tokens %lld: %lld preemptions, "
             "rows bitwise the roomy pool's\n", m ? "sampled" : "greedy", (long long)blocks[i],
             (long long)running[i], (long long)chunk[i], (long long)st.preemptions);
      for (int64_t k = 0; k < p.n * 3; k++) same_row(&all, k, &one, k);
    }
  }
  run_close(&r);
  fixture_free(&fx);
}

/* n samples, greedy: each sample is the n = 1 row (the prompt's prefill
 * copied to every sample's slot bitwise); max_new per prompt and finish
 * reasons: a row stops at its own max_new (length) or its first stop id
 * (stop), the rows' tokens the unbounded run's up to there. */
static void test_samples_and_limits(void **state) {
  (void)state;
  static fixture fx;
  static run r;
  open_fixture(&r, &fx, ML_F32, true);
  prompts p = four(&fx);
  result one, got;
  ml_gen_opts o = greedy();
  generate(&r, &p, &o, &one);
  for (int64_t k = 0; k < p.n; k++) assert_int_equal(one.fin[k], ML_FINISH_LENGTH);
  o.n_samples = 2;
  generate(&r, &p, &o, &got);
  for (int64_t r2 = 0; r2 < 2 * p.n; r2++) same_row(&one, r2 / 2, &got, r2);
  o.n_samples = 1;
  int64_t per[NMAX] = {3, NEW, 1, 9};
  int32_t stop = one.tok[1 * NEW + 4]; /* prompt 1's fifth token */
  o.max_new_per = per;
  o.stop = &stop;
  o.n_stop = 1;
  generate(&r, &p, &o, &got);
  for (int64_t k = 0; k < p.n; k++) {
    int64_t end = per[k], why = ML_FINISH_LENGTH;
    for (int64_t j = 0; j < per[k]; j++)
      if (one.tok[k * NEW + j] == stop) {
        end = j + 1;
        why = ML_FINISH_STOP;
        break;
      }
    assert_int_equal(got.len[k], end);
    assert_int_equal(got.fin[k], why);
    assert_memory_equal(got.tok + k * NEW, one.tok + k * NEW, sizeof(int32_t) * (size_t)end);
    assert_memory_equal(got.lp + k * NEW, one.lp + k * NEW, sizeof(float) * (size_t)end);
    for (int64_t j = end; j < NEW; j++) assert_int_equal(got.tok[k * NEW + j], -1);
  }
  assert_int_equal(got.fin[1], ML_FINISH_STOP);
  assert_true(got.len[1] <= 5);
  run_close(&r);
  fixture_free(&fx);
}

/* Seeds, top_p → 0, eos and max_new 1. */
static void test_sampling_and_eos(void **state) {
  (void)state;
  static fixture fx;
  static run r;
  open_fixture(&r, &fx, ML_F32, false);
  prompts p = {0};
  add(&p, &fx, 0, 1, 6);
  add(&p, &fx, 1, 0, 3);
  result a = {0}, b = {0}; /* rows past n stay 0: whole results compare */
  ml_gen_opts o = sampled(1.0f, 1.0f, 5);
  generate(&r, &p, &o, &a);
  generate(&r, &p, &o, &b); /* the same computation: bitwise */
  assert_memory_equal(&a, &b, sizeof a);
  o.seed = 6;
  generate(&r, &p, &o, &b);
  assert_memory_not_equal(a.tok, b.tok, sizeof a.tok);
  /* a nucleus of one token is the argmax, on the same logits */
  result gr = {0};
  ml_gen_opts og = greedy();
  generate(&r, &p, &og, &gr);
  o = sampled(0.7f, 1e-6f, 5);
  generate(&r, &p, &o, &b);
  assert_memory_equal(&gr, &b, sizeof gr);
  /* a stop id: each row stops after its first occurrence in the greedy run */
  int32_t stop = gr.tok[3];
  og.stop = &stop;
  og.n_stop = 1;
  generate(&r, &p, &og, &b);
  for (int64_t k = 0; k < p.n; k++) {
    int64_t end = NEW;
    for (int64_t j = NEW - 1; j >= 0; j--)
      if (gr.tok[k * NEW + j] == stop) end = j + 1;
    assert_int_equal(b.len[k], end);
    assert_memory_equal(b.tok + k * NEW, gr.tok + k * NEW, sizeof(int32_t) * (size_t)end);
    assert_memory_equal(b.lp + k * NEW, gr.lp + k * NEW, sizeof(float) * (size_t)end);
    for (int64_t j = end; j < NEW; j++) {
      assert_int_equal(b.tok[k * NEW + j], -1);
      assert_true(b.lp[k * NEW + j] == 0.0f);
    }
  }
  assert_true(b.len[0] <= 4);
  /* max_new 1: the prefill's token alone, into [n, 1] */
  og = greedy();
  og.max_new = 1;
  int32_t t1[NMAX];
  int64_t l1[NMAX];
  if (ml_generate(&r.e, p.n, p.lens, p.tokens, &og, t1, l1, NULL, NULL))
    fail_msg("generate: %s", ml_error_msg());
  for (int64_t k = 0; k < p.n; k++) {
    assert_int_equal(l1[k], 1);
    assert_int_equal(t1[k], gr.tok[k * NEW]);
  }
  run_close(&r);
  fixture_free(&fx);
}

/* A call refused with -1 and a message containing `want`. */
static void refused(run *r, int64_t n, const int64_t *lens, const int32_t *tokens,
                    const ml_gen_opts *o, const char *want) {
  result out;
  ml_error_clear();
  int rc = ml_generate(&r->e, n, lens, tokens, o, out.tok, out.len, out.lp, NULL);
  const char *msg = ml_error_msg();
  printf("refused: %s\n", msg);
  if (rc != -1 || !strstr(msg, want))
    fail_msg("expected -1 and a message with \"%s\"; got %d, \"%s\"", want, rc, msg);
  ml_error_clear();
}

static void test_errors(void **state) {
  (void)state;
  static fixture fx;
  static run r;
  open_fixture(&r, &fx, ML_F32, false);
  prompts p = {0};
  add(&p, &fx, 0, 0, 4);
  add(&p, &fx, 1, 0, 3);
  int64_t V = r.e.model.cfg.vocab, maxpos = r.e.model.cfg.max_positions;
  ml_gen_opts o = sampled(1.0f, 1.0f, 0);
  refused(&r, -1, p.lens, p.tokens, &o, "n = -1");
  int64_t zero[2] = {4, 0};
  refused(&r, 2, zero, p.tokens, &o, "prompt 1 has 0 tokens");
  int32_t bad[7];
  memcpy(bad, p.tokens, sizeof bad);
  bad[5] = (int32_t)V;
  refused(&r, 2, p.lens, bad, &o, "prompt 1, position 1: token id");
  bad[5] = -3;
  refused(&r, 2, p.lens, bad, &o, "token id -3");
  o.max_new = 0;
  refused(&r, 2, p.lens, p.tokens, &o, "max_new 0");
  o = sampled(1.0f, 1.0f, 0);
  o.n_samples = 0;
  refused(&r, 2, p.lens, p.tokens, &o, "n_samples 0");
  o = sampled(1.0f, 1.0f, 0);
  o.sampler.top_k = -1;
  refused(&r, 2, p.lens, p.tokens, &o, "top_k -1");
  o = sampled(1.0f, 1.0f, 0);
  o.sampler.min_p = 1.5f;
  refused(&r, 2, p.lens, p.tokens, &o, "min_p 1.5");
  o = sampled(1.0f, 1.0f, 0);
  int32_t bad_stop = (int32_t)V;
  o.stop = &bad_stop;
  o.n_stop = 1;
  refused(&r, 2, p.lens, p.tokens, &o, "stop id 0 is");
  o = sampled(1.0f, 1.0f, 0);
  int64_t per[2] = {NEW, NEW + 1};
  o.max_new_per = per;
  refused(&r, 2, p.lens, p.tokens, &o, "max_new_per[1]");
  o = sampled(1.0f, 1.0f, 0);
  o.n_samples = 3;
  o.max_running = 2;
  refused(&r, 2, p.lens, p.tokens, &o, "max_running 2");
  o = sampled(0.0f, 1.0f, 0);
  refused(&r, 2, p.lens, p.tokens, &o, "temperature 0");
  o = sampled(-1.0f, 1.0f, 0);
  refused(&r, 2, p.lens, p.tokens, &o, "temperature -1");
  o = sampled(1.0f, 0.0f, 0);
  refused(&r, 2, p.lens, p.tokens, &o, "top_p 0");
  o = sampled(1.0f, 1.5f, 0);
  refused(&r, 2, p.lens, p.tokens, &o, "top_p 1.5");
  o = sampled(1.0f, 1.0f, 0);
  o.max_new = maxpos - 2; /* 3 + max_new fits, 4 + max_new does not */
  refused(&r, 2, p.lens, p.tokens, &o, "max_position_embeddings");
  o = sampled(1.0f, 1.0f, 0);
  o.max_kv_bytes = -1;
  refused(&r, 2, p.lens, p.tokens, &o, "max_kv_bytes -1");
  o.max_kv_bytes = kv_bytes(&r, 2) - 1; /* prompt 0: 4 + 15 positions, 2 blocks */
  refused(&r, 2, p.lens, p.tokens, &o, "holds 1 KV blocks");
  run_close(&r);
  fixture_free(&fx);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  if (argc != 2) {
    fprintf(stderr, "usage: test_generate FIXTURE\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  g_fixture = argv[1];
  const struct CMUnitTest tests[] = {
      held_test(test_greedy_fp32),  held_test(test_greedy_bf16),
      held_test(test_greedy_transformers),
      held_test(test_batch_invariance_greedy), held_test(test_batch_invariance_greedy_bf16),
      held_test(test_batch_invariance_sampled), held_test(test_preemption),
      held_test(test_samples_and_limits), held_test(test_sampling_and_eos),
      held_test(test_errors),
  };
  return held_finish(cmocka_run_group_tests(tests, NULL, NULL));
}

/* test_api_generate: meshlm_generate. Greedy tokens are the argmax of the
 * full forward and their log-probs meshlm_logprobs'; seeds; n = 0 on some
 * ranks; eos; after a train step the replica has the new weights;
 * meshlm_generate_samples (n samples, stop ids, per-prompt max_new_tokens,
 * finish reasons, the first 0.2 struct layout); sampling.replica (the
 * policy's mesh or a replica per rank, and what each refuses).
 * The suite, its meshes and its helpers: api_util.h. */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api_util.h"

/* Prompts of dp rank d (its tp peers pass the same): two on even dp ranks, one on odd. */
static batch prompts_of(int d, uint64_t seed) {
  static const int64_t l0[] = {4, 7}, l1[] = {6};
  return d % 2 == 0 ? batch_make(l0, 2, seed + (uint64_t)d) : batch_make(l1, 1, seed + (uint64_t)d);
}

typedef struct gen_out {
  int64_t n;
  int32_t *tok; /* [n, NEW] */
  int64_t *len;
  float *lp;
} gen_out;

static gen_out generate_ok(meshlm_session *s, const meshlm_seqs *q, const meshlm_sampling *sp) {
  gen_out g = {q->n, xcalloc((size_t)(q->n * NEW), sizeof(int32_t)),
               xcalloc((size_t)q->n, sizeof(int64_t)), xcalloc((size_t)(q->n * NEW), sizeof(float))};
  OK(s, meshlm_generate(s, q, sp, q->n ? g.tok : NULL, q->n ? g.len : NULL, q->n ? g.lp : NULL));
  for (int64_t k = 0; k < q->n; k++) {
    assert_true(g.len[k] >= 1 && g.len[k] <= NEW);
    for (int64_t j = 0; j < NEW; j++) {
      int32_t t = g.tok[k * NEW + j];
      if (j < g.len[k]) assert_true(t >= 0 && t < g_vocab);
      else {
        assert_int_equal(t, -1);
        assert_true(g.lp[k * NEW + j] == 0.0f);
      }
    }
  }
  return g;
}

static void gen_free(gen_out *g) {
  free(g->tok);
  free(g->len);
  free(g->lp);
}

/* Prompt k followed by its generated tokens, as a batch. */
static batch continued(const batch *p, const gen_out *g) {
  batch c = {.n = p->n};
  c.lens = xcalloc((size_t)p->n, sizeof *c.lens);
  for (int64_t k = 0; k < p->n; k++) {
    c.lens[k] = p->lens[k] + g->len[k];
    c.ntok += c.lens[k];
    c.npred += c.lens[k] - 1;
  }
  c.tok = xcalloc((size_t)c.ntok, sizeof *c.tok);
  c.mask = xcalloc((size_t)c.npred, 1);
  for (int64_t k = 0, at = 0; k < p->n; k++) {
    memcpy(c.tok + at, p->tok + tok_at(p, k), sizeof(int32_t) * (size_t)p->lens[k]);
    memcpy(c.tok + at + p->lens[k], g->tok + k * NEW, sizeof(int32_t) * (size_t)g->len[k]);
    at += c.lens[k];
  }
  return c;
}

/* The generated tokens' log-probs (got) against `scorer`'s meshlm_logprobs
 * of prompt + generated at the same positions (ref): rel L2 over them. */
static double gen_vs_scoring(meshlm_session *scorer, const batch *p, const gen_out *g) {
  batch c = continued(p, g);
  meshlm_seqs q = seqs_of(&c);
  float *lp = xcalloc((size_t)c.npred, sizeof *lp), *got = xcalloc((size_t)(p->n * NEW), 4);
  float *ref = xcalloc((size_t)(p->n * NEW), 4);
  local_ok(scorer, meshlm_logprobs(scorer, &q, NULL, lp, NULL), "scoring the generated rows");
  int64_t m = 0;
  for (int64_t k = 0; k < p->n; k++)
    for (int64_t j = 0; j < g->len[k]; j++, m++) {
      got[m] = g->lp[k * NEW + j];
      ref[m] = lp[pred_at(&c, k) + p->lens[k] - 1 + j];
    }
  double err = m ? rel_l2(got, ref, m) : 0.0;
  free(lp);
  free(got);
  free(ref);
  batch_free(&c);
  return err;
}

/* Greedy on the mesh session: each token is the argmax of the full
 * forward's distribution (meshlm_logprobs of prefix + v for every v) and
 * its log-prob is meshlm_logprobs'. Both sides are fp32 evaluations of the
 * same log-probs (generation's KV-cache path, the mesh's full forward):
 * ||c − f|| <= tol·||f|| for the vector over the vocabulary at a position
 * (tolerance.h §3), so the generated t, maximising c, has f_t >= max_v f_v
 * − sqrt(2)·tol·||f|| (as tests/mpi/test_generate.c). Then eos: a row
 * stops after the first eos, the rest −1 / 0. */
static void test_generate_greedy(void **state) {
  (void)state;
  meshlm_options o = mesh_opts();
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  meshlm_info in = info_of(s);
  batch p = prompts_of(in.dp_rank, 500);
  meshlm_seqs q = seqs_of(&p);
  meshlm_sampling sp;
  meshlm_sampling_default(&sp);
  sp.greedy = 1;
  sp.max_new_tokens = NEW;
  sp.eos_token_id = -2;
  gen_out g = generate_ok(s, &q, &sp);
  for (int64_t k = 0; k < p.n; k++) assert_int_equal(g.len[k], NEW);
  double tol = lp_tol(7 + NEW), err = gen_vs_scoring(s, &p, &g);
  printf("[rank %d] greedy: generated log-probs vs meshlm_logprobs rel L2 %.3g (bound %.3g)\n",
         g_rank, err, tol);
  assert_true(err <= tol);

  /* argmax, row 0: every candidate v after the prefix, scored on the mesh */
  int64_t P0 = p.lens[0], V = g_vocab;
  double worst = 0;
  for (int64_t j = 0; j < NEW; j++) {
    int64_t L = P0 + j + 1;
    int64_t *lens = xcalloc((size_t)V, sizeof *lens);
    int32_t *tok = xcalloc((size_t)(V * L), sizeof *tok);
    float *out = xcalloc((size_t)(V * (L - 1)), sizeof *out), *f = xcalloc((size_t)V, 4);
    for (int64_t v = 0; v < V; v++) {
      lens[v] = L;
      memcpy(tok + v * L, p.tok, sizeof(int32_t) * (size_t)P0);
      memcpy(tok + v * L + P0, g.tok, sizeof(int32_t) * (size_t)j);
      tok[v * L + L - 1] = (int32_t)v;
    }
    meshlm_seqs cand = {V, lens, tok};
    OK(s, meshlm_logprobs(s, &cand, NULL, out, NULL));
    double best = -INFINITY;
    for (int64_t v = 0; v < V; v++) {
      f[v] = out[v * (L - 1) + L - 2];
      best = fmax(best, f[v]);
    }
    int32_t t = g.tok[j];
    double gap = (best - f[t]) / (sqrt(2.0) * lp_tol(L) * l2(f, V));
    worst = fmax(worst, gap);
    if (gap > 1.0)
      fail_msg("step %lld: greedy token %d has log-prob %.7g, the best %.7g", (long long)j, t,
               f[t], best);
    free(lens);
    free(tok);
    free(out);
    free(f);
  }
  printf("[rank %d] greedy argmax: worst gap %.3g of its bound\n", g_rank, worst);

  /* eos: the third token of row 0 (and the model's own, −1). A row stops after the first
   * eos; the tokens before it are the greedy run's (the argmax of the same model on the same
   * prefix: they could differ only at a near-tie within rounding, which the fixture's random
   * weights do not produce — tests/mpi/test_generate.c's argument) */
  int32_t eos_ids[2] = {g.tok[2], g_eos};
  for (int e = 0; e < 2; e++) {
    sp.eos_token_id = e == 0 ? eos_ids[0] : -1;
    gen_out h = generate_ok(s, &q, &sp);
    for (int64_t k = 0; k < p.n; k++) {
      int64_t want = NEW;
      for (int64_t j = 0; j < NEW && want == NEW; j++)
        if (g.tok[k * NEW + j] == eos_ids[e]) want = j + 1;
      assert_int_equal(h.len[k], want);
      assert_memory_equal(h.tok + k * NEW, g.tok + k * NEW, sizeof(int32_t) * (size_t)want);
    }
    if (e == 0) assert_true(h.len[0] <= 3);
    gen_free(&h);
  }
  gen_free(&g);
  batch_free(&p);
  meshlm_close(s);
}

/* Sampling: the same seed, the same tokens (and log-probs); another seed,
 * other tokens; the log-probs at temperature 1 whatever the temperature;
 * a dp rank with no prompts. */
static void test_generate_seeds(void **state) {
  (void)state;
  meshlm_options o = mesh_opts();
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  meshlm_info in = info_of(s);
  int none = in.dp_size > 1 && in.dp_rank == in.dp_size - 1; /* this dp rank samples nothing */
  batch p = prompts_of(in.dp_rank, 600), empty = {0};
  const batch *mine = none ? &empty : &p;
  meshlm_seqs q = seqs_of(mine);
  size_t nt = (size_t)(q.n * NEW);
  meshlm_sampling sp;
  meshlm_sampling_default(&sp);
  sp.max_new_tokens = NEW;
  sp.top_p = 0.9f;
  sp.eos_token_id = -2;
  sp.seed = 11;
  gen_out a = generate_ok(s, &q, &sp), b = generate_ok(s, &q, &sp);
  if (q.n > 0) {
    assert_memory_equal(a.tok, b.tok, sizeof(int32_t) * nt);
    assert_memory_equal(a.len, b.len, sizeof(int64_t) * (size_t)q.n);
    assert_memory_equal(a.lp, b.lp, sizeof(float) * nt);
  }
  sp.seed = 12;
  gen_out c = generate_ok(s, &q, &sp);
  if (q.n > 0) /* 5 or 10 draws from ~300 near-uniform tokens: all equal by chance with
                  probability ~300^-5 */
    assert_true(memcmp(a.tok, c.tok, sizeof(int32_t) * nt) != 0);
  sp.temperature = 0.7f;
  sp.top_p = 1.0f;
  gen_out d = generate_ok(s, &q, &sp);
  double tol = lp_tol(7 + NEW), err = gen_vs_scoring(s, mine, &d);
  printf("[rank %d] sampled at temperature 0.7: log-probs vs meshlm_logprobs rel L2 %.3g (bound "
         "%.3g)\n", g_rank, err, tol);
  assert_true(err <= tol);
  gen_free(&a);
  gen_free(&b);
  gen_free(&c);
  gen_free(&d);
  batch_free(&p);
  meshlm_close(s);
}

/* After a train step the replica is refitted: greedy continuations' log-
 * probs are the new weights' meshlm_logprobs, and not the old weights'
 * (scored on a one-rank session of the fixture). */
static void test_generate_after_step(void **state) {
  (void)state;
  meshlm_options o = mesh_opts();
  o.lr = 1e-2;
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  meshlm_session *old = open_ok(g_fixture, NULL, MPI_COMM_SELF);
  meshlm_info in = info_of(s);
  batch p = prompts_of(in.dp_rank, 700);
  meshlm_seqs q = seqs_of(&p);
  meshlm_sampling sp;
  meshlm_sampling_default(&sp);
  sp.greedy = 1;
  sp.max_new_tokens = NEW;
  sp.eos_token_id = -2;
  gen_out before = generate_ok(s, &q, &sp); /* the policy's mesh at the fixture's weights */
  double tol = lp_tol(7 + NEW);
  assert_true(gen_vs_scoring(old, &p, &before) <= tol);
  gbatch g = gbatch_make(44);
  nll_step(s, &g);
  gen_out after = generate_ok(s, &q, &sp);
  double e_new = gen_vs_scoring(s, &p, &after), e_old = gen_vs_scoring(old, &p, &after);
  printf("[rank %d] after a step: generated log-probs vs the new weights rel L2 %.3g, vs the "
         "old %.3g (bound %.3g)\n", g_rank, e_new, e_old, tol);
  assert_true(e_new <= tol);
  assert_true(e_old > tol);
  gen_free(&before);
  gen_free(&after);
  batch_free(&g.all);
  batch_free(&p);
  meshlm_close(old);
  meshlm_close(s);
}

/* sampling.replica: 0 (the policy's mesh, the default) and 1 (a replica
 * per rank) both within the bound of scoring (greedy, as
 * test_generate_greedy); replica 2 refused naming the field. On a mesh with
 * tp 2: with replica 0 tp ranks passing different prompts, or different
 * sampling (a seed), are refused on every rank, naming what differs; with
 * replica 1 each rank samples its own. A cp 2 session (4 ranks) refuses
 * replica 0 naming cp and serves replica 1. */
static void test_generate_replica(void **state) {
  (void)state;
  meshlm_options o = mesh_opts();
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  meshlm_info in = info_of(s);
  batch p = prompts_of(in.dp_rank, 800);
  meshlm_seqs q = seqs_of(&p);
  meshlm_sampling sp;
  meshlm_sampling_default(&sp);
  sp.greedy = 1;
  sp.max_new_tokens = NEW;
  sp.eos_token_id = -2;
  double tol = lp_tol(7 + NEW);
  for (int r = 0; r < 2; r++) {
    sp.replica = r;
    gen_out g = generate_ok(s, &q, &sp);
    double err = gen_vs_scoring(s, &p, &g);
    printf("[rank %d] replica %d: generated log-probs vs meshlm_logprobs rel L2 %.3g (bound "
           "%.3g)\n", g_rank, r, err, tol);
    assert_true(err <= tol);
    gen_free(&g);
  }
  int32_t *tok = xcalloc((size_t)(4 * NEW), sizeof *tok);
  int64_t *len = xcalloc(4, sizeof *len);
  sp.replica = 2;
  expect_fail(s, meshlm_generate(s, &q, &sp, tok, len, NULL), "replica 2", "replica 2");
  if (in.tp > 1) {
    batch other = prompts_of(in.dp_rank + 2 * in.tp_rank, 800); /* differs on tp rank 1 */
    meshlm_seqs qo = seqs_of(&other);
    sp.replica = 0;
    expect_fail(s, meshlm_generate(s, &qo, &sp, tok, len, NULL), "different batches",
                "tp ranks' prompts");
    sp.seed = (uint64_t)in.tp_rank;
    expect_fail(s, meshlm_generate(s, &q, &sp, tok, len, NULL), "different sampling",
                "tp ranks' seeds");
    sp.replica = 1;
    sp.seed = 0;
    gen_out g = generate_ok(s, &qo, &sp);
    gen_free(&g);
    batch_free(&other);
  }
  meshlm_close(s);
  if (g_world == 4) {
    meshlm_options oc;
    meshlm_options_default(&oc);
    oc.cp = 2;
    meshlm_session *c = open_ok(g_fixture, &oc, MPI_COMM_WORLD);
    batch pc = prompts_of(info_of(c).dp_rank, 800);
    meshlm_seqs qc = seqs_of(&pc);
    sp.replica = 0;
    expect_fail(c, meshlm_generate(c, &qc, &sp, tok, len, NULL), "cp 2", "replica 0 under cp");
    sp.replica = 1;
    gen_out g = generate_ok(c, &qc, &sp);
    gen_free(&g);
    batch_free(&pc);
    meshlm_close(c);
  }
  free(tok);
  free(len);
  batch_free(&p);
}

/* The header's bound: max_new_tokens up to meshlm_info.max_seq_len − the
 * longest prompt (max_position_embeddings here) runs; one more, 2^31 and
 * 2^40 fail on every rank naming the field, before anything is written
 * (one-entry outputs); without prompts the bound is max_seq_len − 1. */
static void test_generate_bound(void **state) {
  (void)state;
  meshlm_options o = mesh_opts();
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  meshlm_info in = info_of(s);
  assert_int_equal(in.max_seq_len, g_maxpos);
  batch p = prompts_of(in.dp_rank, 5);
  meshlm_seqs q = seqs_of(&p), none = {0, NULL, NULL};
  int64_t longest = 0;
  for (int64_t k = 0; k < p.n; k++) longest = p.lens[k] > longest ? p.lens[k] : longest;
  meshlm_sampling sp;
  meshlm_sampling_default(&sp);
  sp.greedy = 1;
  sp.eos_token_id = -2;
  int32_t tok1 = 7;
  int64_t len1 = 7;
  const int64_t too_many[] = {in.max_seq_len - longest + 1, (int64_t)1 << 31, (int64_t)1 << 40};
  for (int c = 0; c < 3; c++) {
    sp.max_new_tokens = too_many[c];
    expect_fail(s, meshlm_generate(s, &q, &sp, &tok1, &len1, NULL), "max_new_tokens",
                "max_new_tokens beyond the bound");
    assert_int_equal(tok1, 7);
    assert_int_equal(len1, 7);
  }
  sp.max_new_tokens = in.max_seq_len;
  expect_fail(s, meshlm_generate(s, &none, &sp, NULL, NULL, NULL), "max_new_tokens",
              "max_new_tokens = max_seq_len without prompts");
  sp.max_new_tokens = in.max_seq_len - longest;
  int32_t *tok = xcalloc((size_t)(p.n * sp.max_new_tokens), sizeof *tok);
  int64_t *lens = xcalloc((size_t)p.n, sizeof *lens);
  OK(s, meshlm_generate(s, &q, &sp, tok, lens, NULL));
  for (int64_t k = 0; k < p.n; k++) assert_int_equal(lens[k], sp.max_new_tokens);
  free(tok);
  free(lens);
  batch_free(&p);
  meshlm_close(s);
}

/* meshlm_generate_samples (in the batch-invariant mode): n samples per
 * prompt in rows k·n + j, each greedy sample bitwise the n = 1 row; finish reasons (length; stop at a
 * stop id, included); per-prompt max_new_tokens; a caller compiled with the
 * first 0.2 layout (struct_size = offsetof(meshlm_sampling, n)) gets the
 * defaults of the appended fields (n 1); bad new fields fail naming them
 * (max_kv_bytes below one KV block). */
static void test_generate_samples(void **state) {
  (void)state;
  meshlm_options o = mesh_opts();
  o.batch_invariant = 1; /* a row's bits whatever the step's other rows, by construction */
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  meshlm_info in = info_of(s);
  batch p = prompts_of(in.dp_rank, 800);
  meshlm_seqs q = seqs_of(&p);
  meshlm_sampling sp;
  meshlm_sampling_default(&sp);
  sp.greedy = 1;
  sp.max_new_tokens = NEW;
  sp.eos_token_id = -2;
  gen_out one = generate_ok(s, &q, &sp);
  int64_t R = 2 * q.n;
  int32_t *tok = xcalloc((size_t)(R * NEW), sizeof *tok), *fin = xcalloc((size_t)R, 4);
  int64_t *len = xcalloc((size_t)R, sizeof *len);
  float *lp = xcalloc((size_t)(R * NEW), sizeof *lp);
  sp.n = 2;
  OK(s, meshlm_generate_samples(s, &q, &sp, tok, len, lp, fin));
  for (int64_t r = 0; r < R; r++) {
    int64_t k = r / 2;
    assert_int_equal(len[r], NEW);
    assert_int_equal(fin[r], MESHLM_FINISH_LENGTH);
    assert_memory_equal(tok + r * NEW, one.tok + k * NEW, sizeof(int32_t) * NEW);
    assert_memory_equal(lp + r * NEW, one.lp + k * NEW, sizeof(float) * NEW);
  }
  /* a stop id (row 0's third token) and max_new_tokens 3 for the other prompts */
  int32_t stop = one.tok[2];
  int64_t per[2] = {NEW, 3};
  sp.n = 1;
  sp.stop_token_ids = &stop;
  sp.n_stop = 1;
  sp.max_new_tokens_per = per;
  OK(s, meshlm_generate_samples(s, &q, &sp, tok, len, lp, fin));
  for (int64_t k = 0; k < q.n; k++) {
    int64_t cap = per[k], end = cap, why = MESHLM_FINISH_LENGTH;
    for (int64_t j = 0; j < cap && why == MESHLM_FINISH_LENGTH; j++)
      if (one.tok[k * NEW + j] == stop) {
        end = j + 1;
        why = MESHLM_FINISH_STOP;
      }
    assert_int_equal(len[k], end);
    assert_int_equal(fin[k], why);
    assert_memory_equal(tok + k * NEW, one.tok + k * NEW, sizeof(int32_t) * (size_t)end);
  }
  if (q.n > 0) assert_int_equal(fin[0], MESHLM_FINISH_STOP);
  /* the first 0.2 layout: the appended fields take their defaults */
  meshlm_sampling old = sp;
  old.struct_size = offsetof(meshlm_sampling, n);
  old.n = 5; /* past the caller's struct: not read */
  OK(s, meshlm_generate_samples(s, &q, &old, tok, len, lp, fin));
  for (int64_t k = 0; k < q.n; k++) {
    assert_int_equal(len[k], NEW);
    assert_memory_equal(tok + k * NEW, one.tok + k * NEW, sizeof(int32_t) * NEW);
  }
  meshlm_sampling bad = sp;
  bad.n = 0;
  expect_fail(s, meshlm_generate_samples(s, &q, &bad, tok, len, lp, fin), "n_samples 0",
              "n = 0");
  bad = sp;
  bad.greedy = 0;
  bad.top_k = -1;
  expect_fail(s, meshlm_generate_samples(s, &q, &bad, tok, len, lp, fin), "top_k -1",
              "top_k -1");
  bad = sp;
  bad.max_kv_bytes = 1; /* not one KV block */
  expect_fail(s, meshlm_generate_samples(s, &q, &bad, tok, len, lp, fin),
              "max_kv_bytes 1 holds 0 KV blocks", "max_kv_bytes 1");
  free(tok);
  free(fin);
  free(len);
  free(lp);
  gen_free(&one);
  batch_free(&p);
  meshlm_close(s);
}

/* ======================================================================= */

/* Preemption through the API (meshlm_sampling.max_kv_bytes,
 * meshlm_call_stats.preemptions), in the batch-invariant mode: 2 samples
 * of each prompt and 13 new tokens (every row crosses its first 16-position
 * block) in a pool of 3 KV blocks of this rank's (fp32: 2 · layers · 16 ·
 * kv heads / tp · head_dim · 4 bytes; the fixture's 2 kv heads split whole
 * over tp 1 or 2) against the default pool: rows bitwise equal (tokens,
 * log-probs, lengths, finish reasons); preemptions > 0 in the tight pool
 * (two rows at their 17th position, one block free), 0 in the roomy one. */
static void test_generate_preemption(void **state) {
  (void)state;
  meshlm_options o = mesh_opts();
  o.batch_invariant = 1;
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  meshlm_info in = info_of(s);
  batch p = prompts_of(in.dp_rank, 900);
  meshlm_seqs q = seqs_of(&p);
  enum { LONG = 13, SAMPLES = 2 };
  int64_t R = SAMPLES * q.n, block = (int64_t)(2 * g_sizes.layers * 16 * g_sizes.kv_heads / in.tp *
                                                g_sizes.head_dim * 4);
  int32_t *tok[2], *fin[2];
  int64_t *len[2];
  float *lp[2];
  meshlm_sampling sp;
  meshlm_sampling_default(&sp);
  sp.max_new_tokens = LONG;
  sp.eos_token_id = -2;
  sp.n = SAMPLES;
  sp.top_k = 20;
  sp.seed = 7;
  for (int i = 0; i < 2; i++) {
    tok[i] = xcalloc((size_t)(R * LONG), sizeof(int32_t));
    fin[i] = xcalloc((size_t)R, sizeof(int32_t));
    len[i] = xcalloc((size_t)R, sizeof(int64_t));
    lp[i] = xcalloc((size_t)(R * LONG), sizeof(float));
    sp.max_kv_bytes = i == 0 ? 0 : 3 * block;
    OK(s, meshlm_generate_samples(s, &q, &sp, tok[i], len[i], lp[i], fin[i]));
    meshlm_call_stats st = {.struct_size = sizeof st};
    OK(s, meshlm_last_call_stats(s, &st));
    if (i == 0) assert_int_equal(st.preemptions, 0);
    else if (st.preemptions < 1)
      fail_msg("max_kv_bytes %lld (3 KV blocks): no preemption; expected some",
               (long long)sp.max_kv_bytes);
  }
  assert_memory_equal(tok[0], tok[1], sizeof(int32_t) * (size_t)(R * LONG));
  assert_memory_equal(lp[0], lp[1], sizeof(float) * (size_t)(R * LONG));
  assert_memory_equal(len[0], len[1], sizeof(int64_t) * (size_t)R);
  assert_memory_equal(fin[0], fin[1], sizeof(int32_t) * (size_t)R);
  for (int i = 0; i < 2; i++) free(tok[i]), free(fin[i]), free(len[i]), free(lp[i]);
  batch_free(&p);
  meshlm_close(s);
}

int main(int argc, char **argv) {
  api_init(&argc, &argv);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_generate_greedy),
      cmocka_unit_test(test_generate_seeds),
      cmocka_unit_test(test_generate_after_step),
      cmocka_unit_test(test_generate_replica),
      cmocka_unit_test(test_generate_bound),
      cmocka_unit_test(test_generate_samples),
      cmocka_unit_test(test_generate_preemption),
  };
  return api_finish(cmocka_run_group_tests(tests, NULL, NULL));
}

/* Generation under expert parallelism (engine/gen_ep.h):
 * `test_generate_ep FIXTURE [tp=T]` on 2·T ranks, dp_shard 2 × tp T (T = 1
 * unless given) with ep 2·T over all of them (under tp each tp rank
 * dispatching its chunk of the tokens, model/moe.h). Each dp rank
 * continues its own prompts, whose numbers and lengths of generation differ
 * from rank to rank, so one rank's sequences end while the other's still
 * decode: the ranks of the ep group step together (a done rank runs steps of
 * zero tokens, computing its experts for the other's rows) instead of
 * hanging in the sparse layers' all-to-alls.
 *  - greedy, batch-invariant: each rank's tokens and log-probs are bitwise
 *    a one-rank engine's (MPI_COMM_SELF, all experts) generation of the same
 *    prompts: in that mode a row's bits do not depend on the other rows of a
 *    GEMM (engine.h batch_invariant), the exchange only moves rows, and each
 *    token's expert outputs are summed in its choice order as on one rank;
 *    cases: rank 0 one prompt of 3 new tokens vs rank 1 two prompts of 12
 *    (max_new_per 12 and 5), and rank 0 no prompt at all;
 *  - a failure on one rank (rank 1: max_kv_bytes too small for a sequence)
 *    ends the call on every rank with an error: rank 1's own, rank 0's
 *    naming the ep group; then both generate again, in step. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine_run.h"
#include "parity_util.h"
#include "engine/generate.h"

enum { NPROMPT = 2, NEW = 12, PMAX = 9 };

static const char *g_fixture;
static int g_tp = 1; /* "tp=T" */

typedef struct call {
  int64_t n, lens[NPROMPT], max_new, max_new_per[NPROMPT];
  int32_t tokens[NPROMPT * PMAX];
} call;

typedef struct result {
  int32_t tok[NPROMPT * NEW];
  int64_t len[NPROMPT];
  float lp[NPROMPT * NEW];
} result;

/* n prompts of rank d: pieces of the fixture's rows (row d + k, lengths 4, 9). */
static call call_of(const fixture *fx, int d, int64_t n, int64_t max_new, const int64_t *per) {
  static const int64_t lens[NPROMPT] = {4, 9};
  call c = {.n = n, .max_new = max_new};
  for (int64_t k = 0, at = 0; k < n; at += lens[k], k++) {
    memcpy(c.tokens + at, fx->ids + ((d + k) % fx->B) * fx->S, sizeof(int32_t) * (size_t)lens[k]);
    c.lens[k] = lens[k];
    c.max_new_per[k] = per[k];
  }
  return c;
}

static int generate(run *r, const call *c, int64_t max_kv_bytes, result *out) {
  ml_gen_opts o = {.max_new = c->max_new, .n_samples = 1, .sampler = {.greedy = true},
                   .max_new_per = c->max_new_per, .max_kv_bytes = max_kv_bytes};
  memset(out, 0, sizeof *out);
  return ml_generate(&r->e, c->n, c->lens, c->tokens, &o, out->tok, out->len, out->lp, NULL);
}

static void open_pair(const fixture *fx, run *r, run *one) {
  ml_engine_opts o = ml_engine_opts_default();
  o.batch_invariant = true;
  run_open_ep(r, MPI_COMM_WORLD, 1, 1, g_tp, 2 * g_tp, &o, fx->dir, NULL, NULL);
  run_open(one, MPI_COMM_SELF, 1, 1, &o, fx->dir);
  assert_int_equal(r->mesh.groups[ML_GROUP_EP].size, 2 * g_tp);
}

/* The mesh's call against the one-rank engine's, bitwise. */
static void check_call(run *r, run *one, const call *c) {
  result got, want;
  if (generate(r, c, 0, &got)) fail_msg("generate (ep %d): %s", 2 * g_tp, ml_error_msg());
  if (c->n > 0 && generate(one, c, 0, &want)) fail_msg("generate (one rank): %s", ml_error_msg());
  for (int64_t k = 0; k < c->n; k++) {
    assert_int_equal(got.len[k], want.len[k]);
    assert_memory_equal(got.tok + k * c->max_new, want.tok + k * c->max_new,
                        sizeof(int32_t) * (size_t)got.len[k]);
    assert_memory_equal(got.lp + k * c->max_new, want.lp + k * c->max_new,
                        sizeof(float) * (size_t)got.len[k]);
  }
  printf("[rank %d] %s tp %d ep %d: %lld prompts, max_new %lld: tokens and log-probs bitwise "
         "one rank's\n", r->mesh.rank, g_fixture, g_tp, 2 * g_tp, (long long)c->n,
         (long long)c->max_new);
}

static void test_uneven(void **state) {
  (void)state;
  static fixture fx;
  static run r, one;
  fixture_load(g_fixture, &fx);
  open_pair(&fx, &r, &one);
  int d = r.mesh.groups[ML_GROUP_DP].rank;
  static const int64_t short_per[NPROMPT] = {3, 3}, long_per[NPROMPT] = {NEW, 5};
  call c = d == 0 ? call_of(&fx, d, 1, 3, short_per) : call_of(&fx, d, 2, NEW, long_per);
  check_call(&r, &one, &c);
  c = d == 0 ? call_of(&fx, d, 0, 3, short_per) : call_of(&fx, d, 2, NEW, long_per);
  check_call(&r, &one, &c);
  run_close(&one);
  run_close(&r);
  fixture_free(&fx);
}

static void test_failure(void **state) {
  (void)state;
  static fixture fx;
  static run r, one;
  fixture_load(g_fixture, &fx);
  open_pair(&fx, &r, &one);
  int d = r.mesh.groups[ML_GROUP_DP].rank;
  static const int64_t per[NPROMPT] = {NEW, NEW};
  call c = call_of(&fx, d, 2, NEW, per);
  result got;
  assert_int_equal(generate(&r, &c, d == 1 ? 1 : 0, &got), -1);
  printf("[rank %d] a failed call: %s\n", r.mesh.rank, ml_error_msg());
  char want[64];
  snprintf(want, sizeof want, "expert-parallel group (ep %d) failed", 2 * g_tp);
  if (d == 0) assert_non_null(strstr(ml_error_msg(), want));
  else assert_non_null(strstr(ml_error_msg(), "max_kv_bytes 1"));
  check_call(&r, &one, &c); /* the group steps together again */
  run_close(&one);
  run_close(&r);
  fixture_free(&fx);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int world;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (argc >= 3 && strncmp(argv[2], "tp=", 3) == 0) g_tp = atoi(argv[2] + 3);
  if (argc < 2 || g_tp < 1 || world != 2 * g_tp) { /* the cases name dp ranks 0 and 1 */
    fprintf(stderr, "usage: mpiexec -n 2*T test_generate_ep FIXTURE [tp=T] (found %d ranks)\n",
            world);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  g_fixture = argv[1];
  const struct CMUnitTest tests[] = {held_test(test_uneven), held_test(test_failure)};
  return held_finish(cmocka_run_group_tests(tests, NULL, NULL));
}

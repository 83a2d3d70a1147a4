/* Generation on the engine's own mesh (engine/generate.h) against one rank:
 * `test_generate_mesh FIXTURE TP [sp] [bf16] [offload] [hsdp]` on W ranks =
 * dp_shard (W / TP) x tp TP, or with hsdp dp_replicate 2 x dp_shard (W / 2TP)
 * x tp TP. Each data-parallel rank continues its own prompts (pieces of the
 * fixture's rows chosen by its dp rank), every tp rank of it the same; a
 * one-rank engine on the same checkpoint (MPI_COMM_SELF) is the reference.
 *  - greedy: the tokens equal the one-rank run's, but where the one-rank
 *    distribution has the two tokens within the bound of a tie (there a
 *    different order of the row-parallel sums may pick either: the test
 *    checks the tie and stops comparing that row); the log-probs of the
 *    common tokens within tolerance.h's bound of two fp32 evaluations in
 *    different orders (§3 tol_model_pair; with bf16 parameters §4
 *    tol_bf16_pair);
 *  - sampled (temperature, top_k, top_p, 2 samples per prompt): the
 *    log-probs generation returns against the one-rank engine's scoring of
 *    prompt + generated tokens (the same bound: tp's order against one
 *    rank's, the KV cache's against the full forward's), whatever tokens
 *    were drawn, so no near-tie of a draw can flake it;
 *  - every tp rank returns bitwise the same tokens, lengths and log-probs
 *    (memcmp against tp rank 0's); without tp (dp_shard alone) greedy
 *    tokens and log-probs are bitwise the one-rank run's;
 *  - the engine keeps working: its log-probs of the fixture batch before and
 *    after the calls are bitwise equal;
 *  - in the batch-invariant mode, generation's log-probs are bitwise the
 *    same mesh's scoring of prompt + generated tokens (tp 2 included).
 * `cuda` (label cuda; exits 77 where the CUDA backend cannot be made): the
 * tested engine on the GPU — one rank, or tp 2 on two ranks sharing it —
 * (its KV cache on the CUDA backend's paged block attention) against the
 * one-rank CPU engine: greedy and
 * sampled as above with the same bounds (test_cuda_engine's: the CUDA
 * backend's fp32 or bf16 against the CPU's in another order), not bitwise;
 * the batch-invariant case is skipped (no such mode on CUDA). */
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

#include "comm/comm_staged.h"
#include "engine_run.h"
#include "parity_util.h"
#include "engine/generate.h"

enum { NPROMPT = 2, NSAMPLE = 2, RMAX = NPROMPT * NSAMPLE, NEW = 12, PMAX = 10 };

static const char *g_fixture;
static int g_tp = 1;
static bool g_sp, g_bf16, g_offload; /* sequence parallel, bf16 parameters, FSDP's CPU offload */
static int g_dpr = 1;                  /* dp_replicate (HSDP's replicas) */
static ml_backend *g_cuda;             /* `cuda`: the tested engine's backend */

typedef struct prompts {
  int64_t n, lens[NPROMPT];
  int32_t tokens[NPROMPT * PMAX];
} prompts;

typedef struct result {
  int32_t tok[RMAX * NEW];
  int64_t len[RMAX];
  float lp[RMAX * NEW];
} result;

/* Data-parallel rank d's prompts: two pieces of the fixture's rows, which
 * differ from rank to rank (row d mod B, offset d). */
static prompts prompts_of(const fixture *fx, int d) {
  static const int64_t lens[NPROMPT] = {5, 9};
  prompts p = {.n = NPROMPT};
  for (int64_t k = 0, at = 0; k < NPROMPT; at += lens[k], k++) {
    int64_t row = (d + k) % fx->B, off = d % (fx->S - PMAX);
    memcpy(p.tokens + at, fx->ids + row * fx->S + off, sizeof(int32_t) * (size_t)lens[k]);
    p.lens[k] = lens[k];
  }
  return p;
}

static int64_t prompt_at(const prompts *p, int64_t k) {
  int64_t at = 0;
  for (int64_t i = 0; i < k; i++) at += p->lens[i];
  return at;
}

static ml_engine_opts opts_of(bool mesh) {
  ml_engine_opts o = ml_engine_opts_default();
  o.fsdp.param_dtype = g_bf16 ? ML_BF16 : ML_F32;
  o.sequence_parallel = mesh && g_sp;
  o.fsdp.cpu_offload = mesh && g_offload;
  return o;
}

/* The tested engine: the mesh over the world, on the GPU with `cuda` (its
 * comms staged through the host, as --device-comm staged: ranks may share
 * the GPU; a group of one copies on the device). */
static void open_tested(run *r, ml_engine_opts *o, const char *dir) {
  if (!g_cuda) {
    run_open(r, MPI_COMM_WORLD, g_dpr, g_tp, o, dir);
    return;
  }
  o->backend = g_cuda;
  run_open_comm(r, MPI_COMM_WORLD, g_dpr, g_tp, o, dir, ml_comm_staged_make, g_cuda);
}

static void generate(run *r, const prompts *p, const ml_gen_opts *o, result *out) {
  if (ml_generate(&r->e, p->n, p->lens, p->tokens, o, out->tok, out->len, out->lp, NULL))
    fail_msg("generate: %s", ml_error_msg());
}

/* The one-rank engine's log-probs of prompt k (of sample row r) followed
 * by the row's first n generated tokens then `last`: f [n + 1], those of
 * the generated tokens and last. */
static void score_row(run *ref, const prompts *p, int64_t k, const int32_t *gen, int64_t n,
                      int32_t last, float *f) {
  int64_t P = p->lens[k], S = P + n + 1;
  int32_t ids[PMAX + NEW + 1];
  float lp[PMAX + NEW];
  memcpy(ids, p->tokens + prompt_at(p, k), sizeof(int32_t) * (size_t)P);
  memcpy(ids + P, gen, sizeof(int32_t) * (size_t)n);
  ids[S - 1] = last;
  if (ml_engine_logprobs(&ref->e, ids, 1, S, lp)) fail_msg("logprobs: %s", ml_error_msg());
  memcpy(f, lp + P - 1, sizeof(float) * (size_t)(n + 1));
}

/* ||f|| of the one-rank distribution after prompt k and gen[0 .. n): the
 * log-probs of every vocabulary token at that position. */
static double dist_norm(run *ref, const prompts *p, int64_t k, const int32_t *gen, int64_t n) {
  int64_t V = ref->e.model.cfg.vocab;
  double s = 0;
  float f[PMAX + NEW];
  for (int32_t v = 0; v < V; v++) {
    score_row(ref, p, k, gen, n, v, f);
    s += (double)f[n] * f[n];
  }
  return sqrt(s);
}

/* What the mesh adds to the printed figures: FSDP's vocab-parallel rows, its CPU offload. */
static const char *mesh_notes(const run *r) {
  if (!r->e.fsdp.vocab_parallel) return "";
  return g_offload ? " vocab-parallel offload" : " vocab-parallel";
}

static double pair_tol(const run *ref, int64_t S, int64_t T) {
  tol_model tm = tol_model_of(ref, S, T);
  return g_bf16 ? tol_bf16_pair(&tm, TOL_LOGPROBS) : tol_model_pair(&tm, TOL_LOGPROBS);
}

/* Every tp rank's outputs bitwise tp rank 0's. */
static void check_tp_same(run *r, const result *g) {
  ml_host *h = ml_mesh_host(&r->mesh, ML_GROUP_TP);
  result *all = malloc(sizeof(result) * (size_t)h->size);
  if (!all || ml_host_all_gather(h, g, sizeof *g, all)) fail_msg("tp all-gather of the outputs");
  for (int q = 1; q < h->size; q++) assert_memory_equal(&all[q], &all[0], sizeof *g);
  free(all);
}

/* Greedy: tokens equal the one-rank run's up to a tie within the bound,
 * log-probs of the common tokens within it. */
static void test_greedy(void **state) {
  (void)state;
  static fixture fx;
  static run r, ref;
  fixture_load(g_fixture, &fx);
  ml_engine_opts om = opts_of(true), o1 = opts_of(false);
  open_tested(&r, &om, fx.dir);
  run_open(&ref, MPI_COMM_SELF, 1, 1, &o1, fx.dir);
  prompts p = prompts_of(&fx, r.mesh.groups[ML_GROUP_DP].rank);
  ml_gen_opts o = {.max_new = NEW, .n_samples = 1, .sampler = {.greedy = true}};
  result g = {0}, want = {0};
  generate(&r, &p, &o, &g);
  generate(&ref, &p, &o, &want);
  check_tp_same(&r, &g);
  /* the bound on one log-prob: ||c − f|| <= tol·||f|| over a position's V log-probs bounds
     each entry, so the two picks a (mesh) and b (one rank) can differ only where
     f_b − f_a <= |c_a − f_a| + |c_b − f_b| <= 2·tol·||f|| */
  int64_t V = ref.e.model.cfg.vocab, S = PMAX + NEW;
  double tol = pair_tol(&ref, S, V * S);
  float got[RMAX * NEW], exp[RMAX * NEW];
  int64_t m = 0, ties = 0;
  for (int64_t k = 0; k < p.n; k++) {
    assert_int_equal(g.len[k], NEW);
    assert_int_equal(want.len[k], NEW);
    for (int64_t j = 0; j < NEW; j++) {
      int32_t a = g.tok[k * NEW + j], b = want.tok[k * NEW + j];
      if (a != b) {
        float fa[NEW + 1], fb[NEW + 1];
        score_row(&ref, &p, k, want.tok + k * NEW, j, a, fa);
        score_row(&ref, &p, k, want.tok + k * NEW, j, b, fb);
        double gap = (fb[j] - fa[j]) / (2.0 * tol * dist_norm(&ref, &p, k, want.tok + k * NEW, j));
        printf("[dp %d] prompt %lld step %lld: token %d (one rank: %d), gap %.3g of a tie's "
               "bound\n", r.mesh.groups[ML_GROUP_DP].rank, (long long)k, (long long)j, a, b,
               gap);
        assert_true(gap <= 1.0);
        ties++;
        break;
      }
      got[m] = g.lp[k * NEW + j];
      exp[m++] = want.lp[k * NEW + j];
    }
  }
  double err = rel_l2(got, exp, m);
  printf("[rank %d] %s dp_replicate %d x dp_shard %d x tp %d%s%s%s greedy vs one rank: %lld "
         "tokens equal, %lld near-tie divergences; log-probs rel L2 %.3g (bound %.3g)\n",
         r.mesh.rank, g_fixture, r.mesh.dp_replicate, r.mesh.dp_shard, g_tp, g_sp ? " sp" : "",
         g_bf16 ? " bf16" : "", mesh_notes(&r), (long long)m,
         (long long)ties, err, tol);
  assert_true(err <= tol);
  /* without tp the mesh computes what one rank does: FSDP's gathers copy the parameters'
     bits, and the same kernels run on the same rows (on the same backend) */
  if (g_tp == 1 && !g_cuda) {
    assert_memory_equal(g.tok, want.tok, sizeof g.tok);
    assert_memory_equal(g.lp, want.lp, sizeof g.lp);
  }
  run_close(&ref);
  run_close(&r);
  fixture_free(&fx);
}

/* Sampled: the returned log-probs against the one-rank engine's scoring of
 * what was drawn; the engine's own log-probs unchanged by the calls. */
static void test_sampled(void **state) {
  (void)state;
  static fixture fx;
  static run r, ref;
  fixture_load(g_fixture, &fx);
  ml_engine_opts om = opts_of(true), o1 = opts_of(false);
  open_tested(&r, &om, fx.dir);
  run_open(&ref, MPI_COMM_SELF, 1, 1, &o1, fx.dir);
  int64_t nlp = fx.B * (fx.S - 1);
  float *before = malloc(sizeof(float) * (size_t)nlp), *after = malloc(sizeof(float) * (size_t)nlp);
  if (!before || !after) fail_msg("out of memory");
  if (ml_engine_logprobs(&r.e, fx.ids, fx.B, fx.S, before)) fail_msg("%s", ml_error_msg());
  prompts p = prompts_of(&fx, r.mesh.groups[ML_GROUP_DP].rank);
  ml_gen_opts o = {.max_new = NEW, .n_samples = NSAMPLE, .seed = 7,
                   .sampler = {.temperature = 0.8f, .top_k = 40, .top_p = 0.9f}};
  result g = {0};
  generate(&r, &p, &o, &g);
  check_tp_same(&r, &g);
  if (ml_engine_logprobs(&r.e, fx.ids, fx.B, fx.S, after)) fail_msg("%s", ml_error_msg());
  assert_memory_equal(before, after, sizeof(float) * (size_t)nlp); /* the same kernels, inputs */
  free(before);
  free(after);
  float got[RMAX * NEW], exp[RMAX * NEW], f[NEW + 1];
  int64_t m = 0;
  for (int64_t row = 0; row < p.n * NSAMPLE; row++) {
    int64_t k = row / NSAMPLE, n = g.len[row];
    assert_true(n >= 1 && n <= NEW);
    score_row(&ref, &p, k, g.tok + row * NEW, n - 1, g.tok[row * NEW + n - 1], f);
    for (int64_t j = 0; j < n; j++) {
      got[m] = g.lp[row * NEW + j];
      exp[m++] = f[j];
    }
  }
  int64_t V = ref.e.model.cfg.vocab, S = PMAX + NEW;
  double tol = pair_tol(&ref, S, V * S), err = rel_l2(got, exp, m);
  printf("[rank %d] %s dp_replicate %d x dp_shard %d x tp %d%s%s%s sampled: %lld log-probs vs "
         "one rank's scoring rel L2 %.3g (bound %.3g)\n",
         r.mesh.rank, g_fixture, r.mesh.dp_replicate, r.mesh.dp_shard, g_tp, g_sp ? " sp" : "",
         g_bf16 ? " bf16" : "", mesh_notes(&r), (long long)m,
         err, tol);
  assert_true(err <= tol);
  run_close(&ref);
  run_close(&r);
  fixture_free(&fx);
}

/* The batch-invariant mode on the mesh: generation's log-probs (KV-cache
 * prefill and decode) are bitwise the same mesh's scoring of prompt +
 * generated tokens (ml_engine_logprobs, one row at a time), tp included:
 * every reduction of a token's forward runs in one order per element
 * whatever the step's batch or cache position (engine.h batch_invariant),
 * and tp computes each row-parallel linear whole in both
 * (parallel/tp_whole.h). Greedy, fp32 or the fixture's param_dtype.
 * (Against one rank too: tests/api/test_api_invariant.c (f).) */
static void test_invariant(void **state) {
  (void)state;
  if (g_cuda) {
    printf("batch-invariant case skipped: the CUDA backend has no batch-invariant mode\n");
    return;
  }
  static fixture fx;
  static run r;
  fixture_load(g_fixture, &fx);
  ml_engine_opts om = opts_of(true);
  om.batch_invariant = true;
  run_open(&r, MPI_COMM_WORLD, g_dpr, g_tp, &om, fx.dir);
  prompts p = prompts_of(&fx, r.mesh.groups[ML_GROUP_DP].rank);
  ml_gen_opts o = {.max_new = NEW, .n_samples = 1, .sampler = {.greedy = true}};
  result g = {0};
  generate(&r, &p, &o, &g);
  for (int64_t k = 0; k < p.n; k++) { /* every dp rank the same lengths: calls in step */
    int64_t P = p.lens[k], S = P + g.len[k];
    int32_t ids[PMAX + NEW];
    float lp[PMAX + NEW];
    memcpy(ids, p.tokens + prompt_at(&p, k), sizeof(int32_t) * (size_t)P);
    memcpy(ids + P, g.tok + k * NEW, sizeof(int32_t) * (size_t)g.len[k]);
    if (ml_engine_logprobs(&r.e, ids, 1, S, lp)) fail_msg("logprobs: %s", ml_error_msg());
    assert_memory_equal(g.lp + k * NEW, lp + P - 1, sizeof(float) * (size_t)g.len[k]);
  }
  printf("[rank %d] %s tp %d batch-invariant: generate's log-probs = the mesh's scoring, "
         "bitwise\n", r.mesh.rank, g_fixture, g_tp);
  run_close(&r);
  fixture_free(&fx);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  if (argc < 3) {
    fprintf(stderr,
            "usage: test_generate_mesh FIXTURE TP [sp] [bf16] [offload] [hsdp] [cuda]\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  g_fixture = argv[1];
  g_tp = atoi(argv[2]);
  for (int i = 3; i < argc; i++) {
    g_sp |= strcmp(argv[i], "sp") == 0;
    g_bf16 |= strcmp(argv[i], "bf16") == 0;
    g_offload |= strcmp(argv[i], "offload") == 0;
    if (strcmp(argv[i], "hsdp") == 0) g_dpr = 2;
    if (strcmp(argv[i], "cuda") == 0 && ml_backend_get("cuda", 0, &g_cuda)) {
      printf("skipped: no GPU (%s)\n", ml_error_msg());
      MPI_Finalize();
      return 77;
    }
  }
  const struct CMUnitTest tests[] = {held_test(test_greedy), held_test(test_sampled),
                                     held_test(test_invariant)};
  int rc = held_finish(cmocka_run_group_tests(tests, NULL, NULL));
  if (g_cuda) ml_backend_release_all();
  return rc;
}

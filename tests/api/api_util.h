/* The public C library API (include/meshlm/meshlm.h, the contract) as a
 * user sees it. The api tests are one cmocka program per topic
 * (test_api_<topic>.c, with this header and api_util.c); each includes
 * only "meshlm/meshlm.h" (and the test suite's tolerance.h), links only
 * libmeshlm.so, MPI, cmocka and jansson (config.json, safetensors
 * headers). Every rank runs the same cmocka sequence in the same order;
 * values are compared per rank. Each program is registered as
 * api_<topic>_1rank and api_<topic>_4ranks (tests/api/CMakeLists.txt); the
 * mesh of the "world" sessions is tp 2 × dp_shard 2 on four ranks (tp 1 on
 * one), the collective counts use a dp_shard 4 session, and references
 * come from sessions on MPI_COMM_SELF (local, one rank) in the same
 * process.
 *
 * The topics (each file's header says what it covers):
 *  test_api_basics.c    version, the *_default functions, open, info, open errors
 *  test_api_score.c     logprobs of variable-length batches, meshlm_last_call_stats
 *  test_api_train.c     train_step's losses against double references, the schedule
 *  test_api_weights.c   save / resume, export / reload, refit, reload_tensors
 *  test_api_generate.c  generate
 *  test_api_reference.c the reference policy (set_reference, reference_logprobs)
 *  test_api_misuse.c    failed sessions, bad arguments, collective order, tp
 *                       peers, the error message's rank
 *  test_api_invariant.c batch_invariant: bitwise across batches, micro-batches,
 *                       generation, the training forward and dp_shard 2 (1, 2 ranks)
 *
 * This header: what the programs share (api_util.c): the process-wide
 * facts (rank, world, the fixture and its config.json's sizes, a shared
 * temporary directory) and the MPI start and end around cmocka, the
 * tolerance and MPI helpers, sessions, batches, the safetensors reader,
 * the weight table and the refit callback. A program's main:
 *
 *   int main(int argc, char **argv) {
 *     api_init(&argc, &argv);
 *     const struct CMUnitTest tests[] = {...};
 *     return api_finish(cmocka_run_group_tests(tests, NULL, NULL));
 *   } */
#ifndef ML_API_UTIL_H
#define ML_API_UTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <jansson.h>

#include "meshlm/meshlm_mpi.h"
#include "tolerance.h"

/* ======================================================================= */
/* Process-wide facts                                                      */
/* ======================================================================= */

enum { PARTS = 2 }; /* the training batches' global batch: two dp parts */
enum { NEW = 5 };   /* tokens generated per prompt (test_api_generate.c, test_api_misuse.c) */

extern int g_rank, g_world;
extern char g_fixture[4096]; /* tests/fixtures/llama_untied */
extern char g_tmp[4096];     /* a directory every rank shares (rank 0 makes it) */
extern tol_model g_sizes;    /* tolerance.h §3's sizes from config.json (seq, tokens per use) */
extern int64_t g_vocab, g_maxpos, g_layers, g_hidden;
extern int32_t g_bos, g_eos;

/* MPI_Init; the rank and world; the fixture's sizes from its config.json
 * (the facts meshlm_get_info and the tolerances are checked against); the
 * shared temporary directory. Exits (2) when either cannot be had. */
void api_init(int *argc, char ***argv);

/* After cmocka_run_group_tests (`failed`, this rank's count): failed on
 * any rank, the temporary directory removed, meshlm_finalize (which must
 * leave MPI, initialised here, alone) and MPI_Finalize. The exit status. */
int api_finish(int failed);

/* A deterministic xorshift generator (batch_make and the training tests
 * reseed it). */
void rng_seed(uint64_t s);
uint64_t rnd(void);
double unif(void); /* [0, 1) */

void *xcalloc(size_t n, size_t sz);

/* tolerance.h §3: two fp32 evaluations of the same log-probs in different
 * summation orders (packed vs alone, another micro-batch split, another
 * mesh, the training forward vs the scoring forward, the KV-cache path vs
 * the full forward), with at most S keys per query: relative L2 over the
 * compared vector. */
double lp_tol(int64_t S);

double rel_l2(const float *a, const float *b, int64_t n); /* ||a − b||₂ / ||b||₂ */
double l2(const float *a, int64_t n);
int64_t max_all(int64_t v); /* the maximum over the world */

/* ======================================================================= */
/* Sessions                                                                */
/* ======================================================================= */

meshlm_session *open_ok(const char *dir, const meshlm_options *o, MPI_Comm comm);

/* The world sessions' mesh: tp 2 where the world is even (four ranks: dp_shard 2). */
meshlm_options mesh_opts(void);

meshlm_info info_of(meshlm_session *s);

/* Fails unless rc is 0 (the message then says why). */
#define OK(s, call)                                                                               \
  do {                                                                                            \
    if ((call) != 0) fail_msg("%s: %s", #call, meshlm_error(s));                                  \
  } while (0)

/* rc is −1 and s's message contains `needle` (NULL: any non-empty one). */
void expect_fail(meshlm_session *s, int rc, const char *needle, const char *what);

/* A call on a one-rank (MPI_COMM_SELF) session, or other local work, that
 * may fail on some ranks only: every rank fails together (so that no rank
 * runs ahead into a world collective the others never reach). */
void local_ok(meshlm_session *s, int rc, const char *what);

/* ======================================================================= */
/* Batches                                                                 */
/* ======================================================================= */

typedef struct batch {
  int64_t n, ntok, npred;
  int64_t *lens;
  int32_t *tok;
  uint8_t *mask; /* [npred] a random token mask (about 70 % set) */
} batch;

batch batch_make(const int64_t *lens, int64_t n, uint64_t seed);
void batch_free(batch *b);
meshlm_seqs seqs_of(const batch *b);

/* First prediction / token of sequence k. */
int64_t pred_at(const batch *b, int64_t k);
int64_t tok_at(const batch *b, int64_t k);

/* Sequences of this dp rank in the packing tests: each dp rank its own. */
batch local_batch(int dp_rank);

/* The training tests' global batch: PARTS parts (a dp rank's share on a
 * 2-way dp mesh; all of them on one rank). Part 1 has a sequence with no
 * masked prediction (its mask cleared), and both a length-1 one. */
typedef struct gbatch {
  batch all;
  int64_t seq[PARTS + 1], pred[PARTS + 1], tok[PARTS + 1];
} gbatch;

gbatch gbatch_make(uint64_t seed);

/* Dp rank d of D's share of g: everything on one dp rank, part d on PARTS. */
typedef struct slice {
  meshlm_seqs seqs;
  int64_t s0, p0, npred;
} slice;

slice slice_of(const gbatch *g, int d, int D);

/* The log-probs of g (every dp rank scoring its share on s) on every rank:
 * each dp rank's tp/cp rank 0 contributes its slice to a zeroed buffer
 * summed over the world (x + 0 is exact, R1). */
void global_lp(meshlm_session *s, const gbatch *g, const uint8_t *mask, float *out);
/* The same of its reference policy (meshlm_reference_logprobs). */
void global_ref_lp(meshlm_session *s, const gbatch *g, float *out);

/* Per-prediction arrays over the global batch (NULL: not given). */
typedef struct garr {
  const uint8_t *mask;
  const float *tw, *sw, *old, *ref;
} garr;

/* This rank's share of g and of a, one train step on s. */
int step_share(meshlm_session *s, const gbatch *g, const garr *a, const meshlm_loss *l,
               meshlm_step_result *r);

/* One step on s of loss NULL (the default: NLL) over g's mask, each dp
 * rank its share of g. */
void nll_step(meshlm_session *s, const gbatch *g);

/* ======================================================================= */
/* safetensors (the exported and the fixture's files)                      */
/* ======================================================================= */

typedef struct st_file {
  unsigned char *buf;
  size_t size, data0;
  json_t *hdr;
} st_file;

void st_open(const char *path, st_file *f);
void st_close(st_file *f);

/* Tensor `name`: its bytes, dtype string, shape; NULL when absent. */
const void *st_tensor(const st_file *f, const char *name, const char **dtype, int *ndim,
                      int64_t shape[2], size_t *nbytes);

/* bf16 of x, round to nearest even (finite x). */
uint16_t bf16_rne(float x);

/* ======================================================================= */
/* The weight table and refits                                             */
/* ======================================================================= */

typedef struct weights {
  int64_t n;
  meshlm_weight *w; /* names point into the session: copy them below */
  char (*name)[256];
  void **data;      /* [n] full tensors (dtype per call) */
  size_t *nbytes;
  meshlm_dtype *dtype;
  int calls, stop_at; /* the callback's count; stop (return 1) at that call (−1: never) */
} weights;

weights weights_of(meshlm_session *s);
int64_t numel(const meshlm_weight *w);
void weights_clear(weights *w);
void weights_free(weights *w);

/* Buffers for refit_into in dtype d. */
void weights_alloc(weights *w, meshlm_dtype d);

/* The refit callback: keeps each tensor (refit order = weight order). */
int keep_tensor(void *ctx, const char *name, meshlm_dtype dtype, int ndim, const int64_t *shape,
                const void *data, size_t nbytes);

/* ======================================================================= */
/* Temporary directory                                                     */
/* ======================================================================= */

/* g_tmp/leaf. */
void tmp_path(char *out, size_t cap, const char *leaf);

#endif

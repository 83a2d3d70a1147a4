/* The public C library API (include/meshlm/meshlm.h, the contract) as a
 * user sees it: this program includes only "meshlm/meshlm.h" (and the test
 * suite's tolerance.h), links only libmeshlm.so, MPI, cmocka and jansson
 * (config.json, safetensors headers). Every rank runs the same cmocka
 * sequence in the same order; values are compared per rank. Registered as
 * api_1rank and api_4ranks (tests/api/CMakeLists.txt); the mesh of the
 * "world" sessions is tp 2 × dp_shard 2 on four ranks (tp 1 on one), the
 * collective counts use a dp_shard 4 session, and references come from
 * sessions on MPI_COMM_SELF (local, one rank) in the same process.
 *
 * Covered:
 *  1. version, the three *_default functions, meshlm_error(NULL), open and
 *     open_f, meshlm_get_info and the weight table against config.json and
 *     the fixture's safetensors; open errors (missing dir, NULL dir, tp not
 *     dividing the world, bad dtypes, device, micro_batch_tokens, and on
 *     four ranks a bad option on one rank only) each −1 with a session
 *     whose message names the field and that closes.
 *  2. logprobs of variable-length batches (a length-1 sequence included)
 *     against each sequence scored alone, with and without a mask, with
 *     several micro-batches and one, unshard_for_inference 0 and 1; each dp
 *     rank its own sequences, the reference on MPI_COMM_SELF.
 *  3. meshlm_last_call_stats: micro-batches as planned; FSDP all-gathers
 *     per micro-batch with and without holding the parameters (dp_shard 4).
 *  4. train_step: NLL, weighted NLL with unit weights, clipped PG at ratio
 *     1 and with shifted old log-probs (clip, dual clip, k3 KL), token and
 *     sequence level, against double references from meshlm_logprobs'
 *     values; the same global batch on the mesh and on one rank; the
 *     schedule (warmup, linear decay) and step counts.
 *  5. save / resume, export / reload(dir), refit (callback, into buffers,
 *     F32 / BF16 / SOURCE) against the exported safetensors bytes,
 *     reload_tensors (perturb and restore, unknown name), a refit callback
 *     that stops.
 *  6. generate: greedy tokens are the argmax of the full forward and their
 *     log-probs meshlm_logprobs'; seeds; n = 0 on some ranks; eos; after a
 *     train step the replica has the new weights.
 *  7. misuse: a failed session, bad shapes and arguments on one rank,
 *     mismatched collective order, tp peers with different batches; each
 *     −1 on every rank and the session still usable (bitwise the same
 *     log-probs, no step taken). */
#define _XOPEN_SOURCE 700 /* mkdtemp, nftw */

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <ftw.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "meshlm/meshlm.h"
#include "tolerance.h"

/* ======================================================================= */
/* Process-wide facts                                                      */
/* ======================================================================= */

enum { PARTS = 2 }; /* the training batches' global batch: two dp parts */

static int g_rank, g_world;
static char g_fixture[4096]; /* tests/fixtures/llama_untied */
static char g_tmp[4096];     /* a directory every rank shares (rank 0 makes it) */
static tol_model g_sizes;    /* tolerance.h §3's sizes from config.json (seq, tokens per use) */
static int64_t g_vocab, g_maxpos, g_layers, g_hidden;
static int32_t g_bos = -1, g_eos = -1;

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static void rng_seed(uint64_t s) { g_rng = 0x9E3779B97F4A7C15ull ^ (s * 0xBF58476D1CE4E5B9ull); }
static uint64_t rnd(void) {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return g_rng;
}
static double unif(void) { return (double)(rnd() >> 11) * 0x1p-53; } /* [0, 1) */

static void *xcalloc(size_t n, size_t sz) {
  void *p = calloc(n ? n : 1, sz ? sz : 1);
  if (!p) fail_msg("out of memory");
  return p;
}

static int32_t cfg_int(json_t *root, const char *key, int32_t dflt) {
  json_t *v = json_object_get(root, key);
  if (json_is_array(v)) v = json_array_get(v, 0);
  return json_is_integer(v) ? (int32_t)json_integer_value(v) : dflt;
}

/* The fixture's sizes from its config.json (the facts meshlm_get_info and
 * the tolerances are checked against). */
static void read_config(void) {
  char path[4200];
  snprintf(path, sizeof path, "%s/config.json", g_fixture);
  json_error_t err;
  json_t *root = json_load_file(path, 0, &err);
  if (!root) {
    fprintf(stderr, "test_api: %s: %s\n", path, err.text);
    exit(2);
  }
  g_hidden = cfg_int(root, "hidden_size", 0);
  g_layers = cfg_int(root, "num_hidden_layers", 0);
  g_vocab = cfg_int(root, "vocab_size", 0);
  g_maxpos = cfg_int(root, "max_position_embeddings", 0);
  int32_t heads = cfg_int(root, "num_attention_heads", 1);
  g_sizes = (tol_model){(double)g_hidden,
                        (double)cfg_int(root, "intermediate_size", 0),
                        (double)heads,
                        (double)cfg_int(root, "num_key_value_heads", heads),
                        (double)cfg_int(root, "head_dim", (int32_t)(g_hidden / heads)),
                        (double)g_layers,
                        (double)g_vocab,
                        0.0,
                        0.0};
  g_bos = cfg_int(root, "bos_token_id", -1);
  g_eos = cfg_int(root, "eos_token_id", -1);
  json_decref(root);
}

/* tolerance.h §3: two fp32 evaluations of the same log-probs in different
 * summation orders (packed vs alone, another micro-batch split, another
 * mesh, the training forward vs the scoring forward, the KV-cache path vs
 * the full forward), with at most S keys per query: relative L2 over the
 * compared vector. */
static double lp_tol(int64_t S) {
  tol_model m = g_sizes;
  m.seq = (double)S;
  return tol_model_pair(&m, TOL_LOGPROBS);
}

static double rel_l2(const float *a, const float *b, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; i++) {
    double d = (double)a[i] - b[i];
    num += d * d;
    den += (double)b[i] * b[i];
  }
  return den > 0 ? sqrt(num / den) : sqrt(num);
}

static double l2(const float *a, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; i++) s += (double)a[i] * a[i];
  return sqrt(s);
}

static int64_t max_all(int64_t v) {
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
  return v;
}

/* ======================================================================= */
/* Sessions                                                                */
/* ======================================================================= */

static meshlm_session *open_ok(const char *dir, const meshlm_options *o, MPI_Comm comm) {
  meshlm_session *s = NULL;
  if (meshlm_open(dir, o, comm, &s))
    fail_msg("meshlm_open(%s): %s", dir, s ? meshlm_error(s) : "(no session)");
  return s;
}

/* The world sessions' mesh: tp 2 where the world is even (four ranks: dp_shard 2). */
static meshlm_options mesh_opts(void) {
  meshlm_options o;
  meshlm_options_default(&o);
  o.tp = g_world % 2 == 0 ? 2 : 1;
  return o;
}

static meshlm_info info_of(meshlm_session *s) {
  meshlm_info in;
  if (meshlm_get_info(s, &in)) fail_msg("meshlm_get_info: %s", meshlm_error(s));
  return in;
}

/* Fails unless rc is 0 (the message then says why). */
#define OK(s, call)                                                                               \
  do {                                                                                            \
    if ((call) != 0) fail_msg("%s: %s", #call, meshlm_error(s));                                  \
  } while (0)

/* rc is −1 and s's message contains `needle` (NULL: any non-empty one). */
static void expect_fail(meshlm_session *s, int rc, const char *needle, const char *what) {
  const char *e = meshlm_error(s);
  if (rc != -1) fail_msg("%s: returned %d, expected -1", what, rc);
  if (!e || !e[0]) fail_msg("%s: -1 without a message", what);
  if (needle && !strstr(e, needle))
    fail_msg("%s: message '%s' does not name '%s'", what, e, needle);
}

/* A call on a one-rank (MPI_COMM_SELF) session, or other local work, that
 * may fail on some ranks only: every rank fails together (so that no rank
 * runs ahead into a world collective the others never reach). */
static void local_ok(meshlm_session *s, int rc, const char *what) {
  int bad = rc != 0, any = 0;
  MPI_Allreduce(&bad, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (bad) fail_msg("%s: %s", what, meshlm_error(s));
  if (any) fail_msg("%s failed on another rank", what);
}

/* ======================================================================= */
/* Batches                                                                 */
/* ======================================================================= */

typedef struct batch {
  int64_t n, ntok, npred;
  int64_t *lens;
  int32_t *tok;
  uint8_t *mask; /* [npred] a random token mask (about 70 % set) */
} batch;

static batch batch_make(const int64_t *lens, int64_t n, uint64_t seed) {
  batch b = {.n = n};
  b.lens = xcalloc((size_t)n, sizeof *b.lens);
  for (int64_t k = 0; k < n; k++) {
    b.lens[k] = lens[k];
    b.ntok += lens[k];
    b.npred += lens[k] - 1;
  }
  b.tok = xcalloc((size_t)b.ntok, sizeof *b.tok);
  b.mask = xcalloc((size_t)b.npred, 1);
  rng_seed(seed);
  for (int64_t t = 0; t < b.ntok; t++) b.tok[t] = (int32_t)(rnd() % (uint64_t)g_vocab);
  for (int64_t t = 0; t < b.npred; t++) b.mask[t] = unif() < 0.7;
  return b;
}

static void batch_free(batch *b) {
  free(b->lens);
  free(b->tok);
  free(b->mask);
  memset(b, 0, sizeof *b);
}

static meshlm_seqs seqs_of(const batch *b) { return (meshlm_seqs){b->n, b->lens, b->tok}; }

/* First prediction / token of sequence k. */
static int64_t pred_at(const batch *b, int64_t k) {
  int64_t o = 0;
  for (int64_t i = 0; i < k; i++) o += b->lens[i] - 1;
  return o;
}
static int64_t tok_at(const batch *b, int64_t k) {
  int64_t o = 0;
  for (int64_t i = 0; i < k; i++) o += b->lens[i];
  return o;
}

/* Sequences of this dp rank in the packing tests: each dp rank its own. */
static batch local_batch(int dp_rank) {
  static const int64_t l0[] = {1, 2, 7, 33, 5}, l1[] = {5, 33, 1, 12, 2, 9};
  return dp_rank % 2 == 0 ? batch_make(l0, 5, 1000 + (uint64_t)dp_rank)
                          : batch_make(l1, 6, 1000 + (uint64_t)dp_rank);
}

/* The training tests' global batch: PARTS parts (a dp rank's share on a
 * 2-way dp mesh; all of them on one rank). Part 1 has a sequence with no
 * masked prediction (its mask cleared), and both a length-1 one. */
typedef struct gbatch {
  batch all;
  int64_t seq[PARTS + 1], pred[PARTS + 1], tok[PARTS + 1];
} gbatch;

static gbatch gbatch_make(uint64_t seed) {
  static const int64_t lens[] = {9, 1, 17, 4, 12, /* part 1: */ 6, 21, 2, 1, 3};
  static const int64_t split[PARTS + 1] = {0, 5, 10};
  gbatch g = {.all = batch_make(lens, 10, seed)};
  for (int p = 0; p <= PARTS; p++) {
    g.seq[p] = split[p];
    g.pred[p] = pred_at(&g.all, split[p]);
    g.tok[p] = tok_at(&g.all, split[p]);
  }
  g.all.mask[pred_at(&g.all, 7)] = 0; /* the length-2 sequence: nothing masked */
  g.all.mask[0] = 1;                  /* at least one everywhere */
  return g;
}

/* Dp rank d of D's share of g: everything on one dp rank, part d on PARTS. */
typedef struct slice {
  meshlm_seqs seqs;
  int64_t s0, p0, npred;
} slice;

static slice slice_of(const gbatch *g, int d, int D) {
  if (D != 1 && D != PARTS) fail_msg("the training tests need dp 1 or %d, not %d", PARTS, D);
  int a = D == 1 ? 0 : d, z = D == 1 ? PARTS : d + 1;
  slice s = {{g->seq[z] - g->seq[a], g->all.lens + g->seq[a], g->all.tok + g->tok[a]},
             g->seq[a], g->pred[a], g->pred[z] - g->pred[a]};
  return s;
}

/* The log-probs of g (every dp rank scoring its share on s) on every rank:
 * each dp rank's tp/cp rank 0 contributes its slice to a zeroed buffer
 * summed over the world (x + 0 is exact, R1). */
static void global_lp(meshlm_session *s, const gbatch *g, const uint8_t *mask, float *out) {
  meshlm_info in = info_of(s);
  slice sl = slice_of(g, in.dp_rank, in.dp_size);
  float *loc = xcalloc((size_t)sl.npred, sizeof *loc);
  OK(s, meshlm_logprobs(s, &sl.seqs, mask ? mask + sl.p0 : NULL, loc, NULL));
  memset(out, 0, sizeof(float) * (size_t)g->all.npred);
  if (in.tp_rank == 0 && in.cp_rank == 0)
    memcpy(out + sl.p0, loc, sizeof(float) * (size_t)sl.npred);
  MPI_Allreduce(MPI_IN_PLACE, out, (int)g->all.npred, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  free(loc);
}

/* First-fit decreasing of `lens` into rows of `cap` tokens (the packing
 * the header and README describe): the number of micro-batches. */
static int64_t ffd_rows(const int64_t *lens, int64_t n, int64_t cap) {
  int64_t *l = xcalloc((size_t)n, sizeof *l), *fill = xcalloc((size_t)n, sizeof *fill), rows = 0;
  memcpy(l, lens, sizeof *l * (size_t)n);
  for (int64_t i = 1; i < n; i++) /* insertion sort, longest first */
    for (int64_t j = i; j > 0 && l[j] > l[j - 1]; j--) {
      int64_t t = l[j];
      l[j] = l[j - 1];
      l[j - 1] = t;
    }
  for (int64_t i = 0; i < n; i++) {
    int64_t j = 0;
    while (j < rows && fill[j] + l[i] > cap) j++;
    if (j == rows) fill[rows++] = 0;
    fill[j] += l[i];
  }
  free(l);
  free(fill);
  return rows;
}

/* ======================================================================= */
/* safetensors (the exported and the fixture's files)                      */
/* ======================================================================= */

typedef struct st_file {
  unsigned char *buf;
  size_t size, data0;
  json_t *hdr;
} st_file;

static void st_open(const char *path, st_file *f) {
  memset(f, 0, sizeof *f);
  FILE *fp = fopen(path, "rb");
  if (!fp) fail_msg("cannot open %s", path);
  fseek(fp, 0, SEEK_END);
  f->size = (size_t)ftell(fp);
  fseek(fp, 0, SEEK_SET);
  f->buf = xcalloc(f->size, 1);
  if (fread(f->buf, 1, f->size, fp) != f->size) fail_msg("cannot read %s", path);
  fclose(fp);
  uint64_t n = 0;
  for (int i = 7; i >= 0; i--) n = n << 8 | f->buf[i]; /* little-endian u64 */
  if (8 + n > f->size) fail_msg("%s: header length %llu", path, (unsigned long long)n);
  json_error_t err;
  f->hdr = json_loadb((const char *)f->buf + 8, (size_t)n, 0, &err);
  if (!f->hdr) fail_msg("%s: header: %s", path, err.text);
  f->data0 = 8 + (size_t)n;
}

static void st_close(st_file *f) {
  json_decref(f->hdr);
  free(f->buf);
  memset(f, 0, sizeof *f);
}

/* Tensor `name`: its bytes, dtype string, shape; NULL when absent. */
static const void *st_tensor(const st_file *f, const char *name, const char **dtype, int *ndim,
                             int64_t shape[2], size_t *nbytes) {
  json_t *t = json_object_get(f->hdr, name);
  if (!t) return NULL;
  json_t *sh = json_object_get(t, "shape"), *off = json_object_get(t, "data_offsets");
  *dtype = json_string_value(json_object_get(t, "dtype"));
  *ndim = (int)json_array_size(sh);
  shape[0] = *ndim > 0 ? json_integer_value(json_array_get(sh, 0)) : 1;
  shape[1] = *ndim > 1 ? json_integer_value(json_array_get(sh, 1)) : 1;
  size_t b = (size_t)json_integer_value(json_array_get(off, 0));
  size_t e = (size_t)json_integer_value(json_array_get(off, 1));
  *nbytes = e - b;
  return f->buf + f->data0 + b;
}

/* bf16 of x, round to nearest even (finite x). */
static uint16_t bf16_rne(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

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

static weights weights_of(meshlm_session *s) {
  weights w = {.n = meshlm_num_weights(s), .stop_at = -1};
  if (w.n <= 0) fail_msg("meshlm_num_weights: %lld", (long long)w.n);
  w.w = xcalloc((size_t)w.n, sizeof *w.w);
  w.name = xcalloc((size_t)w.n, sizeof *w.name);
  w.data = xcalloc((size_t)w.n, sizeof *w.data);
  w.nbytes = xcalloc((size_t)w.n, sizeof *w.nbytes);
  w.dtype = xcalloc((size_t)w.n, sizeof *w.dtype);
  for (int64_t i = 0; i < w.n; i++) {
    OK(s, meshlm_weight_info(s, i, &w.w[i]));
    snprintf(w.name[i], sizeof w.name[i], "%s", w.w[i].name);
  }
  return w;
}

static int64_t numel(const meshlm_weight *w) {
  return w->shape[0] * (w->ndim == 2 ? w->shape[1] : 1);
}

static void weights_clear(weights *w) {
  for (int64_t i = 0; i < w->n; i++) {
    free(w->data[i]);
    w->data[i] = NULL;
  }
  w->calls = 0;
}

static void weights_free(weights *w) {
  weights_clear(w);
  free(w->w);
  free(w->name);
  free(w->data);
  free(w->nbytes);
  free(w->dtype);
}

/* Buffers for refit_into in dtype d. */
static void weights_alloc(weights *w, meshlm_dtype d) {
  weights_clear(w);
  for (int64_t i = 0; i < w->n; i++) {
    w->nbytes[i] = (size_t)numel(&w->w[i]) * (d == MESHLM_DTYPE_BF16 ? 2 : 4);
    w->data[i] = xcalloc(w->nbytes[i], 1);
    w->dtype[i] = d;
  }
}

/* The refit callback: keeps each tensor (refit order = weight order). */
static int keep_tensor(void *ctx, const char *name, meshlm_dtype dtype, int ndim,
                       const int64_t *shape, const void *data, size_t nbytes) {
  weights *w = ctx;
  int k = w->calls++;
  if (k == w->stop_at) return 1;
  if (k >= w->n || strcmp(name, w->name[k]) != 0 || ndim != w->w[k].ndim ||
      shape[0] != w->w[k].shape[0] || (ndim == 2 && shape[1] != w->w[k].shape[1]))
    return 2; /* checked by the caller: the call fails, and calls says where */
  w->data[k] = xcalloc(nbytes, 1);
  memcpy(w->data[k], data, nbytes);
  w->nbytes[k] = nbytes;
  w->dtype[k] = dtype;
  return 0;
}

/* ======================================================================= */
/* Temporary directory                                                     */
/* ======================================================================= */

static int rm_one(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
  (void)sb;
  (void)flag;
  (void)ftw;
  return remove(path);
}

static void make_tmp(void) {
  if (g_rank == 0) {
    snprintf(g_tmp, sizeof g_tmp, "%s/meshlm_api_XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR")
                                                                            : "/tmp");
    if (!mkdtemp(g_tmp)) g_tmp[0] = '\0';
  }
  MPI_Bcast(g_tmp, sizeof g_tmp, MPI_CHAR, 0, MPI_COMM_WORLD);
  if (!g_tmp[0]) {
    fprintf(stderr, "test_api: cannot create a temporary directory\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
}

static void tmp_path(char *out, size_t cap, const char *leaf) {
  snprintf(out, cap, "%s/%s", g_tmp, leaf);
}

/* ======================================================================= */
/* 1. Version, defaults, open, info                                        */
/* ======================================================================= */

static void test_version_defaults(void **state) {
  (void)state;
  char want[64];
  snprintf(want, sizeof want, "%d.%d.%d", MESHLM_VERSION_MAJOR, MESHLM_VERSION_MINOR,
           MESHLM_VERSION_PATCH);
  assert_string_equal(meshlm_version(), want);

  meshlm_options o;
  memset(&o, 0xA5, sizeof o);
  meshlm_options_default(&o);
  assert_int_equal(o.dp_replicate, 1);
  assert_int_equal(o.cp, 1);
  assert_int_equal(o.tp, 1);
  assert_string_equal(o.device, "cpu");
  assert_true(o.parallel_plan == NULL || strcmp(o.parallel_plan, "auto") == 0);
  assert_int_equal(o.sequence_parallel, 0);
  assert_int_equal(o.param_dtype, MESHLM_DTYPE_F32);
  assert_int_equal(o.reduce_dtype, MESHLM_DTYPE_F32);
  assert_int_equal(o.ac, MESHLM_AC_NONE);
  /* the documented literals, compared exactly (the same double constants) */
  assert_true(o.lr == 1e-5 && o.min_lr == 0.0 && o.beta1 == 0.9 && o.beta2 == 0.999);
  assert_true(o.eps == 1e-8 && o.weight_decay == 0.01 && o.max_grad_norm == 1.0);
  assert_int_equal(o.schedule, MESHLM_LR_CONSTANT);
  assert_int_equal(o.warmup_steps, 0);
  assert_int_equal(o.total_steps, 1);
  assert_int_equal(o.micro_batch_tokens, 4096);
  assert_int_equal(o.unshard_for_inference, 1);

  meshlm_loss l;
  memset(&l, 0xA5, sizeof l);
  meshlm_loss_default(&l);
  assert_int_equal(l.kind, MESHLM_LOSS_NLL);
  assert_int_equal(l.sequence_level, 0);
  assert_true(l.ratio_clip_min == 0.2f && l.ratio_clip_max == 0.2f);
  assert_true(l.ratio_clip_c == 0.0f && l.kl_penalty == 0.0f);

  meshlm_sampling sp;
  memset(&sp, 0xA5, sizeof sp);
  meshlm_sampling_default(&sp);
  assert_int_equal(sp.max_new_tokens, 32);
  assert_true(sp.temperature == 1.0f && sp.top_p == 1.0f);
  assert_int_equal(sp.greedy, 0);
  assert_int_equal(sp.eos_token_id, -1);
  assert_int_equal(sp.seed, 0);

  assert_non_null(meshlm_error(NULL));
  meshlm_close(NULL); /* s may be NULL */
}

/* meshlm_open fails: −1, a session that names `needle` and that closes. */
static void expect_open_fails(const char *dir, const meshlm_options *o, const char *needle,
                              const char *what) {
  meshlm_session *s = NULL;
  int rc = meshlm_open(dir, o, MPI_COMM_WORLD, &s);
  if (!s) fail_msg("%s: meshlm_open handed out no session", what);
  expect_fail(s, rc, needle, what);
  meshlm_info in;
  assert_int_equal(meshlm_get_info(s, &in), -1);
  meshlm_close(s);
}

static void test_open_errors(void **state) {
  (void)state;
  char missing[4200];
  tmp_path(missing, sizeof missing, "no_such_model");
  meshlm_options o;
  meshlm_options_default(&o);
  expect_open_fails(missing, &o, "no_such_model", "a missing model directory");
  expect_open_fails(NULL, &o, "model_dir", "model_dir NULL");

  o.tp = g_world == 1 ? 2 : 3; /* divides neither 1 nor 4 */
  expect_open_fails(g_fixture, &o, "tp", "tp not dividing the world");
  meshlm_options_default(&o);
  o.tp = 0;
  expect_open_fails(g_fixture, &o, "tp", "tp 0");

  meshlm_options_default(&o);
  o.param_dtype = (meshlm_dtype)7;
  expect_open_fails(g_fixture, &o, "param_dtype", "param_dtype 7");
  meshlm_options_default(&o);
  o.reduce_dtype = MESHLM_DTYPE_SOURCE;
  expect_open_fails(g_fixture, &o, "reduce_dtype", "reduce_dtype SOURCE");

  meshlm_options_default(&o);
  o.device = "tpu";
  expect_open_fails(g_fixture, &o, "device", "device tpu");
  o.device = NULL;
  expect_open_fails(g_fixture, &o, "device", "device NULL");

  meshlm_options_default(&o);
  o.micro_batch_tokens = 0;
  expect_open_fails(g_fixture, &o, "micro_batch_tokens", "micro_batch_tokens 0");
  o.micro_batch_tokens = -5;
  expect_open_fails(g_fixture, &o, "micro_batch_tokens", "micro_batch_tokens -5");

  /* one rank's option only: every rank fails with its message */
  meshlm_options_default(&o);
  if (g_rank == g_world - 1) o.micro_batch_tokens = 0;
  expect_open_fails(g_fixture, &o, "micro_batch_tokens", "micro_batch_tokens 0 on one rank");
}

/* The fixture's tensors against meshlm_weight_info: the same names (the
 * untied Llama trains every tensor), shapes, and its dtype. */
static void check_weight_table(meshlm_session *s, int64_t *params) {
  char path[4200];
  snprintf(path, sizeof path, "%s/model.safetensors", g_fixture);
  st_file f;
  st_open(path, &f);
  int64_t n = meshlm_num_weights(s), in_file = 0;
  const char *key;
  json_t *val;
  json_object_foreach(f.hdr, key, val) in_file += strcmp(key, "__metadata__") != 0;
  assert_int_equal(n, in_file);
  *params = 0;
  for (int64_t i = 0; i < n; i++) {
    meshlm_weight w;
    OK(s, meshlm_weight_info(s, i, &w));
    const char *dt;
    int nd;
    int64_t sh[2];
    size_t nb;
    if (!st_tensor(&f, w.name, &dt, &nd, sh, &nb))
      fail_msg("weight %lld '%s' is not in the fixture", (long long)i, w.name);
    assert_int_equal(w.ndim, nd);
    assert_int_equal(w.shape[0], sh[0]);
    if (nd == 2) assert_int_equal(w.shape[1], sh[1]);
    assert_int_equal(w.dtype, strcmp(dt, "BF16") == 0 ? MESHLM_DTYPE_BF16 : MESHLM_DTYPE_F32);
    *params += numel(&w);
  }
  st_close(&f);
  meshlm_weight w;
  expect_fail(s, meshlm_weight_info(s, n, &w), "index", "meshlm_weight_info(n)");
  expect_fail(s, meshlm_weight_info(s, -1, &w), "index", "meshlm_weight_info(-1)");
}

static void test_open_info(void **state) {
  (void)state;
  /* NULL options: one rank's mesh, 1 × world × 1 × 1 */
  meshlm_session *s = open_ok(g_fixture, NULL, MPI_COMM_WORLD);
  meshlm_info in = info_of(s);
  assert_int_equal(in.rank, g_rank);
  assert_int_equal(in.world, g_world);
  assert_int_equal(in.dp_replicate, 1);
  assert_int_equal(in.dp_shard, g_world);
  assert_int_equal(in.cp, 1);
  assert_int_equal(in.tp, 1);
  assert_int_equal(in.dp_rank, g_rank);
  assert_int_equal(in.dp_size, g_world);
  assert_int_equal(in.cp_rank, 0);
  assert_int_equal(in.tp_rank, 0);
  assert_int_equal(in.vocab_size, g_vocab);
  assert_int_equal(in.hidden_size, g_hidden);
  assert_int_equal(in.num_layers, g_layers);
  assert_int_equal(in.bos_token_id, g_bos);
  assert_int_equal(in.eos_token_id, g_eos);
  assert_int_equal(in.step, 0);
  assert_string_equal(meshlm_error(s), ""); /* no error so far */
  int64_t params;
  check_weight_table(s, &params);
  assert_int_equal(in.num_params, params);
  meshlm_close(s);

  /* the mesh: tp fastest */
  meshlm_options o = mesh_opts();
  s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  in = info_of(s);
  assert_int_equal(in.tp, o.tp);
  assert_int_equal(in.dp_shard, g_world / o.tp);
  assert_int_equal(in.tp_rank, g_rank % o.tp);
  assert_int_equal(in.dp_rank, g_rank / o.tp);
  assert_int_equal(in.dp_size, g_world / o.tp);
  meshlm_close(s);

  /* open_f: comm_f < 0 is the world, else the Fortran handle's communicator */
  OK(s, meshlm_open_f(g_fixture, NULL, -1, &s));
  assert_int_equal(info_of(s).world, g_world);
  meshlm_close(s);
  OK(s, meshlm_open_f(g_fixture, NULL, (int64_t)MPI_Comm_c2f(MPI_COMM_SELF), &s));
  in = info_of(s);
  assert_int_equal(in.world, 1);
  assert_int_equal(in.rank, 0);
  meshlm_close(s);
}

/* ======================================================================= */
/* 2. Log-probs of variable-length batches                                 */
/* ======================================================================= */

/* Each sequence of b alone (n = 1 calls) on a one-rank session. */
static void score_alone(meshlm_session *self, const batch *b, float *out) {
  int rc = 0;
  for (int64_t k = 0; rc == 0 && k < b->n; k++) {
    meshlm_seqs one = {1, &b->lens[k], b->tok + tok_at(b, k)};
    float dummy;
    double sum = -1.0;
    float *o = b->lens[k] > 1 ? out + pred_at(b, k) : &dummy;
    rc = meshlm_logprobs(self, &one, NULL, o, &sum);
    if (rc == 0 && b->lens[k] == 1 && sum != 0.0) { /* no prediction: an empty sum */
      fprintf(stderr, "[rank %d] a length-1 sequence's seq_sums: %g\n", g_rank, sum);
      rc = -1;
    }
  }
  local_ok(self, rc, "scoring each sequence alone on MPI_COMM_SELF");
}

/* seq_sums against the test's own double sums of the same fp32 outputs:
 * both are sums of the same L − 1 values in double, each within
 * gamma64_{L−1}·Σ|out| of the exact sum in any order (R2). */
static void check_sums(const batch *b, const float *out, const double *sums) {
  for (int64_t k = 0, p = 0; k < b->n; p += b->lens[k] - 1, k++) {
    double s = 0, a = 0;
    for (int64_t t = 0; t < b->lens[k] - 1; t++) {
      s += out[p + t];
      a += fabs(out[p + t]);
    }
    if (fabs(sums[k] - s) > 2.0 * tol_gamma64((double)b->lens[k]) * a)
      fail_msg("seq_sums[%lld] = %.17g, the outputs sum to %.17g", (long long)k, sums[k], s);
  }
}

static void test_logprobs_packing(void **state) {
  (void)state;
  meshlm_options o = mesh_opts();
  /* one micro-batch (4096 tokens), several (12: the 33-token sequence alone, the others in
   * rows of <= 12), and several without holding the parameters */
  const int64_t caps[3] = {4096, 12, 12};
  meshlm_session *s[3];
  for (int i = 0; i < 3; i++) {
    o.micro_batch_tokens = caps[i];
    o.unshard_for_inference = i < 2;
    s[i] = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  }
  meshlm_session *self = open_ok(g_fixture, NULL, MPI_COMM_SELF);
  meshlm_info in = info_of(s[0]);
  batch b = local_batch(in.dp_rank); /* each dp rank its own sequences */
  meshlm_seqs q = seqs_of(&b);
  int64_t P = b.npred, S = 33;
  float *ref = xcalloc((size_t)P, sizeof *ref), *got[3], *m = xcalloc((size_t)P, sizeof *m);
  double *sums = xcalloc((size_t)b.n, sizeof *sums);
  score_alone(self, &b, ref);
  /* packing runs the same kernels per document; the GEMM and attention tilings over other
   * token counts (and the mesh's tp/FSDP split against one rank) sum in other orders:
   * tolerance.h §3, relative L2 over the batch's log-probs */
  double tol = lp_tol(S);
  for (int i = 0; i < 3; i++) {
    got[i] = xcalloc((size_t)P, sizeof *got[i]);
    OK(s[i], meshlm_logprobs(s[i], &q, NULL, got[i], sums));
    double err = rel_l2(got[i], ref, P);
    printf("[rank %d] logprobs, micro_batch_tokens %lld, hold %d vs alone: rel L2 %.3g (bound "
           "%.3g)\n", g_rank, (long long)caps[i], i < 2, err, tol);
    assert_true(err <= tol);
    check_sums(&b, got[i], sums);

    meshlm_call_stats st;
    OK(s[i], meshlm_last_call_stats(s[i], &st));
    assert_int_equal(st.micro_batches, max_all(ffd_rows(b.lens, b.n, caps[i])));
    assert_int_equal(st.tokens - st.padding, b.ntok); /* every token computed once */
    assert_true(st.padding >= 0);
    if (g_world == 1) assert_int_equal(st.padding, 0); /* no padding on one rank */
    /* forward only: no gradient reduce-scatters; under vocab parallelism (FSDP's group > 1
     * rank) the embedding's lookup is one reduce-scatter per micro-batch
     * (src/parallel/vocab.h) */
    assert_int_equal(st.fsdp_reduce_scatters, in.dp_shard > 1 ? st.micro_batches : 0);
    assert_int_equal(st.cp_collectives, 0);
    assert_int_equal(st.dp_replicate_collectives, 0);
    if (in.tp == 1) assert_int_equal(st.tp_collectives, 0);
    else assert_true(st.tp_collectives > 0);

    /* a mask: masked-out entries are 0 and left out of the sums; the rest is the same
     * call's output (the mask selects outputs of the same computation: TOL_EXACT) */
    OK(s[i], meshlm_logprobs(s[i], &q, b.mask, m, sums));
    for (int64_t t = 0; t < P; t++) {
      if (!b.mask[t] && m[t] != 0.0f) fail_msg("masked-out entry %lld = %g", (long long)t, m[t]);
      if (b.mask[t] && memcmp(&m[t], &got[i][t], sizeof(float)) != 0)
        fail_msg("entry %lld: %.9g with the mask, %.9g without", (long long)t, m[t], got[i][t]);
    }
    check_sums(&b, m, sums);
  }
  /* unshard_for_inference 0 vs 1: the same micro-batches; all-gathers are copies, so the
   * kernels see the same parameters (TOL_EXACT) */
  assert_memory_equal(got[1], got[2], sizeof(float) * (size_t)P);

  /* a dp rank passing no sequences (n = 0, NULL arrays) while the others score theirs */
  meshlm_seqs none = {0, NULL, NULL};
  int empty = in.dp_size > 1 && in.dp_rank == 1;
  OK(s[1], meshlm_logprobs(s[1], empty ? &none : &q, NULL, empty ? NULL : m, NULL));
  if (!empty) assert_true(rel_l2(m, ref, P) <= tol);
  /* and every rank none */
  OK(s[0], meshlm_logprobs(s[0], &none, NULL, NULL, NULL));

  for (int i = 0; i < 3; i++) {
    meshlm_close(s[i]);
    free(got[i]);
  }
  meshlm_close(self);
  free(ref);
  free(m);
  free(sums);
  batch_free(&b);
}

/* ======================================================================= */
/* 3. Call statistics: FSDP all-gathers per micro-batch                    */
/* ======================================================================= */

/* On dp_shard = world (tp 1: four FSDP ranks on four). The header: one
 * all-gather per FSDP unit (a decoder layer, the root: units = layers + 1)
 * per micro-batch, or per call under unshard_for_inference, and under
 * vocab parallelism (FSDP's group > 1 rank) k = 2 more per micro-batch
 * (the token ids, lm_head's input). Calls of 1 and 3 micro-batches:
 *   held:   units + k·mb       → Δ = 2k
 *   unheld: (units + k)·mb     → Δ = 2(units + k)
 * A one-rank FSDP group gathers nothing (each "gathered" unit is its shard)
 * and has no vocab parallelism: every count 0. */
static void test_call_stats(void **state) {
  (void)state;
  meshlm_options o;
  meshlm_options_default(&o);
  o.micro_batch_tokens = 16;
  static const int64_t la[] = {8, 8}, lb[] = {16, 16, 16}; /* 1 and 3 rows of 16 */
  batch a = batch_make(la, 2, 70 + (uint64_t)g_rank), b = batch_make(lb, 3, 80 + (uint64_t)g_rank);
  float *out = xcalloc((size_t)b.npred, sizeof *out);
  int64_t units = g_layers + 1, k = g_world > 1 ? 2 : 0;
  for (int hold = 1; hold >= 0; hold--) {
    o.unshard_for_inference = hold;
    meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
    meshlm_info in = info_of(s);
    assert_int_equal(in.dp_shard, g_world);
    meshlm_call_stats sa, sb;
    meshlm_seqs qa = seqs_of(&a), qb = seqs_of(&b);
    OK(s, meshlm_logprobs(s, &qa, NULL, out, NULL));
    OK(s, meshlm_last_call_stats(s, &sa));
    OK(s, meshlm_logprobs(s, &qb, NULL, out, NULL));
    OK(s, meshlm_last_call_stats(s, &sb));
    printf("[rank %d] hold %d: all-gathers %lld (1 micro-batch), %lld (3); units %lld, k %lld\n",
           g_rank, hold, (long long)sa.fsdp_all_gathers, (long long)sb.fsdp_all_gathers,
           (long long)units, (long long)k);
    assert_int_equal(sa.micro_batches, 1);
    assert_int_equal(sb.micro_batches, 3);
    /* every rank's rows equally long: no padding */
    assert_int_equal(sa.tokens, 16);
    assert_int_equal(sb.tokens, 48);
    assert_int_equal(sa.padding, 0);
    assert_int_equal(sb.padding, 0);
    if (g_world == 1) {
      assert_int_equal(sa.fsdp_all_gathers, 0);
      assert_int_equal(sb.fsdp_all_gathers, 0);
      assert_int_equal(sb.fsdp_bytes, 0);
    } else {
      int64_t want_a = hold ? units + k : units + k, want_b = hold ? units + 3 * k : 3 * (units + k);
      assert_int_equal(sb.fsdp_all_gathers - sa.fsdp_all_gathers,
                       hold ? 2 * k : 2 * (units + k));
      assert_int_equal(sa.fsdp_all_gathers, want_a);
      assert_int_equal(sb.fsdp_all_gathers, want_b);
      assert_true(sb.fsdp_bytes > sa.fsdp_bytes);
    }
    /* besides (src/parallel/vocab.h): the embedding lookup's reduce-scatter per
     * micro-batch, and the vocab-parallel log-softmax's statistics all-reduced over the
     * group, the same per micro-batch of the same length; no gradient reduce-scatters */
    assert_int_equal(sa.fsdp_reduce_scatters, k ? 1 : 0);
    assert_int_equal(sb.fsdp_reduce_scatters, k ? 3 : 0);
    assert_int_equal(sb.fsdp_all_reduces, 3 * sa.fsdp_all_reduces);
    if (k) assert_true(sa.fsdp_all_reduces > 0);
    else assert_int_equal(sa.fsdp_all_reduces, 0);
    for (int i = 0; i < 2; i++) {
      const meshlm_call_stats *st = i ? &sb : &sa;
      assert_int_equal(st->tp_collectives, 0);
      assert_int_equal(st->cp_collectives, 0);
      assert_int_equal(st->dp_replicate_collectives, 0);
    }
    meshlm_close(s);
  }
  free(out);
  batch_free(&a);
  batch_free(&b);
}

/* ======================================================================= */
/* 4. Training steps against double references                            */
/* ======================================================================= */

/* Per-prediction arrays over the global batch (NULL: not given). */
typedef struct garr {
  const uint8_t *mask;
  const float *tw, *sw, *old, *ref;
} garr;

/* This rank's share of g and of a, one train step on s. */
static int step_share(meshlm_session *s, const gbatch *g, const garr *a, const meshlm_loss *l,
                      meshlm_step_result *r) {
  meshlm_info in = info_of(s);
  slice sl = slice_of(g, in.dp_rank, in.dp_size);
  meshlm_train_batch tb = {sl.seqs,
                           a->mask ? a->mask + sl.p0 : NULL,
                           a->tw ? a->tw + sl.p0 : NULL,
                           a->sw ? a->sw + sl.s0 : NULL,
                           a->old ? a->old + sl.p0 : NULL,
                           a->ref ? a->ref + sl.p0 : NULL};
  return meshlm_train_step(s, &tb, l, r);
}

typedef struct ref_loss {
  double loss, kl, clip_fraction;
  double bound, kl_bound; /* on |engine − reference| */
  double dnorm;           /* the bound on ||Δ||₂, Δ = the step's log-probs − lp */
  double margin;          /* CLIPPED_PG: the nearest log-ratio to a branch boundary */
  int64_t tokens, sequences, clipped, dual;
} ref_loss;

/* The step's loss per the header's formulas, in double, from lp [all
 * predictions of g] (meshlm_logprobs' values), with its bound.
 *
 * The engine evaluates the same formulas (in double) on its training
 * forward's log-probs lp + Δ, with ||Δ||₂ <= dnorm = lp_tol(S)·||lp||₂
 * (two fp32 evaluations, tolerance.h §3), so |Δ_t| <= dnorm for every t.
 * Per masked token with weight w_t (1/N token level, 1/(n_k·K) sequence
 * level):
 *  - NLL / weighted NLL: ℓ is linear in lp with slope |A_t| (1 for NLL);
 *  - clipped PG: where the ratio is not clipped, ℓ = −A·e^(lp − old) moves
 *    by <= |A|·r·|Δ|·e^|Δ|; a clipped token's ℓ is constant in lp — provided
 *    no ratio crosses a clip boundary, asserted by margin > dnorm;
 *  - k3: β(e^(d−Δ) − e^d + Δ), d = ref − lp: <= β|1 − e^d||Δ| +
 *    β·e^d·Δ²·e^|Δ|/2.
 * Summed with Cauchy–Schwarz: e^dnorm·||w·s||₂·dnorm + e^dnorm/2·max(w β
 * e^d)·dnorm², s_t the slope above. Rounding: the engine's weights are
 * fp32 roundings of 1/norm (relative u each) and its sums and this
 * reference's are double (gamma64 of the token count and the dozen
 * operations per token, R2/R3/R5): (u + gamma64(N + 32))·Σ w|ℓ|. */
static ref_loss reference(const gbatch *g, const garr *a, const float *lp, const meshlm_loss *l) {
  const batch *b = &g->all;
  ref_loss R = {.margin = INFINITY};
  int64_t K = 0, S = 0;
  int64_t *nk = xcalloc((size_t)b->n, sizeof *nk);
  for (int64_t k = 0, p = 0; k < b->n; k++) {
    S = b->lens[k] > S ? b->lens[k] : S;
    for (int64_t t = 0; t < b->lens[k] - 1; t++, p++) nk[k] += !a->mask || a->mask[p];
    R.tokens += nk[k];
    K += nk[k] > 0;
  }
  R.sequences = b->n;
  R.dnorm = lp_tol(S) * l2(lp, b->npred);
  double lo = 1.0 - (double)l->ratio_clip_min, hi = 1.0 + (double)l->ratio_clip_max;
  double c = l->ratio_clip_c, beta = l->kl_penalty;
  double ws2 = 0, wk2 = 0, absl = 0, absk = 0, curv = 0;
  for (int64_t k = 0, p = 0; k < b->n; k++)
    for (int64_t t = 0; t < b->lens[k] - 1; t++, p++) {
      if (a->mask && !a->mask[p]) continue;
      double w = 1.0 / (l->sequence_level ? (double)nk[k] * (double)K : (double)R.tokens);
      float A = (a->tw ? a->tw[p] : 1.0f) * (a->sw ? a->sw[k] : 1.0f); /* as the engine: fp32 */
      double x = lp[p], ell, slope;
      if (l->kind == MESHLM_LOSS_NLL) {
        ell = -x;
        slope = 1.0;
      } else if (l->kind == MESHLM_LOSS_WEIGHTED_NLL) {
        ell = -(double)A * x;
        slope = fabs((double)A);
      } else {
        double d = x - (double)a->old[p], r = exp(d), rc = r < lo ? lo : r > hi ? hi : r;
        double l1 = -(double)A * r, l2v = -(double)A * rc;
        int flows = l1 >= l2v; /* torch.max: the unclipped branch */
        ell = flows ? l1 : l2v;
        if (c > 1.0 && A < 0.0f && -(double)A * c < ell) {
          ell = -(double)A * c;
          flows = 0;
          R.dual++;
        }
        R.clipped += !flows;
        slope = flows ? fabs((double)A) * r : 0.0;
        R.margin = fmin(R.margin, fmin(fabs(d - log(lo)), fabs(d - log(hi))));
        if (c > 1.0) R.margin = fmin(R.margin, fabs(d - log(c)));
      }
      double kslope = 0;
      if (l->kind != MESHLM_LOSS_NLL && beta > 0) {
        double d = (double)a->ref[p] - x, e = exp(d), k3 = beta * (e - d - 1.0);
        ell += k3;
        R.kl += w * k3;
        absk += w * fabs(k3);
        kslope = beta * fabs(1.0 - e);
        curv = fmax(curv, w * beta * e);
      }
      R.loss += w * ell;
      absl += w * fabs(ell);
      ws2 += (w * (slope + kslope)) * (w * (slope + kslope));
      wk2 += (w * kslope) * (w * kslope);
    }
  double ed = exp(R.dnorm), round = TOL_U + tol_gamma64((double)R.tokens + 32.0);
  R.bound = ed * sqrt(ws2) * R.dnorm + ed / 2.0 * curv * R.dnorm * R.dnorm + round * absl;
  R.kl_bound = ed * sqrt(wk2) * R.dnorm + ed / 2.0 * curv * R.dnorm * R.dnorm + round * absk;
  R.clip_fraction = R.tokens ? (double)R.clipped / (double)R.tokens : 0.0;
  free(nk);
  return R;
}

static void check_step(const char *what, const char *where, const meshlm_step_result *r,
                       const ref_loss *R, double lr) {
  printf("[rank %d] %s (%s): loss %.9g, reference %.9g, |diff| %.3g (bound %.3g); kl %.6g "
         "(%.6g); clip fraction %.4f (%lld dual); grad norm %.4g\n",
         g_rank, what, where, r->loss, R->loss, fabs(r->loss - R->loss), R->bound, r->kl, R->kl,
         r->clip_fraction, (long long)R->dual, r->grad_norm);
  if (!(fabs(r->loss - R->loss) <= R->bound))
    fail_msg("%s (%s): loss %.17g, reference %.17g", what, where, r->loss, R->loss);
  if (!(fabs(r->kl - R->kl) <= R->kl_bound))
    fail_msg("%s (%s): kl %.17g, reference %.17g", what, where, r->kl, R->kl);
  /* the same integer counts divided in double: exact */
  if (r->clip_fraction != R->clip_fraction)
    fail_msg("%s (%s): clip fraction %.17g, reference %.17g", what, where, r->clip_fraction,
             R->clip_fraction);
  assert_int_equal(r->tokens, R->tokens);
  assert_int_equal(r->sequences, R->sequences);
  assert_int_equal(r->step, 1);
  assert_int_equal(r->skipped, 0);
  assert_true(isfinite(r->grad_norm) && r->grad_norm > 0);
  assert_true(fabs(r->lr - lr) <= tol_schedule_abs(lr));
}

enum { OLD_NONE, OLD_SAME, OLD_SHIFTED };

/* One first step of loss l on g from the fixture's weights: on the mesh
 * (each dp rank its part) and, on several ranks, on a one-rank session
 * with the whole global batch; both against the reference from the mesh's
 * meshlm_logprobs. old: none, = the current log-probs (ratio 1), or
 * shifted by ±0.05, ±0.5, +1.5 (inside, beyond the clips, beyond the dual
 * clip). ref_logprobs: lp + U(−0.3, 0.3) when l has a KL penalty. The
 * mesh's log-probs after the step go to `after` (NULL: not wanted). */
static ref_loss run_case(const char *what, const gbatch *g, const meshlm_loss *l, int old_kind,
                         const float *tw, const float *sw, meshlm_step_result *out,
                         float *after) {
  const double lr = 1e-3;
  meshlm_options o = mesh_opts();
  o.lr = lr;
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD), *one = NULL;
  if (g_world > 1) {
    meshlm_options_default(&o);
    o.lr = lr;
    one = open_ok(g_fixture, &o, MPI_COMM_SELF);
  }
  int64_t n = g->all.npred;
  float *lp = xcalloc((size_t)n, sizeof *lp), *old = NULL, *ref = NULL;
  global_lp(s, g, NULL, lp);
  static const double shifts[5] = {-0.5, -0.05, 0.05, 0.5, 1.5};
  rng_seed(4242);
  if (old_kind != OLD_NONE) {
    old = xcalloc((size_t)n, sizeof *old);
    for (int64_t t = 0; t < n; t++)
      old[t] = old_kind == OLD_SAME ? lp[t] : (float)((double)lp[t] - shifts[rnd() % 5]);
  }
  if (l->kl_penalty > 0) {
    ref = xcalloc((size_t)n, sizeof *ref);
    for (int64_t t = 0; t < n; t++) ref[t] = (float)((double)lp[t] + 0.6 * unif() - 0.3);
  }
  garr a = {g->all.mask, tw, sw, old, ref};
  ref_loss R = reference(g, &a, lp, l);
  if (l->kind == MESHLM_LOSS_CLIPPED_PG && !(R.margin > R.dnorm))
    fail_msg("%s: a log-ratio lies %.3g from a clip boundary, within the log-probs' bound %.3g",
             what, R.margin, R.dnorm);
  meshlm_step_result r;
  OK(s, step_share(s, g, &a, l, &r));
  check_step(what, "mesh", &r, &R, lr);
  if (one) {
    meshlm_step_result r1;
    garr a1 = a;
    local_ok(one, meshlm_train_step(one, &(meshlm_train_batch){seqs_of(&g->all), a1.mask, a1.tw,
                                                                a1.sw, a1.old, a1.ref},
                                    l, &r1),
             "the step on one rank");
    check_step(what, "one rank, the whole global batch", &r1, &R, lr);
    meshlm_close(one);
  }
  assert_int_equal(info_of(s).step, 1);
  if (after) global_lp(s, g, NULL, after);
  if (out) *out = r;
  meshlm_close(s);
  free(lp);
  free(old);
  free(ref);
  return R;
}

/* Per-sequence advantages in ±[0.1, 1] and per-token weights in [0.5, 1.5]. */
static void advantages(const gbatch *g, float *sw, float *tw) {
  rng_seed(99);
  for (int64_t k = 0; k < g->all.n; k++)
    sw[k] = (float)((rnd() & 1 ? 1.0 : -1.0) * (0.1 + 0.9 * unif()));
  for (int64_t t = 0; tw && t < g->all.npred; t++) tw[t] = (float)(0.5 + unif());
}

static void test_train_nll(void **state) {
  (void)state;
  gbatch g = gbatch_make(31);
  int64_t n = g.all.npred;
  float *after_nll = xcalloc((size_t)n, sizeof(float)), *after_w = xcalloc((size_t)n, 4);
  float *ones = xcalloc((size_t)n, sizeof(float)), *sones = xcalloc((size_t)g.all.n, 4);
  for (int64_t t = 0; t < n; t++) ones[t] = 1.0f;
  for (int64_t k = 0; k < g.all.n; k++) sones[k] = 1.0f;
  meshlm_loss l;
  meshlm_loss_default(&l);
  meshlm_step_result r_nll, r_w;
  /* NLL: the mean of −log-probs over the masked predictions of the global batch */
  ref_loss R = run_case("NLL", &g, &l, OLD_NONE, NULL, NULL, &r_nll, after_nll);
  assert_true(r_nll.kl == 0.0 && r_nll.clip_fraction == 0.0);
  l.sequence_level = 1;
  run_case("NLL, sequence level", &g, &l, OLD_NONE, NULL, NULL, NULL, NULL);
  /* weighted NLL with every weight 1: −A·lp with A = 1·1 (fp32, exact, R1) is −lp and its
   * slope −A = −1 exactly, so the same operations run on the same values as NLL's: the loss,
   * and the log-probs after the step, bitwise (TOL_EXACT; MPI's reductions are deterministic
   * for the same inputs on the same communicator size) */
  l.sequence_level = 0;
  l.kind = MESHLM_LOSS_WEIGHTED_NLL;
  R = run_case("weighted NLL, weights 1", &g, &l, OLD_NONE, ones, sones, &r_w, after_w);
  assert_true(r_w.loss == r_nll.loss);
  assert_true(r_w.grad_norm == r_nll.grad_norm);
  assert_memory_equal(after_w, after_nll, sizeof(float) * (size_t)n);
  (void)R;
  free(after_nll);
  free(after_w);
  free(ones);
  free(sones);
  batch_free(&g.all);
}

static void test_train_clipped_pg(void **state) {
  (void)state;
  gbatch g = gbatch_make(32);
  float *sw = xcalloc((size_t)g.all.n, sizeof *sw), *tw = xcalloc((size_t)g.all.npred, 4);
  advantages(&g, sw, tw);
  meshlm_loss l;
  meshlm_loss_default(&l);
  l.kind = MESHLM_LOSS_CLIPPED_PG;
  /* ratio 1: loss = −Σ A / N (token level), −Σ_k A_k / K over sequences with a masked
   * prediction (sequence level); nothing clipped */
  for (int seq = 0; seq <= 1; seq++) {
    l.sequence_level = seq;
    meshlm_step_result r;
    ref_loss R = run_case(seq ? "clipped PG, ratio 1, sequence level" : "clipped PG, ratio 1",
                          &g, &l, OLD_SAME, NULL, sw, &r, NULL);
    double closed = 0, absa = 0;
    int64_t K = 0;
    for (int64_t k = 0, p = 0; k < g.all.n; k++) {
      int64_t nk = 0;
      for (int64_t t = 0; t < g.all.lens[k] - 1; t++, p++) nk += g.all.mask[p];
      K += nk > 0;
      closed -= seq ? (nk > 0 ? sw[k] : 0.0) : (double)nk * sw[k];
      absa += seq ? fabs(sw[k]) : (double)nk * fabs(sw[k]);
    }
    double norm = seq ? (double)K : (double)R.tokens;
    closed /= norm;
    /* the reference at r = e^0 = 1 is this closed form up to double rounding (R2, R5) */
    assert_true(fabs(R.loss - closed) <= tol_gamma64((double)R.tokens + 8.0) * absa / norm);
    assert_true(fabs(r.loss - closed) <= R.bound + tol_gamma64((double)R.tokens + 8.0) * absa / norm);
    assert_true(r.clip_fraction == 0.0);
    assert_int_equal(R.clipped, 0);
  }
  /* shifted old log-probs: ratios inside and beyond [1 − ε_low, 1 + ε_high], beyond the dual
   * clip c = 3, per-token weights, and a k3 KL penalty to reference log-probs */
  l.sequence_level = 0;
  l.ratio_clip_min = 0.2f;
  l.ratio_clip_max = 0.28f;
  l.ratio_clip_c = 3.0f;
  l.kl_penalty = 0.05f;
  meshlm_step_result r;
  ref_loss R = run_case("clipped PG, shifted, dual clip, KL", &g, &l, OLD_SHIFTED, tw, sw, &r,
                        NULL);
  assert_true(R.clipped > 0 && R.clipped < R.tokens); /* the case clips some, not all */
  assert_true(R.dual > 0);
  assert_true(r.kl > 0);
  l.sequence_level = 1;
  l.ratio_clip_c = 0.0f;
  l.kl_penalty = 0.0f;
  R = run_case("clipped PG, shifted, sequence level", &g, &l, OLD_SHIFTED, NULL, sw, &r, NULL);
  assert_true(R.clipped > 0 && R.clipped < R.tokens);
  assert_true(r.kl == 0.0);
  free(sw);
  free(tw);
  batch_free(&g.all);
}

/* transformers' get_{constant,linear,cosine}_schedule_with_warmup with
 * min_lr reached at step total − 1 (the header), in double. */
static double lr_want(meshlm_schedule sch, double lr, double min_lr, int64_t warm, int64_t total,
                      int64_t k) {
  if (k < warm) return lr * (double)k / (double)warm;
  if (sch == MESHLM_LR_CONSTANT) return lr;
  int64_t span = total - 1 - warm;
  double p = fmin(1.0, (double)(k - warm) / (double)(span > 1 ? span : 1));
  double f = sch == MESHLM_LR_LINEAR ? 1.0 - p : 0.5 * (1.0 + cos(M_PI * p));
  return min_lr + (lr - min_lr) * f;
}

static void test_schedule(void **state) {
  (void)state;
  gbatch g = gbatch_make(33);
  int64_t n = g.all.npred;
  float *lp0 = xcalloc((size_t)n, sizeof *lp0), *lp = xcalloc((size_t)n, sizeof *lp);
  garr a = {g.all.mask, NULL, NULL, NULL, NULL};
  const meshlm_schedule kinds[2] = {MESHLM_LR_LINEAR, MESHLM_LR_COSINE};
  const int64_t warm[2] = {2, 0}, total[2] = {5, 4}, steps[2] = {6, 4};
  for (int i = 0; i < 2; i++) {
    meshlm_options o = mesh_opts();
    o.lr = 1e-3;
    o.min_lr = 1e-4;
    o.schedule = kinds[i];
    o.warmup_steps = warm[i];
    o.total_steps = total[i];
    meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
    global_lp(s, &g, NULL, lp0);
    for (int64_t k = 0; k < steps[i]; k++) {
      meshlm_step_result r;
      OK(s, step_share(s, &g, &a, NULL, &r));
      double want = lr_want(kinds[i], o.lr, o.min_lr, warm[i], total[i], k);
      printf("[rank %d] schedule %d step %lld: lr %.9g (want %.9g)\n", g_rank, (int)kinds[i],
             (long long)k, r.lr, want);
      assert_true(fabs(r.lr - want) <= tol_schedule_abs(o.lr));
      assert_int_equal(r.step, k + 1);
      assert_int_equal(info_of(s).step, k + 1);
      global_lp(s, &g, NULL, lp);
      if (warm[i] > 0 && k == 0) {
        /* lr 0 (warmup's first step): AdamW's p·(1 − 0·wd) − 0·update is p exactly (R1),
         * so the log-probs are bitwise those before */
        assert_true(r.lr == 0.0);
        assert_memory_equal(lp, lp0, sizeof(float) * (size_t)n);
      } else if (k == 1) {
        assert_true(memcmp(lp, lp0, sizeof(float) * (size_t)n) != 0);
      }
    }
    meshlm_close(s);
  }
  free(lp0);
  free(lp);
  batch_free(&g.all);
}

/* ======================================================================= */
/* 5. Save / resume, export / reload, refit, reload_tensors                */
/* ======================================================================= */

static void nll_step(meshlm_session *s, const gbatch *g) {
  garr a = {g->all.mask, NULL, NULL, NULL, NULL};
  meshlm_step_result r;
  OK(s, step_share(s, g, &a, NULL, &r));
}

/* Save → train → resume gives the saved weights back; export → train →
 * reload(dir) likewise, and a session opened from the export too. Every
 * comparison is bitwise: the weights are copies (checkpoint and export
 * bytes of fp32 values, read back) and the same mesh runs the same kernels
 * on them (TOL_EXACT). */
static void test_save_resume_export(void **state) {
  (void)state;
  meshlm_options o = mesh_opts();
  o.lr = 1e-3;
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  gbatch g = gbatch_make(41);
  int64_t n = g.all.npred;
  size_t bytes = sizeof(float) * (size_t)n;
  float *saved = xcalloc((size_t)n, 4), *lp = xcalloc((size_t)n, 4);
  char ckpt[4200], exp[4200];
  tmp_path(ckpt, sizeof ckpt, "ckpt");
  tmp_path(exp, sizeof exp, "export");

  nll_step(s, &g);
  OK(s, meshlm_save(s, ckpt));
  global_lp(s, &g, NULL, saved);
  nll_step(s, &g);
  assert_int_equal(info_of(s).step, 2);
  global_lp(s, &g, NULL, lp);
  assert_true(memcmp(lp, saved, bytes) != 0);
  OK(s, meshlm_resume(s, ckpt));
  assert_int_equal(info_of(s).step, 1);
  global_lp(s, &g, NULL, lp);
  assert_memory_equal(lp, saved, bytes);

  OK(s, meshlm_export(s, exp, MESHLM_DTYPE_F32));
  nll_step(s, &g);
  global_lp(s, &g, NULL, lp);
  assert_true(memcmp(lp, saved, bytes) != 0);
  OK(s, meshlm_reload(s, exp));
  assert_int_equal(info_of(s).step, 2); /* reload keeps the step */
  global_lp(s, &g, NULL, lp);
  assert_memory_equal(lp, saved, bytes);
  meshlm_session *e = open_ok(exp, &o, MPI_COMM_WORLD);
  global_lp(e, &g, NULL, lp);
  assert_memory_equal(lp, saved, bytes);
  meshlm_close(e);
  meshlm_close(s);
  free(saved);
  free(lp);
  batch_free(&g.all);
}

/* refit against the exported safetensors: F32 byte for byte (to root 0 by
 * callback, to every rank into buffers), SOURCE = F32 for this fp32
 * fixture, BF16 = round-to-nearest-even of the F32 values (byte for byte
 * with a BF16 export). */
static void test_refit(void **state) {
  (void)state;
  meshlm_options o = mesh_opts();
  o.lr = 1e-3;
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  gbatch g = gbatch_make(42);
  nll_step(s, &g); /* weights other than the fixture's */
  char e32[4200], e16[4200], path[4300];
  tmp_path(e32, sizeof e32, "refit_f32");
  tmp_path(e16, sizeof e16, "refit_bf16");
  OK(s, meshlm_export(s, e32, MESHLM_DTYPE_F32));
  OK(s, meshlm_export(s, e16, MESHLM_DTYPE_BF16));
  st_file f32, f16;
  snprintf(path, sizeof path, "%s/model.safetensors", e32);
  st_open(path, &f32);
  snprintf(path, sizeof path, "%s/model.safetensors", e16);
  st_open(path, &f16);

  weights w = weights_of(s);
  /* to root 0, by callback: rank 0 receives every tensor in weight order, the others none */
  OK(s, meshlm_refit(s, 0, MESHLM_DTYPE_F32, keep_tensor, &w));
  assert_int_equal(w.calls, g_rank == 0 ? w.n : 0);
  for (int64_t i = 0; g_rank == 0 && i < w.n; i++) {
    const char *dt;
    int nd;
    int64_t sh[2];
    size_t nb;
    const void *d = st_tensor(&f32, w.name[i], &dt, &nd, sh, &nb);
    if (!d) fail_msg("'%s' is not in the export", w.name[i]);
    assert_string_equal(dt, "F32");
    assert_int_equal(w.dtype[i], MESHLM_DTYPE_F32);
    assert_int_equal(w.nbytes[i], nb);
    if (memcmp(w.data[i], d, nb) != 0) fail_msg("refit '%s' differs from the export", w.name[i]);
  }
  /* SOURCE on every rank (root −1): F32 for this fixture, the same bytes */
  weights_clear(&w);
  OK(s, meshlm_refit(s, -1, MESHLM_DTYPE_SOURCE, keep_tensor, &w));
  assert_int_equal(w.calls, w.n);
  /* into buffers, on every rank, F32 and BF16 */
  weights b32 = weights_of(s), b16 = weights_of(s);
  weights_alloc(&b32, MESHLM_DTYPE_F32);
  weights_alloc(&b16, MESHLM_DTYPE_BF16);
  OK(s, meshlm_refit_into(s, -1, MESHLM_DTYPE_F32, b32.data));
  OK(s, meshlm_refit_into(s, -1, MESHLM_DTYPE_BF16, b16.data));
  for (int64_t i = 0; i < w.n; i++) {
    const char *dt;
    int nd;
    int64_t sh[2];
    size_t nb, nb16;
    const float *d = st_tensor(&f32, w.name[i], &dt, &nd, sh, &nb);
    const uint16_t *h = st_tensor(&f16, w.name[i], &dt, &nd, sh, &nb16);
    assert_non_null(d);
    assert_non_null(h);
    assert_string_equal(dt, "BF16");
    assert_int_equal(w.dtype[i], MESHLM_DTYPE_F32);
    assert_memory_equal(w.data[i], d, nb);
    assert_memory_equal(b32.data[i], d, nb);
    assert_int_equal(b16.nbytes[i], nb16);
    assert_memory_equal(b16.data[i], h, nb16);
    const uint16_t *got = b16.data[i];
    for (int64_t j = 0; j < numel(&w.w[i]); j++)
      if (got[j] != bf16_rne(d[j]))
        fail_msg("'%s'[%lld]: bf16 0x%04x, round-to-nearest-even of %.9g is 0x%04x", w.name[i],
                 (long long)j, got[j], d[j], bf16_rne(d[j]));
  }
  /* root 0 only: buffers may be NULL elsewhere */
  weights_alloc(&b32, MESHLM_DTYPE_F32);
  OK(s, meshlm_refit_into(s, 0, MESHLM_DTYPE_F32, g_rank == 0 ? b32.data : NULL));
  for (int64_t i = 0; g_rank == 0 && i < w.n; i++)
    assert_memory_equal(b32.data[i], w.data[i], b32.nbytes[i]);
  st_close(&f32);
  st_close(&f16);
  weights_free(&w);
  weights_free(&b32);
  weights_free(&b16);
  meshlm_close(s);
  batch_free(&g.all);
}

/* reload_tensors: perturbed tensors change the log-probs, the originals
 * restore them bitwise (copies of the same values, TOL_EXACT); BF16 data
 * is widened exactly; an unknown name or a wrong shape fails naming it;
 * a refit callback that stops fails every rank. */
static void test_reload_tensors(void **state) {
  (void)state;
  meshlm_options o = mesh_opts();
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  gbatch g = gbatch_make(43);
  int64_t n = g.all.npred;
  size_t bytes = sizeof(float) * (size_t)n;
  float *lp0 = xcalloc((size_t)n, 4), *lp = xcalloc((size_t)n, 4);
  global_lp(s, &g, NULL, lp0);
  weights w = weights_of(s);
  weights_alloc(&w, MESHLM_DTYPE_F32);
  OK(s, meshlm_refit_into(s, -1, MESHLM_DTYPE_F32, w.data));

  meshlm_tensor *all = xcalloc((size_t)w.n, sizeof *all);
  for (int64_t i = 0; i < w.n; i++)
    all[i] = (meshlm_tensor){w.name[i], MESHLM_DTYPE_F32, w.w[i].ndim,
                             {w.w[i].shape[0], w.w[i].shape[1]}, w.data[i]};
  /* two tensors perturbed: the first and the last of the table */
  int64_t pick[2] = {0, w.n - 1};
  meshlm_tensor t[2];
  float *pert[2];
  for (int j = 0; j < 2; j++) {
    int64_t i = pick[j], m = numel(&w.w[i]);
    pert[j] = xcalloc((size_t)m, sizeof(float));
    for (int64_t e = 0; e < m; e++) pert[j][e] = ((float *)w.data[i])[e] * 1.25f + 0.01f;
    t[j] = all[i];
    t[j].data = pert[j];
  }
  OK(s, meshlm_reload_tensors(s, 2, t));
  global_lp(s, &g, NULL, lp);
  double moved = rel_l2(lp, lp0, n);
  printf("[rank %d] reload_tensors: perturbed log-probs moved by rel L2 %.3g (rounding bound "
         "%.3g)\n", g_rank, moved, lp_tol(21));
  assert_true(moved > lp_tol(21)); /* more than any rounding could */
  OK(s, meshlm_reload_tensors(s, w.n, all));
  global_lp(s, &g, NULL, lp);
  assert_memory_equal(lp, lp0, bytes);
  assert_int_equal(info_of(s).step, 0);

  /* BF16 data: kept as its exact fp32 widening */
  uint16_t *h = xcalloc((size_t)numel(&w.w[0]), 2);
  for (int64_t e = 0; e < numel(&w.w[0]); e++) h[e] = bf16_rne(((float *)w.data[0])[e]);
  meshlm_tensor tb = all[0];
  tb.dtype = MESHLM_DTYPE_BF16;
  tb.data = h;
  OK(s, meshlm_reload_tensors(s, 1, &tb));
  weights back = weights_of(s);
  weights_alloc(&back, MESHLM_DTYPE_F32);
  OK(s, meshlm_refit_into(s, -1, MESHLM_DTYPE_F32, back.data));
  for (int64_t e = 0; e < numel(&w.w[0]); e++) {
    uint32_t u = (uint32_t)h[e] << 16;
    float want;
    memcpy(&want, &u, sizeof want);
    assert_true(((float *)back.data[0])[e] == want);
  }
  for (int64_t i = 1; i < w.n; i++) assert_memory_equal(back.data[i], w.data[i], w.nbytes[i]);
  OK(s, meshlm_reload_tensors(s, 1, &all[0]));
  global_lp(s, &g, NULL, lp);
  assert_memory_equal(lp, lp0, bytes);

  /* an unknown name; a wrong shape: both named, nothing changed */
  meshlm_tensor bad = all[0];
  bad.name = "model.layers.99.mlp.nonexistent.weight";
  expect_fail(s, meshlm_reload_tensors(s, 1, &bad), "model.layers.99.mlp.nonexistent.weight",
              "reload_tensors, an unknown name");
  bad = all[w.n - 1];
  bad.shape[0] -= 1;
  expect_fail(s, meshlm_reload_tensors(s, 1, &bad), w.name[w.n - 1],
              "reload_tensors, a wrong shape");
  global_lp(s, &g, NULL, lp);
  assert_memory_equal(lp, lp0, bytes);

  /* a refit callback that stops: at the first tensor on root 0; at the third on the last
   * rank of a refit to every rank. Every rank fails; nothing changed. */
  weights c = weights_of(s);
  c.stop_at = g_rank == 0 ? 0 : -1;
  expect_fail(s, meshlm_refit(s, 0, MESHLM_DTYPE_F32, keep_tensor, &c),
              "stopped by the callback", "refit stopped at root 0");
  weights_clear(&c);
  c.stop_at = g_rank == g_world - 1 ? 2 : -1;
  expect_fail(s, meshlm_refit(s, -1, MESHLM_DTYPE_BF16, keep_tensor, &c),
              "stopped by the callback", "refit stopped on the last rank");
  weights_clear(&c);
  c.stop_at = -1;
  OK(s, meshlm_refit(s, -1, MESHLM_DTYPE_F32, keep_tensor, &c));
  for (int64_t i = 0; i < w.n; i++) assert_memory_equal(c.data[i], w.data[i], w.nbytes[i]);
  global_lp(s, &g, NULL, lp);
  assert_memory_equal(lp, lp0, bytes);

  weights_free(&c);
  weights_free(&back);
  free(h);
  free(pert[0]);
  free(pert[1]);
  free(all);
  weights_free(&w);
  free(lp0);
  free(lp);
  meshlm_close(s);
  batch_free(&g.all);
}

/* ======================================================================= */
/* 6. Generation                                                           */
/* ======================================================================= */

enum { NEW = 5 };

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
 * same log-probs (the replica's KV-cache path, the mesh's full forward):
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
  gen_out before = generate_ok(s, &q, &sp); /* the replica at the fixture's weights */
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

/* ======================================================================= */
/* 7. Misuse                                                               */
/* ======================================================================= */

static meshlm_session *failed_session(void) {
  char missing[4200];
  tmp_path(missing, sizeof missing, "no_such_model");
  meshlm_session *s = NULL;
  assert_int_equal(meshlm_open(missing, NULL, MPI_COMM_WORLD, &s), -1);
  assert_non_null(s);
  /* the checks below look for the calls' own message, not this one */
  assert_null(strstr(meshlm_error(s), "session is not open"));
  return s;
}

/* Every collective call on a session whose open failed: −1 and a message
 * that it is not open (no collective runs: each rank answers alone). */
static void test_failed_session(void **state) {
  (void)state;
  meshlm_session *s = failed_session();
  batch b = local_batch(0);
  meshlm_seqs q = seqs_of(&b);
  float *out = xcalloc((size_t)b.npred, sizeof *out);
  meshlm_train_batch tb = {.seqs = q};
  meshlm_step_result r;
  meshlm_sampling sp;
  meshlm_sampling_default(&sp);
  int32_t tok[64 * 32];
  int64_t lens[64];
  meshlm_info in;
  weights none = {0};
  char dir[4200];
  tmp_path(dir, sizeof dir, "failed");
  expect_fail(s, meshlm_logprobs(s, &q, NULL, out, NULL), "session is not open", "logprobs");
  expect_fail(s, meshlm_train_step(s, &tb, NULL, &r), "session is not open", "train_step");
  expect_fail(s, meshlm_save(s, dir), "session is not open", "save");
  expect_fail(s, meshlm_resume(s, dir), "session is not open", "resume");
  expect_fail(s, meshlm_export(s, dir, MESHLM_DTYPE_F32), "session is not open", "export");
  expect_fail(s, meshlm_refit(s, -1, MESHLM_DTYPE_F32, keep_tensor, &none), "session is not open", "refit");
  expect_fail(s, meshlm_refit_into(s, -1, MESHLM_DTYPE_F32, (void *const *)out), "session is not open",
              "refit_into");
  expect_fail(s, meshlm_reload(s, g_fixture), "session is not open", "reload");
  expect_fail(s, meshlm_reload_tensors(s, 0, NULL), "session is not open", "reload_tensors");
  expect_fail(s, meshlm_generate(s, &q, &sp, tok, lens, NULL), "session is not open", "generate");
  expect_fail(s, meshlm_get_info(s, &in), "session is not open", "get_info");
  meshlm_close(s);
  free(out);
  batch_free(&b);
}

/* The non-collective calls on a failed session: −1 (num_weights −1), each
 * with its own message (the header: every call's error is the session's
 * message), not the open's left over. */
static void test_failed_session_local_calls(void **state) {
  (void)state;
  char missing[512] = "";
  meshlm_session *s = failed_session();
  meshlm_call_stats st;
  meshlm_weight w;
  if (meshlm_last_call_stats(s, &st) != -1 || !strstr(meshlm_error(s), "session is not open"))
    strcat(missing, " meshlm_last_call_stats");
  meshlm_close(s);
  s = failed_session();
  if (meshlm_num_weights(s) != -1 || !strstr(meshlm_error(s), "session is not open"))
    strcat(missing, " meshlm_num_weights");
  meshlm_close(s);
  s = failed_session();
  if (meshlm_weight_info(s, 0, &w) != -1 || !strstr(meshlm_error(s), "session is not open"))
    strcat(missing, " meshlm_weight_info");
  meshlm_close(s);
  if (missing[0])
    fail_msg("on a failed session these return -1 but leave the open's message instead of "
             "their own:%s", missing);
}

/* Bad arguments on one rank only (the last): −1 on every rank with a
 * message naming what was wrong; then the session works as before (the
 * same log-probs bitwise, no step). */
static void test_bad_arguments(void **state) {
  (void)state;
  meshlm_options o = mesh_opts();
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  meshlm_info in = info_of(s);
  batch b = local_batch(in.dp_rank);
  meshlm_seqs q = seqs_of(&b);
  size_t bytes = sizeof(float) * (size_t)b.npred;
  float *ref = xcalloc((size_t)b.npred, 4), *out = xcalloc((size_t)b.npred, 4);
  OK(s, meshlm_logprobs(s, &q, NULL, ref, NULL));
  int bad = g_rank == g_world - 1;
  int64_t *lens = xcalloc((size_t)b.n, sizeof *lens);
  int32_t *tok = xcalloc((size_t)(g_maxpos + 1 + b.ntok), sizeof *tok);
  char vocab_s[32], maxpos_s[32];
  snprintf(vocab_s, sizeof vocab_s, "%lld", (long long)g_vocab);
  snprintf(maxpos_s, sizeof maxpos_s, "%lld", (long long)(g_maxpos + 1));
  enum { NCASES = 9 };
  static const char *what[NCASES] = {"n = -1", "a length 0", "an id = vocab_size", "an id -1",
                                     "lens NULL", "tokens NULL", "the batch NULL",
                                     "a length > max_position_embeddings", "out NULL"};
  const char *needle[NCASES] = {"-1", "sequence 1", vocab_s, "-1", "NULL", "NULL", "NULL",
                                maxpos_s, "NULL"};
  for (int c = 0; c < NCASES; c++) {
    meshlm_seqs v = q;
    memcpy(lens, b.lens, sizeof *lens * (size_t)b.n);
    memcpy(tok, b.tok, sizeof *tok * (size_t)b.ntok);
    v.lens = lens;
    v.tokens = tok;
    float *o_ = out;
    const meshlm_seqs *arg = &v;
    switch (c) {
    case 0: v.n = -1; break;
    case 1: lens[1] = 0; break;
    case 2: tok[3] = (int32_t)g_vocab; break;
    case 3: tok[b.ntok - 1] = -1; break;
    case 4: v.lens = NULL; break;
    case 5: v.tokens = NULL; break;
    case 6: arg = NULL; break;
    case 7: lens[0] = g_maxpos + 1; break;
    case 8: o_ = NULL; break;
    }
    int rc = meshlm_logprobs(s, bad ? arg : &q, NULL, bad ? o_ : out, NULL);
    expect_fail(s, rc, needle[c], what[c]);
  }
  OK(s, meshlm_logprobs(s, &q, NULL, out, NULL));
  assert_memory_equal(out, ref, bytes);

  /* train_step: a bad length on one rank */
  memcpy(lens, b.lens, sizeof *lens * (size_t)b.n);
  lens[2] = 0;
  meshlm_train_batch tb = {.seqs = q}, tbad = {.seqs = {q.n, lens, q.tokens}};
  meshlm_step_result r;
  expect_fail(s, meshlm_train_step(s, bad ? &tbad : &tb, NULL, &r), "sequence 2",
              "train_step with a length 0");

  /* generate: sampling out of range, a prompt too long, on one rank (the fields' names:
   * test_bad_sampling) */
  meshlm_sampling good, sp;
  meshlm_sampling_default(&good);
  good.max_new_tokens = NEW;
  int32_t *gt = xcalloc((size_t)(b.n * 40), sizeof *gt);
  int64_t *gl = xcalloc((size_t)b.n, sizeof *gl);
  for (int c = 0; c < 5; c++) {
    sp = good;
    if (c == 0) sp.max_new_tokens = 0;
    if (c == 1) sp.temperature = 0.0f;
    if (c == 2) sp.top_p = 0.0f;
    if (c == 3) sp.top_p = 1.5f;
    if (c == 4) sp.eos_token_id = -3;
    expect_fail(s, meshlm_generate(s, &q, bad ? &sp : &good, gt, gl, NULL), NULL, "sampling");
  }
  memcpy(lens, b.lens, sizeof *lens * (size_t)b.n);
  lens[0] = g_maxpos - NEW + 1; /* prompt + max_new_tokens > max_position_embeddings */
  meshlm_seqs longp = {1, lens, tok};
  expect_fail(s, meshlm_generate(s, bad ? &longp : &q, &good, gt, gl, NULL), NULL,
              "generate, a prompt too long");
  expect_fail(s, meshlm_generate(s, &q, bad ? NULL : &good, gt, gl, NULL), NULL,
              "generate, sampling NULL");

  /* weights calls */
  char dir[4200], missing[4200];
  tmp_path(dir, sizeof dir, "bad_args");
  tmp_path(missing, sizeof missing, "no_such_checkpoint");
  weights w = weights_of(s);
  char root_s[32];
  snprintf(root_s, sizeof root_s, "root %d", g_world);
  expect_fail(s, meshlm_refit(s, g_world, MESHLM_DTYPE_F32, keep_tensor, &w), root_s,
              "refit, root = world");
  expect_fail(s, meshlm_refit(s, -1, (meshlm_dtype)9, keep_tensor, &w), "dtype", "refit dtype 9");
  expect_fail(s, meshlm_refit(s, -1, MESHLM_DTYPE_F32, bad ? NULL : keep_tensor, &w), NULL,
              "refit, no callback on a receiving rank");
  expect_fail(s, meshlm_export(s, dir, (meshlm_dtype)9), "dtype", "export dtype 9");
  expect_fail(s, meshlm_export(s, bad ? NULL : dir, MESHLM_DTYPE_F32), "dir", "export dir NULL");
  expect_fail(s, meshlm_save(s, bad ? NULL : dir), "dir", "save dir NULL");
  expect_fail(s, meshlm_resume(s, missing), "no_such_checkpoint", "resume, no checkpoint");
  expect_fail(s, meshlm_reload(s, bad ? NULL : g_fixture), "dir", "reload dir NULL");
  expect_fail(s, meshlm_reload(s, missing), "no_such_checkpoint", "reload, a missing directory");
  expect_fail(s, meshlm_reload_tensors(s, bad ? -1 : 0, NULL), "-1", "reload_tensors n -1");
  expect_fail(s, meshlm_reload_tensors(s, 1, NULL), "NULL", "reload_tensors NULL");
  weights_free(&w);

  /* nothing changed */
  assert_int_equal(info_of(s).step, 0);
  OK(s, meshlm_logprobs(s, &q, NULL, out, NULL));
  assert_memory_equal(out, ref, bytes);
  free(gt);
  free(gl);
  free(lens);
  free(tok);
  free(ref);
  free(out);
  batch_free(&b);
  meshlm_close(s);
}

/* The header: sampling fields out of range are named (as meshlm_sampling
 * names them), on every rank. */
static void test_bad_sampling(void **state) {
  (void)state;
  meshlm_options o = mesh_opts();
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  batch b = local_batch(info_of(s).dp_rank);
  meshlm_seqs q = seqs_of(&b);
  meshlm_sampling good, sp;
  meshlm_sampling_default(&good);
  good.max_new_tokens = NEW;
  int32_t *gt = xcalloc((size_t)(b.n * 40), sizeof *gt);
  int64_t *gl = xcalloc((size_t)b.n, sizeof *gl);
  static const char *field[5] = {"temperature", "top_p", "top_p", "eos_token_id",
                                 "max_new_tokens"};
  for (int c = 0; c < 5; c++) {
    sp = good;
    if (c == 0) sp.temperature = 0.0f;
    if (c == 1) sp.top_p = 0.0f;
    if (c == 2) sp.top_p = 1.5f;
    if (c == 3) sp.eos_token_id = -3;
    if (c == 4) sp.max_new_tokens = 0;
    expect_fail(s, meshlm_generate(s, &q, g_rank == g_world - 1 ? &sp : &good, gt, gl, NULL),
                field[c], field[c]);
  }
  free(gt);
  free(gl);
  batch_free(&b);
  meshlm_close(s);
}

/* The loss's fields and arrays (every rank, then one rank only). */
static void test_bad_loss(void **state) {
  (void)state;
  meshlm_options o = mesh_opts();
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  gbatch g = gbatch_make(51);
  int64_t n = g.all.npred;
  float *lp0 = xcalloc((size_t)n, 4), *lp = xcalloc((size_t)n, 4), *old = xcalloc((size_t)n, 4);
  uint8_t *zero = xcalloc((size_t)n, 1);
  global_lp(s, &g, NULL, lp0);
  memcpy(old, lp0, sizeof(float) * (size_t)n);
  meshlm_step_result r;
  enum { NCASES = 9 };
  static const char *needle[NCASES] = {"kind", "ratio_clip_min", "ratio_clip_max", "ratio_clip_c",
                                       "kl_penalty", "kl_penalty", "old_logprobs",
                                       "ref_logprobs", "masked"};
  for (int once = 0; once <= 1; once++)
    for (int c = 0; c < NCASES; c++) {
      meshlm_loss l, good;
      meshlm_loss_default(&l);
      good = l;
      garr a = {g.all.mask, NULL, NULL, NULL, NULL};
      switch (c) {
      case 0: l.kind = (meshlm_loss_kind)7; break;
      case 1: l.ratio_clip_min = -0.1f; break;
      case 2: l.ratio_clip_max = NAN; break;
      case 3: l.ratio_clip_c = 0.5f; break;
      case 4: l.kl_penalty = -1.0f; break;
      case 5: l.kl_penalty = 0.1f; break; /* with NLL */
      case 6: l.kind = MESHLM_LOSS_CLIPPED_PG; break;
      case 7: l.kind = MESHLM_LOSS_WEIGHTED_NLL; l.kl_penalty = 0.1f; break;
      case 8: a.mask = zero; break;
      }
      if (c == 8 && once) continue; /* "none in the global batch" needs every rank */
      int mine = !once || g_rank == g_world - 1;
      /* with `once` the other ranks pass a valid step of the same loss */
      garr ga = a;
      if (!mine) {
        l = c == 6 ? l : good;
        ga.old = old;
      }
      expect_fail(s, step_share(s, &g, mine ? &a : &ga, &l, &r), needle[c], needle[c]);
    }
  garr a = {g.all.mask, NULL, NULL, NULL, NULL};
  expect_fail(s, step_share(s, &g, &a, NULL, NULL), "NULL", "train_step, result NULL");
  expect_fail(s, meshlm_train_step(s, NULL, NULL, &r), "NULL", "train_step, batch NULL");
  assert_int_equal(info_of(s).step, 0);
  global_lp(s, &g, NULL, lp);
  assert_memory_equal(lp, lp0, sizeof(float) * (size_t)n);
  free(lp0);
  free(lp);
  free(old);
  free(zero);
  batch_free(&g.all);
  meshlm_close(s);
}

/* Rank 0 calls meshlm_logprobs while the others call meshlm_train_step:
 * −1 on every rank naming both calls, nothing run. */
static void test_collective_order(void **state) {
  (void)state;
  if (g_world == 1) skip();
  meshlm_options o = mesh_opts();
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  meshlm_info in = info_of(s);
  batch b = local_batch(in.dp_rank);
  meshlm_seqs q = seqs_of(&b);
  float *ref = xcalloc((size_t)b.npred, 4), *out = xcalloc((size_t)b.npred, 4);
  OK(s, meshlm_logprobs(s, &q, NULL, ref, NULL));
  meshlm_train_batch tb = {.seqs = q};
  meshlm_step_result r;
  int rc = g_rank == 0 ? meshlm_logprobs(s, &q, NULL, out, NULL)
                       : meshlm_train_step(s, &tb, NULL, &r);
  expect_fail(s, rc, "meshlm_logprobs", "mismatched collective order");
  expect_fail(s, rc, "meshlm_train_step", "mismatched collective order");
  /* and another pair: save on the last rank, export elsewhere */
  char dir[4200];
  tmp_path(dir, sizeof dir, "order");
  rc = g_rank == g_world - 1 ? meshlm_save(s, dir) : meshlm_export(s, dir, MESHLM_DTYPE_F32);
  expect_fail(s, rc, "meshlm_save", "save vs export");
  expect_fail(s, rc, "meshlm_export", "save vs export");
  assert_int_equal(info_of(s).step, 0);
  OK(s, meshlm_logprobs(s, &q, NULL, out, NULL));
  assert_memory_equal(out, ref, sizeof(float) * (size_t)b.npred);
  free(ref);
  free(out);
  batch_free(&b);
  meshlm_close(s);
}

/* The tp peers of a dp rank pass different batches: −1 naming it. */
static void test_tp_peers_differ(void **state) {
  (void)state;
  meshlm_options o = mesh_opts();
  if (o.tp == 1) skip();
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  meshlm_info in = info_of(s);
  batch b = local_batch(in.dp_rank), c = local_batch(in.dp_rank);
  if (in.tp_rank == 1) c.tok[c.ntok - 1] = (c.tok[c.ntok - 1] + 1) % (int32_t)g_vocab;
  meshlm_seqs q = seqs_of(&b), qc = seqs_of(&c), fewer = {b.n - 1, b.lens, b.tok};
  float *ref = xcalloc((size_t)b.npred, 4), *out = xcalloc((size_t)b.npred, 4);
  OK(s, meshlm_logprobs(s, &q, NULL, ref, NULL));
  expect_fail(s, meshlm_logprobs(s, &qc, NULL, out, NULL), "different batches",
              "tp peers with different tokens");
  expect_fail(s, meshlm_logprobs(s, in.tp_rank == 1 ? &fewer : &q, NULL, out, NULL),
              "different batches", "tp peers with different counts");
  meshlm_train_batch tb = {.seqs = qc};
  meshlm_step_result r;
  expect_fail(s, meshlm_train_step(s, &tb, NULL, &r), "different batches",
              "train_step, tp peers with different tokens");
  assert_int_equal(info_of(s).step, 0);
  OK(s, meshlm_logprobs(s, &q, NULL, out, NULL));
  assert_memory_equal(out, ref, sizeof(float) * (size_t)b.npred);
  free(ref);
  free(out);
  batch_free(&b);
  batch_free(&c);
  meshlm_close(s);
}

/* The header: meshlm_error's message "names the world rank it arose on". */
static void test_error_names_rank(void **state) {
  (void)state;
  meshlm_options o = mesh_opts();
  meshlm_session *s = open_ok(g_fixture, &o, MPI_COMM_WORLD);
  meshlm_info in = info_of(s);
  batch b = local_batch(in.dp_rank);
  if (g_rank == g_world - 1) b.lens[1] = 0;
  meshlm_seqs q = seqs_of(&b);
  float *out = xcalloc((size_t)b.npred + 1, 4);
  char want[32];
  snprintf(want, sizeof want, "rank %d", g_world - 1);
  expect_fail(s, meshlm_logprobs(s, &q, NULL, out, NULL), want, "a length 0 on the last rank");
  free(out);
  batch_free(&b);
  meshlm_close(s);
}

/* ======================================================================= */

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_world);
  snprintf(g_fixture, sizeof g_fixture, "%s/tests/fixtures/llama_untied", ML_SOURCE_DIR);
  read_config();
  make_tmp();
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_version_defaults),
      cmocka_unit_test(test_open_errors),
      cmocka_unit_test(test_open_info),
      cmocka_unit_test(test_logprobs_packing),
      cmocka_unit_test(test_call_stats),
      cmocka_unit_test(test_train_nll),
      cmocka_unit_test(test_train_clipped_pg),
      cmocka_unit_test(test_schedule),
      cmocka_unit_test(test_save_resume_export),
      cmocka_unit_test(test_refit),
      cmocka_unit_test(test_reload_tensors),
      cmocka_unit_test(test_generate_greedy),
      cmocka_unit_test(test_generate_seeds),
      cmocka_unit_test(test_generate_after_step),
      cmocka_unit_test(test_failed_session),
      cmocka_unit_test(test_failed_session_local_calls),
      cmocka_unit_test(test_bad_arguments),
      cmocka_unit_test(test_bad_sampling),
      cmocka_unit_test(test_bad_loss),
      cmocka_unit_test(test_collective_order),
      cmocka_unit_test(test_tp_peers_differ),
      cmocka_unit_test(test_error_names_rank),
  };
  int failed = cmocka_run_group_tests(tests, NULL, NULL);
  MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (g_rank == 0) nftw(g_tmp, rm_one, 16, FTW_DEPTH | FTW_PHYS);
  /* MPI was initialised here, not by the library: meshlm_finalize leaves it to us */
  int fin = meshlm_finalize();
  int up = 0;
  MPI_Finalized(&up);
  if (fin != 0 || up) {
    fprintf(stderr, "test_api: meshlm_finalize finalised MPI it did not initialise\n");
    failed = 1;
  }
  MPI_Finalize();
  return failed ? 1 : 0;
}

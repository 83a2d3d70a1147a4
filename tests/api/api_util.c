/* The api tests' shared helpers: api_util.h says what each one does. */
#define _XOPEN_SOURCE 700 /* mkdtemp, nftw */

#include <ftw.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "api_util.h"

/* ======================================================================= */
/* Process-wide facts                                                      */
/* ======================================================================= */

int g_rank, g_world;
char g_fixture[4096]; /* tests/fixtures/llama_untied */
char g_tmp[4096];     /* a directory every rank shares (rank 0 makes it) */
tol_model g_sizes;    /* tolerance.h §3's sizes from config.json (seq, tokens per use) */
int64_t g_vocab, g_maxpos, g_layers, g_hidden;
int32_t g_bos = -1, g_eos = -1;

static char g_prog[256] = "test_api"; /* this program's name, for its messages */

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
void rng_seed(uint64_t s) { g_rng = 0x9E3779B97F4A7C15ull ^ (s * 0xBF58476D1CE4E5B9ull); }
uint64_t rnd(void) {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return g_rng;
}
double unif(void) { return (double)(rnd() >> 11) * 0x1p-53; } /* [0, 1) */

void *xcalloc(size_t n, size_t sz) {
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
    fprintf(stderr, "%s: %s: %s\n", g_prog, path, err.text);
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
                        0.0,
                        1.0 /* whole rows (parallel/loss.h) */,
                        0.0, /* dense layers: the API tests' fixtures have no experts */
                        0.0};
  g_bos = cfg_int(root, "bos_token_id", -1);
  g_eos = cfg_int(root, "eos_token_id", -1);
  json_decref(root);
}

double lp_tol(int64_t S) {
  tol_model m = g_sizes;
  m.seq = (double)S;
  return tol_model_pair(&m, TOL_LOGPROBS);
}

double rel_l2(const float *a, const float *b, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; i++) {
    double d = (double)a[i] - b[i];
    num += d * d;
    den += (double)b[i] * b[i];
  }
  return den > 0 ? sqrt(num / den) : sqrt(num);
}

double l2(const float *a, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; i++) s += (double)a[i] * a[i];
  return sqrt(s);
}

int64_t max_all(int64_t v) {
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
  return v;
}

/* ======================================================================= */
/* Sessions                                                                */
/* ======================================================================= */

meshlm_session *open_ok(const char *dir, const meshlm_options *o, MPI_Comm comm) {
  meshlm_session *s = NULL;
  if (meshlm_open(dir, o, comm, &s))
    fail_msg("meshlm_open(%s): %s", dir, s ? meshlm_error(s) : "(no session)");
  return s;
}

meshlm_options mesh_opts(void) {
  meshlm_options o;
  meshlm_options_default(&o);
  o.tp = g_world % 2 == 0 ? 2 : 1;
  return o;
}

meshlm_info info_of(meshlm_session *s) {
  meshlm_info in = {.struct_size = sizeof in};
  if (meshlm_get_info(s, &in)) fail_msg("meshlm_get_info: %s", meshlm_error(s));
  return in;
}

void expect_fail(meshlm_session *s, int rc, const char *needle, const char *what) {
  const char *e = meshlm_error(s);
  if (rc != -1) fail_msg("%s: returned %d, expected -1", what, rc);
  if (!e || !e[0]) fail_msg("%s: -1 without a message", what);
  if (needle && !strstr(e, needle))
    fail_msg("%s: message '%s' does not name '%s'", what, e, needle);
}

void local_ok(meshlm_session *s, int rc, const char *what) {
  int bad = rc != 0, any = 0;
  MPI_Allreduce(&bad, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (bad) fail_msg("%s: %s", what, meshlm_error(s));
  if (any) fail_msg("%s failed on another rank", what);
}

/* ======================================================================= */
/* Batches                                                                 */
/* ======================================================================= */

batch batch_make(const int64_t *lens, int64_t n, uint64_t seed) {
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

void batch_free(batch *b) {
  free(b->lens);
  free(b->tok);
  free(b->mask);
  memset(b, 0, sizeof *b);
}

meshlm_seqs seqs_of(const batch *b) { return (meshlm_seqs){b->n, b->lens, b->tok}; }

int64_t pred_at(const batch *b, int64_t k) {
  int64_t o = 0;
  for (int64_t i = 0; i < k; i++) o += b->lens[i] - 1;
  return o;
}
int64_t tok_at(const batch *b, int64_t k) {
  int64_t o = 0;
  for (int64_t i = 0; i < k; i++) o += b->lens[i];
  return o;
}

batch local_batch(int dp_rank) {
  static const int64_t l0[] = {1, 2, 7, 33, 5}, l1[] = {5, 33, 1, 12, 2, 9};
  return dp_rank % 2 == 0 ? batch_make(l0, 5, 1000 + (uint64_t)dp_rank)
                          : batch_make(l1, 6, 1000 + (uint64_t)dp_rank);
}

gbatch gbatch_make(uint64_t seed) {
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

slice slice_of(const gbatch *g, int d, int D) {
  if (D != 1 && D != PARTS) fail_msg("the training tests need dp 1 or %d, not %d", PARTS, D);
  int a = D == 1 ? 0 : d, z = D == 1 ? PARTS : d + 1;
  slice s = {{g->seq[z] - g->seq[a], g->all.lens + g->seq[a], g->all.tok + g->tok[a]},
             g->seq[a], g->pred[a], g->pred[z] - g->pred[a]};
  return s;
}

void global_lp(meshlm_session *s, const gbatch *g, const uint8_t *mask, float *out) {
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

void global_ref_lp(meshlm_session *s, const gbatch *g, float *out) {
  meshlm_info in = info_of(s);
  slice sl = slice_of(g, in.dp_rank, in.dp_size);
  float *loc = xcalloc((size_t)sl.npred, sizeof *loc);
  OK(s, meshlm_reference_logprobs(s, &sl.seqs, NULL, loc, NULL));
  memset(out, 0, sizeof(float) * (size_t)g->all.npred);
  if (in.tp_rank == 0 && in.cp_rank == 0)
    memcpy(out + sl.p0, loc, sizeof(float) * (size_t)sl.npred);
  MPI_Allreduce(MPI_IN_PLACE, out, (int)g->all.npred, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  free(loc);
}

int step_share(meshlm_session *s, const gbatch *g, const garr *a, const meshlm_loss *l,
               meshlm_step_result *r) {
  meshlm_info in = info_of(s);
  slice sl = slice_of(g, in.dp_rank, in.dp_size);
  meshlm_train_batch tb = {sizeof tb, sl.seqs,
                           a->mask ? a->mask + sl.p0 : NULL,
                           a->tw ? a->tw + sl.p0 : NULL,
                           a->sw ? a->sw + sl.s0 : NULL,
                           a->old ? a->old + sl.p0 : NULL,
                           a->ref ? a->ref + sl.p0 : NULL, NULL, NULL};
  return meshlm_train_step(s, &tb, l, r);
}

void nll_step(meshlm_session *s, const gbatch *g) {
  garr a = {g->all.mask, NULL, NULL, NULL, NULL};
  meshlm_step_result r = {.struct_size = sizeof r};
  OK(s, step_share(s, g, &a, NULL, &r));
}

/* ======================================================================= */
/* safetensors (the exported and the fixture's files)                      */
/* ======================================================================= */

void st_open(const char *path, st_file *f) {
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

void st_close(st_file *f) {
  json_decref(f->hdr);
  free(f->buf);
  memset(f, 0, sizeof *f);
}

const void *st_tensor(const st_file *f, const char *name, const char **dtype, int *ndim,
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

uint16_t bf16_rne(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* ======================================================================= */
/* The weight table and refits                                             */
/* ======================================================================= */

weights weights_of(meshlm_session *s) {
  weights w = {.n = meshlm_num_weights(s), .stop_at = -1};
  if (w.n <= 0) fail_msg("meshlm_num_weights: %lld", (long long)w.n);
  w.w = xcalloc((size_t)w.n, sizeof *w.w);
  w.name = xcalloc((size_t)w.n, sizeof *w.name);
  w.data = xcalloc((size_t)w.n, sizeof *w.data);
  w.nbytes = xcalloc((size_t)w.n, sizeof *w.nbytes);
  w.dtype = xcalloc((size_t)w.n, sizeof *w.dtype);
  for (int64_t i = 0; i < w.n; i++) {
    w.w[i].struct_size = sizeof w.w[i];
    OK(s, meshlm_weight_info(s, i, &w.w[i]));
    snprintf(w.name[i], sizeof w.name[i], "%s", w.w[i].name);
  }
  return w;
}

int64_t numel(const meshlm_weight *w) {
  return w->shape[0] * (w->ndim == 2 ? w->shape[1] : 1);
}

void weights_clear(weights *w) {
  for (int64_t i = 0; i < w->n; i++) {
    free(w->data[i]);
    w->data[i] = NULL;
  }
  w->calls = 0;
}

void weights_free(weights *w) {
  weights_clear(w);
  free(w->w);
  free(w->name);
  free(w->data);
  free(w->nbytes);
  free(w->dtype);
}

void weights_alloc(weights *w, meshlm_dtype d) {
  weights_clear(w);
  for (int64_t i = 0; i < w->n; i++) {
    w->nbytes[i] = (size_t)numel(&w->w[i]) * (d == MESHLM_DTYPE_BF16 ? 2 : 4);
    w->data[i] = xcalloc(w->nbytes[i], 1);
    w->dtype[i] = d;
  }
}

int keep_tensor(void *ctx, const char *name, meshlm_dtype dtype, int ndim, const int64_t *shape,
                const void *data, size_t nbytes) {
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
    fprintf(stderr, "%s: cannot create a temporary directory\n", g_prog);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
}

void tmp_path(char *out, size_t cap, const char *leaf) {
  snprintf(out, cap, "%s/%s", g_tmp, leaf);
}

/* ======================================================================= */
/* The start and the end of a program                                      */
/* ======================================================================= */

void api_init(int *argc, char ***argv) {
  MPI_Init(argc, argv);
  if (*argc > 0 && (*argv)[0]) {
    const char *slash = strrchr((*argv)[0], '/');
    snprintf(g_prog, sizeof g_prog, "%s", slash ? slash + 1 : (*argv)[0]);
  }
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_world);
  snprintf(g_fixture, sizeof g_fixture, "%s/tests/fixtures/llama_untied", ML_SOURCE_DIR);
  read_config();
  make_tmp();
}

int api_finish(int failed) {
  MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (g_rank == 0) nftw(g_tmp, rm_one, 16, FTW_DEPTH | FTW_PHYS);
  /* MPI was initialised here, not by the library: meshlm_finalize leaves it to us */
  int fin = meshlm_finalize();
  int up = 0;
  MPI_Finalized(&up);
  if (fin != 0 || up) {
    fprintf(stderr, "%s: meshlm_finalize finalised MPI it did not initialise\n", g_prog);
    failed = 1;
  }
  MPI_Finalize();
  return failed ? 1 : 0;
}

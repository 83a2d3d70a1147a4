#include "parallel/loss.h"

#include "common/checked.h"
#include "common/status.h"
#include "tensor/placement.h"

/* floats of logits per tile by default (64 MiB); where the vocabulary is
 * tiled, token blocks of at least BLOCK_MIN tokens (lm_head's weight
 * gradient one GEMM over K = the block per tile) and tiles of a multiple of
 * COLS_MIN columns (aligned rows) */
enum { TILE_FLOATS = 1 << 24, BLOCK_MIN = 4096, COLS_MIN = 16 };

typedef struct chunk_bufs {
  float *logits; /* [nt, cols] one tile of logits, then of their gradient */
  float *mx;     /* [nt] the max over the vocabulary (after the MAX reduction) */
  float *mxl;    /* [nt] this rank's running max over its tiles (tiled only) */
  float *se_tl;  /* [3 nt]: sum of exp, then target logit − max, then (entropy only) sl =
                    Σ exp(l − max)·(l − max) — one SUM reduction of the first 2 or all 3 */
  float *w;      /* [nt] gradient weights */
  float *lp;     /* [nt] log-probs of every target of the chunk (objective only) */
  float *H;      /* [nt] the entropies of every token of the chunk (entropy bonus only) */
  float *ew;     /* [nt] their bonus weights c·w_t (entropy bonus only) */
  float *host;   /* [2 nt] host staging of lp and w (objective only); [4 nt] with the entropy
                    bonus: then H and ew */
  double *sums;  /* [4] device: this rank's tokens' −Σ log-prob and target count, then the
                    other tokens' (discarded); read once when the pass ends */
  /* Tiled with bf16 rows, the operands the tile GEMMs read rounded once (exact: rounded in
     fp32 storage, where the backend reads such operands in place, ml_be_gemm_exact_in_place;
     else into bf16 copies): */
  void *xr;      /* [nt, c] bf16 or fp32: the block's lm_head input rounded once */
  void *dlr;     /* [nt, cols] bf16: a tile's logits gradient rounded once (backward; NULL
                    when exact: rounded in place in logits) */
  bool exact;
  int64_t cols;  /* columns per tile; >= nv: whole rows through lm_head's own forward */
  bool bf16;     /* round the logits to bf16 (output_dtype) */
  float *tv;     /* [nt, k] top-k: the running lists' logits (then their log-probs) */
  int32_t *ti;   /* [nt, k] and global ids */
  float *gv;     /* [P nt, k] the lists all-gathered over tp or the group (P its size) */
  int32_t *gi;   /* [P nt, k] */
  float *rows;   /* batch-invariant mode under tp (gather_rows): [nt, V] whole rows, then the
                    all-gather's [nt, wmax] send and [tp, nt, wmax] receive; else NULL */
} chunk_bufs;

/* One pass of the loss: the N tokens it runs over, of which [own0, own0 +
 * T) are this rank's, and this rank's vocab columns. Without a group N = T
 * and lm_head runs on m->head_in with its edges; with one, on the gathered
 * input h and lm_head's rows. Tiles read x and lm_head's rows w directly. */
typedef struct loss_pass {
  ml_model *m;
  const ml_loss_split *split;
  const int32_t *y; /* [N] targets */
  const float *h;   /* [N, c] lm_head's input (group only) */
  float *dh;        /* [N, c] its gradient (group and backward only) */
  const float *x;   /* [N, c] lm_head's input: h, or m->head_in's rows */
  float *dx;        /* [N, c] its gradient: dh, or m->dxn_final */
  ml_rows w;        /* lm_head's rows: the group's, or its local view */
  int64_t N, own0, T, c;
  int64_t v0, nv;   /* global vocab columns v0 .. v0+nv−1 */
  const ml_loss_extra *ex; /* NULL: neither entropy nor top-k */
  double coef;             /* the objective's entropy_coef (0: no entropy bonus) */
} loss_pass;

/* sum (or max) of n floats over the groups holding the other columns: tp,
 * then the group */
static int reduce_columns(const loss_pass *p, float *x, size_t n, ml_redop op) {
  const ml_loss_split *s = p->split;
  if (s->tp && s->tp->size > 1) ML_TRY(ml_all_reduce(s->tp, x, n, ML_ELEM_F32, op));
  if (s->group) ML_TRY(ml_all_reduce(s->group->comm, x, n, ML_ELEM_F32, op));
  return 0;
}

static bool want_entropy(const loss_pass *p) {
  return (p->ex && p->ex->entropy) || p->coef != 0.0;
}
static int64_t topk_of(const loss_pass *p) { return p->ex ? p->ex->topk : 0; }

/* The statistics' SUM reduction: se, tl and, for the entropy, sl. */
static int reduce_sums(const loss_pass *p, int64_t nt, chunk_bufs *b) {
  return reduce_columns(p, b->se_tl, (size_t)((want_entropy(p) ? 3 : 2) * nt), ML_RED_SUM);
}

/* The widest tp block of the vocabulary (torch.chunk: the first). */
static int64_t rows_width(const loss_pass *p) {
  int64_t v0, n;
  ml_chunk(p->m->cfg.vocab, p->split->tp->size, 0, &v0, &n);
  return n;
}

/* Batch-invariant mode under tp: b->rows [nt, V] ← every tp rank's logits
 * columns b->logits [nt, nv] (torch.chunk blocks of the vocabulary, each
 * padded to the widest for one all-gather), so that each row's statistics
 * are one rank's (tp's split sum of exp is what made tp 2 differ from one
 * rank). */
static int gather_rows(const loss_pass *p, int64_t nt, chunk_bufs *b) {
  ml_backend *be = p->m->be;
  ml_comm *tp = p->split->tp;
  int64_t V = p->m->cfg.vocab, wmax = rows_width(p), v0, n;
  ml_chunk(V, tp->size, tp->rank, &v0, &n);
  if (v0 != p->v0 || n != p->nv)
    return ml_err("lm_head: this tp rank holds vocab columns [%lld, %lld); the batch-invariant "
                  "mode expected torch.chunk's [%lld, %lld)",
                  (long long)p->v0, (long long)(p->v0 + p->nv), (long long)v0,
                  (long long)(v0 + n));
  float *send = b->rows + nt * V, *recv = send + nt * wmax;
  size_t f = sizeof(float);
  // send: [nt, wmax] ← logits [nt, nv] → recv: [tp, nt, wmax] → rows: [nt, V]
  if (p->nv > 0)
    ML_TRY(ml_be_copy2d(be, send, f * (size_t)wmax, b->logits, f * (size_t)p->nv,
                        f * (size_t)p->nv, (size_t)nt));
  ML_TRY(ml_all_gather(tp, send, recv, (size_t)(nt * wmax)));
  for (int q = 0; q < tp->size; q++) {
    ml_chunk(V, tp->size, q, &v0, &n);
    if (n > 0)
      ML_TRY(ml_be_copy2d(be, b->rows + v0, f * (size_t)V, recv + q * nt * wmax,
                          f * (size_t)wmax, f * (size_t)n, (size_t)nt));
  }
  return 0;
}

/* mx, se, tl of tokens t0 .. t0+nt−1, reduced over the vocab split (in the
 * batch-invariant mode under tp: computed on the gathered whole rows, as
 * one rank computes them, and not reduced). */
static int chunk_stats(const loss_pass *p, int64_t t0, int64_t nt, chunk_bufs *b) {
  ml_model *m = p->m;
  if (p->split->group)  // logits: [nt, nv] = h[t0 : t0+nt] · W_rows^T
    ML_TRY(ml_head_logits(m, p->h + t0 * p->c, nt, &p->split->rows, b->logits));
  else  // logits: [nt, nv] (lm_head's local view and edges)
    ML_TRY(ml_head_forward(m, t0, nt, b->logits));
  if (b->bf16) ML_TRY(ml_be_round_bf16(m->be, b->logits, (size_t)(nt * p->nv)));
  if (b->rows) ML_TRY(gather_rows(p, nt, b));
  // the statistics' rows: l [nt, nc] from global column c0
  const float *l = b->rows ? b->rows : b->logits;
  int64_t nc = b->rows ? m->cfg.vocab : p->nv, c0 = b->rows ? 0 : p->v0;
  ML_TRY(ml_be_xent_rowmax(m->be, l, nt, nc, b->mx));
  if (!b->rows) ML_TRY(reduce_columns(p, b->mx, (size_t)nt, ML_RED_MAX));
  ML_TRY(ml_be_xent_sumexp_target(m->be, l, nt, nc, c0, p->y + t0, b->mx, b->se_tl,
                                  b->se_tl + nt));
  if (want_entropy(p))
    ML_TRY(ml_be_xent_entropy_sum(m->be, l, nt, nc, b->mx, b->se_tl + 2 * nt));
  if (topk_of(p)) { /* this rank's columns: the lists are merged over tp (chunk_extras) */
    ML_TRY(ml_be_xent_topk_clear(m->be, nt, topk_of(p), b->tv, b->ti));
    ML_TRY(ml_be_xent_topk_online(m->be, b->logits, nt, p->nv, p->v0, topk_of(p), b->tv, b->ti));
  }
  return b->rows ? 0 : reduce_sums(p, nt, b);
}

/* The block's lm_head input for the tiles: x rows t0 .. t0+nt−1, rounded
 * to bf16 once for every tile's GEMMs when lm_head's rows are bf16 (into
 * bf16, or, exact, into fp32 storage by ml_be_round_bf16_to). */
static int block_input(const loss_pass *p, int64_t t0, int64_t nt, chunk_bufs *b,
                       ml_tile_in *x) {
  const float *in = p->x + t0 * p->c;
  size_t n = (size_t)(nt * p->c);
  *x = (ml_tile_in){in, ML_F32, false};
  if (!b->xr) return 0;
  if (b->exact) {
    ML_TRY(ml_be_round_bf16_to(p->m->be, in, b->xr, NULL, n));
    *x = (ml_tile_in){b->xr, ML_F32, true};
    return 0;
  }
  ML_TRY(ml_be_convert(p->m->be, b->xr, ML_BF16, in, ML_F32, n));
  *x = (ml_tile_in){b->xr, ML_BF16, false};
  return 0;
}

// logits: [nt, n] = x · W[r0 : r0+n]^T (rounded to output_dtype)
static int tile_logits(const loss_pass *p, ml_tile_in x, int64_t nt, int64_t r0, int64_t n,
                       chunk_bufs *b) {
  ML_TRY(ml_head_tile_logits(p->m, &p->w, x, nt, r0, n, b->logits));
  return b->bf16 ? ml_be_round_bf16(p->m->be, b->logits, (size_t)(nt * n)) : 0;
}

/* mx, se, tl of tokens t0 .. t0+nt−1 from this rank's columns in tiles (nv >= 1 here): the
 * online log-sum-exp over the tiles, its max reduced over the vocab split,
 * the sums moved onto that max, then reduced. */
static int tiled_stats(const loss_pass *p, ml_tile_in x, int64_t t0, int64_t nt,
                       chunk_bufs *b) {
  ml_backend *be = p->m->be;
  float *se = b->se_tl, *tl = b->se_tl + nt;
  float *sl = want_entropy(p) ? b->se_tl + 2 * nt : NULL;
  int64_t k = topk_of(p);
  ML_TRY(ml_be_zero(be, b->se_tl, sizeof(float) * (size_t)((sl ? 3 : 2) * nt)));
  if (k) ML_TRY(ml_be_xent_topk_clear(be, nt, k, b->tv, b->ti));
  for (int64_t r0 = 0; r0 < p->nv; r0 += b->cols) {
    int64_t n = p->nv - r0 < b->cols ? p->nv - r0 : b->cols;
    ML_TRY(tile_logits(p, x, nt, r0, n, b));
    /* before xent_online: it reads the running mx, se this tile updates */
    if (sl) ML_TRY(ml_be_xent_entropy_online(be, b->logits, nt, n, b->mxl, se, sl));
    if (k) ML_TRY(ml_be_xent_topk_online(be, b->logits, nt, n, p->v0 + r0, k, b->tv, b->ti));
    ML_TRY(ml_be_xent_online(be, b->logits, nt, n, p->v0 + r0, p->y + t0, b->mxl, se, tl));
  }
  ML_TRY(ml_be_copy(be, b->mx, b->mxl, sizeof(float) * (size_t)nt, ML_COPY_D2D));
  ML_TRY(reduce_columns(p, b->mx, (size_t)nt, ML_RED_MAX));
  if (sl) ML_TRY(ml_be_xent_entropy_rebase(be, nt, b->mxl, b->mx, se, sl)); /* se not yet moved */
  ML_TRY(ml_be_xent_rebase(be, nt, p->nv, p->v0, p->y + t0, b->mxl, b->mx, se, tl));
  return reduce_sums(p, nt, b);
}

/* The top-k lists of tokens t0 .. t0+nt−1 merged over the group c (its
 * size P): every rank's [nt, k] all-gathered ([P, nt, k]; the ids moved as
 * 32-bit words) and the top-k of them kept, the same on every rank. */
static int merge_topk(const loss_pass *p, ml_comm *c, int64_t nt, chunk_bufs *b) {
  if (!c || c->size == 1) return 0;
  ml_backend *be = p->m->be;
  int64_t k = topk_of(p);
  size_t n = (size_t)(nt * k);
  ML_TRY(ml_all_gather(c, b->tv, b->gv, n));
  ML_TRY(ml_all_gather(c, (const float *)b->ti, (float *)b->gi, n));
  return ml_be_xent_topk_merge(be, c->size, nt, k, b->gv, b->gi, b->tv, b->ti);
}

/* The entropy and top-k of this rank's own tokens [a, z) among t0 ..
 * t0+nt−1, from the reduced statistics: the lists merged over tp, then the
 * group, their log-probs val − log-sum-exp. */
static int chunk_extras(const loss_pass *p, int64_t t0, int64_t nt, int64_t a, int64_t z,
                        chunk_bufs *b) {
  ml_backend *be = p->m->be;
  const ml_loss_extra *ex = p->ex;
  if (ex->entropy && z > a)
    ML_TRY(ml_be_xent_entropy(be, b->se_tl + (a - t0), b->se_tl + 2 * nt + (a - t0), z - a,
                              ex->entropy + (a - p->own0)));
  int64_t k = topk_of(p);
  if (!k) return 0;
  ML_TRY(merge_topk(p, p->split->tp, nt, b));
  ML_TRY(merge_topk(p, p->split->group ? p->split->group->comm : NULL, nt, b));
  ML_TRY(ml_be_xent_topk_logprobs(be, nt, k, b->mx, b->se_tl, b->tv, b->ti, b->tv));
  if (z == a) return 0;
  size_t own = sizeof(float) * (size_t)((z - a) * k);
  ML_TRY(ml_be_copy(be, ex->topk_logprobs + (a - p->own0) * k, b->tv + (a - t0) * k, own,
                    ML_COPY_D2D));
  return ml_be_copy(be, ex->topk_ids + (a - p->own0) * k, b->ti + (a - t0) * k, own,
                    ML_COPY_D2D);
}

/* dlogits [nt, n] (=, over the logits) of tokens t0 .. t0+nt−1 on columns
 * v0 .. v0+n−1: the objective's (softmax − onehot) weights, plus the
 * entropy bonus's term when there is one. */
static int logits_grad(const loss_pass *p, int64_t t0, int64_t nt, int64_t v0, int64_t n,
                       chunk_bufs *b) {
  if (p->coef != 0.0)
    return ml_be_xent_bwd_entropy(p->m->be, b->logits, nt, n, v0, p->y + t0, b->mx, b->se_tl,
                                  b->w, b->H, b->ew, b->logits);
  return ml_be_xent_bwd(p->m->be, b->logits, nt, n, v0, p->y + t0, b->mx, b->se_tl, b->w,
                        b->logits);
}

/* The backward of tokens t0 .. t0+nt−1 tile by tile (nv >= 1 here), last
 * tile first: its logits are still in the buffer from tiled_stats, every
 * other tile's are computed again; then their gradient, dx[t0 : t0+nt] (=
 * on the first tile done, += after) and the tile's rows of lm_head's
 * weight gradient (+=, one GEMM over the block's nt tokens). */
static int tiled_backward(const loss_pass *p, ml_tile_in x, int64_t t0, int64_t nt,
                          chunk_bufs *b) {
  ml_backend *be = p->m->be;
  float *dx = p->dx + t0 * p->c;
  int64_t last = (p->nv - 1) / b->cols * b->cols;
  for (int64_t r0 = last; r0 >= 0; r0 -= b->cols) {
    int64_t n = p->nv - r0 < b->cols ? p->nv - r0 : b->cols;
    if (r0 != last) ML_TRY(tile_logits(p, x, nt, r0, n, b));
    // dlogits: [nt, n] = w·(softmax − onehot) (+ the entropy bonus's) on the tile's columns
    ML_TRY(logits_grad(p, t0, nt, p->v0 + r0, n, b));
    ml_tile_in dl = {b->logits, ML_F32, false};
    if (b->exact) { /* rounded here, in place, for both GEMMs (exact: read as they are) */
      ML_TRY(ml_be_round_bf16(be, b->logits, (size_t)(nt * n)));
      dl.exact = true;
    } else if (b->dlr) {
      ML_TRY(ml_be_convert(be, b->dlr, ML_BF16, b->logits, ML_F32, (size_t)(nt * n)));
      dl = (ml_tile_in){b->dlr, ML_BF16, false};
    }
    ML_TRY(ml_head_tile_backward(p->m, &p->w, x, nt, r0, n, dl, dx, r0 != last));
  }
  return 0;
}

/* [*a, *z): this rank's own tokens among t0 .. t0+nt−1 (empty: a = z). */
static void own_range(const loss_pass *p, int64_t t0, int64_t nt, int64_t *a, int64_t *z) {
  int64_t end = t0 + nt;
  *a = p->own0 > t0 ? p->own0 : t0;
  *a = *a < end ? *a : end;
  *z = p->own0 + p->T;
  *z = *z > *a ? (*z < end ? *z : end) : *a;
}

/* Log-probs and gradient weights of tokens t0 .. t0+nt−1: the loss and
 * log-probs of this rank's own tokens only (their sums over the data ranks
 * are the caller's), the weights of all. */
static int chunk_logprobs(const loss_pass *p, int64_t t0, int64_t nt, const ml_loss_grad *g,
                          float *logprobs, chunk_bufs *b) {
  int64_t a, z, end = t0 + nt;
  own_range(p, t0, nt, &a, &z);
  int64_t cut[4] = {t0, a, z, end}; /* before, own, after */
  bool obj = g && g->obj;
  /* under an objective the NLL weights are validity flags (scale 1) and every lp is kept */
  float scale = obj ? 1.0f : g ? g->scale : 0.0f;
  for (int k = 0; k < 3; k++) {
    int64_t s = cut[k], n = cut[k + 1] - s;
    if (n == 0) continue;
    float *lp = obj ? b->lp + (s - t0) : k == 1 && logprobs ? logprobs + (s - p->own0) : NULL;
    ML_TRY(ml_be_xent_logprobs(p->m->be, b->se_tl + (s - t0), b->se_tl + nt + (s - t0),
                               p->y + s, n, scale, lp, b->w + (s - t0),
                               b->sums + (k == 1 ? 0 : 2)));
  }
  if (!obj) return 0;
  ml_backend *be = p->m->be;
  if (logprobs && z > a)
    ML_TRY(ml_be_copy(be, logprobs + (a - p->own0), b->lp + (a - t0),
                      sizeof(float) * (size_t)(z - a), ML_COPY_D2D));
  float *hlp = b->host, *hw = b->host + nt;
  ML_TRY(ml_be_copy(be, hlp, b->lp, sizeof(float) * (size_t)nt, ML_COPY_D2H));
  ML_TRY(ml_be_copy(be, hw, b->w, sizeof(float) * (size_t)nt, ML_COPY_D2H));
  ML_TRY(ml_objective_chunk(g->obj, nt, hlp, g->in + t0, a - t0, z - t0, hw, g->sums));
  ML_TRY(ml_be_copy(be, b->w, hw, sizeof(float) * (size_t)nt, ML_COPY_H2D));
  /* an objective of own targets only: each weight from its owner in the group */
  if (p->split->group && ml_objective_own_only(g->obj))
    ML_TRY(ml_all_reduce(p->split->group->comm, b->w, (size_t)nt, ML_ELEM_F32, ML_RED_SUM));
  return 0;
}

/* The entropy bonus of tokens t0 .. t0+nt−1 (own: [a, z)) after the
 * objective's weights b->w: H of every token, its bonus weight ew = c·w_t
 * where the target is trained (in[t].w ≠ 0; else 0), and the own tokens'
 * −c·w·H added to the loss sum and w·H to the entropy sum. */
static int entropy_bonus(const loss_pass *p, int64_t t0, int64_t nt, int64_t a, int64_t z,
                         const ml_loss_grad *g, chunk_bufs *b) {
  ml_backend *be = p->m->be;
  float *hH = b->host + 2 * nt, *hew = b->host + 3 * nt;
  ML_TRY(ml_be_xent_entropy(be, b->se_tl, b->se_tl + 2 * nt, nt, b->H));
  ML_TRY(ml_be_copy(be, hH, b->H, sizeof(float) * (size_t)nt, ML_COPY_D2H));
  for (int64_t i = 0; i < nt; i++) {
    int64_t t = t0 + i;
    double w = p->y[t] >= 0 ? g->in[t].w : 0.0; /* an ignored target's inputs are not read */
    hew[i] = (float)(p->coef * w);
    if (t < a || t >= z || w == 0.0) continue;
    g->sums->loss -= p->coef * w * hH[i];
    g->sums->entropy += w * hH[i];
  }
  return ml_be_copy(be, b->ew, hew, sizeof(float) * (size_t)nt, ML_COPY_H2D);
}

/* Whole rows (b->cols >= nv): per block lm_head's own forward (and edges)
 * into [nt, nv] logits, the statistics, their gradient in place and
 * lm_head's backward. Tiled: the statistics over the tiles, then the
 * backward tile by tile (tiled_stats, tiled_backward). */
static int run_chunks(const loss_pass *p, const ml_loss_grad *g, float *logprobs, chunk_bufs *b,
                      int64_t block) {
  bool tiled = b->cols < p->nv;
  for (int64_t t0 = 0; t0 < p->N; t0 += block) {
    int64_t nt = p->N - t0 < block ? p->N - t0 : block;
    ml_tile_in x = {NULL, ML_F32, false};
    if (tiled) {
      ML_TRY(block_input(p, t0, nt, b, &x));
      ML_TRY(tiled_stats(p, x, t0, nt, b));
    } else {
      ML_TRY(chunk_stats(p, t0, nt, b));
    }
    ML_TRY(chunk_logprobs(p, t0, nt, g, logprobs, b));
    int64_t a, z;
    own_range(p, t0, nt, &a, &z);
    if (p->ex) ML_TRY(chunk_extras(p, t0, nt, a, z, b));
    if (g && p->coef != 0.0) ML_TRY(entropy_bonus(p, t0, nt, a, z, g, b));
    if (!g) continue;
    if (tiled) {
      ML_TRY(tiled_backward(p, x, t0, nt, b));
      continue;
    }
    ML_TRY(logits_grad(p, t0, nt, p->v0, p->nv, b));
    if (p->split->group)  // dh[t0 : t0+nt] (=) dlogits · W_rows; W_rows grad += dlogits^T · h
      ML_TRY(ml_head_logits_backward(p->m, p->h + t0 * p->c, nt, &p->split->rows, b->logits,
                                     p->dh + t0 * p->c));
    else  // dxn_final[t0 : t0+nt] (=)
      ML_TRY(ml_head_backward(p->m, t0, nt, b->logits));
  }
  return 0;
}

ml_loss_tiles ml_loss_tiling(int64_t N, int64_t V, int parts, bool tileable, int64_t budget) {
  budget = budget > 0 ? budget : TILE_FLOATS;
  int64_t widest = (V + parts - 1) / parts; /* torch.chunk: the first shard is the largest */
  widest = widest > 0 ? widest : 1;
  int64_t block = budget / widest; /* tokens whose whole rows fit */
  block = block < 1 ? 1 : block;
  if (tileable && block < N) {
    int64_t lo = budget / COLS_MIN < BLOCK_MIN ? budget / COLS_MIN : BLOCK_MIN;
    block = block < lo ? lo : block;
  }
  block = block > N ? N : block;
  int64_t cols = widest;
  if (tileable && block > 0 && budget / block < widest) {
    cols = budget / block;
    cols = cols > COLS_MIN ? cols - cols % COLS_MIN : cols < 1 ? 1 : cols;
  }
  return (ml_loss_tiles){block, cols};
}

/* The top-k lists of a block of `chunk` tokens and their all-gathers over
 * the larger of tp and the group. */
static int topk_alloc(const loss_pass *p, int64_t chunk, chunk_bufs *b) {
  ml_backend *be = p->m->be;
  const ml_loss_split *s = p->split;
  int64_t k = topk_of(p), P = s->tp ? s->tp->size : 1;
  if (s->group && s->group->comm->size > P) P = s->group->comm->size;
  int64_t n = ml_mul_sat(chunk, k), gn = ml_mul_sat(n, P);
  b->tv = ml_be_alloc(be, n, sizeof(float), "the top-k lists (%lld tokens x k %lld)",
                      (long long)chunk, (long long)k);
  b->ti = ml_be_alloc(be, n, sizeof(int32_t), "the top-k ids (%lld tokens x k %lld)",
                      (long long)chunk, (long long)k);
  b->gv = P > 1 ? ml_be_alloc(be, gn, sizeof(float), "the gathered top-k lists (%lld ranks)",
                              (long long)P)
                : NULL;
  b->gi = P > 1 ? ml_be_alloc(be, gn, sizeof(int32_t), "the gathered top-k ids (%lld ranks)",
                              (long long)P)
                : NULL;
  return b->tv && b->ti && (P == 1 || (b->gv && b->gi)) ? 0 : -1;
}

/* The chunk buffers, then the chunks. */
static int run_pass(loss_pass *p, ml_dtype logits_dtype, const ml_loss_grad *g,
                    float *logprobs, ml_loss_out *out) {
  ml_model *m = p->m;
  const ml_loss_split *s = p->split;
  int parts = (s->tp ? s->tp->size : 1) * (s->group ? s->group->comm->size : 1);
  ml_loss_tiles tiles = ml_loss_tiling(p->N, m->cfg.vocab, parts,
                                       !m->lm_head.out.fwd.fn && !s->batch_invariant,
                                       s->tile_floats);
  int64_t chunk = tiles.block, cols = tiles.cols < p->nv ? tiles.cols : p->nv;
  bool tiled = cols < p->nv;
  if (tiled && p->c != p->w.cols)
    return ml_err("lm_head: its input has %lld features but this rank's rows expect %lld; the "
                  "plan's layouts do not compose here",
                  (long long)p->c, (long long)p->w.cols);
  /* chunk · cols <= max(budget, vocab_size) (ml_loss_tiling): a plain count */
  float *mem = ml_be_alloc(m->be, chunk * (cols + 9), sizeof(float),
                           "the logits tile (%lld tokens x %lld vocab columns of vocab_size "
                           "%lld)",
                           (long long)chunk, (long long)cols, (long long)m->cfg.vocab);
  if (!mem) return -1;
  chunk_bufs b = {.logits = mem, .mx = mem + chunk * cols, .mxl = mem + chunk * (cols + 1),
                  .se_tl = mem + chunk * (cols + 2), .w = mem + chunk * (cols + 5),
                  .lp = mem + chunk * (cols + 6), .H = mem + chunk * (cols + 7),
                  .ew = mem + chunk * (cols + 8), .cols = tiled ? cols : p->nv,
                  .bf16 = logits_dtype == ML_BF16};
  int rc = 0;
  bool bf16_rows = tiled && p->w.dtype == ML_BF16;
  b.exact = bf16_rows && ml_be_gemm_exact_in_place(m->be);
  if (bf16_rows && !(b.xr = ml_be_alloc(m->be, chunk * p->c,
                                        b.exact ? sizeof(float) : sizeof(uint16_t),
                                        "lm_head's input as bf16 (%lld tokens)",
                                        (long long)chunk)))
    rc = -1;
  if (!rc && bf16_rows && !b.exact && g &&
      !(b.dlr = ml_be_alloc(m->be, chunk * cols, sizeof(uint16_t),
                            "the logits tile's gradient as bf16 (%lld tokens x %lld columns)",
                            (long long)chunk, (long long)cols)))
    rc = -1;
  if (!rc && g && g->obj && !(b.host = ml_be_host_alloc(m->be, (p->coef != 0.0 ? 4 : 2) * chunk,
                                                        sizeof(float),
                                                        "the objective's staging (%lld tokens)",
                                                        (long long)chunk)))
    rc = -1;
  if (!rc && !(b.sums = ml_be_alloc(m->be, 4, sizeof(double), "the loss sums")))
    rc = -1;
  if (!rc && topk_of(p)) rc = topk_alloc(p, chunk, &b);
  /* whole rows, the send and the receive (gather_rows): chunk · (V + (tp + 1) · wmax) floats,
     saturating. Not under vocab parallelism over the group (the mode turns it off; the rows
     would skip its reduction) */
  if (!rc && s->batch_invariant && s->tp && s->tp->size > 1 && !s->group && !tiled) {
    int64_t wmax = rows_width(p);
    int64_t n = ml_mul_sat(chunk, ml_add_sat(m->cfg.vocab, ml_mul_sat(s->tp->size + 1, wmax)));
    if (!(b.rows = ml_be_alloc(m->be, n, sizeof(float),
                               "the whole rows of logits gathered over tp %d (%lld tokens x "
                               "vocab_size %lld)",
                               s->tp->size, (long long)chunk, (long long)m->cfg.vocab)))
      rc = -1;
  }
  if (!rc) rc = ml_be_zero(m->be, b.sums, 4 * sizeof(double));
  if (!rc) rc = run_chunks(p, g, logprobs, &b, chunk);
  double sums[4];
  if (!rc) rc = ml_be_copy(m->be, sums, b.sums, sizeof sums, ML_COPY_D2H);
  if (!rc) {
    out->loss_sum = sums[0];
    out->count = (int64_t)sums[1]; /* exact: a count below 2^53 */
  }
  ml_be_free(m->be, b.rows);
  ml_be_free(m->be, b.gi);
  ml_be_free(m->be, b.gv);
  ml_be_free(m->be, b.ti);
  ml_be_free(m->be, b.tv);
  ml_be_free(m->be, b.sums);
  ml_be_host_free(m->be, b.host);
  ml_be_free(m->be, b.dlr);
  ml_be_free(m->be, b.xr);
  ml_be_free(m->be, mem);
  return rc;
}

/* Vocab parallelism over the group: lm_head's input of every rank
 * gathered (and its gradient scattered back) around the chunks, in the
 * group's work buffer (ml_vocab_reserve). */
static int run_group(loss_pass *p, ml_dtype logits_dtype, const ml_loss_grad *grad,
                     float *logprobs, ml_loss_out *out) {
  ml_model *m = p->m;
  const ml_vocab *g = p->split->group;
  int64_t d = g->comm->size, T = p->T, c = m->head_in.c;
  ML_TRY(ml_vocab_check(g, m, c));
  p->h = g->work;
  p->dh = grad ? g->work + d * T * c : NULL;
  p->x = p->h;
  p->dx = p->dh;
  p->y = g->targets;
  p->N = d * T;
  p->own0 = g->comm->rank * T;
  p->c = c;
  // h: [d·T, c] = every rank's lm_head input [T, c]
  ML_TRY(ml_all_gather(g->comm, m->head_in.x, g->work, (size_t)(T * c)));
  ML_TRY(run_pass(p, logits_dtype, grad, logprobs, out));
  // dxn_final: [T, c] = sum over the group of its dh rows for this rank's tokens
  if (grad) ML_TRY(ml_reduce_scatter(g->comm, p->dh, m->dxn_final, (size_t)(T * c)));
  return 0;
}

int ml_vocab_parallel_loss(ml_model *m, const ml_loss_split *split, const int32_t *targets,
                           ml_dtype logits_dtype, const ml_loss_grad *grad, float *logprobs,
                           ml_loss_out *out) {
  return ml_vocab_parallel_scores(m, split, targets, logits_dtype, grad, logprobs, NULL, out);
}

int ml_vocab_parallel_scores(ml_model *m, const ml_loss_split *split, const int32_t *targets,
                             ml_dtype logits_dtype, const ml_loss_grad *grad, float *logprobs,
                             const ml_loss_extra *extra, ml_loss_out *out) {
  int64_t T = m->B * m->S;
  if (extra && extra->topk < 0)
    return ml_err("top-k: k is %lld; expected k >= 0", (long long)extra->topk);
  if (extra && extra->topk > m->cfg.vocab)
    return ml_err("top-k: k is %lld; expected at most vocab_size %lld", (long long)extra->topk,
                  (long long)m->cfg.vocab);
  loss_pass p = {.m = m, .split = split, .y = targets, .x = m->head_in.x, .dx = m->dxn_final,
                 .w = ml_param_rows(m->lm_head.weight), .N = T, .own0 = 0, .T = T,
                 .c = m->head_in.c, .ex = extra,
                 .coef = grad && grad->obj ? grad->obj->entropy_coef : 0.0};
  if (split->group) {
    p.w = split->rows;
    p.v0 = split->rows.row0;
    p.nv = split->rows.rows;
  } else if (split->tp) {
    ml_model_vocab_shard(m, &p.v0, &p.nv);
  } else { /* whole rows */
    p.v0 = 0;
    p.nv = m->cfg.vocab;
  }
  out->loss_sum = 0.0;
  out->count = 0;
  if (split->group) return run_group(&p, logits_dtype, grad, logprobs, out);
  return run_pass(&p, logits_dtype, grad, logprobs, out);
}

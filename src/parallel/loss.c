#include "parallel/loss.h"

#include "common/checked.h"
#include "common/status.h"

/* floats of logits per chunk (64 MiB): for a 49k vocabulary, chunks of
 * ~340 tokens, where lm_head's GEMMs (M = the chunk's tokens) run near the
 * speed of the layers' ones; half that costs a sixth more time in them */
enum { LOGITS_BUDGET = 1 << 24 };

typedef struct chunk_bufs {
  float *logits; /* [nt, nv] */
  float *mx;     /* [nt] */
  float *se_tl;  /* [2 nt]: sum of exp, then target logit − max */
  float *w;      /* [nt] gradient weights */
  float *lp;     /* [nt] log-probs of every target of the chunk (objective only) */
  float *host;   /* [2 nt] host staging of lp and w (objective only) */
  bool bf16;     /* round the logits to bf16 (output_dtype) */
} chunk_bufs;

/* One pass of the loss: the N tokens it runs over, of which [own0, own0 +
 * T) are this rank's, and this rank's vocab columns. Without a group N = T
 * and lm_head runs on m->head_in with its edges; with one, on the gathered
 * input h and lm_head's rows. */
typedef struct loss_pass {
  ml_model *m;
  const ml_loss_split *split;
  const int32_t *y; /* [N] targets */
  const float *h;   /* [N, c] lm_head's input (group only) */
  float *dh;        /* [N, c] its gradient (group and backward only) */
  int64_t N, own0, T, c;
  int64_t v0, nv;   /* global vocab columns v0 .. v0+nv−1 */
} loss_pass;

/* sum (or max) of n floats over the groups holding the other columns: tp,
 * then the group */
static int reduce_columns(const loss_pass *p, float *x, size_t n, ml_redop op) {
  const ml_loss_split *s = p->split;
  if (s->tp && s->tp->size > 1) ML_TRY(ml_all_reduce(s->tp, x, n, ML_ELEM_F32, op));
  if (s->group) ML_TRY(ml_all_reduce(s->group->comm, x, n, ML_ELEM_F32, op));
  return 0;
}

/* mx, se, tl of tokens t0 .. t0+nt−1, reduced over the vocab split. */
static int chunk_stats(const loss_pass *p, int64_t t0, int64_t nt, chunk_bufs *b) {
  ml_model *m = p->m;
  if (p->split->group)  // logits: [nt, nv] = h[t0 : t0+nt] · W_rows^T
    ML_TRY(ml_head_logits(m, p->h + t0 * p->c, nt, &p->split->rows, b->logits));
  else  // logits: [nt, nv] (lm_head's local view and edges)
    ML_TRY(ml_head_forward(m, t0, nt, b->logits));
  if (b->bf16) ML_TRY(ml_be_round_bf16(m->be, b->logits, (size_t)(nt * p->nv)));
  ML_TRY(ml_be_xent_rowmax(m->be, b->logits, nt, p->nv, b->mx));
  ML_TRY(reduce_columns(p, b->mx, (size_t)nt, ML_RED_MAX));
  ML_TRY(ml_be_xent_sumexp_target(m->be, b->logits, nt, p->nv, p->v0, p->y + t0, b->mx,
                                  b->se_tl, b->se_tl + nt));
  return reduce_columns(p, b->se_tl, (size_t)(2 * nt), ML_RED_SUM);
}

/* Log-probs and gradient weights of tokens t0 .. t0+nt−1: the loss and
 * log-probs of this rank's own tokens only (their sums over the data ranks
 * are the caller's), the weights of all. */
static int chunk_logprobs(const loss_pass *p, int64_t t0, int64_t nt, const ml_loss_grad *g,
                          float *logprobs, ml_loss_out *out, chunk_bufs *b) {
  int64_t end = t0 + nt, a = p->own0 > t0 ? p->own0 : t0, z = p->own0 + p->T;
  a = a < end ? a : end;
  z = z > a ? (z < end ? z : end) : a;
  int64_t cut[4] = {t0, a, z, end}; /* before, own, after */
  bool obj = g && g->obj;
  /* under an objective the NLL weights are validity flags (scale 1) and every lp is kept */
  float scale = obj ? 1.0f : g ? g->scale : 0.0f;
  for (int k = 0; k < 3; k++) {
    int64_t s = cut[k], n = cut[k + 1] - s;
    if (n == 0) continue;
    ml_loss_out other = {0};
    ml_loss_out *o = k == 1 ? out : &other;
    float *lp = obj ? b->lp + (s - t0) : k == 1 && logprobs ? logprobs + (s - p->own0) : NULL;
    ML_TRY(ml_be_xent_logprobs(p->m->be, b->se_tl + (s - t0), b->se_tl + nt + (s - t0),
                               p->y + s, n, scale, lp, b->w + (s - t0), &o->loss_sum,
                               &o->count));
  }
  if (!obj) return 0;
  ml_backend *be = p->m->be;
  if (logprobs && z > a)
    ML_TRY(ml_be_copy(be, logprobs + (a - p->own0), b->lp + (a - t0),
                      sizeof(float) * (size_t)(z - a), ML_COPY_D2D));
  float *hlp = b->host, *hw = b->host + nt;
  ML_TRY(ml_be_copy(be, hlp, b->lp, sizeof(float) * (size_t)nt, ML_COPY_D2H));
  ML_TRY(ml_be_copy(be, hw, b->w, sizeof(float) * (size_t)nt, ML_COPY_D2H));
  ml_obj_sums others = {0};
  for (int64_t i = 0; i < nt; i++) {
    int64_t t = t0 + i;
    ml_obj_sums *acc = t >= a && t < z ? g->sums : &others;
    hw[i] = hw[i] != 0.0f ? ml_objective_token(g->obj, &g->in[t], hlp[i], acc) : 0.0f;
  }
  return ml_be_copy(be, b->w, hw, sizeof(float) * (size_t)nt, ML_COPY_H2D);
}

static int run_chunks(const loss_pass *p, const ml_loss_grad *g, float *logprobs,
                      ml_loss_out *out, chunk_bufs *b, int64_t chunk) {
  for (int64_t t0 = 0; t0 < p->N; t0 += chunk) {
    int64_t nt = p->N - t0 < chunk ? p->N - t0 : chunk;
    ML_TRY(chunk_stats(p, t0, nt, b));
    ML_TRY(chunk_logprobs(p, t0, nt, g, logprobs, out, b));
    if (!g) continue;
    ML_TRY(ml_be_xent_bwd(p->m->be, b->logits, nt, p->nv, p->v0, p->y + t0, b->mx, b->se_tl,
                          b->w, b->logits));
    if (p->split->group)  // dh[t0 : t0+nt] (=) dlogits · W_rows; W_rows grad += dlogits^T · h
      ML_TRY(ml_head_logits_backward(p->m, p->h + t0 * p->c, nt, &p->split->rows, b->logits,
                                     p->dh + t0 * p->c));
    else  // dxn_final[t0 : t0+nt] (=)
      ML_TRY(ml_head_backward(p->m, t0, nt, b->logits));
  }
  return 0;
}

int64_t ml_loss_chunk_tokens(int64_t T, int64_t V, int parts) {
  int64_t widest = (V + parts - 1) / parts; /* torch.chunk: the first shard is the largest */
  int64_t chunk = LOGITS_BUDGET / (widest > 0 ? widest : 1);
  chunk = chunk < 1 ? 1 : chunk;
  return chunk > T ? T : chunk;
}

/* The chunk buffers, then the chunks. */
static int run_pass(loss_pass *p, ml_dtype logits_dtype, const ml_loss_grad *g,
                    float *logprobs, ml_loss_out *out) {
  ml_model *m = p->m;
  const ml_loss_split *s = p->split;
  int parts = (s->tp ? s->tp->size : 1) * (s->group ? s->group->comm->size : 1);
  int64_t chunk = ml_loss_chunk_tokens(p->N, m->cfg.vocab, parts);
  /* chunk · nv <= max(LOGITS_BUDGET, vocab_size) (ml_loss_chunk_tokens): a plain count */
  float *mem = ml_be_alloc(m->be, chunk * (p->nv + 5), sizeof(float),
                           "the logits chunk (%lld tokens x %lld vocab columns of vocab_size "
                           "%lld)",
                           (long long)chunk, (long long)p->nv, (long long)m->cfg.vocab);
  if (!mem) return -1;
  chunk_bufs b = {mem, mem + chunk * p->nv, mem + chunk * (p->nv + 1),
                  mem + chunk * (p->nv + 3), mem + chunk * (p->nv + 4), NULL,
                  logits_dtype == ML_BF16};
  int rc = 0;
  if (g && g->obj && !(b.host = ml_be_host_alloc(m->be, 2 * chunk, sizeof(float),
                                                 "the objective's staging (%lld tokens)",
                                                 (long long)chunk)))
    rc = -1;
  if (rc == 0) rc = run_chunks(p, g, logprobs, out, &b, chunk);
  ml_be_host_free(m->be, b.host);
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
  int64_t T = m->B * m->S;
  loss_pass p = {.m = m, .split = split, .y = targets, .N = T, .own0 = 0, .T = T};
  if (split->group) {
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

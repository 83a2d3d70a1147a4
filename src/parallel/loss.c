#include "parallel/loss.h"

#include "common/checked.h"
#include "common/status.h"

/* floats of logits per chunk (64 MiB): for a 49k vocabulary, chunks of
 * ~340 tokens, where lm_head's GEMMs (M = the chunk's tokens) run near the
 * speed of the layers' ones; half that costs a sixth more time in them */
enum { LOGITS_BUDGET = 1 << 24 };

typedef struct chunk_bufs {
  float *logits; /* [nt, V_local] */
  float *mx;     /* [nt] */
  float *se_tl;  /* [2 nt]: sum of exp, then target logit − max */
  float *w;      /* [nt] gradient weights */
  bool bf16;     /* round the logits to bf16 (output_dtype) */
} chunk_bufs;

/* mx, se, tl of tokens t0 .. t0+nt−1, reduced over the vocab shards. */
/* The vocab columns of this rank's logits: lm_head's shard, or all of
 * them when the logits arrive whole (tp == NULL). */
static void vocab_range(const ml_model *m, const ml_comm *tp, int64_t *v0, int64_t *nv) {
  if (tp) {
    ml_model_vocab_shard(m, v0, nv);
  } else {
    *v0 = 0;
    *nv = m->cfg.vocab;
  }
}

static int chunk_stats(ml_model *m, ml_comm *tp, const int32_t *y, int64_t t0, int64_t nt,
                       chunk_bufs *b) {
  int64_t v0, nv;
  vocab_range(m, tp, &v0, &nv);
  ML_TRY(ml_head_forward(m, t0, nt, b->logits));  // logits: [nt, nv]
  if (b->bf16) ML_TRY(ml_be_round_bf16(m->be, b->logits, (size_t)(nt * nv)));
  ML_TRY(ml_be_xent_rowmax(m->be, b->logits, nt, nv, b->mx));
  if (tp && tp->size > 1) ML_TRY(ml_all_reduce(tp, b->mx, (size_t)nt, ML_ELEM_F32, ML_RED_MAX));
  ML_TRY(ml_be_xent_sumexp_target(m->be, b->logits, nt, nv, v0, y + t0, b->mx, b->se_tl,
                                  b->se_tl + nt));
  if (tp && tp->size > 1)
    ML_TRY(ml_all_reduce(tp, b->se_tl, (size_t)(2 * nt), ML_ELEM_F32, ML_RED_SUM));
  return 0;
}

static int run_chunks(ml_model *m, ml_comm *tp, const int32_t *y, bool backward, float scale,
                      float *logprobs, ml_loss_out *out, chunk_bufs *b, int64_t chunk) {
  int64_t T = m->B * m->S, v0, nv;
  vocab_range(m, tp, &v0, &nv);
  for (int64_t t0 = 0; t0 < T; t0 += chunk) {
    int64_t nt = T - t0 < chunk ? T - t0 : chunk;
    ML_TRY(chunk_stats(m, tp, y, t0, nt, b));
    ML_TRY(ml_be_xent_logprobs(m->be, b->se_tl, b->se_tl + nt, y + t0, nt, scale,
                               logprobs ? logprobs + t0 : NULL, b->w, &out->loss_sum,
                               &out->count));
    if (!backward) continue;
    ML_TRY(ml_be_xent_bwd(m->be, b->logits, nt, nv, v0, y + t0, b->mx, b->se_tl, b->w,
                          b->logits));
    ML_TRY(ml_head_backward(m, t0, nt, b->logits));
  }
  return 0;
}

int64_t ml_loss_chunk_tokens(int64_t T, int64_t V, int parts) {
  int64_t widest = (V + parts - 1) / parts; /* torch.chunk: the first shard is the largest */
  int64_t chunk = LOGITS_BUDGET / (widest > 0 ? widest : 1);
  chunk = chunk < 1 ? 1 : chunk;
  return chunk > T ? T : chunk;
}

int ml_vocab_parallel_loss(ml_model *m, ml_comm *tp, const int32_t *targets, ml_dtype logits_dtype,
                           bool backward, float grad_scale, float *logprobs, ml_loss_out *out) {
  int64_t T = m->B * m->S, v0, nv;
  vocab_range(m, tp, &v0, &nv);
  int64_t chunk = ml_loss_chunk_tokens(T, m->cfg.vocab, tp ? tp->size : 1);
  chunk_bufs b;
  /* chunk · nv <= max(LOGITS_BUDGET, vocab_size) (ml_loss_chunk_tokens): a plain count */
  float *mem = ml_be_alloc(m->be, chunk * (nv + 4), sizeof(float),
                               "the logits chunk (%lld tokens x %lld vocab columns of vocab_size "
                               "%lld)",
                               (long long)chunk, (long long)nv, (long long)m->cfg.vocab);
  if (!mem) return -1;
  b.logits = mem;
  b.mx = mem + chunk * nv;
  b.se_tl = b.mx + chunk;
  b.w = b.se_tl + 2 * chunk;
  b.bf16 = logits_dtype == ML_BF16;
  out->loss_sum = 0.0;
  out->count = 0;
  int rc = run_chunks(m, tp, targets, backward, grad_scale, logprobs, out, &b, chunk);
  ml_be_free(m->be, mem);
  return rc;
}

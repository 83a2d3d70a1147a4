/* Text generation with a KV cache, continuous batching (generate.h). */
#include "engine/generate.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/profile.h"
#include "common/checked.h"
#include "common/hash.h"
#include "common/rng.h"
#include "common/status.h"
#include "engine/gen_ep.h"
#include "engine/gen_vocab.h"
#include "engine/kvcache.h"
#include "engine/token_lp.h"
#include "parallel/redistribute.h"
#include "parallel/tp_whole.h"

/* A slot of the KV cache and the sequence in it. */
typedef enum { SLOT_FREE, SLOT_WAIT, SLOT_PREFILL, SLOT_DECODE } slot_kind;

typedef struct slot {
  slot_kind kind; /* WAIT: a sample slot until its prompt's prefill ends */
  int64_t row;    /* its output row (PREFILL: the prompt's first sample, or a resumed row) */
  int64_t pos;    /* positions in its cache */
  int32_t next;   /* DECODE: the token the next step feeds */
  int64_t plen;   /* PREFILL: the positions it prefills (the prompt; a resumed row: the
                     prompt and the tokens it generated before its preemption) */
  bool fork;      /* PREFILL: its prompt's other samples wait for its keys (WAIT slots) */
} slot;

/* One call's state. */
typedef struct gen {
  ml_engine *e;
  ml_model *m;
  const ml_gen_opts *o;
  int64_t n, N, R;            /* prompts, samples per prompt, rows n·N */
  const int64_t *lens;         /* [n] prompt lengths */
  int64_t *start;              /* [n] their offsets into tokens */
  const int32_t *tokens;
  int64_t budget, Tmax, V;     /* prefill tokens per step, tokens per step, vocab */
  ml_kv_pool kv;
  int64_t pending;             /* KV blocks the admitted prefills (and their forks) will take */
  slot *slots;
  int64_t nslots, nfree;
  int64_t *slot_of;            /* [R] the slot of each row once admitted */
  int64_t next_prompt;         /* prompts admitted: 0 .. next_prompt − 1 */
  int64_t *resume, nres;       /* [R] preempted rows waiting to re-enter, ascending */
  int64_t preemptions;
  int64_t *queue, nq;          /* slots prefilling, in order of admission */
  ml_kv_seg *seg;              /* [nslots] the step's segments */
  int64_t *need;               /* [nslots] tokens whose logits the step samples from */
  ml_rng *rng;                 /* [R] each row's stream */
  /* draws of a step, [nslots] each */
  int64_t *d_row, *d_logit;
  ml_rng *d_rng;
  int32_t *d_tok;
  float *d_lp;
  float *work;                 /* [nslots, 2·V] the sampler's scratch (NULL: greedy) */
  /* the step's batch (device) and its host sides */
  float *x, *rope, *logits;
  float *gather_work;          /* vocab-sharded logits' all-gather over tp (NULL: none) */
  int32_t *ids, *host_ids;
  float *host_logits;          /* = logits where the backend's memory is the host's */
  /* outputs */
  int32_t *out_tokens, *out_finish;
  int64_t *out_lens;
  float *out_logprobs;
  ml_gen_ep ep; /* the ep group stepping together (gen_ep.h) */
} gen;

static int64_t max_new_of(const gen *g, int64_t k) {
  return g->o->max_new_per ? g->o->max_new_per[k] : g->o->max_new;
}

/* Row r's draws: seed's stream (its first output, a mixed 64-bit value,
 * as the base) advanced by r·2^32 draws, so that rows' streams never
 * overlap (a row draws at most max_new <= 2^24 numbers) and depend on seed
 * and r only. */
static ml_rng row_rng(uint64_t seed, int64_t r) {
  ml_rng s = ml_rng_seed(seed);
  return ml_rng_seed(ml_rng_next(&s) + ((uint64_t)r << 32));
}

/* Each layer's RoPE tables at the step's gathered rows [4][T][hd/2]. */
static void rope_point(gen *g, int64_t T) {
  int64_t n = T * g->kv.half;
  for (int l = 0; l < g->m->cfg.n_layers; l++) {
    const float *t = g->rope + (g->m->cfg.sliding[l] ? 2 * n : 0);
    g->m->layers[l].rope_cos = t;
    g->m->layers[l].rope_sin = t + n;
  }
}

/* Back to the model's tables, as ml_model_begin points the layers. */
static void rope_restore(ml_model *m) {
  for (int l = 0; l < m->cfg.n_layers; l++) {
    m->layers[l].rope_cos = m->cfg.sliding[l] ? m->rope_local_cos : m->rope_cos;
    m->layers[l].rope_sin = m->cfg.sliding[l] ? m->rope_local_sin : m->rope_sin;
  }
}

// host_ids [1, T] of the step's segments → host_logits [nl, V] of tokens need[0 .. nl)
static int forward(gen *g, int64_t T, int64_t nl) {
  ml_model *m = g->m;
  ml_backend *be = g->e->be;
  snprintf(m->batch_what, sizeof m->batch_what, "generation: a step of %lld tokens",
           (long long)T);
  m->forward_only = true; /* no backward: one layer's activations (model.h) */
  ML_TRY(ml_model_begin(m, 1, T));
  ML_TRY(ml_kv_gather_rope(&g->kv, g->rope, T));
  rope_point(g, T);
  ML_TRY(ml_be_copy(be, g->ids, g->host_ids, sizeof(int32_t) * (size_t)T, ML_COPY_H2D));
  ML_TRY(ml_embed_forward(m, g->ids, g->x));
  /* the unit boundaries' casts and hand-offs (ml_engine_layer_cast), as the engine's forward */
  for (int l = 0; l < m->cfg.n_layers; l++)
    ML_TRY(ml_layer_forward(m, l, g->x, ml_engine_layer_cast(g->e, l, false)));
  ML_TRY(ml_head_begin(m, g->x));
  /* lm_head's input: the sampled tokens' rows compacted to rows 0 .. nl−1 (need ascending,
     need[i] >= i: each row moves down onto a row no later one reads) */
  int64_t c = m->head_in.c;
  for (int64_t i = 0; i < nl; i++)
    if (g->need[i] != i)
      ML_TRY(ml_be_copy(be, m->head_in.x + i * c, m->head_in.x + g->need[i] * c,
                        sizeof(float) * (size_t)c, ML_COPY_D2D));
  ML_TRY(ml_head_forward(m, 0, nl, g->logits)); // [nl, V], or [nl, V_local] vocab-sharded
  if (m->logits_c != g->V) { /* lm_head's Shard(−1) logits → Replicate: every tp rank all V */
    ml_act a = {g->logits, 1, nl, nl, g->V, m->logits_c};
    ML_TRY(ml_redistribute(be, ml_mesh_comm(g->e->mesh, ML_GROUP_TP), ml_shard(2),
                           ml_replicate(), &a, g->gather_work));
  }
  if (g->e->opts.output_dtype == ML_BF16)       /* as the loss reads them */
    ML_TRY(ml_be_round_bf16(be, g->logits, (size_t)(nl * g->V)));
  if (g->host_logits == g->logits) return 0; /* host memory: the sampler reads them there */
  return ml_be_copy(be, g->host_logits, g->logits, sizeof(float) * (size_t)(nl * g->V),
                    ML_COPY_D2H);
}

/* Positions a row of prompt k writes at most: P + max_new − 1 (its last
 * token is never fed back). */
static int64_t last_pos(const gen *g, int64_t k) { return g->lens[k] + max_new_of(g, k) - 1; }

/* KV blocks a sequence of prompt k holds once `pos` positions are written
 * and its next position has its block (the current need and the next
 * step's, vLLM's admission with one block of headroom), less `shared`
 * blocks it holds by reference. */
static int64_t next_blocks(const gen *g, int64_t k, int64_t pos, int64_t shared) {
  int64_t upto = pos + 1 < last_pos(g, k) ? pos + 1 : last_pos(g, k);
  return ml_kv_blocks(upto) - shared;
}

/* KV blocks prompt k's n samples take to enter: sample 0 its prefill's and
 * the next position's, each other sample all but the prompt's full blocks
 * (which it shares; a copy of a partial last block, the next position's). */
static int64_t group_blocks(const gen *g, int64_t k) {
  int64_t P = g->lens[k];
  return next_blocks(g, k, P, 0) + (g->N - 1) * next_blocks(g, k, P, P / ML_KV_BLOCK);
}

/* Of those, the blocks the prefill and the forks take before any decode. */
static int64_t group_prefill_blocks(const gen *g, int64_t k) {
  int64_t P = g->lens[k];
  return ml_kv_blocks(P) + (g->N - 1) * (P % ML_KV_BLOCK != 0);
}

/* The smallest pool every prompt can run in: its group entering, and one
 * sequence alone to its last position (a preempted row re-enters needing
 * at most that). */
static int64_t least_blocks(const gen *g) {
  int64_t most = 1;
  for (int64_t k = 0; k < g->n; k++) {
    int64_t need = group_blocks(g, k), alone = ml_kv_blocks(last_pos(g, k));
    if (need > most) most = need;
    if (alone > most) most = alone;
  }
  return most;
}

/* The blocks the step's prefill chunks or forks took, out of the pending
 * ones (more: a bug in the accounting). */
static int spend(gen *g, int64_t s, int64_t taken) {
  if (taken > g->pending)
    return ml_err("generate: slot %lld took %lld KV blocks with %lld left to the admitted "
                  "prefills; expected at most that",
                  (long long)s, (long long)taken, (long long)g->pending);
  g->pending -= taken;
  return 0;
}

/* The lowest free slot (the caller checked that one is). */
static int64_t free_slot(const gen *g) {
  int64_t s = 0;
  while (g->slots[s].kind != SLOT_FREE) s++;
  return s;
}

/* The earliest preempted row re-enters when a slot and the blocks of its
 * prompt, its generated tokens and its next position are free (beside
 * those the admitted prefills will take): it prefills all of them again
 * (vLLM's recompute preemption) in its own slot, its RoPE tables for its
 * prompt's length as before; *in false when it does not fit. */
static int admit_resumed(gen *g, bool *in) {
  int64_t r = g->resume[0], k = r / g->N, plen = g->lens[k] + g->out_lens[r];
  *in = g->nfree >= 1 && g->pending + next_blocks(g, k, plen, 0) <= g->kv.nfree;
  if (!*in) return 0;
  int64_t s = free_slot(g);
  g->slots[s] = (slot){SLOT_PREFILL, r, 0, -1, plen, false};
  g->slot_of[r] = s;
  g->nfree--;
  g->pending += ml_kv_blocks(plen);
  g->queue[g->nq++] = s;
  memmove(g->resume, g->resume + 1, sizeof(int64_t) * (size_t)--g->nres);
  return ml_kv_slot_rope(&g->kv, &g->m->cfg, s, g->lens[k]);
}

/* Rows enter first come, first served: preempted rows first (the earliest
 * first: they arrived before every prompt not yet admitted), then prompts
 * in order while their n samples find free slots and the KV blocks they
 * take to enter (group_blocks) are free beside those the admitted
 * prefills will take (vLLM's admission on the current need: a running
 * sequence that later finds no free block preempts another, make_room).
 * A prompt's first slot prefills, the others wait for its keys. */
static int admit(gen *g) {
  for (bool in = true; in && g->nres > 0;) ML_TRY(admit_resumed(g, &in));
  if (g->nres > 0) return 0;
  while (g->next_prompt < g->n && g->nfree >= g->N &&
         g->pending + group_blocks(g, g->next_prompt) <= g->kv.nfree) {
    int64_t k = g->next_prompt++;
    for (int64_t j = 0; j < g->N; j++) {
      int64_t s = free_slot(g), r = k * g->N + j;
      g->slots[s] = (slot){j == 0 ? SLOT_PREFILL : SLOT_WAIT, r, 0, -1, g->lens[k], j == 0};
      g->slot_of[r] = s;
    }
    g->nfree -= g->N;
    g->pending += group_prefill_blocks(g, k);
    int64_t owner = g->slot_of[k * g->N];
    g->queue[g->nq++] = owner;
    ML_TRY(ml_kv_slot_rope(&g->kv, &g->m->cfg, owner, g->lens[k]));
  }
  return 0;
}

/* Whether decoding slot s's next position needs a block its table lacks. */
static bool grows(const gen *g, int64_t s) {
  return ml_kv_blocks(g->slots[s].pos + 1) > g->kv.nb[s];
}

/* Slot s's sequence preempted (vLLM's recompute preemption): its blocks
 * released (those it shares stay with their other holders), its slot
 * freed, its row queued to re-enter with the tokens it generated (kept in
 * the outputs; its stream, which drew them, kept as it is). */
static void preempt(gen *g, int64_t s) {
  int64_t r = g->slots[s].row, i = g->nres++;
  ml_kv_release(&g->kv, s);
  g->slots[s] = (slot){SLOT_FREE, -1, 0, -1, 0, false};
  g->nfree++;
  for (; i > 0 && g->resume[i - 1] > r; i--) g->resume[i] = g->resume[i - 1];
  g->resume[i] = r;
  g->preemptions++;
}

/* Before a decode step: while the decoding sequences' next positions need
 * more blocks than are free, the one that arrived last (the highest row)
 * is preempted (vLLM's scheduler: the running queue's tail). The last
 * running sequence is never preempted: it fits the pool alone
 * (least_blocks), so its need finding no block is a bug, named. */
static int make_room(gen *g) {
  int64_t need = 0, running = 0;
  for (int64_t s = 0; s < g->nslots; s++)
    if (g->slots[s].kind == SLOT_DECODE) need += grows(g, s), running++;
  while (need > g->kv.nfree) {
    int64_t v = -1;
    for (int64_t s = 0; s < g->nslots; s++)
      if (g->slots[s].kind == SLOT_DECODE && (v < 0 || g->slots[s].row > g->slots[v].row)) v = s;
    if (running <= 1)
      return ml_err("generate: row %lld alone needs %lld KV blocks with %lld free of %lld; "
                    "expected room for one sequence (a bug in the accounting)",
                    (long long)g->slots[v].row, (long long)need, (long long)g->kv.nfree,
                    (long long)g->kv.nblocks);
    need -= grows(g, v);
    running--;
    preempt(g, v);
  }
  return 0;
}

/* The step's ids of slot sl's prefill chunk, positions pos .. pos+c−1:
 * its prompt's, then (a resumed row) the tokens it generated. */
static void prefill_ids(const gen *g, const slot *sl, int64_t c, int32_t *ids) {
  int64_t k = sl->row / g->N, P = g->lens[k];
  for (int64_t i = 0, p = sl->pos; i < c; i++, p++)
    ids[i] = p < P ? g->tokens[g->start[k] + p] : g->out_tokens[sl->row * g->o->max_new + p - P];
}

/* The step's segments: while prompts wait for their prefill, prefill
 * chunks in order of admission while they fit the budget (the first
 * always); else a token per decoding slot (in slot order). A step is all
 * prefill or all decode (vLLM's V0 scheduler): the steps take few distinct
 * sizes (the model's buffers and the GEMMs' primitives are per size).
 * Sets the batch's ids and need[]; returns T, *nl the tokens whose logits
 * are drawn from. */
static int64_t plan_step(gen *g, int64_t *nl) {
  int64_t t = 0, ns = 0, used = 0;
  *nl = 0;
  for (int64_t s = 0; s < g->nslots && g->nq == 0; s++) {
    const slot *sl = &g->slots[s];
    if (sl->kind != SLOT_DECODE) continue;
    g->seg[ns++] = (ml_kv_seg){s, sl->pos, 1, t};
    g->host_ids[t] = sl->next;
    g->need[(*nl)++] = t++;
  }
  for (int64_t i = 0; i < g->nq; i++) {
    const slot *sl = &g->slots[g->queue[i]];
    int64_t P = sl->plen;
    int64_t c = P - sl->pos < g->budget ? P - sl->pos : g->budget;
    if (used > 0 && used + c > g->budget) break;
    g->seg[ns++] = (ml_kv_seg){g->queue[i], sl->pos, c, t};
    prefill_ids(g, sl, c, g->host_ids + t);
    if (sl->pos + c == P) g->need[(*nl)++] = t + c - 1;
    used += c;
    t += c;
  }
  g->kv.seg = g->seg;
  g->kv.nseg = ns;
  return t;
}

/* The step's segments' positions in their slots' blocks: a prefill's out
 * of the pending ones its admission counted, a decode token's free after
 * make_room. */
static int reserve_step(gen *g) {
  for (int64_t i = 0; i < g->kv.nseg; i++) {
    const ml_kv_seg *sg = &g->seg[i];
    int64_t taken;
    ML_TRY(ml_kv_reserve(&g->kv, sg->slot, sg->pos + sg->n, &taken));
    if (g->slots[sg->slot].kind == SLOT_PREFILL) ML_TRY(spend(g, sg->slot, taken));
  }
  return 0;
}

/* Row r's next token: written out; the row finishes on a stop id or its
 * max_new (its slot freed), else decodes it next. */
static void take(gen *g, int64_t r, int32_t tok, float lp) {
  int64_t mx = g->o->max_new, k = r / g->N, j = g->out_lens[r]++;
  g->out_tokens[r * mx + j] = tok;
  if (g->out_logprobs) g->out_logprobs[r * mx + j] = lp;
  int32_t why = 0;
  for (int64_t i = 0; i < g->o->n_stop && !why; i++)
    if (g->o->stop[i] == tok) why = ML_FINISH_STOP;
  if (!why && j + 1 == max_new_of(g, k)) why = ML_FINISH_LENGTH;
  int64_t s = g->slot_of[r];
  slot *sl = &g->slots[s];
  if (why) {
    if (g->out_finish) g->out_finish[r] = why;
    ml_kv_release(&g->kv, s);
    *sl = (slot){SLOT_FREE, -1, 0, -1, 0, false};
    g->nfree++;
  } else {
    sl->kind = SLOT_DECODE, sl->next = tok;
  }
}

/* After the forward: segments' positions advance; a finished prefill hands
 * its keys to its samples' slots; the draws of every sampled token. */
static int finish_step(gen *g, int64_t nl) {
  int64_t nd = 0, i = 0;
  for (int64_t q = 0; q < g->kv.nseg; q++) {
    const ml_kv_seg *sg = &g->seg[q];
    slot *sl = &g->slots[sg->slot];
    sl->pos += sg->n;
    if (i >= nl || g->need[i] != sg->t0 + sg->n - 1) continue; /* a prefill chunk, not the last */
    if (sl->fork) {
      int64_t k = sl->row / g->N;
      for (int64_t j = 0; j < g->N; j++) {
        int64_t r = k * g->N + j, s = g->slot_of[r];
        if (j > 0) {
          int64_t taken;
          ML_TRY(ml_kv_fork(&g->kv, sg->slot, s, sl->pos, &taken));
          ML_TRY(spend(g, s, taken));
          g->slots[s].pos = sl->pos;
        }
        g->d_row[nd] = r;
        g->d_logit[nd++] = i;
      }
      sl->fork = false; /* its samples have its keys: it decodes on its own */
    } else {
      g->d_row[nd] = sl->row;
      g->d_logit[nd++] = i;
    }
    i++;
  }
  /* prefills that ended leave the queue */
  int64_t kept = 0;
  for (int64_t q = 0; q < g->nq; q++) {
    const slot *sl = &g->slots[g->queue[q]];
    if (sl->pos < sl->plen) g->queue[kept++] = g->queue[q];
  }
  g->nq = kept;
  for (int64_t d = 0; d < nd; d++) g->d_rng[d] = g->rng[g->d_row[d]];
  if (ml_be_profile_on()) ml_be_profile_mark(g->e->be, "generate: sampling (host)");
  ml_sample_rows(g->host_logits, g->d_logit, nd, g->V, &g->o->sampler, g->d_rng, g->work,
                 g->d_tok, g->d_lp);
  for (int64_t d = 0; d < nd; d++) {
    g->rng[g->d_row[d]] = g->d_rng[d];
    if (g->out_logprobs && g->e->opts.batch_invariant) /* bitwise the loss's log-prob */
      ML_TRY(ml_token_logprob(g->e->be, g->logits + g->d_logit[d] * g->V, g->V, g->d_tok[d],
                              &g->d_lp[d]));
    take(g, g->d_row[d], g->d_tok[d], g->d_lp[d]);
  }
  return 0;
}

/* Steps until every prompt is admitted and every row has finished. */
static int run(gen *g) {
  for (;;) {
    if (ml_be_profile_on()) ml_be_profile_mark(g->e->be, "generate: scheduling (host)");
    ML_TRY(admit(g));
    if (g->nq == 0) ML_TRY(make_room(g)); /* a decode step next */
    int64_t nl, T = plan_step(g, &nl);
    if (T == 0 && g->nres == 0 && g->next_prompt == g->n)
      return 0; /* nothing decodes, prefills or waits: every row done */
    if (T == 0)
      return ml_err("generate: %lld preempted rows and %lld prompts wait with nothing running "
                    "and %lld of %lld KV blocks free; expected the first to enter (a bug in "
                    "the admission)",
                    (long long)g->nres, (long long)(g->n - g->next_prompt),
                    (long long)g->kv.nfree, (long long)g->kv.nblocks);
    ML_TRY(reserve_step(g));
    ML_TRY(ml_gen_ep_step(&g->ep)); /* the ep group steps together (gen_ep.h) */
    ML_TRY(forward(g, T, nl));
    ML_TRY(finish_step(g, nl));
  }
}

/* The key/value heads this rank's attention reads: k_proj's rows over
 * head_dim (all of them on one rank; its whole heads under tp, parallel/tp.h). */
static int64_t local_kv_heads(const ml_model *m) {
  return m->layers[0].k_proj.weight->local[0] / m->cfg.head_dim;
}

/* The call's buffers (errors: allocation, named). */
static int gen_alloc(gen *g, int64_t cap, int64_t nblocks, bool kv_bf16) {
  ml_model *m = g->m;
  ml_backend *be = g->e->be;
  const ml_model_config *c = &m->cfg;
  int64_t S = g->nslots, T = g->Tmax, V = c->vocab;
  ML_TRY(ml_kv_pool_create(&g->kv, be, c, local_kv_heads(m), S, cap, nblocks, kv_bf16));
  g->x = ml_be_alloc(be, ml_mul_sat(T, c->hidden), sizeof(float),
                     "the residual stream (a step of %lld tokens x hidden_size %lld)",
                     (long long)T, (long long)c->hidden);
  g->rope = ml_be_alloc(be, ml_mul_sat(4 * T, c->head_dim / 2), sizeof(float),
                        "the step's RoPE tables (%lld tokens x head_dim %lld)", (long long)T,
                        (long long)c->head_dim);
  g->ids = ml_be_alloc(be, T, sizeof(int32_t), "the step's ids (%lld tokens)", (long long)T);
  g->host_ids = ml_be_host_alloc(be, T, sizeof(int32_t), "the step's ids (%lld tokens)",
                                 (long long)T);
  int64_t SV = ml_mul_sat(S, V);
  g->logits = ml_be_alloc(be, SV, sizeof(float),
                          "the logits (%lld sequence slots x vocab_size %lld)", (long long)S,
                          (long long)V);
  g->host_logits = ml_be_host_memory(be) ? g->logits /* no copy to the host */
                  : ml_be_host_alloc(be, SV, sizeof(float),
                                     "the logits (%lld sequence slots x vocab_size %lld)",
                                     (long long)S, (long long)V);
  if (!g->x || !g->rope || !g->ids || !g->host_ids || !g->logits || !g->host_logits) return -1;
  int tp = g->e->mesh->tp;
  if (tp > 1 && !m->lm_head.out.fwd.fn && m->lm_head.weight->local[0] != V) {
    g->gather_work = ml_be_alloc(be, ml_redistribute_work(1, S, V, tp), sizeof(float),
                                 "the logits' all-gather over tp %d (%lld sequence slots x "
                                 "vocab_size %lld)", tp, (long long)S, (long long)V);
    if (!g->gather_work) return -1;
  }
  g->slots = ml_malloc_array(S, sizeof *g->slots, "the slots (%lld)", (long long)S);
  g->queue = ml_malloc_array(S, sizeof(int64_t), "the prefill queue (%lld)", (long long)S);
  g->seg = ml_malloc_array(S, sizeof *g->seg, "the step's segments (%lld)", (long long)S);
  g->need = ml_malloc_array(S, sizeof(int64_t), "the step's sampled tokens (%lld)", (long long)S);
  g->d_row = ml_malloc_array(S, sizeof(int64_t), "the step's draws (%lld)", (long long)S);
  g->d_logit = ml_malloc_array(S, sizeof(int64_t), "the step's draws (%lld)", (long long)S);
  g->d_rng = ml_malloc_array(S, sizeof(ml_rng), "the step's draws (%lld)", (long long)S);
  g->d_tok = ml_malloc_array(S, sizeof(int32_t), "the step's draws (%lld)", (long long)S);
  g->d_lp = ml_malloc_array(S, sizeof(float), "the step's draws (%lld)", (long long)S);
  g->slot_of = ml_malloc_array(g->R, sizeof(int64_t), "the rows' slots (%lld)", (long long)g->R);
  g->resume = ml_malloc_array(g->R, sizeof(int64_t), "the preempted rows (%lld)", (long long)g->R);
  g->rng = ml_malloc_array(g->R, sizeof(ml_rng), "the rows' draws (%lld)", (long long)g->R);
  if (!g->o->sampler.greedy)
    g->work = ml_malloc_array(ml_mul_sat(S, 2 * V), sizeof(float),
                              "the sampler's scratch (%lld sequence slots x 2 x vocab_size %lld)",
                              (long long)S, (long long)V);
  if (!g->slots || !g->queue || !g->seg || !g->need || !g->d_row || !g->d_logit || !g->d_rng ||
      !g->d_tok || !g->d_lp || !g->slot_of || !g->resume || !g->rng ||
      (!g->work && !g->o->sampler.greedy))
    return -1;
  for (int64_t s = 0; s < S; s++) g->slots[s] = (slot){SLOT_FREE, -1, 0, -1, 0, false};
  g->nfree = S;
  for (int64_t r = 0; r < g->R; r++) g->rng[r] = row_rng(g->o->seed, r);
  return 0;
}

static void gen_free(gen *g) {
  ml_backend *be = g->e->be;
  ml_kv_pool_destroy(&g->kv);
  ml_be_free(be, g->x);
  ml_be_free(be, g->rope);
  ml_be_free(be, g->ids);
  if (g->host_logits != g->logits) ml_be_host_free(be, g->host_logits);
  ml_be_free(be, g->logits);
  ml_be_free(be, g->gather_work);
  ml_be_host_free(be, g->host_ids);
  void *host[] = {g->slots, g->queue, g->seg, g->need, g->d_row, g->d_logit, g->d_rng,
                  g->d_tok, g->d_lp, g->slot_of, g->resume, g->rng, g->work, g->start};
  for (size_t i = 0; i < sizeof host / sizeof *host; i++) free(host[i]);
}

/* No context parallelism, and a backend the KV cache's attention runs on. */
static int check_engine(const ml_engine *e) {
  const ml_mesh *ms = e->mesh;
  if (ms->cp != 1)
    return ml_err("generate: the engine's mesh has cp %d (dp_replicate %d x dp_shard %d x cp "
                  "%d x tp %d); expected cp 1: the KV cache holds whole sequences on each rank "
                  "(generate on a one-rank replica instead: meshlm_sampling.replica = 1)",
                  ms->cp, ms->dp_replicate, ms->dp_shard, ms->cp, ms->tp);
  if (!ml_be_supports(e->be, ML_OP_ATTENTION_BLOCK))
    return ml_err("generate: backend '%s' has no block attention, which the KV cache's "
                  "attention runs on; expected a backend with it (cpu)",
                  e->be->ops->name);
  return 0;
}

static int check_opts(const ml_engine *e, int64_t n, const ml_gen_opts *o) {
  int64_t V = e->model.cfg.vocab;
  if (!o) return ml_err("generate: no options (o NULL)");
  if (n < 0) return ml_err("generate: n = %lld prompts; expected >= 0", (long long)n);
  if (o->max_new < 1)
    return ml_err("generate: max_new %lld; expected >= 1", (long long)o->max_new);
  if (o->n_samples < 1)
    return ml_err("generate: n_samples %lld; expected >= 1", (long long)o->n_samples);
  if (o->max_running != 0 && o->max_running < o->n_samples)
    return ml_err("generate: max_running %lld; expected 0 (every sequence) or >= n_samples "
                  "%lld (a prompt's samples run together)",
                  (long long)o->max_running, (long long)o->n_samples);
  if (o->max_kv_bytes < 0)
    return ml_err("generate: max_kv_bytes %lld; expected >= 0 (0: room for max_running "
                  "sequences of the longest prompt)", (long long)o->max_kv_bytes);
  if (o->prefill_tokens < 0)
    return ml_err("generate: prefill_tokens %lld; expected >= 1 (0: %d)",
                  (long long)o->prefill_tokens, ML_GEN_PREFILL);
  if (o->n_stop < 0 || (o->n_stop > 0 && !o->stop))
    return ml_err("generate: %lld stop ids%s; expected >= 0 ids and a list for them",
                  (long long)o->n_stop, o->n_stop > 0 ? " without a list (stop NULL)" : "");
  for (int64_t i = 0; i < o->n_stop; i++)
    if (o->stop[i] < 0 || o->stop[i] >= V)
      return ml_err("generate: stop id %lld is %d; expected 0 .. %lld (vocab_size %lld)",
                    (long long)i, o->stop[i], (long long)(V - 1), (long long)V);
  for (int64_t k = 0; o->max_new_per && k < n; k++)
    if (o->max_new_per[k] < 1 || o->max_new_per[k] > o->max_new)
      return ml_err("generate: max_new_per[%lld] = %lld; expected 1 .. max_new %lld",
                    (long long)k, (long long)o->max_new_per[k], (long long)o->max_new);
  return ml_sampler_check(&o->sampler, "generate");
}

static int check_prompts(const ml_engine *e, int64_t n, const int64_t *lens,
                         const int32_t *tokens, const ml_gen_opts *o, const int32_t *out_tokens,
                         const int64_t *out_lens) {
  const ml_model_config *c = &e->model.cfg;
  if (n > 0 && (!lens || !tokens || !out_tokens || !out_lens))
    return ml_err("generate: %lld prompts but %s is NULL", (long long)n,
                  !lens ? "lens" : !tokens ? "tokens" : !out_tokens ? "out_tokens" : "out_lens");
  for (int64_t k = 0, at = 0; k < n; k++) {
    if (lens[k] < 1)
      return ml_err("generate: prompt %lld has %lld tokens; expected >= 1", (long long)k,
                    (long long)lens[k]);
    char what[128];
    int64_t mx = o->max_new_per ? o->max_new_per[k] : o->max_new;
    snprintf(what, sizeof what, "generate: prompt %lld (%lld tokens) + max_new %lld",
             (long long)k, (long long)lens[k], (long long)mx);
    ML_TRY(ml_model_config_check_seq_len(c, e->model_dir, ml_add_sat(lens[k], mx), what));
    for (int64_t i = 0; i < lens[k]; i++)
      if (tokens[at + i] < 0 || tokens[at + i] >= c->vocab)
        return ml_err("generate: prompt %lld, position %lld: token id %d; expected 0 .. %lld "
                      "(vocab_size %lld)",
                      (long long)k, (long long)i, tokens[at + i], (long long)(c->vocab - 1),
                      (long long)c->vocab);
    if (ml_add_i64(at, lens[k], &at))
      return ml_err("generate: the prompts' lengths sum beyond int64 at prompt %lld",
                    (long long)k);
  }
  return 0;
}

/* The call's sizes: rows, slots, step tokens, and each slot's positions
 * (the longest prompt + its max_new − 1). */
static int size_call(gen *g, int64_t *cap) {
  const ml_gen_opts *o = g->o;
  if (ml_mul_i64(g->n, g->N, &g->R))
    return ml_err("generate: %lld prompts x n_samples %lld rows overflow int64", (long long)g->n,
                  (long long)g->N);
  int64_t S = o->max_running ? o->max_running : g->R < ML_GEN_RUNNING ? g->R : ML_GEN_RUNNING;
  g->nslots = S < g->N ? g->N : S > g->R ? g->R : S;
  g->budget = o->prefill_tokens ? o->prefill_tokens : ML_GEN_PREFILL;
  g->Tmax = g->nslots > g->budget ? g->nslots : g->budget;
  g->V = g->m->cfg.vocab;
  g->start = ml_malloc_array(g->n, sizeof(int64_t), "the prompts' offsets (%lld)",
                             (long long)g->n);
  if (!g->start) return -1;
  *cap = 1;
  for (int64_t k = 0, at = 0; k < g->n; at += g->lens[k], k++) {
    g->start[k] = at;
    int64_t need = g->lens[k] + max_new_of(g, k) - 1; /* <= max_position_embeddings: checked */
    if (need > *cap) *cap = need;
  }
  return 0;
}

/* The KV cache's storage: bf16 where every layer's attention products are
 * bf16 (its projections' weights in bf16: param_dtype bf16), else fp32. */
static bool kv_bf16(const ml_model *m) {
  for (int l = 0; l < m->cfg.n_layers; l++)
    if (m->layers[l].q_proj.weight->dtype != ML_BF16) return false;
  return true;
}

/* The KV cache's blocks: room for the call's max_running slots filled with
 * prompts of the largest need to their last positions (no preemption), or
 * as many as max_kv_bytes holds when that is less (preemption then makes
 * room, make_room); at least least_blocks. */
static int size_blocks(const gen *g, bool bf16, int64_t *nblocks) {
  int64_t most = 1, bytes = ml_kv_block_bytes(&g->m->cfg, local_kv_heads(g->m), bf16);
  for (int64_t k = 0; k < g->n; k++) { /* sample 0 every block, the others all but the shared */
    int64_t all = ml_kv_blocks(last_pos(g, k));
    int64_t full = all + (g->N - 1) * (all - g->lens[k] / ML_KV_BLOCK);
    if (full > most) most = full;
  }
  *nblocks = ml_mul_sat(g->nslots / g->N, most);
  if (g->o->max_kv_bytes == 0) return 0;
  int64_t fit = g->o->max_kv_bytes / bytes, least = least_blocks(g);
  if (fit < least)
    return ml_err("generate: max_kv_bytes %lld holds %lld KV blocks of %lld bytes (%d positions, "
                  "%s); expected room for one sequence to its last position and for a prompt's "
                  "samples to enter, %lld blocks (>= %lld bytes)",
                  (long long)g->o->max_kv_bytes, (long long)fit, (long long)bytes, ML_KV_BLOCK,
                  bf16 ? "bf16" : "fp32", (long long)least, (long long)ml_mul_sat(least, bytes));
  if (fit < *nblocks) *nblocks = fit;
  return 0;
}

/* The tp ranks drew the same tokens (generate.h): one fingerprint of the
 * outputs compared over the tp group. */
static int check_tp_agree(const gen *g) {
  ml_host *h = ml_mesh_host(g->e->mesh, ML_GROUP_TP);
  uint64_t f = ml_fnv1a(ML_FNV_BASIS, g->out_lens, sizeof(int64_t) * (size_t)g->R);
  f = ml_fnv1a(f, g->out_tokens, sizeof(int32_t) * (size_t)(g->R * g->o->max_new));
  bool same;
  ML_TRY(ml_host_all_equal(h, f, &same));
  if (!same)
    return ml_err("generate: the tp ranks of data-parallel rank %d drew different tokens; "
                  "expected the same on every tp rank (the same prompts, options and logits)",
                  g->e->mesh->groups[ML_GROUP_DP].rank);
  return 0;
}

/* The call's sizes, buffers and steps, with every FSDP unit unsharded. */
static int generate(gen *g) {
  int64_t cap = 1;
  ML_TRY(size_call(g, &cap));
  int64_t cells = ml_mul_sat(g->R, g->o->max_new);
  for (int64_t i = 0; i < cells; i++) g->out_tokens[i] = -1; /* the caller's [R, max_new] */
  if (g->out_logprobs) memset(g->out_logprobs, 0, sizeof(float) * (size_t)cells);
  if (g->out_finish) memset(g->out_finish, 0, sizeof(int32_t) * (size_t)g->R);
  memset(g->out_lens, 0, sizeof(int64_t) * (size_t)g->R);
  bool bf16 = kv_bf16(g->m);
  int64_t nblocks;
  ML_TRY(size_blocks(g, bf16, &nblocks));
  ML_TRY(gen_alloc(g, cap, nblocks, bf16));
  ML_TRY(run(g));
  if (g->o->stats) g->o->stats->preemptions = g->preemptions;
  return 0;
}

int ml_generate_check(const ml_engine *e, int64_t n, const int64_t *lens, const int32_t *tokens,
                      const ml_gen_opts *o, const int32_t *out_tokens, const int64_t *out_lens) {
  ML_TRY(check_opts(e, n, o));
  return check_prompts(e, n, lens, tokens, o, out_tokens, out_lens);
}

int ml_generate(ml_engine *e, int64_t n, const int64_t *lens, const int32_t *tokens,
                const ml_gen_opts *o, int32_t *out_tokens, int64_t *out_lens,
                float *out_logprobs, int32_t *out_finish) {
  ML_TRY(check_engine(e));
  ML_TRY(ml_generate_check(e, n, lens, tokens, o, out_tokens, out_lens));
  if (o->stats) *o->stats = (ml_gen_stats){0};
  ML_TRY(ml_engine_batch_mode(e));
  ml_fsdp *f = &e->fsdp;
  /* a rank without prompts still takes part in FSDP's gathers and its ep group's steps */
  if (n == 0 && f->dp->size == 1 && e->mesh->groups[ML_GROUP_EP].size == 1) return 0;
  ml_model *m = &e->model;
  gen g = {.e = e, .m = m, .o = o, .n = n, .N = o->n_samples, .lens = lens, .tokens = tokens,
           .out_tokens = out_tokens, .out_finish = out_finish, .out_lens = out_lens,
           .out_logprobs = out_logprobs, .kv = {.be = e->be}, .ep = {.e = e}};
  /* the model forwards through the KV cache for the call, then as before (the positions
     of a packed training batch set aside: each step points the layers at its own tables) */
  ml_attn_core core = m->attn_core;
  const int64_t *positions = m->position_ids;
  char what[sizeof m->batch_what];
  memcpy(what, m->batch_what, sizeof what);
  m->attn_core = ml_kv_core(&g.kv);
  m->position_ids = NULL;
  ml_gen_vocab vocab = {0};
  int rc = 0;
  for (int u = 0; rc == 0 && u < f->n_units; u++) rc = ml_fsdp_unshard(f, u);
  if (rc == 0) rc = ml_gen_vocab_whole(f, &vocab);
  if (rc == 0) rc = ml_tp_whole_hold(&e->tp, m); /* row-parallel weights once per call */
  if (rc == 0 && n > 0) rc = generate(&g);
  rc = ml_gen_ep_finish(&g.ep, rc != 0); /* zero-token steps while the ep group's others step */
  if (rc == 0 && n > 0) rc = check_tp_agree(&g);
  ml_tp_whole_release(&e->tp, m);
  ml_gen_vocab_release(f, &vocab);
  for (int u = 0; u < f->n_units; u++) ml_fsdp_reshard(f, u);
  m->attn_core = core;
  m->position_ids = positions;
  rope_restore(m);
  memcpy(m->batch_what, what, sizeof what);
  gen_free(&g);
  return rc;
}

/* Text generation with a KV cache (generate.h). */
#include "engine/generate.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/checked.h"
#include "common/rng.h"
#include "common/status.h"
#include "engine/token_lp.h"

/* The KV cache of one group: per layer its K then its V, [B, cap, nkv, hd]
 * each (device); p0, the position of the first of the forward's S new
 * positions. */
typedef struct kv_cache {
  ml_backend *be;
  float *mem;
  int64_t L, B, cap, nkv, hd;
  int64_t p0;
} kv_cache;

/* What the core saves per forward: the log-sum-exp [B, S, nh] of the block
 * attention; never less than the backend's own attention saves, so that
 * the buffers the model sizes with it stay valid for that attention once
 * the core is restored (the model keeps this geometry after the call). */
static int64_t kv_saved(void *ctx, int64_t B, int64_t S, int64_t nh) {
  const kv_cache *kc = ctx;
  int64_t lse = ml_mul_sat(ml_mul_sat(B, S), nh), own = ml_be_attention_saved(kc->be, B, S, nh);
  return lse > own ? lse : own;
}

// q [B, S, nh, hd], k, v [B, S, nkv, hd] at positions p0 .. p0+S−1: k, v appended to the
// layer's cache; out [B, S, nh·hd] = attention over the cached keys 0 .. p0+S−1, lse [B, S, nh]
static int kv_fwd(void *ctx, const ml_attn_call *c, float *out, float *lse) {
  kv_cache *kc = ctx;
  if (c->layer < 0 || c->layer >= kc->L || c->B != kc->B || c->nkv != kc->nkv ||
      c->hd != kc->hd || kc->p0 + c->S > kc->cap)
    return ml_err("generate: layer %lld's attention of %lld sequences x %lld positions from %lld "
                  "(%lld kv heads of %lld) does not fit the KV cache of %lld layers x %lld "
                  "sequences x %lld positions (%lld kv heads of %lld)",
                  (long long)c->layer, (long long)c->B, (long long)c->S, (long long)kc->p0,
                  (long long)c->nkv, (long long)c->hd, (long long)kc->L, (long long)kc->B,
                  (long long)kc->cap, (long long)kc->nkv, (long long)kc->hd);
  int64_t row = c->nkv * c->hd, seq = kc->cap * row; /* floats of a position, a sequence */
  float *K = kc->mem + c->layer * 2 * kc->B * seq, *V = K + kc->B * seq;
  size_t width = sizeof(float) * (size_t)(c->S * row), pitch = sizeof(float) * (size_t)seq;
  ML_TRY(ml_be_copy2d(kc->be, K + kc->p0 * row, pitch, c->k, width, width, (size_t)c->B));
  ML_TRY(ml_be_copy2d(kc->be, V + kc->p0 * row, pitch, c->v, width, width, (size_t)c->B));
  ml_attn_block blk = {.B = c->B, .sq = c->S, .sk = kc->p0 + c->S, .nh = c->nh, .nkv = c->nkv,
                       .hd = c->hd, .q_pos = kc->p0, .k_pos = 0, .q_bs = c->S * c->nh * c->hd,
                       .k_bs = seq, .l_bs = c->S * c->nh, .scale = c->scale,
                       .window = c->window, .group = c->group, .head_off = c->head_off};
  return ml_be_attention_block_fwd(kc->be, &blk, c->q, K, V, out, lse, false, c->compute);
}

/* One group's state: B prompts of P tokens, generating into positions up
 * to cap − 1. */
typedef struct gen {
  ml_engine *e;
  ml_model *m;
  kv_cache kv;
  float *rope;        /* [4, cap, hd/2]: full-attention cos, sin; sliding cos, sin (device) */
  float *x;           /* [B·P, H] residual stream (device) */
  int32_t *ids;       /* [B·P] token ids (device) */
  float *logits;      /* [B, V] of each row's last position (device) */
  int32_t *host_ids;  /* [B·P] (host) */
  float *host_logits; /* [B, V] (host) */
} gen;

/* Each layer's RoPE tables at rows p0 .. of the group's tables (the model's
 * own, ml_model_begin's, cover positions 0 .. S−1 of its geometry). */
static void rope_point(gen *g, int64_t p0) {
  int64_t half = g->m->cfg.head_dim / 2, n = g->kv.cap * half;
  for (int l = 0; l < g->m->cfg.n_layers; l++) {
    const float *t = g->rope + (g->m->cfg.sliding[l] ? 2 * n : 0) + p0 * half;
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

/* Mixed precision: the residual stream rounded to param_dtype at a unit's
 * input, as the engine's forward does (FSDP2's cast_forward_inputs). */
static int cast_unit_input(gen *g, float *x) {
  if (g->e->opts.fsdp.param_dtype != ML_BF16) return 0;
  ml_model *m = g->m;
  return ml_be_round_bf16(g->e->be, x, (size_t)(m->B * m->s_res * m->cfg.hidden));
}

// host_ids [B, S] at positions p0 .. p0+S−1 → host_logits [B, V] of each row's last position
static int forward_last(gen *g, int64_t B, int64_t S, int64_t p0) {
  ml_model *m = g->m;
  ml_backend *be = g->e->be;
  int64_t V = m->cfg.vocab;
  ML_TRY(ml_model_begin(m, B, S));
  rope_point(g, p0);
  g->kv.p0 = p0;
  ML_TRY(ml_be_copy(be, g->ids, g->host_ids, sizeof(int32_t) * (size_t)(B * S), ML_COPY_H2D));
  ML_TRY(ml_embed_forward(m, g->ids, g->x));
  for (int l = 0; l < m->cfg.n_layers; l++) {
    ML_TRY(cast_unit_input(g, g->x));
    ML_TRY(ml_layer_forward(m, l, g->x));
  }
  ML_TRY(cast_unit_input(g, g->x));
  ML_TRY(ml_head_begin(m, g->x));
  // lm_head's input: each row's last position compacted in place to rows 0 .. B−1
  size_t c = sizeof(float) * (size_t)m->head_in.c;
  if (S > 1)
    ML_TRY(ml_be_copy2d(be, m->head_in.x, c, m->head_in.x + (S - 1) * m->head_in.c, c * (size_t)S,
                        c, (size_t)B));
  ML_TRY(ml_head_forward(m, 0, B, g->logits));  // [B, V]
  if (g->e->opts.output_dtype == ML_BF16)        /* as the loss reads them */
    ML_TRY(ml_be_round_bf16(be, g->logits, (size_t)(B * V)));
  return ml_be_copy(be, g->host_logits, g->logits, sizeof(float) * (size_t)(B * V),
                    ML_COPY_D2H);
}

/* A token id and its weight, for the nucleus's sort. */
typedef struct weighted {
  double w;
  int32_t id;
} weighted;

/* Heaviest first; the lower id first among equals. */
static int heavier_first(const void *a, const void *b) {
  const weighted *x = a, *y = b;
  if (x->w != y->w) return x->w > y->w ? -1 : 1;
  return (x->id > y->id) - (x->id < y->id);
}

/* The next token of a row from its logits l [V] (host); *lp = log_softmax(l)
 * at it. Greedy: the argmax (lowest id on ties). Else weights exp((l −
 * max)/T) (TemperatureLogitsWarper), restricted under top_p < 1 to the
 * heaviest tokens while the mass before each is below top_p of the total
 * (TopPLogitsWarper: the smallest such set reaching top_p, at least one
 * token), then one uniform draw u of rng over the kept mass, walked in the
 * kept order. `sorted` [V]: scratch for top_p < 1. */
static int32_t pick(const float *l, int64_t V, const ml_gen_opts *o, ml_rng *rng,
                    weighted *sorted, float *lp) {
  int64_t arg = 0;
  for (int64_t i = 1; i < V; i++) arg = l[i] > l[arg] ? i : arg;
  double mx = l[arg], se = 0.0;
  for (int64_t i = 0; i < V; i++) se += exp((double)l[i] - mx);
  int64_t tok = arg;
  if (!o->greedy) {
    double inv_t = 1.0 / (double)o->temperature, total = 0.0, kept = 0.0;
    int64_t n = 0;
    if (o->top_p < 1.0f) {
      for (int64_t i = 0; i < V; i++) {
        sorted[i] = (weighted){exp(((double)l[i] - mx) * inv_t), (int32_t)i};
        total += sorted[i].w;
      }
      qsort(sorted, (size_t)V, sizeof *sorted, heavier_first);
      for (; n < V && kept < (double)o->top_p * total; n++) kept += sorted[n].w;
    } else {
      for (int64_t i = 0; i < V; i++) kept += exp(((double)l[i] - mx) * inv_t);
    }
    /* the walk adds the same weights in the same order, so it ends inside the kept mass */
    double u = ml_rng_uniform(rng) * kept, acc = 0.0;
    for (int64_t r = 0; r < (n ? n : V); r++) {
      tok = n ? sorted[r].id : r;
      acc += n ? sorted[r].w : exp(((double)l[r] - mx) * inv_t);
      if (u < acc) break;
    }
  }
  *lp = (float)((double)l[tok] - mx - log(se));
  return (int32_t)tok;
}

/* Row k's draws: seed's stream (its first output, a mixed 64-bit value,
 * as the base) advanced by k·2^32 draws, so that rows' streams never
 * overlap (a row draws at most max_new <= 2^24 numbers) and depend on seed
 * and k only. */
static ml_rng row_rng(uint64_t seed, int64_t k) {
  ml_rng r = ml_rng_seed(seed);
  return ml_rng_seed(ml_rng_next(&r) + ((uint64_t)k << 32));
}

/* Prompt index and length, ordered by length, then index. */
typedef struct prompt_ref {
  int64_t len, k, start; /* start: offset of its tokens */
} prompt_ref;

static int shorter_first(const void *a, const void *b) {
  const prompt_ref *x = a, *y = b;
  if (x->len != y->len) return (x->len > y->len) - (x->len < y->len);
  return (x->k > y->k) - (x->k < y->k);
}

/* The group's buffers: KV cache, RoPE tables of positions 0 .. cap−1, the
 * batch and its logits (errors: allocation, named). */
static int group_alloc(gen *g, int64_t B, int64_t P, int64_t cap) {
  ml_model *m = g->m;
  ml_backend *be = g->e->be;
  const ml_model_config *c = &m->cfg;
  int64_t half = c->head_dim / 2, n = ml_mul_sat(cap, half), T = ml_mul_sat(B, P);
  g->kv = (kv_cache){.be = be, .L = c->n_layers, .B = B, .cap = cap, .nkv = c->n_kv_heads,
                     .hd = c->head_dim};
  int64_t kv = ml_mul_sat(ml_mul_sat(2 * c->n_layers, ml_mul_sat(B, cap)),
                          c->n_kv_heads * c->head_dim);
  g->kv.mem = ml_be_alloc(be, kv, sizeof(float),
                          "the KV cache (%lld layers x %lld prompts x %lld positions x %lld kv "
                          "heads x head_dim %lld, K and V)",
                          (long long)c->n_layers, (long long)B, (long long)cap,
                          (long long)c->n_kv_heads, (long long)c->head_dim);
  g->rope = ml_be_alloc(be, ml_mul_sat(4, n), sizeof(float),
                        "the RoPE tables (%lld positions x head_dim %lld)", (long long)cap,
                        (long long)c->head_dim);
  g->x = ml_be_alloc(be, ml_mul_sat(T, c->hidden), sizeof(float),
                     "the residual stream (%lld prompts x %lld tokens x hidden_size %lld)",
                     (long long)B, (long long)P, (long long)c->hidden);
  g->ids = ml_be_alloc(be, T, sizeof(int32_t), "the prompt ids (%lld tokens)", (long long)T);
  g->host_ids = ml_be_host_alloc(be, T, sizeof(int32_t), "the prompt ids (%lld tokens)",
                                 (long long)T);
  int64_t BV = ml_mul_sat(B, c->vocab);
  g->logits = ml_be_alloc(be, BV, sizeof(float), "the logits (%lld prompts x vocab_size %lld)",
                          (long long)B, (long long)c->vocab);
  g->host_logits = ml_be_host_alloc(be, BV, sizeof(float),
                                    "the logits (%lld prompts x vocab_size %lld)", (long long)B,
                                    (long long)c->vocab);
  if (!g->kv.mem || !g->rope || !g->x || !g->ids || !g->host_ids || !g->logits ||
      !g->host_logits)
    return -1;
  /* length-dependent scalings for the prefill's length P (generate.h) */
  ML_TRY(ml_be_rope_tables(be, c->rope_theta, c->head_dim, &c->rope, P, cap, g->rope,
                           g->rope + n));
  return ml_be_rope_tables(be, c->rope_local_theta, c->head_dim, &c->rope_local, P, cap,
                           g->rope + 2 * n, g->rope + 3 * n);
}

static void group_free(gen *g) {
  ml_backend *be = g->e->be;
  ml_be_free(be, g->kv.mem);
  ml_be_free(be, g->rope);
  ml_be_free(be, g->x);
  ml_be_free(be, g->ids);
  ml_be_free(be, g->logits);
  ml_be_host_free(be, g->host_ids);
  ml_be_host_free(be, g->host_logits);
  g->kv.mem = g->rope = g->x = g->logits = g->host_logits = NULL;
  g->ids = g->host_ids = NULL;
}

/* Outputs of one run: as ml_generate's, and the per-row scratch. */
typedef struct gen_out {
  int32_t *tokens;
  int64_t *lens;
  float *logprobs;
  bool *done;        /* [B]: the row has finished */
  ml_rng *rng;       /* [B]: the rows' streams (row_rng) */
  weighted *sorted;  /* [V] (top_p < 1 only) */
} gen_out;

/* The prompts grp [B] of P tokens each: prefill, then one token per step
 * for every row until each has its max_new or its eos. */
static int run_group(gen *g, const prompt_ref *grp, int64_t B, const int32_t *tokens,
                     const ml_gen_opts *o, gen_out *out) {
  int64_t P = grp[0].len, V = g->m->cfg.vocab, mx = o->max_new;
  snprintf(g->m->batch_what, sizeof g->m->batch_what, "generation: %lld prompts x %lld tokens",
           (long long)B, (long long)P);
  ML_TRY(group_alloc(g, B, P, P + mx - 1));
  for (int64_t b = 0; b < B; b++) {
    memcpy(g->host_ids + b * P, tokens + grp[b].start, sizeof(int32_t) * (size_t)P);
    out->done[b] = false;
    out->rng[b] = row_rng(o->seed, grp[b].k);
  }
  ML_TRY(forward_last(g, B, P, 0));
  for (int64_t j = 0; j < mx; j++) {
    bool running = false;
    for (int64_t b = 0; b < B; b++) {
      if (out->done[b]) continue;
      int64_t k = grp[b].k;
      float lp;
      int32_t t = pick(g->host_logits + b * V, V, o, &out->rng[b], out->sorted, &lp);
      if (out->logprobs && g->e->opts.batch_invariant) /* bitwise the loss's log-prob */
        ML_TRY(ml_token_logprob(g->e->be, g->logits + b * V, V, t, &lp));
      out->tokens[k * mx + j] = t;
      if (out->logprobs) out->logprobs[k * mx + j] = lp;
      out->lens[k] = j + 1;
      g->host_ids[b] = t; /* the next forward's input; a finished row keeps its last */
      out->done[b] = t == o->eos;
      running |= !out->done[b];
    }
    if (!running || j + 1 == mx) break;
    ML_TRY(forward_last(g, B, 1, P + j));
  }
  return 0;
}

/* One rank, and a backend the KV cache's attention runs on. */
static int check_engine(const ml_engine *e) {
  const ml_mesh *ms = e->mesh;
  if (ms->world_size != 1)
    return ml_err("generate: the engine's mesh has %d ranks (dp_replicate %d x dp_shard %d x cp "
                  "%d x tp %d); expected one rank (all 1): generation runs on a whole replica",
                  ms->world_size, ms->dp_replicate, ms->dp_shard, ms->cp, ms->tp);
  if (!ml_be_supports(e->be, ML_OP_ATTENTION_BLOCK))
    return ml_err("generate: backend '%s' has no block attention, which the KV cache's "
                  "attention runs on; expected a backend with it (cpu)",
                  e->be->ops->name);
  return 0;
}

static int check_args(const ml_engine *e, int64_t n, const int64_t *lens, const int32_t *tokens,
                      const ml_gen_opts *o, const int32_t *out_tokens, const int64_t *out_lens) {
  const ml_model_config *c = &e->model.cfg;
  if (!o) return ml_err("generate: no options (o NULL)");
  if (n < 0) return ml_err("generate: n = %lld prompts; expected >= 0", (long long)n);
  if (n > 0 && (!lens || !tokens || !out_tokens || !out_lens))
    return ml_err("generate: %lld prompts but %s is NULL", (long long)n,
                  !lens ? "lens" : !tokens ? "tokens" : !out_tokens ? "out_tokens" : "out_lens");
  if (o->max_new < 1)
    return ml_err("generate: max_new %lld; expected >= 1", (long long)o->max_new);
  if (!o->greedy && !(o->temperature > 0.0f && isfinite(o->temperature)))
    return ml_err("generate: temperature %g; expected a finite value > 0 (or greedy)",
                  (double)o->temperature);
  if (!o->greedy && !(o->top_p > 0.0f && o->top_p <= 1.0f))
    return ml_err("generate: top_p %g; expected in (0, 1] (or greedy)", (double)o->top_p);
  for (int64_t k = 0, at = 0; k < n; k++) {
    if (lens[k] < 1)
      return ml_err("generate: prompt %lld has %lld tokens; expected >= 1", (long long)k,
                    (long long)lens[k]);
    char what[128];
    snprintf(what, sizeof what, "generate: prompt %lld (%lld tokens) + max_new %lld",
             (long long)k, (long long)lens[k], (long long)o->max_new);
    ML_TRY(ml_model_config_check_seq_len(c, e->model_dir, ml_add_sat(lens[k], o->max_new),
                                         what));
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

/* Every group in order of length; the engine's units unsharded throughout. */
static int run_all(gen *g, prompt_ref *refs, int64_t n, const int32_t *tokens,
                   const ml_gen_opts *o, gen_out *out) {
  ml_fsdp *f = &g->e->fsdp;
  for (int u = 0; u < f->n_units; u++) ML_TRY(ml_fsdp_unshard(f, u));
  for (int64_t a = 0, z; a < n; a = z) {
    for (z = a + 1; z < n && refs[z].len == refs[a].len;) z++;
    int rc = run_group(g, refs + a, z - a, tokens, o, out);
    group_free(g);
    ML_TRY(rc);
  }
  return 0;
}

int ml_generate(ml_engine *e, int64_t n, const int64_t *lens, const int32_t *tokens,
                const ml_gen_opts *o, int32_t *out_tokens, int64_t *out_lens,
                float *out_logprobs) {
  ML_TRY(check_engine(e));
  ML_TRY(check_args(e, n, lens, tokens, o, out_tokens, out_lens));
  ML_TRY(ml_engine_batch_mode(e));
  if (n == 0) return 0;
  ml_model *m = &e->model;
  int64_t cells = ml_mul_sat(n, o->max_new), V = m->cfg.vocab;
  for (int64_t i = 0; i < cells; i++) out_tokens[i] = -1; /* the caller's [n, max_new] */
  if (out_logprobs) memset(out_logprobs, 0, sizeof(float) * (size_t)cells);
  memset(out_lens, 0, sizeof(int64_t) * (size_t)n);
  bool top_p = !o->greedy && o->top_p < 1.0f;
  prompt_ref *refs = ml_malloc_array(n, sizeof *refs, "the prompt order (%lld prompts)",
                                     (long long)n);
  gen_out out = {out_tokens, out_lens, out_logprobs,
                 ml_malloc_array(n, sizeof(bool), "the rows' state (%lld prompts)", (long long)n),
                 ml_malloc_array(n, sizeof(ml_rng), "the rows' draws (%lld prompts)",
                                 (long long)n),
                 top_p ? ml_malloc_array(V, sizeof(weighted), "the top_p sort (vocab_size %lld)",
                                         (long long)V)
                       : NULL};
  int rc = refs && out.done && out.rng && (out.sorted || !top_p) ? 0 : -1;
  for (int64_t k = 0, at = 0; rc == 0 && k < n; at += lens[k], k++)
    refs[k] = (prompt_ref){lens[k], k, at};
  if (rc == 0) qsort(refs, (size_t)n, sizeof *refs, shorter_first);
  /* the model forwards through the KV cache for the call, then as before */
  gen g = {.e = e, .m = m, .kv = {.be = e->be}};
  ml_attn_core core = m->attn_core;
  char what[sizeof m->batch_what];
  memcpy(what, m->batch_what, sizeof what);
  m->attn_core = (ml_attn_core){.saved = kv_saved, .fwd = kv_fwd, .ctx = &g.kv};
  if (rc == 0) rc = run_all(&g, refs, n, tokens, o, &out);
  for (int u = 0; u < e->fsdp.n_units; u++) ml_fsdp_reshard(&e->fsdp, u);
  m->attn_core = core;
  rope_restore(m);
  memcpy(m->batch_what, what, sizeof what);
  free(refs);
  free(out.done);
  free(out.rng);
  free(out.sorted);
  return rc;
}

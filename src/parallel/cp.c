/* Context parallelism: load-balanced sequence split and ring attention
 * (cp.h). */
#include "parallel/cp.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "common/checked.h"
#include "common/status.h"

/* The global chunk index of local chunk a (0 or 1) of cp rank r. */
static int64_t chunk_of(int cp, int r, int a) { return a == 0 ? r : 2 * (int64_t)cp - 1 - r; }

/* Whether some query of global chunk i sees some key of chunk j (chunks of
 * c positions): the diagonal always; an earlier chunk unless a window
 * shuts it out — its last key must lie within the window of the chunk's
 * first query, which is the closest pair. */
static bool visible(int64_t i, int64_t j, int64_t c, int64_t window) {
  if (j != i) return j < i && (window <= 0 || i * c - ((j + 1) * c - 1) < window);
  return true;
}

/* The block of local query chunk a (global chunk qi) against key chunk b
 * (global kj) of a rank's K/V, on the [B, s = 2c, heads, hd] layouts. */
typedef struct ring_block {
  ml_attn_block blk;
  int64_t q_off, k_off, l_off; /* elements into q/out/dout/dq, k/v/dk/dv, lse */
} ring_block;

static ring_block block_of(const ml_cp *cp, const ml_attn_call *c, int a, int b, int src) {
  int64_t ch = cp->chunk, s = 2 * ch;
  ring_block r;
  r.blk = (ml_attn_block){.B = c->B, .sq = ch, .sk = ch, .nh = c->nh, .nkv = c->nkv,
                          .hd = c->hd, .q_pos = chunk_of(cp->size, cp->rank, a) * ch,
                          .k_pos = chunk_of(cp->size, src, b) * ch, .q_bs = s * c->nh * c->hd,
                          .k_bs = s * c->nkv * c->hd, .l_bs = s * c->nh, .scale = c->scale,
                          .window = c->window, .group = c->group, .head_off = c->head_off,
                          .qkv_bf16 = c->qkv_bf16};
  r.q_off = a * ch * c->nh * c->hd;
  r.k_off = b * ch * c->nkv * c->hd;
  r.l_off = a * ch * c->nh;
  return r;
}

/* Bytes of an element of the call's q, k, v and of the K/V the ring carries:
 * bf16 under ml_attn_call.qkv_bf16 (the core declares bf16_qkv), else fp32. */
static size_t qkv_size(const ml_attn_call *c) { return c->qkv_bf16 ? 2 : sizeof(float); }

/* p (q, k, v or K/V in hand) advanced by i elements; the block calls take
 * float pointers, which under qkv_bf16 point at bf16. */
static const float *qkv_at(const ml_attn_call *c, const void *p, int64_t i) {
  return (const float *)((const char *)p + (size_t)i * qkv_size(c));
}
static float *qkv_at_w(const ml_attn_call *c, void *p, int64_t i) {
  return (float *)((char *)p + (size_t)i * qkv_size(c));
}

/* The (query chunk, key chunk) pairs of one ring step, in the order the
 * forward merges them: each query chunk's diagonal block first (it starts
 * the chunk's softmax at step 0), then the other key chunk. */
static const int k_pairs[4][2] = {{0, 0}, {0, 1}, {1, 1}, {1, 0}};

static bool pair_visible(const ml_cp *cp, const ml_attn_call *c, int a, int b, int src) {
  return visible(chunk_of(cp->size, cp->rank, a), chunk_of(cp->size, src, b), cp->chunk,
                 c->window);
}

// step of the forward ring: this rank's queries against the K/V of rank src
// k, v: [B, s, nkv, hd] → out [B, s, nh, hd], lse [B, s, nh] (merged)
static int step_fwd(const ml_cp *cp, const ml_attn_call *c, int src, const float *k,
                    const float *v, float *out, float *lse) {
  for (int p = 0; p < 4; p++) {
    int a = k_pairs[p][0], b = k_pairs[p][1];
    if (!pair_visible(cp, c, a, b, src)) continue;
    ring_block r = block_of(cp, c, a, b, src);
    bool first = src == cp->rank && a == b; /* the diagonal: fresh softmax */
    ML_TRY(ml_be_attention_block_fwd(cp->be, &r.blk, qkv_at(c, c->q, r.q_off),
                                     qkv_at(c, k, r.k_off), qkv_at(c, v, r.k_off), out + r.q_off,
                                     lse + r.l_off, !first, c->compute));
  }
  return 0;
}

// step of the backward ring: dq (+=) of this rank's queries, dk, dv (+=) of rank src's keys; at
// the first step (src: this rank) its diagonal blocks write (=) instead
static int step_bwd(const ml_cp *cp, const ml_attn_call *c, int src, const float *k,
                    const float *v, const float *dout, const float *out, const float *lse,
                    float *dq, float *dk, float *dv, void *work) {
  for (int p = 0; p < 4; p++) {
    int a = k_pairs[p][0], b = k_pairs[p][1];
    if (!pair_visible(cp, c, a, b, src)) continue;
    ring_block r = block_of(cp, c, a, b, src);
    /* The first step (src: this rank) writes: its diagonal blocks come first
     * for their query chunk's dq and key chunk's dk, dv ((0, 1) sees nothing:
     * chunk 1's keys follow chunk 0's queries); every other block adds. */
    r.blk.bwd_overwrite = src == cp->rank && a == b;
    ML_TRY(ml_be_attention_block_bwd(cp->be, &r.blk, dout + r.q_off, qkv_at(c, c->q, r.q_off),
                                     qkv_at(c, k, r.k_off), qkv_at(c, v, r.k_off), out + r.q_off,
                                     lse + r.l_off, dq + r.q_off, dk + r.k_off, dv + r.k_off,
                                     c->compute, work));
  }
  return 0;
}

/* Elements of one rank's K (or V): [B, s, nkv, hd]. */
static int64_t kv_floats(const ml_attn_call *c) { return c->B * c->S * c->nkv * c->hd; }

static int64_t ring_saved(void *ctx, int64_t B, int64_t S, int64_t nh) {
  return ml_mul_sat(ml_mul_sat(B, S), nh); /* lse [B, s, nh] */
}

static void *ring_alloc(ml_cp *cp, int64_t n, size_t size, const char *what) {
  return ml_be_alloc(cp->be, n, size, "the ring attention's %s (%lld elements of %zu bytes)",
                     what, (long long)n, size);
}

/* Finish a pass whatever happened before: buffers are freed after it. */
static int finish(ml_cp *cp, ml_request *req, int rc) {
  int w = ml_wait(cp->comm, req);
  return rc ? rc : w;
}

/* Fixed order (cp->fixed): rank src's K/V chunks in hand ([k | v], each
 * [B, s = 2c, nkv, hd]) copied to their global places in the whole
 * sequence's K/V `full` ([k | v], each [B, S', nkv, hd]; elements of
 * qkv_size). */
static int place_kv(const ml_cp *cp, const ml_attn_call *c, int src, const void *hand,
                    void *full) {
  int64_t ch = cp->chunk, row = c->nkv * c->hd, n = kv_floats(c), nf = c->B * cp->S_pad * row;
  size_t nb = qkv_size(c) * (size_t)(ch * row);
  for (int kv = 0; kv < 2; kv++)
    for (int64_t b = 0; b < c->B; b++)
      for (int a = 0; a < 2; a++)
        ML_TRY(ml_be_copy(
            cp->be, qkv_at_w(c, full, kv * nf + (b * cp->S_pad + chunk_of(cp->size, src, a) * ch) * row),
            qkv_at(c, hand, kv * n + (b * 2 * ch + a * ch) * row), nb, ML_COPY_D2D));
  return 0;
}

/* Fixed order: each local query chunk against the whole sequence's keys
 * up to its end, in one block from global position 0 — the block the
 * batch-invariant forward computes bitwise as one rank's whole-sequence
 * call does (k_attn_block.fixed_order: key tiles at global positions), so
 * the log-probs do not depend on cp. */
static int fixed_fwd(const ml_cp *cp, const ml_attn_call *c, const void *full, float *out,
                     float *lse) {
  int64_t ch = cp->chunk, nf = c->B * cp->S_pad * c->nkv * c->hd;
  for (int a = 0; a < 2; a++) {
    ring_block r = block_of(cp, c, a, 0, cp->rank);
    r.blk.k_pos = 0;
    r.blk.sk = r.blk.q_pos + ch; /* causal: no key after the chunk's last query */
    r.blk.k_bs = cp->S_pad * c->nkv * c->hd;
    ML_TRY(ml_be_attention_block_fwd(cp->be, &r.blk, qkv_at(c, c->q, r.q_off), qkv_at(c, full, 0),
                                     qkv_at(c, full, nf), out + r.q_off, lse + r.l_off, false,
                                     c->compute));
  }
  return 0;
}

/* The wire type of the K/V the ring carries (qkv_size). */
static ml_elem kv_elem(const ml_attn_call *c) { return c->qkv_bf16 ? ML_ELEM_BF16 : ML_ELEM_F32; }

// q [B, s, nh, hd], k, v [B, s, nkv, hd] (bf16 under c->qkv_bf16) → out [B, s, nh·hd], lse [B, s, nh]
static int ring_fwd(void *ctx, const ml_attn_call *c, float *out, float *lse) {
  ml_cp *cp = ctx;
  int64_t n = kv_floats(c), nf = 2 * c->B * cp->S_pad * c->nkv * c->hd;
  size_t nb = qkv_size(c) * (size_t)n;
  /* [k | v] of the rank in hand, and the next; fixed order: the whole
     sequence's [k | v] after them (each in the dtype of the call's k, v) */
  void *buf = ring_alloc(cp, 4 * n + (cp->fixed ? nf : 0), qkv_size(c), "K/V buffers");
  if (!buf) return -1;
  float *kv[2] = {qkv_at_w(c, buf, 0), qkv_at_w(c, buf, 2 * n)}, *full = qkv_at_w(c, buf, 4 * n);
  int rc = ml_be_copy(cp->be, kv[0], c->k, nb, ML_COPY_D2D);
  if (!rc) rc = ml_be_copy(cp->be, qkv_at_w(c, kv[0], n), c->v, nb, ML_COPY_D2D);
  for (int t = 0; rc == 0 && t < cp->size; t++) {
    ml_request req = {0};
    const float *hand = kv[t % 2];
    if (t + 1 < cp->size) /* the next rank's K/V arrive while this block computes */
      rc = ml_iring_pass(cp->comm, hand, kv[(t + 1) % 2], 2 * (size_t)n, kv_elem(c), &req);
    int src = (cp->rank - t + cp->size) % cp->size;
    if (!rc) rc = cp->fixed ? place_kv(cp, c, src, hand, full)
                            : step_fwd(cp, c, src, hand, qkv_at(c, hand, n), out, lse);
    rc = finish(cp, &req, rc);
  }
  if (!rc && cp->fixed) rc = fixed_fwd(cp, c, full, out, lse);
  ml_be_free(cp->be, buf);
  return rc;
}

// dout [B, s, nh·hd] → dq [B, s, nh, hd], dk, dv [B, s, nkv, hd] (=)
static int ring_bwd(void *ctx, const ml_attn_call *c, const float *dout, const float *out,
                    const float *lse, float *dq, float *dk, float *dv) {
  ml_cp *cp = ctx;
  int64_t n = kv_floats(c);
  size_t nb = sizeof(float) * (size_t)n, kb = qkv_size(c) * (size_t)n;
  /* the dK/dV accumulator (fp32) in hand and arriving; this rank's
   * contribution to the accumulator in hand; K/V (the call's dtype) in hand
   * and next: 6n floats + 4n elements of qkv_size */
  float *buf = ring_alloc(cp, 6 * n + (int64_t)qkv_size(c) * n, sizeof(float),
                          "K/V and dK/dV buffers");
  if (!buf) return -1;
  ring_block r0 = block_of(cp, c, 0, 0, cp->rank); /* every block has this size */
  size_t wb = ml_be_attention_block_work(cp->be, &r0.blk);
  void *work = ml_be_alloc(cp->be, 1, wb ? wb : 1, "the ring attention's block workspace (%zu "
                           "bytes)", wb);
  if (!work) {
    ml_be_free(cp->be, buf);
    return -1;
  }
  float *acc[2] = {buf, buf + 2 * n}, *mine = buf + 4 * n;
  float *kv[2] = {buf + 6 * n, qkv_at_w(c, buf + 6 * n, 2 * n)};
  int rc = ml_be_copy(cp->be, kv[0], c->k, kb, ML_COPY_D2D);
  if (!rc) rc = ml_be_copy(cp->be, qkv_at_w(c, kv[0], n), c->v, kb, ML_COPY_D2D);
  ml_request dreq = {0}; /* the accumulator's pass, one step behind its K/V */
  for (int t = 0; rc == 0 && t < cp->size; t++) {
    ml_request kreq = {0};
    const float *hand = kv[t % 2];
    float *a = acc[t % 2], *d = t == 0 ? a : mine;
    if (t + 1 < cp->size)
      rc = ml_iring_pass(cp->comm, hand, kv[(t + 1) % 2], 2 * (size_t)n, kv_elem(c), &kreq);
    int src = (cp->rank - t + cp->size) % cp->size;
    if (!rc && t > 0) rc = ml_be_zero(cp->be, mine, 2 * nb);
    if (!rc)
      rc = step_bwd(cp, c, src, hand, qkv_at(c, hand, n), dout, out, lse, dq, d, d + n, work);
    rc = finish(cp, &dreq, rc); /* src's accumulator, from the rank before */
    if (!rc && t > 0) rc = ml_be_add(cp->be, a, mine, 2 * n);
    /* on to the next rank; after the last step it reaches src, its owner */
    if (!rc && cp->size > 1)
      rc = ml_iring_pass(cp->comm, a, acc[(t + 1) % 2], 2 * (size_t)n, ML_ELEM_F32, &dreq);
    rc = finish(cp, &kreq, rc);
  }
  rc = finish(cp, &dreq, rc);
  float *own = acc[cp->size > 1 ? cp->size % 2 : 0]; /* this rank's K/V's, complete */
  if (!rc) rc = ml_be_copy(cp->be, dk, own, nb, ML_COPY_D2D);
  if (!rc) rc = ml_be_copy(cp->be, dv, own + n, nb, ML_COPY_D2D);
  ml_be_free(cp->be, work);
  ml_be_free(cp->be, buf);
  return rc;
}

int ml_cp_apply(ml_cp *cp, ml_model *m, ml_comm *comm, ml_backend *be, bool fixed) {
  memset(cp, 0, sizeof *cp);
  cp->comm = comm;
  cp->be = be;
  cp->fixed = fixed;
  cp->size = comm->size;
  cp->rank = comm->rank;
  if (cp->size > 1)
    m->attn_core = (ml_attn_core){.saved = ring_saved, .fwd = ring_fwd, .bwd = ring_bwd,
                                  .ctx = cp, .bf16_qkv = true};
  return 0;
}

void ml_cp_destroy(ml_cp *cp) {
  free(cp->position_ids);
  memset(cp, 0, sizeof *cp);
}

int ml_cp_geometry(ml_cp *cp, ml_model *m, int64_t S, int64_t *s_local) {
  if (S < 1) return ml_err("context parallelism: sequence length %lld; expected >= 1", (long long)S);
  int64_t parts = 2 * (int64_t)cp->size;
  if (S > INT32_MAX - parts)
    return ml_err("context parallelism: sequence length %lld padded to a multiple of 2 x cp = "
                  "%lld exceeds int32 positions",
                  (long long)S, (long long)parts);
  if (cp->size == 1) {
    cp->S = cp->S_pad = *s_local = S;
    return 0;
  }
  int64_t pad = (S + parts - 1) / parts * parts, ch = pad / parts;
  if (cp->S_pad != pad) {
    int64_t *pos = ml_malloc(sizeof *pos * (size_t)(2 * ch), "the position ids");
    if (!pos) return -1;
    free(cp->position_ids);
    cp->position_ids = pos;
    for (int a = 0; a < 2; a++)
      for (int64_t i = 0; i < ch; i++) pos[a * ch + i] = chunk_of(cp->size, cp->rank, a) * ch + i;
  }
  cp->S = S;
  cp->S_pad = pad;
  cp->chunk = ch;
  *s_local = 2 * ch;
  /* RoPE's length-dependent scalings take the whole sequence's length, not
   * the piece's: a new length in the same geometry rebuilds the tables
   * (ml_model_begin keeps them); a new geometry's ml_model_begin builds them */
  bool rebuild = m->rope_len != S && m->S == *s_local;
  m->rope_len = S;
  m->position_ids = cp->position_ids;
  return rebuild ? ml_model_set_positions(m, cp->position_ids) : 0;
}

void ml_cp_local_values(const ml_cp *cp, const void *in, int64_t B, size_t size, const void *pad,
                        void *out) {
  const char *src = in;
  char *dst = out;
  int64_t S = cp->S;
  if (cp->size == 1) {
    memcpy(dst, src, size * (size_t)(B * S));
    return;
  }
  int64_t ch = cp->chunk, s = 2 * ch;
  for (int64_t b = 0; b < B; b++)
    for (int a = 0; a < 2; a++)
      for (int64_t i = 0, g = chunk_of(cp->size, cp->rank, a) * ch; i < ch; i++, g++)
        memcpy(dst + size * (size_t)(b * s + a * ch + i),
               g < S ? src + size * (size_t)(b * S + g) : (const char *)pad, size);
}

void ml_cp_local_tokens(const ml_cp *cp, const int32_t *in, int64_t B, int32_t pad,
                        int32_t *out) {
  ml_cp_local_values(cp, in, B, sizeof *in, &pad, out);
}

int ml_cp_gather_tokens(const ml_cp *cp, const float *local, int64_t B, float *work, float *host,
                        float *out) {
  int64_t S = cp->S, ch = cp->chunk, s = cp->size == 1 ? S : 2 * ch, n = B * s;
  ML_TRY(ml_all_gather(cp->comm, local, work, (size_t)n));
  ML_TRY(ml_be_copy(cp->be, host, work, sizeof(float) * (size_t)n * (size_t)cp->size,
                    ML_COPY_D2H));
  if (cp->size == 1) {
    memcpy(out, host, sizeof *out * (size_t)n);
    return 0;
  }
  for (int r = 0; r < cp->size; r++)
    for (int64_t b = 0; b < B; b++)
      for (int a = 0; a < 2; a++)
        for (int64_t i = 0, g = chunk_of(cp->size, r, a) * ch; i < ch && g < S; i++, g++)
          out[b * S + g] = host[r * n + b * s + a * ch + i];
  return 0;
}

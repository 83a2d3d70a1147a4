/* ml_tokenizer_encode: tokenizers' TokenizerImpl::encode_single_sequence
 * then post_process (tokenizers/src/tokenizer/mod.rs), piece by piece.
 *
 * Every stage after the first works on each piece of the previous stage
 * independently, so the stages run depth first: a piece goes through
 * normalization, the normalized added tokens, each pre-tokenizer step and
 * the model before the next piece starts. The ids are those of the
 * stage-by-stage order of tokenizers. */
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "tokenizer/tok_impl.h"
#include "tokenizer/tok_util.h"

/* The pieces of pre-tokenizer step k and the text it made (a prefix space). */
typedef struct level {
  tok_span *sp;
  size_t n, cap;
  tok_buf buf;
} level;

typedef struct ctx {
  const ml_tokenizer *t;
  ml_tokens *out;
  tok_match_state ms;
  tok_bpe_work bpe;
  tok_buf norm, norm_tmp;  /* the current piece, normalized */
  tok_aspan *raw, *normed; /* added-token splits of the text, of a normalized piece */
  size_t raw_n, raw_cap, normed_n, normed_cap;
  level *lv; /* one per pre-tokenizer step */
} ctx;

void ml_tokens_free(ml_tokens *t) {
  free(t->ids);
  memset(t, 0, sizeof *t);
}

/* Append ids[0..n); n = 0 (an empty side of the template: ids may be NULL) appends nothing. */
static int push_ids(ml_tokens *out, const int32_t *ids, size_t n) {
  if (n == 0) return 0;
  ML_TRY(tok_reserve(&out->ids, &out->cap, out->n + n, sizeof *out->ids, "token ids"));
  memcpy(out->ids + out->n, ids, n * sizeof *ids);
  out->n += n;
  return 0;
}

/* Pre-tokenizer step k on one piece, then the model on what it cuts. */
static int pretok(ctx *c, size_t k, const char *s, size_t len) {
  const tok_pretok *p = &c->t->pretok;
  if (k == p->n)
    return tok_bpe_encode(&c->t->bpe, &c->bpe, s, len, &c->out->ids, &c->out->n, &c->out->cap);
  const tok_pre_step *st = &p->steps[k];
  level *L = &c->lv[k];
  if (st->kind == TOK_PRE_BYTELEVEL) {
    if (st->add_prefix_space && s[0] != ' ') {
      L->buf.n = 0;
      ML_TRY(tok_buf_put(&L->buf, " ", 1));
      ML_TRY(tok_buf_put(&L->buf, s, len));
      s = L->buf.p;
      len = L->buf.n;
    }
    if (!st->use_regex) return pretok(c, k + 1, s, len);
  }
  L->n = 0;
  ML_TRY(tok_pretok_split(st, &c->ms, s, len, &L->sp, &L->n, &L->cap));
  for (size_t i = 0; i < L->n; i++)
    ML_TRY(pretok(c, k + 1, s + L->sp[i].start, L->sp[i].end - L->sp[i].start));
  return 0;
}

/* A piece of the text between raw added tokens: normalize it, split out
 * the normalized added tokens, pre-tokenize and encode the rest. */
static int segment(ctx *c, const char *s, size_t len) {
  const ml_tokenizer *t = c->t;
  if (t->norm.n) {
    ML_TRY(tok_norm_apply(&t->norm, &c->ms, s, len, &c->norm, &c->norm_tmp));
    s = c->norm.p;
    len = c->norm.n;
  }
  if (len == 0) return 0;
  if (t->added.norm.nodes == 0) return pretok(c, 0, s, len);
  c->normed_n = 0;
  ML_TRY(
      tok_added_split(&t->added, true, &c->ms, s, len, &c->normed, &c->normed_n, &c->normed_cap));
  for (size_t i = 0; i < c->normed_n; i++) {
    const tok_aspan *a = &c->normed[i];
    if (a->id >= 0)
      ML_TRY(push_ids(c->out, &a->id, 1));
    else if (a->end > a->start)
      ML_TRY(pretok(c, 0, s + a->start, a->end - a->start));
  }
  return 0;
}

static int run(ctx *c, const char *text, size_t len, bool add_special) {
  const ml_tokenizer *t = c->t;
  size_t bad;
  if (!tok_utf8_valid(text, len, &bad))
    return ml_err("text is not valid UTF-8: byte 0x%02X at byte offset %zu",
                  (unsigned char)text[bad], bad);
  if (t->pretok.n) {
    c->lv = ml_calloc(t->pretok.n, sizeof *c->lv, "pre-tokenizer work space");
    if (!c->lv) return -1;
  }
  if (add_special) ML_TRY(push_ids(c->out, t->post.pre, t->post.n_pre));
  if (t->added.raw.nodes == 0) {
    if (len) ML_TRY(segment(c, text, len));
  } else {
    ML_TRY(tok_added_split(&t->added, false, &c->ms, text, len, &c->raw, &c->raw_n, &c->raw_cap));
    for (size_t i = 0; i < c->raw_n; i++) {
      const tok_aspan *a = &c->raw[i];
      if (a->id >= 0)
        ML_TRY(push_ids(c->out, &a->id, 1));
      else if (a->end > a->start)
        ML_TRY(segment(c, text + a->start, a->end - a->start));
    }
  }
  if (add_special) ML_TRY(push_ids(c->out, t->post.post, t->post.n_post));
  return 0;
}

int ml_tokenizer_encode(const ml_tokenizer *t, const char *text, size_t len, bool add_special,
                        ml_tokens *out) {
  ctx c = {.t = t, .out = out};
  size_t n0 = out->n;
  int rc = run(&c, text, len, add_special);
  if (rc) out->n = n0; /* nothing half-appended */
  tok_match_state_free(&c.ms);
  tok_bpe_work_free(&c.bpe);
  tok_buf_free(&c.norm);
  tok_buf_free(&c.norm_tmp);
  free(c.raw);
  free(c.normed);
  for (size_t k = 0; c.lv && k < t->pretok.n; k++) {
    free(c.lv[k].sp);
    tok_buf_free(&c.lv[k].buf);
  }
  free(c.lv);
  return rc;
}

#include "tokenizer/tok_bpe.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "tokenizer/tok_bytelevel.h"
#include "tokenizer/tok_cache.h"
#include "tokenizer/tok_util.h"

/* ---- loading ---------------------------------------------------------- */

static int load_vocab(tok_bpe *m, const json_t *vocab, const char *file) {
  if (!json_is_object(vocab)) return tok_bad(file, "model.vocab", vocab, "an object token → id");
  m->max_id = -1;
  size_t tokens = json_object_size(vocab); /* distinct: duplicate keys are refused */
  for (void *it = json_object_iter((json_t *)vocab); it;
       it = json_object_iter_next((json_t *)vocab, it)) {
    const char *key = json_object_iter_key(it);
    const json_t *v = json_object_iter_value(it);
    char f[300];
    snprintf(f, sizeof f, "model.vocab[\"%.200s\"]", key);
    int32_t id;
    ML_TRY(tok_id(file, f, v, tokens, &id));
    ML_TRY(tok_strmap_put(&m->vocab, key, json_object_iter_key_len(it), id));
    if (id > m->max_id) m->max_id = id;
  }
  m->vocab_len = m->vocab.n;
  m->id_ent = ml_malloc(((size_t)m->max_id + 1) * sizeof *m->id_ent, "vocabulary by id");
  if (!m->id_ent) return -1;
  memset(m->id_ent, 0xFF, ((size_t)m->max_id + 1) * sizeof *m->id_ent);
  for (size_t i = 0; i < m->vocab.n; i++) m->id_ent[m->vocab.ents[i].val] = (int32_t)i;
  return 0;
}

/* One merge (item `i` of model.merges) as its two tokens. */
static int merge_parts(const json_t *item, size_t i, bool pairs, const char *file, const char **a,
                       size_t *alen, const char **b, size_t *blen) {
  char f[64];
  snprintf(f, sizeof f, "model.merges[%zu]", i);
  if (pairs) {
    if (!json_is_array(item) || json_array_size(item) != 2 ||
        !json_is_string(json_array_get(item, 0)) || !json_is_string(json_array_get(item, 1)))
      return tok_bad(file, f, item, "a pair [\"a\", \"b\"] like the merges before it");
    *a = json_string_value(json_array_get(item, 0));
    *alen = json_string_length(json_array_get(item, 0));
    *b = json_string_value(json_array_get(item, 1));
    *blen = json_string_length(json_array_get(item, 1));
    return 0;
  }
  if (!json_is_string(item))
    return tok_bad(file, f, item, "a string \"a b\" like the merges before it");
  const char *s = json_string_value(item);
  size_t len = json_string_length(item);
  const char *sp = memchr(s, ' ', len);
  if (!sp || memchr(sp + 1, ' ', len - (size_t)(sp + 1 - s)))
    return tok_bad(file, f, item, "two tokens separated by one space");
  *a = s;
  *alen = (size_t)(sp - s);
  *b = sp + 1;
  *blen = len - *alen - 1;
  return 0;
}

static int load_merges(tok_bpe *m, const json_t *merges, const char *file) {
  if (!json_is_array(merges)) return tok_bad(file, "model.merges", merges, "an array");
  size_t n = json_array_size(merges);
  bool pairs = n > 0 && json_is_array(json_array_get(merges, 0));
  m->merge_new = ml_malloc((n ? n : 1) * sizeof *m->merge_new, "BPE merges");
  if (!m->merge_new) return -1;
  tok_buf joined = {0};
  int rc = 0;
  for (size_t i = 0; i < n && rc == 0; i++) {
    const json_t *item = json_array_get(merges, i);
    const char *a = NULL, *b = NULL;
    size_t alen = 0, blen = 0;
    if ((rc = merge_parts(item, i, pairs, file, &a, &alen, &b, &blen))) break;
    if (!pairs && alen >= 8 && memcmp(a, "#version", 8) == 0) continue; /* merges.txt header */
    joined.n = 0;
    if ((rc = tok_buf_put(&joined, a, alen)) || (rc = tok_buf_put(&joined, b, blen))) break;
    int32_t ia = tok_strmap_get(&m->vocab, a, alen), ib = tok_strmap_get(&m->vocab, b, blen);
    int32_t in = tok_strmap_get(&m->vocab, joined.p, joined.n);
    if (ia < 0 || ib < 0 || in < 0) {
      char f[64], what[300];
      snprintf(f, sizeof f, "model.merges[%zu]", i);
      snprintf(what, sizeof what, "tokens of the vocabulary (\"%.*s\" is not)",
               (int)(ia < 0   ? (alen > 100 ? 100 : alen)
                     : ib < 0 ? (blen > 100 ? 100 : blen)
                              : (joined.n > 100 ? 100 : joined.n)),
               ia < 0   ? a
               : ib < 0 ? b
                        : joined.p);
      rc = tok_bad(file, f, item, what);
      break;
    }
    size_t rank = m->n_merges++;
    m->merge_new[rank] = in;
    rc = tok_u64map_put(&m->merges, (uint64_t)ia << 32 | (uint32_t)ib, (uint32_t)rank);
  }
  tok_buf_free(&joined);
  return rc;
}

/* An optional string option that must be null or "". */
static int refuse_affix(const json_t *model, const char *key, const char *file) {
  const json_t *v = json_object_get(model, key);
  if (!v || json_is_null(v) || (json_is_string(v) && json_string_length(v) == 0)) return 0;
  char f[64];
  snprintf(f, sizeof f, "model.%s", key);
  return tok_bad(file, f, v, "null or \"\" (meshlm does not implement subword affixes)");
}

int tok_bpe_load(tok_bpe *m, const json_t *model, const char *file) {
  memset(m, 0, sizeof *m);
  if (!json_is_object(model)) return tok_bad(file, "model", model, "an object");
  const json_t *type = json_object_get(model, "type");
  if (!json_is_string(type) || strcmp(json_string_value(type), "BPE") != 0)
    return tok_bad(file, "model.type", type, "\"BPE\" (the one model meshlm implements)");
  const json_t *dropout = json_object_get(model, "dropout");
  if (dropout && !json_is_null(dropout) &&
      !(json_is_number(dropout) && json_number_value(dropout) == 0.0))
    return tok_bad(file, "model.dropout", dropout, "null (meshlm encodes deterministically)");
  ML_TRY(refuse_affix(model, "continuing_subword_prefix", file));
  ML_TRY(refuse_affix(model, "end_of_word_suffix", file));
  ML_TRY(tok_bool(file, model, "model", "fuse_unk", false, &m->fuse_unk));
  ML_TRY(tok_bool(file, model, "model", "byte_fallback", false, &m->byte_fallback));
  ML_TRY(tok_bool(file, model, "model", "ignore_merges", false, &m->ignore_merges));
  const json_t *unk = json_object_get(model, "unk_token");
  if (unk && !json_is_null(unk)) {
    if (!json_is_string(unk)) return tok_bad(file, "model.unk_token", unk, "a string or null");
    m->unk = json_string_value(unk);
    m->unk_len = json_string_length(unk);
  }
  m->serial = tok_cache_serial();
  ML_TRY(load_vocab(m, json_object_get(model, "vocab"), file));
  ML_TRY(load_merges(m, json_object_get(model, "merges"), file));
  for (int b = 0; b < 256; b++) {
    char name[8];
    snprintf(name, sizeof name, "<0x%02X>", b);
    m->byte_fb[b] = tok_strmap_get(&m->vocab, name, 6);
  }
  return 0;
}

int tok_bpe_set_byte_level(tok_bpe *m) {
  m->byte_level = true;
  tok_buf raw = {0};
  for (size_t i = 0; i < m->vocab.n; i++) {
    const tok_strent *e = &m->vocab.ents[i];
    if (tok_reserve(&raw.p, &raw.cap, e->len ? e->len : 1, 1, "byte-level vocabulary")) {
      tok_buf_free(&raw);
      return -1;
    }
    long n = tok_bytelevel_unmap(tok_strmap_key(&m->vocab, i), e->len, raw.p);
    if (n >= 0 && tok_strmap_put(&m->raw_vocab, raw.p, (size_t)n, e->val)) {
      tok_buf_free(&raw);
      return -1;
    }
  }
  tok_buf_free(&raw);
  for (int b = 0; b < 256; b++) {
    char u[4];
    size_t n = tok_byte_to_utf8((unsigned char)b, u);
    m->byte_id[b] = tok_strmap_get(&m->vocab, u, n);
  }
  return 0;
}

void tok_bpe_free(tok_bpe *m) {
  tok_strmap_free(&m->vocab);
  tok_strmap_free(&m->raw_vocab);
  tok_u64map_free(&m->merges);
  free(m->merge_new);
  free(m->id_ent);
  memset(m, 0, sizeof *m);
}

const char *tok_bpe_token(const tok_bpe *m, int32_t id, size_t *len) {
  if (id < 0 || id > m->max_id || m->id_ent[id] < 0) return NULL;
  *len = m->vocab.ents[m->id_ent[id]].len;
  return tok_strmap_key(&m->vocab, (size_t)m->id_ent[id]);
}

/* ---- encoding (word.rs) ----------------------------------------------- */

struct tok_sym {
  int32_t id, prev, next;
  uint32_t len; /* bytes covered; 0 = merged into its left neighbour */
};

typedef struct word {
  tok_bpe_work *w;
  size_t n;
  int32_t unk_id; /* a pending unknown (−1: none) and its length */
  uint32_t unk_len;
} word;

static int add(word *wd, int32_t id, uint32_t len) {
  tok_bpe_work *w = wd->w;
  ML_TRY(tok_reserve(&w->syms, &w->syms_cap, wd->n + 1, sizeof *w->syms, "BPE word"));
  int32_t i = (int32_t)wd->n;
  if (i > 0) w->syms[i - 1].next = i;
  w->syms[wd->n++] = (struct tok_sym){id, i - 1, -1, len};
  return 0;
}

static int flush_unk(word *wd) {
  if (wd->unk_id < 0) return 0;
  int32_t id = wd->unk_id;
  wd->unk_id = -1;
  return add(wd, id, wd->unk_len);
}

/* merge_word's step for one char: `id` its vocabulary id (−1: none), `key`
 * the char as the model sees it (for <0xNN> byte fallback), `len` the bytes
 * it covers. */
static int add_char(const tok_bpe *m, word *wd, int32_t id, const char *key, size_t klen,
                    uint32_t len) {
  if (id >= 0) {
    ML_TRY(flush_unk(wd));
    return add(wd, id, len);
  }
  if (m->byte_fallback) {
    bool all = true;
    for (size_t k = 0; k < klen; k++) all = all && m->byte_fb[(unsigned char)key[k]] >= 0;
    if (all) { /* as model.rs: a pending unknown stays pending */
      for (size_t k = 0; k < klen; k++) ML_TRY(add(wd, m->byte_fb[(unsigned char)key[k]], 1));
      return 0;
    }
  }
  if (!m->unk) return 0; /* no unk_token: the char is dropped */
  if (wd->unk_id >= 0 && m->fuse_unk) {
    wd->unk_len += len;
    return 0;
  }
  ML_TRY(flush_unk(wd));
  int32_t unk = tok_strmap_get(&m->vocab, m->unk, m->unk_len);
  if (unk < 0)
    return ml_err("tokenizer: unk_token \"%.*s\" is needed but not in the vocabulary",
                  (int)(m->unk_len > 100 ? 100 : m->unk_len), m->unk);
  wd->unk_id = unk;
  wd->unk_len = len;
  return 0;
}

static int heap_push(tok_bpe_work *w, size_t *n, uint64_t key) {
  ML_TRY(tok_reserve(&w->heap, &w->heap_cap, *n + 1, sizeof *w->heap, "BPE merge queue"));
  uint64_t *h = w->heap;
  size_t i = (*n)++;
  while (i > 0 && h[(i - 1) / 2] > key) {
    h[i] = h[(i - 1) / 2];
    i = (i - 1) / 2;
  }
  h[i] = key;
  return 0;
}

static uint64_t heap_pop(uint64_t *h, size_t *n) {
  uint64_t top = h[0], last = h[--*n];
  size_t i = 0;
  for (;;) {
    size_t c = 2 * i + 1;
    if (c >= *n) break;
    if (c + 1 < *n && h[c + 1] < h[c]) c++;
    if (h[c] >= last) break;
    h[i] = h[c];
    i = c;
  }
  h[i] = last;
  return top;
}

/* Queue the merge of symbols `left` and its right neighbour, if any. */
static int queue_pair(const tok_bpe *m, tok_bpe_work *w, size_t *hn, int32_t left, int32_t right) {
  uint32_t rank;
  if (!tok_u64map_get(&m->merges, (uint64_t)w->syms[left].id << 32 | (uint32_t)w->syms[right].id,
                      &rank))
    return 0;
  return heap_push(w, hn, (uint64_t)rank << 32 | (uint32_t)left);
}

/* word.rs merge_all without dropout: a min-heap on (rank, position). */
static int merge_all(const tok_bpe *m, tok_bpe_work *w, size_t n) {
  size_t hn = 0;
  for (size_t i = 0; i + 1 < n; i++) ML_TRY(queue_pair(m, w, &hn, (int32_t)i, (int32_t)i + 1));
  struct tok_sym *s = w->syms;
  while (hn > 0) {
    uint64_t top = heap_pop(w->heap, &hn);
    uint32_t rank = (uint32_t)(top >> 32);
    int32_t pos = (int32_t)(uint32_t)top;
    if (s[pos].len == 0 || s[pos].next == -1) continue;
    int32_t next = s[pos].next;
    uint32_t cur;
    /* an expired entry: the pair at pos no longer makes this merge's token */
    if (!tok_u64map_get(&m->merges, (uint64_t)s[pos].id << 32 | (uint32_t)s[next].id, &cur) ||
        m->merge_new[cur] != m->merge_new[rank])
      continue;
    s[pos].id = m->merge_new[rank];
    s[pos].len += s[next].len;
    s[pos].next = s[next].next;
    s[next].len = 0;
    if (s[pos].next >= 0) s[s[pos].next].prev = pos;
    if (s[pos].prev >= 0) ML_TRY(queue_pair(m, w, &hn, s[pos].prev, pos));
    if (s[pos].next >= 0) ML_TRY(queue_pair(m, w, &hn, pos, s[pos].next));
  }
  return 0;
}

/* merge_word: the word's symbols, merged. */
static int merge_word(const tok_bpe *m, tok_bpe_work *w, const char *s, size_t len, size_t *n) {
  word wd = {w, 0, -1, 0};
  if (m->byte_level) {
    for (size_t i = 0; i < len; i++) {
      unsigned char b = (unsigned char)s[i];
      char key[4];
      size_t klen = tok_byte_to_utf8(b, key);
      ML_TRY(add_char(m, &wd, m->byte_id[b], key, klen, (uint32_t)klen));
    }
  } else {
    for (size_t i = 0; i < len;) {
      size_t cl = tok_utf8_len((unsigned char)s[i]);
      ML_TRY(add_char(m, &wd, tok_strmap_get(&m->vocab, s + i, cl), s + i, cl, (uint32_t)cl));
      i += cl;
    }
  }
  ML_TRY(flush_unk(&wd));
  ML_TRY(merge_all(m, w, wd.n));
  *n = wd.n;
  return 0;
}

int tok_bpe_encode(const tok_bpe *m, tok_bpe_work *w, const char *s, size_t len, int32_t **ids,
                   size_t *n, size_t *cap) {
  if (len == 0) return 0;
  if (m->ignore_merges) {
    int32_t id = tok_strmap_get(m->byte_level ? &m->raw_vocab : &m->vocab, s, len);
    if (id >= 0) {
      ML_TRY(tok_reserve(ids, cap, *n + 1, sizeof **ids, "token ids"));
      (*ids)[(*n)++] = id;
      return 0;
    }
  }
  uint64_t h = len <= TOK_CACHE_KEY ? tok_hash_bytes(s, len) : 0;
  ML_TRY(tok_reserve(ids, cap, *n + TOK_CACHE_IDS, sizeof **ids, "token ids"));
  size_t hit;
  if (h && tok_cache_get(m->serial, h, s, len, *ids + *n, &hit)) {
    *n += hit;
    return 0;
  }
  size_t nsym, n0 = *n;
  ML_TRY(merge_word(m, w, s, len, &nsym));
  ML_TRY(tok_reserve(ids, cap, *n + nsym, sizeof **ids, "token ids"));
  for (size_t i = 0; i < nsym; i++)
    if (w->syms[i].len) (*ids)[(*n)++] = w->syms[i].id;
  if (h) tok_cache_put(m->serial, h, s, len, *ids + n0, *n - n0);
  return 0;
}

void tok_bpe_work_free(tok_bpe_work *w) {
  free(w->syms);
  free(w->heap);
  memset(w, 0, sizeof *w);
}

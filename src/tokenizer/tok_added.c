#include "tokenizer/tok_added.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "tokenizer/tok_util.h"

/* Rust regex's Unicode \w (UTS #18 Annex C), which added_vocabulary.rs
 * uses for single_word. */
static const char WORD_RE[] = "[\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\p{Join_Control}]";

static int trie_node(tok_trie *t) {
  ML_TRY(tok_reserve(&t->term, &t->cap, t->nodes + 1, sizeof *t->term, "added-token trie"));
  t->term[t->nodes++] = -1;
  return 0;
}

static int trie_add(tok_trie *t, const char *s, size_t len, int32_t index) {
  if (t->nodes == 0) ML_TRY(trie_node(t));
  uint32_t node = 0;
  for (size_t i = 0; i < len; i++) {
    uint64_t key = (uint64_t)node << 8 | (unsigned char)s[i];
    uint32_t child;
    if (!tok_u64map_get(&t->edges, key, &child)) {
      child = (uint32_t)t->nodes;
      ML_TRY(trie_node(t));
      ML_TRY(tok_u64map_put(&t->edges, key, child));
    }
    node = child;
  }
  t->first[(unsigned char)s[0]] = true;
  t->term[node] = index;
  return 0;
}

static void trie_free(tok_trie *t) {
  tok_u64map_free(&t->edges);
  free(t->term);
  memset(t, 0, sizeof *t);
}

/* The leftmost-longest match in s[from..len): 1 with [*ms, *me) and the
 * token index, or 0. */
static int trie_find(const tok_trie *t, const char *s, size_t len, size_t from, size_t *ms,
                     size_t *me, int32_t *index) {
  if (t->nodes == 0) return 0;
  for (size_t i = from; i < len; i++) {
    if (!t->first[(unsigned char)s[i]]) continue;
    uint32_t node = 0;
    int32_t best = -1;
    size_t end = 0;
    for (size_t j = i; j < len; j++) {
      if (!tok_u64map_get(&t->edges, (uint64_t)node << 8 | (unsigned char)s[j], &node)) break;
      if (t->term[node] >= 0) {
        best = t->term[node];
        end = j + 1;
      }
    }
    if (best >= 0) {
      *ms = i;
      *me = end;
      *index = best;
      return 1;
    }
  }
  return 0;
}

static int load_token(const json_t *e, size_t i, const char *file, tok_added_token *t) {
  char f[64];
  snprintf(f, sizeof f, "added_tokens[%zu]", i);
  if (!json_is_object(e)) return tok_bad(file, f, e, "an object");
  ML_TRY(tok_str(file, e, f, "content", &t->content, &t->len));
  ML_TRY(tok_bool(file, e, f, "special", false, &t->special));
  ML_TRY(tok_bool(file, e, f, "normalized", !t->special, &t->normalized));
  ML_TRY(tok_bool(file, e, f, "lstrip", false, &t->lstrip));
  ML_TRY(tok_bool(file, e, f, "rstrip", false, &t->rstrip));
  return tok_bool(file, e, f, "single_word", false, &t->single_word);
}

/* The tries, from the final token list. */
static int build_tries(tok_added *a, const tok_normalizer *nm) {
  tok_buf normed = {0}, tmp = {0};
  tok_match_state ms = {0};
  int rc = 0;
  for (size_t i = 0; i < a->n && rc == 0; i++) {
    tok_added_token *t = &a->tok[i];
    if (!t->normalized) {
      rc = trie_add(&a->raw, t->content, t->len, (int32_t)i);
      continue;
    }
    const char *pat = t->content;
    size_t plen = t->len;
    if (nm->n) {
      if ((rc = tok_norm_apply(nm, &ms, t->content, t->len, &normed, &tmp))) break;
      pat = normed.p;
      plen = normed.n;
      if (plen != t->len || memcmp(pat, t->content, plen) != 0) {
        if (!(t->normed = ml_malloc(plen, "added token")))
          rc = -1;
        else
          memcpy(t->normed, pat, plen);
        t->normed_len = plen;
      }
    }
    if (rc == 0 && plen) rc = trie_add(&a->norm, pat, plen, (int32_t)i);
  }
  tok_buf_free(&normed);
  tok_buf_free(&tmp);
  tok_match_state_free(&ms);
  return rc;
}

int tok_added_load(tok_added *a, const json_t *list, const tok_bpe *model, const tok_normalizer *nm,
                   const char *file) {
  memset(a, 0, sizeof *a);
  a->max_id = -1;
  if (list && !json_is_array(list)) return tok_bad(file, "added_tokens", list, "an array");
  tok_strmap ids = {0}; /* content → id of the tokens added so far */
  int64_t next_id = (int64_t)model->vocab_len;
  int rc = 0;
  for (size_t i = 0; list && i < json_array_size(list) && rc == 0; i++) {
    tok_added_token t = {0};
    if ((rc = load_token(json_array_get(list, i), i, file, &t))) break;
    if (t.len == 0) continue; /* tokenizers ignores empty tokens */
    int32_t id = tok_strmap_get(&ids, t.content, t.len);
    if (id < 0) id = tok_strmap_get(&model->vocab, t.content, t.len);
    if (id < 0) {
      if (next_id > INT32_MAX) {
        rc = ml_err("%s: field 'added_tokens[%zu]': found more ids than 2^31", file, i);
        break;
      }
      id = (int32_t)next_id++;
    }
    t.id = id;
    uint32_t slot;
    if (tok_u64map_get(&a->by_id, (uint64_t)id, &slot)) {
      a->tok[slot] = t; /* a later token of the same id replaces the earlier one */
    } else {
      if ((rc = tok_reserve(&a->tok, &a->cap, a->n + 1, sizeof *a->tok, "added tokens"))) break;
      a->tok[a->n] = t;
      if ((rc = tok_u64map_put(&a->by_id, (uint64_t)id, (uint32_t)a->n++))) break;
    }
    if (id > a->max_id) a->max_id = id;
    rc = tok_strmap_put(&ids, t.content, t.len, id);
  }
  tok_strmap_free(&ids);
  if (rc == 0) rc = build_tries(a, nm);
  if (rc == 0) rc = tok_regex_compile(&a->word, WORD_RE, strlen(WORD_RE), false, file, "\\w");
  return rc;
}

void tok_added_free(tok_added *a) {
  for (size_t i = 0; i < a->n; i++) free(a->tok[i].normed);
  free(a->tok);
  tok_u64map_free(&a->by_id);
  trie_free(&a->raw);
  trie_free(&a->norm);
  tok_regex_free(&a->word);
  memset(a, 0, sizeof *a);
}

const tok_added_token *tok_added_by_id(const tok_added *a, int32_t id) {
  uint32_t slot;
  if (id < 0 || !tok_u64map_get(&a->by_id, (uint64_t)id, &slot)) return NULL;
  return &a->tok[slot];
}

/* Rust's char::is_whitespace / regex \s: the Unicode White_Space chars. */
static bool white_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

/* Start of the char that ends at s[end] (exclusive), end > 0. */
static size_t char_before(const char *s, size_t end) {
  size_t i = end - 1;
  while (i > 0 && ((unsigned char)s[i] & 0xC0) == 0x80) i--;
  return i;
}

static int is_word(const tok_added *a, tok_match_state *ms, const char *c, bool *w) {
  return tok_regex_match_at_start(&a->word, ms, c, tok_utf8_len((unsigned char)*c), w);
}

static int push(tok_aspan **sp, size_t *n, size_t *cap, size_t a, size_t b, int32_t id) {
  ML_TRY(tok_reserve(sp, cap, *n + 1, sizeof **sp, "added-token splits"));
  (*sp)[(*n)++] = (tok_aspan){a, b, id};
  return 0;
}

int tok_added_split(const tok_added *a, bool normalized, tok_match_state *ms, const char *s,
                    size_t len, tok_aspan **sp, size_t *n, size_t *cap) {
  if (len == 0) return push(sp, n, cap, 0, 0, -1);
  const tok_trie *t = normalized ? &a->norm : &a->raw;
  size_t done = 0, from = 0, ms0, me;
  int32_t index;
  while (trie_find(t, s, len, from, &ms0, &me, &index)) {
    from = me;
    const tok_added_token *tk = &a->tok[index];
    size_t start = ms0, stop = me;
    if (tk->single_word) {
      bool before = false, after = false;
      if (start > 0) ML_TRY(is_word(a, ms, s + char_before(s, start), &before));
      if (stop < len) ML_TRY(is_word(a, ms, s + stop, &after));
      if (before || after) continue; /* not a whole word */
    }
    if (tk->lstrip) {
      size_t ns = start;
      while (ns > 0 && white_space(tok_utf8_decode(s + char_before(s, ns))))
        ns = char_before(s, ns);
      start = ns > done ? ns : done; /* spaces a previous match took stay with it */
    }
    if (tk->rstrip)
      while (stop < len && white_space(tok_utf8_decode(s + stop)))
        stop += tok_utf8_len((unsigned char)s[stop]);
    if (done < start) ML_TRY(push(sp, n, cap, done, start, -1));
    ML_TRY(push(sp, n, cap, start, stop, tk->id));
    done = stop;
  }
  if (done != len) ML_TRY(push(sp, n, cap, done, len, -1));
  return 0;
}

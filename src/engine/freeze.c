#define _POSIX_C_SOURCE 200809L

#include "engine/freeze.h"

#include <fnmatch.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"

/* The parameters matching pattern `pat` (by name, or by the fused
 * checkpoint tensor holding them) marked frozen; their count. */
static int freeze_matching(ml_model *m, const char *pat) {
  int n = 0;
  for (int i = 0; i < m->n_params; i++)
    if (fnmatch(pat, m->params[i].name, 0) == 0 || fnmatch(pat, m->params[i].key, 0) == 0) {
      m->params[i].frozen = true;
      n++;
    }
  return n;
}

static int no_match(const ml_model *m, const char *pat) {
  bool tied = m->lm_head.weight == m->embed_tokens.weight;
  if (tied && strstr(pat, "lm_head"))
    return ml_err("freeze (--freeze): pattern '%s' matches no parameter: lm_head.weight is tied "
                  "to %s (tie_word_embeddings), the one parameter named_parameters() lists; "
                  "expected a pattern matching %s to freeze both",
                  pat, m->embed_tokens.weight->name, m->embed_tokens.weight->name);
  return ml_err("freeze (--freeze): pattern '%s' matches no parameter; expected fnmatch patterns "
                "over HF parameter names such as %s or %s",
                pat, m->params[0].name, m->params[m->n_params - 1].name);
}

int ml_freeze_apply(ml_model *m, const char *patterns) {
  for (int i = 0; i < m->n_params; i++) m->params[i].frozen = false;
  if (!patterns || !*patterns) return 0;
  char *list = strdup(patterns);
  if (!list) return ml_err("freeze (--freeze): out of memory copying '%s'", patterns);
  int rc = 0, k = 0;
  for (char *s = list, *end; rc == 0 && s; s = end ? end + 1 : NULL, k++) {
    end = strchr(s, ',');
    if (end) *end = '\0';
    s += strspn(s, " \t");
    for (size_t n = strlen(s); n > 0 && (s[n - 1] == ' ' || s[n - 1] == '\t'); n--) s[n - 1] = 0;
    if (!*s)
      rc = ml_err("freeze (--freeze) '%s': pattern %d is empty; expected comma-separated "
                  "fnmatch patterns",
                  patterns, k + 1);
    else if (freeze_matching(m, s) == 0)
      rc = no_match(m, s);
  }
  free(list);
  ML_TRY(rc);
  int n;
  int64_t numel;
  ml_freeze_count(m, &n, &numel);
  if (n == m->n_params)
    return ml_err("freeze (--freeze) '%s' matches all %d parameters; expected at least one "
                  "trainable parameter (nothing would train)",
                  patterns, n);
  return 0;
}

void ml_freeze_count(const ml_model *m, int *n_frozen, int64_t *numel) {
  *n_frozen = 0;
  *numel = 0;
  for (int i = 0; i < m->n_params; i++) {
    const ml_param *p = &m->params[i];
    if (!p->frozen) continue;
    (*n_frozen)++;
    *numel += p->shape[0] * p->shape[1]; /* bounded: config sizes fit int64 (model/config.h) */
  }
}

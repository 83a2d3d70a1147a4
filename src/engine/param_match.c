#define _POSIX_C_SOURCE 200809L

#include "engine/param_match.h"

#include <fnmatch.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"

/* mark() on the parameters matching pattern `pat` (by name, or by the
 * fused checkpoint tensor holding them); their count. */
static int mark_matching(ml_model *m, const char *pat, void (*mark)(ml_param *p)) {
  int n = 0;
  for (int i = 0; i < m->n_params; i++)
    if (fnmatch(pat, m->params[i].name, 0) == 0 || fnmatch(pat, m->params[i].key, 0) == 0) {
      mark(&m->params[i]);
      n++;
    }
  return n;
}

static int no_match(const ml_model *m, const char *option, const char *pat) {
  bool tied = m->lm_head.weight == m->embed_tokens.weight;
  if (tied && strstr(pat, "lm_head"))
    return ml_err("%s: pattern '%s' matches no parameter: lm_head.weight is tied to %s "
                  "(tie_word_embeddings), the one parameter named_parameters() lists; expected "
                  "a pattern matching %s, which names both",
                  option, pat, m->embed_tokens.weight->name, m->embed_tokens.weight->name);
  return ml_err("%s: pattern '%s' matches no parameter; expected fnmatch patterns over HF "
                "parameter names such as %s or %s",
                option, pat, m->params[0].name, m->params[m->n_params - 1].name);
}

int ml_param_match_each(ml_model *m, const char *patterns, const char *option,
                        void (*mark)(ml_param *p)) {
  if (!patterns || !*patterns) return 0;
  char *list = strdup(patterns);
  if (!list) return ml_err("%s: out of memory copying '%s'", option, patterns);
  int rc = 0, k = 0;
  for (char *s = list, *end; rc == 0 && s; s = end ? end + 1 : NULL, k++) {
    end = strchr(s, ',');
    if (end) *end = '\0';
    s += strspn(s, " \t");
    for (size_t n = strlen(s); n > 0 && (s[n - 1] == ' ' || s[n - 1] == '\t'); n--) s[n - 1] = 0;
    if (!*s)
      rc = ml_err("%s '%s': pattern %d is empty; expected comma-separated fnmatch patterns",
                  option, patterns, k + 1);
    else if (mark_matching(m, s, mark) == 0)
      rc = no_match(m, option, s);
  }
  free(list);
  return rc;
}

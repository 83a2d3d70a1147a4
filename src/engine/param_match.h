/* Parameters named by a list of fnmatch patterns over their HF names, as
 * NeMo Automodel's and torch users' `for n, p in model.named_parameters():
 * if fnmatch(n, pat): ...` selects them: the one parser of the options that
 * name parameters (--freeze: engine/freeze.h; --fp32-params:
 * engine/fp32_params.h). */
#ifndef ML_PARAM_MATCH_H
#define ML_PARAM_MATCH_H

#include "model/model.h"

/* Call mark(p) on every parameter of m that one of `patterns` matches.
 * patterns: comma-separated fnmatch(3) patterns (flags 0: `*` also matches
 * dots, as Python's fnmatch.fnmatchcase) over the HF parameter names as
 * model.named_parameters() lists them (ml_param.name) or the fused
 * checkpoint tensor holding a parameter (ml_param.key: Phi-3's
 * `*.self_attn.qkv_proj.weight` names q, k and v), spaces around each
 * ignored; NULL or "" names nothing. option: how the messages name the
 * option, e.g. "freeze (--freeze)". Errors (one message naming option):
 * an empty pattern (its position), a pattern matching no parameter
 * (naming it; a hint where it names a tied lm_head, which
 * named_parameters() does not list apart from embed_tokens). */
int ml_param_match_each(ml_model *m, const char *patterns, const char *option,
                        void (*mark)(ml_param *p));

#endif

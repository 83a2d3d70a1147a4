/* Frozen parameters: requires_grad=False on the parameters whose HF name
 * matches one of a list of fnmatch patterns, as NeMo Automodel's and torch
 * users' `for n, p in model.named_parameters(): if fnmatch(n, pat):
 * p.requires_grad_(False)` before fully_shard. A frozen parameter gets no
 * weight gradient (its param->grad stays NULL: backward skips its dW GEMM
 * and passes the input gradient on), no AdamW state and no update, and is
 * left out of the grad norm (clip_grad_norm_ over parameters whose grad is
 * None); an FSDP unit whose parameters are all frozen allocates no gradient
 * or optimizer buffers and reduces nothing (parallel/fsdp.h). */
#ifndef ML_FREEZE_H
#define ML_FREEZE_H

#include <stddef.h>
#include <stdint.h>

#include "model/model.h"

/* Mark the parameters of m matching `patterns` frozen (ml_param.frozen);
 * the others trainable. patterns: comma-separated fnmatch(3) patterns
 * (flags 0: `*` also matches dots, as Python's fnmatch.fnmatchcase) over
 * the HF parameter names as model.named_parameters() lists them
 * (ml_param.name, e.g. `model.embed_tokens.*,model.layers.[0-9].*`) or
 * the fused checkpoint tensor holding a parameter (ml_param.key: Phi-3's
 * `*.self_attn.qkv_proj.weight`, HF's one Parameter, freezes q, k and v),
 * spaces around each ignored; NULL or "" freezes nothing. A tied lm_head
 * (tie_word_embeddings) is model.embed_tokens.weight itself, which
 * named_parameters() lists once: freezing embed_tokens freezes it, and a
 * pattern naming lm_head alone matches nothing. Errors (one message
 * naming the option `freeze` / --freeze): an empty pattern, a pattern
 * matching no parameter (naming it; a hint where it names the tied
 * lm_head), every parameter frozen (nothing would train). */
int ml_freeze_apply(ml_model *m, const char *patterns);

/* The frozen parameters of m: their count and elements (global shapes). */
void ml_freeze_count(const ml_model *m, int *n_frozen, int64_t *numel);

#endif

/* LoRA adapters on the decoder's linears (Hu et al. 2021, "LoRA: Low-Rank
 * Adaptation of Large Language Models"), as PEFT's LoraConfig /
 * tuners/lora/layer.py Linear builds them: for each target linear W [out,
 * in], lora_A [r, in] and lora_B [out, r], and
 *   y = x·W^T (+ b) + scaling · ((x·A^T)·B^T),
 * scaling = lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
 * (Kalajdzievski 2023). The adapters are parameters of their layer (FSDP
 * unit), named as PEFT's module tree names them without its
 * `base_model.model.` prefix and adapter name:
 * model.layers.N.self_attn.q_proj.lora_A.weight. */
#ifndef ML_LORA_H
#define ML_LORA_H

#include <stdint.h>

#include "model/model.h"

/* PEFT's scaling: alpha / r, or alpha / sqrt(r) when rslora. */
double ml_lora_scaling(int64_t rank, double alpha, bool rslora);

/* Attach rank-r adapters with `scaling` to the linears of m's decoder
 * layers that `targets` names, as PEFT's target_modules matches module
 * names: a comma-separated list of module names, each matching the
 * linears whose HF name is that name or ends in "." + that name
 * (q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj), or
 * "all-linear": every linear but lm_head (PEFT's INCLUDE_LINEAR_LAYERS_SHORTHAND).
 * Appends lora_A then lora_B per target (ml_param.adapter set) in module
 * order. A family's fused checkpoint linear (Phi-3's qkv_proj = [q; k; v],
 * gate_up_proj = [gate; up]; ml_module.alias) is one module to PEFT, which
 * targets it by that name and gives it one lora_A [r, in] and one lora_B
 * [Σ out, r]: its parts, separate linears here, share one lora_A parameter
 * (named <fused>.lora_A.weight; its gradient sums the parts') and each
 * holds its rows of lora_B (named <part>.lora_B.weight, keyed as PEFT's
 * <fused>.lora_B.weight rows key_row0.., as the parts' weights are keyed:
 * loads, exports and TP cut them as the weights), one dropout mask for the
 * module (lora_id: its first part's). Call once, right after
 * ml_model_create. Errors (naming the option `lora_targets` /
 * --lora-targets or `lora_rank` / --lora-rank): rank < 1 or above the
 * linear's smaller side's 2^20 bound, an empty name, a name matching no
 * linear (PEFT: "Target modules ... not found in the base model"), a
 * target naming a part of a fused linear (q_proj on Phi-3: PEFT sees only
 * qkv_proj; the message names the fused module and its parts), a target
 * in a mixture-of-experts block (its router or an expert, a shared expert
 * and its gate included; all-linear there included: the message names the
 * linear; attention's linears of such a model are adapted). */
int ml_lora_attach(ml_model *m, int64_t rank, double scaling, const char *targets);

/* The number of linears carrying adapters (a fused module's parts each). */
int ml_lora_count(const ml_model *m);

#endif

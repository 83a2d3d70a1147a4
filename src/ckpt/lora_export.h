/* The export of a LoRA run (engine/lora.h): the trained adapters as a PEFT
 * adapter directory, or the base model with the adapters merged into its
 * weights as an HF checkpoint (PEFT's merge_and_unload + save_pretrained). */
#ifndef ML_LORA_EXPORT_H
#define ML_LORA_EXPORT_H

#include <stdbool.h>

#include "ckpt/hf_export.h"
#include "engine/engine.h"

/* Collective over the world. merge false: write `dir` as PEFT's
 * save_pretrained of a LoRA PeftModel writes it: adapter_config.json
 * (peft_type LORA, task_type CAUSAL_LM, r, lora_alpha, lora_dropout,
 * use_rslora, target_modules as the sorted list of the adapted linears'
 * module names' last components — PEFT resolves all-linear to them —,
 * bias "none", base_model_name_or_path e->model_dir, PEFT's defaults for
 * the rest) and adapter_model.safetensors (every adapter in fp32, its
 * master's values, keyed base_model.model.<param name>, e.g.
 * base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight). merge
 * true: the HF checkpoint ml_engine_save_hf writes for a plain run, each
 * adapted weight replaced by W + scaling · B·A (the product summed in
 * double, the sum rounded once to fp32, then to `dtype` as the export
 * rounds every trained tensor; PEFT's merge adds the fp32 delta
 * B·A·scaling to W in the weight's dtype). Both streams run over every
 * parameter (ml_engine_stream_params; the merge runs two: the adapters,
 * then the weights). Errors (every rank, the first failing rank's
 * message): LoRA off (`--merge-lora` without --lora-rank / --adapter),
 * allocation, collectives, I/O on rank 0 (path named). */
int ml_engine_save_lora(ml_engine *e, const char *dir, bool merge, ml_export_dtype dtype);

#endif

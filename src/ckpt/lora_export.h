/* The export of a LoRA run (engine/lora.h): the trained adapters as a PEFT
 * adapter directory, or the base model with the adapters merged into its
 * weights as an HF checkpoint (PEFT's merge_and_unload + save_pretrained). */
#ifndef ML_LORA_EXPORT_H
#define ML_LORA_EXPORT_H

#include <stdbool.h>

#include "ckpt/hf_export.h"
#include "ckpt/save.h"
#include "engine/engine.h"

/* Collective over the world. merge false: write `dir` as PEFT's
 * save_pretrained of a LoRA PeftModel writes it: adapter_config.json
 * (peft_type LORA, task_type CAUSAL_LM, r, lora_alpha, lora_dropout,
 * use_rslora, target_modules as the sorted list of the adapted linears'
 * module names' last components — PEFT resolves all-linear to them —,
 * bias "none", base_model_name_or_path e->model_dir, PEFT's defaults for
 * the rest) and adapter_model.safetensors (every adapter in fp32, its
 * master's values, keyed base_model.model.<param key> — a fused module's
 * lora_B parts written as PEFT's one tensor over their rows —, e.g.
 * base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight). merge
 * true: the HF checkpoint ml_engine_save_hf writes for a plain run, each
 * adapted weight replaced by W + scaling · B·A (the product summed in
 * double, the sum rounded once to fp32, then to `dtype` as the export
 * rounds every trained tensor; PEFT's merge adds the fp32 delta
 * B·A·scaling to W in the weight's dtype). The adapter export streams
 * the adapters alone, the merge ml_lora_stream's merged view (the adapters,
 * then the base parameters). Errors (every rank, the first failing rank's
 * message): LoRA off (`--merge-lora` without --lora-rank / --adapter),
 * allocation, collectives, I/O on rank 0 (path named). */
int ml_engine_save_lora(ml_engine *e, const char *dir, bool merge, ml_export_dtype dtype);

/* What ml_lora_stream hands on. */
typedef enum ml_lora_view {
  ML_LORA_ADAPTERS = 1, /* the adapters alone: adapter_model.safetensors' tensors (what vLLM's
                           LoRA loading, LoRAModel.from_lora_tensors, takes) */
  ML_LORA_MERGED = 2,   /* the base parameters, each adapted weight merged (PEFT's
                           merge_and_unload): what a plain model loads */
} ml_lora_view;

/* Collective over the world, as ml_engine_stream_params to world rank
 * `root` (every rank when root < 0), in export order, each tensor its
 * global fp32 [p->shape]. ML_LORA_ADAPTERS: the adapters only (their fp32
 * masters; the base parameters move no byte), a fused module's lora_B
 * (Phi-3's qkv_proj) assembled from its parts and handed on once as a
 * parameter of PEFT's shape named by its key (p->name = p->key), with its
 * first part's export index k. ML_LORA_MERGED: every base
 * parameter, an adapted weight W [out, in] handed as fp32(W + scaling ·
 * B·A) — the product summed in double over r, the sum rounded once, as
 * the merged export (ml_engine_save_lora with merge) writes it before its
 * dtype — the adapters not handed on: the adapters are first gathered on
 * the receivers (2·r·(in + out) floats per adapted linear), then each
 * weight is merged as it arrives, so a receiver holds one merged weight
 * beside the stream's one tensor, never a second copy of the model.
 * Errors (every rank): LoRA off (e->lora.on false), a view out of range,
 * allocation, collectives, the sink's. */
int ml_lora_stream(ml_engine *e, int root, ml_lora_view view, ml_param_sink sink, void *ctx);

#endif

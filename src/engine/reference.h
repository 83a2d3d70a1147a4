/* The reference policy of an RL loop inside the policy's own engine: a
 * frozen copy of the weights (the initial ones, or any the caller captures
 * later) that the KL penalty's reference log-probs are scored with, as NeMo
 * RL's DTensorPolicyWorker keeps reference_model_state_dict (a copy of the
 * local shards of the model's state dict, taken at init) and swaps it into
 * the model for get_reference_policy_logprobs (use_reference_model). Here
 * the copy is a second set of each FSDP unit's weights as the unit computes
 * from them: under param_dtype bf16 (without cpu_offload, for a unit with
 * no parameter kept in fp32: parallel/fsdp.h ml_fsdp_bf16_weights) its
 * bf16 shard, rounded once at the capture as every unshard of the fp32
 * shard rounds it; else its fp32 parameter shard, in the shards' memory (the
 * device, or the host under cpu_offload). The swap exchanges those pointers
 * (ml_fsdp_swap_weights): no second model, no gradient, no AdamW state, no
 * activations of its own; the reference scores with the policy's plan,
 * mesh, mixed precision and kernels, so its log-probs are bitwise those of
 * a fresh engine on the captured weights. Memory: Σ_u shard_numel per
 * rank, 2 bytes each (bf16 units) or 4 (the others), i.e. 2Ψ/N or 4Ψ/N
 * bytes (Ψ parameters, N = dp_shard·cp·tp ranks sharing them; FSDP's
 * padding rows included). */
#ifndef ML_REFERENCE_H
#define ML_REFERENCE_H

#include <stdbool.h>

#include "engine/engine.h"

/* Capture the engine's current weights (every unit's shard) as the
 * reference, allocating its shards on the first call. Local to each rank
 * (no collective); every rank of the mesh calls it for a consistent
 * reference. Errors: allocation (the reference shards, named). */
int ml_engine_reference_set(ml_engine *e);

/* Whether a reference was captured. */
bool ml_engine_has_reference(const ml_engine *e);

/* Exchange the engine's weights with the reference's (ml_fsdp_swap_weights);
 * a second call swaps back. Between the two the engine computes with the
 * reference weights; it must not step (the AdamW state belongs to the
 * policy's). Collective over FSDP's group under ZeRO-1/2 (the persistent
 * unsharded parameters re-gathered), local under ZeRO-3. Errors: no
 * reference captured; the re-gather's. */
int ml_engine_reference_swap(ml_engine *e);

/* Free the reference (swapped back first by the caller); a no-op without
 * one. ml_engine_close calls it. */
void ml_engine_reference_free(ml_engine *e);

/* Bytes of the reference's shards on this rank (0 without one). */
size_t ml_engine_reference_bytes(const ml_engine *e);
/* Bytes the reference holds for one unit of f: shard_numel bf16 where the
 * unit computes from bf16 weights (ml_fsdp_bf16_weights), else fp32. */
size_t ml_engine_reference_unit_bytes(const ml_fsdp *f, const ml_fsdp_unit *unit);

#endif

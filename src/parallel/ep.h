/* Expert parallelism of the sparse (MoE) layers over the mesh's ep group
 * (parallel/mesh.h ML_GROUP_EP), as NeMo Automodel's MoE mesh: the world
 * flattened (dp_replicate, dp_shard, cp, tp) and split into (ep_shard, ep);
 * expert e is computed on ep rank e / (E / ep) for the tokens of every rank
 * of its ep group, which reach it by all-to-all (model/moe.h: dispatch and
 * combine; counts on the group's host channel, rows on its data comm,
 * comm/comm.h ml_all_to_all_v, counted as all_to_all).
 *
 * Parameters (NeMo Automodel's apply_ep + apply_fsdp of
 * nemo_automodel/components/moe/parallelizer.py): the experts are placed
 * Shard(0) over ep on the expert dimension, a rank of ep coordinate r
 * holding experts [r·E/ep, (r+1)·E/ep) only, and FSDP-shard those over the
 * ep_shard group (mesh.h ML_GROUP_EP_SHARD, world / ep ranks) in FSDP
 * units of their own, one per sparse layer, gathered and reduced with
 * their layer's unit (parallel/fsdp.h ml_fsdp_ep); the layer's unit holds
 * the rest of the layer (Automodel's block-level fully_shard ignores the
 * experts). An expert's gradient comes only from the tokens dispatched to
 * it, all of which its ranks computed, so it is reduce-scattered over
 * ep_shard alone (sum of the ep_shard ranks' dispatched tokens), never
 * over ep. The other experts' parameters have no storage on this rank
 * (data and grad stay NULL; model/moe.c never touches them). */
#ifndef ML_EP_H
#define ML_EP_H

#include "model/model.h"
#include "parallel/mesh.h"

/* Point m's sparse layers at the ep group of mesh (model.h ml_moe_ep), when
 * it has more than one rank (else nothing); under tp > 1 also at the tp
 * group (ml_moe_ep.slices, gather: each tp rank dispatches its torch.chunk
 * of the Replicate tokens, the block's output and input gradient
 * all-gathered over tp, model/moe.h), which makes the routers' gradients
 * Partial over tp: call it before tp's walk (parallel/tp.h ml_tp_apply),
 * which marks them. Under cp nothing more: cp's pieces differ per rank.
 * The ep group may span any of dp, cp and tp (NeMo Automodel's MoE mesh
 * flattens them): every token of the world is dispatched by one rank. Errors, naming --ep
 * (ep_size) and the values: a model without sparse layers (num_experts
 * 0), num_experts not a multiple of ep. The mesh must outlive m's use of
 * it. */
int ml_ep_apply(ml_model *m, const ml_mesh *mesh);

/* The expert parameter p belongs to: e in 0 .. num_experts − 1 when p is the
 * weight, bias or a LoRA adapter of one of expert e's linears (model.h
 * ml_moe.experts of its decoder layer), else −1 (the router, attention,
 * norms, a dense MLP, the root modules). */
int64_t ml_ep_expert_of(const ml_model *m, const ml_param *p);

#endif

/* Expert parallelism of the sparse (MoE) layers over the mesh's ep group
 * (parallel/mesh.h ML_GROUP_EP), as NeMo Automodel's MoE mesh: the world
 * flattened (dp_replicate, dp_shard, cp, tp) and split into (ep_shard, ep);
 * expert e is computed on ep rank e / (E / ep) for the tokens of every rank
 * of its ep group, which reach it by all-to-all (model/moe.h: dispatch and
 * combine; counts on the group's host channel, rows on its data comm,
 * comm/comm.h ml_all_to_all_v, counted as all_to_all).
 *
 * Parameters: the experts stay in their decoder layer's FSDP unit (sharded
 * and all-gathered over dp_shard_cp with the layer's other parameters), so
 * each rank holds every expert while its layer is unsharded; a rank's
 * expert gradients are those of its own experts, the others' zero, and the
 * unit's reduce-scatter (and HSDP's all-reduce) sums them over the ranks:
 * the gradient of the whole batch. The compute and the activations of the
 * experts are split over ep; their parameters' memory is FSDP's. */
#ifndef ML_EP_H
#define ML_EP_H

#include "model/model.h"
#include "parallel/mesh.h"

/* Point m's sparse layers at the ep group of mesh (model.h ml_moe_ep), when
 * it has more than one rank (else nothing). Errors, naming --ep
 * (ep_size) and the values: a model without sparse layers (num_experts
 * 0), num_experts not a multiple of ep. The mesh must outlive m's use of
 * it. */
int ml_ep_apply(ml_model *m, const ml_mesh *mesh);

#endif

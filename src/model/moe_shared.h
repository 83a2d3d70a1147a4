/* The shared expert of a sparse mixture-of-experts block (model.h
 * ml_moe.shared), forward and backward, as transformers 5.23 computes
 * Qwen2MoeSparseMoeBlock's shared_expert and shared_expert_gate and as
 * torch's autograd differentiates them, on every token of the block:
 *   s_t = down(act(gate(h_t)) · up(h_t))      [T, H]  (Qwen2MoeMLP of I_s features)
 *   z_t = sigmoid(h_t · w^T)                  [T]     (shared_expert_gate, w [1, H])
 *   y_t += z_t · s_t                          after the routed experts' sum
 * The idea is DeepSeekMoE's shared experts (Dai et al. 2024, "DeepSeekMoE",
 * arXiv:2401.06066 §3.2; DeepSeek-V3 keeps one shared expert, ungated): an
 * expert every token takes besides its routed ones. Qwen2-MoE adds the
 * sigmoid gate. The router and its load-balancing loss do not see it.
 *
 * Under expert parallelism the shared expert is not exchanged: it is a dense
 * MLP in its layer's FSDP unit, computed on this rank's tokens (replicated
 * over ep as the router); under tp it is replicated as the whole sparse
 * block is (parallel/tp_walk.c). The GEMMs and the GLU run on the backend;
 * the gate's sigmoid and the scaled sum on the host over the buffers (the
 * sparse block's requirement, model/moe.h ml_moe_check), skipped on the
 * meta backend (`meshlm plan`), where only the GEMMs' sizes count. */
#ifndef ML_MOE_SHARED_H
#define ML_MOE_SHARED_H

#include "model/model.h"

/* Sparse layer L's shared expert on h [T, H] (the block's input): y [T, H]
 * += z_t · s_t; saves sg, su, sa [T, I_s], sy [T, H] and sz [T] in L->acts.
 * Nothing when L's block has no shared expert. Errors: the backend's. */
int ml_moe_shared_forward(ml_model *m, ml_layer *L, const ml_act *h, float *y);

/* Its backward: dy [T, H] the gradient of the block's output (read only);
 * dh [T, H] += the shared expert's and its gate's input gradient; their
 * weight gradients accumulate (+=). Nothing when L's block has none.
 * Errors: allocation (named), the backend's. */
int ml_moe_shared_backward(ml_model *m, ml_layer *L, const ml_act *h, const float *dy, float *dh);

#endif

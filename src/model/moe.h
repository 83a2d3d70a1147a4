/* The sparse mixture-of-experts block of a decoder layer (model.h ml_moe),
 * forward and backward, as transformers 5.23 computes Qwen3MoeSparseMoeBlock
 * and MixtralSparseMoeBlock (their TopKRouter and Experts modules) and as
 * torch's autograd differentiates them:
 *   logits = h·W_gate^T                       [T, E]
 *   p      = softmax(logits) in fp32          [T, E]
 *   e_t,j, v_t,j = torch.topk(p_t, k)         (descending; exact ties: see below)
 *   w_t,j  = v_t,j / Σ_i v_t,i  if norm_topk, else v_t,j
 *   y_t    = Σ_j w_t,j · down_e(act(gate_e(h_t)) · up_e(h_t)),  e = e_t,j
 *            (+ the gated shared expert where the family has one,
 *            Qwen2MoeSparseMoeBlock: model/moe_shared.h)
 * Dropless: every (token, choice) reaches its expert. The tokens routed to
 * an expert are gathered contiguously (in token order, then choice order)
 * and run as one GEMM per expert; the weighted outputs are
 * summed per token in choice order, a fixed order, so results do not
 * depend on threads or batch layout beyond the GEMMs' own. Exactly equal
 * probabilities go to the lower expert index first; torch's CPU topk
 * leaves their order to std::nth_element / std::sort (measured: of three
 * tied 0.3 it keeps experts 1 and 2, not 0), so an exact tie at the k-th
 * place may route differently from torch (the fixtures keep a 1e-4 margin
 * there: tools/gen_fixtures.py). The selection has no gradient (as torch.topk's indices); the weights do, through the
 * renormalization and the softmax to the router.
 *
 * Computed on the backend's GEMMs and GLU; the routing (softmax, top-k,
 * the gathers and the weighted sums) runs on the host over the buffers, so
 * the block needs a backend whose memory is the host's (the engine refuses
 * others: ml_moe_check), or the meta backend (`meshlm plan`), where nothing
 * is computed and the routing is modelled as balanced: expert e gets rows
 * floor(e·T·k/E) .. floor((e+1)·T·k/E) − 1 on every rank, so the GEMMs'
 * sizes, the exchanges' bytes and the buffers are those of a perfectly
 * balanced router (a real run's follow its routing).
 *
 * Router replay ("R3", Megatron-LM PR #4168, megatron/core/transformer/moe/
 * router_replay.py; NeMo Automodel PR #2797): a forward can record each
 * token's chosen experts (ml_model.route_record, int32 [T, n_layers, k] in
 * torch.topk's order) and a later forward can route by recorded choices
 * instead of its own top-k (ml_model.route_replay), as an RL trainer replays
 * the generator's routing. This follows Megatron's REPLAY_FORWARD: the
 * recorded indices replace topk's, the gates' weights are the router's
 * softmax probabilities gathered at them (scores.gather(1, top_indices)),
 * renormalized when norm_topk as transformers' Qwen3-MoE/Mixtral routers
 * renormalize, so the gradients reach the router through those
 * probabilities (the softmax of every expert) exactly as for the model's own
 * choices; the load-balancing loss counts the recorded routing (its
 * count_e: Megatron builds routing_map, which the aux loss sums, from the
 * replayed indices) with the probabilities of this forward. Replaying the
 * routing the model itself chooses computes bitwise the same step. */
#ifndef ML_MOE_H
#define ML_MOE_H

#include "model/model.h"

/* Whether m can run its sparse layers on m->be (called `device` in the
 * message): 0, or −1 with a message naming the family and the backend when
 * the backend's memory is not the host's and it is not the meta backend
 * (cuda: the block is CPU-only). */
int ml_moe_check(const ml_model *m, const char *device);

/* Sparse layer L's block on h [T, H] (T = h->B · h->s tokens, the mlp
 * norm's output): y [T, H] (=); saves the routing and the experts'
 * activations in L->acts (probs, top_e, top_w, ye, g, u, a). */
int ml_moe_forward(ml_model *m, ml_layer *L, const ml_act *h, float *y);

/* Under expert parallelism (model.h ml_moe_ep, ranks > 1) this rank
 * computes its experts' GEMMs for the rows every rank of the group routes
 * to them: the rows go to the experts' ranks by an all-to-all (counts
 * first, then the rows, rank q's sorted by expert, token, choice), are
 * regrouped by local expert then source rank (each expert's rows
 * contiguous, in a fixed order), and the outputs come back by the inverse
 * all-to-all into ye, summed per token in choice order as on one rank.
 * The received rows and their activations are kept in L->moe_held for
 * backward, which moves dy's rows as forward moved h's and the input
 * gradients back as the outputs; the local experts' weight gradients
 * cover every rank's tokens, the others' stay untouched (zero: FSDP's
 * reduction over the ranks sums the owners').
 * Under expert parallelism with tp (ml_moe_ep.slices > 1; the design of
 * NeMo Automodel's MoE mesh, whose ep groups span tp ranks holding the same
 * Replicate tokens, and Megatron-LM's token dispatchers, transformer/moe/
 * token_dispatcher.py, which dispatch S/TP·B tokens per rank): the router
 * runs on all T tokens on every tp rank (the routing and the aux sums
 * whole), the tp rank dispatches only its torch.chunk of them (tokens t0 ..
 * t0 + Td − 1, ml_chunk(T, tp, tp rank): uneven when tp does not divide T)
 * and y's other rows come from the other tp ranks by an all-gather over tp
 * (ml_moe_ep.gather), so y is Replicate. Backward likewise: the chunk's
 * rows of dy go through the two exchanges, the router's backward runs on
 * the chunk's tokens (its weight gradient a Partial sum over tp, summed by
 * the gradients' tp step: parallel/tp_walk.c), and dh's rows are
 * all-gathered over tp into the Replicate input gradient. */
/* Its backward: dy [T, H] the gradient of y (read only), dh [T, H] (=) the
 * gradient of h; the router's and the experts' weight gradients
 * accumulate (+=). */
int ml_moe_backward(ml_model *m, ml_layer *L, const ml_act *h, const float *dy, float *dh);

/* Sparse layer L's part in the expert-parallel exchange of a forward in
 * which this rank has no tokens (T = 0): it sends no rows, runs its
 * experts (ml_moe_ep: experts rank·El .. (rank+1)·El − 1) on the rows the
 * other ranks of the ep group send and returns their outputs, as
 * ml_moe_forward's exchange does; keeps nothing for backward. For a
 * generation rank whose sequences are done while others of its ep group
 * still decode (engine/gen_ep.h). Nothing without expert parallelism.
 * Collective over the ep group. Errors: allocation (named), the exchange's. */
int ml_moe_forward_idle(ml_model *m, ml_layer *L);

/* Free what L's last forward kept for backward under expert parallelism
 * (L->moe_held; nothing when NULL). */
void ml_moe_release(ml_model *m, ml_layer *L);

/* The load-balancing loss (model.h ml_moe_aux) of a training forward, when
 * cfg.router_aux (else both are no-ops and the loss gets no aux term):
 * begin before the forward: the sums restart, and each sparse layer's
 * forward adds its tokens at positions < valid of each sequence (global
 * positions when the caller sets m->aux.pos after begin: cp's pieces; HF's
 * attention_mask: the others are padding; the engine passes docs[ndocs] for
 * packed documents, S for whole rows, whose pad tokens it cannot tell from
 * others and which therefore count, as HF counts them without a mask). The caller then sums
 * m->aux.sums (2E + 1 doubles) over the ranks holding the other tokens of
 * the batch, and close computes aux and its gradient's scale, which the
 * sparse layers' backward adds to the router probabilities' gradient
 * (ml_moe_backward). Recomputed forwards (activation checkpointing) after
 * close add nothing. No counted token: aux = 0. Errors (begin): host
 * memory. */
int ml_moe_aux_begin(ml_model *m, int64_t valid);
void ml_moe_aux_close(ml_model *m);

#endif

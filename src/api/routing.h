/* Router replay at the library's edge (meshlm_scores.routing,
 * meshlm_train_batch.routing; model/moe.h): the per-token expert choices
 * between the caller's [Σ lens, num_hidden_layers, num_experts_per_tok]
 * layout and a micro-batch's packed row. Internal to libmeshlm. */
#ifndef ML_API_ROUTING_H
#define ML_API_ROUTING_H

#include "api/pack.h"

/* Whether `call` may read or write `field` (a routing array) on s: 0, or
 * −1 with a message naming the field when the model has no experts or the
 * mesh has cp > 1 (there a rank's sparse layers see a piece of each
 * sequence, not its tokens position for position). Under tp every tp rank
 * routes all of its sequences' tokens (the Replicate residual stream; under
 * ep too, each dispatching a chunk of them: model/moe.h), so each records
 * and replays the whole routing. */
int api_routing_check(const meshlm_session *s, const char *call, const char *field);

/* int32 entries per token: num_hidden_layers · num_experts_per_tok. */
int64_t api_routing_cols(const meshlm_session *s);

/* Micro-batch j's packed row [S, cols] (p's pack) from the caller's
 * routing [Σ lens, cols]: each sequence's tokens where ml_pack_fill puts
 * them, the padding after them −1 (routed by their own top-k). */
void api_routing_pack(const api_plan *p, const meshlm_seqs *b, int64_t j, int64_t cols,
                      const int32_t *caller, int32_t *packed);

/* The inverse: the packed row's sequences' tokens into the caller's
 * routing [Σ lens, cols]. */
void api_routing_unpack(const api_plan *p, const meshlm_seqs *b, int64_t j, int64_t cols,
                        const int32_t *packed, int32_t *caller);

#endif

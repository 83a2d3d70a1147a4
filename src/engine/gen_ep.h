/* Generation under expert parallelism (engine/generate.h, parallel/ep.h):
 * the ranks of an ep group step together. Each data-parallel rank decodes
 * its own prompts, for as many steps as its prompts, max_new and stop ids
 * make; but every sparse layer's forward is an all-to-all over the ep group
 * (model/moe.h), so every rank of the group must run each step's exchanges
 * (vLLM's data-parallel MoE does the same: an idle DP rank runs dummy
 * batches while any rank of its group has requests). Before each step
 * every rank of the group says, in one all-reduce (MAX) over it, whether it
 * steps (1), is done (0) or failed (2); a done rank runs steps of zero
 * tokens (ml_moe_forward_idle on each sparse layer: it computes its experts
 * for the others' rows) until no rank steps; a failure ends every rank's
 * call with an error. A rank that fails inside a step's forward (between
 * its exchanges) cannot take part any more and the others wait on it. */
#ifndef ML_GEN_EP_H
#define ML_GEN_EP_H

#include <stdbool.h>

#include "engine/engine.h"

/* A call's stepping together: the engine, and whether the group's vote
 * already reported a failure (then this rank casts no more votes). */
typedef struct ml_gen_ep {
  ml_engine *e;
  bool heard;
} ml_gen_ep;

/* Before each step of the call's own sequences: the step's all-reduce over
 * the engine's ep group. Nothing without expert parallelism. Errors: a
 * failure of another rank of the group (named; the failed rank's message
 * is its own; s->heard set), the collective's. */
int ml_gen_ep_step(ml_gen_ep *s);

/* After the call's own sequences are done (failed: its call failed, the
 * error message set): steps of zero tokens while any rank of the ep group
 * still steps, then returns 0; with failed, reports the failure to the
 * group once (unless s->heard: it came from the group) and returns -1,
 * the message left as it was. Nothing without expert parallelism (returns
 * 0, or -1 when failed). Errors: another rank's failure (named),
 * ml_moe_forward_idle's, the collective's. */
int ml_gen_ep_finish(ml_gen_ep *s, bool failed);

#endif

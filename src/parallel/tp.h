/* Apply a tensor-parallel plan to a model over the tp group, as torch's
 * parallelize_module does (torch/distributed/tensor/parallel/style.py):
 * each matched module's parameters get their placement and local slice
 * (torch.chunk sizes), and every activation edge of the decoder gets the
 * redistributes its placements imply (ARCHITECTURE.md §3–§5).
 *
 * Placements are propagated through the decoder graph before anything is
 * sharded: embedding → per layer [norm → self_attn (q/k/v → q_norm/k_norm →
 * attention → o_proj) → (post-norm) → residual; norm → mlp (gate/up → act →
 * down) → (post-norm) → residual] → final norm → lm_head → loss. At each
 * edge the truth (what the producer hands out, local tensor or DTensor) is
 * redistributed to what the consumer computes on. As in torch, a DTensor
 * input keeps its placement and a local input is read with the consumer's
 * input_layouts; where such an annotation disagrees with the truth (torch
 * would compute silently wrong numbers, pytorch#129355) the plan is refused
 * with a message naming both modules.
 *
 * Each edge is a chain of placements p0 → p1 → ... run forward with
 * ml_redistribute; backward runs it in reverse on the gradient, which
 * arrives as the consumer makes it (Partial from a colwise consumer,
 * Shard(−1) from a rowwise one, else the activation's placement): e.g.
 * Shard(1) → Replicate into colwise q/k/v is an all-gather forward and a
 * reduce-scatter backward. q/k/v (and gate/up) read one activation and share
 * one chain: one collective instead of three, the same numbers.
 *
 * Replicated parameters whose module sees a sharded activation (SP norms,
 * q_norm/k_norm on head-sharded q/k, HF replicated_with_grad_allreduce)
 * get Partial gradients: they are listed in ml_tp.partial
 * (ml_tp_grad_partial) and summed over tp once per step
 * (engine/grads.h ml_grads_tp_reduce), packed into one all-reduce.
 *
 * The placements live here, not in the model: a sharded parameter's
 * ml_param gets its local view (local shape and offset in the global
 * tensor), and ml_tp records on which dim (ml_tp_param_dim). */
#ifndef ML_TP_H
#define ML_TP_H

#include "comm/comm.h"
#include "model/model.h"
#include "parallel/plan.h"

/* One activation edge: its placements forward, the gradient's on arrival. */
typedef struct ml_tp_edge {
  char name[192];     /* "model.layers.0.self_attn.q_proj input" */
  ml_placement p[8];  /* forward chain p[0] → ... → p[n−1] */
  int n;
  ml_placement grad_in; /* placement of the gradient arriving at p[n−1] */
  int64_t C;            /* global features of the activation */
  struct ml_tp *tp;
} ml_tp_edge;

/* What the plan gave a module (for reports). */
typedef struct ml_tp_module {
  const ml_module *module;
  const ml_plan_rule *rule; /* NULL: not in the plan (replicated) */
} ml_tp_module;

typedef struct ml_tp {
  ml_comm *comm;
  int size, rank;
  ml_tp_module *modules; /* one per model module */
  int n_modules;
  ml_tp_edge *edges;
  int n_edges, cap_edges;
  ml_placement residual; /* the residual stream: Replicate() or Shard(1) */
  ml_placement logits;   /* Shard(−1) (vocab-parallel loss) or Replicate() */
  int *param_dim;        /* [n_params]: per parameter (its index in the model's params),
                            the dim it is Shard on over tp (0 or 1), or −1 (Replicate) */
  unsigned char *param_heads; /* [n_params]: how its Shard is cut (ml_tp_param_slice):
                                 0 torch.chunk, ML_TP_QUERY_HEADS or ML_TP_KV_HEADS */
  int64_t *kv_shared;    /* the key/value heads more than one tp rank holds, ascending */
  int n_kv_shared;
  int n_params;
  ml_param **partial;    /* replicated params with Partial grads */
  int n_partial;
  const ml_model *model; /* the model applied to */
  ml_backend *be; /* the model's (NULL when only planning: nothing runs) */
  float *work;    /* redistribute scratch (device memory from be's pool) */
  size_t work_cap;
} ml_tp;

/* The attention heads tp rank r of `size` holds when q/k/v are colwise and
 * o_proj rowwise. Query heads are split as torch.tensor_split splits
 * num_attention_heads (the first nh % size ranks get one more: 9 heads on
 * tp=2 are 5 + 4, on tp=4 3 + 2 + 2 + 2; torch.chunk's split where it has
 * `size` non-empty pieces, and every tp up to num_attention_heads works).
 * Each rank holds the key/value heads its query heads read (query head h
 * reads kv head h / group, group = num_attention_heads /
 * num_key_value_heads, as HF's repeat_kv): a kv head whose group straddles
 * two ranks, or every kv head when tp > num_key_value_heads, is held by
 * several ranks (Megatron replicates kv heads when tp exceeds them; torch
 * and NeMo refuse). Their copies stay equal: the same initial rows, and
 * their gradients, partial sums over each holder's query heads, are summed
 * over the holders (engine/grads.h). Owned: a held kv head no
 * lower rank holds — what counts once in the grad norm and what run
 * checkpoints write. With tp dividing both head counts: torch.chunk's
 * shards, nothing shared. Requires 1 <= size <= num_attention_heads. */
typedef struct ml_tp_heads {
  int64_t q0, nq;   /* query heads [q0, q0 + nq) */
  int64_t kv0, nkv; /* key/value heads [kv0, kv0 + nkv) */
  int64_t kv_own0;  /* owned: [kv_own0, kv0 + nkv) */
  int64_t group;    /* query heads per key/value head */
} ml_tp_heads;
void ml_tp_heads_of(const ml_model_config *c, int size, int r, ml_tp_heads *h);

enum { ML_TP_QUERY_HEADS = 1, ML_TP_KV_HEADS = 2 };

/* Validate `plan` against `m` and apply it over `comm` (size / rank may
 * describe a group that does not exist, with comm->ops NULL, to plan
 * without running: `meshlm plan`). With size 1 the validation runs and
 * nothing is sharded. Errors (identical on every rank, before any
 * collective): a pattern that matches no module, a module matched by two
 * rules, a style on a module kind it cannot shard (colwise on a norm),
 * heads or kv heads not divisible by tp, a dimension too small for tp
 * non-empty shards, tied embeddings sharded on different dims, siblings
 * prepared differently, an annotation that disagrees with the truth, a
 * residual stream that is neither Replicate nor Shard(1), attention or
 * lm_head fed a sequence shard, a Partial that reaches a consumer. */
int ml_tp_apply(ml_tp *tp, const ml_plan *plan, ml_model *m, ml_comm *comm);
void ml_tp_destroy(ml_tp *tp);

/* After ml_tp_apply: with `sequence_parallel` requested (--sequence-parallel),
 * the applied plan must shard the residual stream on the sequence. Errors
 * name the plan. */
int ml_tp_check_sequence_parallel(const ml_tp *tp, const ml_plan *plan, bool sequence_parallel);

/* The TP placement of parameter p of m (the model ml_tp_apply sharded):
 * the dim of its Shard (0 or 1: p->local[d] and p->offset[d] are its
 * torch.chunk of p->shape[d]), or −1 for Replicate — every parameter with
 * tp size 1, and before ml_tp_apply. */
int ml_tp_param_dim(const ml_tp *tp, const ml_model *m, const ml_param *p);

/* Where tp rank r's local tensor of parameter p lies on its Shard dim
 * (ml_tp_param_dim >= 0): elements [*start, *start + *len) of
 * p->shape[dim], of which rank r owns [*own, *start + *len) (counts once
 * in the grad norm, is written to run checkpoints; the rest are copies a
 * lower rank owns). torch.chunk of the dim for most parameters; whole
 * heads for q_proj / k_proj / v_proj (dim 0) and o_proj (dim 1) as
 * ml_tp_heads_of says (k_proj / v_proj rows may be held by several
 * ranks). For a Replicate parameter: the whole dim 0, owned by tp rank 0
 * only. */
void ml_tp_param_slice(const ml_tp *tp, const ml_model *m, const ml_param *p, int r,
                       int64_t *start, int64_t *len, int64_t *own);

/* Whether p is tp-replicated with a Partial gradient (each tp rank holds a
 * partial sum; engine/grads.h sums them): a replicated
 * parameter whose module sees a sharded activation. Never with tp size 1. */
bool ml_tp_grad_partial(const ml_tp *tp, const ml_param *p);

/* The tp group's scratch buffer (device memory of tp->be), grown to `need`
 * floats (0: 1); valid until the next call. The edges' redistributes and
 * the gradients' tp step (engine/grads.h) use it. Errors: allocation (NULL). */
float *ml_tp_work(ml_tp *tp, size_t need);

/* Free the scratch (the next ml_tp_work allocates it again): the pool
 * then holds what a freshly applied tp holds. */
void ml_tp_release_work(ml_tp *tp);

/* The redistributes edge e runs, forward (backward = false: p[i] →
 * p[i+1] where they differ) or on its gradient (backward: from grad_in,
 * back through each step to p[0]'s gradient placement; an all-gather's
 * backward is a reduce-scatter when the gradient arrives Partial, a slice
 * when it arrives Replicate): step i goes from[i] → to[i]. The one
 * description of an edge's collectives: the hooks run exactly these, and
 * `meshlm plan` prints them. Returns the count (< ML_TP_MAX_STEPS). */
enum { ML_TP_MAX_STEPS = 16 };
int ml_tp_edge_steps(const ml_tp_edge *e, bool backward, ml_placement *from, ml_placement *to);

/* The collectives of edge e's forward or backward steps for a local batch
 * [B, S]: calls and bytes per collective kind, added into the arrays
 * (indexed by ml_coll). Same numbers as the counting wrapper records;
 * bytes saturate at ML_SAT (common/checked.h) instead of wrapping. */
int ml_tp_edge_cost(const ml_tp_edge *e, bool backward, int64_t B, int64_t S,
                    int64_t calls[ML_COLL_KINDS], int64_t bytes[ML_COLL_KINDS]);

#endif

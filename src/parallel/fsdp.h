/* FSDP (torch's fully_shard / FSDP2, ARCHITECTURE.md §6) over the dp_shard_cp group
 * (dp_shard × cp, NeMo Automodel's name), with HSDP over dp_replicate.
 *
 * Unit = one decoder layer, plus a root unit (embedding, final norm,
 * lm_head). Each parameter's TP-local tensor is chunked on dim 0 across the
 * group (chunk = ceil(rows / dp), zero-padded), and a unit's chunks are
 * packed into one flat shard per rank: shard = [chunk of p0 | chunk of p1 |
 * ...]. Unsharding is one all-gather of the flat shards (in param_dtype;
 * under bf16, once training, sent from the persistent bf16 shard lp which
 * AdamW's pass keeps current, instead of rounded at every unshard)
 * followed by a copy into the unit's contiguous unsharded fp32 buffer
 * (FSDP2's copy-out; bf16 values widened exactly); gradients are rounded to
 * param_dtype (they were computed in it), copied into the same rank-major
 * layout, reduce-scattered in reduce_dtype (SUM: the loss is already
 * normalised by the global token count), all-reduced over dp_replicate
 * under HSDP, and added to the shard's fp32 gradient. Master weights,
 * gradients and AdamW state live on the shard in fp32.
 *
 * Prefetch (FSDP2's implicit prefetching, set_modules_to_forward_prefetch):
 * ml_fsdp_prefetch starts a unit's all-gather without blocking (MPI
 * nonblocking collective); ml_fsdp_unshard waits for it.
 *
 * CPU offload (cpu_offload: torch's CPUOffloadPolicy for fully_shard,
 * NeMo's cpu_offload): the flat shards, their gradients and the AdamW
 * state live in host memory (ml_be_host_alloc: pinned on CUDA; on the CPU
 * backend its host pool, apart from the device pool). Before a unit's
 * all-gather its shard is copied to the device (dev_shard, FSDP2's
 * sharded_param.to(device, non_blocking=True) in all_gather_inputs); the
 * reduced gradient shard is copied back and accumulated on the host: the
 * first since zero_grad without waiting, straight into shard_grad, the
 * copy overlapping the next unit's backward (FSDP2's non-blocking D2H,
 * synchronised in finalize_backward: ml_fsdp_finish_backward), later ones
 * through a host buffer and added there (FSDP2 blocks on the copy to
 * accumulate). Everything computed on the shards afterwards (the tp step of
 * the gradients, the grad norm, clipping, AdamW) runs on shard_be, the
 * host peer of the backend (kernels/cpu; backend.h ml_be_host_peer). Where
 * backward would accumulate into shard_grad itself (one rank, or the vocab
 * rows, in fp32 without replicas) the device holds a copy of the shard's
 * gradient during the unit's backward, loaded before and stored back after
 * it, so the sums are the same: on the CPU backend the results are
 * bitwise those without offload (up to the sign of a zero gradient, which
 * nothing downstream tells apart).
 *
 * ZeRO stages: 3 is the above. 2 keeps every unit's unsharded parameters
 * between steps (re-gathered after the optimizer step: ml_fsdp_sync_params),
 * so forward and backward gather nothing; 1 also all-reduces whole
 * gradients instead of reduce-scattering them (each rank then keeps its
 * shard's slice for the optimizer). The reshard policy applies to ZeRO-3.
 *
 * Vocab-parallel parameters (ml_fsdp_init's vocab_parallel: the engine's
 * choice whenever the group has more than one rank, engine/engine.h): the
 * root's vocab-sized embed_tokens.weight and an untied lm_head.weight
 * (dim 0 of their TP-local tensor is the vocab, so a rank's chunk is a
 * contiguous block of vocab rows) are never gathered, under any ZeRO stage
 * or reshard policy: the embedding and the loss compute on each rank's rows
 * and move the tokens instead (parallel/vocab.h, Megatron's vocab
 * parallelism over this group). Their chunks are laid out after the
 * unit's other parameters', so a unit's all-gather and reduce-scatter move
 * only the leading part of the shard (gather_numel: for the root, the final
 * norm); their rows are read from the shard (fp32) or from a param_dtype
 * copy made when the unit is unsharded (bf16, as the gathered parameters
 * are rounded), and their gradient, complete on each rank (every token of
 * the group went through its rows), accumulates in the shard's gradient
 * directly, or where it must first be rounded to param_dtype / reduce_dtype
 * or all-reduced over the HSDP replicas, in a buffer that is then added. So
 * the root holds neither its [V, H] parameters nor their gradient
 * unsharded, and FSDP's staging buffers are sized by the largest unit's
 * gathered part (a decoder layer), not by the vocab. Checkpoints and
 * exports read the shards and are unchanged.
 *
 * Frozen parameters (ml_param.frozen, engine/freeze.h): their param->grad
 * and vocab rows' gradient stay NULL, so backward computes no weight
 * gradient for them. Within each part of the shard (the gathered one, then
 * the vocab-parallel rows) the trainable parameters' chunks come first and
 * the frozen ones after: [trainable | frozen | vocab trainable | vocab
 * frozen]. Gradients and AdamW state exist for the shard's leading
 * grad_numel elements only (up to the last trainable chunk), the unsharded
 * gradient for the gathered part's leading grad_full, and the reduce-scatter
 * moves each rank's trainable prefix of the gathered part (a prefix of
 * every rank's block: one collective, shorter); a unit whose parameters are
 * all frozen (unit->frozen, grad_numel 0) has neither and reduces nothing.
 * What a partly frozen unit still holds: the gradient and AdamW state of
 * frozen gathered chunks lying before a trainable vocab-parallel one (the
 * root under vocab parallelism with the final norm frozen and lm_head
 * trainable), zeros that the optimizer never touches (it steps the trainable
 * chunks only).
 *
 * Expert units (ml_fsdp_init_ep, expert parallelism: parallel/ep.h; NeMo
 * Automodel's fully_shard of each MoE block's experts over ep_shard_mesh,
 * and the block's fully_shard with the experts as ignored_params): each
 * unit has its own groups (ml_fsdp_unit.dp, .rep), the layers and the root
 * dp_shard_cp with the HSDP replicas, an expert unit the ep_shard group
 * and no replicas (ep_shard spans dp_replicate already). Under ep > 1 each
 * sparse layer's experts local to this rank form a unit of their own,
 * numbered after the root, which its layer's unit carries along
 * (ml_fsdp_unit.with): prefetch, unshard, reshard, grad_begin and
 * reduce_grads of the layer's unit do the same to it, so the engine walks
 * the layers as before; everything else (the shards, their gradients and
 * AdamW state, the norm, clipping, the optimizer, checkpoints) walks every
 * unit and reads each unit's own group.
 *
 * Mixed-dtype units (ml_param.fp32 under param_dtype bf16, engine/
 * fp32_params.h; NeMo Automodel's fully_shard_by_dtype, which gives such
 * parameters FSDP units of their own with param_dtype fp32): a unit holding
 * some keeps them in an fp32 part of its own, the last of the gathered
 * part: [bf16 trainable | bf16 frozen | fp32 trainable | fp32 frozen | vocab
 * trainable | vocab frozen]. Its unshard starts two all-gathers, the bf16
 * part's into `full` and the fp32 part's (the master bits) into `full32`,
 * so the bf16 all-gather stays bf16 and the fp32 one moves 4 bytes an
 * element: the bytes of two units, as torch's two fully_shard calls move
 * them, but one unit to the engine (its layer) and one reduce-scatter of
 * the gradients (both parts in reduce_dtype, as the fp32 unit keeps the
 * policy's reduce_dtype in fully_shard_by_dtype; only the bf16 part's
 * gradient is rounded to bf16 first). A vocab-parallel parameter kept in
 * fp32 (embed_tokens, an untied lm_head) is read from the shard as under
 * param_dtype fp32. Frozen fp32 parameters after trainable ones keep the
 * frozen bf16 chunks before them inside the gradient's prefix (zeros the
 * optimizer never touches), as the vocab rows do.
 *
 * Inference-only sessions (ml_fsdp_opts.inference_only: scoring and
 * generation, never a training call): under param_dtype bf16 without
 * cpu_offload a unit with no fp32 part (no parameter kept in fp32,
 * ml_param.fp32) holds its parameters in the persistent bf16 shard alone
 * (ml_fsdp_unit.lp_only): each checkpoint value is rounded once into lp as
 * it is loaded (the rounding an unshard of the fp32 shard would do: the same
 * bits gathered), and no fp32 shard exists (shard NULL), so such a unit
 * keeps 2 bytes per shard element instead of 4 (+ 2 for lp once trained).
 * Units with an fp32 part, and every unit under param_dtype fp32 (the shard
 * is the weight) or cpu_offload (host fp32 shards, rounded on the way to the
 * device), keep their fp32 shard as without the option. Under any dtype
 * nothing can train: ml_fsdp_train_state refuses, naming inference_only, and
 * FSDP allocates no gradient staging (comm_buf, grad_buf, wire, host_grad:
 * nothing is reduced); nothing reads fp32 masters from an lp_only unit
 * (ml_fsdp_has_masters). */
#ifndef ML_FSDP_H
#define ML_FSDP_H

#include <stdbool.h>

#include "comm/comm.h"
#include "io/checkpoint.h"
#include "model/model.h"
#include "tensor/dtype.h"

/* reshard_after_forward of fully_shard: the default policy (layers true,
 * the root and the last layer false), or the same value for every unit. */
typedef enum { ML_RESHARD_DEFAULT, ML_RESHARD_ALWAYS, ML_RESHARD_NEVER } ml_reshard_policy;

/* FSDP2's fully_shard options (torch.distributed.fsdp.MixedPrecisionPolicy,
 * reshard_after_forward) plus the ZeRO stage and the prefetch depths. */
typedef struct ml_fsdp_opts {
  ml_dtype param_dtype;  /* ML_F32 or ML_BF16: all-gather dtype of the parameters, the
                            dtype the unsharded parameters are kept in, and so the GEMMs'
                            compute dtype (bf16 operands, fp32 accumulation) */
  ml_dtype reduce_dtype; /* ML_F32 or ML_BF16: dtype gradients are reduced in */
  ml_reshard_policy reshard_after_forward;
  int zero;              /* 3: params, grads and optimizer state sharded (FSDP); 2: params
                            stay unsharded between steps; 1: grads also all-reduced whole */
  int prefetch_forward;  /* units whose all-gather is issued ahead in forward (0 = none) */
  int prefetch_backward; /* the same in backward */
  bool cpu_offload;      /* CPUOffloadPolicy: shards, gradients and AdamW state in host memory,
                            the optimizer step on the host (see above) */
  bool inference_only;   /* no training state ever (ml_fsdp_train_state refuses); under bf16
                            the units' weights in their bf16 shard alone (see above) */
} ml_fsdp_opts;

typedef struct ml_fsdp_unit {
  ml_param **params;
  int n;
  bool *vocab;          /* per param: vocab-parallel (never gathered; ml_fsdp_rows) */
  int64_t *chunk_rows;  /* per param: ceil(local rows / dp) */
  int64_t *shard_off;   /* per param: offset of its chunk in the flat shard (the others'
                           chunks first, then the vocab-parallel ones) */
  int64_t *full_off;    /* per param: offset in the unsharded layout (same order) */
  int64_t shard_numel;  /* per rank, padding included */
  int64_t full_numel;   /* every parameter unsharded (ml_fsdp_gather_flat's layout) */
  int64_t gather_numel; /* per rank: the shard's leading part the all-gather and the
                           reduce-scatter move, all but the vocab-parallel chunks */
  int64_t gather_full;  /* those parameters unsharded: the leading part of full_numel */
  int64_t grad_numel;   /* per rank: the shard's leading part with a gradient and AdamW state
                           (through the last trainable chunk; shard_numel when nothing is
                           frozen, 0 when everything is): shard_grad, adam_m, adam_v's size */
  int64_t grad_full;    /* the gathered part's leading unsharded elements with a gradient
                           (through the last trainable gathered parameter): full_grad's size */
  float *shard;                       /* [shard_numel] fp32, where the shards live
                                         (ml_fsdp_shard_alloc); NULL in an lp_only unit */
  float *shard_grad, *adam_m, *adam_v; /* [grad_numel] fp32 each, likewise (NULL: frozen, or
                                          no training call yet: ml_fsdp_train_state) */
  float *dev_shard; /* cpu_offload: [shard_numel] fp32, the shard copied to the device for
                       its all-gather; kept while materialised where fp32 vocab rows read it */
  void *full;       /* [gather_full − f32_full] unsharded parameters in param_dtype, while
                       materialised (the fp32 part's: full32) */
  void *rows;       /* [shard_numel − gather_numel] bf16: the vocab-parallel rows in
                       param_dtype while materialised (param_dtype bf16; fp32 reads the
                       shard) */
  float *full_grad; /* [grad_full] unsharded fp32 gradients, during backward */
  float *rows_grad; /* [grad_numel − gather_numel] fp32: the trainable vocab-parallel rows'
                       gradient during backward (shard_grad's own part, or a buffer) */
  bool reshard_after_forward;
  /* an all-gather in flight (prefetch): its request and wire buffers */
  ml_request req;
  void *send, *recv;
  bool in_flight;
  /* cpu_offload: the reduced gradient's copy to the host */
  ml_event grad_ev;  /* recorded after its non-blocking copies */
  bool grad_pending; /* copies in flight (ml_fsdp_finish_backward waits) */
  bool grad_fresh;   /* shard_grad holds no value since ml_fsdp_zero_grads (it reads as
                        zeros: the first reduction writes it, ml_fsdp_settle_grad zeroes it) */
  bool frozen;       /* every parameter frozen (ml_param.frozen, requires_grad=False): as
                        FSDP2 on a module without trainable parameters, the unit is gathered
                        for forward only and has no gradient or AdamW state (shard_grad,
                        adam_m, adam_v NULL, full_grad never allocated) and no reduction */
  /* The unit's groups: the parameters' chunks, all-gather and reduce-scatter over dp, the
   * gradients' all-reduce over the replicas rep (size 1: none): ml_fsdp.dp and .rep for the
   * layers and the root; the ep_shard group and one rank for an expert unit */
  ml_comm *dp, *rep;
  int with;  /* the expert unit this one carries along (see above), or −1 */
  int layer; /* an expert unit's decoder layer, or −1 (the layers and the root) */
  /* The fp32 part (parameters kept in fp32 under a bf16 param_dtype: ml_param.fp32,
   * engine/fp32_params.h): the gathered part's last f32_numel elements per rank, after the
   * param_dtype ones, gathered by an all-gather of their own in fp32 into full32 */
  bool *f32;          /* per param: in the fp32 part */
  int64_t f32_numel;  /* per rank: [gather_numel − f32_numel, gather_numel) of the shard */
  int64_t f32_full;   /* unsharded: [gather_full − f32_full, gather_full) of the layout */
  float *full32;      /* [f32_full] the fp32 part unsharded, while materialised (full holds
                         the param_dtype part alone, gather_full − f32_full elements) */
  float *recv32;      /* its all-gather's receive buffer while one is started (one rank: the
                         shard's part itself) */
  ml_request req32;
  /* The persistent param_dtype shard (ml_fsdp_train_state under param_dtype bf16 without
   * cpu_offload, or an lp_only unit's weights from its init; NULL otherwise): [shard_numel] bf16, the shard rounded once per change of
   * the masters instead of at every unshard (FSDP2 MixedPrecisionPolicy casts param_dtype
   * before each all-gather; here the cast is kept). The all-gather sends its param_dtype
   * part as it is (one rank: it is the unsharded buffer itself), the vocab-parallel rows
   * are read from its rows part; its fp32 part's slots hold their rounding, unread. */
  uint16_t *lp;
  bool lp_fresh; /* lp holds the shard's current values: set where lp is rounded from the
                    shard (at an unshard when stale) or written by AdamW's pass (ml_be_adamw's
                    p_bf16); cleared by every other write to the shard (ml_fsdp_load,
                    ml_fsdp_swap_weights, ml_fsdp_params_changed); always set when lp_only */
  bool lp_only;  /* inference_only under bf16 (see above): lp is the unit's only copy of its
                    weights (allocated with the unit, written by ml_fsdp_load), shard NULL */
} ml_fsdp_unit;

/* fp32 elements a unit keeps where the shards live once it trains: the
 * shard (shard_numel), its gradient and AdamW's exp_avg, exp_avg_sq
 * (grad_numel each, from ml_fsdp_train_state on). An lp_only unit (never
 * trains) holds shard_numel bf16 elements instead (ml_fsdp_unit_bytes). */
static inline int64_t ml_fsdp_unit_floats(const ml_fsdp_unit *u) {
  return u->shard_numel + 3 * u->grad_numel;
}

/* Bytes of parameters a unit holds where the shards live while nothing
 * trained: the fp32 shard (4 · shard_numel), or for an lp_only unit the
 * bf16 shard alone (2 · shard_numel). */
static inline int64_t ml_fsdp_unit_bytes(const ml_fsdp_unit *u) {
  return (u->lp_only ? 2 : 4) * u->shard_numel;
}

typedef struct ml_fsdp {
  ml_backend *be;       /* the model's: buffers, the unsharded parameters, copies */
  ml_backend *shard_be; /* computes on the shards (zero, the gradients' tp step, norms,
                           clipping, AdamW) and copies them to and from the host: be, or under
                           cpu_offload its host peer (ml_be_host_peer: kernels/cpu) */
  ml_comm *dp;  /* dp_shard (× cp): the group the layers' and the root's parameters are
                   sharded over (ml_fsdp_unit.dp) */
  ml_comm *rep; /* dp_replicate: their HSDP replicas (size 1: plain FSDP) */
  ml_fsdp_opts opts;
  ml_fsdp_unit *units; /* n_layers + 1 (the root last), then the expert units (see above) */
  int n_units;
  bool vocab_parallel; /* the vocab-sized root parameters are vocab-parallel (see above) */
  float *comm_buf;  /* [max over units of unit->dp · gather_numel] fp32: gradient staging (a
                       unit's gradients use unit->dp blocks of its trainable prefix of the
                       gathered part); this and the three below: NULL where nothing is staged
                       (gradients accumulated in place) or reduced (inference_only) */
  float *grad_buf;  /* [max gather_numel] fp32: the reduced gradient, added to shard_grad */
  uint16_t *wire;   /* [as comm_buf] bf16 gradients on the wire (reduce_dtype BF16 only) */
  float *host_grad; /* cpu_offload: [max shard_numel] fp32 host staging of a reduced
                       gradient being accumulated */
  ml_comm *solo;    /* a one-rank comm: the expert units' replicas (none); NULL without them */
  int *held_unit;   /* [m->n_params] per parameter (by its index in m->params) the unit
                       holding it, or −1: none of this rank's (ml_fsdp_find) */
  int *held_index;  /* [m->n_params] its index in that unit */
  const ml_param *params; /* m->params, which held is indexed by */
} ml_fsdp;

/* Expert parallelism's placement of the experts (parallel/ep.h): with
 * ranks > 1, this rank holds experts [rank·E/ranks, (rank+1)·E/ranks) of
 * each sparse layer (Shard(0) over ep on the expert dimension) in an
 * expert unit sharded over `shard` (the ep_shard group); the other
 * experts' parameters are in no unit. */
typedef struct ml_fsdp_ep {
  int ranks, rank;
  ml_comm *shard;
} ml_fsdp_ep;

/* The FSDP unit of parameter p (fully_shard applied to every decoder layer,
 * then to the root, as torchtitan and NeMo do): its decoder layer's index
 * (ml_param.layer), or m->cfg.n_layers for the root (embedding, final
 * norm, lm_head). Units number n_layers + 1, the root last. */
int ml_fsdp_unit_of(const ml_model *m, const ml_param *p);

/* The parameters of unit u, in m->params order, into out[] (room for
 * m->n_params); returns their count. */
int ml_fsdp_unit_params(const ml_model *m, int u, ml_param **out);

/* Whether unit u of n_units (n_layers + 1, the root last) frees its
 * unsharded parameters after forward under `policy`: by default every
 * layer but the last (FSDP2 as torchtitan applies it); ALWAYS / NEVER: every
 * layer or none. Never the root: the vocab-parallel loss runs lm_head's
 * forward and backward chunk by chunk, so the root's forward ends only
 * when its backward has begun. */
bool ml_fsdp_reshard_after_forward(ml_reshard_policy policy, int u, int n_units);

/* Build the units of `m` (after TP is applied), allocate this rank's
 * parameter shards (not yet their gradients and AdamW state:
 * ml_fsdp_train_state) and fill them from the checkpoint `ck` (each rank reads only its
 * slice; ck NULL: left zero, nothing read); under ZeRO-1/2 gather every
 * unit once. dp: the sharding group;
 * rep: the HSDP replica group (size 1: plain FSDP). vocab_parallel: keep
 * embed_tokens.weight and an untied lm_head.weight vocab-parallel (see
 * above; f->vocab_parallel says whether they are: not when dp has one rank,
 * where the shard is the whole tensor). Errors: options out of range
 * (named), a parameter missing from the checkpoint or with another shape
 * (named, with both shapes), unreadable dtype, allocation. */
int ml_fsdp_init(ml_fsdp *f, ml_model *m, ml_comm *dp, ml_comm *rep, const ml_fsdp_opts *opts,
                 bool vocab_parallel, const ml_ckpt *ck);
/* ml_fsdp_init with the experts placed by ep (NULL, or ranks 1: as
 * ml_fsdp_init): an expert unit after the root for each sparse layer,
 * sharded over ep->shard (see above). Errors: those of ml_fsdp_init;
 * ep->rank outside 0 .. ranks − 1 or ranks not dividing num_experts
 * (named, with the values). */
int ml_fsdp_init_ep(ml_fsdp *f, ml_model *m, ml_comm *dp, ml_comm *rep, const ml_fsdp_ep *ep,
                    const ml_fsdp_opts *opts, bool vocab_parallel, const ml_ckpt *ck);
/* The unit holding parameter p (one of the model's) and p's index there:
 * true with *u, *i set, or false when no unit of this rank holds it
 * (another ep rank's expert). */
bool ml_fsdp_find(const ml_fsdp *f, const ml_param *p, int *u, int *i);

/* Overwrite the fp32 shards of the parameters from checkpoint `ck` (its
 * tensors, or tensors in memory dressed as one): each rank reads its rows
 * of each TP-local tensor, as ml_fsdp_init does (an lp_only unit's rounded
 * once into its bf16 shard, see above). all: every parameter must
 * be there; else the ones it lacks keep their values. Gradients and AdamW
 * state are untouched; the unsharded copies are the caller's to refresh
 * (ml_engine_sync_params). Errors: a missing tensor (all), another shape,
 * an unreadable dtype (named), allocation. */
int ml_fsdp_load(ml_fsdp *f, const ml_ckpt *ck, bool all);
void ml_fsdp_destroy(ml_fsdp *f);

/* Start unit u's all-gather without waiting (no-op when u is not one of
 * the layers' units or the root, or is materialised or already in
 * flight), and its expert unit's (ml_fsdp_unit.with). */
int ml_fsdp_prefetch(ml_fsdp *f, int u);
/* Materialise unit u's parameters and its expert unit's (all-gather, or
 * wait for its prefetch; no-op if already there) and point param->data at
 * them; its
 * vocab-parallel parameters' rows in param_dtype (ml_fsdp_rows; their
 * param->data stays NULL). */
int ml_fsdp_unshard(ml_fsdp *f, int u);
/* Free unit u's (and its expert unit's) unsharded parameters
 * (param->data = NULL); no-op when the shard is the full tensor or the
 * parameters persist (ZeRO-1/2). */
void ml_fsdp_reshard(ml_fsdp *f, int u);
/* Unsharded gradients for unit u and its expert unit (param->grad set):
 * zeroed, or with one rank the shard's gradient itself (backward accumulates into it); for
 * its vocab-parallel parameters the gradient of their rows (ml_fsdp_rows;
 * their param->grad stays NULL). */
int ml_fsdp_grad_begin(ml_fsdp *f, int u);
/* Reduce unit u's gradients and its expert unit's, each over its own
 * group (reduce-scatter over dp, or all-reduce under ZeRO-1; then
 * all-reduce over the replicas) and add this rank's part to
 * shard_grad (+=, so micro-batches accumulate; the first after
 * ml_fsdp_zero_grads writes it: =, as 0 + g), then free them. The vocab-parallel rows' gradient is complete already:
 * rounded to param_dtype, all-reduced over the replicas in reduce_dtype
 * (one more all-reduce under HSDP), added. */
int ml_fsdp_reduce_grads(ml_fsdp *f, int u);

/* This rank's rows of vocab-parallel parameter p while its unit is
 * materialised (ml_fsdp_unshard): global rows p->offset[0] + r0 .. (its
 * FSDP chunk, ml_fsdp_param_rows), all p->local[1] columns, in param_dtype
 * (fp32: the shard itself; bf16: the copy the unshard rounded), and
 * between ml_fsdp_grad_begin and ml_fsdp_reduce_grads of its unit their
 * fp32 gradient (+=), else grad NULL. Errors: p not vocab-parallel, its
 * unit not materialised. */
int ml_fsdp_rows(const ml_fsdp *f, const ml_param *p, ml_rows *w);

/* All-gather a flat per-rank array laid out like unit u's shard where the
 * shards live (`src`, e.g. shard_grad) into the unsharded layout `dst`
 * [full_numel] of device memory, every
 * parameter (the vocab-parallel ones too: for exports and tests, with its
 * own staging of dp · shard_numel floats). */
int ml_fsdp_gather_flat(ml_fsdp *f, int u, const float *src, float *dst);

/* Re-gather the persistent unsharded parameters (ZeRO-1/2) from the
 * shards after they changed (optimizer step, checkpoint load); no-op under
 * ZeRO-3. Collective over the group. */
int ml_fsdp_sync_params(ml_fsdp *f);

/* Whether unit u computes from a bf16 copy of its weights: param_dtype
 * bf16 without cpu_offload, and no parameter of it kept in fp32 (its
 * all-gather sends the bf16 shard lp, or rounds the fp32 shard into one):
 * the units an inference_only session keeps in bf16 alone (lp_only), and
 * those whose weights ml_fsdp_swap_weights exchanges in bf16. */
bool ml_fsdp_bf16_weights(const ml_fsdp *f, const ml_fsdp_unit *u);

/* Exchange every unit's weights with other[u], as a swap of the module's
 * parameters would (NeMo RL's use_reference_model swaps the reference state
 * dict in): a unit of ml_fsdp_bf16_weights exchanges its bf16 shard lp
 * (other[u]: shard_numel bf16 on the device, or NULL where the unit has no
 * lp yet: a session that never trained), the others their fp32 shard
 * (other[u]: shard_numel floats where the shards live,
 * ml_fsdp_shard_alloc). in: the incoming bf16 weights are current as they
 * are (a reference's copy: lp fresh); !in: they are the fp32 shard's own
 * lp back (stale unless lp_only: rounded afresh at the next unshard, as
 * after any write to the masters). The unsharded parameters of the old
 * weights are dropped (ZeRO-3; the next forward gathers the new ones),
 * re-pointed where they alias the shard, or re-gathered where they
 * persist (ZeRO-1/2: collective over the group, ml_fsdp_sync_params; not
 * with regather false, for a teardown). The gradients and AdamW state
 * stay. The pointers are owned by whoever holds them after the call: a
 * caller swaps back before ml_fsdp_destroy. Errors: those of the
 * re-gather. */
int ml_fsdp_swap_weights(ml_fsdp *f, void **other, bool in, bool regather);

/* Whether every unit holds its fp32 shard (the masters; false where an
 * inference_only session keeps a unit in bf16 alone, ml_fsdp_unit.lp_only):
 * what reads the shards' fp32 values (exports, run checkpoints, the
 * weights stream, a reference policy's fp32 copy, ml_fsdp_gather_flat of
 * shard) needs it. */
bool ml_fsdp_has_masters(const ml_fsdp *f);

/* Mark every unit's persistent param_dtype shard stale (fsdp.h lp_fresh):
 * a caller that wrote the fp32 shards other than through ml_fsdp_load or
 * ml_fsdp_swap_weights (a checkpoint resume, a refit into a replica, the
 * reference policy's shards swapped back) calls it before the next
 * unshard, which then rounds them afresh. An lp_only unit's bf16 shard is
 * its weight: never stale. */
void ml_fsdp_params_changed(ml_fsdp *f);

/* count elements of `elem` bytes where the shards live: the backend's
 * device memory, or under cpu_offload its host memory (ml_be_host_alloc:
 * pinned on CUDA); NULL with ml_be_alloc's message (what_fmt, ...). Free
 * with ml_fsdp_shard_free. */
#define ml_fsdp_shard_alloc(f, count, elem, ...)                                        \
  ml_be_alloc_at(__FILE__, __LINE__, (f)->be, (f)->opts.cpu_offload, (count), (elem), \
                 __VA_ARGS__)
void ml_fsdp_shard_free(const ml_fsdp *f, void *p);
/* The copy kinds between the shards' memory and the device's: H2D / D2H
 * under cpu_offload, else D2D (for ml_be_copy on f->be). */
ml_copy_kind ml_fsdp_shard_to_device(const ml_fsdp *f);
ml_copy_kind ml_fsdp_device_to_shard(const ml_fsdp *f);

/* Zero every unit's gradient, lazily (torch's
 * optimizer.zero_grad(set_to_none=True): FSDP2's sharded grads are None
 * until a backward sets them): mark each trainable unit fresh, its
 * shard_grad unwritten. The unit's next reduced gradient is written (=, as
 * 0 + g: bitwise an add into zeros; under cpu_offload copied without
 * waiting); where the backward accumulates into shard_grad itself (one
 * rank in fp32, the vocab rows) ml_fsdp_grad_begin zeroes it first; every
 * other reader of shard_grad settles it (ml_fsdp_settle_grad) first. The
 * training state must exist (ml_fsdp_train_state). */
void ml_fsdp_zero_grads(ml_fsdp *f);
/* unit's shard_grad zeroed (on shard_be) if it is still fresh (no
 * gradient since ml_fsdp_zero_grads), and no longer fresh: what a reader
 * of shard_grad outside FSDP's reduction calls first (the grad norm,
 * clipping, AdamW, the export, the tp step's stash). No-op for a frozen
 * unit. Errors: the backend's. */
int ml_fsdp_settle_grad(ml_fsdp *f, ml_fsdp_unit *unit);
/* ml_fsdp_settle_grad of every unit. */
int ml_fsdp_settle_grads(ml_fsdp *f);
/* The end of a backward (FSDP2's finalize_backward): wait for the
 * gradients' copies to the host still in flight (cpu_offload), after which
 * shard_grad may be read on the host; then ml_fsdp_settle_grads (the units
 * the backward gave no gradient read as zeros). Errors: the device's. */
int ml_fsdp_finish_backward(ml_fsdp *f);

/* The training state of every unit that has a trainable parameter:
 * shard_grad, adam_m and adam_v (grad_numel fp32 each, one block where the
 * shards live, ml_fsdp_shard_alloc), zeroed and marked fresh; no-op for
 * the units that have it. A session that only scores never calls it and
 * never holds these 12 bytes per trainable shard element (torch likewise
 * creates .grad at the first backward and AdamW's exp_avg / exp_avg_sq at
 * the first optimizer step). Its callers are the training entry points
 * (ml_engine_train_state). Under param_dtype bf16 without cpu_offload it
 * also gives every unit its persistent bf16 shard (lp, 2 bytes per shard
 * element), which AdamW's pass keeps current. Errors: allocation (named);
 * an inference_only FSDP (opts.inference_only: named, nothing allocated). */
int ml_fsdp_train_state(ml_fsdp *f);

/* Which unit holds parameter p: its index, and where its chunk lies. */
int ml_fsdp_param_index(const ml_fsdp_unit *unit, const ml_param *p);

/* Rows [r0, r0+nr) of p's local tensor held in this rank's shard. */
void ml_fsdp_param_rows(const ml_fsdp *f, const ml_fsdp_unit *unit, int i, int64_t *r0,
                        int64_t *nr);

#endif

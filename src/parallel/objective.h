/* Per-token training objectives on the log-prob of each target: the
 * losses an RL loop trains with (include/meshlm/meshlm.h meshlm_loss gives
 * the formulas and their sources: NeMo RL NLLLoss, ClippedPGLossFn with its
 * dual clip, calculate_kl_penalty_joschu2020's k3). The vocab-parallel loss
 * (parallel/loss.h) computes lp_t for every target and asks, per token, for
 * the loss and dL/dlp_t; the logits' gradient is then −dL/dlp_t · (softmax
 * − onehot), so full-vocabulary logits never exist here either. Host code,
 * fp64 arithmetic, the same for every backend. */
#ifndef ML_OBJECTIVE_H
#define ML_OBJECTIVE_H

#include <stdbool.h>
#include <stdint.h>

typedef enum { ML_OBJ_NLL, ML_OBJ_WEIGHTED_NLL, ML_OBJ_CLIPPED_PG, ML_OBJ_CUSTOM } ml_obj_kind;

struct ml_obj_in;

/* A caller's objective (ML_OBJ_CUSTOM) on n trained targets of one chunk,
 * all this rank's own: lp [n] their log-probs (nats), in [n] their inputs
 * (w, idx, ...). It writes loss [n], each target's term of the loss
 * (already normalised: the loss is their sum over the global batch), and
 * grad [n] = ∂loss/∂lp_t; returns 0, or −1 with the error recorded
 * (ml_err). It must not call collectives: ranks call it different numbers
 * of times. */
typedef int (*ml_obj_fn)(void *ctx, int64_t n, const float *lp, const struct ml_obj_in *in,
                         double *loss, double *grad);

typedef struct ml_objective {
  ml_obj_kind kind;
  double clip_low, clip_high; /* ratio clipped to [1 − clip_low, 1 + clip_high] */
  double clip_c;              /* dual clip c > 1 where the advantage is negative; 0: off */
  double kl_beta;             /* β of the k3 penalty (WEIGHTED_NLL, CLIPPED_PG); 0: off */
  bool is_weighted;           /* CLIPPED_PG: the clipped term times each target's in.rho (an
                                 importance-sampling weight, constant in lp) */
  ml_obj_fn fn;               /* CUSTOM: the caller's objective, with ctx */
  void *ctx;
  double entropy_coef;        /* c of the entropy bonus: the loss − c·Σ_t w_t·H_t (H_t the
                                 target's whole-distribution entropy, w_t its weight below),
                                 applied by the vocab-parallel loss (parallel/loss.c), its
                                 gradient exact on the logits; 0: off */
} ml_objective;

/* One target's inputs. w: its weight in the global mean — mask × the
 * normalisation (1 / global masked targets at token level; 1 / (the
 * sequence's masked targets × global sequences) at sequence level), 0 for
 * a target not trained; adv: its advantage / weight A_t; old_lp, ref_lp:
 * log-probs of the sampling and the reference policy (nats). */
typedef struct ml_obj_in {
  float w, adv, old_lp, ref_lp;
  int64_t idx; /* the caller's own index of the target (api: its place in the batch's
                  prediction-aligned arrays), −1 where no target; read by CUSTOM only */
  float rho;   /* the importance-sampling weight of the clipped term (is_weighted only) */
} ml_obj_in;

/* Sums over targets, this rank's: loss Σ w·(ℓ + β·k3) (− c·Σ w·H with
 * an entropy bonus), kl Σ w·β·k3; trained (w ≠ 0) and clipped (trained
 * targets whose gradient a clip removed) counts; entropy Σ w·H (with an
 * entropy bonus only: its mean, normalised as the loss). */
typedef struct ml_obj_sums {
  double loss, kl;
  int64_t trained, clipped;
  double entropy;
} ml_obj_sums;

/* Target with inputs `in` and log-prob lp: adds its terms to *acc and
 * returns −dL/dlp, the weight of its (softmax − onehot) in the logits'
 * gradient (for NLL: w). A target with w = 0 adds nothing and returns 0
 * (its other inputs are not read: they may be garbage). */
float ml_objective_token(const ml_objective *o, const ml_obj_in *in, float lp, ml_obj_sums *acc);

/* The chunk-level hook the vocab-parallel loss calls once per chunk of
 * targets after their log-softmax: n targets, lp [n], in [n] (in[i] the
 * inputs of target i), w [n] on entry nonzero for a target of the NLL pass
 * (mask 1), on return −dL/dlp_i (0 for a non-target). Targets [own0,
 * own1) are this rank's own: their terms go to *acc, the others' are
 * dropped. A built-in objective runs ml_objective_token on every target
 * (the same weights on every rank, no communication). A CUSTOM one is
 * called on the trained targets (in.w != 0) of [own0, own1) only and leaves every
 * other weight 0: when the pass runs over other ranks' targets too
 * (vocab parallelism over a group) the caller sums w over that group
 * (ml_objective_own_only). Errors: the objective's, allocation. */
int ml_objective_chunk(const ml_objective *o, int64_t n, const float *lp, const ml_obj_in *in,
                       int64_t own0, int64_t own1, float *w, ml_obj_sums *acc);

/* Whether ml_objective_chunk leaves the weights of targets not this
 * rank's own at 0 (CUSTOM): their owners hold them. */
bool ml_objective_own_only(const ml_objective *o);

#endif

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

#include <stdint.h>

typedef enum { ML_OBJ_NLL, ML_OBJ_WEIGHTED_NLL, ML_OBJ_CLIPPED_PG } ml_obj_kind;

typedef struct ml_objective {
  ml_obj_kind kind;
  double clip_low, clip_high; /* ratio clipped to [1 − clip_low, 1 + clip_high] */
  double clip_c;              /* dual clip c > 1 where the advantage is negative; 0: off */
  double kl_beta;             /* β of the k3 penalty (WEIGHTED_NLL, CLIPPED_PG); 0: off */
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

#endif

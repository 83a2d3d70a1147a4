/* Importance sampling between the generator's and the trainer's log-probs
 * (include/meshlm/meshlm.h meshlm_is_level): the per-token weights ρ and
 * the mismatch metrics, as NeMo RL nemo_rl/algorithms/loss_functions.py
 * ClippedPGLossFn.__call__ computes them (its "Off-policy (actor)
 * importance-sampling correction" and "Truncated Importance Sampling"
 * blocks, token_mult_prob_error, gen_kl_error). Host arithmetic in fp64,
 * ρ rounded once to fp32. */
#include <math.h>
#include <stdlib.h>

#include "api/train.h"
#include "common/checked.h"

/* torch.nan_to_num(x, nan=0, posinf=0, neginf=0) */
static double nan_to_zero(double x) { return isfinite(x) ? x : 0.0; }

static bool masked_at(const meshlm_train_batch *b, int64_t i) {
  return !b->token_mask || b->token_mask[i];
}

/* The metrics' local sums over the masked targets: NeMo's
 * masked_mean(exp(|gen − old|·mask)) and masked_mean(k3) with
 * k3(logprobs = gen, reference = old) = exp(old − gen) − (old − gen) − 1
 * (calculate_kl's "k3", calculate_kl_penalty_joschu2020). */
static void metrics(const meshlm_train_batch *b, int64_t preds, api_is *is) {
  for (int64_t i = 0; i < preds; i++) {
    if (!masked_at(b, i)) continue;
    double d = (double)b->old_logprobs[i] - (double)b->generation_logprobs[i];
    is->mult_err += exp(fabs(d));
    is->gen_kl += exp(d) - d - 1.0;
    is->tokens++;
  }
}

/* Sequence k's Σ and count over its masked targets of old − gen (nan_to_num
 * of each term when `clean`, as seq-mask-tis's log_is_ratio). */
static double seq_log_ratio(const meshlm_train_batch *b, int64_t o, int64_t L, bool clean,
                            int64_t *n) {
  double sum = 0.0;
  *n = 0;
  for (int64_t t = 0; t < L - 1; t++) {
    if (!masked_at(b, o + t)) continue;
    double d = (double)b->old_logprobs[o + t] - (double)b->generation_logprobs[o + t];
    sum += clean ? nan_to_zero(d) : d;
    ++*n;
  }
  return sum;
}

/* ρ of sequence k's targets before truncation: per token exp(old − gen),
 * or the sequence's exp(Σ masked (old − gen)); non-finite ones 0. */
static void raw_weights(const meshlm_train_batch *b, const meshlm_loss *l, int64_t o, int64_t L,
                        double *rho) {
  int64_t n;
  double seq = l->is_level == MESHLM_IS_SEQUENCE
                   ? nan_to_zero(exp(seq_log_ratio(b, o, L, false, &n)))
                   : 0.0;
  for (int64_t t = 0; t < L - 1; t++)
    rho[t] = l->is_level == MESHLM_IS_SEQUENCE
                 ? seq
                 : nan_to_zero(exp((double)b->old_logprobs[o + t] -
                                   (double)b->generation_logprobs[o + t]));
}

/* Truncation of sequence k's weights rho [L − 1] (in place); the
 * out-of-bounds counts into is. */
static void truncate_weights(const meshlm_train_batch *b, const meshlm_loss *l, int64_t o,
                             int64_t L, double *rho, api_is *is) {
  double lo = l->is_ratio_min, hi = l->is_ratio_max;
  if (l->is_truncation == MESHLM_IS_TRUNC_SEQ_MASK_TIS) {
    int64_t n;
    double sum = seq_log_ratio(b, o, L, true, &n);
    if (n == 0) return; /* no masked target: not a sample (NeMo sample_mask) */
    double geo = exp(sum / (double)n);
    bool keep = geo >= lo && geo <= hi;
    is->oob += !keep;
    is->oob_of++;
    for (int64_t t = 0; !keep && t < L - 1; t++) rho[t] = 0.0;
    return;
  }
  for (int64_t t = 0; t < L - 1; t++) {
    bool out = l->is_truncation == MESHLM_IS_TRUNC_TIS ? rho[t] > hi
                                                       : !(rho[t] >= lo && rho[t] <= hi);
    if (masked_at(b, o + t)) {
      is->oob += out;
      is->oob_of++;
    }
    if (l->is_truncation == MESHLM_IS_TRUNC_TIS) rho[t] = out ? hi : rho[t];
    else if (out) rho[t] = 0.0;
  }
}

int api_is_prepare(const meshlm_train_batch *b, const meshlm_loss *l, const api_plan *p,
                   int64_t preds, api_is *is) {
  *is = (api_is){0};
  if (b->generation_logprobs && b->old_logprobs) metrics(b, preds, is);
  if (l->kind != MESHLM_LOSS_CLIPPED_PG || l->is_level == MESHLM_IS_OFF) return 0;
  int64_t longest = 1;
  for (int64_t k = 0; k < b->seqs.n; k++)
    longest = b->seqs.lens[k] > longest ? b->seqs.lens[k] : longest;
  is->rho = ml_malloc_array(preds > 0 ? preds : 1, sizeof *is->rho,
                            "the importance-sampling weights (%lld targets)", (long long)preds);
  double *rho = ml_malloc_array(longest, sizeof *rho,
                                "a sequence's importance-sampling weights (%lld)",
                                (long long)longest);
  if (!is->rho || !rho) {
    free(rho);
    return -1;
  }
  for (int64_t k = 0; k < b->seqs.n; k++) {
    int64_t L = b->seqs.lens[k], o = p->start[k] - k;
    raw_weights(b, l, o, L, rho);
    if (l->is_truncation != MESHLM_IS_TRUNC_NONE) truncate_weights(b, l, o, L, rho, is);
    /* a non-finite input is bad data, not an overflow to zero: its ρ is NaN, so the loss is
       not finite and the step skipped (its reason names the input) */
    for (int64_t t = 0; t < L - 1; t++)
      is->rho[o + t] = masked_at(b, o + t) && !(isfinite(b->old_logprobs[o + t]) &&
                                               isfinite(b->generation_logprobs[o + t]))
                           ? NAN
                           : (float)rho[t];
  }
  free(rho);
  return 0;
}

void api_is_free(api_is *is) {
  free(is->rho);
  is->rho = NULL;
}

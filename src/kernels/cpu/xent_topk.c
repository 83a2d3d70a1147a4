/* Per-token top-k of the logits over vocab shards and column tiles
 * (NeMo RL's get_topk_logits, its distributed_vocab_topk: a local top-k
 * per shard, the candidates all-gathered, a top-k of them), never over
 * full-vocabulary logits: a running list per token of k (logit, global
 * id) pairs, best first — larger logit, of equal logits the lower id (a
 * total order, so the result does not depend on the order candidates
 * arrive in: tiles, ranks); an empty entry has id −1 and is worse than any
 * candidate; NaN logits are skipped, as the row max skips them. */
#include <math.h>

#include "kernels/cpu/kernels.h"

// whether (v, i) goes before the entry (w, j)
static inline int better(float v, int32_t i, float w, int32_t j) {
  return j < 0 || v > w || (v == w && i < j);
}

// (v, i) into the sorted list val, id [k] where it belongs, the last entry dropped
static void insert(float v, int32_t i, int64_t k, float *val, int32_t *id) {
  if (k == 0 || !better(v, i, val[k - 1], id[k - 1])) return;
  int64_t p = k - 1;
  for (; p > 0 && better(v, i, val[p - 1], id[p - 1]); p--) {
    val[p] = val[p - 1];
    id[p] = id[p - 1];
  }
  val[p] = v;
  id[p] = i;
}

// val, id: [T, k]
void k_xent_topk_clear(int64_t T, int64_t k, float *val, int32_t *id) {
  for (int64_t i = 0; i < T * k; i++) val[i] = -INFINITY, id[i] = -1;
}

// logits: [T, V] the columns v0 .. v0+V−1; val, id: [T, k]
void k_xent_topk_online(const float *logits, int64_t T, int64_t V, int64_t v0, int64_t k,
                        float *val, int32_t *id) {
#pragma omp parallel for if (K_PAR(T, T * V))
  for (int64_t t = 0; t < T; t++) {
    const float *l = logits + t * V;
    for (int64_t j = 0; j < V; j++)
      if (!isnan(l[j])) insert(l[j], (int32_t)(v0 + j), k, val + t * k, id + t * k);
  }
}

// cval, cid: [P, T, k]; val, id: [T, k]
void k_xent_topk_merge(int64_t P, int64_t T, int64_t k, const float *cval, const int32_t *cid,
                       float *val, int32_t *id) {
  k_xent_topk_clear(T, k, val, id);
#pragma omp parallel for if (K_PAR(T, T * P * k))
  for (int64_t t = 0; t < T; t++)
    for (int64_t p = 0; p < P; p++)
      for (int64_t j = 0; j < k; j++) {
        int64_t c = (p * T + t) * k + j;
        if (cid[c] >= 0) insert(cval[c], cid[c], k, val + t * k, id + t * k);
      }
}

// M, se: [T]; val, id, lp: [T, k] (lp may alias val)
void k_xent_topk_logprobs(int64_t T, int64_t k, const float *M, const float *se,
                          const float *val, const int32_t *id, float *lp) {
#pragma omp parallel for if (K_PAR(T, T * k))
  for (int64_t t = 0; t < T; t++)
    for (int64_t j = 0; j < k; j++) {
      int64_t c = t * k + j;
      float d = val[c] - M[t]; /* k_xent_sumexp_target's / k_xent_rebase's tl */
      lp[c] = id[c] >= 0 ? (float)((double)d - log((double)se[t])) : -INFINITY;
    }
}

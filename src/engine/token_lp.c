#include "engine/token_lp.h"

#include "common/status.h"
#include "tensor/placement.h"

int ml_token_logprob(ml_backend *be, const float *logits, int64_t V, int parts, int32_t token,
                     float *out) {
  /* device scratch: sums [2] fp64, then mx, se, tl, lp, w, part_se, part_tl [1] fp32 and the
     target [1] */
  double *sums = ml_be_alloc(be, 6, sizeof(double), "a token's log-prob statistics");
  if (!sums) return -1;
  float *mx = (float *)(sums + 2), *se = mx + 1, *tl = mx + 2, *lp = mx + 3, *w = mx + 4;
  float *pse = mx + 5, *ptl = mx + 6;
  int32_t *y = (int32_t *)(mx + 7); /* 2 doubles + 7 floats + 1 int32 = 48 bytes */
  int rc = ml_be_zero(be, sums, 2 * sizeof(double));
  if (!rc) rc = ml_be_copy(be, y, &token, sizeof token, ML_COPY_H2D);
  if (!rc) rc = ml_be_xent_rowmax(be, logits, 1, V, mx);
  /* each part's sum of exp (and the owner's target logit), added in part order in fp32 as
     the loss's all-reduce SUM over tp adds its ranks' */
  float total_se = 0.0f, total_tl = 0.0f;
  for (int q = 0; !rc && q < parts; q++) {
    int64_t v0, n;
    ml_chunk(V, parts, q, &v0, &n);
    float hse = 0.0f, htl = 0.0f;
    if (n > 0) rc = ml_be_xent_sumexp_target(be, logits + v0, 1, n, v0, y, mx, pse, ptl);
    if (!rc && n > 0) rc = ml_be_copy(be, &hse, pse, sizeof hse, ML_COPY_D2H);
    if (!rc && n > 0) rc = ml_be_copy(be, &htl, ptl, sizeof htl, ML_COPY_D2H);
    total_se = q == 0 ? hse : total_se + hse;
    total_tl = q == 0 ? htl : total_tl + htl;
  }
  if (!rc) rc = ml_be_copy(be, se, &total_se, sizeof total_se, ML_COPY_H2D);
  if (!rc) rc = ml_be_copy(be, tl, &total_tl, sizeof total_tl, ML_COPY_H2D);
  if (!rc) rc = ml_be_xent_logprobs(be, se, tl, y, 1, 0.0f, lp, w, sums);
  if (!rc) rc = ml_be_copy(be, out, lp, sizeof *out, ML_COPY_D2H);
  ml_be_free(be, sums);
  return rc;
}

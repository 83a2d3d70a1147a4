#include "engine/token_lp.h"

#include "common/status.h"

int ml_token_logprob(ml_backend *be, const float *logits, int64_t V, int32_t token, float *out) {
  /* device scratch: sums [2] fp64, then mx, se, tl, lp, w [1] fp32 and the target [1] */
  double *sums = ml_be_alloc(be, 5, sizeof(double), "a token's log-prob statistics");
  if (!sums) return -1;
  float *mx = (float *)(sums + 2), *se = mx + 1, *tl = mx + 2, *lp = mx + 3, *w = mx + 4;
  int32_t *y = (int32_t *)(mx + 5); /* 2 doubles + 5 floats + 1 int32 = 40 bytes */
  int rc = ml_be_zero(be, sums, 2 * sizeof(double));
  if (!rc) rc = ml_be_copy(be, y, &token, sizeof token, ML_COPY_H2D);
  if (!rc) rc = ml_be_xent_rowmax(be, logits, 1, V, mx);
  if (!rc) rc = ml_be_xent_sumexp_target(be, logits, 1, V, 0, y, mx, se, tl);
  if (!rc) rc = ml_be_xent_logprobs(be, se, tl, y, 1, 0.0f, lp, w, sums);
  if (!rc) rc = ml_be_copy(be, out, lp, sizeof *out, ML_COPY_D2H);
  ml_be_free(be, sums);
  return rc;
}

/* The entropy and top-k kernels (kernels/cpu/xent_entropy.c,
 * xent_topk.c) as the fused classifier runs them (parallel/loss.c): a row
 * of V logits split into two vocab shards, each in column tiles, against
 * a double-precision reference over the whole row, and against the
 * whole-row path (one shard, one tile).
 *  - entropy: online over the tiles, rebased onto the reduced max, the
 *    shards' sums added in fp32 (the SUM all-reduce), within the bound
 *    derived at entropy_bound;
 *  - top-k: exact selection, so the tiled and sharded lists, merged, equal
 *    the whole row's bit for bit (memcmp), ties ordered by the lower id,
 *    NaNs skipped, a shard narrower than k (empty entries) merged; their
 *    log-probs bitwise k_xent_logprobs's for the same token as target;
 *  - the entropy bonus's backward (k_xent_bwd_entropy) against the
 *    gradient of w·(−log p_y) − ew·H in double, dH/dl_j = −p_j(log p_j +
 *    H), within the bound derived at test_bwd_entropy. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>  // after the headers it needs

#include "check_util.h"
#include "kernels/cpu/kernels.h"
#include "tolerance.h"

enum { T = 9, V = 1001, SPLIT = 400, COLS = 96, K = 7 };

/* The statistics of a row's shard [v0, v0 + n) in tiles of COLS columns:
 * the running max, se and sl (entropy_online before xent_online, as
 * loss.c tiled_stats). */
static void shard_online(const float *lg, int64_t v0, int64_t n, float *mx, float *se, float *sl,
                         float *val, int32_t *id) {
  float *tile = malloc(sizeof(float) * T * COLS), *tl = calloc(T, sizeof(float));
  int32_t y[T];
  for (int t = 0; t < T; t++) y[t] = -1, se[t] = 0.0f, sl[t] = 0.0f;
  k_xent_topk_clear(T, K, val, id);
  for (int64_t r0 = 0; r0 < n; r0 += COLS) {
    int64_t c = n - r0 < COLS ? n - r0 : COLS;
    for (int t = 0; t < T; t++) memcpy(tile + t * c, lg + t * V + v0 + r0, sizeof(float) * c);
    k_xent_entropy_online(tile, T, c, mx, se, sl);
    k_xent_topk_online(tile, T, c, v0 + r0, K, val, id);
    k_xent_online(tile, T, c, v0 + r0, y, mx, se, tl);
  }
  free(tile), free(tl);
}

/* Per token: the reference entropy (double, whole row) and the bound on
 * |H − ref|. With d_j = fl(l_j − m) (relative u) and e_j = expf(d_j)
 * (TOL_LIBM roundings, and e·u|d_j| from d's error), every term of se and
 * of sl = Σ e_j·d_j (the product exact in fp64) has the same sign, so each
 * sum is within gamma(V + TOL_LIBM + 2 + max|d_j|) relative (R2, R3),
 * plus the tiles' moves and the rebase (tol_xent_online, the same for sl:
 * its move e^d·(sl + d·se) adds two same-signed terms, d·se carrying se's
 * error) and the shards' fp32 addition (u): e_se. Then H = log(se) −
 * sl/se: |Δ| <= e_se (log of a relative error; log itself TOL_LIBM·u64
 * relative) + (|sl|/se)·(2·e_se + e_se + u) + u·H (the rounding to fp32). */
static void entropy_ref(const float *lg, double tiles, double *ref, double *bound) {
  for (int t = 0; t < T; t++) {
    const float *l = lg + t * V;
    double m = -INFINITY, se = 0, sl = 0, dmax = 0;
    for (int j = 0; j < V; j++) m = fmax(m, l[j]);
    for (int j = 0; j < V; j++) {
      double d = l[j] - m, e = exp(d);
      if (e == 0.0) continue; /* l = −inf: no term (as the kernel's) */
      se += e, sl += e * d, dmax = fmax(dmax, -d);
    }
    ref[t] = log(se) - sl / se;
    double e_se = tol_gamma(V + TOL_LIBM + 2.0 + dmax) + tol_xent_online(tiles) + TOL_U;
    bound[t] = e_se + TOL_LIBM * TOL_U64 * log(se) + fabs(sl) / se * (3.0 * e_se + TOL_U) +
               TOL_U * ref[t];
  }
}

static void test_entropy(void **state) {
  (void)state;
  float *lg = rand_buf(T * V, 6.0f);
  lg[3 * V + 17] = -INFINITY; /* a masked logit: a zero term, not 0·inf */
  double ref[T], bound[T];
  entropy_ref(lg, ceil((double)(V - SPLIT) / COLS), ref, bound);
  /* two shards, tiled: online, MAX of the maxes, rebase, SUM in fp32 */
  float mx[2][T], se[2][T], sl[2][T], M[T], H[T], val[2][T * K];
  int32_t id[2][T * K], y[T];
  for (int t = 0; t < T; t++) y[t] = -1;
  shard_online(lg, 0, SPLIT, mx[0], se[0], sl[0], val[0], id[0]);
  shard_online(lg, SPLIT, V - SPLIT, mx[1], se[1], sl[1], val[1], id[1]);
  for (int t = 0; t < T; t++) M[t] = fmaxf(mx[0][t], mx[1][t]);
  float tl[T] = {0};
  for (int s = 0; s < 2; s++) {
    k_xent_entropy_rebase(T, mx[s], M, se[s], sl[s]);
    k_xent_rebase(T, s ? V - SPLIT : SPLIT, s ? SPLIT : 0, y, mx[s], M, se[s], tl);
  }
  float gse[T], gsl[T];
  for (int t = 0; t < T; t++) gse[t] = se[0][t] + se[1][t], gsl[t] = sl[0][t] + sl[1][t];
  k_xent_entropy(gse, gsl, T, H);
  expect_within("entropy: two shards in tiles vs double", H, ref, bound, T);
  /* whole rows: the max, then entropy_sum about it */
  float wmx[T], wse[T], wtl[T], wsl[T], wH[T];
  k_xent_rowmax(lg, T, V, wmx);
  k_xent_sumexp_target(lg, T, V, 0, y, wmx, wse, wtl);
  k_xent_entropy_sum(lg, T, V, wmx, wsl);
  k_xent_entropy(wse, wsl, T, wH);
  expect_within("entropy: whole rows vs double", wH, ref, bound, T);
  free(lg);
}

static void test_topk(void **state) {
  (void)state;
  float *lg = rand_buf(T * V, 6.0f);
  /* ties: row 0 has 10 equal maxima across both shards and tiles; row 1 a NaN */
  for (int j = 0; j < 10; j++) lg[j * 97 + 5] = 50.0f;
  lg[V + 3] = NAN;
  float wval[T * K], val[2][T * K], mx[2][T], se[2][T], sl[2][T], mval[T * K];
  int32_t wid[T * K], id[2][T * K], mid[T * K];
  k_xent_topk_clear(T, K, wval, wid);
  k_xent_topk_online(lg, T, V, 0, K, wval, wid);
  shard_online(lg, 0, SPLIT, mx[0], se[0], sl[0], val[0], id[0]);
  shard_online(lg, SPLIT, V - SPLIT, mx[1], se[1], sl[1], val[1], id[1]);
  float cval[2 * T * K];
  int32_t cid[2 * T * K];
  memcpy(cval, val[0], sizeof val[0]), memcpy(cval + T * K, val[1], sizeof val[1]);
  memcpy(cid, id[0], sizeof id[0]), memcpy(cid + T * K, id[1], sizeof id[1]);
  k_xent_topk_merge(2, T, K, cval, cid, mval, mid);
  assert_memory_equal(mval, wval, sizeof wval);
  assert_memory_equal(mid, wid, sizeof wid);
  /* the reference: each row sorted by (−logit, id), NaNs left out */
  for (int t = 0; t < T; t++) {
    int32_t best[K];
    for (int c = 0; c < K; c++) {
      int32_t b = -1;
      for (int32_t j = 0; j < V; j++) {
        float v = lg[t * V + j];
        bool used = false;
        for (int q = 0; q < c; q++) used |= best[q] == j;
        if (isnan(v) || used) continue;
        if (b < 0 || v > lg[t * V + b]) b = j; /* strict: the lower id kept on ties */
      }
      best[c] = b;
    }
    assert_memory_equal(&wid[t * K], best, sizeof best);
  }
  for (int c = 0; c < K; c++) assert_int_equal(wid[c], c * 97 + 5); /* the tie, by id */
  /* a shard narrower than k: its empty entries merge away */
  float nval[T * K], n2val[T * K];
  int32_t nid[T * K], n2id[T * K];
  float first[T * 3];
  for (int t = 0; t < T; t++) memcpy(first + t * 3, lg + t * V, sizeof(float) * 3);
  k_xent_topk_clear(T, K, nval, nid);
  k_xent_topk_online(first, T, 3, 0, K, nval, nid); /* 3 columns: K − 3 empty entries */
  assert_int_equal(nid[K - 1], -1);
  float c2v[2 * T * K];
  int32_t c2i[2 * T * K];
  float rest[T * (V - 3)];
  for (int t = 0; t < T; t++) memcpy(rest + t * (V - 3), lg + t * V + 3, sizeof(float) * (V - 3));
  k_xent_topk_clear(T, K, n2val, n2id);
  k_xent_topk_online(rest, T, V - 3, 3, K, n2val, n2id);
  memcpy(c2v, nval, sizeof nval), memcpy(c2v + T * K, n2val, sizeof n2val);
  memcpy(c2i, nid, sizeof nid), memcpy(c2i + T * K, n2id, sizeof n2id);
  k_xent_topk_merge(2, T, K, c2v, c2i, mval, mid);
  assert_memory_equal(mval, wval, sizeof wval);
  assert_memory_equal(mid, wid, sizeof wid);
  /* the log-probs: bitwise k_xent_logprobs's with each entry's id as target */
  float M[T], wse[T], wtl[T], lp[T * K];
  for (int c = 0; c < K; c++) {
    int32_t y[T];
    for (int t = 0; t < T; t++) y[t] = wid[t * K + c];
    k_xent_rowmax(lg, T, V, M);
    k_xent_sumexp_target(lg, T, V, 0, y, M, wse, wtl);
    float tlp[T], w[T];
    double sums[2] = {0, 0};
    k_xent_logprobs(wse, wtl, y, T, 1.0f, tlp, w, sums);
    k_xent_topk_logprobs(T, K, M, wse, wval, wid, lp);
    for (int t = 0; t < T; t++) assert_memory_equal(&lp[t * K + c], &tlp[t], sizeof(float));
  }
  free(lg);
}

/* Per element, with z = fl(l − m) (u|z| absolute), p = expf(z)·fl(1/se):
 * relative e_p = (TOL_LIBM + 2)u + u|z| + e_se (se's relative error, from
 * entropy_ref's derivation); the bracket z − c with c = fl(log se − H):
 * absolute e_b = u|z| + u|c| + e_se + e_H (H's bound) + u|z − c|; then
 * p·bracket (u), ·ew (u), w·p (u), their sum (u) and the target's − w
 * (u): |d − ref| <= |w|p(e_p + 2u) + |ew|p(|z − c|(e_p + 3u) + e_b) +
 * u(|d| + |w|[j = y]). */
static void test_bwd_entropy(void **state) {
  (void)state;
  float *lg = rand_buf(T * V, 6.0f);
  lg[V + 5] = -INFINITY; /* a masked logit: no gradient, not 0·inf */
  double ref[T], hb[T];
  entropy_ref(lg, 1.0, ref, hb);
  float mx[T], se[T], tl[T], sl[T], H[T], w[T], ew[T];
  int32_t y[T];
  for (int t = 0; t < T; t++) {
    y[t] = t == 2 ? -1 : (int32_t)((t * 131) % V);
    w[t] = y[t] >= 0 ? 0.25f + 0.1f * (float)t : 0.0f;
    ew[t] = t % 3 == 0 ? 0.0f : 0.05f * (float)(t + 1) * (t % 2 ? 1.0f : -1.0f);
  }
  k_xent_rowmax(lg, T, V, mx);
  k_xent_sumexp_target(lg, T, V, 0, y, mx, se, tl);
  k_xent_entropy_sum(lg, T, V, mx, sl);
  k_xent_entropy(se, sl, T, H);
  float *d = malloc(sizeof(float) * T * V);
  k_xent_bwd_entropy(lg, T, V, 0, y, mx, se, w, H, ew, d);
  double *rd = dzeros(T * V), *bd = dzeros(T * V);
  for (int t = 0; t < T; t++) {
    const float *l = lg + t * V;
    double m = mx[t], s = 0, dmax = 0;
    for (int j = 0; j < V; j++)
      if (isfinite(l[j])) s += exp(l[j] - m), dmax = fmax(dmax, m - l[j]);
    double e_se = tol_gamma(V + TOL_LIBM + 2.0 + dmax) + TOL_U, c = log(se[t]) - H[t];
    for (int j = 0; j < V; j++) {
      double z = l[j] - m, p = exp(z) / s, lp = z - log(s), g = w[t] * (p - (j == y[t]));
      g += p != 0.0 ? ew[t] * p * (lp + ref[t]) : 0.0; /* −ew·dH/dl_j */
      z = isinf(z) ? 0.0 : z; /* the −inf logit's bound: its p = 0 terms only */
      double e_p = (TOL_LIBM + 2.0) * TOL_U + TOL_U * fabs(z) + e_se;
      double e_b = TOL_U * (fabs(z) + fabs(c) + fabs(z - c)) + e_se + hb[t];
      rd[t * V + j] = g;
      bd[t * V + j] = fabs(w[t]) * p * (e_p + 2.0 * TOL_U) +
                      fabs(ew[t]) * p * (fabs(z - c) * (e_p + 3.0 * TOL_U) + e_b) +
                      TOL_U * (fabs(g) + fabs(w[t]) * (j == y[t]));
    }
  }
  expect_within("entropy bonus backward vs double", d, rd, bd, T * V);
  /* in place, as loss.c runs it: the same values */
  k_xent_bwd_entropy(lg, T, V, 0, y, mx, se, w, H, ew, lg);
  assert_memory_equal(lg, d, sizeof(float) * T * V);
  free(rd), free(bd), free(d), free(lg);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_entropy),
      cmocka_unit_test(test_topk),
      cmocka_unit_test(test_bwd_entropy),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

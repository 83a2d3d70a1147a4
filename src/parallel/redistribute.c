/* DTensor.redistribute for [B, S, C] activations on a 1-D mesh (see
 * redistribute.h). Layout moves are memcpy of contiguous runs: a sequence
 * shard is B row blocks of s·c floats, a feature shard is B·S runs of c. */
#include "parallel/redistribute.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/checked.h"
#include "common/status.h"

/* A placement on a [B, S, C] activation, normalized. */
typedef enum { PL_REP, PL_SEQ, PL_FEAT, PL_PART, PL_BAD } pl;

static pl classify(ml_placement p) {
  switch (p.kind) {
    case ML_REPLICATE: return PL_REP;
    case ML_PARTIAL: return PL_PART;
    case ML_SHARD: {
      int d = p.dim < 0 ? p.dim + 3 : p.dim;
      return d == 1 ? PL_SEQ : d == 2 ? PL_FEAT : PL_BAD;
    }
  }
  return PL_BAD;
}

/* "group 'tp' (rank 1 of 4)", or "a group of 4 ranks" without a comm. */
static const char *group_str(const ml_comm *g, int size, char *buf, size_t cap) {
  if (g) snprintf(buf, cap, "group '%s' (rank %d of %d)", g->name, g->rank, g->size);
  else snprintf(buf, cap, "a group of %d ranks", size);
  return buf;
}

/* Placement and size checks shared by ml_redistribute (g set) and its cost
 * (g NULL). Identical on every rank. */
static int check_request(ml_placement from, ml_placement to, int64_t B, int64_t S, int64_t C,
                         const ml_comm *g, int size, pl *f, pl *o) {
  *f = classify(from);
  *o = classify(to);
  bool bad = *f == PL_BAD || *o == PL_BAD, to_partial = *o == PL_PART && *f != PL_PART;
  bool negative = B < 0 || S < 0 || C < 0;
  if (!bad && !to_partial && !negative && size >= 1) return 0;
  char fb[32], tb[32], gb[80];
  ml_placement_str(from, fb, sizeof fb);
  ml_placement_str(to, tb, sizeof tb);
  group_str(g, size, gb, sizeof gb);
  if (bad)
    return ml_err("redistribute %s -> %s on %s: %s is not a placement of an activation [B, S, C]; "
                  "supported are Replicate(), Partial(sum), Shard(1) (sequence) and "
                  "Shard(2) = Shard(-1) (features)",
                  fb, tb, gb, *f == PL_BAD ? fb : tb);
  if (to_partial)
    return ml_err("redistribute %s -> %s on %s: the target cannot be Partial(sum) (torch's split "
                  "of a Replicate into a Partial is not supported); targets are Replicate(), "
                  "Shard(1) and Shard(-1)",
                  fb, tb, gb);
  if (negative)
    return ml_err("redistribute %s -> %s on %s: negative global shape [%lld, %lld, %lld]", fb, tb,
                  gb, (long long)B, (long long)S, (long long)C);
  return ml_err("redistribute %s -> %s: group size %d < 1", fb, tb, size);
}

/* Local extents of placement p on rank r of t: [B, *s, *c]. */
static void local_extent(pl p, int64_t S, int64_t C, int t, int r, int64_t *s, int64_t *c) {
  int64_t start;
  *s = S;
  *c = C;
  if (p == PL_SEQ) ml_chunk(S, t, r, &start, s);
  if (p == PL_FEAT) ml_chunk(C, t, r, &start, c);
}

static int gather(ml_comm *g, const float *send, size_t n_send, float *recv, const size_t *cnt,
                  bool even) {
  return even ? ml_all_gather(g, send, recv, n_send) : ml_all_gather_v(g, send, n_send, recv, cnt);
}

static int scatter(ml_comm *g, const float *send, float *recv, const size_t *cnt, bool even) {
  return even ? ml_reduce_scatter(g, send, recv, cnt[g->rank])
              : ml_reduce_scatter_v(g, send, recv, cnt);
}

/* Replicate -> Shard(1) / Shard(-1): keep this rank's chunk, in place
 * (moving to lower addresses in increasing order never overwrites a source
 * not yet read). */
static void slice_local(pl o, ml_act *a, int t, int r) {
  int64_t B = a->B, S = a->S, C = a->C, start, len;
  float *x = a->x;
  if (o == PL_SEQ) {
    ml_chunk(S, t, r, &start, &len);
    for (int64_t b = 0; b < B; b++)
      memmove(x + b * len * C, x + (b * S + start) * C, sizeof(float) * (size_t)(len * C));
  } else {
    ml_chunk(C, t, r, &start, &len);
    for (int64_t row = 0; row < B * S; row++)
      memmove(x + row * len, x + row * C + start, sizeof(float) * (size_t)len);
  }
}

/* Shard(1) -> Replicate / Shard(-1): all-gather the sequence blocks
 * ([t][B, s_q, C] in work), then place them as [B, S, C] or as this rank's
 * feature columns [B, S, c]. */
static int gather_seq(ml_comm *g, pl o, ml_act *a, float *work, size_t *cnt) {
  int t = g->size;
  int64_t B = a->B, S = a->S, C = a->C, start, len, c0, cl;
  float *x = a->x;
  for (int q = 0; q < t; q++) {
    ml_chunk(S, t, q, &start, &len);
    cnt[q] = (size_t)(B * len * C);
  }
  bool even = S % t == 0;
  size_t mine = cnt[g->rank];
  if (o == PL_REP && B == 1) { /* rank blocks are already [S, C] in order */
    memcpy(work, x, sizeof(float) * mine);
    return gather(g, work, mine, x, cnt, even);
  }
  ML_TRY(gather(g, x, mine, work, cnt, even));
  ml_chunk(C, t, g->rank, &c0, &cl);
  if (o == PL_FEAT && cl == 0) return 0;
  const float *src = work;
  for (int q = 0; q < t; q++) {
    ml_chunk(S, t, q, &start, &len);
    for (int64_t b = 0; b < B; b++, src += len * C) {
      if (o == PL_REP) {
        memcpy(x + (b * S + start) * C, src, sizeof(float) * (size_t)(len * C));
        continue;
      }
      float *dst = x + (b * S + start) * cl;
      for (int64_t i = 0; i < len; i++)
        memcpy(dst + i * cl, src + i * C + c0, sizeof(float) * (size_t)cl);
    }
  }
  return 0;
}

/* Shard(-1) -> Replicate / Shard(1): all-gather the feature blocks
 * ([t][B·S, c_q] in work), then interleave them into rows of C for all
 * tokens or for this rank's sequence chunk. */
static int gather_feat(ml_comm *g, pl o, ml_act *a, float *work, size_t *cnt) {
  int t = g->size;
  int64_t B = a->B, S = a->S, C = a->C, start, len, s0, sl;
  float *x = a->x;
  for (int q = 0; q < t; q++) {
    ml_chunk(C, t, q, &start, &len);
    cnt[q] = (size_t)(B * S * len);
  }
  ML_TRY(gather(g, x, cnt[g->rank], work, cnt, C % t == 0));
  s0 = 0;
  sl = S;
  if (o == PL_SEQ) ml_chunk(S, t, g->rank, &s0, &sl);
  const float *blk = work;
  for (int q = 0; q < t; blk += cnt[q], q++) {
    ml_chunk(C, t, q, &start, &len);
    if (len == 0) continue;
    size_t bytes = sizeof(float) * (size_t)len;
    for (int64_t b = 0; b < B; b++) {
      const float *src = blk + (b * S + s0) * len;
      float *dst = x + b * sl * C + start;
      for (int64_t i = 0; i < sl; i++) memcpy(dst + i * C, src + i * len, bytes);
    }
  }
  return 0;
}

/* Partial -> Shard(1): pack the sequence blocks as [t][B, s_q, C] and
 * reduce-scatter; this rank's summed block is its [B, s, C]. */
static int scatter_seq(ml_comm *g, ml_act *a, float *work, size_t *cnt) {
  int t = g->size;
  int64_t B = a->B, S = a->S, C = a->C, start, len;
  float *x = a->x;
  for (int q = 0; q < t; q++) {
    ml_chunk(S, t, q, &start, &len);
    cnt[q] = (size_t)(B * len * C);
  }
  bool even = S % t == 0;
  if (B == 1) { /* x already is the rank-ordered concatenation */
    ML_TRY(scatter(g, x, work, cnt, even));
    memcpy(x, work, sizeof(float) * cnt[g->rank]);
    return 0;
  }
  float *dst = work;
  for (int q = 0; q < t; q++) {
    ml_chunk(S, t, q, &start, &len);
    for (int64_t b = 0; b < B; b++, dst += len * C)
      memcpy(dst, x + (b * S + start) * C, sizeof(float) * (size_t)(len * C));
  }
  return scatter(g, work, x, cnt, even);
}

/* Partial -> Shard(-1): pack the feature blocks as [t][B·S, c_q] and
 * reduce-scatter; this rank's summed block is its [B, S, c]. */
static int scatter_feat(ml_comm *g, ml_act *a, float *work, size_t *cnt) {
  int t = g->size;
  int64_t rows = a->B * a->S, C = a->C, start, len;
  const float *x = a->x;
  float *dst = work;
  for (int q = 0; q < t; q++) {
    ml_chunk(C, t, q, &start, &len);
    cnt[q] = (size_t)(rows * len);
    if (len == 0) continue;
    for (int64_t row = 0; row < rows; row++, dst += len)
      memcpy(dst, x + row * C + start, sizeof(float) * (size_t)len);
  }
  return scatter(g, work, a->x, cnt, C % t == 0);
}

/* One transition that changes the data (f != o, t > 1, non-empty). */
static int move(ml_comm *g, pl f, pl o, ml_act *a, float *work) {
  if (f == PL_REP) {
    slice_local(o, a, g->size, g->rank);
    return 0;
  }
  if (f == PL_PART && o == PL_REP)
    return ml_all_reduce(g, a->x, (size_t)(a->B * a->S * a->C), ML_ELEM_F32, ML_RED_SUM);
  size_t *cnt = ml_malloc(sizeof(size_t) * (size_t)g->size, "redistribute counts");
  if (!cnt) return -1;
  int rc;
  if (f == PL_PART) rc = o == PL_SEQ ? scatter_seq(g, a, work, cnt) : scatter_feat(g, a, work, cnt);
  else if (f == PL_SEQ) rc = gather_seq(g, o, a, work, cnt);
  else rc = gather_feat(g, o, a, work, cnt);
  free(cnt);
  return rc;
}

int ml_redistribute(ml_comm *g, ml_placement from, ml_placement to, ml_act *a, float *work) {
  int t = g->size, r = g->rank;
  pl f, o;
  ML_TRY(check_request(from, to, a->B, a->S, a->C, g, t, &f, &o));
  int64_t es, ec, ts, tc, B = a->B, numel = B * a->S * a->C;
  local_extent(f, a->S, a->C, t, r, &es, &ec);
  local_extent(o, a->S, a->C, t, r, &ts, &tc);
  bool moves = f != o && t > 1 && numel > 0, needs_work = moves && f != PL_REP;
  uintptr_t wx = (uintptr_t)work, xx = (uintptr_t)a->x, span = sizeof(float) * (uintptr_t)numel;
  bool shape_ok = a->s == es && a->c == ec, x_ok = !moves || a->x;
  bool work_ok = !needs_work || (work && (wx >= xx + span || xx >= wx + span));
  if (!shape_ok || !x_ok || !work_ok) {
    char fb[32], tb[32], gb[80];
    ml_placement_str(from, fb, sizeof fb);
    ml_placement_str(to, tb, sizeof tb);
    group_str(g, t, gb, sizeof gb);
    if (!shape_ok)
      return ml_err("redistribute %s -> %s on %s: local activation [%lld, %lld, %lld] is not %s "
                    "of global [%lld, %lld, %lld]; expected local [%lld, %lld, %lld]",
                    fb, tb, gb, (long long)B, (long long)a->s, (long long)a->c, fb, (long long)B,
                    (long long)a->S, (long long)a->C, (long long)B, (long long)es, (long long)ec);
    if (!x_ok)
      return ml_err("redistribute %s -> %s on %s: activation [%lld, %lld, %lld] has no buffer", fb,
                    tb, gb, (long long)B, (long long)a->S, (long long)a->C);
    return ml_err("redistribute %s -> %s on %s: needs a work buffer of B*S*C = %lld floats %s", fb,
                  tb, gb, (long long)numel,
                  work ? "that does not overlap the activation" : "(got NULL)");
  }
  int rc = moves ? move(g, f, o, a, work) : 0;
  if (rc) return -1;
  a->s = ts;
  a->c = tc;
  return 0;
}

int ml_redistribute_cost(ml_placement from, ml_placement to, int64_t B, int64_t S, int64_t C,
                         int group_size, ml_coll out[2], int64_t bytes[2], int *n) {
  *n = 0;
  pl f, o;
  ML_TRY(check_request(from, to, B, S, C, NULL, group_size, &f, &o));
  /* B and S come from a plan's flags: saturate (common/checked.h) */
  int64_t numel = ml_mul_sat(ml_mul_sat(B, S), C);
  if (f == o || group_size == 1 || numel == 0 || f == PL_REP) return 0;
  out[0] = f == PL_PART ? (o == PL_REP ? ML_COLL_ALL_REDUCE : ML_COLL_REDUCE_SCATTER)
                        : ML_COLL_ALL_GATHER;
  bytes[0] = ml_mul_sat(numel, (int64_t)sizeof(float));
  *n = 1;
  return 0;
}

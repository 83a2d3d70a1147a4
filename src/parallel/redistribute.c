/* DTensor.redistribute for [B, S, C] activations on a 1-D mesh (see
 * redistribute.h). Layout moves are strided copies on the backend
 * (ml_be_copy2d) of contiguous runs: a sequence shard is B row blocks of
 * s·c floats, a feature shard is B·S runs of c. */
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

int ml_all_gather_padded(ml_backend *be, ml_comm *g, float *send, size_t n, size_t chunk,
                         float *recv) {
  ML_TRY(ml_be_zero(be, send + n, sizeof(float) * (chunk - n)));
  return ml_all_gather(g, send, recv, chunk);
}

/* rows runs of n floats, device to device: src rows spitch floats apart,
 * dst rows dpitch apart. */
static int copy_rows(ml_backend *be, float *dst, int64_t dpitch, const float *src, int64_t spitch,
                     int64_t n, int64_t rows) {
  size_t f = sizeof(float);
  return ml_be_copy2d(be, dst, f * (size_t)dpitch, src, f * (size_t)spitch, f * (size_t)n,
                      (size_t)rows);
}

/* Replicate -> Shard(1) / Shard(-1): keep this rank's chunk, in place
 * (moving to lower addresses in increasing order never overwrites a source
 * not yet read). */
static int slice_local(ml_backend *be, pl o, ml_act *a, int t, int r) {
  int64_t B = a->B, S = a->S, C = a->C, start, len;
  float *x = a->x;
  if (o == PL_SEQ) {
    ml_chunk(S, t, r, &start, &len);
    return copy_rows(be, x, len * C, x + start * C, S * C, len * C, B);
  }
  ml_chunk(C, t, r, &start, &len);
  return copy_rows(be, x, len, x + start, C, len, B * S);
}

/* Shard(1) -> Replicate / Shard(-1): all-gather the sequence blocks,
 * padded to B·ceil(S/t)·C ([t][chunk] in work, block q's first B·s_q·C
 * floats rank q's [B, s_q, C]), then place them as [B, S, C] or as this
 * rank's feature columns [B, S, c]. */
static int gather_seq(ml_backend *be, ml_comm *g, pl o, ml_act *a, float *work) {
  int t = g->size;
  int64_t B = a->B, S = a->S, C = a->C, start, len, c0, cl;
  float *x = a->x;
  size_t mine = (size_t)(B * a->s * C), chunk = (size_t)(B * ml_chunk_size(S, t) * C);
  if (o == PL_REP && B == 1 && S % t == 0) { /* rank blocks are already [S, C] in order */
    ML_TRY(ml_be_copy(be, work, x, sizeof(float) * mine, ML_COPY_D2D));
    return ml_all_gather(g, work, x, mine);
  }
  ML_TRY(ml_all_gather_padded(be, g, x, mine, chunk, work));
  ml_chunk(C, t, g->rank, &c0, &cl);
  if (o == PL_FEAT && cl == 0) return 0;
  for (int q = 0; q < t; q++) {
    const float *src = work + (size_t)q * chunk;
    ml_chunk(S, t, q, &start, &len);
    if (o == PL_REP) { /* B runs of [len, C] into rows start.. of each sequence */
      ML_TRY(copy_rows(be, x + start * C, S * C, src, len * C, len * C, B));
      continue;
    }
    /* rows of C, this rank's columns c0 .. c0+cl, into rows of cl */
    for (int64_t b = 0; b < B; b++, src += len * C)
      ML_TRY(copy_rows(be, x + (b * S + start) * cl, cl, src + c0, C, cl, len));
  }
  return 0;
}

/* Shard(-1) -> Replicate / Shard(1): all-gather the feature blocks, padded
 * to B·S·ceil(C/t) ([t][chunk] in work, block q's first B·S·c_q floats rank
 * q's [B·S, c_q]), then interleave them into rows of C for all tokens or
 * for this rank's sequence chunk. */
static int gather_feat(ml_backend *be, ml_comm *g, pl o, ml_act *a, float *work) {
  int t = g->size;
  int64_t B = a->B, S = a->S, C = a->C, start, len, s0, sl;
  float *x = a->x;
  size_t chunk = (size_t)(B * S * ml_chunk_size(C, t));
  ML_TRY(ml_all_gather_padded(be, g, x, (size_t)(B * S * a->c), chunk, work));
  s0 = 0;
  sl = S;
  if (o == PL_SEQ) ml_chunk(S, t, g->rank, &s0, &sl);
  for (int q = 0; q < t; q++) {
    const float *blk = work + (size_t)q * chunk;
    ml_chunk(C, t, q, &start, &len);
    if (len == 0) continue;
    for (int64_t b = 0; b < B; b++)
      ML_TRY(copy_rows(be, x + b * sl * C + start, C, blk + (b * S + s0) * len, len, len, sl));
  }
  return 0;
}

/* Partial -> Shard(1): pack the sequence blocks as [t][chunk], chunk =
 * B·ceil(S/t)·C (block q: [B, s_q, C], then zeros), and reduce-scatter;
 * this rank's summed block begins with its [B, s, C]. */
static int scatter_seq(ml_backend *be, ml_comm *g, ml_act *a, float *work) {
  int t = g->size;
  int64_t B = a->B, S = a->S, C = a->C, start, len;
  float *x = a->x;
  size_t chunk = (size_t)(B * ml_chunk_size(S, t) * C);
  if (B == 1 && S % t == 0) { /* x already is the rank-ordered concatenation */
    ML_TRY(ml_reduce_scatter(g, x, work, chunk));
    return ml_be_copy(be, x, work, sizeof(float) * chunk, ML_COPY_D2D);
  }
  for (int q = 0; q < t; q++) {
    float *dst = work + (size_t)q * chunk;
    ml_chunk(S, t, q, &start, &len);
    ML_TRY(copy_rows(be, dst, len * C, x + start * C, S * C, len * C, B));
    ML_TRY(ml_be_zero(be, dst + B * len * C, sizeof(float) * (chunk - (size_t)(B * len * C))));
  }
  return ml_reduce_scatter(g, work, x, chunk);
}

/* Partial -> Shard(-1): pack the feature blocks as [t][chunk], chunk =
 * B·S·ceil(C/t) (block q: [B·S, c_q], then zeros), and reduce-scatter;
 * this rank's summed block begins with its [B, S, c]. */
static int scatter_feat(ml_backend *be, ml_comm *g, ml_act *a, float *work) {
  int t = g->size;
  int64_t rows = a->B * a->S, C = a->C, start, len;
  const float *x = a->x;
  size_t chunk = (size_t)(rows * ml_chunk_size(C, t));
  for (int q = 0; q < t; q++) {
    float *dst = work + (size_t)q * chunk;
    ml_chunk(C, t, q, &start, &len);
    ML_TRY(copy_rows(be, dst, len, x + start, C, len, rows));
    ML_TRY(ml_be_zero(be, dst + rows * len, sizeof(float) * (chunk - (size_t)(rows * len))));
  }
  return ml_reduce_scatter(g, work, a->x, chunk);
}

/* One transition that changes the data (f != o, t > 1, non-empty). */
static int move(ml_backend *be, ml_comm *g, pl f, pl o, ml_act *a, float *work) {
  if (f == PL_REP) return slice_local(be, o, a, g->size, g->rank);
  if (f == PL_PART && o == PL_REP)
    return ml_all_reduce(g, a->x, (size_t)(a->B * a->S * a->C), ML_ELEM_F32, ML_RED_SUM);
  if (f == PL_PART)
    return o == PL_SEQ ? scatter_seq(be, g, a, work) : scatter_feat(be, g, a, work);
  return f == PL_SEQ ? gather_seq(be, g, o, a, work) : gather_feat(be, g, o, a, work);
}

int ml_redistribute(ml_backend *be, ml_comm *g, ml_placement from, ml_placement to, ml_act *a,
                    float *work) {
  int t = g->size, r = g->rank;
  pl f, o;
  ML_TRY(check_request(from, to, a->B, a->S, a->C, g, t, &f, &o));
  int64_t es, ec, ts, tc, B = a->B, numel = B * a->S * a->C;
  local_extent(f, a->S, a->C, t, r, &es, &ec);
  local_extent(o, a->S, a->C, t, r, &ts, &tc);
  bool moves = f != o && t > 1 && numel > 0, needs_work = moves && f != PL_REP;
  int64_t wn = ml_redistribute_work(B, a->S, a->C, t);
  uintptr_t wx = (uintptr_t)work, xx = (uintptr_t)a->x, span = sizeof(float) * (uintptr_t)numel;
  uintptr_t wspan = sizeof(float) * (uintptr_t)wn;
  bool shape_ok = a->s == es && a->c == ec, x_ok = !moves || a->x;
  bool work_ok = !needs_work || (work && (wx >= xx + span || xx >= wx + wspan));
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
    return ml_err("redistribute %s -> %s on %s: needs a work buffer of %lld floats "
                  "(ml_redistribute_work) %s",
                  fb, tb, gb, (long long)wn,
                  work ? "that does not overlap the activation" : "(got NULL)");
  }
  int rc = moves ? move(be, g, f, o, a, work) : 0;
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
  *n = 1;
  if (f == PL_PART && o == PL_REP) {
    out[0] = ML_COLL_ALL_REDUCE;
    bytes[0] = ml_mul_sat(numel, (int64_t)sizeof(float));
    return 0;
  }
  /* all-gather from, or reduce-scatter to, a shard: every rank's block
   * padded to the chunk of the sharded dim */
  out[0] = f == PL_PART ? ML_COLL_REDUCE_SCATTER : ML_COLL_ALL_GATHER;
  bool seq = (f == PL_PART ? o : f) == PL_SEQ;
  int64_t padded = ml_mul_sat(ml_chunk_size(seq ? S : C, group_size), group_size);
  bytes[0] = ml_mul_sat(ml_mul_sat(ml_mul_sat(B, seq ? C : S), padded), (int64_t)sizeof(float));
  return 0;
}

int64_t ml_redistribute_work(int64_t B, int64_t S, int64_t C, int group_size) {
  int64_t t = group_size;
  int64_t seq = ml_mul_sat(ml_mul_sat(B, C), ml_mul_sat(ml_chunk_size(S, group_size), t));
  int64_t feat = ml_mul_sat(ml_mul_sat(B, S), ml_mul_sat(ml_chunk_size(C, group_size), t));
  return seq > feat ? seq : feat;
}

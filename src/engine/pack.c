#include "engine/pack.h"

#include <stdlib.h>
#include <string.h>

#include "common/checked.h"
#include "common/status.h"

static const int64_t *g_sort_lens; /* qsort's comparator reads it (one call at a time) */

/* Longer first, then input order: a deterministic plan. */
static int by_length(const void *a, const void *b) {
  int64_t i = *(const int64_t *)a, j = *(const int64_t *)b;
  int64_t li = g_sort_lens[i], lj = g_sort_lens[j];
  if (li != lj) return li > lj ? -1 : 1;
  return (i > j) - (i < j);
}

/* First-fit decreasing into rows of `cap` tokens: bins[k] of sequence
 * order[k] (0-based micro-batch), *n_bins of them. */
static int64_t first_fit(const ml_pack *p, const int64_t *order, int64_t cap, int64_t *bins,
                         int64_t *fill) {
  int64_t n_bins = 0;
  for (int64_t k = 0; k < p->n; k++) {
    int64_t L = p->lens[order[k]], j = 0;
    while (j < n_bins && fill[j] + L > cap) j++;
    if (j == n_bins) fill[n_bins++] = 0;
    fill[j] += L;
    bins[k] = j;
  }
  return n_bins;
}

/* p->order and p->mb of this rank (n_mb its own count). */
static int plan_local(ml_pack *p, int64_t budget) {
  int64_t n = p->n;
  int64_t *tmp = ml_malloc_array(3 * (n > 0 ? n : 1), sizeof *tmp, "the micro-batch plan");
  if (!tmp) return -1;
  int64_t *sorted = tmp, *bins = tmp + n, *fill = tmp + 2 * n;
  for (int64_t k = 0; k < n; k++) sorted[k] = k;
  g_sort_lens = p->lens;
  qsort(sorted, (size_t)n, sizeof *sorted, by_length);
  int64_t cap = p->packed ? budget : 1; /* unpacked: one sequence each */
  int64_t n_bins = first_fit(p, sorted, cap, bins, fill);
  p->mb = ml_calloc_array(n_bins > 0 ? n_bins : 1, sizeof *p->mb, "the micro-batch plan");
  if (!p->mb) {
    free(tmp);
    return -1;
  }
  /* counting sort of the sequences by bin, keeping the length order inside */
  int64_t at = 0;
  for (int64_t j = 0; j < n_bins; j++) {
    p->mb[j].first = at;
    for (int64_t k = 0; k < n; k++)
      if (bins[k] == j) {
        p->order[at++] = sorted[k];
        p->mb[j].count++;
        p->mb[j].tokens += p->lens[sorted[k]];
      }
    p->mb[j].S = p->mb[j].tokens;
  }
  p->n_mb = n_bins;
  free(tmp);
  return 0;
}

/* The count (and under vocab parallelism each length) agreed over the world. */
static int agree_shape(ml_pack *p, ml_engine *e, ml_host *world) {
  int64_t n_mb = p->n_mb;
  ML_TRY(ml_host_all_reduce_i64(world, &n_mb, 1, ML_RED_MAX));
  if (n_mb > p->n_mb) {
    ml_micro *mb = realloc(p->mb, sizeof *mb * (size_t)n_mb);
    if (!mb) return ml_err("out of memory planning %lld micro-batches", (long long)n_mb);
    p->mb = mb;
    /* an empty micro-batch: two tokens of padding (no target), so every rank runs the
     * same collectives */
    for (int64_t j = p->n_mb; j < n_mb; j++) p->mb[j] = (ml_micro){p->n, 0, 0, 2};
    p->n_mb = n_mb;
  }
  if (e->vocab.comm && n_mb > 0) {
    int64_t *S = ml_malloc_array(n_mb, sizeof *S, "the micro-batch lengths");
    if (!S) return -1;
    for (int64_t j = 0; j < n_mb; j++) S[j] = p->mb[j].S;
    int rc = ml_host_all_reduce_i64(world, S, (int)n_mb, ML_RED_MAX);
    for (int64_t j = 0; rc == 0 && j < n_mb; j++) p->mb[j].S = S[j];
    free(S);
    ML_TRY(rc);
  }
  p->S_max = 0;
  for (int64_t j = 0; j < n_mb; j++) p->S_max = p->mb[j].S > p->S_max ? p->mb[j].S : p->S_max;
  return 0;
}

static int alloc_buffers(ml_pack *p) {
  int64_t S = p->S_max > 0 ? p->S_max : 1, docs = 1;
  for (int64_t j = 0; j < p->n_mb; j++) docs = p->mb[j].count + 1 > docs ? p->mb[j].count + 1 : docs;
  p->row = ml_malloc_array(S, sizeof *p->row, "a micro-batch's ids (%lld tokens)", (long long)S);
  p->mask = ml_malloc_array(S, 1, "a micro-batch's mask (%lld tokens)", (long long)S);
  p->docs = ml_malloc_array(docs, sizeof *p->docs, "a micro-batch's documents");
  p->obj = ml_calloc_array(S, sizeof *p->obj, "a micro-batch's objective inputs");
  p->lp = ml_malloc_array(S, sizeof *p->lp, "a micro-batch's log-probs (%lld)", (long long)S);
  return p->row && p->mask && p->docs && p->obj && p->lp ? 0 : -1;
}

int ml_pack_plan(ml_pack *p, ml_engine *e, ml_host *world, int64_t n, const int64_t *lens,
                 const int32_t **ids, int64_t budget) {
  memset(p, 0, sizeof *p);
  p->n = n;
  p->lens = lens;
  p->ids = ids;
  p->packed = ml_engine_can_pack(e);
  int64_t n1 = n > 0 ? n : 1;
  int rc = budget >= 1 ? 0 : ml_err("micro-batch budget %lld tokens; expected >= 1",
                                    (long long)budget);
  if (rc == 0 && !(p->order = ml_malloc_array(n1, sizeof *p->order, "the micro-batch plan")))
    rc = -1;
  if (rc == 0) rc = plan_local(p, budget);
  ML_TRY(ml_host_agree(world, rc));
  ML_TRY(ml_host_agree(world, agree_shape(p, e, world)));
  return ml_host_agree(world, alloc_buffers(p));
}

int ml_pack_reserve(const ml_pack *p, ml_engine *e, bool forward_only) {
  return p->S_max > 0 ? ml_engine_reserve(e, 1, p->S_max, forward_only, "the longest micro-batch row "
                                          "(the micro-batch token budget, or the longest "
                                          "sequence)")
                      : 0;
}

void ml_pack_free(ml_pack *p) {
  free(p->order);
  free(p->mb);
  free(p->row);
  free(p->mask);
  free(p->docs);
  free(p->obj);
  free(p->lp);
  memset(p, 0, sizeof *p);
}

void ml_pack_fill(const ml_pack *p, int64_t j, ml_engine_batch *eb) {
  const ml_micro *m = &p->mb[j];
  int64_t at = 0;
  for (int64_t i = 0; i < m->count; i++) {
    int64_t k = p->order[m->first + i], L = p->lens[k];
    memcpy(p->row + at, p->ids[k], sizeof(int32_t) * (size_t)L);
    memset(p->mask + at, 1, (size_t)L);
    p->mask[at] = 0; /* a document's first token is no target */
    p->docs[i] = at;
    at += L;
  }
  p->docs[m->count] = at;
  memset(p->row + at, 0, sizeof(int32_t) * (size_t)(m->S - at));
  memset(p->mask + at, 0, (size_t)(m->S - at));
  *eb = (ml_engine_batch){.ids = p->row, .mask = p->mask, .B = 1, .S = m->S,
                          .docs = p->packed ? p->docs : NULL, .ndocs = m->count};
}

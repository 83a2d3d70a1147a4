#include "data/data_gather.h"

#include <stdlib.h>
#include <string.h>

#include "common/checked.h"
#include "common/status.h"

static int solo_gather(void *ctx, const void *send, const size_t *bytes, void *recv) {
  (void)ctx;
  if (bytes[0]) memcpy(recv, send, bytes[0]);
  return 0;
}

static int solo_agree(void *ctx, int rc) {
  (void)ctx;
  return rc ? -1 : 0;
}

static const ml_data_group solo = {.rank = 0, .size = 1, .all_gather_v = solo_gather,
                                   .agree = solo_agree};

const ml_data_group *ml_data_group_or_solo(const ml_data_group *g) { return g ? g : &solo; }

/* Bytes per call of all ranks together. */
static size_t call_bytes(const ml_data_group *g) {
  return g->call_bytes ? g->call_bytes : (size_t)1 << 30;
}

/* recv[sum of bytes] = every rank's send[bytes[rank]], in rounds of at most
 * call_bytes / size bytes per rank, each gathered into `tmp` and moved to
 * its place. */
static int gather_rounds(const ml_data_group *g, const char *send, const size_t *bytes,
                         char *recv) {
  size_t per = call_bytes(g) / (size_t)g->size, most = 0;
  if (per == 0) per = 1;
  for (int q = 0; q < g->size; q++) most = bytes[q] > most ? bytes[q] : most;
  size_t *cnt = ml_calloc_array(g->size, sizeof *cnt, "data gather counts");
  char *tmp = cnt ? ml_malloc_array((int64_t)(per * (size_t)g->size), 1, "a data gather buffer")
                  : NULL;
  int rc = tmp ? 0 : -1;
  for (size_t at = 0; rc == 0 && at < most; at += per) {
    for (int q = 0; q < g->size; q++)
      cnt[q] = bytes[q] <= at ? 0 : bytes[q] - at < per ? bytes[q] - at : per;
    rc = g->all_gather_v(g->ctx, cnt[g->rank] ? send + at : send, cnt, tmp);
    size_t from = 0, to = 0;
    for (int q = 0; rc == 0 && q < g->size; to += bytes[q++]) {
      memcpy(recv + to + at, tmp + from, cnt[q]);
      from += cnt[q];
    }
  }
  free(tmp);
  free(cnt);
  return rc;
}

int ml_data_gather(const ml_data_group *g, const void *send, int64_t count, size_t elem,
                   void **all, int64_t *counts, int64_t *total) {
  *all = NULL;
  size_t *eight = ml_calloc_array(g->size, sizeof *eight, "data gather counts");
  if (!eight) return -1;
  for (int q = 0; q < g->size; q++) eight[q] = sizeof *counts;
  int rc = g->all_gather_v(g->ctx, &count, eight, counts);
  size_t *bytes = eight, sum = 0;
  for (int q = 0; rc == 0 && q < g->size; q++) {
    bytes[q] = (size_t)counts[q] * elem;
    sum += bytes[q];
  }
  *total = 0;
  for (int q = 0; rc == 0 && q < g->size; q++) *total += counts[q];
  char *recv = rc == 0 ? ml_malloc_array(ml_mul_sat(*total, (int64_t)elem), 1,
                                         "%lld gathered data elements", (long long)*total)
                       : NULL;
  if (rc == 0 && !recv) rc = -1;
  if (rc == 0)
    rc = sum <= call_bytes(g) ? g->all_gather_v(g->ctx, send, bytes, recv)
                              : gather_rounds(g, send, bytes, recv);
  free(bytes);
  if (rc != 0) {
    free(recv);
    return -1;
  }
  *all = recv;
  return 0;
}

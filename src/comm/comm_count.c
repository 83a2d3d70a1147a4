/* Counting wrapper: forwards every collective to the wrapped comm and
 * records calls and bytes per kind when it is issued, and the time spent
 * waiting for it (the role of torch's CommDebugMode). */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm/comm.h"
#include "common/status.h"

typedef struct counting {
  ml_comm *inner;
  ml_comm_stats stats;
} counting;

static counting *cnt_of(ml_comm *c) { return c->impl; }

static void record(ml_comm *c, ml_coll k, size_t bytes) {
  cnt_of(c)->stats.calls[k]++;
  cnt_of(c)->stats.bytes[k] += (int64_t)bytes;
}

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int cnt_iall_reduce(ml_comm *c, void *buf, size_t n, ml_elem elem, ml_redop op,
                           ml_request *req) {
  record(c, ML_COLL_ALL_REDUCE, n * ml_elem_size(elem));
  return ml_iall_reduce(cnt_of(c)->inner, buf, n, elem, op, req);
}

static int cnt_iall_gather(ml_comm *c, const void *send, void *recv, size_t n, ml_elem elem,
                           ml_request *req) {
  record(c, ML_COLL_ALL_GATHER, n * (size_t)c->size * ml_elem_size(elem));
  return ml_iall_gather(cnt_of(c)->inner, send, recv, n, elem, req);
}

static int cnt_ireduce_scatter(ml_comm *c, const void *send, void *recv, size_t n, ml_elem elem,
                               ml_request *req) {
  record(c, ML_COLL_REDUCE_SCATTER, n * (size_t)c->size * ml_elem_size(elem));
  return ml_ireduce_scatter(cnt_of(c)->inner, send, recv, n, elem, req);
}

static int cnt_iring_pass(ml_comm *c, const void *send, void *recv, size_t n, ml_elem elem,
                          ml_request *req) {
  record(c, ML_COLL_SEND_RECV, n * ml_elem_size(elem));
  return ml_iring_pass(cnt_of(c)->inner, send, recv, n, elem, req);
}

static int cnt_iall_to_all_v(ml_comm *c, const void *send, const int64_t *send_counts, void *recv,
                             const int64_t *recv_counts, ml_elem elem, ml_request *req) {
  int64_t n = 0;
  for (int q = 0; q < c->size; q++) n += send_counts[q];
  record(c, ML_COLL_ALL_TO_ALL, (size_t)n * ml_elem_size(elem));
  return ml_iall_to_all_v(cnt_of(c)->inner, send, send_counts, recv, recv_counts, elem, req);
}

/* The inner request is req itself: its wait, timed into wait_s. */
static int cnt_wait(ml_comm *c, ml_request *req) {
  double t0 = now_s();
  int rc = ml_wait(cnt_of(c)->inner, req);
  cnt_of(c)->stats.wait_s += now_s() - t0;
  return rc;
}

static void cnt_destroy(ml_comm *c) {
  ml_comm_destroy(cnt_of(c)->inner);
  free(c->impl);
  free(c);
}

static const ml_comm_ops counting_ops = {cnt_iall_reduce,     cnt_iall_gather,
                                         cnt_ireduce_scatter, cnt_iring_pass,
                                         cnt_wait,            cnt_destroy,
                                         cnt_iall_to_all_v};

int ml_comm_counting_create(ml_comm *inner, ml_comm **out) {
  ml_comm *c = ml_calloc(1, sizeof *c, "counting comm");
  counting *k = ml_calloc(1, sizeof *k, "counting comm");
  if (!c || !k) {
    free(c);
    free(k);
    return -1;
  }
  k->inner = inner;
  c->ops = &counting_ops;
  c->impl = k;
  c->rank = inner->rank;
  c->size = inner->size;
  memcpy(c->name, inner->name, sizeof c->name);
  *out = c;
  return 0;
}

ml_comm_stats *ml_comm_stats_of(ml_comm *c) {
  return c->ops == &counting_ops ? &cnt_of(c)->stats : NULL;
}

void ml_comm_stats_reset(ml_comm *c) {
  ml_comm_stats *s = ml_comm_stats_of(c);
  if (s) memset(s, 0, sizeof *s);
}

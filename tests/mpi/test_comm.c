/* The communication backend: `mpiexec -n N test_comm`.
 *  - every data-path collective nonblocking (comm/comm.h): all-reduce
 *    (SUM / MAX / MIN; f32, f64, bf16 SUM), all-gather and reduce-scatter
 *    (f32, bf16), several in flight at once, against plain loops; values
 *    are multiples of 1/8 of small magnitude, so sums are exact in any
 *    order and in bf16;
 *  - bf16 SUM adds in fp32 and rounds to nearest-even (ties on a pair);
 *  - refusals: bf16 MAX, with a message naming the group;
 *  - the counting wrapper: calls and bytes at issue time, wait time only in
 *    ml_wait, blocking forms counted once, ml_wait of nothing;
 *  - the uneven all-to-all (f32 and bf16, empty blocks included, counts
 *    exchanged on the host channel's all-to-all) against the blocks each
 *    sender's formula gives, bitwise; its count, and the refusal of a
 *    negative count;
 *  - the host channel (comm/host.h): all-reduces of f64 / i64, broadcast,
 *    all-gather, barrier, the first failing rank and the error agreement.
 * Checks that fail on some ranks are collected and agreed on after the
 * collectives, so a failure never leaves other ranks waiting. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/host.h"
#include "common/status.h"
#include "counting_comm.h"
#include "held.h"
#include "rank_report.h"
#include "tensor/dtype.h"

/* Element i of rank q's buffer: a multiple of 1/8 in [−2, 2]. */
static float val(int q, int64_t i) { return (float)((int)((q * 7 + i * 5) % 33) - 16) * 0.125f; }

/* All three collectives issued before any wait, each checked after its
 * wait (waited in reverse order: completion order is free). */
static void test_nonblocking_f32(void **state) {
  (void)state;
  report rep = {0};
  ml_comm *c = counting(MPI_COMM_WORLD, "tp");
  int t = c->size, r = c->rank;
  enum { N = 37 };
  float ar[N], ag_send[N], *ag = malloc(sizeof(float) * N * (size_t)t);
  float *rs_send = malloc(sizeof(float) * N * (size_t)t), rs[N];
  for (int i = 0; i < N; i++) ar[i] = ag_send[i] = val(r, i);
  for (int i = 0; i < N * t; i++) rs_send[i] = val(r, i);
  ml_request q[3];
  if (ml_iall_reduce(c, ar, N, ML_ELEM_F32, ML_RED_SUM, &q[0]) ||
      ml_iall_gather(c, ag_send, ag, N, ML_ELEM_F32, &q[1]) ||
      ml_ireduce_scatter(c, rs_send, rs, N, ML_ELEM_F32, &q[2]))
    fail_msg("issue: %s", ml_error_msg());
  const ml_comm_stats *st = ml_comm_stats_of(c);
  /* counted when issued */
  if (st->calls[ML_COLL_ALL_REDUCE] != 1 || st->bytes[ML_COLL_ALL_REDUCE] != 4 * N ||
      st->calls[ML_COLL_ALL_GATHER] != 1 || st->bytes[ML_COLL_ALL_GATHER] != 4 * N * t ||
      st->calls[ML_COLL_REDUCE_SCATTER] != 1 || st->bytes[ML_COLL_REDUCE_SCATTER] != 4 * N * t)
    note(&rep,
         "counts at issue: all_reduce %lld/%lld B, all_gather %lld/%lld B, "
         "reduce_scatter %lld/%lld B",
         (long long)st->calls[0], (long long)st->bytes[0], (long long)st->calls[1],
         (long long)st->bytes[1], (long long)st->calls[2], (long long)st->bytes[2]);
  if (st->wait_s != 0) note(&rep, "wait time %g s before any wait", st->wait_s);
  for (int k = 2; k >= 0; k--)
    if (ml_wait(c, &q[k]) || q[k].impl) note(&rep, "wait %d: %s", k, ml_error_msg());
  if (!(st->wait_s >= 0)) note(&rep, "wait time %g", st->wait_s);
  for (int i = 0; i < N; i++) {
    float sum = 0, rsum = 0;
    for (int p = 0; p < t; p++) {
      sum += val(p, i);
      rsum += val(p, (int64_t)r * N + i);
    }
    if (ar[i] != sum) note(&rep, "all_reduce [%d] = %g, want %g", i, ar[i], sum);
    if (rs[i] != rsum) note(&rep, "reduce_scatter [%d] = %g, want %g", i, rs[i], rsum);
    for (int p = 0; p < t; p++)
      if (ag[p * N + i] != val(p, i))
        note(&rep, "all_gather block %d [%d] = %g, want %g", p, i, ag[p * N + i], val(p, i));
  }
  /* a request with nothing in flight */
  ml_request none = {NULL};
  if (ml_wait(c, &none)) note(&rep, "wait of nothing: %s", ml_error_msg());
  free(ag);
  free(rs_send);
  ml_comm_destroy(c);
  agree(&rep, "failures");
}

/* MAX, MIN and SUM in f32 (integer values: every order sums exactly),
 * through the blocking forms (one count each). */
static void test_reductions(void **state) {
  (void)state;
  report rep = {0};
  ml_comm *c = counting(MPI_COMM_WORLD, "dp");
  int t = c->size, r = c->rank;
  float mx[3] = {val(r, 0), val(r, 1), (float)r}, mn[3] = {val(r, 0), val(r, 1), (float)r};
  float d[2] = {(float)(r + 1), -(float)r};
  if (ml_all_reduce(c, mx, 3, ML_ELEM_F32, ML_RED_MAX) ||
      ml_all_reduce(c, mn, 3, ML_ELEM_F32, ML_RED_MIN) ||
      ml_all_reduce(c, d, 2, ML_ELEM_F32, ML_RED_SUM))
    note(&rep, "%s", ml_error_msg());
  for (int i = 0; i < 3; i++) {
    float hi = -1e30f, lo = 1e30f;
    for (int p = 0; p < t; p++) {
      float v = i < 2 ? val(p, i) : (float)p;
      hi = v > hi ? v : hi;
      lo = v < lo ? v : lo;
    }
    if (mx[i] != hi || mn[i] != lo)
      note(&rep, "[%d] max %g min %g, want %g %g", i, mx[i], mn[i], hi, lo);
  }
  float want0 = (float)t * (t + 1) / 2, want1 = -(float)t * (t - 1) / 2;
  if (d[0] != want0 || d[1] != want1)
    note(&rep, "sums %g %g, want %g %g", d[0], d[1], want0, want1);
  const ml_comm_stats *st = ml_comm_stats_of(c);
  if (st->calls[ML_COLL_ALL_REDUCE] != 3 || st->bytes[ML_COLL_ALL_REDUCE] != 12 + 12 + 8)
    note(&rep, "counted %lld all-reduces, %lld B; want 3, 32 B",
         (long long)st->calls[ML_COLL_ALL_REDUCE], (long long)st->bytes[ML_COLL_ALL_REDUCE]);
  ml_comm_destroy(c);
  agree(&rep, "failures");
}

/* bf16 on the wire: all-gather moves the bits, all-reduce and
 * reduce-scatter SUM add in fp32 and round (exact values here), at half
 * the bytes of fp32. */
static void test_bf16(void **state) {
  (void)state;
  report rep = {0};
  ml_comm *c = counting(MPI_COMM_WORLD, "dp_shard");
  int t = c->size, r = c->rank;
  enum { N = 9 };
  uint16_t ar[N], ag_send[N], *ag = malloc(sizeof(uint16_t) * N * (size_t)t);
  uint16_t *rs_send = malloc(sizeof(uint16_t) * N * (size_t)t), rs[N];
  for (int i = 0; i < N; i++) ar[i] = ag_send[i] = ml_f32_to_bf16(val(r, i));
  for (int i = 0; i < N * t; i++) rs_send[i] = ml_f32_to_bf16(val(r, i));
  ml_request q[3];
  if (ml_iall_reduce(c, ar, N, ML_ELEM_BF16, ML_RED_SUM, &q[0]) ||
      ml_iall_gather(c, ag_send, ag, N, ML_ELEM_BF16, &q[1]) ||
      ml_ireduce_scatter(c, rs_send, rs, N, ML_ELEM_BF16, &q[2]))
    fail_msg("issue: %s", ml_error_msg());
  for (int k = 0; k < 3; k++)
    if (ml_wait(c, &q[k])) note(&rep, "wait %d: %s", k, ml_error_msg());
  for (int i = 0; i < N; i++) {
    float sum = 0, rsum = 0;
    for (int p = 0; p < t; p++) {
      sum += val(p, i);
      rsum += val(p, (int64_t)r * N + i);
    }
    if (ml_bf16_to_f32(ar[i]) != sum)
      note(&rep, "bf16 all_reduce [%d] = %g, want %g", i, ml_bf16_to_f32(ar[i]), sum);
    if (ml_bf16_to_f32(rs[i]) != rsum)
      note(&rep, "bf16 reduce_scatter [%d] = %g, want %g", i, ml_bf16_to_f32(rs[i]), rsum);
    for (int p = 0; p < t; p++)
      if (ag[p * N + i] != ml_f32_to_bf16(val(p, i)))
        note(&rep, "bf16 all_gather block %d [%d]", p, i);
  }
  const ml_comm_stats *st = ml_comm_stats_of(c);
  if (st->bytes[ML_COLL_ALL_REDUCE] != 2 * N || st->bytes[ML_COLL_ALL_GATHER] != 2 * N * t ||
      st->bytes[ML_COLL_REDUCE_SCATTER] != 2 * N * t)
    note(&rep, "bf16 bytes %lld %lld %lld", (long long)st->bytes[0], (long long)st->bytes[1],
         (long long)st->bytes[2]);
  /* MAX has no bf16 form: refused before anything is issued */
  ml_error_clear();
  ml_request none;
  if (ml_iall_reduce(c, ar, N, ML_ELEM_BF16, ML_RED_MAX, &none) == 0 || none.impl ||
      !strstr(ml_error_msg(), "bf16") || !strstr(ml_error_msg(), "dp_shard"))
    note(&rep, "bf16 MAX: '%s'", ml_error_msg());
  free(ag);
  free(rs_send);
  ml_comm_destroy(c);
  agree(&rep, "failures");
}

/* Round to nearest-even on pairs of ranks (a pair's sum is one rounding,
 * whatever the order): 1 + 2^-8 is a tie between 1 and 1 + 2^-7 (even: 1),
 * 1 + 2^-7 + 2^-8 a tie between 1 + 2^-7 and 1 + 2^-6 (even: 1 + 2^-6),
 * 1 + 3·2^-9 rounds up to 1 + 2^-7. */
static void test_bf16_rounding(void **state) {
  (void)state;
  report rep = {0};
  int wr;
  MPI_Comm_rank(MPI_COMM_WORLD, &wr);
  MPI_Comm pair;
  MPI_Comm_split(MPI_COMM_WORLD, wr / 2, wr, &pair);
  ml_comm *c = counting(pair, "pair");
  MPI_Comm_free(&pair);
  if (c->size == 2) {
    float a[3] = {1.0f, 1.0f + 0x1p-7f, 1.0f}, b[3] = {0x1p-8f, 0x1p-8f, 3 * 0x1p-9f};
    float want[3] = {1.0f, 1.0f + 0x1p-6f, 1.0f + 0x1p-7f};
    uint16_t v[3];
    for (int i = 0; i < 3; i++) v[i] = c->rank == 0 ? ml_f32_to_bf16(a[i]) : ml_f32_to_bf16(b[i]);
    if (ml_all_reduce(c, v, 3, ML_ELEM_BF16, ML_RED_SUM)) note(&rep, "%s", ml_error_msg());
    for (int i = 0; i < 3; i++)
      if (ml_bf16_to_f32(v[i]) != want[i])
        note(&rep, "bf16 %a + %a = %a, want %a", a[i], b[i], ml_bf16_to_f32(v[i]), want[i]);
  }
  ml_comm_destroy(c);
  agree(&rep, "failures");
}

/* The host channel's calls. */
static void test_host(void **state) {
  (void)state;
  report rep = {0};
  ml_host *h;
  if (ml_host_create(MPI_COMM_WORLD, "world", &h)) fail_msg("host: %s", ml_error_msg());
  int t = h->size, r = h->rank;
  double f[3] = {r + 0.5, r + 0.5, r + 0.5};
  int64_t n[3] = {r, r, (int64_t)1 << 40 | r};
  if (ml_host_all_reduce_f64(h, f, 1, ML_RED_SUM) ||
      ml_host_all_reduce_f64(h, f + 1, 1, ML_RED_MAX) ||
      ml_host_all_reduce_f64(h, f + 2, 1, ML_RED_MIN) ||
      ml_host_all_reduce_i64(h, n, 1, ML_RED_SUM) ||
      ml_host_all_reduce_i64(h, n + 1, 1, ML_RED_MAX) ||
      ml_host_all_reduce_i64(h, n + 2, 1, ML_RED_MIN) || ml_host_barrier(h))
    note(&rep, "%s", ml_error_msg());
  if (f[0] != t * (t - 1) / 2.0 + 0.5 * t || f[1] != t - 0.5 || f[2] != 0.5)
    note(&rep, "f64 sum/max/min %g %g %g", f[0], f[1], f[2]);
  if (n[0] != t * (t - 1) / 2 || n[1] != t - 1 || n[2] != (int64_t)1 << 40)
    note(&rep, "i64 sum/max/min %lld %lld %lld", (long long)n[0], (long long)n[1], (long long)n[2]);
  char name[24] = "";
  if (r == t - 1) snprintf(name, sizeof name, "from %d", r);
  if (ml_host_broadcast(h, name, sizeof name, t - 1)) note(&rep, "%s", ml_error_msg());
  char want[24];
  snprintf(want, sizeof want, "from %d", t - 1);
  if (strcmp(name, want)) note(&rep, "broadcast '%s', want '%s'", name, want);
  int32_t mine[2] = {r, -r}, *all = malloc(sizeof mine * (size_t)t);
  if (ml_host_all_gather(h, mine, sizeof mine, all)) note(&rep, "%s", ml_error_msg());
  for (int p = 0; p < t; p++)
    if (all[2 * p] != p || all[2 * p + 1] != -p) note(&rep, "all_gather block %d", p);
  /* blocks of different lengths, rank 0's empty: rank p sends p values p */
  if (t > 64) fail_msg("test_host: at most 64 ranks");
  size_t bytes[64];
  int32_t v[64], *packed = malloc(sizeof(int32_t) * (size_t)(t * t + 1));
  for (int p = 0; p < t; p++) bytes[p] = sizeof(int32_t) * (size_t)p;
  for (int i = 0; i < r; i++) v[i] = r;
  if (ml_host_all_gather_v(h, v, bytes, packed)) note(&rep, "%s", ml_error_msg());
  for (int p = 0, at = 0; p < t; at += p++)
    for (int i = 0; i < p; i++)
      if (packed[at + i] != p) note(&rep, "all_gather_v block %d [%d] = %d", p, i, packed[at + i]);
  free(packed);
  free(all);
  /* the first failing rank, and the agreement carrying its message */
  int first = 7;
  if (ml_host_first_failing(h, 0, &first) || first != -1) note(&rep, "none failing: %d", first);
  int fails = t > 1 && r >= 1;
  if (ml_host_first_failing(h, fails, &first) || first != (t > 1 ? 1 : -1))
    note(&rep, "first failing %d", first);
  ml_error_clear();
  if (ml_host_agree(h, 0)) note(&rep, "agree on success: %s", ml_error_msg());
  if (fails) ml_err("disk full on rank %d", r);
  if (t > 1 && (ml_host_agree(h, fails ? -1 : 0) != -1 || ml_error_origin() != 1 ||
                !strstr(ml_error_msg(), "disk full on rank 1")))
    note(&rep, "agreed message '%s' from rank %d, want rank 1's", ml_error_msg(),
         ml_error_origin());
  ml_error_clear();
  ml_host_destroy(h);
  agree(&rep, "failures");
}

/* Elements rank q sends rank p in an all-to-all: (q·3 + p·5 + 1) mod 5,
 * so some blocks are empty (and the self block on some ranks). */
static int64_t a2a_count(int q, int p) { return (q * 3 + p * 5 + 1) % 5; }
/* Element i of that block: distinct per (q, p, i) in fp32 (bf16 rounds it). */
static float a2a_val(int q, int p, int64_t i) { return (float)(q * 64 + p * 8 + i) + 0.5f; }

/* The uneven all-to-all: counts through ml_host_all_to_all_i64, then the
 * blocks in f32 and bf16 (two in flight), each compared with memcmp to
 * what the senders' formula puts there. */
static void test_all_to_all_v(void **state) {
  (void)state;
  report rep = {0};
  ml_comm *c = counting(MPI_COMM_WORLD, "ep");
  ml_host *h;
  if (ml_host_create(MPI_COMM_WORLD, "ep", &h)) fail_msg("%s", ml_error_msg());
  int t = c->size, r = c->rank;
  int64_t sc[8], rc[8], ns = 0, nr = 0;
  assert_true(t <= 8);
  for (int p = 0; p < t; p++) ns += sc[p] = a2a_count(r, p);
  if (ml_host_all_to_all_i64(h, sc, 1, rc)) note(&rep, "counts: %s", ml_error_msg());
  for (int q = 0; q < t; q++) {
    if (rc[q] != a2a_count(q, r))
      note(&rep, "count from rank %d: %lld, want %lld", q, (long long)rc[q],
           (long long)a2a_count(q, r));
    nr += a2a_count(q, r);
  }
  float *send = malloc(sizeof(float) * (size_t)(ns + 1)), *recv = malloc(sizeof(float) * (size_t)(nr + 1));
  float *want = malloc(sizeof(float) * (size_t)(nr + 1));
  uint16_t *send16 = malloc(2 * (size_t)(ns + 1)), *recv16 = malloc(2 * (size_t)(nr + 1));
  uint16_t *want16 = malloc(2 * (size_t)(nr + 1));
  for (int p = 0, o = 0; p < t; p++)
    for (int64_t i = 0; i < sc[p]; i++, o++) {
      send[o] = a2a_val(r, p, i);
      send16[o] = ml_f32_to_bf16(send[o]);
    }
  for (int q = 0, o = 0; q < t; q++)
    for (int64_t i = 0; i < a2a_count(q, r); i++, o++) {
      want[o] = a2a_val(q, r, i);
      want16[o] = ml_f32_to_bf16(want[o]);
    }
  ml_request q32, q16;
  if (ml_iall_to_all_v(c, send, sc, recv, rc, ML_ELEM_F32, &q32) ||
      ml_iall_to_all_v(c, send16, sc, recv16, rc, ML_ELEM_BF16, &q16) || ml_wait(c, &q16) ||
      ml_wait(c, &q32))
    note(&rep, "all-to-all: %s", ml_error_msg());
  if (memcmp(recv, want, sizeof(float) * (size_t)nr))
    note(&rep, "f32 all-to-all: received blocks differ from the senders'");
  if (memcmp(recv16, want16, 2 * (size_t)nr))
    note(&rep, "bf16 all-to-all: received blocks differ from the senders'");
  const ml_comm_stats *st = ml_comm_stats_of(c);
  if (st->calls[ML_COLL_ALL_TO_ALL] != 2 || st->bytes[ML_COLL_ALL_TO_ALL] != 6 * ns)
    note(&rep, "counted %lld all-to-alls, %lld B; want 2, %lld B",
         (long long)st->calls[ML_COLL_ALL_TO_ALL], (long long)st->bytes[ML_COLL_ALL_TO_ALL],
         (long long)(6 * ns));
  /* a negative count: refused before anything is issued, on every rank */
  sc[0] = -1;
  ml_request qn;
  if (ml_iall_to_all_v(c, send, sc, recv, rc, ML_ELEM_F32, &qn) == 0 || qn.impl ||
      !strstr(ml_error_msg(), "send count -1") || !strstr(ml_error_msg(), "'ep'"))
    note(&rep, "negative count: '%s'", ml_error_msg());
  ml_error_clear();
  free(send), free(recv), free(want), free(send16), free(recv16), free(want16);
  ml_host_destroy(h);
  ml_comm_destroy(c);
  agree(&rep, "failures");
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  ml_error_set_rank(rank);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_nonblocking_f32),
      cmocka_unit_test(test_reductions),
      cmocka_unit_test(test_bf16),
      cmocka_unit_test(test_bf16_rounding),
      cmocka_unit_test(test_host),
      cmocka_unit_test(test_all_to_all_v),
  };
  return held_finish(cmocka_run_group_tests(tests, NULL, NULL));
}

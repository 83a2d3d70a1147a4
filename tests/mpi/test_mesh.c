/* The device mesh's group table: `mpiexec -n 4 test_mesh`.
 *  - every layout dp_replicate × dp_shard × cp × tp of the world (cp
 *    included, though the engine runs cp = 1 only): each group's members,
 *    in order, as its host channel and its data comm see them (all-gathers
 *    of the world rank), its size, rank and name, and the mesh's
 *    coordinates, against the row-major layout with tp fastest;
 *  - three layouts of 4 ranks written out by hand (cp 2 × tp 2, dp_shard 2 ×
 *    cp 2, dp_replicate 2 × cp 2), so that the layout rule itself is
 *    checked and not only its implementation;
 *  - the comm factory: called once per group in table order with the
 *    caller's context; a failing factory fails the mesh with its message
 *    and leaves it empty; a comm of the wrong size is refused;
 *  - sizes that do not multiply to the world are refused;
 *  - the node-local rank (comm/node.h) on the world and on a split of it
 *    (all ranks on this one machine: the rank itself), and the mesh's
 *    device (parallel/device.h): cpu with the MPI comms, an unknown name
 *    refused with the caller's prefix. */
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

#include "comm/comm_mpi.h"
#include "comm/comm_staged.h"
#include "comm/node.h"
#include "common/status.h"
#include "held.h"
#include "parallel/device.h"
#include "parallel/mesh.h"
#include "rank_report.h"

enum { DIMS = 4, MAX_RANKS = 64 };

typedef struct layout {
  int size[DIMS]; /* dp_replicate, dp_shard, cp, tp */
} layout;

/* The dimensions each group spans, as the layout rule says (ARCHITECTURE.md §2). */
static const char *const spans[ML_GROUP_KINDS] = {
    [ML_GROUP_WORLD] = "1111",       [ML_GROUP_DP_REPLICATE] = "1000", [ML_GROUP_DP_SHARD] = "0100",
    [ML_GROUP_CP] = "0010",          [ML_GROUP_TP] = "0001",           [ML_GROUP_DP] = "1100",
    [ML_GROUP_DP_SHARD_CP] = "0110", [ML_GROUP_DP_CP] = "1110",
    [ML_GROUP_EP] = "0000",       /* one rank until ml_mesh_set_ep (test_ep) */
    [ML_GROUP_EP_SHARD] = "0000", /* likewise */
};

/* Row-major coordinates of rank r, tp fastest. */
static void coords(const layout *l, int r, int c[DIMS]) {
  for (int d = DIMS - 1; d >= 0; d--) {
    c[d] = r % l->size[d];
    r /= l->size[d];
  }
}

/* The members of rank r's group g in world-rank order: the ranks whose
 * coordinates outside the group's dimensions equal r's. */
static int members_of(const layout *l, int n, ml_group g, int r, int *out) {
  int cr[DIMS], k = 0;
  coords(l, r, cr);
  for (int p = 0; p < n; p++) {
    int cp[DIMS];
    coords(l, p, cp);
    bool same = true;
    for (int d = 0; d < DIMS; d++) same = same && (spans[g][d] == '1' || cp[d] == cr[d]);
    if (same) out[k++] = p;
  }
  return k;
}

/* Members of rank r's group from a hand-written labelling (ranks with the
 * same digit share a group). */
static int members_by_label(const char *labels, int r, int *out) {
  int k = 0;
  for (int p = 0; labels[p]; p++)
    if (labels[p] == labels[r]) out[k++] = p;
  return k;
}

static void expect_members(report *rep, const layout *l, ml_group g, const char *how,
                           const int *got, int n_got, const int *want, int n_want) {
  bool same = n_got == n_want;
  for (int i = 0; same && i < n_got; i++) same = got[i] == want[i];
  if (same) return;
  char a[256] = "", b[256] = "";
  for (int i = 0; i < n_got; i++) snprintf(a + strlen(a), sizeof a - strlen(a), " %d", got[i]);
  for (int i = 0; i < n_want; i++) snprintf(b + strlen(b), sizeof b - strlen(b), " %d", want[i]);
  note(rep, "layout %dx%dx%dx%d group %s (%s): members [%s ], want [%s ]", l->size[0], l->size[1],
       l->size[2], l->size[3], ml_group_name(g), how, a, b);
}

/* Build the mesh of layout l and check every group against the rule (and
 * against `labels`, a hand-written labelling per group, when given). */
static void check_layout(report *rep, const layout *l, const char *const *labels) {
  int n, r;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  ml_mesh m;
  if (ml_mesh_create(MPI_COMM_WORLD, l->size[0], l->size[1], l->size[2], l->size[3], NULL, NULL,
                     &m)) {
    note(rep, "mesh %dx%dx%dx%d: %s", l->size[0], l->size[1], l->size[2], l->size[3],
         ml_error_msg());
    return;
  }
  int c[DIMS];
  coords(l, r, c);
  if (m.dp_replicate_rank != c[0] || m.dp_shard_rank != c[1] || m.cp_rank != c[2] ||
      m.tp_rank != c[3])
    note(rep, "rank %d: coordinates %d %d %d %d, want %d %d %d %d", r, m.dp_replicate_rank,
         m.dp_shard_rank, m.cp_rank, m.tp_rank, c[0], c[1], c[2], c[3]);
  for (int g = 0; g < ML_GROUP_KINDS; g++) {
    const ml_mesh_group *grp = &m.groups[g];
    int want[MAX_RANKS], k = members_of(l, n, (ml_group)g, r, want);
    int32_t me = r, via_host[MAX_RANKS];
    float mef = (float)r, via_comm[MAX_RANKS];
    if (ml_host_all_gather(grp->host, &me, sizeof me, via_host) ||
        ml_all_gather(grp->comm, &mef, via_comm, 1)) {
      note(rep, "group %s: %s", ml_group_name((ml_group)g), ml_error_msg());
      continue;
    }
    int got_host[MAX_RANKS], got_comm[MAX_RANKS];
    for (int i = 0; i < grp->size; i++) {
      got_host[i] = via_host[i];
      got_comm[i] = (int)via_comm[i];
    }
    expect_members(rep, l, (ml_group)g, "host channel", got_host, grp->size, want, k);
    expect_members(rep, l, (ml_group)g, "data comm", got_comm, grp->comm->size, want, k);
    if (labels) {
      int hand[MAX_RANKS], kh = members_by_label(labels[g], r, hand);
      expect_members(rep, l, (ml_group)g, "written out", got_host, grp->size, hand, kh);
    }
    int pos = 0;
    while (pos < k && want[pos] != r) pos++;
    const char *name = ml_group_name((ml_group)g);
    if (grp->rank != pos || grp->comm->rank != pos || grp->host->rank != pos || grp->size != k ||
        strcmp(grp->name, name) || strcmp(grp->comm->name, name) || strcmp(grp->host->name, name) ||
        !ml_comm_stats_of(grp->comm) || ml_mesh_comm(&m, (ml_group)g) != grp->comm ||
        ml_mesh_host(&m, (ml_group)g) != grp->host)
      note(rep, "group %s on rank %d: rank %d/%d/%d of %d named '%s'/'%s'; want rank %d of %d",
           name, r, grp->rank, grp->comm->rank, grp->host->rank, grp->size, grp->comm->name,
           grp->host->name, pos, k);
  }
  ml_mesh_destroy(&m);
}

/* Every factorisation of the world into dp_replicate × dp_shard × cp × tp. */
static void test_every_layout(void **state) {
  (void)state;
  report rep = {0};
  int n;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  assert_true(n <= MAX_RANKS);
  int layouts = 0;
  for (int a = 1; a <= n; a++)
    for (int b = 1; a * b <= n; b++)
      for (int c = 1; a * b * c <= n; c++)
        if (n % (a * b * c) == 0) {
          layout l = {{a, b, c, n / (a * b * c)}};
          check_layout(&rep, &l, NULL);
          layouts++;
        }
  if (n == 4 && layouts != 10) note(&rep, "%d layouts of 4 ranks, want 10", layouts);
  agree(&rep, "failures");
}

/* Layouts of 4 ranks written out: per group (table order: world,
 * dp_replicate, dp_shard, cp, tp, dp, dp_shard_cp, dp_cp, ep, ep_shard),
 * ranks with the same digit share a group. */
static void test_written_out(void **state) {
  (void)state;
  int n;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  if (n != 4) skip();
  report rep = {0};
  static const char *const cp2_tp2[] = {"0000", "0123", "0123", "0101", "0011",
                                        "0123", "0101", "0101", "0123", "0123"};
  static const char *const dps2_cp2[] = {"0000", "0123", "0101", "0011", "0123",
                                         "0101", "0000", "0000", "0123", "0123"};
  static const char *const dpr2_cp2[] = {"0000", "0101", "0123", "0011", "0123",
                                         "0101", "0011", "0000", "0123", "0123"};
  check_layout(&rep, &(layout){{1, 1, 2, 2}}, cp2_tp2);
  check_layout(&rep, &(layout){{1, 2, 2, 1}}, dps2_cp2);
  check_layout(&rep, &(layout){{2, 1, 2, 1}}, dpr2_cp2);
  agree(&rep, "failures");
}

/* A factory that records its calls and fails (or misbehaves) on request. */
typedef struct factory_log {
  int calls;
  char names[ML_GROUP_KINDS + 1][32];
  const char *fail_on;  /* fail for this group name */
  bool rank0_only;      /* ... on world rank 0 only */
  const char *wrong_on; /* make a one-rank comm for this group name */
} factory_log;

static int logging_factory(void *ctx, MPI_Comm group, const char *name, ml_comm **out) {
  factory_log *log = ctx;
  if (log->calls <= ML_GROUP_KINDS) snprintf(log->names[log->calls], 32, "%s", name);
  log->calls++;
  int rank;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (log->fail_on && !strcmp(name, log->fail_on) && (!log->rank0_only || rank == 0))
    return ml_err("no device communicator for group '%s'", name);
  return ml_comm_mpi_make(
      NULL, log->wrong_on && !strcmp(name, log->wrong_on) ? MPI_COMM_SELF : group, name, out);
}

static void test_factory(void **state) {
  (void)state;
  report rep = {0};
  int n;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  factory_log log = {0};
  ml_mesh m;
  if (ml_mesh_create(MPI_COMM_WORLD, 1, 0, 1, 1, logging_factory, &log, &m)) {
    note(&rep, "mesh with a factory: %s", ml_error_msg());
  } else {
    ml_mesh_destroy(&m);
  }
  if (log.calls != ML_GROUP_KINDS)
    note(&rep, "factory called %d times, want %d", log.calls, ML_GROUP_KINDS);
  for (int g = 0; g < ML_GROUP_KINDS && g < log.calls; g++)
    if (strcmp(log.names[g], ml_group_name((ml_group)g)))
      note(&rep, "factory call %d for '%s', want '%s'", g, log.names[g],
           ml_group_name((ml_group)g));
  /* a failing factory: the mesh fails with its message and is left empty */
  factory_log failing = {.fail_on = "cp"};
  ml_error_clear();
  if (ml_mesh_create(MPI_COMM_WORLD, 1, 0, 1, 1, logging_factory, &failing, &m) == 0 ||
      !strstr(ml_error_msg(), "no device communicator for group 'cp'") ||
      m.groups[ML_GROUP_WORLD].comm || m.groups[ML_GROUP_WORLD].host)
    note(&rep, "failing factory: '%s'", ml_error_msg());
  /* a factory failing on rank 0 alone: every rank fails, none hangs; the others name rank 0 */
  factory_log first = {.fail_on = "tp", .rank0_only = true};
  ml_error_clear();
  int rank;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (ml_mesh_create(MPI_COMM_WORLD, 1, 0, 1, 1, logging_factory, &first, &m) == 0 ||
      !strstr(ml_error_msg(), rank == 0 ? "no device communicator for group 'tp'"
                                        : "mesh group 'tp': making its comm failed on rank 0"))
    note(&rep, "factory failing on rank 0: '%s'", ml_error_msg());
  /* a comm that is not the group's */
  if (n > 1) {
    factory_log wrong = {.wrong_on = "dp_shard"};
    ml_error_clear();
    if (ml_mesh_create(MPI_COMM_WORLD, 1, 0, 1, 1, logging_factory, &wrong, &m) == 0 ||
        !strstr(ml_error_msg(), "mesh group 'dp_shard'") ||
        !strstr(ml_error_msg(), "expected rank"))
      note(&rep, "wrong-size comm: '%s'", ml_error_msg());
  }
  ml_error_clear();
  agree(&rep, "failures");
}

static void test_bad_sizes(void **state) {
  (void)state;
  report rep = {0};
  int n;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  ml_mesh m;
  ml_error_clear();
  if (ml_mesh_create(MPI_COMM_WORLD, 1, 0, n + 1, 1, NULL, NULL, &m) == 0 ||
      !strstr(ml_error_msg(), "not divisible"))
    note(&rep, "cp = world + 1: '%s'", ml_error_msg());
  ml_error_clear();
  if (ml_mesh_create(MPI_COMM_WORLD, 1, 2 * n, 1, 1, NULL, NULL, &m) == 0 ||
      !strstr(ml_error_msg(), "does not equal the world size"))
    note(&rep, "dp_shard = 2 x world: '%s'", ml_error_msg());
  ml_error_clear();
  agree(&rep, "failures");
}

static void test_node_and_device(void **state) {
  (void)state;
  report rep = {0};
  int rank, local = -1, half_rank, half_local = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (ml_node_rank(MPI_COMM_WORLD, &local) || local != rank)
    note(&rep, "node rank on the world: %d, want %d (%s)", local, rank, ml_error_msg());
  MPI_Comm half;
  MPI_Comm_split(MPI_COMM_WORLD, rank % 2, rank, &half);
  MPI_Comm_rank(half, &half_rank);
  if (ml_node_rank(half, &half_local) || half_local != half_rank)
    note(&rep, "node rank on a split: %d, want %d (%s)", half_local, half_rank, ml_error_msg());
  MPI_Comm_free(&half);
  ml_backend *be = NULL;
  ml_comm_factory make = ml_comm_mpi_make;
  void *ctx = &rep;
  if (ml_mesh_device_open(MPI_COMM_WORLD, "cpu", "test: device", ML_DEVICE_COMM_AUTO, "test: comm",
                          &be, &make, &ctx) ||
      !be || strcmp(be->ops->name, "cpu") || make || ctx)
    note(&rep, "cpu device: backend %s, factory %s (%s)", be ? be->ops->name : "none",
         make ? "set" : "NULL (MPI)", ml_error_msg());
  /* staged on request: its factory over the backend; nccl refused, naming the flag */
  if (ml_mesh_device_open(MPI_COMM_WORLD, "cpu", "test: device", ML_DEVICE_COMM_STAGED,
                          "test: comm", &be, &make, &ctx) ||
      make != ml_comm_staged_make || ctx != be)
    note(&rep, "cpu device, staged comm: factory %s (%s)", make ? "other" : "NULL",
         ml_error_msg());
  ml_error_clear();
  if (ml_mesh_device_open(MPI_COMM_WORLD, "cpu", "test: device", ML_DEVICE_COMM_NCCL, "test: comm",
                          &be, &make, &ctx) == 0 ||
      !strstr(ml_error_msg(), "test: comm nccl: device 'cpu' keeps tensors in host memory"))
    note(&rep, "cpu device, nccl: '%s'", ml_error_msg());
  ml_error_clear();
  if (ml_mesh_device_open(MPI_COMM_WORLD, "tpu", "test: device", ML_DEVICE_COMM_AUTO, "test: comm",
                          &be, &make, &ctx) == 0 ||
      !strstr(ml_error_msg(), "test: device tpu: ") ||
      !strstr(ml_error_msg(), "device 'tpu': unknown; expected one of cpu, cuda"))
    note(&rep, "unknown device: '%s'", ml_error_msg());
  ml_error_clear();
  agree(&rep, "failures");
}

/* Expert parallelism over 4 ranks (ml_mesh_set_ep): ep 2 groups world
 * ranks {0, 1} and {2, 3} (dp_shard 4, and HSDP 2 x 2), ep 4 all four; the
 * group's rank its position; ep_shard the ranks of one ep coordinate ({0,
 * 2} and {1, 3} under ep 2, each rank alone under ep 4), its rank rank / ep;
 * ep 3 refused naming it and the sizes; the meta mesh's ep and ep_shard
 * groups null comms of ep and world / ep ranks. */
static void test_ep(void **state) {
  (void)state;
  int n, r;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  if (n != 4) skip();
  report rep = {0};
  const struct { int dpr, ep; } cases[] = {{1, 2}, {2, 2}, {1, 4}};
  for (int i = 0; i < 3; i++) {
    ml_mesh m;
    if (ml_mesh_create(MPI_COMM_WORLD, cases[i].dpr, 0, 1, 1, NULL, NULL, &m) ||
        ml_mesh_set_ep(&m, MPI_COMM_WORLD, cases[i].ep, NULL, NULL)) {
      note(&rep, "ep %d: %s", cases[i].ep, ml_error_msg());
      continue;
    }
    const ml_mesh_group *g = &m.groups[ML_GROUP_EP];
    int32_t me = r, got[MAX_RANKS];
    if (ml_host_all_gather(g->host, &me, sizeof me, got)) note(&rep, "%s", ml_error_msg());
    int ep = cases[i].ep, first = r / ep * ep;
    if (g->size != ep || g->rank != r % ep || g->comm->size != ep || g->comm->rank != r % ep ||
        strcmp(g->name, "ep"))
      note(&rep, "ep %d: group of %d (rank %d), want %d (rank %d)", ep, g->size, g->rank, ep,
           r % ep);
    for (int q = 0; q < ep && q < g->size; q++)
      if (got[q] != first + q) note(&rep, "ep %d: member %d is rank %d, want %d", ep, q, got[q], first + q);
    const ml_mesh_group *x = &m.groups[ML_GROUP_EP_SHARD];
    if (ml_host_all_gather(x->host, &me, sizeof me, got)) note(&rep, "%s", ml_error_msg());
    if (x->size != n / ep || x->rank != r / ep || x->comm->size != n / ep ||
        strcmp(x->name, "ep_shard"))
      note(&rep, "ep %d: ep_shard group of %d (rank %d), want %d (rank %d)", ep, x->size,
           x->rank, n / ep, r / ep);
    for (int q = 0; q < n / ep && q < x->size; q++)
      if (got[q] != r % ep + q * ep)
        note(&rep, "ep %d: ep_shard member %d is rank %d, want %d", ep, q, got[q], r % ep + q * ep);
    ml_mesh_destroy(&m);
  }
  ml_mesh m;
  ml_error_clear();
  if (ml_mesh_create(MPI_COMM_WORLD, 1, 0, 1, 1, NULL, NULL, &m)) fail_msg("%s", ml_error_msg());
  if (ml_mesh_set_ep(&m, MPI_COMM_WORLD, 3, NULL, NULL) == 0 ||
      !strstr(ml_error_msg(), "--ep (ep_size) 3") || !strstr(ml_error_msg(), "= 4 ranks"))
    note(&rep, "ep 3 of 4 ranks: '%s'", ml_error_msg());
  ml_mesh_destroy(&m);
  if (ml_mesh_create_meta(2, 4, 1, 1, 5, &m) || ml_mesh_set_ep_meta(&m, 4))
    note(&rep, "meta: %s", ml_error_msg());
  else if (m.groups[ML_GROUP_EP].size != 4 || m.groups[ML_GROUP_EP].rank != 1 ||
           m.groups[ML_GROUP_EP].comm->size != 4)
    note(&rep, "meta ep group: %d ranks, rank %d; want 4, 1", m.groups[ML_GROUP_EP].size,
         m.groups[ML_GROUP_EP].rank);
  else if (m.groups[ML_GROUP_EP_SHARD].size != 2 || m.groups[ML_GROUP_EP_SHARD].rank != 1 ||
           m.groups[ML_GROUP_EP_SHARD].comm->size != 2)
    note(&rep, "meta ep_shard group: %d ranks, rank %d; want 2, 1 (world 8 / ep 4; 5 / 4)",
         m.groups[ML_GROUP_EP_SHARD].size, m.groups[ML_GROUP_EP_SHARD].rank);
  ml_mesh_destroy(&m);
  agree(&rep, "failures");
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_every_layout),
      cmocka_unit_test(test_written_out),
      cmocka_unit_test(test_factory),
      cmocka_unit_test(test_bad_sizes),
      cmocka_unit_test(test_ep),
      cmocka_unit_test(test_node_and_device),
  };
  return held_finish(cmocka_run_group_tests(tests, NULL, NULL));
}

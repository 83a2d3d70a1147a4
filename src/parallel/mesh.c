#include "parallel/mesh.h"

#include <string.h>

#include "comm/comm_mpi.h"
#include "comm/comm_null.h"
#include "common/status.h"

/* The mesh dimensions, slowest first (tp fastest). */
enum { DIM_DPR, DIM_DPS, DIM_CP, DIM_TP, DIMS };

/* The dimensions each group spans (bit d = dimension d). */
static const unsigned group_dims[ML_GROUP_KINDS] = {
    [ML_GROUP_WORLD] = 1u << DIM_DPR | 1u << DIM_DPS | 1u << DIM_CP | 1u << DIM_TP,
    [ML_GROUP_DP_REPLICATE] = 1u << DIM_DPR,
    [ML_GROUP_DP_SHARD] = 1u << DIM_DPS,
    [ML_GROUP_CP] = 1u << DIM_CP,
    [ML_GROUP_TP] = 1u << DIM_TP,
    [ML_GROUP_DP] = 1u << DIM_DPR | 1u << DIM_DPS,
    [ML_GROUP_DP_SHARD_CP] = 1u << DIM_DPS | 1u << DIM_CP,
    [ML_GROUP_DP_CP] = 1u << DIM_DPR | 1u << DIM_DPS | 1u << DIM_CP,
    [ML_GROUP_EP] = 0,       /* one rank until ml_mesh_set_ep */
    [ML_GROUP_EP_SHARD] = 0, /* likewise */
};

const char *ml_group_name(ml_group g) {
  static const char *names[ML_GROUP_KINDS] = {"world", "dp_replicate", "dp_shard", "cp",
                                              "tp",    "dp",           "dp_shard_cp", "dp_cp",
                                              "ep",    "ep_shard"};
  return g >= 0 && g < ML_GROUP_KINDS ? names[g] : "?";
}

/* rc of every rank of base, agreed: where a rank failed to make group
 * `name`'s comm (a device communicator's set-up can fail on one rank
 * alone), every rank fails, the others naming the lowest failing world
 * rank, so that none is left waiting in the next group's MPI_Comm_split. */
static int agreed(MPI_Comm base, int rc, const char *name) {
  int rank, size, first;
  MPI_Comm_rank(base, &rank);
  MPI_Comm_size(base, &size);
  int mine = rc ? rank : size;
  ML_TRY(ml_mpi_check(MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, base),
                      "MPI_Allreduce of the comm factory's status", name));
  if (first == size || rc) return rc;
  return ml_err("mesh group '%s': making its comm failed on rank %d (its message there)", name,
                first);
}

/* Group g's data comm and host channel over the ranks sharing `color`
 * (key = world rank keeps the mesh order inside the group). */
static int group_create(MPI_Comm base, int color, int key, ml_group g, ml_comm_factory make,
                        void *ctx, ml_mesh_group *out) {
  const char *name = ml_group_name(g);
  MPI_Comm sub;
  ML_TRY(ml_mpi_check(MPI_Comm_split(base, color, key, &sub), "MPI_Comm_split", name));
  out->name = name;
  MPI_Comm_size(sub, &out->size);
  MPI_Comm_rank(sub, &out->rank);
  ml_comm *raw = NULL;
  int rc = make(ctx, sub, name, &raw);
  if (rc == 0 && (raw->rank != out->rank || raw->size != out->size))
    rc = ml_err("mesh group '%s': the comm factory made a comm of rank %d of %d; expected rank %d "
                "of %d (the group's MPI communicator)",
                name, raw->rank, raw->size, out->rank, out->size);
  if (rc == 0) rc = ml_comm_counting_create(raw, &out->comm);
  if (rc != 0) ml_comm_destroy(raw);
  if (rc == 0) rc = ml_host_create(sub, name, &out->host);
  MPI_Comm_free(&sub);
  return agreed(base, rc, name);
}

static int check_sizes(int world, int dpr, int dps, int cp, int tp) {
  if (dpr < 1 || cp < 1 || tp < 1)
    return ml_err("mesh: dp_replicate=%d, cp=%d, tp=%d: every size must be >= 1", dpr, cp, tp);
  long prod = (long)dpr * dps * cp * tp;
  if (dps < 1 || prod != world)
    return ml_err("mesh: dp_replicate(%d) x dp_shard(%d) x cp(%d) x tp(%d) = %ld does not equal "
                  "the world size %d; expected the sizes to multiply to the number of ranks",
                  dpr, dps, cp, tp, prod, world);
  return 0;
}

/* Sizes, strides and rank r's coordinates (row-major, tp fastest). */
static void place(ml_mesh *out, int dpr, int dps, int cp, int tp, int r, int size[DIMS],
                  int stride[DIMS], int coord[DIMS]) {
  out->dp_replicate = dpr;
  out->dp_shard = dps;
  out->cp = cp;
  out->tp = tp;
  const int sz[DIMS] = {dpr, dps, cp, tp}, st[DIMS] = {dps * cp * tp, cp * tp, tp, 1};
  for (int d = 0; d < DIMS; d++) {
    size[d] = sz[d];
    stride[d] = st[d];
    coord[d] = r / stride[d] % size[d];
  }
  out->dp_replicate_rank = coord[DIM_DPR];
  out->dp_shard_rank = coord[DIM_DPS];
  out->cp_rank = coord[DIM_CP];
  out->tp_rank = coord[DIM_TP];
}

int ml_mesh_create(MPI_Comm base, int dp_replicate, int dp_shard, int cp, int tp,
                   ml_comm_factory make_comm, void *ctx, ml_mesh *out) {
  memset(out, 0, sizeof *out);
  MPI_Comm_size(base, &out->world_size);
  MPI_Comm_rank(base, &out->rank);
  int world = out->world_size, r = out->rank;
  if (dp_shard <= 0 && dp_replicate >= 1 && cp >= 1 && tp >= 1) {
    if (world % (dp_replicate * cp * tp) != 0)
      return ml_err("mesh: world size %d is not divisible by dp_replicate(%d) x cp(%d) x tp(%d) = "
                    "%d; expected a multiple of it",
                    world, dp_replicate, cp, tp, dp_replicate * cp * tp);
    dp_shard = world / (dp_replicate * cp * tp);
  }
  ML_TRY(check_sizes(world, dp_replicate, dp_shard, cp, tp));
  int size[DIMS], stride[DIMS], coord[DIMS];
  place(out, dp_replicate, dp_shard, cp, tp, r, size, stride, coord);
  if (!make_comm) make_comm = ml_comm_mpi_make;
  for (int g = 0; g < ML_GROUP_KINDS; g++) {
    /* the color: this rank with the group's coordinates set to 0, i.e. the
     * coordinates that stay fixed inside the group */
    int color = r;
    for (int d = 0; d < DIMS; d++)
      if (group_dims[g] >> d & 1u) color -= coord[d] * stride[d];
    if (group_create(base, color, r, (ml_group)g, make_comm, ctx, &out->groups[g])) {
      ml_mesh_destroy(out);
      return -1;
    }
  }
  return 0;
}

/* Free group g (a one-rank ep or ep_shard group made at creation, before its replacement). */
static void group_free(ml_mesh_group *g) {
  ml_comm_destroy(g->comm);
  ml_host_destroy(g->host);
  memset(g, 0, sizeof *g);
}

/* A meta mesh's group g: a null comm of `size` ranks (this rank's `rank`),
 * its channel this process alone. */
static int meta_group(ml_mesh *m, ml_group g, int size, int rank) {
  ml_mesh_group *grp = &m->groups[g];
  group_free(grp);
  *grp = (ml_mesh_group){.size = size, .rank = rank, .name = ml_group_name(g)};
  ml_comm *raw = NULL;
  int rc = ml_comm_null_create(grp->rank, grp->size, grp->name, &raw);
  if (rc == 0) rc = ml_comm_counting_create(raw, &grp->comm);
  if (rc != 0) ml_comm_destroy(raw);
  if (rc == 0) rc = ml_host_create(MPI_COMM_SELF, grp->name, &grp->host);
  return rc;
}

int ml_mesh_create_meta(int dp_replicate, int dp_shard, int cp, int tp, int rank, ml_mesh *out) {
  memset(out, 0, sizeof *out);
  if (dp_replicate < 1 || dp_shard < 1 || cp < 1 || tp < 1 || dp_replicate > 1 << 16 ||
      dp_shard > 1 << 16 || cp > 1 << 16 || tp > 1 << 16)
    return ml_err("mesh: dp_replicate=%d, dp_shard=%d, cp=%d, tp=%d: expected sizes in 1..65536",
                  dp_replicate, dp_shard, cp, tp);
  int64_t world = (int64_t)dp_replicate * dp_shard * cp * tp;
  if (world > 1 << 24 || rank < 0 || rank >= world)
    return ml_err("mesh: rank %d of a world of %lld ranks; expected 0 <= rank < world <= 2^24",
                  rank, (long long)world);
  out->world_size = (int)world;
  out->rank = rank;
  int size[DIMS], stride[DIMS], coord[DIMS];
  place(out, dp_replicate, dp_shard, cp, tp, rank, size, stride, coord);
  for (int g = 0; g < ML_GROUP_KINDS; g++) {
    int gsize = 1, grank = 0;
    for (int d = 0; d < DIMS; d++) /* row-major index of the coordinates in its dims */
      if (group_dims[g] >> d & 1u) {
        grank = grank * size[d] + coord[d];
        gsize *= size[d];
      }
    if (meta_group(out, (ml_group)g, gsize, grank) != 0) {
      ml_mesh_destroy(out);
      return -1;
    }
  }
  return 0;
}

/* ep against the mesh's world (ml_mesh_set_ep). */
static int ep_ok(const ml_mesh *m, int ep) {
  if (ep >= 1 && m->world_size % ep == 0) return 0;
  return ml_err("--ep (ep_size) %d: dp_replicate(%d) x dp_shard(%d) x cp(%d) x tp(%d) = %d ranks "
                "is not a multiple of it; expected ep >= 1 dividing the ranks (experts are split "
                "over ep ranks, the rest being ep_shard = ranks / ep)",
                ep, m->dp_replicate, m->dp_shard, m->cp, m->tp, m->world_size);
}

int ml_mesh_set_ep(ml_mesh *m, MPI_Comm base, int ep, ml_comm_factory make_comm, void *ctx) {
  ML_TRY(ep_ok(m, ep));
  if (ep == 1) return 0;
  ml_comm_factory make = make_comm ? make_comm : ml_comm_mpi_make;
  group_free(&m->groups[ML_GROUP_EP]);
  group_free(&m->groups[ML_GROUP_EP_SHARD]);
  /* (ep_shard, ep) row-major, ep fastest: an ep group is ep consecutive ranks, an ep_shard
   * group the ranks of one ep coordinate */
  ML_TRY(group_create(base, m->rank / ep, m->rank, ML_GROUP_EP, make, ctx,
                      &m->groups[ML_GROUP_EP]));
  return group_create(base, m->rank % ep, m->rank, ML_GROUP_EP_SHARD, make, ctx,
                      &m->groups[ML_GROUP_EP_SHARD]);
}

int ml_mesh_set_ep_meta(ml_mesh *m, int ep) {
  ML_TRY(ep_ok(m, ep));
  if (ep == 1) return 0;
  ML_TRY(meta_group(m, ML_GROUP_EP, ep, m->rank % ep));
  return meta_group(m, ML_GROUP_EP_SHARD, m->world_size / ep, m->rank / ep);
}

void ml_mesh_destroy(ml_mesh *m) {
  for (int g = 0; g < ML_GROUP_KINDS; g++) {
    ml_comm_destroy(m->groups[g].comm);
    ml_host_destroy(m->groups[g].host);
  }
  memset(m, 0, sizeof *m);
}

ml_comm *ml_mesh_comm(const ml_mesh *m, ml_group g) { return m->groups[g].comm; }
ml_host *ml_mesh_host(const ml_mesh *m, ml_group g) { return m->groups[g].host; }

void ml_mesh_stats_reset(ml_mesh *m) {
  for (int g = 0; g < ML_GROUP_KINDS; g++) ml_comm_stats_reset(m->groups[g].comm);
}

#include "parallel/mesh.h"

#include <string.h>

#include "comm/comm_mpi.h"
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
};

const char *ml_group_name(ml_group g) {
  static const char *names[ML_GROUP_KINDS] = {"world", "dp_replicate", "dp_shard", "cp",
                                              "tp",    "dp",           "dp_shard_cp", "dp_cp"};
  return g >= 0 && g < ML_GROUP_KINDS ? names[g] : "?";
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
  return rc;
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
  out->dp_replicate = dp_replicate;
  out->dp_shard = dp_shard;
  out->cp = cp;
  out->tp = tp;
  /* row-major coordinates: stride of each dimension, tp fastest */
  const int size[DIMS] = {dp_replicate, dp_shard, cp, tp};
  const int stride[DIMS] = {dp_shard * cp * tp, cp * tp, tp, 1};
  int coord[DIMS];
  for (int d = 0; d < DIMS; d++) coord[d] = r / stride[d] % size[d];
  out->dp_replicate_rank = coord[DIM_DPR];
  out->dp_shard_rank = coord[DIM_DPS];
  out->cp_rank = coord[DIM_CP];
  out->tp_rank = coord[DIM_TP];
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

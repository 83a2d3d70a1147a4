#include "parallel/mesh.h"

#include <mpi.h>
#include <string.h>

#include "comm/comm_mpi.h"
#include "common/status.h"

/* A counting comm over the ranks sharing `color` (key = world rank keeps
 * the mesh order inside the group). */
static int group_create(MPI_Comm base, int color, int rank, const char *name, ml_comm **out) {
  MPI_Comm sub;
  if (MPI_Comm_split(base, color, rank, &sub) != MPI_SUCCESS)
    return ml_err("MPI_Comm_split for mesh group '%s' failed", name);
  ml_comm *raw = NULL;
  int rc = ml_comm_mpi_create(sub, name, &raw);
  MPI_Comm_free(&sub);
  ML_TRY(rc);
  if (ml_comm_counting_create(raw, out)) {
    ml_comm_destroy(raw);
    return -1;
  }
  return 0;
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

int ml_mesh_create(MPI_Comm base, int dp_replicate, int dp_shard, int cp, int tp, ml_mesh *out) {
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
  out->tp_rank = r % tp;
  out->cp_rank = (r / tp) % cp;
  out->dp_shard_rank = (r / (tp * cp)) % dp_shard;
  out->dp_replicate_rank = r / (tp * cp * dp_shard);
  /* Colors: the coordinates that stay fixed inside each group. */
  int tp_color = r / tp;
  int dps_color = out->dp_replicate_rank * (cp * tp) + out->cp_rank * tp + out->tp_rank;
  int dp_color = out->cp_rank * tp + out->tp_rank;
  int dpr_color = out->dp_shard_rank * (cp * tp) + dp_color;
  if (group_create(base, 0, r, "world", &out->world) || group_create(base, tp_color, r, "tp", &out->tp_comm) ||
      group_create(base, dps_color, r, "dp_shard", &out->dp_shard_comm) ||
      group_create(base, dp_color, r, "dp", &out->dp_comm) ||
      group_create(base, dpr_color, r, "dp_replicate", &out->dp_replicate_comm)) {
    ml_mesh_destroy(out);
    return -1;
  }
  return 0;
}

void ml_mesh_destroy(ml_mesh *m) {
  ml_comm_destroy(m->world);
  ml_comm_destroy(m->tp_comm);
  ml_comm_destroy(m->dp_shard_comm);
  ml_comm_destroy(m->dp_comm);
  ml_comm_destroy(m->dp_replicate_comm);
  memset(m, 0, sizeof *m);
}

void ml_mesh_stats_reset(ml_mesh *m) {
  ml_comm_stats_reset(m->world);
  ml_comm_stats_reset(m->tp_comm);
  ml_comm_stats_reset(m->dp_shard_comm);
  ml_comm_stats_reset(m->dp_comm);
  ml_comm_stats_reset(m->dp_replicate_comm);
}

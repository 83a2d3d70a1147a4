/* An engine on a mesh, as the MPI tests open, step and inspect it. Include
 * after <cmocka.h> and <mpi.h> (failures go through fail_msg). */
#ifndef ML_ENGINE_RUN_H
#define ML_ENGINE_RUN_H

#include <stdlib.h>

#include "common/status.h"
#include "train/engine.h"
#include "train/save.h"

typedef struct run {
  ml_mesh mesh;
  ml_engine e;
} run;

static inline int rank0(void) {
  int r;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r == 0;
}

/* The engine on checkpoint `dir` over a mesh of `base`: dp_replicate dpr,
 * tp, dp_shard inferred; opts NULL = ml_engine_opts_default(). */
static inline void run_open(run *r, MPI_Comm base, int dpr, int tp, const ml_engine_opts *opts,
                            const char *dir) {
  if (ml_mesh_create(base, dpr, 0, 1, tp, &r->mesh) || ml_engine_open(&r->e, &r->mesh, dir, opts))
    fail_msg("setup (%s, dp_replicate %d, tp %d): %s", dir, dpr, tp, ml_error_msg());
}

static inline void run_close(run *r) {
  ml_engine_close(&r->e);
  ml_mesh_destroy(&r->mesh);
}

/* Every parameter's global tensor (ml_engine_export), in export order. */
static inline float **export_all(run *r, ml_export_what what) {
  float **t = calloc((size_t)r->e.model.n_params, sizeof *t);
  if (ml_engine_export(&r->e, what, t)) fail_msg("export: %s", ml_error_msg());
  return t;
}

static inline void free_all(float **t, int n) {
  for (int i = 0; i < n; i++) free(t[i]);
  free(t);
}

#endif

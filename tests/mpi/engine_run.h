/* An engine on a mesh, as the MPI tests open, step and inspect it. Include
 * after <cmocka.h> and <mpi.h> (failures go through fail_msg). Runs and
 * exported tensors are held (held.h) until closed or freed, so a failed
 * assertion's teardown releases them. */
#ifndef ML_ENGINE_RUN_H
#define ML_ENGINE_RUN_H

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "held.h"
#include "tol_config.h"
#include "engine/engine.h"
#include "ckpt/save.h"

typedef struct run {
  ml_mesh mesh;
  ml_engine e;
} run;

static inline int rank0(void) {
  int r;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r == 0;
}

/* Both close functions accept the zeroed or partly built state a failed
 * open leaves. */
static inline void run_release(void *p) {
  run *r = p;
  ml_engine_close(&r->e);
  ml_mesh_destroy(&r->mesh);
}

/* The engine on checkpoint `dir` over a mesh of `base`: dp_replicate dpr,
 * cp, tp, dp_shard inferred; opts NULL = ml_engine_opts_default(); the
 * mesh's data comms from make_comm(ctx, ...) (parallel/mesh.h; NULL: MPI);
 * expert parallelism of degree ep (ml_mesh_set_ep) before the engine opens. */
static inline void run_open_ep(run *r, MPI_Comm base, int dpr, int cp, int tp, int ep,
                               const ml_engine_opts *opts, const char *dir,
                               ml_comm_factory make_comm, void *ctx) {
  memset(r, 0, sizeof *r);
  hold(r, run_release);
  if (ml_mesh_create(base, dpr, 0, cp, tp, make_comm, ctx, &r->mesh) ||
      ml_mesh_set_ep(&r->mesh, base, ep, make_comm, ctx) ||
      ml_engine_open(&r->e, &r->mesh, dir, opts))
    fail_msg("setup (%s, dp_replicate %d, cp %d, tp %d, ep %d): %s", dir, dpr, cp, tp, ep,
             ml_error_msg());
}

/* run_open_ep without expert parallelism. */
static inline void run_open_mesh(run *r, MPI_Comm base, int dpr, int cp, int tp,
                                 const ml_engine_opts *opts, const char *dir,
                                 ml_comm_factory make_comm, void *ctx) {
  run_open_ep(r, base, dpr, cp, tp, 1, opts, dir, make_comm, ctx);
}

/* run_open_mesh without context parallelism. */
static inline void run_open_comm(run *r, MPI_Comm base, int dpr, int tp,
                                 const ml_engine_opts *opts, const char *dir,
                                 ml_comm_factory make_comm, void *ctx) {
  run_open_mesh(r, base, dpr, 1, tp, opts, dir, make_comm, ctx);
}

/* run_open_comm with the MPI comms. */
static inline void run_open(run *r, MPI_Comm base, int dpr, int tp, const ml_engine_opts *opts,
                            const char *dir) {
  run_open_comm(r, base, dpr, tp, opts, dir, NULL, NULL);
}

static inline void run_close(run *r) {
  unhold(r);
  run_release(r);
}

/* Every parameter's global tensors (host memory of the engine's backend),
 * in export order, with their count and backend in front so that the
 * teardown can free them. */
typedef struct exported {
  ml_backend *be;
  int n;
  float *t[];
} exported;

static inline void exported_release(void *p) {
  exported *x = p;
  for (int i = 0; i < x->n; i++) ml_be_host_free(x->be, x->t[i]);
  free(x);
}

/* Every parameter's global tensor (ml_engine_export), in export order. */
static inline float **export_all(run *r, ml_export_what what) {
  int n = r->e.model.n_params;
  exported *x = calloc(1, sizeof *x + sizeof(float *) * (size_t)n);
  if (!x) fail_msg("export: out of memory");
  x->be = r->e.be;
  x->n = n;
  hold(x, exported_release);
  if (ml_engine_export(&r->e, what, x->t)) fail_msg("export: %s", ml_error_msg());
  return x->t;
}

/* Free what export_all returned. */
static inline void free_all(float **t) {
  exported *x = (exported *)(void *)((char *)t - offsetof(exported, t));
  unhold(x);
  exported_release(x);
}

/* The sizes section 3 of tolerance.h counts for this run's model, with S
 * keys per query and T token rows in the batch. */
static inline tol_model tol_model_of(const run *r, int64_t S, int64_t T) {
  return tol_model_of_config(&r->e.model.cfg, S, T);
}

#endif

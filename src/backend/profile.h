/* The operator profile: where a step's time goes, per backend operator,
 * on any backend (the table issue 29's tuning pass reads: GEMMs by shape,
 * attention, loss, elementwise, optimizer, copies).
 *
 * Off unless the environment sets MESHLM_OP_PROFILE=1 (read once). When on,
 * every ml_be_* operator, copy, zero, conversion and sync (backend.c) marks
 * a boundary: the device is synchronized (ml_be_sync) and the wall time
 * since the previous boundary is charged to the previous operator's class.
 * A class's time is thus its device time plus the host work until the next
 * operator starts (launch overhead, host-side logic, collectives issued in
 * between on meshes of several ranks), with no overlap between operators:
 * the synchronizations serialize the stream, so a profiled step is slower
 * than an unprofiled one — the shares are the figure, not the total. As
 * torch.profiler's per-operator table with CUDA_LAUNCH_BLOCKING=1.
 * Each training step restarts the profile (ml_step_run), so the table is
 * that of the last step (and what ran after it), model loading and earlier
 * steps left out. Generation marks its host work between operators as
 * classes of their own ("generate: sampling (host)", "generate:
 * scheduling (host)": engine/generate.c), so it is not charged to the
 * operator before it. At process exit each rank prints it to stderr, heaviest
 * first: class, calls, total ms, mean µs per call, share of the profiled
 * time. */
#ifndef MESHLM_BACKEND_PROFILE_H
#define MESHLM_BACKEND_PROFILE_H

#include <stdbool.h>

struct ml_backend;

/* Whether MESHLM_OP_PROFILE=1 (the first call reads the environment). */
bool ml_be_profile_on(void);
/* A boundary before operator `name` (at most 63 characters kept) on be:
 * sync be, charge the time since the last boundary to the last name. */
void ml_be_profile_mark(struct ml_backend *be, const char *name);

/* Forget every class so far and start counting afresh from here (after
 * syncing be): the training step's start. */
void ml_be_profile_restart(struct ml_backend *be);

#endif

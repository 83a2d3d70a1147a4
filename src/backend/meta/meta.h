/* The meta backend: torch's "meta" device (FakeTensorMode) for meshlm. It
 * has the memory bookkeeping of a real backend and none of its work:
 * device allocations go through the same caching pool (backend/pool.h)
 * over a raw allocator that hands out addresses no one may dereference
 * (non-canonical on x86-64: a host access faults at once), and every
 * operator, copy and fill does nothing. Host staging is real memory; a
 * device-to-host copy fills it with zeros, so host code reads defined
 * values (loss 0, norms 0, no non-finite gradient).
 *
 * Running the engine's real step on it (with data comms that only count,
 * comm/comm_null.h) gives, without computing anything, exactly what the
 * step allocates (ml_be_memory_stats: the peak bytes of a 1-step run) and
 * the collectives it issues — as torch's FSDPMemTracker and CommDebugMode
 * run a model under FakeTensorMode (torch.distributed._tools). `meshlm
 * plan` predicts this way (engine/predict.h).
 *
 * Sizes a backend decides itself (the attention backward's workspace) are
 * those of the backend the meta device stands for (`like`). It implements
 * every operator (ml_be_supports) but varlen attention on a `like` without
 * it (ML_OP_ATTENTION_VARLEN: the model then runs a block per document, as
 * on `like`), and its device memory is not host memory
 * (ml_be_host_memory). */
#ifndef ML_BACKEND_META_H
#define ML_BACKEND_META_H

#include "backend/backend.h"

/* A meta backend standing for `like` (which must outlive it). Errors:
 * allocation. Free with ml_backend_meta_destroy. */
int ml_backend_meta_create(ml_backend *like, ml_backend **out);
void ml_backend_meta_destroy(ml_backend *be);

#endif

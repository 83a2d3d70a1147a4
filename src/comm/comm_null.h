/* The null comm: a group of `size` ranks, seen from `rank`, whose
 * collectives complete at once and move nothing. Under a counting comm
 * (comm.h) it records what a step would issue without other ranks: with
 * the meta backend (backend/meta/meta.h) `meshlm plan` runs the engine's
 * real step for one rank of a mesh that does not exist. Buffers are never
 * read or written (they may be meta addresses). */
#ifndef ML_COMM_NULL_H
#define ML_COMM_NULL_H

#include "comm/comm.h"

/* Errors: rank outside [0, size), allocation. */
int ml_comm_null_create(int rank, int size, const char *name, ml_comm **out);

#endif

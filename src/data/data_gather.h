/* The data loader's collectives over a group of ranks (data/data.h
 * ml_data_group): a one-rank group for a process alone, and an all-gather
 * of arrays of any size, cut into calls of at most the group's call_bytes. */
#ifndef ML_DATA_GATHER_H
#define ML_DATA_GATHER_H

#include <stddef.h>
#include <stdint.h>

#include "data/data.h"

/* g, or when NULL a group of this process alone (its gather a copy, its
 * agreement rc itself). */
const ml_data_group *ml_data_group_or_solo(const ml_data_group *g);

/* Collective: *all (malloc'd, at least 1 byte; free it) = every rank's
 * send[count · elem] in rank order, counts[q] = rank q's count (counts has
 * g->size entries), *total = their sum. Errors: allocation (every rank
 * agrees on the sizes, so each fails alike), the group's. */
int ml_data_gather(const ml_data_group *g, const void *send, int64_t count, size_t elem,
                   void **all, int64_t *counts, int64_t *total);

#endif

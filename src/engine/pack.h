/* Micro-batches of variable-length sequences, for scoring and training
 * (meshlm_logprobs, meshlm_train_step, `meshlm logprobs`): sequences
 * sorted by length and packed first-fit decreasing into rows of at most
 * `budget` tokens (a longer sequence alone), each row a batch of packed
 * documents (engine/engine.h ml_engine_batch.docs) — no padding inside a
 * row; where the engine cannot pack (context parallelism, a backend
 * without block attention) one sequence per micro-batch. Every rank runs
 * the same number of micro-batches (FSDP's collectives go in step): a rank
 * with fewer runs empty ones. Under vocab parallelism the ranks of FSDP's
 * group exchange tokens, so micro-batch j has the same length on every
 * rank (the longest), the shorter rows padded at the end. */
#ifndef ML_PACK_H
#define ML_PACK_H

#include "comm/host.h"
#include "engine/engine.h"

typedef struct ml_micro {
  int64_t first, count; /* sequences order[first .. first+count−1] */
  int64_t tokens;       /* theirs */
  int64_t S;            /* the row's length, >= tokens (padding after) */
} ml_micro;

typedef struct ml_pack {
  int64_t n;              /* sequences */
  const int64_t *lens;    /* [n] (the caller's) */
  const int32_t **ids;    /* [n] each sequence's tokens (the caller's memory) */
  int64_t *order;         /* [n] sequence indices, micro-batch by micro-batch */
  ml_micro *mb;           /* [n_mb] */
  int64_t n_mb;           /* the same on every rank (the empty ones at the end) */
  int64_t S_max;          /* the longest row */
  bool packed;
  /* one micro-batch's host buffers, [S_max] each (docs [max count + 1]) */
  int32_t *row;
  uint8_t *mask;
  int64_t *docs;
  ml_obj_in *obj;
  float *lp;
} ml_pack;

/* Plan the micro-batches of n sequences (lens [n], each >= 1; ids [n]
 * pointers to their tokens, kept by the caller while p is in use) of at
 * most `budget` tokens for engine e. Collective over `world` (the
 * engine's mesh ranks): the count and, under vocab parallelism, the
 * lengths are agreed. Allocates the buffers. Errors (every rank, agreed):
 * budget < 1, allocation. Free with ml_pack_free (also after an error). */
int ml_pack_plan(ml_pack *p, ml_engine *e, ml_host *world, int64_t n, const int64_t *lens,
                 const int32_t **ids, int64_t budget);
void ml_pack_free(ml_pack *p);

/* Micro-batch j as an engine batch in p's buffers: the row's tokens, the
 * documents (or none), mask 1 on every document token but the first of
 * each, padding 0. (obj is the caller's to fill: p->obj.) */
void ml_pack_fill(const ml_pack *p, int64_t j, ml_engine_batch *eb);

/* Reserve the longest row's activations (ml_engine_reserve) before any
 * micro-batch's collectives, so that every rank can agree on an
 * allocation failure; forward_only: scoring (ml_engine_reserve). No
 * collective. */
int ml_pack_reserve(const ml_pack *p, ml_engine *e, bool forward_only);

/* (A micro-batch's sequences sit in its row in order: sequence
 * order[first + i] begins at the sum of the lengths before it.) */

#endif

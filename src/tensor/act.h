/* A local activation view at a module edge: B sequences, s of the global S
 * positions and c of the global C features, row-major [B, s, c] (token
 * b·s + i in row b·s + i). Under Shard(1) s is this rank's torch.chunk of S;
 * under Shard(−1) c is its chunk of C; otherwise s = S, c = C. The buffer x
 * always has room for the unsharded B·S·C floats, so an edge may change s
 * and c in place (all-gather, reduce-scatter, slicing). */
#ifndef ML_ACT_H
#define ML_ACT_H

#include <stdint.h>

typedef struct ml_act {
  float *x;
  int64_t B;
  int64_t S, s; /* global / local sequence extent */
  int64_t C, c; /* global / local features */
} ml_act;

#endif

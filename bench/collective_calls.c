/* The time of one FSDP collective call as meshlm's MPI comm issues it
 * (comm/comm_mpi.c: MPI_Iallgather and MPI_Ireduce_scatter_block on fp32,
 * waited at once), for the sizes given: what one more or one fewer call
 * per step costs, the figure bench/lora_units.sh needs to price a change
 * of FSDP's units (LoRA adapters in their own units or in their layer's).
 * Figures for notes; nothing is asserted.
 *
 * usage: mpirun -np N collective_calls ITERS FLOATS...
 *   FLOATS: elements of one rank's shard (all-gather's send count,
 *   reduce-scatter's receive count), each > 0.
 * Prints per size the median over ITERS calls (after 5 warm-up calls) of
 * the slowest rank's wall time of one call, in microseconds. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* one call of op (0: all-gather, 1: reduce-scatter) of n floats per rank */
static double one_call(int op, float *send, float *recv, int n) {
  MPI_Request r;
  MPI_Barrier(MPI_COMM_WORLD);
  double t0 = MPI_Wtime();
  if (op == 0)
    MPI_Iallgather(send, n, MPI_FLOAT, recv, n, MPI_FLOAT, MPI_COMM_WORLD, &r);
  else
    MPI_Ireduce_scatter_block(send, recv, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &r);
  MPI_Wait(&r, MPI_STATUS_IGNORE);
  double dt = MPI_Wtime() - t0, slowest;
  MPI_Allreduce(&dt, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return slowest;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, size;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  int iters = argc > 1 ? atoi(argv[1]) : 0;
  if (argc < 3 || iters < 1) {
    if (rank == 0) {
      if (argc < 3)
        fprintf(stderr, "usage: collective_calls ITERS FLOATS... (at least one FLOATS)\n");
      else
        fprintf(stderr, "collective_calls: ITERS '%s': expected an integer >= 1\n", argv[1]);
    }
    MPI_Finalize();
    return 2;
  }
  if (rank == 0) printf("%d ranks, median of %d calls, slowest rank\n", size, iters);
  for (int a = 2; a < argc; a++) {
    long n = atol(argv[a]);
    if (n < 1 || n > (1L << 28) / size) { /* the full buffer n·size floats stays < 1 GiB */
      if (rank == 0)
        fprintf(stderr, "FLOATS '%s': expected 1 .. %ld\n", argv[a], (1L << 28) / size);
      MPI_Finalize();
      return 2;
    }
    float *small = calloc((size_t)n, sizeof(float));
    float *full = calloc((size_t)n * (size_t)size, sizeof(float));
    double *t = malloc(sizeof(double) * (size_t)iters);
    if (!small || !full || !t) {
      fprintf(stderr, "out of memory for %ld floats x %d ranks\n", n, size);
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    for (int op = 0; op < 2; op++) {
      for (int i = 0; i < 5; i++)
        one_call(op, op ? full : small, op ? small : full, (int)n);
      for (int i = 0; i < iters; i++)
        t[i] = one_call(op, op ? full : small, op ? small : full, (int)n);
      qsort(t, (size_t)iters, sizeof(double), cmp_double);
      if (rank == 0)
        printf("%-15s %9ld floats/rank (%8.3f MiB full buffer): %9.1f us/call\n",
               op ? "reduce_scatter" : "all_gather", n, (double)n * size * 4 / 1048576.0,
               t[iters / 2] * 1e6);
    }
    free(small);
    free(full);
    free(t);
  }
  MPI_Finalize();
  return 0;
}

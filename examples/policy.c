/* The README's C example: a policy scored, trained one clipped
 * policy-gradient step and refitted through libmeshlm. Build:
 *   cc policy.c $(pkg-config --cflags --libs meshlm) -o policy
 * Run: ./policy MODEL_DIR   or   mpirun -np 2 ./policy MODEL_DIR */
#include <meshlm/meshlm_mpi.h> /* meshlm.h and meshlm_open on an MPI_Comm */
#include <stdio.h>

static int count(void *ctx, const char *name, meshlm_dtype dt, int ndim, const int64_t *shape,
                 const void *data, size_t nbytes) {
  *(size_t *)ctx += nbytes; /* a generation engine would load `data` as `name` here */
  return 0;
}

int main(int argc, char **argv) {
  meshlm_options o;
  meshlm_options_default(&o); /* one data-parallel rank per process; o.tp = 2 for TP */
  o.lr = 1e-4;
  meshlm_session *s;
  if (meshlm_open(argv[1], &o, MPI_COMM_WORLD, &s)) return fprintf(stderr, "%s\n", meshlm_error(s)), 1;
  int64_t lens[2] = {4, 6};                      /* two sequences, no padding */
  int32_t ids[10] = {1, 7, 42, 9, 1, 5, 5, 17, 3, 8};
  float old_lp[8], adv[2] = {1.0f, -1.0f};        /* [Σ (len − 1)] log-probs; per-sequence advantages */
  meshlm_seqs batch = {2, lens, ids};
  if (meshlm_logprobs(s, &batch, NULL, old_lp, NULL)) return fprintf(stderr, "%s\n", meshlm_error(s)), 1;
  meshlm_loss loss;
  meshlm_loss_default(&loss);
  loss.kind = MESHLM_LOSS_CLIPPED_PG;             /* NeMo RL ClippedPGLossFn, ε = 0.2 */
  meshlm_train_batch tb = {.struct_size = sizeof tb, .seqs = batch, .seq_weights = adv,
                           .old_logprobs = old_lp};
  meshlm_step_result r = {.struct_size = sizeof r}; /* what the library may write */
  if (meshlm_train_step(s, &tb, &loss, &r)) return fprintf(stderr, "%s\n", meshlm_error(s)), 1;
  size_t bytes = 0;                               /* refit: full weights to rank 0, no files */
  if (meshlm_refit(s, 0, MESHLM_DTYPE_BF16, count, &bytes)) return fprintf(stderr, "%s\n", meshlm_error(s)), 1;
  meshlm_info info = {.struct_size = sizeof info};
  meshlm_get_info(s, &info);
  if (info.rank == 0) printf("loss %.6f grad_norm %.6f refit %zu bytes\n", r.loss, r.grad_norm, bytes);
  meshlm_close(s);
  return meshlm_finalize();
}

/* Throughput of meshlm_logprobs (include/meshlm/meshlm.h) on random
 * variable-length sequences: N sequences of lengths uniform in [Lmin,
 * Lmax] and token ids uniform in [0, vocab_size) from --seed, dealt over
 * the data-parallel ranks as `meshlm logprobs` deals them (sorted by
 * length, round robin); one warm-up call, then --iters timed calls (each
 * between barriers, the slowest rank's time). Prints the median call's
 * tokens/s (token positions of all ranks / seconds), the micro-batches and
 * the FSDP all-gathers of the last call (meshlm_last_call_stats, rank 0),
 * the CPU time of a call (process CPU time summed over the ranks, mean of
 * the timed calls: the work, less sensitive than wall time to other load
 * on the machine), and one `RESULT key=value ...` line for scripts
 * (bench/api_logprobs.sh).
 * --dump FILE writes the sequences as JSONL {"input_ids": [...]} (rank 0),
 * the same the API scores, so that `meshlm logprobs --data FILE` can be
 * timed on them; --dump-only exits after that. Nothing is asserted.
 *
 * mpirun -np R bench_api_logprobs --model DIR [--n 32] [--min-len 16]
 *   [--max-len 512] [--seed 1] [--iters 3] [--micro-batch-tokens 4096]
 *   [--unshard 0|1] [--tp 1] [--bf16 0|1] [--dump FILE [--dump-only]]
 * --bf16 1 scores with param_dtype bf16 (meshlm logprobs --param-dtype bf16). */
#include <meshlm/meshlm_mpi.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct bench_args {
  const char *model, *dump;
  int64_t n, min_len, max_len, seed, iters, mbt, unshard, tp, dump_only, bf16;
} bench_args;

static int usage(const char *why) {
  fprintf(stderr,
          "bench_api_logprobs: %s\n"
          "usage: bench_api_logprobs --model DIR [--n N] [--min-len L] [--max-len L] [--seed S]\n"
          "       [--iters K] [--micro-batch-tokens T] [--unshard 0|1] [--tp N] [--bf16 0|1]\n"
          "       [--dump FILE [--dump-only]]\n",
          why);
  return 2;
}

static int parse(int argc, char **argv, bench_args *a) {
  *a = (bench_args){NULL, NULL, 32, 16, 512, 1, 3, 4096, 1, 1, 0, 0};
  struct {
    const char *flag;
    int64_t *v;
  } ints[] = {{"--n", &a->n},         {"--min-len", &a->min_len},
              {"--max-len", &a->max_len}, {"--seed", &a->seed},
              {"--iters", &a->iters}, {"--micro-batch-tokens", &a->mbt},
              {"--unshard", &a->unshard}, {"--tp", &a->tp},
              {"--bf16", &a->bf16}};
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--dump-only")) {
      a->dump_only = 1;
      continue;
    }
    if (i + 1 >= argc) return usage("a flag without its value");
    const char *v = argv[++i];
    if (!strcmp(argv[i - 1], "--model")) {
      a->model = v;
      continue;
    }
    if (!strcmp(argv[i - 1], "--dump")) {
      a->dump = v;
      continue;
    }
    int found = 0;
    for (size_t k = 0; k < sizeof ints / sizeof *ints; k++)
      if (!strcmp(argv[i - 1], ints[k].flag)) {
        char *end;
        *ints[k].v = strtoll(v, &end, 10);
        if (*end) return usage("an integer flag with a non-integer value");
        found = 1;
      }
    if (!found) return usage("unknown flag");
  }
  if (!a->model) return usage("--model is required");
  if (a->n < 1 || a->min_len < 2 || a->max_len < a->min_len || a->iters < 1 || a->mbt < 1 ||
      (a->unshard != 0 && a->unshard != 1) || a->tp < 1 || (a->bf16 != 0 && a->bf16 != 1))
    return usage("expected n >= 1, 2 <= min-len <= max-len, iters >= 1, micro-batch-tokens >= "
                 "1, unshard 0 or 1, tp >= 1, bf16 0 or 1");
  if (a->dump_only && !a->dump) return usage("--dump-only without --dump");
  return 0;
}

/* splitmix64: the same sequences on every rank and every run of a seed */
static uint64_t next(uint64_t *s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static const int64_t *g_lens;
static int by_length(const void *x, const void *y) {
  int64_t i = *(const int64_t *)x, j = *(const int64_t *)y;
  if (g_lens[i] != g_lens[j]) return g_lens[i] > g_lens[j] ? -1 : 1;
  return (i > j) - (i < j);
}

static double cpu_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *x, const void *y) {
  double a = *(const double *)x, b = *(const double *)y;
  return (a > b) - (a < b);
}

static int fail(meshlm_session *s, const char *what) {
  fprintf(stderr, "bench_api_logprobs: %s: %s\n", what, s ? meshlm_error(s) : "no session");
  meshlm_close(s);
  MPI_Abort(MPI_COMM_WORLD, 1);
  return 1;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, world;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  bench_args a;
  int rc = parse(argc, argv, &a);
  if (rc) {
    MPI_Finalize();
    return rc;
  }
  meshlm_options o;
  meshlm_options_default(&o);
  o.tp = (int)a.tp;
  o.micro_batch_tokens = a.mbt;
  o.unshard_for_inference = (int)a.unshard;
  if (a.bf16) o.param_dtype = MESHLM_DTYPE_BF16;
  meshlm_session *s = NULL;
  MPI_Barrier(MPI_COMM_WORLD);
  double t_open = MPI_Wtime();
  if (meshlm_open(a.model, &o, MPI_COMM_WORLD, &s)) return fail(s, "meshlm_open");
  MPI_Barrier(MPI_COMM_WORLD);
  t_open = MPI_Wtime() - t_open;
  meshlm_info info = {.struct_size = sizeof info};
  if (meshlm_get_info(s, &info)) return fail(s, "meshlm_get_info");

  /* the global sequences */
  int64_t n = a.n, total = 0;
  int64_t *lens = malloc(sizeof *lens * (size_t)n), *order = malloc(sizeof *order * (size_t)n);
  uint64_t st = (uint64_t)a.seed;
  for (int64_t k = 0; k < n; k++) {
    lens[k] = a.min_len + (int64_t)(next(&st) % (uint64_t)(a.max_len - a.min_len + 1));
    total += lens[k];
  }
  int32_t *ids = malloc(sizeof *ids * (size_t)total);
  if (!lens || !order || !ids) return fail(s, "out of memory");
  for (int64_t i = 0; i < total; i++) ids[i] = (int32_t)(next(&st) % (uint64_t)info.vocab_size);
  if (a.dump && rank == 0) {
    FILE *f = fopen(a.dump, "w");
    if (!f) return fail(s, "--dump: cannot open the file");
    for (int64_t k = 0, at = 0; k < n; at += lens[k++]) {
      fputs("{\"input_ids\": [", f);
      for (int64_t t = 0; t < lens[k]; t++) fprintf(f, t ? ", %d" : "%d", (int)ids[at + t]);
      fputs("]}\n", f);
    }
    if (fclose(f)) return fail(s, "--dump: write failed");
  }
  if (a.dump_only) {
    meshlm_close(s);
    MPI_Finalize();
    return 0;
  }

  /* this data-parallel rank's deal: by length, round robin (meshlm logprobs') */
  int64_t *start = malloc(sizeof *start * (size_t)n), mine = 0, mine_tokens = 0;
  for (int64_t k = 0, at = 0; k < n; at += lens[k++]) start[k] = at, order[k] = k;
  g_lens = lens;
  qsort(order, (size_t)n, sizeof *order, by_length);
  int64_t *my_lens = malloc(sizeof *my_lens * (size_t)n);
  int32_t *my_ids = malloc(sizeof *my_ids * (size_t)total);
  for (int64_t i = 0; i < n; i++) {
    int64_t k = order[i];
    if (i % info.dp_size != info.dp_rank) continue;
    memcpy(my_ids + mine_tokens, ids + start[k], sizeof *ids * (size_t)lens[k]);
    my_lens[mine++] = lens[k];
    mine_tokens += lens[k];
  }
  float *out = malloc(sizeof *out * (size_t)(mine_tokens > 0 ? mine_tokens : 1));
  meshlm_seqs q = {mine, my_lens, my_ids};

  /* warm-up, then the timed calls */
  if (meshlm_logprobs(s, &q, NULL, out, NULL)) return fail(s, "meshlm_logprobs (warm-up)");
  double *secs = malloc(sizeof *secs * (size_t)a.iters), cpu = 0;
  for (int64_t it = 0; it < a.iters; it++) {
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime(), c0 = cpu_now();
    if (meshlm_logprobs(s, &q, NULL, out, NULL)) return fail(s, "meshlm_logprobs");
    double dt = MPI_Wtime() - t0;
    cpu += cpu_now() - c0;
    MPI_Allreduce(&dt, &secs[it], 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  }
  MPI_Allreduce(MPI_IN_PLACE, &cpu, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  cpu /= (double)a.iters;
  meshlm_call_stats cs = {.struct_size = sizeof cs};
  if (meshlm_last_call_stats(s, &cs)) return fail(s, "meshlm_last_call_stats");
  int64_t mb_max = cs.micro_batches;
  MPI_Allreduce(MPI_IN_PLACE, &mb_max, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
  qsort(secs, (size_t)a.iters, sizeof *secs, cmp_double);
  double med = secs[a.iters / 2], best = secs[0];
  if (rank == 0) {
    printf("model %s: %lld layers, hidden %lld, vocab %lld; %d ranks (dp %d x tp %d)\n",
           a.model, (long long)info.num_layers, (long long)info.hidden_size,
           (long long)info.vocab_size, world, info.dp_size, info.tp);
    printf("%lld sequences of %lld..%lld tokens (seed %lld), %lld tokens; micro_batch_tokens %lld, "
           "unshard_for_inference %lld; open %.2f s\n",
           (long long)n, (long long)a.min_len, (long long)a.max_len, (long long)a.seed,
           (long long)total, (long long)a.mbt, (long long)a.unshard, t_open);
    printf("meshlm_logprobs: median %.3f s (best %.3f s of %lld) = %.1f tokens/s, CPU %.2f s per "
           "call (all ranks); rank 0: %lld micro-batches (max over ranks %lld), %lld tokens "
           "computed, %lld padding, fsdp_all_gathers %lld (%.1f MB)\n",
           med, best, (long long)a.iters, (double)total / med, cpu, (long long)cs.micro_batches,
           (long long)mb_max, (long long)cs.tokens, (long long)cs.padding,
           (long long)cs.fsdp_all_gathers, (double)cs.fsdp_bytes / 1e6);
    printf("RESULT world=%d dp=%d tp=%d unshard=%lld mbt=%lld tokens=%lld seconds=%.6f "
           "tokens_per_s=%.2f cpu_s=%.3f micro_batches=%lld fsdp_all_gathers=%lld open_s=%.3f "
           "bf16=%lld\n",
           world, info.dp_size, info.tp, (long long)a.unshard, (long long)a.mbt,
           (long long)total, med, (double)total / med, cpu, (long long)cs.micro_batches,
           (long long)cs.fsdp_all_gathers, t_open, (long long)a.bf16);
  }
  free(secs);
  free(out);
  free(my_ids);
  free(my_lens);
  free(start);
  free(ids);
  free(order);
  free(lens);
  meshlm_close(s);
  MPI_Finalize();
  return 0;
}

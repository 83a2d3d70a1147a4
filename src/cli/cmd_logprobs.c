/* meshlm logprobs: per-token log-probs of JSONL records (token ids, text,
 * or prompt + completion: train/data.h, tokenized as train tokenizes them)
 * with the vocab-parallel log-softmax (no rank holds full-vocab logits when
 * tp > 1). Sequences are dealt round-robin to the data-parallel ranks (the
 * cp ranks of one share its sequences, each scoring a piece: parallel/cp.h),
 * with every FSDP unit all-gathered once for the whole pass
 * (ml_engine_hold_params: the model's parameters held unsharded meanwhile);
 * rank 0 gathers and writes them in input order to a temp file renamed at
 * the end. One output line per record:
 *   {"logprobs": [S-1 floats]}                     input_ids records;
 *   + "input_ids": [S ids]                          text records (the ids scored);
 *   + "completion_logprobs": [...], "completion_logprob_sum": x,
 *     "prompt_tokens": P, "input_ids": [S ids]     prompt/completion records.
 * logprobs[t] = log p(token t+1 | tokens 0..t). The completion is tokens
 * P..S-1; completion_logprobs = logprobs[P-1 .. S-2] (each completion
 * token's log-prob; with P = 0 — an empty prompt and no BOS — its first
 * token has no context and is left out) and completion_logprob_sum their
 * sum in double: log p(completion | prompt), what an RL policy loss needs.
 * A non-finite log-prob (NaN or ±inf, from weights or activations that
 * overflowed) is written as JSON null, which every JSON reader accepts
 * (Python's json module reads it as None), and counted in one warning on
 * stderr naming the first line that has one; a sum over one is null. */
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "cli/device.h"
#include "cli/train_flags.h"
#include "common/file.h"
#include "common/status.h"
#include "train/data.h"
#include "train/engine.h"

typedef struct lp_run {
  ml_mesh *mesh;
  ml_engine *e;
  const ml_seqs *seqs;
  FILE *out; /* world rank 0 only */
  float *buf, *all;
  int64_t nonfinite, first_bad_line; /* written as null; its 1-based input line (0: none) */
} lp_run;

/* lp[0, n) as a JSON array; non-finite values as null, counted when
 * `count` (line: the 1-based output line). */
static void write_floats(lp_run *run, int64_t line, const float *lp, int64_t n, bool count) {
  FILE *f = run->out;
  fputc('[', f);
  for (int64_t t = 0; t < n; t++) {
    if (isfinite(lp[t])) {
      fprintf(f, "%s%.9g", t ? ", " : "", lp[t]);
      continue;
    }
    fprintf(f, "%snull", t ? ", " : "");
    if (count && run->nonfinite++ == 0) run->first_bad_line = line;
  }
  fputc(']', f);
}

/* The completion's fields of sequence k (prompt/completion records). */
static void write_completion(lp_run *run, int64_t k, const float *lp, int64_t n) {
  FILE *f = run->out;
  int64_t p = run->seqs->prompt_len[k], c0 = p > 0 ? p - 1 : 0;
  double sum = 0;
  for (int64_t t = c0; t < n; t++) sum += lp[t];
  fputs(", \"completion_logprobs\": ", f);
  write_floats(run, k + 1, lp + c0, n - c0, false);
  if (isfinite(sum))
    fprintf(f, ", \"completion_logprob_sum\": %.17g", sum);
  else
    fputs(", \"completion_logprob_sum\": null", f);
  fprintf(f, ", \"prompt_tokens\": %lld", (long long)p);
}

/* The output line of sequence k (0-based; line k + 1): its n = S-1 log-probs. */
static void write_line(lp_run *run, int64_t k, const float *lp, int64_t n) {
  FILE *f = run->out;
  fputs("{\"logprobs\": ", f);
  write_floats(run, k + 1, lp, n, true);
  if (run->seqs->format == ML_DATA_PROMPT) write_completion(run, k, lp, n);
  if (run->seqs->format != ML_DATA_IDS) {
    fputs(", \"input_ids\": [", f);
    for (int64_t t = 0; t < run->seqs->len[k]; t++)
      fprintf(f, "%s%d", t ? ", " : "", run->seqs->ids[k][t]);
    fputc(']', f);
  }
  fputs("}\n", f);
}

/* Round r: dp rank d scores sequence r·dp + d (or repeats the last one
 * when there is none, to keep FSDP's collectives in step); the round's
 * log-probs (host results) are gathered over the dp group's host channel,
 * each rank's S−1 values packed in rank order (ml_host_all_gather_v). */
static int score_round(lp_run *run, int64_t r) {
  ml_host *dp = ml_mesh_host(run->mesh, ML_GROUP_DP);
  int64_t n = run->seqs->n, mine = r * dp->size + dp->rank;
  int64_t i = mine < n ? mine : n - 1;
  int64_t S = run->seqs->len[i];
  ML_TRY(ml_engine_logprobs(run->e, run->seqs->ids[i], 1, S, run->buf));
  size_t bytes[1024];
  if (dp->size > 1024) return ml_err("logprobs: at most 1024 data-parallel ranks");
  for (int d = 0; d < dp->size; d++) {
    int64_t k = r * dp->size + d < n ? r * dp->size + d : n - 1;
    bytes[d] = sizeof(float) * (size_t)(run->seqs->len[k] - 1);
  }
  const float *got = run->buf;
  if (dp->size > 1) {
    ML_TRY(ml_host_all_gather_v(dp, run->buf, bytes, run->all));
    got = run->all;
  }
  for (int d = 0; run->out && d < dp->size && r * dp->size + d < n; d++) {
    write_line(run, r * dp->size + d, got, (int64_t)(bytes[d] / sizeof(float)));
    got += bytes[d] / sizeof(float);
  }
  return 0;
}

static int run_all(lp_run *run) {
  int64_t n = run->seqs->n, maxlen = 0, dp = run->mesh->groups[ML_GROUP_DP].size;
  for (int64_t i = 0; i < n; i++) maxlen = run->seqs->len[i] > maxlen ? run->seqs->len[i] : maxlen;
  run->buf = ml_malloc(sizeof(float) * (size_t)(maxlen * (dp + 1)), "log-probs");
  if (!run->buf) return -1;
  run->all = run->buf + maxlen;
  int rc = 0;
  /* every FSDP unit all-gathered once for the whole pass (NeMo RL's unshard_fsdp2_model) */
  ml_engine_hold_params(run->e, true);
  for (int64_t r = 0; rc == 0 && r * dp < n; r++) rc = score_round(run, r);
  ml_engine_hold_params(run->e, false);
  free(run->buf);
  return rc;
}

int ml_cmd_logprobs(ml_host *world, int argc, char **argv) {
  const char *model = NULL, *data = NULL, *out = NULL, *plan = NULL;
  int64_t tp = 1, cp = 1;
  bool sp = false;
  ml_arg_choice dtype = ml_dtype_choice(), device = ml_device_choice();
  ml_data_opts dopts = ml_data_opts_default(NULL);
  const ml_arg flags[] = {
      {"--model", ML_ARG_STR, &model, "HF checkpoint directory", true},
      {"--data", ML_ARG_STR, &data,
       "JSONL records: input_ids, text, or prompt + completion (one sequence each)", true},
      {"--out", ML_ARG_STR, &out,
       "output JSONL: {\"logprobs\": [S-1 floats]} per record (+ input_ids for text; + "
       "completion_logprobs, completion_logprob_sum, prompt_tokens, input_ids for "
       "prompt/completion)", true},
      {"--device", ML_ARG_CHOICE, &device, "where to compute (cuda: one GPU per rank)", false},
      {"--tp", ML_ARG_INT, &tp, "tensor-parallel size (dp_shard = world / (cp*tp))", false},
      {"--cp", ML_ARG_INT, &cp, "context-parallel size: cp ranks share each sequence", false},
      {"--sequence-parallel", ML_ARG_FLAG, &sp, "shard norms and residuals on the sequence", false},
      {"--parallel-plan", ML_ARG_STR, &plan, "plan file (JSON), or auto|optimized|hf|default",
       false},
      {"--param-dtype", ML_ARG_CHOICE, &dtype, "parameter and GEMM dtype (bf16: bf16 operands, "
       "fp32 accumulation)", false},
  };
  enum { N_FLAGS = sizeof flags / sizeof flags[0] };
  ml_arg spec[N_FLAGS + 3];
  memcpy(spec, flags, sizeof flags);
  size_t nspec = N_FLAGS + ml_data_key_flags(&dopts, spec + N_FLAGS);
  int rc = ml_cli_parse("logprobs", "per-token log-probs, log p(token t+1 | tokens <= t)", argc,
                        argv, spec, nspec);
  if (rc == 1) return 0;
  ml_mesh mesh = {0};
  ml_engine e = {0};
  ml_seqs seqs = {0};
  lp_run run = {&mesh, &e, &seqs, NULL, NULL, NULL, 0, 0};
  char tmp[4096];
  ml_engine_opts eo = ml_engine_opts_default();
  ml_comm_factory make_comm = NULL;
  void *comm_ctx = NULL;
  if (rc == 0) rc = ml_device_open("logprobs", &device, &eo.backend, &make_comm, &comm_ctx);
  if (rc == 0 && (tp < 1 || tp > INT32_MAX || cp < 1 || cp > INT32_MAX))
    rc = ml_err("logprobs: flags --tp %lld, --cp %lld: expected sizes >= 1", (long long)tp,
                (long long)cp);
  if (rc == 0)
    rc = ml_mesh_create(MPI_COMM_WORLD, 1, 0, (int)cp, (int)tp, make_comm, comm_ctx, &mesh);
  eo.parallel_plan = plan;
  eo.sequence_parallel = sp;
  eo.fsdp.param_dtype = ml_dtype_chosen(&dtype);
  if (rc == 0) rc = ml_engine_open(&e, &mesh, model, &eo);
  dopts.tokenizer_dir = model;
  if (rc == 0) rc = ml_seqs_load(data, e.model.cfg.vocab, e.model.cfg.max_positions, &dopts, &seqs);
  if (rc == 0 && mesh.rank == 0) rc = ml_file_open_tmp(out, tmp, sizeof tmp, &run.out);
  if (ml_cli_agree(world, rc) == 0) {
    rc = run_all(&run);
    if (run.out && rc == 0) rc = ml_file_commit(run.out, tmp, out);
    else if (run.out) ml_file_abandon(run.out, tmp);
    run.out = NULL;
    rc = ml_cli_agree(world, rc);
    if (rc == 0 && run.nonfinite > 0)
      ml_warn("logprobs: %lld log-probs are not finite (NaN or inf), the first on line %lld of "
              "%s; written as null",
              (long long)run.nonfinite, (long long)run.first_bad_line, out);
    if (rc == 0) ml_cli_print("logprobs: wrote %lld lines to %s\n", (long long)seqs.n, out);
  } else {
    rc = -1;
  }
  if (run.out) ml_file_abandon(run.out, tmp);
  ml_seqs_free(&seqs);
  ml_engine_close(&e);
  ml_mesh_destroy(&mesh);
  return rc;
}

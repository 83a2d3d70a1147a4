/* meshlm logprobs: per-token log-probs of JSONL records (token ids, text,
 * or prompt + completion: data/data.h, tokenized as train tokenizes them)
 * with the vocab-parallel log-softmax (no rank holds full-vocab logits when
 * tp > 1). Sequences are dealt to the data-parallel ranks by length (the
 * longest first, round-robin: like shares of tokens; the cp ranks of one
 * share its sequences, each scoring a piece: parallel/cp.h), packed into
 * micro-batches of --micro-batch-tokens without padding (engine/pack.h), with
 * every FSDP unit all-gathered once for the whole pass
 * (ml_engine_hold_params: the model's parameters held unsharded meanwhile);
 * the log-probs are all-gathered over the dp group and rank 0 writes them
 * in input order to a temp file renamed at the end. One output line per
 * record:
 *   {"logprobs": [S-1 floats]}                     input_ids records;
 *   + "input_ids": [S ids]                          text records (the ids scored);
 *   + "completion_logprobs": [...], "completion_logprob_sum": x,
 *     "prompt_tokens": P, "input_ids": [S ids]     prompt/completion records.
 * With --entropy, + "entropy": [S-1 floats], the entropy (nats) of each
 * position's whole next-token distribution; with --topk K, + "topk_ids":
 * [[K ids] x S-1] and "topk_logprobs": [[K floats] x S-1], each position's
 * K most probable next tokens, best first, equal logits by the lower id
 * (verl's calculate_entropy, NeMo RL's get_topk_logits; both computed
 * vocab-parallel, parallel/loss.h ml_loss_extra). With --routing (a
 * mixture-of-experts model), + "routing": [[[k experts] x num_hidden_layers]
 * x S], the experts each token's sparse layers chose, in torch.topk's order
 * (−1 at the dense layers): what meshlm_scores.routing returns and router
 * replay takes (model/moe.h, ml_model.route_record).
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
#include "cli/data_group.h"
#include "cli/device.h"
#include "cli/train_flags.h"
#include "common/checked.h"
#include "common/file.h"
#include "common/status.h"
#include "data/data.h"
#include "engine/engine.h"
#include "engine/pack.h"

typedef struct lp_run {
  ml_mesh *mesh;
  ml_engine *e;
  const ml_seqs *seqs;
  FILE *out; /* world rank 0 only */
  int64_t nonfinite, first_bad_line; /* written as null; its 1-based input line (0: none) */
  bool entropy; /* --entropy */
  int64_t topk; /* --topk (0: none) */
  int64_t route_k, route_cols; /* --routing: top_k, and int32 per token (layers · top_k); 0:
                                  none */
} lp_run;

/* 32-bit words per prediction in the results: the log-prob, the entropy,
 * the top-k log-probs and ids (moved between ranks as bytes). A
 * sequence's n predictions are stored as [n lp][n entropy][n·k top-k
 * log-probs][n·k top-k ids], then its n + 1 tokens' routing [(n + 1) ·
 * route_cols] (seq_words). */
static int64_t words(const lp_run *run) { return 1 + run->entropy + 2 * run->topk; }

/* 32-bit words of a sequence of len tokens in the results: its len − 1
 * predictions' words, then (--routing) its tokens' routing [len, cols]. */
static int64_t seq_words(const lp_run *run, int64_t len) {
  return (len - 1) * words(run) + len * run->route_cols;
}

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

/* The top-k fields of a sequence's n predictions: log-probs tlp and ids tid [n, k]. */
static void write_topk(lp_run *run, int64_t line, const float *tlp, const int32_t *tid,
                       int64_t n) {
  FILE *f = run->out;
  int64_t k = run->topk;
  fputs(", \"topk_ids\": [", f);
  for (int64_t t = 0; t < n; t++) {
    fputs(t ? ", [" : "[", f);
    for (int64_t c = 0; c < k; c++) fprintf(f, "%s%d", c ? ", " : "", tid[t * k + c]);
    fputc(']', f);
  }
  fputs("], \"topk_logprobs\": [", f);
  for (int64_t t = 0; t < n; t++) {
    fputs(t ? ", " : "", f);
    write_floats(run, line, tlp + t * k, k, false);
  }
  fputc(']', f);
}

/* The routing field of a sequence's len tokens: r [len, layers, k]. */
static void write_routing(lp_run *run, const int32_t *r, int64_t len) {
  FILE *f = run->out;
  int64_t k = run->route_k, layers = run->route_cols / k;
  fputs(", \"routing\": [", f);
  for (int64_t t = 0; t < len; t++) {
    fputs(t ? ", [" : "[", f);
    for (int64_t l = 0; l < layers; l++) {
      fputs(l ? ", [" : "[", f);
      for (int64_t c = 0; c < k; c++) fprintf(f, "%s%d", c ? ", " : "", *r++);
      fputc(']', f);
    }
    fputc(']', f);
  }
  fputc(']', f);
}

/* The output line of sequence k (0-based; line k + 1) from its results
 * (words(run) per prediction, n = S-1 predictions). */
static void write_line(lp_run *run, int64_t k, const float *lp, int64_t n) {
  FILE *f = run->out;
  fputs("{\"logprobs\": ", f);
  write_floats(run, k + 1, lp, n, true);
  if (run->entropy) {
    fputs(", \"entropy\": ", f);
    write_floats(run, k + 1, lp + n, n, false);
  }
  if (run->topk) {
    const float *tlp = lp + n * (1 + run->entropy);
    write_topk(run, k + 1, tlp, (const int32_t *)(tlp + n * run->topk), n);
  }
  if (run->route_cols) write_routing(run, (const int32_t *)(lp + n * words(run)), n + 1);
  if (run->seqs->format == ML_DATA_PROMPT) write_completion(run, k, lp, n);
  if (run->seqs->format != ML_DATA_IDS) {
    fputs(", \"input_ids\": [", f);
    for (int64_t t = 0; t < run->seqs->len[k]; t++)
      fprintf(f, "%s%d", t ? ", " : "", run->seqs->ids[k][t]);
    fputc(']', f);
  }
  fputs("}\n", f);
}

/* The deal: sequences sorted by length (longest first, then input
 * order), the i-th to data-parallel rank i mod dp, so every rank gets a
 * like share of tokens. mine[0 .. *n) = this rank's, by input index;
 * owner[k] its rank, at[k] its first float in that rank's results. */
static const int64_t *g_lens;
static int by_length(const void *a, const void *b) {
  int64_t i = *(const int64_t *)a, j = *(const int64_t *)b;
  if (g_lens[i] != g_lens[j]) return g_lens[i] > g_lens[j] ? -1 : 1;
  return (i > j) - (i < j);
}

typedef struct deal {
  int64_t *sorted, *mine, *owner, *at, n_mine;
  size_t *bytes; /* [dp] each rank's results */
} deal;

static int deal_out(const lp_run *run, int dp, int me, deal *d) {
  const ml_seqs *q = run->seqs;
  int64_t n = q->n;
  d->sorted = ml_malloc_array(4 * n, sizeof(int64_t), "the sequences' deal (%lld)", (long long)n);
  d->bytes = ml_calloc_array(dp, sizeof *d->bytes, "the sequences' deal");
  if (!d->sorted || !d->bytes) return -1;
  d->mine = d->sorted + n;
  d->owner = d->mine + n;
  d->at = d->owner + n;
  for (int64_t k = 0; k < n; k++) d->sorted[k] = k;
  g_lens = q->len;
  qsort(d->sorted, (size_t)n, sizeof *d->sorted, by_length);
  d->n_mine = 0;
  for (int64_t i = 0; i < n; i++) {
    int64_t k = d->sorted[i];
    int r = (int)(i % dp);
    d->owner[k] = r;
    d->at[k] = (int64_t)(d->bytes[r] / sizeof(float));
    d->bytes[r] += sizeof(float) * (size_t)seq_words(run, q->len[k]);
    if (r == me) d->mine[d->n_mine++] = k;
  }
  return 0;
}

static void deal_free(deal *d) {
  free(d->sorted);
  free(d->bytes);
}

/* Micro-batch j's results into `mine`: each sequence's words at d->at,
 * from the pack's log-probs, the extras `es` asked for and the packed
 * routing `route` [S, route_cols] (--routing; else NULL). */
static void keep(const lp_run *run, const deal *d, const ml_pack *p, int64_t j,
                 const int64_t *lens, const ml_engine_scores *es, const int32_t *route,
                 float *mine) {
  int64_t k = run->topk;
  for (int64_t i = 0, at = 0; i < p->mb[j].count; i++) {
    int64_t s = p->order[p->mb[j].first + i], n = lens[s] - 1;
    float *o = mine + d->at[d->mine[s]];
    memcpy(o, p->lp + at, sizeof(float) * (size_t)n);
    o += n;
    if (es->entropy) memcpy(o, es->entropy + at, sizeof(float) * (size_t)n), o += n;
    if (k) {
      memcpy(o, es->topk_logprobs + at * k, sizeof(float) * (size_t)(n * k));
      memcpy(o + n * k, es->topk_ids + at * k, sizeof(int32_t) * (size_t)(n * k));
      o += 2 * n * k;
    }
    int64_t c = run->route_cols;
    if (route) memcpy(o, route + at * c, sizeof(int32_t) * (size_t)(lens[s] * c));
    at += lens[s];
  }
}

/* Host buffers of the extras for micro-batches of S tokens (es->logprobs
 * the pack's). */
static int extras_alloc(const lp_run *run, int64_t S, ml_engine_scores *es) {
  int64_t n = ml_mul_sat(S, run->topk);
  es->topk = run->topk;
  if (run->entropy && !(es->entropy = ml_malloc_array(S, sizeof(float), "the entropies (%lld)",
                                                      (long long)S)))
    return -1;
  if (run->topk && !(es->topk_logprobs = ml_malloc_array(n, sizeof(float),
                                                         "the top-k log-probs (%lld)",
                                                         (long long)n)))
    return -1;
  if (run->topk && !(es->topk_ids = ml_malloc_array(n, sizeof(int32_t), "the top-k ids (%lld)",
                                                    (long long)n)))
    return -1;
  return 0;
}

/* The packed routing of micro-batches of S tokens (--routing: [S,
 * route_cols] int32; else *route stays NULL). */
static int route_alloc(const lp_run *run, int64_t S, int32_t **route) {
  if (!run->route_cols) return 0;
  int64_t n = ml_mul_sat(S, run->route_cols);
  *route = ml_malloc_array(n, sizeof(int32_t), "the routing (%lld tokens x %lld)", (long long)S,
                           (long long)run->route_cols);
  return *route ? 0 : -1;
}

/* Score this rank's sequences in packed micro-batches into `mine` (each
 * sequence's words at d->at), the parameters held unsharded for the
 * whole pass (NeMo RL's unshard_fsdp2_model). */
static int score_mine(lp_run *run, const deal *d, int64_t budget, float *mine) {
  const ml_seqs *q = run->seqs;
  int64_t n = d->n_mine;
  int64_t *lens = ml_malloc_array(n > 0 ? n : 1, sizeof *lens, "this rank's sequences");
  const int32_t **ids = ml_malloc_array(n > 0 ? n : 1, sizeof *ids, "this rank's sequences");
  int rc = lens && ids ? 0 : -1;
  for (int64_t i = 0; rc == 0 && i < n; i++) {
    lens[i] = q->len[d->mine[i]];
    ids[i] = q->ids[d->mine[i]];
  }
  ml_host *world = ml_mesh_host(run->mesh, ML_GROUP_WORLD);
  ml_pack p = {0};
  ml_engine_scores es = {0};
  int32_t *route = NULL;
  bool extra = run->entropy || run->topk;
  if (ml_host_agree(world, rc) == 0 && ml_pack_plan(&p, run->e, world, n, lens, ids, budget) == 0 &&
      ml_host_agree(world, ml_pack_reserve(&p, run->e, true)) == 0 &&
      ml_host_agree(world, extra ? extras_alloc(run, p.S_max, &es) : 0) == 0 &&
      ml_host_agree(world, route_alloc(run, p.S_max, &route)) == 0) {
    es.logprobs = p.lp;
    ml_engine_hold_params(run->e, true);
    for (int64_t j = 0; rc == 0 && j < p.n_mb; j++) {
      ml_engine_batch eb;
      ml_pack_fill(&p, j, &eb);
      /* the dense layers' entries stay −1 (the sparse ones are written by the forward) */
      for (int64_t i = 0; route && i < eb.S * run->route_cols; i++) route[i] = -1;
      run->e->model.route_record = route;
      if (extra ? ml_engine_scores_batch(run->e, &eb, &es)
                : ml_engine_logprobs_batch(run->e, &eb, p.lp))
        ml_cli_abort();
      run->e->model.route_record = NULL;
      keep(run, d, &p, j, lens, &es, route, mine);
    }
    ml_engine_hold_params(run->e, false);
  } else {
    rc = -1;
  }
  free(route);
  free(es.entropy);
  free(es.topk_logprobs);
  free(es.topk_ids);
  ml_pack_free(&p);
  free(lens);
  free(ids);
  return rc;
}

/* Score every sequence (each data-parallel rank its deal), gather the
 * log-probs over the dp group and write them in input order (rank 0). */
static int run_all(lp_run *run, int64_t budget) {
  const ml_seqs *q = run->seqs;
  ml_host *dp = ml_mesh_host(run->mesh, ML_GROUP_DP);
  deal d = {0};
  int rc = deal_out(run, dp->size, dp->rank, &d);
  size_t total = 0;
  for (int r = 0; rc == 0 && r < dp->size; r++) total += d.bytes[r];
  float *all = rc == 0 ? ml_malloc(total + sizeof(float), "the log-probs of every sequence") : NULL;
  float *mine = rc == 0 ? ml_malloc(d.bytes[dp->rank] + sizeof(float), "this rank's log-probs")
                        : NULL;
  if (rc == 0 && (!all || !mine)) rc = -1;
  if (ml_cli_agree(ml_mesh_host(run->mesh, ML_GROUP_WORLD), rc) == 0) rc = score_mine(run, &d, budget, mine);
  else rc = -1;
  if (rc == 0) rc = ml_host_all_gather_v(dp, mine, d.bytes, all);
  for (int64_t k = 0; rc == 0 && run->out && k < q->n; k++) {
    size_t off = 0;
    for (int r = 0; r < d.owner[k]; r++) off += d.bytes[r] / sizeof(float);
    write_line(run, k, all + off + d.at[k], q->len[k] - 1);
  }
  free(all);
  free(mine);
  deal_free(&d);
  return rc;
}

int ml_cmd_logprobs(ml_host *world, int argc, char **argv) {
  const char *model = NULL, *data = NULL, *out = NULL, *plan = NULL, *adapter = NULL,
             *fp32_params = NULL;
  int64_t tp = 1, cp = 1, budget = 4096, topk = 0;
  bool sp = false, entropy = false, invariant = false, routing = false;
  ml_arg_choice dtype = ml_dtype_choice(), device = ml_device_choice(),
                device_comm = ml_device_comm_choice();
  ml_data_opts dopts = ml_data_opts_default(NULL);
  const ml_arg flags[] = {
      {"--model", ML_ARG_STR, &model, "HF checkpoint directory", true, "DIR"},
      {"--data", ML_ARG_STR, &data,
       "JSONL records: input_ids, text, prompt + completion, or messages (one sequence "
       "each)", true,
       "FILE.jsonl"},
      {"--out", ML_ARG_STR, &out,
       "output JSONL: {\"logprobs\": [S-1 floats]} per record (+ input_ids for text; + "
       "completion_logprobs, completion_logprob_sum, prompt_tokens, input_ids for "
       "prompt/completion)", true, "FILE.jsonl"},
      {"--device", ML_ARG_CHOICE, &device, ml_device_help(), false, NULL},
      {"--device-comm", ML_ARG_CHOICE, &device_comm, ml_device_comm_help(), false, NULL},
      {"--tp", ML_ARG_INT, &tp, "tensor-parallel size (dp_shard = world / (cp*tp))", false, NULL},
      {"--cp", ML_ARG_INT, &cp, "context-parallel size: cp ranks share each sequence", false, NULL},
      {"--sequence-parallel", ML_ARG_FLAG, &sp, "shard norms and residuals on the sequence", false,
       NULL},
      {"--parallel-plan", ML_ARG_STR, &plan, "plan file (JSON), or auto|optimized|hf|default",
       false, "PLAN"},
      {"--micro-batch-tokens", ML_ARG_INT, &budget, "tokens per packed micro-batch and rank (a "
       "longer sequence is one of its own)", false, NULL},
      {"--param-dtype", ML_ARG_CHOICE, &dtype, "parameter and GEMM dtype (bf16: bf16 operands, "
       "fp32 accumulation)", false, NULL},
      {"--fp32-params", ML_ARG_STR, &fp32_params, ml_fp32_params_help, false, "PATTERNS"},
      {"--entropy", ML_ARG_FLAG, &entropy, "add \"entropy\": each position's next-token "
       "entropy (nats)", false, NULL},
      {"--topk", ML_ARG_INT, &topk, "add \"topk_ids\" and \"topk_logprobs\": each position's K "
       "most probable next tokens (0: none)", false, "K"},
      {"--routing", ML_ARG_FLAG, &routing, "add \"routing\": each token's experts per layer "
       "([S][num_hidden_layers][k], -1 at dense layers; mixture-of-experts models)", false,
       NULL},
      {"--batch-invariant", ML_ARG_FLAG, &invariant, "every token's log-prob the same bits in "
       "any batch, micro-batch, dp, cp or tp size (as meshlm train --batch-invariant)", false,
       NULL},
      {"--adapter", ML_ARG_STR, &adapter, "score the model with this PEFT LoRA adapter "
       "(adapter_config.json + adapter_model.safetensors)", false, "DIR"},
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
  lp_run run = {&mesh, &e, &seqs, NULL, 0, 0, entropy, topk, 0, 0};
  char tmp[4096];
  ml_engine_opts eo = ml_engine_opts_default();
  ml_comm_factory make_comm = NULL;
  void *comm_ctx = NULL;
  if (rc == 0)
    rc = ml_device_open("logprobs", &device, &device_comm, &eo.backend, &make_comm, &comm_ctx);
  if (rc == 0 && (tp < 1 || tp > INT32_MAX || cp < 1 || cp > INT32_MAX))
    rc = ml_err("logprobs: flags --tp %lld, --cp %lld: expected sizes >= 1", (long long)tp,
                (long long)cp);
  if (rc == 0)
    rc = ml_mesh_create(MPI_COMM_WORLD, 1, 0, (int)cp, (int)tp, make_comm, comm_ctx, &mesh);
  eo.parallel_plan = plan;
  eo.sequence_parallel = sp;
  eo.fsdp.param_dtype = ml_dtype_chosen(&dtype);
  eo.batch_invariant = invariant;
  eo.lora.adapter = adapter;
  eo.fp32_params = fp32_params;
  /* scoring never trains: no training state, and under bf16 the weights in bf16 alone
   * (parallel/fsdp.h inference_only; the same log-probs bit for bit) */
  eo.fsdp.inference_only = true;
  if (rc == 0) rc = ml_engine_open(&e, &mesh, model, &eo);
  if (rc == 0) ml_print_fp32_params("logprobs", &e, fp32_params);
  if (rc == 0 && (topk < 0 || topk > e.model.cfg.vocab))
    rc = ml_err("logprobs: flag --topk %lld: expected 0 .. vocab_size %lld", (long long)topk,
                (long long)e.model.cfg.vocab);
  if (rc == 0 && topk > 0 && cp > 1)
    rc = ml_err("logprobs: flag --topk %lld with --cp %lld: top-k under context parallelism is "
                "not implemented; expected --cp 1",
                (long long)topk, (long long)cp);
  if (rc == 0 && routing && e.model.cfg.n_experts == 0)
    rc = ml_err("logprobs: flag --routing: %s has no experts (num_experts 0); expected a "
                "mixture-of-experts model (qwen3_moe, qwen2_moe, mixtral)",
                e.model.cfg.family->architecture);
  if (rc == 0 && routing) {
    run.route_k = e.model.cfg.top_k;
    run.route_cols = ml_mul_sat(e.model.cfg.n_layers, e.model.cfg.top_k);
  }
  dopts.tokenizer_dir = model;
  ml_data_group group = ml_cli_data_group(world); /* every rank reads its part of --data */
  dopts.group = &group;
  bool opened = ml_cli_agree(world, rc) == 0; /* the load below is collective */
  rc = opened ? ml_seqs_load(data, e.model.cfg.vocab, ml_model_config_max_seq_len(&e.model.cfg),
                             &dopts, &seqs)
              : -1;
  if (rc == 0 && mesh.rank == 0) rc = ml_file_open_tmp(out, tmp, sizeof tmp, &run.out);
  if (opened && ml_cli_agree(world, rc) == 0) {
    rc = run_all(&run, budget);
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

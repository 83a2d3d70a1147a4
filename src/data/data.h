/* Training and scoring data: token sequences read from JSONL records or raw
 * text, tokenized in C where a record holds text (tokenizer/tokenizer.h,
 * the model directory's tokenizer.json).
 *
 * Training data is a fixed-shape table of sequences ([nseq, seq_len] token
 * ids, int32) with a loss mask ([nseq, seq_len], uint8): mask[t] = 1 means
 * token t is a prediction target, predicted from tokens [0, t) — the HF
 * causal-LM convention (labels shifted by one inside the loss), so position
 * 0 of a row is never a target. Batches are a pure function of (step,
 * global batch, dp rank), so every rank computes its slice and the global
 * target count without communication, and any dp size sees the same global
 * batch.
 *
 * JSONL (first non-whitespace byte of the file is '{'): each non-empty line
 * is one object, a record of one of four formats, chosen by the fields
 * present (input_ids first, then the text key, then the prompt/completion
 * keys, then "messages"); other fields are ignored. Every record of a file has the first
 * record's format (a record of another format is an error naming its line
 * and the first record's). Line numbers in messages are 1-based and count
 * empty lines.
 *  - token ids: "input_ids": [int, ...] in [0, vocab_size), at least one;
 *    "loss_mask": [0|1|bool, ...] optional, the length of input_ids,
 *    loss_mask[t] applying to token t (absent: every token a target).
 *  - text: "text": "..." (key: ml_data_opts.text_key). The document's
 *    tokens are encode(text, add_special = true) — the tokenizer.json
 *    post-processor's template, BOS where it puts one, as transformers'
 *    tokenizer(text) — then EOS when the template does not end with it and
 *    the tokenizer has one (so documents are separated by EOS, as NeMo's
 *    GPTSFTDataset with add_eos and Megatron's EOD between documents). Every
 *    token is a target.
 *  - prompt/completion: "prompt": "...", "completion": "..." (keys:
 *    prompt_key, completion_key; both required). Tokens: encode(prompt,
 *    add_special = true) without the EOS a template may end with, then
 *    encode(completion, add_special = false), then EOS when the tokenizer
 *    has one. Prompt and completion are tokenized apart (as NeMo's
 *    GPTSFTDataset: context_ids + answer_ids), so the boundary is exact.
 *    Targets: the completion's tokens (its EOS included) only — NeMo SFT's
 *    answer-only loss.
 *  - messages: "messages": [{"role": "...", "content": "..."}, ...] and an
 *    optional "tools" list (TRL's and NeMo RL's conversational format;
 *    content a string or a list of {"type": "text", "text": ...} parts).
 *    The conversation rendered with the model's chat template
 *    (data/data_chat.h: chat_template.jinja or tokenizer_config.json's, in
 *    the context of transformers' apply_chat_template, add_generation_prompt
 *    false), then encode(rendering, add_special = false) — the ids of
 *    apply_chat_template(tokenize=True). Targets: the tokens overlapping
 *    the assistant turns' text ({% generation %} blocks, else each
 *    assistant message's text after the generation prompt) — TRL's
 *    assistant_only_loss; every token with
 *    ml_data_opts.assistant_only_loss false.
 * A text, prompt/completion or messages record needs tokenizer.json in
 * ml_data_opts.tokenizer_dir (and a messages record a chat template
 * there); token ids it yields must lie in [0, vocab_size).
 *
 * Raw text (anything else): with a tokenizer.json, the file is one text
 * document (tokens and EOS as a text record; valid UTF-8 required). Without
 * one, the file's bytes are the token ids (byte-level vocabulary, so
 * vocab_size >= 256) — never with a tokenizer.json, which would train a
 * model on ids its tokenizer never produces. */
#ifndef ML_DATA_H
#define ML_DATA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The format of a data file's records. */
typedef enum ml_data_format {
  ML_DATA_IDS,      /* JSONL "input_ids" [+ "loss_mask"] */
  ML_DATA_TEXT,     /* JSONL text records */
  ML_DATA_PROMPT,   /* JSONL prompt/completion records */
  ML_DATA_CHAT,     /* JSONL "messages" records, rendered with the chat template */
  ML_DATA_RAW,      /* raw text, tokenized with tokenizer.json */
  ML_DATA_RAW_BYTES /* raw text, bytes as ids (no tokenizer.json) */
} ml_data_format;

/* A few words naming a format for messages: "input_ids", "text",
 * "prompt/completion", "messages", "raw text, tokenized", "raw text, bytes
 * as token ids". */
const char *ml_data_format_name(ml_data_format f);

/* The ranks that load a data file together (every rank of the run): each
 * reads and tokenizes only its part of a JSONL file (data/data_split.h:
 * contiguous byte ranges cut at line starts), and the parts' records are
 * then all-gathered, so every rank holds the dataset a single-rank load
 * gives, bitwise (rows, masks, counts), and fails with the message a
 * single-rank load gives (the first failing line's: the lowest failing
 * rank's, whose part holds the lowest lines). Raw text (one document) is
 * read and tokenized whole by every rank. The data layer does no
 * communication of its own: the caller passes its collectives
 * (cli/data_group.h: the CLI's host channel over MPI). */
typedef struct ml_data_group {
  int rank, size; /* this rank in [0, size) */
  void *ctx;      /* the callbacks' */
  /* Collective: recv = every rank's send[bytes[rank]] in rank order, packed
   * (bytes[size] the same array on every rank; MPI_Allgatherv). The loader
   * keeps each call's sum below call_bytes. */
  int (*all_gather_v)(void *ctx, const void *send, const size_t *bytes, void *recv);
  size_t call_bytes; /* the most bytes one all_gather_v call moves, all ranks together (more
                        go in rounds); 0: 2^30 (MPI's int counts) */
  /* Collective: 0 when rc == 0 on every rank, else −1 on every rank, each
   * then holding the lowest failing rank's message (comm/host.h
   * ml_host_agree). */
  int (*agree)(void *ctx, int rc);
} ml_data_group;

/* How records are read. */
typedef struct ml_data_opts {
  const char *tokenizer_dir;  /* where tokenizer.json is looked for: the --model directory */
  const char *text_key;       /* "text" */
  const char *prompt_key;     /* "prompt" */
  const char *completion_key; /* "completion" */
  bool packing;               /* training: text documents packed into windows (true) */
  bool assistant_only_loss;   /* messages records: only the assistant turns are targets (true),
                                 else every token (TRL's assistant_only_loss) */
  const ml_data_group *group; /* the ranks loading together; NULL: this process alone */
} ml_data_opts;

/* The defaults above, over tokenizer_dir `dir`. */
ml_data_opts ml_data_opts_default(const char *dir);

typedef struct ml_dataset {
  int64_t nseq;    /* number of sequences (rows) */
  int64_t seq_len; /* tokens per row */
  int32_t *ids;    /* [nseq, seq_len], padding id 0 */
  uint8_t *mask;   /* [nseq, seq_len], 1 = target, 0 = not (incl. padding) */
  ml_data_format format;
  int64_t records; /* JSONL records read (1 for raw text) */
  int64_t tokens;  /* tokens of every record (before truncation) */
  bool packed;     /* rows are windows over the concatenated records */
} ml_dataset;

/* Load `path` into `out` (zeroed on entry; free with ml_dataset_free).
 * seq_len >= 2, vocab_size >= 1. Rows:
 *  - token ids, prompt/completion and messages records: one row per record,
 *    truncated to seq_len (ids and targets alike; the completion's tail
 *    first) or padded with id 0 and mask 0; NeMo's SFT datasets unpacked.
 *  - text records with opts->packing (the default) and raw text: the
 *    documents' tokens concatenated in file order (EOS between documents,
 *    as above) and cut into consecutive non-overlapping windows of seq_len
 *    tokens, as transformers' run_clm group_texts and NeMo's packed
 *    sequences; a tail window of at least 2 tokens is padded, a 1-token
 *    tail dropped. A window's tokens attend to every earlier token of the
 *    window, across document boundaries (Megatron's default
 *    reset_attention_mask=False; NeMo's packed SFT instead limits
 *    attention to each document with cu_seqlens, which this engine does
 *    not).
 *  - text records without opts->packing: one document per row, truncated
 *    or padded as above.
 * mask[t] = 1 where token t is a target of its record (above) and t is not
 * the row's first position (it has no context in the row).
 * Errors (file named; line and field for a record): seq_len/vocab_size out
 * of range, file unreadable, raw text bytes with vocab_size < 256, raw text
 * not UTF-8 (with a tokenizer), no sequences; invalid JSON or not an
 * object; none of the format fields; input_ids not an array of ids in
 * [0, vocab_size) or empty (index, value, vocab named), loss_mask not an
 * array of 0/1/bools of input_ids' length; a text, prompt or completion
 * field not a string, a prompt without a completion or the reverse; a
 * record that tokenizes to no token; a token id >= vocab_size; a record of
 * another format than the file's first; a text record without
 * tokenizer.json (the missing file named) or a tokenizer.json that does
 * not load (its message); a messages record's errors (data/data_chat.h:
 * no chat template, a malformed message named by index and field, the
 * template's render error, a template breaking the prefix rule).
 * Collective over opts->group's ranks (ml_data_group above), when set. */
int ml_dataset_load(const char *path, int64_t seq_len, int64_t vocab_size,
                    const ml_data_opts *opts, ml_dataset *out);
void ml_dataset_free(ml_dataset *ds);

/* Copy dp rank `dp_rank`'s slice of the global batch of `step` (0-based)
 * into ids/mask, each [global_batch / dp_size, seq_len]. The global batch of
 * step k is sequences (k*global_batch + i) mod nseq for i in
 * [0, global_batch) (wrapping around the dataset, so epochs blend into one
 * another); rank r gets i in [r*B/dp, (r+1)*B/dp), B = global_batch.
 * Errors: step < 0, global_batch < 1, dp_size < 1, dp_rank outside
 * [0, dp_size), global_batch not divisible by dp_size. */
int ml_dataset_batch(const ml_dataset *ds, int64_t step, int64_t global_batch, int64_t dp_rank,
                     int64_t dp_size, int32_t *ids, uint8_t *mask);

/* Number of targets (mask = 1) in the whole global batch of `step`: the
 * denominator of the mean token loss (torch cross_entropy reduction="mean"
 * over the global batch), the same on every rank. Returns -1 (with a
 * message) when step < 0 or global_batch < 1. */
int64_t ml_dataset_count_targets(const ml_dataset *ds, int64_t step, int64_t global_batch);

/* Variable-length sequences for scoring (log-probs): ids[i] has len[i]
 * tokens, no padding. */
typedef struct ml_seqs {
  int64_t n;             /* number of sequences */
  int64_t *len;          /* [n] */
  int32_t **ids;         /* [n][len[i]] */
  int64_t *prompt_len;   /* [n]: prompt/completion records: the prompt's tokens; else 0 */
  ml_data_format format; /* of every record: ML_DATA_IDS, _TEXT, _PROMPT or _CHAT */
} ml_seqs;

/* Load a JSONL file of records (the formats above; loss_mask ignored), one
 * sequence per record with the tokens train builds from it, never
 * truncated: at least 2 and at most max_len tokens (the model's
 * max_position_embeddings; log-probs score tokens 1..len-1). `out` is
 * zeroed on entry; free with ml_seqs_free. Errors: those of the records
 * above (file, line, field), file unreadable, no sequences, fewer than 2
 * or more than max_len tokens (line, the field, the count,
 * max_position_embeddings). Collective over opts->group's ranks, when
 * set. */
int ml_seqs_load(const char *path, int64_t vocab_size, int64_t max_len, const ml_data_opts *opts,
                 ml_seqs *out);
void ml_seqs_free(ml_seqs *s);

#endif

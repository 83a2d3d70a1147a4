/* Training and scoring data: token sequences read from JSONL or raw text.
 *
 * Training data is a fixed-shape table of sequences ([nseq, seq_len] token
 * ids, int32) with a loss mask ([nseq, seq_len], uint8): mask[t] = 1 means
 * token t is a prediction target, predicted from tokens [0, t) — the HF
 * causal-LM convention (labels shifted by one inside the loss), so position
 * 0 is never a target. Batches are a pure function of (step, global batch,
 * dp rank), so every rank computes its slice and the global target count
 * without communication, and any dp size sees the same global batch.
 *
 * JSONL format (first non-whitespace byte of the file is '{'): each
 * non-empty line is an object with
 *   "input_ids": [int, ...]     ids in [0, vocab_size), at least one;
 *   "loss_mask": [0|1|bool, ...] optional, same length as input_ids;
 *                                loss_mask[t] applies to token t.
 * Other fields are ignored. Line numbers in messages are 1-based and count
 * empty lines. Raw text format (anything else): the file's bytes are the
 * token ids (byte-level vocabulary, so vocab_size >= 256). */
#ifndef ML_DATA_H
#define ML_DATA_H

#include <stdint.h>

typedef struct ml_dataset {
  int64_t nseq;    /* number of sequences (rows) */
  int64_t seq_len; /* tokens per row */
  int32_t *ids;    /* [nseq, seq_len], padding id 0 */
  uint8_t *mask;   /* [nseq, seq_len], 1 = target, 0 = not (incl. padding) */
} ml_dataset;

/* Load `path` into `out` (zeroed on entry; free with ml_dataset_free).
 * seq_len >= 2, vocab_size >= 1.
 * JSONL: one row per non-empty line; rows longer than seq_len are truncated
 * (ids and mask alike), shorter ones padded with id 0 and mask 0. Without
 * loss_mask every real token but position 0 is a target; with it, the mask
 * is copied and position 0 is forced to 0.
 * Raw text: consecutive non-overlapping windows of seq_len bytes; a tail
 * window of at least 2 bytes is padded, a 1-byte tail dropped; targets are
 * every real token but the window's first.
 * Errors: seq_len/vocab_size out of range, file unreadable, raw text with
 * vocab_size < 256, no sequences, invalid JSON or not an object (line),
 * missing/non-array/empty input_ids (line), id not an integer or out of
 * [0, vocab_size) (line, index, value, vocab), loss_mask not an array of
 * 0/1/bools or of a different length than input_ids (line). */
int ml_dataset_load(const char *path, int64_t seq_len, int64_t vocab_size, ml_dataset *out);
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
  int64_t n;      /* number of sequences */
  int64_t *len;   /* [n] */
  int32_t **ids;  /* [n][len[i]] */
} ml_seqs;

/* Load a JSONL file whose non-empty lines each carry "input_ids" (ids in
 * [0, vocab_size), at least 2 and at most max_len of them — the model's
 * max_position_embeddings; log-probs score tokens 1..len-1); other fields,
 * loss_mask included, are ignored. `out` is zeroed on entry; free with
 * ml_seqs_free. Errors: file unreadable, no sequences, invalid JSON or not
 * an object (line), missing/non-array input_ids (line), fewer than 2 or
 * more than max_len tokens (line, the count, max_position_embeddings), id
 * not an integer or out of range (line, index, value, vocab). */
int ml_seqs_load_jsonl(const char *path, int64_t vocab_size, int64_t max_len, ml_seqs *out);
void ml_seqs_free(ml_seqs *s);

#endif

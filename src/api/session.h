/* The library's session (include/meshlm/meshlm.h meshlm_session): the
 * engine over a mesh on the caller's communicator, the options, the
 * session's own error message, and the pieces every call shares — the
 * collective-order check, error capture, batch validation. Internal to
 * libmeshlm (src/api). */
#ifndef ML_API_SESSION_H
#define ML_API_SESSION_H

#include <stdbool.h>
#include <stddef.h>

#include "comm/host.h"
#include "common/status.h"
#include "meshlm/meshlm.h"
#include "parallel/mesh.h"
#include "engine/engine.h"
#include "engine/settings.h"

/* The collective calls, for the order check (their names: api_call_name). */
typedef enum {
  API_CALL_CLOSE = 1,
  API_CALL_LOGPROBS,
  API_CALL_TRAIN_STEP,
  API_CALL_SAVE,
  API_CALL_RESUME,
  API_CALL_EXPORT,
  API_CALL_REFIT,
  API_CALL_RELOAD,
  API_CALL_RELOAD_TENSORS,
  API_CALL_GENERATE,
  API_CALL_ZERO_GRAD,
  API_CALL_FORWARD_BACKWARD,
  API_CALL_OPTIMIZER_STEP,
  API_CALL_EVAL_LOSS,
  API_CALL_SET_REFERENCE,
  API_CALL_REFERENCE_LOGPROBS,
  API_CALL_SCORE,
  API_CALL_REFIT_LORA,
  API_CALL_EXPORT_MERGED,
  API_CALL_KINDS
} api_call;

/* What the forward_backward calls since meshlm_zero_grad added up
 * (api/steps.c): global sums, the same on every rank. */
typedef struct api_acc {
  double loss, kl;          /* the losses and their KL parts */
  double entropy;           /* with an entropy bonus: Σ w·H, normalised as the loss */
  double mult_err, gen_kl;  /* Σ over the metrics' targets of exp|gen − old| and k3(gen ‖ old) */
  int64_t trained, clipped; /* the objective's counts */
  int64_t tokens, sequences, metric_tokens; /* masked targets, sequences; of the metrics */
  int64_t oob, oob_of;      /* importance weights out of the truncation bounds, of how many */
  char skip[256];           /* "" or the first call's reason its loss was not finite */
} api_acc;

struct meshlm_session {
  bool open;                  /* opened successfully, not closed */
  int closed_by;              /* >= 0: the world rank that closed the session while this one
                                 made another collective call (api_enter): no collective can
                                 run any more, meshlm_close only frees; −1: none */
  char err[ML_ERROR_MSG_CAP]; /* the last error's message */
  MPI_Comm comm;              /* the caller's communicator, duplicated */
  ml_host *world;             /* host channel over it */
  ml_mesh mesh;
  ml_engine e;
  meshlm_options o;           /* as opened (device, plan, freeze and LoRA strings copied below) */
  char *device, *plan;
  char *freeze;               /* meshlm_options.freeze's copy, or NULL */
  char *lora_targets, *adapter; /* meshlm_options' LoRA strings' copies, or NULL */
  char *fp32_params;          /* meshlm_options.fp32_params's copy, or NULL */
  ml_train_settings set;      /* the options' engine and step settings (api/session.c's
                                 mapping; engine/settings.h) */
  int64_t steps;              /* trainer steps taken (the schedule's position; skipped ones
                                 included, as the CLI's) */
  int64_t version;            /* bumped whenever the weights change */
  char (*wnames)[sizeof((ml_param *)0)->name]; /* refit names (source layout), lazily */
  ml_dtype *wdtypes;                             /* their source dtypes */
  meshlm_call_stats last;     /* of the last logprobs / train_step (meshlm_last_call_stats) */
  /* the generation replica (api/generate.c): an engine on this rank alone */
  ml_mesh gen_mesh;
  ml_engine gen;
  bool gen_open;
  int64_t gen_version;        /* `version` it was refitted at */
  api_acc acc;                /* since meshlm_zero_grad (split steps) */
};

/* Begin a collective call: clears the session's message and checks that
 * every rank makes the same call (one all-gather of call ids over the
 * world). Errors (every rank): s NULL or not open, or closed by another
 * rank (no collective then: every rank sees its own), a rank calling
 * another collective — when that rank called meshlm_close, s->closed_by
 * records it on the others. */
int api_enter(meshlm_session *s, api_call call);

/* Record the current error (common/status.h) as s's message, clear it;
 * returns −1. A no-op returning 0 when rc == 0. */
int api_leave(meshlm_session *s, int rc);

/* Agree rc over the world (every rank −1 with the first failing rank's
 * message when any failed), then api_leave. */
int api_agree(meshlm_session *s, int rc);

/* A failure inside a computation's collectives, where the other ranks may
 * be waiting in one: print the message and MPI_Abort the communicator (as
 * the CLI does; the header says so). */
_Noreturn void api_abort(meshlm_session *s);

/* For the calls that are not collective: 0 when s is open, else −1 with
 * s's message (when s is not NULL) saying `call` needs an open session. */
int api_local(meshlm_session *s, const char *call);

/* The struct sizes the library takes (meshlm.h "Struct sizes"): from the
 * struct's minimum layout to its sizeof. API_MIN(T) is T's minimum. */
#define API_MIN_meshlm_options offsetof(meshlm_options, grad_norm_type)
#define API_MIN_meshlm_info offsetof(meshlm_info, max_seq_len)
#define API_MIN_meshlm_call_stats offsetof(meshlm_call_stats, nonfinite_logprobs)
#define API_MIN_meshlm_step_result offsetof(meshlm_step_result, nonfinite_param)
#define API_MIN_meshlm_loss offsetof(meshlm_loss, objective)
#define API_MIN_meshlm_train_batch offsetof(meshlm_train_batch, generation_logprobs)
#define API_MIN_meshlm_sampling offsetof(meshlm_sampling, n)
#define API_MIN_meshlm_weight sizeof(meshlm_weight)
#define API_MIN_meshlm_tensor sizeof(meshlm_tensor)
#define API_MIN_meshlm_scores sizeof(meshlm_scores)
#define API_MIN(T) API_MIN_##T

/* 0 when `size` (a caller's T.struct_size) is in [min, max], else the error
 * "call: T.struct_size N; expected min .. max (sizeof(T) of this library, 0.2.0)". */
int api_struct_size(const char *call, const char *type, size_t size, size_t min, size_t max);
#define API_STRUCT_SIZE(call, T, size) api_struct_size(call, #T, size, API_MIN(T), sizeof(T))

/* An input struct T at `in` (the caller's, struct_size checked) as this
 * library's T in *full: *def (T's defaults) with the caller's first
 * struct_size bytes over it; full->struct_size = sizeof(T). */
#define API_READ(call, T, in, def, full) \
  api_read_struct(call, #T, in, API_MIN(T), sizeof(T), def, full)
int api_read_struct(const char *call, const char *type, const void *in, size_t min, size_t max,
                    const void *def, void *full);

/* The caller's first out->struct_size bytes of an output struct T from
 * *full (its struct_size the caller's); the size checked first (nothing
 * written when it is out of range). */
#define API_WRITE(call, T, out, full) \
  api_write_struct(call, #T, out, API_MIN(T), sizeof(T), full)
int api_write_struct(const char *call, const char *type, void *out, size_t min, size_t max,
                     const void *full);

/* A *_init function (meshlm_options_init): the first `size` bytes of
 * *full (T's defaults) into out with struct_size = size, 0; a size out of
 * [min, max]: only struct_size written (when it fits), −1. */
int api_init_struct(void *out, size_t size, size_t min, size_t max, void *full);

/* Check a batch: n >= 0, lens and tokens given when n > 0, each length in
 * [1, max_position_embeddings] (min_len 2: at least one prediction),
 * every id in [0, vocab); *tokens_out = Σ lens, *preds = Σ (lens − 1).
 * `what` names the argument. No collective. */
int api_check_seqs(const meshlm_session *s, const meshlm_seqs *b, const char *what,
                   int64_t min_len, int64_t *tokens_out, int64_t *preds);

/* A prediction mask (NULL: all) of b's Σ (lens − 1) entries holds only 0
 * and 1 (torch bool masks; any other byte is refused rather than read as
 * true). `what` names the argument, e.g. "meshlm_logprobs: mask". Errors:
 * the first other value, with its sequence and prediction index. No
 * collective. */
int api_check_mask(const meshlm_seqs *b, const uint8_t *mask, const char *what);

/* The tp and cp ranks of one data-parallel rank pass the same batch:
 * compared by a hash of it over the tp and the cp groups. Collective. */
int api_check_replicas(meshlm_session *s, const meshlm_seqs *b, const char *what);

#endif

/* `meshlm plan`'s report of how the attention heads are split over tp
 * (parallel/tp.h ml_tp_heads): each tp rank's query and key/value heads,
 * the kv heads several ranks hold, and what those copies cost. */
#ifndef ML_PLAN_HEADS_H
#define ML_PLAN_HEADS_H

#include <jansson.h>
#include <stdbool.h>

#include "parallel/tp.h"

/* Whether `tp` (applied to m) splits the attention heads: q_proj sharded. */
bool ml_plan_heads_split(const ml_tp *tp, const ml_model *m);

/* Print the split (ml_cli_print): per tp rank "query heads a-b (n), kv
 * heads c-d (k)", then the shared kv heads with the parameters their extra
 * copies add per tp rank (k_proj and v_proj rows, biases included, all
 * layers) and their bytes in fp32. */
void ml_plan_heads_text(const ml_tp *tp, const ml_model *m);

/* The same as JSON: {"per_tp_rank": [{"q0", "query_heads", "kv0",
 * "kv_heads", "kv_owned", "kv_copy_params"}], "kv_shared": [heads],
 * "kv_copy_params": total, "kv_copy_bytes_fp32": total}. NULL when out of
 * memory. */
json_t *ml_plan_heads_json(const ml_tp *tp, const ml_model *m);

#endif

/* The HF export writer: a trained model's global tensors, streamed in one
 * at a time, written with the rest of its source model (ckpt/hf_source.h)
 * as an HF checkpoint directory that transformers' from_pretrained loads —
 * what save_pretrained of the fine-tuned model writes (HF
 * modeling_utils.save_pretrained: config.json, model.safetensors or shards
 * + model.safetensors.index.json above max_shard_size, tied copies
 * dropped), plus the tokenizer's and generation config's files as their
 * own save_pretrained writes them.
 *
 * With a source description:
 *  - config.json is the source's, architecture and every field kept, its
 *    "torch_dtype" / "dtype" (top level and in the text config; added as
 *    "torch_dtype" when it has neither) set to the trained tensors' dtype
 *    when they all have one;
 *  - the trained tensors are written under their source keys (a
 *    Gemma3ForConditionalGeneration's text tower as language_model.model.*)
 *    in the dtype `dtype` selects: SOURCE each its source tensor's dtype,
 *    F32 / BF16 all of them that one (fp32 → bf16 rounds to nearest even,
 *    torch's tensor.to(torch.bfloat16));
 *  - then every carried tensor, its bytes copied unchanged from the source
 *    directory's weights (which must still hold it, with the dtype and
 *    shape the description records);
 *  - the description's files are copied from `files_dir`.
 * Without one (a run checkpoint saved before meshlm recorded its source):
 * config.json of cfg's saved family (ml_family_saved), the trained tensors
 * renamed into that layout, in fp32 under SOURCE, nothing else.
 *
 * Crash and error safety: everything is written into a staging directory
 * beside the output, OUT.export-tmp (a stale one from a killed export is
 * removed first), and moved into place only when complete: renamed to OUT
 * when OUT is missing or empty; otherwise its files are renamed into OUT
 * one by one (weights, then the index, then config.json and the other
 * files; stale weight files of an earlier export that this one did not
 * write — model.safetensors, model-*-of-*.safetensors, the index — are
 * removed, as save_pretrained does). An error at any point removes the
 * staging directory and leaves OUT as it was. */
#ifndef ML_HF_EXPORT_H
#define ML_HF_EXPORT_H

#include <stddef.h>

#include <jansson.h>

#include "model/model.h"

/* The dtype of the exported trained tensors (--export-dtype). */
typedef enum { ML_EXPORT_DTYPE_SOURCE, ML_EXPORT_DTYPE_F32, ML_EXPORT_DTYPE_BF16 } ml_export_dtype;
/* Their flag values "source", "fp32", "bf16" in enum order, NULL-terminated
 * (the names of an ml_arg_choice, cli/args.h). */
extern const char *const ml_export_dtype_names[];

typedef struct ml_hf_export_spec {
  const char *out_dir;
  const ml_model_config *cfg;    /* the trained model */
  const ml_param *const *params; /* the trained tensors in the order their data comes, named
                                    in cfg->family's layout; global shapes; the parts of a
                                    fused checkpoint tensor (ml_param.key) consecutive, in
                                    the order of their rows: their data is appended to it */
  int n;
  const json_t *source;  /* hf_source.h description (checked), or NULL: none recorded */
  const char *files_dir; /* where the description's files are */
  ml_export_dtype dtype;
  size_t max_shard_bytes; /* 0 = one file */
} ml_hf_export_spec;

typedef struct ml_hf_export ml_hf_export;

/* Start an export (one process: the writer): prepare the staging
 * directory, write the weight files' headers (every size is known from the
 * shapes and dtypes). The spec is copied; source must outlive the export.
 * Errors: the source's family not the trained model's, a carried tensor
 * missing from the source weights or changed (named, recorded vs found),
 * the source directory unreadable while tensors are to be carried from it
 * (named, with their count and one name), a fused tensor's part out of
 * its place in params (named), out_dir an existing file, I/O (path named). */
int ml_hf_export_begin(const ml_hf_export_spec *spec, ml_hf_export **out);

/* The names and dtypes spec's trained tensors are written under (the
 * source family's layout, the dtype rule above), without writing anything:
 * names[k] (capacity sizeof ml_param.name) and dtypes[k] for k < spec->n
 * (out_dir unused) — per parameter: a fused tensor's parts under their own
 * names, each in the fused tensor's dtype. What refit hands out
 * (include/meshlm/meshlm.h).
 * Errors: as ml_hf_export_begin's for the layout and the dtypes. */
int ml_hf_export_layout(const ml_hf_export_spec *spec, char (*names)[sizeof((ml_param *)0)->name],
                        ml_dtype *dtypes);

/* The next trained tensor (params[k] for the k-th call): its global data
 * in fp32, [shape] row-major, converted and written at once. Errors: more
 * calls than tensors, I/O. */
int ml_hf_export_put(ml_hf_export *x, const float *data);

/* After the last trained tensor: write the carried tensors, config.json
 * and the files, and move the export into place. Frees x, also on error
 * (when nothing of it is left). Errors: a trained tensor never put, I/O. */
int ml_hf_export_end(ml_hf_export *x);

/* Give up: remove the staging directory, free x (NULL: nothing). */
void ml_hf_export_abandon(ml_hf_export *x);

#endif

/* The source of an HF export: what the export of a trained model takes
 * over from the HF checkpoint directory the run started from (meshlm train
 * --model), so that the export is that checkpoint with its trained tensors
 * replaced — what save_pretrained of the fine-tuned transformers model
 * writes: the original architecture and config.json (a
 * Gemma3ForConditionalGeneration stays one, vision_config included), the
 * tokenizer, generation and processor files, every tensor meshlm does not
 * train (a VLM's vision tower and projector, extra keys) byte for byte in
 * its dtype, and each trained tensor's dtype (save_pretrained writes a
 * model in the dtype it was loaded in).
 *
 * The description is a JSON object, kept in a run checkpoint's
 * metadata.json as "source" (ckpt/runckpt_format.h):
 *   {"dir": the source directory's absolute path (the carried tensors are
 *           read from there at export time),
 *    "dir_rel": in a run checkpoint, the same directory relative to the
 *           checkpoint's copy of the files (STEP/source; optional: tried
 *           when "dir" is not the source, so that a checkpoint moved with
 *           its source keeps exporting),
 *    "architecture": its config.json's architectures[0],
 *    "files": ["config.json", then the other files copied, sorted],
 *    "dtypes": {trained tensor (its source key): safetensors dtype},
 *    "carried": {tensor: {"dtype": D, "shape": [..]}} (the source's order)}
 * A tied lm_head stored in the source anyway is neither trained nor
 * carried: the export omits it, as save_pretrained drops tied copies. */
#ifndef ML_HF_SOURCE_H
#define ML_HF_SOURCE_H

#include <stdbool.h>

#include <jansson.h>

#include "model/model.h"

/* Describe the source directory `dir` of model m (m's parameters are the
 * trained tensors, named by their keys in dir's checkpoint): *out is a new
 * JSON object (json_decref it). Files copied: config.json and those
 * matching tokenizer*, special_tokens_map.json, added_tokens.json, vocab.*,
 * merges.txt, *.tiktoken, spiece.model, generation_config.json,
 * chat_template*, preprocessor_config.json, processor_config.json,
 * video_preprocessor_config.json (regular files). Errors: the directory,
 * its config.json or its weights unreadable (named), a parameter missing
 * from the weights or stored in a dtype other than F32/BF16/F16. */
int ml_hf_source_describe(const char *dir, const ml_model *m, json_t **out);

/* Record in src "dir_rel": its "dir" relative to the directory `base`
 * (both resolved: "../../model"). Errors: base unresolvable (named), out of
 * memory. */
int ml_hf_source_relate(json_t *src, const char *base);

/* Check the fields of a description read from a file (`what` names it in
 * messages): "dir" and "architecture" strings, "dir_rel" a string where
 * present, "files" plain file names
 * beginning with config.json, "dtypes" F32/BF16/F16 names, "carried"
 * entries with a dtype name and a shape of at most 8 non-negative sizes.
 * Errors: the first field that is not so (named, found vs expected). */
int ml_hf_source_check(const json_t *src, const char *what);

/* Copy the files `src` lists from directory `from` into `to` (which
 * exists), each through a temp file, fsync'd and renamed; config.json too
 * when with_config. Errors: a file missing or unreadable, I/O (named). */
int ml_hf_source_copy(const json_t *src, const char *from, const char *to, bool with_config);

#endif

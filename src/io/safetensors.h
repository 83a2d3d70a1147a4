/* safetensors reader (mmap, validated) and writer.
 *
 * Format (huggingface/safetensors): u64 little-endian header length N, N
 * bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]}, optional
 * "__metadata__": {str: str}}, then the data; offsets are relative to the
 * first byte after the header. Validation follows the reference reader
 * (SafeTensors::read_metadata + Metadata::validate): header <= 100 MB and
 * within the file, valid UTF-8 JSON object, no duplicate keys, known dtype,
 * shape entries non-negative, end - begin == product(shape) * dtype size
 * (overflow-checked), tensors sorted by offset cover the data exactly with
 * no gap and no overlap, and the data ends at end of file. */
#ifndef ML_SAFETENSORS_H
#define ML_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "tensor/dtype.h"

#define ML_ST_MAX_DIMS 8

typedef struct ml_st_tensor {
  char *name;
  ml_dtype dtype;
  int ndim;
  int64_t shape[ML_ST_MAX_DIMS];
  int64_t numel;
  const uint8_t *data; /* into the mapping; end - begin bytes */
  size_t nbytes;
} ml_st_tensor;

typedef struct ml_st_file {
  char *path;
  void *map;
  size_t map_size;
  size_t n;
  ml_st_tensor *tensors; /* in header order */
} ml_st_file;

/* Map and validate `path`. On error: -1 with a message naming the file, the
 * tensor or field, what was found and what was expected; `out` is left
 * closed. */
int ml_st_open(const char *path, ml_st_file *out);
void ml_st_close(ml_st_file *f);

/* The tensor called `name`, or NULL. */
const ml_st_tensor *ml_st_find(const ml_st_file *f, const char *name);

/* Read a block of a 1-D or 2-D tensor converted to fp32 (F32/BF16/F16):
 * dst[r, c] = t[row0 + r, col0 + c] for r < nrows, c < ncols; dst is
 * [nrows, ncols] row-major. A 1-D tensor is read as [n, 1] (col0 = 0,
 * ncols = 1). Errors: block out of range, ndim > 2, non-float dtype. */
int ml_st_read_block(const ml_st_tensor *t, int64_t row0, int64_t nrows, int64_t col0,
                     int64_t ncols, float *dst);

/* One tensor to write: fp32 data converted to `dtype` (F32/BF16/F16). */
typedef struct ml_st_entry {
  const char *name;
  ml_dtype dtype;
  int ndim;
  int64_t shape[ML_ST_MAX_DIMS];
  const float *data; /* product(shape) floats */
} ml_st_entry;

/* Write one safetensors file as the reference writer does: header with
 * "__metadata__": {"format": "pt"}, padded with spaces to a multiple of 8,
 * data in entry order; written to `path`.tmp, fsync'd, then renamed, so a
 * crash never leaves a half-written `path`. */
int ml_st_write(const char *path, const ml_st_entry *entries, size_t n);

/* Helper (used by ml_st_write and the checkpoint sharder): validate entry e
 * (name, dtype F32/BF16/F16, shape, overflow) and set *nbytes to its size
 * in the file; -1 with a message naming `path` and the tensor otherwise. */
int ml_st_entry_nbytes(const char *path, const ml_st_entry *e, size_t *nbytes);

#endif

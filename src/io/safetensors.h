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

/* For messages: shape[0..ndim) as "[a, b, ...]" in buf ("[]" for ndim 0),
 * cut to fit `cap` bytes; ML_ST_SHAPE_CAP bytes hold any shape of up to
 * ML_ST_MAX_DIMS dims (", " and 20 chars a dim, the brackets, the NUL). */
#define ML_ST_SHAPE_CAP (ML_ST_MAX_DIMS * 22 + 3)
void ml_st_shape_str(char *buf, size_t cap, int ndim, const int64_t *shape);

/* Read a block of a 1-D or 2-D tensor converted to fp32 (F32/BF16/F16):
 * dst[r, c] = t[row0 + r, col0 + c] for r < nrows, c < ncols; dst is
 * [nrows, ncols] row-major. A 1-D tensor is read as [n, 1] (col0 = 0,
 * ncols = 1). Errors: block out of range, ndim > 2, non-float dtype. */
int ml_st_read_block(const ml_st_tensor *t, int64_t row0, int64_t nrows, int64_t col0,
                     int64_t ncols, float *dst);
/* ml_st_read_block into a destination of dst_type: ML_F32 (that function),
 * or ML_BF16, each value widened to fp32 (ml_convert_to_f32: exact) and
 * rounded to bf16 (ml_convert_from_f32: ml_f32_to_bf16, torch's
 * round-to-nearest-even, NaN to 0x7FC0) — the bits of ml_st_read_block
 * followed by a conversion of its fp32 block, in one pass over dst (the
 * widened values go through an L1-sized buffer; a BF16 tensor's values copy
 * bit for bit, but for NaNs, which become 0x7FC0). dst is [nrows, ncols]
 * row-major, aligned for dst_type; large blocks are converted on the OpenMP
 * threads (the bits do not depend on their number). Errors: those of
 * ml_st_read_block, and a dst_type other than F32 and BF16. */
int ml_st_read_block_to(const ml_st_tensor *t, int64_t row0, int64_t nrows, int64_t col0,
                        int64_t ncols, void *dst, ml_dtype dst_type);

/* One tensor to write: its header fields, and fp32 data converted to
 * `dtype` (F32/BF16/F16) by ml_st_write. The streaming writer reads the
 * header fields only (any dtype) and takes the data from its puts. */
typedef struct ml_st_entry {
  const char *name;
  ml_dtype dtype;
  int ndim;
  int64_t shape[ML_ST_MAX_DIMS];
  const float *data; /* product(shape) floats; not read by ml_st_writer_open */
} ml_st_entry;

/* Write one safetensors file as the reference writer does: header with
 * "__metadata__": {"format": "pt"}, padded with spaces to a multiple of 8,
 * data in entry order; written to `path`.tmp, fsync'd, then renamed, so a
 * crash never leaves a half-written `path`. Every entry is checked
 * (ml_st_entry_nbytes) before the file is created. */
int ml_st_write(const char *path, const ml_st_entry *entries, size_t n);

/* The streaming form of ml_st_write, for data that arrives one tensor at a
 * time (the HF export, ckpt/hf_export.h: a tensor gathered from the mesh,
 * or copied from a source file, is written and dropped before the next):
 * ml_st_writer_open writes `path`.tmp's header for entries[0..n) (name,
 * dtype — any safetensors dtype —, ndim, shape; data is not read; the
 * writer copies what it keeps), then each put appends bytes of the current
 * tensor (the first one not yet complete, in entry order; a tensor may
 * take several puts, a put never spans two tensors), and
 * ml_st_writer_close checks every byte was put, fsyncs and renames the file
 * into place. Errors: those of ml_st_spec_nbytes, a duplicate name, I/O
 * (file named), a put larger than what remains of the current tensor
 * (named); after an error from a put, ml_st_writer_abandon. */
typedef struct ml_st_writer ml_st_writer;
int ml_st_writer_open(const char *path, const ml_st_entry *entries, size_t n, ml_st_writer **out);
/* bytes[nbytes]: the current tensor's next bytes, as stored (little-endian). */
int ml_st_writer_put(ml_st_writer *w, const void *bytes, size_t nbytes);
/* x[n]: the current tensor's next n elements as fp32, converted to its
 * dtype (F32, BF16 or F16: tensor/dtype.h, round-to-nearest-even) through
 * a 64 KiB buffer. Errors: another dtype, more elements than remain. */
int ml_st_writer_put_f32(ml_st_writer *w, const float *x, size_t n);
/* Commit the file (frees w, also on error, when the temp file is removed).
 * Errors: a tensor not complete (named, bytes put vs its size), I/O. */
int ml_st_writer_close(ml_st_writer *w);
/* Remove the temp file and free w (NULL: nothing). */
void ml_st_writer_abandon(ml_st_writer *w);

/* Validate the header fields of e (name, a safetensors dtype, ndim, shape,
 * overflow) and set *nbytes to its data size; -1 with a message naming
 * `path` and the tensor otherwise. */
int ml_st_spec_nbytes(const char *path, const ml_st_entry *e, size_t *nbytes);
/* ml_st_spec_nbytes for an entry ml_st_write converts: also dtype
 * F32/BF16/F16 and data not NULL. */
int ml_st_entry_nbytes(const char *path, const ml_st_entry *e, size_t *nbytes);

/* Drop the pages holding data[0..n) — bytes of a file mapped by ml_st_open
 * — from this process's memory (madvise MADV_DONTNEED on the pages that
 * contain them): reading a large checkpoint tensor by tensor then keeps the
 * resident set at about one tensor. The mapping stays valid; a later read
 * faults the pages back in from the file. */
void ml_st_release(const void *data, size_t n);

#endif

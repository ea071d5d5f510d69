// Tensor extension columns (Ray Data's fixed-shape and ragged tensors, Arrow's fixed_shape_tensor) read
// from their storage's buffers, one record batch at a time, with no copy: rows of the tensor's shape, or
// values and offsets ragged along the first dim. fastcollate/data/arrow_tensors.py reads the same storage
// in Python (the first table of a schema, and the per-sample way) and gives each tensor's dims: each
// library writes them into the type's metadata its own way (JSON, or a pickle).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

#include "collate/arrow_c_data.h"

namespace fastcollate {

// One record batch's rows of a column, as a GatheredColumn holds a chunk: rows of one shape, or values
// with offsets (int64, one more than the rows, within values).
struct ColumnChunk {
  at::Tensor rows;
  at::Tensor values;
  at::Tensor offsets;
};

// How a tensor column is read: its rows' dims as its type gives them (-1 for each dim of Ray's ragged
// tensors, whose rows each store their own), and what every chunk must hold, as the first table's did:
// the dtype, the dims after the first, and whether rows are ragged along the first (a ragged column that
// Ray stores with one shape in a block of rows that happen to share it).
struct TensorReading {
  std::vector<int64_t> dims;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> inner;
  bool ragged = false;
};

struct TensorRows {
  std::optional<ColumnChunk> chunk;  // none: see read_tensor_rows
  int64_t null_row = -1;             // the chunk's first row that holds a null at any level, or -1
};

// The rows of `array`, one record batch of a tensor column whose storage `schema` lays out. Its chunk is
// none where they are not laid out as `reading` says (a corrupt column, ragged dims after the first other
// than the first table's, another storage), or where a row holds a null: the per-sample way reads the
// first, or names what is wrong; the caller names the null's row.
TensorRows read_tensor_rows(const ArrowSchema* schema, const ArrowArray* array, const TensorReading& reading);

}  // namespace fastcollate

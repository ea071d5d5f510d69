// The gathers of array-backed columns by index, as the dispatcher ops run them and as the column gather
// (column_gather.h) calls them for a whole batch. Each checks every index before a byte is written.
#pragma once

#include <ATen/ATen.h>

namespace fastcollate {

// out[b] = source[indices[b]] for every b, cast to out's dtype on the way when it differs.
void gather_into_cpu(const at::Tensor& source, const at::Tensor& indices, const at::Tensor& out);

// The length of row index[b] of a ragged column.
inline int64_t row_length(const int64_t* offset, const int64_t* index, int64_t b) {
  return offset[index[b] + 1] - offset[index[b]];
}

// What the ragged gathers check first, their errors led by `op`: values and offsets as a Ragged column
// holds them, every index in range, and every gathered row's span inside values.
void check_ragged_rows(const at::Tensor& values, const at::Tensor& offsets, const at::Tensor& indices, const char* op);

// Rows values[offsets[i]:offsets[i + 1]], padded on the right with `value` to out's length; mask is 1 at
// real positions; lengths gets each row's length.
void gather_ragged_into_cpu(const at::Tensor& values, const at::Tensor& offsets, const at::Tensor& indices,
                            const at::Scalar& value, const at::Tensor& out, const at::Tensor& mask,
                            const at::Tensor& lengths);

// The same rows back to back into out ([total, *fixed dims]), row b at cu_seq_lens[b].
void gather_packed_into_cpu(const at::Tensor& values, const at::Tensor& offsets, const at::Tensor& indices,
                            const at::Tensor& cu_seq_lens, const at::Tensor& out);

}  // namespace fastcollate

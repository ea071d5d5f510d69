// The gathers of array-backed columns by index: rows, ragged rows padded (through fill/padded_rows.h) and
// ragged rows packed (through fill/packed_rows.h). The column gather (collate/column_gather.cpp) calls the
// *_spans_into_cpu and gather_rows_into_cpu kernels for a whole batch; the dispatcher ops
// (ops/cpu/ops_kernels.cpp registers them) call the *_into_cpu ones, which check every argument and index
// before a byte is written.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace fastcollate {

// Where each row of a batch lies: row b starts at data[b] and, in a ragged column, spans lengths[b]
// positions of its dim 0. Rows may come from different arrays (the chunks of one column).
struct RowSpans {
  std::vector<const void*> data;
  std::vector<int64_t> lengths;
};

// Whether each row of `source` (dims 1..) is contiguous, however far apart the rows are.
bool rows_are_contiguous(const at::Tensor& source);

// out[b] = source[indices[b]] for every b, cast to out's dtype on the way when it differs.
void gather_into_cpu(const at::Tensor& source, const at::Tensor& indices, const at::Tensor& out);

// The same from rows already found: out[b] is the row at rows[b], of `source`'s dtype.
void gather_rows_into_cpu(const std::vector<const void*>& rows, at::ScalarType source, const at::Tensor& out);

// Raises the IndexError of a ragged row (`row`, at batch position `position`) whose span start..stop is not
// within the `total` values, led by `op`.
[[noreturn]] void fail_row_span(int64_t start, int64_t stop, int64_t total, const char* op, int64_t row,
                                int64_t position);

// Checks a ragged row's span: inline, as it runs once for every row of every batch.
inline void check_row_span(int64_t start, int64_t stop, int64_t total, const char* op, int64_t row, int64_t position) {
  if (C10_UNLIKELY(!(0 <= start && start <= stop && stop <= total))) {
    fail_row_span(start, stop, total, op, row, position);
  }
}

// Rows values[offsets[i]:offsets[i + 1]], padded on the right with `value` to out's length; mask is 1 at
// real positions; lengths gets each row's length.
void gather_ragged_into_cpu(const at::Tensor& values, const at::Tensor& offsets, const at::Tensor& indices,
                            const at::Scalar& value, const at::Tensor& out, const at::Tensor& mask,
                            const at::Tensor& lengths);

// The spans of rows indices of a ragged column, whose spans have been checked.
RowSpans ragged_spans(const at::Tensor& values, const at::Tensor& offsets, const at::Tensor& indices);

// The same from spans already found, of `source`'s dtype; out, mask and lengths shaped as above. `left`
// puts the padding before each row's values instead (padded_rows.h).
void gather_ragged_spans_into_cpu(const RowSpans& spans, at::ScalarType source, const at::Scalar& value,
                                  const at::Tensor& out, const at::Tensor& mask, const at::Tensor& lengths, bool left);

// The same rows back to back into out ([total, *fixed dims]), row b at cu_seq_lens[b].
void gather_packed_into_cpu(const at::Tensor& values, const at::Tensor& offsets, const at::Tensor& indices,
                            const at::Tensor& cu_seq_lens, const at::Tensor& out);

// The same from spans already found: row b at token starts[b] of out ([total, *fixed dims]), starts having
// one entry more than spans has rows (fill/packed_rows.h).
void gather_packed_spans_into_cpu(const RowSpans& spans, at::ScalarType source, const int64_t* starts,
                                  const at::Tensor& out);

// The keys beside a packed row, from its cu_seq_lens: position_ids (int64, counting from `start` in each
// sample) and seq_idx (int32, each token's batch position), each [total] or [1, total]; either may be None.
// Positions count up from a start, up to 2**31 tokens a sample: a start beyond this bound would pass int64
// (signed overflow, undefined) rather than give a position. Packing.position_ids_start is held to it too.
constexpr int64_t kPositionStartBound = int64_t{1} << 62;

void packed_positions_into_cpu(const at::Tensor& cu_seq_lens, int64_t start,
                               const std::optional<at::Tensor>& position_ids, const std::optional<at::Tensor>& seq_idx);

}  // namespace fastcollate

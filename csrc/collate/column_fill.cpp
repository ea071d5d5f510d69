// The column gather's fill: the rows of each laid-out column copied into the batch's buffer (by index
// through fill/gather_kernels.h, or a column of rows chunk by chunk when in order), then the field's range
// checked on what was copied and the packed fields' separators written.
#include "collate/column_fill.h"

#include <ATen/EmptyTensor.h>

#include <algorithm>

#include "collate/contract_rules.h"
#include "fill/packed_rows.h"
#include "fill/padded_rows.h"
#include "memory/copy_kernels.h"

namespace fastcollate {

namespace {

using Kind = GatheredColumn::Kind;

// The first sample (by batch position) whose real values break the field's range, gathered into `node`,
// and the flat position within that sample; {-1, ...} when none does.
struct RangeMisfit {
  int64_t position = -1;
  int64_t flat = 0;
  double value = 0;
};

RangeMisfit first_range_misfit(const ColumnFill& fill, const ValueRange& range) {
  const Node& node = *fill.node;
  const at::Tensor& out = node.out;
  const at::ScalarType dtype = out.scalar_type();
  const auto* base = static_cast<const unsigned char*>(out.const_data_ptr());
  const size_t element_size = out.element_size();
  const int64_t size = node.packed ? static_cast<int64_t>(node.starts.size()) - 1 : out.size(0);
  RangeMisfit misfit;
  if (size == 0 || out.numel() == 0) {
    return misfit;
  }
  if (node.packed) {  // [1, total, *fixed]: sample b is tokens starts[b]..starts[b + 1]
    const int64_t token = c10::multiply_integers(out.sizes().slice(2));
    for (int64_t b = 0; b < size; ++b) {
      const int64_t begin = node.starts[b] * token;
      const int64_t flat = first_out_of_range(base + begin * element_size, dtype,
                                              (node.starts[b + 1] - node.starts[b]) * token, range, misfit.value);
      if (flat >= 0) {
        return {b, flat, misfit.value};
      }
    }
    return misfit;
  }
  const int64_t row = out.numel() / size;
  if (fill.lengths.empty()) {  // every row whole
    const int64_t flat = first_out_of_range(base, dtype, out.numel(), range, misfit.value);
    return flat < 0 ? misfit : RangeMisfit{flat / row, flat % row, misfit.value};
  }
  const int64_t step = row / std::max<int64_t>(out.size(1), 1);  // elements per position of the padded dim
  for (int64_t b = 0; b < size; ++b) {  // padding is not the sample's: only its own positions are checked
    const int64_t start = padded_row(fill.lengths[b], out.size(1), node.pad_left).start;
    const int64_t flat = first_out_of_range(base + (b * row + start * step) * element_size, dtype,
                                            fill.lengths[b] * step, range, misfit.value);
    if (flat >= 0) {
      return {b, flat, misfit.value};
    }
  }
  return misfit;
}

void write_separators(const Node& node, uint64_t pattern) {
  const PackedRows rows(node.out.select(0, 0), node.starts.data());
  CopyJobs jobs;
  for (size_t b = 0; b + 1 < node.starts.size(); ++b) {
    rows.add_separator(jobs, b, pattern);
  }
  jobs.run();
}

// Every row of a column of rows, in order: each chunk one block (a memcpy, or ATen's copy when casting).
void copy_chunks_in_order(const GatheredColumn& column, const at::Tensor& out) {
  if (out.numel() == 0) {
    return;
  }
  const bool casting = column.source().scalar_type() != out.scalar_type();
  const size_t row_bytes = static_cast<size_t>(out.numel() / out.size(0)) * out.element_size();
  auto* dst = static_cast<unsigned char*>(out.data_ptr());
  CopyJobs jobs;
  for (size_t c = 0; c < column.rows.size(); ++c) {
    const at::Tensor& chunk = column.rows[c];
    const int64_t rows = column.starts[c + 1] - column.starts[c];
    if (rows == 0) {
      continue;
    }
    if (casting || !chunk.is_contiguous()) {
      out.narrow(0, column.starts[c], rows).copy_(chunk);
    } else {
      jobs.add_memcpy(chunk.const_data_ptr(), dst + static_cast<size_t>(column.starts[c]) * row_bytes,
                      static_cast<size_t>(rows) * row_bytes);
    }
  }
  jobs.run();
}

// Gathers one column into its node's views.
void gather_column(const ColumnFill& fill) {
  const GatheredColumn& column = *fill.column;
  Node& node = *fill.node;
  switch (column.kind) {
    case Kind::Rows:
      if (fill.rows.data.empty()) {
        copy_chunks_in_order(column, node.out);
      } else {
        gather_rows_into_cpu(fill.rows.data, column.source().scalar_type(), node.out);
      }
      return;
    case Kind::Ragged: {
      const double pad = node.padded ? *column.field->pad_value : 0;
      if (node.padded) {
        gather_ragged_spans_into_cpu(fill.rows, column.source().scalar_type(), pad, node.out, node.mask->out,
                                     node.lengths->out, node.pad_left);
      } else {  // rows of one length: the mask and lengths are the gather's scratch
        const int64_t size = static_cast<int64_t>(fill.rows.data.size());
        gather_ragged_spans_into_cpu(fill.rows, column.source().scalar_type(), pad, node.out,
                                     at::detail::empty_cpu({size, node.out.size(1)}, at::kBool),
                                     at::detail::empty_cpu({size}, at::kLong), /*left=*/false);
      }
      return;
    }
    case Kind::Packed:
      gather_packed_spans_into_cpu(fill.rows, column.source().scalar_type(), node.starts.data(), node.out.select(0, 0));
      return;
    case Kind::Ids:
      return;
  }
}

}  // namespace

// Fills every gathered column of a laid-out batch, then checks its range and writes its separators.
void fill_columns(BatchPlan& plan, const std::vector<GatheredColumn>& columns, const std::string& id_key,
                  bool ids_are_indices, const int64_t* index, const int64_t* read,
                  const std::vector<ColumnFill>& fills) {
  for (const ColumnFill& fill : fills) {
    const GatheredColumn& column = *fill.column;
    try {
      py::gil_scoped_release no_gil;  // the copy touches no Python object
      gather_column(fill);
    } catch (...) {
      plan.failed_key = column.key;  // the caller names the column, and its file when a read faulted
      throw;
    }
    const FieldSpec* field = column.field ? &*column.field : nullptr;
    if (field != nullptr && field->range) {
      const RangeMisfit misfit = first_range_misfit(fill, *field->range);
      if (misfit.position >= 0) {
        const size_t position = static_cast<size_t>(misfit.position);
        raise_violation(range_misfit(*field->range, misfit.flat, misfit.value),
                        sample_at(columns, ids_are_indices, id_key, index, read, position), position, column.key,
                        id_key);
      }
    }
    if (column.kind == Kind::Packed && field->separator) {  // after the range: it checks the samples' own tokens
      write_separators(*fill.node, element_pattern(*field->separator, column.dtype));
    }
  }
}

}  // namespace fastcollate

// Gathering rows of an array-backed column by index, straight into the memory a batch goes out in (a
// staging slot, a shared slot): the batched path of fastcollate.Arrays, with no sample objects. Every index
// is checked before a byte is written; the copies are CopyJobs' (threads, streaming stores), and the GIL
// is released by the dispatcher around the whole op.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>

#include <ATen/Dispatch_v2.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "fill/gather_kernels.h"
#include "fill/packed_rows.h"
#include "fill/padded_rows.h"
#include "memory/copy_kernels.h"
#include "memory/mapped_reads.h"

namespace fastcollate {

namespace {

// Casting gathers go through a scratch block of source rows this large, copied into out by ATen's
// vectorised cast while it is still in the cache.
constexpr int64_t kCastChunkBytes = 256 << 10;

void check_indices(const at::Tensor& indices, int64_t rows, const char* op) {
  TORCH_CHECK(
      indices.device().is_cpu() && indices.scalar_type() == at::kLong && indices.dim() == 1 && indices.is_contiguous(),
      op, ": indices must be a contiguous 1-D int64 CPU tensor, got ", indices.scalar_type(), " of shape ",
      indices.sizes(), " on ", indices.device());
  const int64_t* index = indices.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < indices.numel(); ++b) {
    TORCH_CHECK_INDEX(index[b] >= 0 && index[b] < rows, op, ": index ", index[b], " (batch position ", b,
                      ") is out of range for ", rows, " rows");
  }
}

// Rows [begin, end) converted element by element as they are gathered (the compiler vectorises the
// inner loop): one pass over the bytes, no scratch block.
template <typename In, typename Out>
void cast_rows(const std::vector<const void*>& rows, Out* dst, int64_t row_elements, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const In* src = static_cast<const In*>(rows[r]);
    Out* out = dst + r * row_elements;
    for (int64_t j = 0; j < row_elements; ++j) {
      out[j] = static_cast<Out>(src[j]);
    }
  }
}

// The casts done in the gather's own pass: integers to wider-or-equal integers or floating point, and
// floating point to floating point (C++'s conversions agree with torch's there). Others go through
// ATen. Returns false when the pair is not one of them.
bool gather_casting(const std::vector<const void*>& rows, at::ScalarType in, const at::Tensor& out,
                    int64_t row_elements) {
  const at::ScalarType out_type = out.scalar_type();
  const bool in_floating = at::isFloatingType(in);
  const bool out_floating = at::isFloatingType(out_type);
  const bool out_taken =
      out_type == at::kLong || out_type == at::kInt || out_type == at::kFloat || out_type == at::kDouble;
  if (!out_taken || in == at::kBool || at::isComplexType(in) || (in_floating && !out_floating)) {
    return false;
  }
  const int64_t batch = static_cast<int64_t>(rows.size());
  const int64_t grain = std::max<int64_t>(1, kCastChunkBytes / std::max<int64_t>(row_elements * 8, 1));
  arm_mapped_read_guard();
  AT_DISPATCH_V2(
      in, "gather_casting", AT_WRAP([&] {
        using In = scalar_t;
        AT_DISPATCH_V2(out_type, "gather_casting", AT_WRAP([&] {
                         auto* dst = out.data_ptr<scalar_t>();
                         at::parallel_for(0, batch, grain, [&](int64_t begin, int64_t end) {
                           guard_mapped_reads([&] { cast_rows<In, scalar_t>(rows, dst, row_elements, begin, end); });
                         });
                       }),
                       at::kLong, at::kInt, at::kFloat, at::kDouble);
      }),
      AT_EXPAND(AT_INTEGRAL_TYPES), AT_EXPAND(AT_BAREBONES_UNSIGNED_TYPES), at::kFloat, at::kDouble, at::kHalf,
      at::kBFloat16);
  return true;
}

// The length of row index[b] of a ragged column.
int64_t row_length(const int64_t* offset, const int64_t* index, int64_t b) {
  return offset[index[b] + 1] - offset[index[b]];
}

// What both ragged gathers check first: values and offsets as a Ragged column holds them, every index in
// range, and every gathered row's span inside values (a Ragged column checks its offsets when made, but
// they may have been changed since, and the ops may be called directly).
void check_ragged_rows(const at::Tensor& values, const at::Tensor& offsets, const at::Tensor& indices, const char* op) {
  TORCH_CHECK(
      values.device().is_cpu() && values.dim() >= 1 && values.is_contiguous() && !values.is_conj() && !values.is_neg(),
      op, ": values must be a contiguous CPU tensor with a leading dim");
  TORCH_CHECK(offsets.device().is_cpu() && offsets.scalar_type() == at::kLong && offsets.dim() == 1 &&
                  offsets.is_contiguous() && offsets.numel() >= 1,
              op, ": offsets must be a contiguous 1-D int64 CPU tensor of rows + 1 entries");
  check_indices(indices, offsets.numel() - 1, op);
  const int64_t* index = indices.const_data_ptr<int64_t>();
  const int64_t* offset = offsets.const_data_ptr<int64_t>();
  const int64_t total = values.size(0);
  for (int64_t b = 0; b < indices.numel(); ++b) {
    check_row_span(offset[index[b]], offset[index[b] + 1], total, op, index[b], b);
  }
}

}  // namespace

// Whether each row of `source` (dims 1..) is contiguous; the rows themselves may be any stride apart, so
// overlapping windows over one token stream (as_strided) gather as they are.
bool rows_are_contiguous(const at::Tensor& source) {
  if (source.numel() == 0) {
    return true;  // no rows, or empty ones: nothing to copy
  }
  int64_t expected = 1;
  for (int64_t d = source.dim() - 1; d >= 1; --d) {
    if (source.size(d) != 1 && source.stride(d) != expected) {
      return false;
    }
    expected *= source.size(d);
  }
  return true;
}

// out[b] = source[indices[b]] for every b, cast to out's dtype on the way when it differs.
void gather_into_cpu(const at::Tensor& source, const at::Tensor& indices, const at::Tensor& out) {
  TORCH_CHECK(source.device().is_cpu() && out.device().is_cpu(), "gather_into: source and out must be CPU tensors");
  TORCH_CHECK(source.dim() >= 1, "gather_into: source needs a leading row dim, got a 0-d tensor");
  TORCH_CHECK(rows_are_contiguous(source), "gather_into: each row of source must be contiguous (strides ",
              source.strides(), " for shape ", source.sizes(), ")");
  TORCH_CHECK(!source.is_conj() && !source.is_neg(), "gather_into: resolve source's conj/neg bit first");
  TORCH_CHECK(out.is_contiguous(), "gather_into: out must be contiguous");
  const int64_t batch = indices.numel();
  std::vector<int64_t> expected{batch};
  expected.insert(expected.end(), source.sizes().begin() + 1, source.sizes().end());
  TORCH_CHECK(out.sizes() == at::IntArrayRef(expected), "gather_into: out must have shape ", expected, ", got ",
              out.sizes());
  check_indices(indices, source.size(0), "gather_into");
  if (batch == 0 || out.numel() == 0) {
    return;
  }
  at::assert_no_overlap(out, source);  // not even fully: rows would be read after being written
  const int64_t* index = indices.const_data_ptr<int64_t>();
  const auto* base = static_cast<const unsigned char*>(source.const_data_ptr());
  const size_t row_stride = static_cast<size_t>(source.stride(0)) * source.element_size();
  std::vector<const void*> rows(static_cast<size_t>(batch));
  for (int64_t b = 0; b < batch; ++b) {
    rows[b] = base + static_cast<size_t>(index[b]) * row_stride;
  }
  gather_rows_into_cpu(rows, source.scalar_type(), out);
}

void gather_rows_into_cpu(const std::vector<const void*>& rows, at::ScalarType source, const at::Tensor& out) {
  const int64_t batch = static_cast<int64_t>(rows.size());
  if (batch == 0 || out.numel() == 0) {
    return;
  }
  const size_t source_element = c10::elementSize(source);
  const size_t row_bytes = static_cast<size_t>(out.numel() / batch) * source_element;
  if (source == out.scalar_type()) {
    CopyJobs jobs;
    jobs.add_rows(rows.data(), out.data_ptr(), row_bytes, rows.size());
    jobs.run();
    return;
  }
  const int64_t row_elements = out.numel() / batch;
  const bool narrowing_integers = at::isIntegralType(source, /*includeBool=*/false) &&
                                  at::isIntegralType(out.scalar_type(), false) && out.element_size() < source_element;
  if (!narrowing_integers && gather_casting(rows, source, out, row_elements)) {
    return;
  }
  const int64_t chunk = std::max<int64_t>(1, kCastChunkBytes / static_cast<int64_t>(std::max<size_t>(row_bytes, 1)));
  const int64_t chunks = (batch + chunk - 1) / chunk;
  arm_mapped_read_guard();
  at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
    std::vector<int64_t> scratch_shape = out.sizes().vec();
    scratch_shape[0] = std::min(chunk, batch);
    at::Tensor scratch = at::empty(scratch_shape, out.options().dtype(source));
    for (int64_t c = first; c < last; ++c) {
      const int64_t begin = c * chunk;
      const int64_t n = std::min(chunk, batch - begin);
      auto* dst = static_cast<unsigned char*>(scratch.data_ptr());
      guard_mapped_reads([&] {
        for (int64_t r = 0; r < n; ++r) {
          std::memcpy(dst + static_cast<size_t>(r) * row_bytes, rows[begin + r], row_bytes);
        }
      });
      out.narrow(0, begin, n).copy_(scratch.narrow(0, 0, n));
    }
  });
}

void fail_row_span(int64_t start, int64_t stop, int64_t total, const char* op, int64_t row, int64_t position) {
  TORCH_CHECK_INDEX(false, op, ": row ", row, " (batch position ", position, ") spans offsets ", start, "..", stop,
                    ", outside the ", total, " values (offsets must be non-decreasing, from 0 to len(values))");
  throw std::logic_error("unreachable");  // TORCH_CHECK_INDEX(false, ...) throws
}

// Rows of a ragged column: row i is values[offsets[i]:offsets[i + 1]]. Gathered rows are padded on the
// right with `value` to out's length; mask is 1 (True) at real positions; lengths gets each row's length.
void gather_ragged_into_cpu(const at::Tensor& values, const at::Tensor& offsets, const at::Tensor& indices,
                            const at::Scalar& value, const at::Tensor& out, const at::Tensor& mask,
                            const at::Tensor& lengths) {
  check_ragged_rows(values, offsets, indices, "gather_ragged_into");
  const int64_t batch = indices.numel();
  TORCH_CHECK(out.device().is_cpu() && out.is_contiguous() && out.dim() == values.dim() + 1 && out.size(0) == batch &&
                  out.sizes().slice(2) == values.sizes().slice(1),
              "gather_ragged_into: out must be contiguous of shape [", batch, ", longest, ", values.sizes().slice(1),
              "], got ", out.sizes());
  const int64_t longest = out.size(1);
  TORCH_CHECK(mask.device().is_cpu() && mask.is_contiguous() && mask.sizes() == at::IntArrayRef({batch, longest}),
              "gather_ragged_into: mask must be contiguous of shape [", batch, ", ", longest, "], got ", mask.sizes());
  TORCH_CHECK(lengths.device().is_cpu() && lengths.scalar_type() == at::kLong && lengths.is_contiguous() &&
                  lengths.sizes() == at::IntArrayRef({batch}),
              "gather_ragged_into: lengths must be a contiguous int64 tensor of shape [", batch, "]");
  at::assert_no_overlap(out, values);
  at::assert_no_overlap(out, mask);
  at::assert_no_overlap(out, lengths);
  gather_ragged_spans_into_cpu(ragged_spans(values, offsets, indices), values.scalar_type(), value, out, mask, lengths,
                               /*left=*/false);
}

RowSpans ragged_spans(const at::Tensor& values, const at::Tensor& offsets, const at::Tensor& indices) {
  const int64_t batch = indices.numel();
  const int64_t* index = indices.const_data_ptr<int64_t>();
  const int64_t* offset = offsets.const_data_ptr<int64_t>();
  const auto* base = static_cast<const unsigned char*>(values.const_data_ptr());
  const size_t step_bytes = static_cast<size_t>(values.stride(0)) * values.element_size();
  RowSpans spans;
  spans.data.resize(static_cast<size_t>(batch));
  spans.lengths.resize(static_cast<size_t>(batch));
  for (int64_t b = 0; b < batch; ++b) {
    spans.data[b] = base + static_cast<size_t>(offset[index[b]]) * step_bytes;
    spans.lengths[b] = row_length(offset, index, b);
  }
  return spans;
}

void gather_ragged_spans_into_cpu(const RowSpans& spans, at::ScalarType source, const at::Scalar& value,
                                  const at::Tensor& out, const at::Tensor& mask, const at::Tensor& lengths, bool left) {
  const int64_t batch = static_cast<int64_t>(spans.data.size());
  const int64_t longest = out.size(1);
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(spans.lengths[b] <= longest, "gather_ragged_into: batch position ", b, " has length ", spans.lengths[b],
                ", longer than out's ", longest);
  }
  // A cast goes through a gather in the source's dtype first (ATen then casts the whole block).
  const at::Tensor target = out.scalar_type() == source ? out : at::empty(out.sizes(), out.options().dtype(source));
  const size_t step_bytes =
      static_cast<size_t>(c10::multiply_integers(out.sizes().slice(2))) * c10::elementSize(source);
  // Casting, the padding is written after the cast, in out's dtype (-100 stays -100 when uint16 tokens
  // become int64 labels); the gather in the source's dtype pads with zeros meanwhile.
  const bool casting = !target.is_same(out);
  // Both made before anything is written: a value out's dtype refuses leaves out, mask and lengths as they were.
  const uint64_t pad = casting ? 0 : element_pattern(value, source);
  const uint64_t out_pad = casting ? element_pattern(value, out.scalar_type()) : pad;
  PaddedRows rows(target, batch, pad, left);
  rows.with_mask(mask).with_lengths(lengths.data_ptr<int64_t>());
  CopyJobs jobs;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t length = spans.lengths[b];
    unsigned char* values = rows.add_row(jobs, b, length);
    if (length > 0) {
      jobs.add_memcpy(spans.data[b], values, static_cast<size_t>(length) * step_bytes);
    }
  }
  jobs.run();
  if (casting) {
    const_cast<at::Tensor&>(out).copy_(target);
    const PaddedRows cast(out, batch, out_pad, left);
    CopyJobs padding;
    for (int64_t b = 0; b < batch; ++b) {
      cast.add_row(padding, b, spans.lengths[b]);
    }
    padding.run();
  }
}

namespace {

// cu_seq_lens must be int32 [batch + 1], from 0, one row's length a step: checked against the rows here
// so a packed row and its offsets cannot disagree.
void check_packed_offsets(const at::Tensor& cu_seq_lens, int64_t batch, const char* op) {
  TORCH_CHECK(cu_seq_lens.device().is_cpu() && cu_seq_lens.scalar_type() == at::kInt && cu_seq_lens.dim() == 1 &&
                  cu_seq_lens.is_contiguous() && cu_seq_lens.numel() == batch + 1,
              op, ": cu_seq_lens must be a contiguous int32 CPU tensor of batch + 1 = ", batch + 1, " entries, got ",
              cu_seq_lens.scalar_type(), " of shape ", cu_seq_lens.sizes());
  const int32_t* cu = cu_seq_lens.const_data_ptr<int32_t>();
  TORCH_CHECK(cu[0] == 0, op, ": cu_seq_lens must start at 0, got ", cu[0]);
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(cu[b] <= cu[b + 1], op, ": cu_seq_lens must not decrease (", cu[b], " then ", cu[b + 1],
                " at batch position ", b, ")");
  }
}

}  // namespace

// Rows values[offsets[i]:offsets[i + 1]] of a ragged column for each index, back to back into out
// ([total, *fixed dims]): row b at cu_seq_lens[b], which must hold the rows' lengths. A packed batch's
// column (contract.Field(pack=True)), gathered with no sample objects; a cast goes through a gather in the
// values' dtype, then one ATen copy.
void gather_packed_into_cpu(const at::Tensor& values, const at::Tensor& offsets, const at::Tensor& indices,
                            const at::Tensor& cu_seq_lens, const at::Tensor& out) {
  check_ragged_rows(values, offsets, indices, "gather_packed_into");
  const int64_t batch = indices.numel();
  check_packed_offsets(cu_seq_lens, batch, "gather_packed_into");
  const int32_t* cu = cu_seq_lens.const_data_ptr<int32_t>();
  TORCH_CHECK(out.device().is_cpu() && out.is_contiguous() && out.dim() == values.dim() && out.size(0) == cu[batch] &&
                  out.sizes().slice(1) == values.sizes().slice(1),
              "gather_packed_into: out must be contiguous of shape [", cu[batch], ", ", values.sizes().slice(1),
              "] (cu_seq_lens' total first), got ", out.sizes());
  const RowSpans spans = ragged_spans(values, offsets, indices);
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(spans.lengths[b] == cu[b + 1] - cu[b], "gather_packed_into: row ", indices.const_data_ptr<int64_t>()[b],
                " (batch position ", b, ") has length ", spans.lengths[b], " but cu_seq_lens gives it ",
                cu[b + 1] - cu[b]);
  }
  if (out.numel() == 0) {
    return;
  }
  at::assert_no_overlap(out, values);
  const std::vector<int64_t> starts(cu, cu + batch + 1);
  gather_packed_spans_into_cpu(spans, values.scalar_type(), starts.data(), out);
}

void gather_packed_spans_into_cpu(const RowSpans& spans, at::ScalarType source, const int64_t* starts,
                                  const at::Tensor& out) {
  if (out.numel() == 0) {
    return;
  }
  const at::Tensor target = out.scalar_type() == source ? out : at::empty(out.sizes(), out.options().dtype(source));
  const PackedRows rows(target, starts);
  CopyJobs jobs;
  for (size_t b = 0; b < spans.data.size(); ++b) {
    rows.add_row(jobs, b, spans.data[b], at::Tensor(), std::nullopt);
  }
  jobs.run();
  if (!target.is_same(out)) {
    const_cast<at::Tensor&>(out).copy_(target);
  }
}

void packed_positions_into_cpu(const at::Tensor& cu_seq_lens, int64_t start,
                               const std::optional<at::Tensor>& position_ids,
                               const std::optional<at::Tensor>& seq_idx) {
  const int64_t batch = cu_seq_lens.numel() - 1;
  TORCH_CHECK(batch >= 0, "packed_positions_into: cu_seq_lens needs at least one entry");
  check_packed_offsets(cu_seq_lens, batch, "packed_positions_into");
  TORCH_CHECK(-kPositionStartBound <= start && start <= kPositionStartBound,
              "packed_positions_into: start must be within +-2**62 (as Packing.position_ids_start), got ", start);
  const int32_t* cu = cu_seq_lens.const_data_ptr<int32_t>();
  auto check_out = [&](const at::Tensor& out, at::ScalarType dtype, const char* name) {
    TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == dtype && out.is_contiguous() &&
                    out.numel() == cu[batch] && out.dim() >= 1 && out.size(-1) == cu[batch],
                "packed_positions_into: ", name, " must be a contiguous ", dtype, " CPU tensor of ", cu[batch],
                " tokens ([total] or [1, total]), got ", out.scalar_type(), " of shape ", out.sizes());
  };
  if (position_ids && seq_idx) {
    at::assert_no_overlap(*position_ids, *seq_idx);
  }
  if (position_ids) {
    check_out(*position_ids, at::kLong, "position_ids");
  }
  if (seq_idx) {
    check_out(*seq_idx, at::kInt, "seq_idx");
  }
  const std::vector<int64_t> starts(cu, cu + batch + 1);
  CopyJobs jobs;
  add_packing_keys(jobs, starts.data(), static_cast<size_t>(batch),
                   position_ids ? position_ids->data_ptr<int64_t>() : nullptr, start,
                   seq_idx ? seq_idx->data_ptr<int32_t>() : nullptr);
  jobs.run();
}

}  // namespace fastcollate

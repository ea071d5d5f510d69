// The one writer of packed fields: each sample's tokens back to back in one row, a separator at each
// sample's first token where the field declares one, and the keys beside the row that tell attention where
// each sample starts (cu_seq_lens, position ids, seq_idx). Every packed field goes through it: the walk's
// plan (collate/plan.cpp, add_packed_jobs), the column gather (fill/gather_kernels.cpp,
// gather_packed_spans_into_cpu, and collate/column_gather.cpp's separators) and the gather_packed_into and
// packed_positions_into ops (fill/gather_kernels.cpp). A change to how a packed field is packed is made here.
//
// Sample b holds tokens starts[b]..starts[b + 1] of the row: `starts` has one entry more than the batch
// has samples, from 0, and its last entry (the total) fits int32, as cu_seq_lens does.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

#include "memory/copy_kernels.h"

namespace fastcollate {

class PackedRows {
 public:
  // `tokens`: the packed row, [total, *fixed dims], contiguous.
  PackedRows(const at::Tensor& tokens, const int64_t* starts);

  // Adds sample b's tokens: its first token the separator's bytes when one is given (a fill; the copy
  // starts one token later, so the two need no order), the rest copied from `source` (the sample's bytes,
  // contiguous, in the row's dtype), or by ATen from `value` when `source` is null.
  void add_row(CopyJobs& jobs, size_t b, const void* source, const at::Tensor& value,
               std::optional<uint64_t> separator) const;

  // Adds the fill of sample b's first token with the separator's bytes (an empty sample has none): the
  // column gather writes separators after it has checked the samples' own first tokens.
  void add_separator(CopyJobs& jobs, size_t b, uint64_t separator) const;

 private:
  at::Tensor tokens_;
  const int64_t* starts_;
  unsigned char* bytes_;
  size_t token_elements_;
  size_t element_size_;
};

// Adds the keys beside a packed row of `count` samples, each null where not asked for: position ids
// (int64, counting from `position_start` in each sample) and seq_idx (int32, each token's batch position).
void add_packing_keys(CopyJobs& jobs, const int64_t* starts, size_t count, int64_t* position_ids,
                      int64_t position_start, int32_t* seq_idx);

// cu_seq_lens (int32, count + 1 entries): the starts, as flash-attention's varlen kernels read them.
void write_cu_seq_lens(int32_t* out, const int64_t* starts, size_t count);

}  // namespace fastcollate

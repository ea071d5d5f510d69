// The one writer of padded fields: for each row of a batch, its padding (the pad value), its mask row (1 of
// the mask's dtype at real positions, 0 at padding) and its lengths; the caller copies the row's own values
// where the writer says. Every padded field goes through it: the walk's plan (collate/plan.cpp,
// add_padded_jobs), the column gather (fill/gather_kernels.cpp, gather_ragged_spans_into_cpu) and the
// pad_into op (ops/cpu/ops_kernels.cpp). A change to how a padded field is padded is made here.
//
// A row of `length` real positions is padded to the batch's padded length on the right (the default), or
// on the left, as a tokenizer with padding_side="left" pads (decoder-only generation: the real tokens end
// every row).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "memory/copy_kernels.h"

namespace fastcollate {

// One row's positions along its padded dim.
struct PaddedRow {
  int64_t start = 0;       // the first real position
  int64_t pad_start = 0;   // the first position of padding
  int64_t pad_length = 0;  // how many positions are padding
};

inline PaddedRow padded_row(int64_t length, int64_t padded, bool left) {
  const int64_t pad = padded - length;
  return left ? PaddedRow{pad, 0, pad} : PaddedRow{0, length, pad};
}

// The batch's padded length: its longest row rounded up to a multiple of `multiple` (>= 1), as
// DataCollatorWithPadding(pad_to_multiple_of=...) rounds it; -1 when that passes int64.
inline int64_t padded_length(int64_t longest, int64_t multiple) {
  const int64_t remainder = longest % multiple;
  if (remainder == 0) {
    return longest;
  }
  const int64_t up = multiple - remainder;
  return longest > std::numeric_limits<int64_t>::max() - up ? -1 : longest + up;
}

// A padded field of `rows` rows: out [rows, padded, *inner] (padded in dim 1 alone, or in several named
// dims), with its mask [rows, *padded dims] and its lengths [rows] or [rows, padded dims] beside, either
// left out (a mask another field writes; lengths written elsewhere, or a second pass).
class PaddedRows {
 public:
  // `pad`: the pad value's bytes in out's dtype (element_pattern).
  PaddedRows(const at::Tensor& out, int64_t rows, uint64_t pad, bool left);

  // Writes the mask too: 1 of its dtype at real positions, 0 at padding.
  PaddedRows& with_mask(const at::Tensor& mask);
  // Writes each row's lengths too (int64, one per padded dim).
  PaddedRows& with_lengths(int64_t* lengths, size_t per_row = 1);

  // Row b padded in dim 1 alone, `length` real positions: adds the fill of its padding and of its mask
  // row, writes its length, and returns where its values go (`length` positions, back to back).
  unsigned char* add_row(CopyJobs& jobs, int64_t b, int64_t length) const;

  // Row b padded in the named dims `dims` of `value` (a sample of out's rows' rank): the whole row is
  // padded, then the sample copied into its corner by ATen (fills run before copies), its first positions
  // of each named dim, or its last ones when padded on the left. Fixed dims stay whole (a declared expand
  // broadcasts). The mask and lengths follow the same corner.
  void add_corner(CopyJobs& jobs, int64_t b, const at::Tensor& value, const std::vector<int64_t>& dims);

 private:
  at::Tensor out_;
  at::Tensor mask_;
  at::Tensor one_;  // the mask's 1, the source of the corner path's mask copies: made once a batch
  unsigned char* out_bytes_;
  int64_t padded_;        // dim 1's padded length
  size_t row_elements_;   // elements of one row of out
  size_t step_elements_;  // elements of one position of dim 1
  size_t element_size_;
  uint64_t pad_;
  bool left_;
  unsigned char* mask_bytes_ = nullptr;
  size_t mask_row_elements_ = 0;
  size_t mask_element_size_ = 0;
  uint64_t mask_one_ = 0;
  int64_t* lengths_ = nullptr;
  size_t lengths_per_row_ = 1;
};

}  // namespace fastcollate

// Where a padded row's values go and where its padding goes, for every writer of padded rows: the walk's
// plan (plan.cpp), the column gather and the pad_into op. A row of `length` real positions is padded to
// the batch's padded length on the right (the default), or on the left, as a tokenizer with
// padding_side="left" pads (decoder-only generation: the real tokens end every row).
#pragma once

#include <cstdint>
#include <limits>

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

// Adds the fill of one row's padding with `pad` (positions of `step_elements` elements of `element_size`
// bytes, the row at `row`) and returns where its values go: the caller copies them there.
inline unsigned char* add_row_padding(CopyJobs& jobs, unsigned char* row, const PaddedRow& span, size_t step_elements,
                                      size_t element_size, uint64_t pad) {
  const size_t step_bytes = step_elements * element_size;
  if (span.pad_length > 0) {
    jobs.fills.push_back({row + static_cast<size_t>(span.pad_start) * step_bytes,
                          static_cast<size_t>(span.pad_length) * step_elements, element_size, pad});
  }
  return row + static_cast<size_t>(span.start) * step_bytes;
}

// Adds the fills of one mask row of `length` real positions: `one` (1 in the mask's dtype) there, 0 at
// the padding.
inline void add_mask_row(CopyJobs& jobs, unsigned char* mask_row, const PaddedRow& span, int64_t length,
                         size_t element_size, uint64_t one) {
  if (length > 0) {
    jobs.fills.push_back(
        {mask_row + static_cast<size_t>(span.start) * element_size, static_cast<size_t>(length), element_size, one});
  }
  if (span.pad_length > 0) {
    jobs.fills.push_back({mask_row + static_cast<size_t>(span.pad_start) * element_size,
                          static_cast<size_t>(span.pad_length), element_size, 0});
  }
}

}  // namespace fastcollate

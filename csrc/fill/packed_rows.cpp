#include "fill/packed_rows.h"

#include <cstring>

namespace fastcollate {

PackedRows::PackedRows(const at::Tensor& tokens, const int64_t* starts)
    : tokens_(tokens),
      starts_(starts),
      bytes_(static_cast<unsigned char*>(tokens.data_ptr())),
      token_elements_(static_cast<size_t>(c10::multiply_integers(tokens.sizes().slice(1)))),
      element_size_(tokens.element_size()) {}

void PackedRows::add_row(CopyJobs& jobs, size_t b, const void* source, const at::Tensor& value,
                         std::optional<uint64_t> separator) const {
  const int64_t length = starts_[b + 1] - starts_[b];
  if (length == 0) {
    return;
  }
  const int64_t skip = separator ? 1 : 0;
  if (separator) {
    add_separator(jobs, b, *separator);
  }
  if (length == skip) {
    return;
  }
  const size_t token_bytes = token_elements_ * element_size_;
  if (source != nullptr) {
    jobs.add_memcpy(static_cast<const unsigned char*>(source) + skip * token_bytes,
                    bytes_ + static_cast<size_t>(starts_[b] + skip) * token_bytes,
                    static_cast<size_t>(length - skip) * token_bytes);
  } else {
    jobs.tensor_copies.push_back(
        {value.narrow(0, skip, length - skip), tokens_.narrow(0, starts_[b] + skip, length - skip)});
  }
}

void PackedRows::add_separator(CopyJobs& jobs, size_t b, uint64_t separator) const {
  if (starts_[b] < starts_[b + 1]) {
    jobs.fills.push_back({bytes_ + static_cast<size_t>(starts_[b]) * token_elements_ * element_size_, token_elements_,
                          element_size_, separator});
  }
}

void add_packing_keys(CopyJobs& jobs, const int64_t* starts, size_t count, int64_t* position_ids,
                      int64_t position_start, int32_t* seq_idx) {
  if (position_ids != nullptr) {
    for (size_t b = 0; b < count; ++b) {
      jobs.counts.push_back({position_ids + starts[b], static_cast<size_t>(starts[b + 1] - starts[b]), position_start});
    }
  }
  if (seq_idx != nullptr) {
    for (size_t b = 0; b < count; ++b) {
      const int32_t position = static_cast<int32_t>(b);
      uint64_t pattern = 0;
      std::memcpy(&pattern, &position, sizeof(position));  // FillJob reads an element's bytes from the pattern's first
      jobs.fills.push_back(
          {seq_idx + starts[b], static_cast<size_t>(starts[b + 1] - starts[b]), sizeof(int32_t), pattern});
    }
  }
}

void write_cu_seq_lens(int32_t* out, const int64_t* starts, size_t count) {
  for (size_t b = 0; b <= count; ++b) {
    out[b] = static_cast<int32_t>(starts[b]);
  }
}

}  // namespace fastcollate

#include "fill/padded_rows.h"

namespace fastcollate {

PaddedRows::PaddedRows(const at::Tensor& out, int64_t rows, uint64_t pad, bool left)
    : out_(out),
      out_bytes_(static_cast<unsigned char*>(out.data_ptr())),
      padded_(out.dim() > 1 ? out.size(1) : 0),
      row_elements_(rows > 0 ? static_cast<size_t>(out.numel() / rows) : 0),
      step_elements_(padded_ > 0 ? row_elements_ / static_cast<size_t>(padded_) : 0),
      element_size_(out.element_size()),
      pad_(pad),
      left_(left) {}

PaddedRows& PaddedRows::with_mask(const at::Tensor& mask) {
  mask_ = mask;
  mask_bytes_ = static_cast<unsigned char*>(mask.data_ptr());
  const int64_t rows = out_.dim() > 0 ? out_.size(0) : 0;
  mask_row_elements_ = rows > 0 ? static_cast<size_t>(mask.numel() / rows) : 0;
  mask_element_size_ = mask.element_size();
  mask_one_ = element_pattern(1, mask.scalar_type());  // 1, 1.0f, ...: the bytes differ by dtype
  return *this;
}

PaddedRows& PaddedRows::with_lengths(int64_t* lengths, size_t per_row) {
  lengths_ = lengths;
  lengths_per_row_ = per_row;
  return *this;
}

unsigned char* PaddedRows::add_row(CopyJobs& jobs, int64_t b, int64_t length) const {
  const PaddedRow span = padded_row(length, padded_, left_);
  const size_t step_bytes = step_elements_ * element_size_;
  unsigned char* row = out_bytes_ + static_cast<size_t>(b) * row_elements_ * element_size_;
  if (span.pad_length > 0) {
    jobs.fills.push_back({row + static_cast<size_t>(span.pad_start) * step_bytes,
                          static_cast<size_t>(span.pad_length) * step_elements_, element_size_, pad_});
  }
  if (mask_bytes_ != nullptr) {
    unsigned char* mask_row = mask_bytes_ + static_cast<size_t>(b) * mask_row_elements_ * mask_element_size_;
    if (length > 0) {
      jobs.fills.push_back({mask_row + static_cast<size_t>(span.start) * mask_element_size_,
                            static_cast<size_t>(length), mask_element_size_, mask_one_});
    }
    if (span.pad_length > 0) {
      jobs.fills.push_back({mask_row + static_cast<size_t>(span.pad_start) * mask_element_size_,
                            static_cast<size_t>(span.pad_length), mask_element_size_, 0});
    }
  }
  if (lengths_ != nullptr) {
    lengths_[b] = length;
  }
  return row + static_cast<size_t>(span.start) * step_bytes;
}

void PaddedRows::add_corner(CopyJobs& jobs, int64_t b, const at::Tensor& value, const std::vector<int64_t>& dims) {
  jobs.fills.push_back(
      {out_bytes_ + static_cast<size_t>(b) * row_elements_ * element_size_, row_elements_, element_size_, pad_});
  at::Tensor target = out_.select(0, b);
  at::Tensor mask_target = mask_bytes_ != nullptr ? mask_.select(0, b) : at::Tensor();
  for (size_t k = 0; k < dims.size(); ++k) {
    const int64_t dim = dims[k];
    const int64_t size = value.size(dim);
    const int64_t start = padded_row(size, target.size(dim), left_).start;
    target = target.narrow(dim, start, size);
    if (mask_bytes_ != nullptr) {
      mask_target = mask_target.narrow(static_cast<int64_t>(k), start, size);
    }
    if (lengths_ != nullptr) {
      lengths_[static_cast<size_t>(b) * lengths_per_row_ + k] = size;
    }
  }
  jobs.tensor_copies.push_back({value, target});
  if (mask_bytes_ != nullptr) {
    jobs.fills.push_back({mask_bytes_ + static_cast<size_t>(b) * mask_row_elements_ * mask_element_size_,
                          mask_row_elements_, mask_element_size_, 0});
    if (!one_.defined()) {
      one_ = at::ones({}, at::TensorOptions().dtype(mask_.scalar_type()));
    }
    jobs.tensor_copies.push_back({one_, mask_target});
  }
}

}  // namespace fastcollate

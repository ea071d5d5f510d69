// The CPU kernels of the dispatcher ops declared in csrc/ops/ops.cpp, as torchvision keeps them
// (csrc/ops/cuda/ holds the CUDA ones), and their registration. Each checks its arguments with messages that
// name the value. The gathers' kernels are fill/gather_kernels.h's, and every padded or packed row is
// written by fill/'s writers, as the collate's are.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <torch/library.h>

#include <algorithm>

#include "fill/gather_kernels.h"
#include "fill/padded_rows.h"
#include "memory/copy_kernels.h"

namespace fastcollate {

namespace {

// Checks that every sample has the same sizes and dtype as out's rows, then copies sample i into out[i].
void stack_into_cpu(at::TensorList samples, const at::Tensor& out) {
  TORCH_CHECK(out.device().is_cpu(), "stack_into: out must be a CPU tensor, got ", out.device());
  TORCH_CHECK(out.is_contiguous(), "stack_into: out must be contiguous");
  TORCH_CHECK(out.dim() >= 1 && out.size(0) == static_cast<int64_t>(samples.size()),
              "stack_into: out must have one row per sample: ", samples.size(), " samples, out has shape ",
              out.sizes());
  const auto row_shape = out.sizes().slice(1);
  CopyJobs jobs;
  for (size_t i = 0; i < samples.size(); ++i) {
    const at::Tensor& sample = samples[i];
    TORCH_CHECK(sample.sizes() == row_shape, "stack_into: sample ", i, " has shape ", sample.sizes(), ", expected ",
                row_shape);
    TORCH_CHECK(sample.scalar_type() == out.scalar_type(), "stack_into: sample ", i, " has dtype ",
                sample.scalar_type(), ", expected ", out.scalar_type());
    TORCH_CHECK(sample.device().is_cpu(), "stack_into: sample ", i, " is on ", sample.device(), ", expected cpu");
    at::assert_no_overlap(out, sample);  // memcpy from memory it writes is undefined
    at::Tensor row = out.select(0, static_cast<int64_t>(i));
    if (copyable_as_is(sample)) {
      jobs.add_memcpy(sample.const_data_ptr(), row.data_ptr(), sample.nbytes());
    } else {
      jobs.tensor_copies.push_back({sample, row});
    }
  }
  jobs.run();
}

// Pads variable-length samples along their first dim to out's length (right side, `value`), marks the
// real positions in `mask` and writes each length into `lengths`.
void pad_into_cpu(at::TensorList samples, const at::Scalar& value, const at::Tensor& out, const at::Tensor& mask,
                  const at::Tensor& lengths) {
  const int64_t batch = static_cast<int64_t>(samples.size());
  TORCH_CHECK(out.device().is_cpu() && out.is_contiguous(), "pad_into: out must be a contiguous CPU tensor");
  TORCH_CHECK(out.dim() >= 2 && out.size(0) == batch, "pad_into: out must have shape [", batch,
              ", max_length, ...], got ", out.sizes());
  TORCH_CHECK(
      mask.scalar_type() == at::kBool && mask.is_contiguous() && mask.sizes() == at::IntArrayRef({batch, out.size(1)}),
      "pad_into: mask must be a contiguous bool tensor of shape [", batch, ", ", out.size(1), "], got ", mask.sizes(),
      " ", mask.scalar_type());
  TORCH_CHECK(
      lengths.scalar_type() == at::kLong && lengths.is_contiguous() && lengths.sizes() == at::IntArrayRef({batch}),
      "pad_into: lengths must be a contiguous int64 tensor of shape [", batch, "]");
  at::assert_no_overlap(out, mask);
  at::assert_no_overlap(out, lengths);
  at::assert_no_overlap(mask, lengths);
  const int64_t max_length = out.size(1);
  const auto inner_shape = out.sizes().slice(2);
  const size_t step_bytes = static_cast<size_t>(c10::multiply_integers(inner_shape)) * out.element_size();
  PaddedRows rows(out, batch, element_pattern(value, out.scalar_type()), /*left=*/false);
  rows.with_mask(mask).with_lengths(lengths.data_ptr<int64_t>());

  CopyJobs jobs;
  std::vector<at::Tensor> contiguous_samples;  // keeps copies of strided samples alive until jobs.run()
  contiguous_samples.reserve(samples.size());
  for (int64_t i = 0; i < batch; ++i) {
    const at::Tensor& sample = samples[i];
    TORCH_CHECK(sample.dim() == out.dim() - 1 && sample.sizes().slice(1) == inner_shape, "pad_into: sample ", i,
                " has shape ", sample.sizes(), ", expected [length <= ", max_length, ", ", inner_shape, "]");
    TORCH_CHECK(sample.size(0) <= max_length, "pad_into: sample ", i, " has length ", sample.size(0),
                ", longer than out's ", max_length);
    TORCH_CHECK(sample.scalar_type() == out.scalar_type() && sample.device().is_cpu(), "pad_into: sample ", i, " is ",
                sample.scalar_type(), " on ", sample.device(), ", expected ", out.scalar_type(), " on cpu");
    at::assert_no_overlap(out, sample);  // memcpy from memory it writes is undefined
    const int64_t length = sample.size(0);
    unsigned char* values = rows.add_row(jobs, i, length);
    const at::Tensor& contiguous = contiguous_samples.emplace_back(sample.contiguous());
    jobs.add_memcpy(contiguous.const_data_ptr(), values, static_cast<size_t>(length) * step_bytes);
  }
  jobs.run();
}

at::Tensor normalize_images_cpu(const at::Tensor& images, const at::Tensor& mean, const at::Tensor& std,
                                at::ScalarType dtype, bool channels_last) {
  TORCH_CHECK(images.dim() == 4, "normalize_images: images must be [N, C, H, W], got shape ", images.sizes());
  const int64_t channels = images.size(1);
  TORCH_CHECK(mean.numel() == channels && std.numel() == channels, "normalize_images: mean and std need ", channels,
              " values (one per channel), got ", mean.numel(), " and ", std.numel());
  auto float_options = at::TensorOptions().dtype(at::kFloat);
  at::Tensor scale = (std.to(float_options) * 255.0).reciprocal().view({1, channels, 1, 1});
  at::Tensor shift = (mean.to(float_options) / std.to(float_options)).view({1, channels, 1, 1});
  at::Tensor out = (images.to(at::kFloat) * scale - shift).to(dtype);
  return channels_last ? out.contiguous(at::MemoryFormat::ChannelsLast) : out.contiguous();
}

}  // namespace

TORCH_LIBRARY_IMPL(fastcollate, CPU, m) {
  m.impl("stack_into", &stack_into_cpu);
  m.impl("pad_into", &pad_into_cpu);
  m.impl("normalize_images", &normalize_images_cpu);
  m.impl("gather_into", &gather_into_cpu);
  m.impl("gather_ragged_into", &gather_ragged_into_cpu);
  m.impl("gather_packed_into", &gather_packed_into_cpu);
  m.impl("packed_positions_into", &packed_positions_into_cpu);
}

}  // namespace fastcollate

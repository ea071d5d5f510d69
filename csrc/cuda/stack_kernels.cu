// CUDA kernels for the dispatcher ops. Launches go on the current stream; only c10/cuda headers are
// used, so the build needs the CUDA runtime headers and nothing from cuBLAS or cuSPARSE.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace fastcollate {

namespace {

void stack_into_cuda(at::TensorList samples, const at::Tensor& out) {
  TORCH_CHECK(out.is_cuda() && out.is_contiguous(), "stack_into: out must be a contiguous CUDA tensor");
  TORCH_CHECK(out.dim() >= 1 && out.size(0) == static_cast<int64_t>(samples.size()),
              "stack_into: out must have one row per sample: ", samples.size(), " samples, out has shape ",
              out.sizes());
  const c10::cuda::CUDAGuard guard(out.device());
  const auto row_shape = out.sizes().slice(1);
  for (size_t i = 0; i < samples.size(); ++i) {
    TORCH_CHECK(samples[i].sizes() == row_shape && samples[i].scalar_type() == out.scalar_type(),
                "stack_into: sample ", i, " is ", samples[i].scalar_type(), " ", samples[i].sizes(), ", expected ",
                out.scalar_type(), " ", row_shape);
    out.select(0, static_cast<int64_t>(i)).copy_(samples[i], /*non_blocking=*/true);
  }
}

// One thread per output element: reads a uint8 pixel of an NCHW image, writes (x/255 - mean)/std
// as `out_t` in NCHW or NHWC order.
template <typename out_t>
__global__ void normalize_images_kernel(const uint8_t* __restrict__ images, const float* __restrict__ scale,
                                        const float* __restrict__ shift, out_t* __restrict__ out, int64_t total,
                                        int64_t channels, int64_t hw, bool channels_last) {
  const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= total) {
    return;
  }
  const int64_t c = (index / hw) % channels;
  const float value = static_cast<float>(images[index]) * scale[c] - shift[c];
  int64_t target = index;
  if (channels_last) {
    const int64_t n = index / (hw * channels);
    const int64_t p = index % hw;
    target = (n * hw + p) * channels + c;
  }
  out[target] = static_cast<out_t>(value);
}

at::Tensor normalize_images_cuda(const at::Tensor& images, const at::Tensor& mean, const at::Tensor& std,
                                 at::ScalarType dtype, bool channels_last) {
  TORCH_CHECK(images.is_cuda() && images.scalar_type() == at::kByte && images.dim() == 4,
              "normalize_images: images must be a uint8 CUDA tensor [N, C, H, W], got ", images.scalar_type(), " ",
              images.sizes(), " on ", images.device());
  const int64_t channels = images.size(1);
  TORCH_CHECK(mean.numel() == channels && std.numel() == channels, "normalize_images: mean and std need ",
              channels, " values (one per channel), got ", mean.numel(), " and ", std.numel());
  const c10::cuda::CUDAGuard guard(images.device());
  at::Tensor input = images.contiguous();
  auto float_options = images.options().dtype(at::kFloat);
  at::Tensor mean_f = mean.to(float_options);
  at::Tensor std_f = std.to(float_options);
  at::Tensor scale = (std_f * 255.0).reciprocal().contiguous();
  at::Tensor shift = (mean_f / std_f).contiguous();
  at::Tensor out = channels_last
                       ? at::empty(images.sizes(), images.options().dtype(dtype).memory_format(at::MemoryFormat::ChannelsLast))
                       : at::empty(images.sizes(), images.options().dtype(dtype));
  const int64_t total = input.numel();
  if (total == 0) {
    return out;
  }
  const int threads = 256;
  const int64_t blocks = (total + threads - 1) / threads;
  const int64_t hw = images.size(2) * images.size(3);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "normalize_images", [&] {
    normalize_images_kernel<scalar_t><<<blocks, threads, 0, stream>>>(
        input.const_data_ptr<uint8_t>(), scale.const_data_ptr<float>(), shift.const_data_ptr<float>(),
        out.data_ptr<scalar_t>(), total, channels, hw, channels_last);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fastcollate, CUDA, m) {
  m.impl("stack_into", &stack_into_cuda);
  m.impl("normalize_images", &normalize_images_cuda);
}

}  // namespace fastcollate

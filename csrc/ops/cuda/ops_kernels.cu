// CUDA kernels for the dispatcher ops. Launches go on the current stream; only c10/cuda headers are
// used, so the build needs the CUDA runtime headers and nothing from cuBLAS or cuSPARSE.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <limits>

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
    TORCH_CHECK(samples[i].sizes() == row_shape && samples[i].scalar_type() == out.scalar_type(), "stack_into: sample ",
                i, " is ", samples[i].scalar_type(), " ", samples[i].sizes(), ", expected ", out.scalar_type(), " ",
                row_shape);
    out.select(0, static_cast<int64_t>(i)).copy_(samples[i], /*non_blocking=*/true);
  }
}

// Four pixels per thread, one (image, channel) plane per grid row: the channel's scale and shift are
// read once per plane, offsets inside a plane are 32-bit, and where the plane allows it the four
// uint8 pixels are one 4-byte load and (NCHW output) the four outputs one vector store. The earlier
// one-thread-per-element kernel did four 64-bit divisions and a 1-byte load per element, on the copy
// stream ahead of the next batch's copy.
constexpr int kNormalizeThreads = 256;
constexpr int kPixelsPerThread = 4;

template <typename T>
struct alignas(sizeof(T) * kPixelsPerThread) Pixels {
  T value[kPixelsPerThread];
};

template <typename out_t>
__global__ void normalize_images_kernel(const uint8_t* __restrict__ images, const float* __restrict__ scale,
                                        const float* __restrict__ shift, out_t* __restrict__ out, int64_t planes,
                                        int channels, int hw, bool channels_last, bool vectorized) {
  const int stride = static_cast<int>(gridDim.x) * kNormalizeThreads * kPixelsPerThread;
  const int first =
      (static_cast<int>(blockIdx.x) * kNormalizeThreads + static_cast<int>(threadIdx.x)) * kPixelsPerThread;
  for (int64_t plane = blockIdx.y; plane < planes; plane += gridDim.y) {
    const int c = static_cast<int>(plane % channels);
    const float a = scale[c];
    const float b = shift[c];
    const uint8_t* in = images + plane * hw;
    // NCHW: the plane is contiguous. NHWC: pixel p of image n, channel c sits at (n * hw + p) * C + c.
    out_t* target = channels_last ? out + (plane / channels) * hw * channels + c : out + plane * hw;
    for (int p = first; p < hw; p += stride) {
      if (vectorized) {  // hw % 4 == 0 and the pointers are aligned for it
        const uchar4 raw = *reinterpret_cast<const uchar4*>(in + p);
        Pixels<out_t> values;
        values.value[0] = static_cast<out_t>(static_cast<float>(raw.x) * a - b);
        values.value[1] = static_cast<out_t>(static_cast<float>(raw.y) * a - b);
        values.value[2] = static_cast<out_t>(static_cast<float>(raw.z) * a - b);
        values.value[3] = static_cast<out_t>(static_cast<float>(raw.w) * a - b);
        if (!channels_last) {
          *reinterpret_cast<Pixels<out_t>*>(target + p) = values;
          continue;
        }
        for (int k = 0; k < kPixelsPerThread; ++k) {
          target[(p + k) * channels] = values.value[k];
        }
        continue;
      }
      for (int k = 0; k < kPixelsPerThread && p + k < hw; ++k) {
        const out_t value = static_cast<out_t>(static_cast<float>(in[p + k]) * a - b);
        target[channels_last ? (p + k) * channels : p + k] = value;
      }
    }
  }
}

at::Tensor normalize_images_cuda(const at::Tensor& images, const at::Tensor& mean, const at::Tensor& std,
                                 at::ScalarType dtype, bool channels_last) {
  TORCH_CHECK(images.is_cuda() && images.scalar_type() == at::kByte && images.dim() == 4,
              "normalize_images: images must be a uint8 CUDA tensor [N, C, H, W], got ", images.scalar_type(), " ",
              images.sizes(), " on ", images.device());
  const int64_t channels = images.size(1);
  TORCH_CHECK(mean.numel() == channels && std.numel() == channels, "normalize_images: mean and std need ", channels,
              " values (one per channel), got ", mean.numel(), " and ", std.numel());
  const c10::cuda::CUDAGuard guard(images.device());
  at::Tensor input = images.contiguous();
  auto float_options = images.options().dtype(at::kFloat);
  at::Tensor mean_f = mean.to(float_options);
  at::Tensor std_f = std.to(float_options);
  at::Tensor scale = (std_f * 255.0).reciprocal().contiguous();
  at::Tensor shift = (mean_f / std_f).contiguous();
  at::Tensor out =
      channels_last
          ? at::empty(images.sizes(), images.options().dtype(dtype).memory_format(at::MemoryFormat::ChannelsLast))
          : at::empty(images.sizes(), images.options().dtype(dtype));
  if (input.numel() == 0) {
    return out;
  }
  const int64_t hw = images.size(2) * images.size(3);
  const int64_t planes = images.size(0) * channels;
  // 32-bit offsets inside a plane (and inside an image, for channels-last output), with room for the
  // grid stride past the end.
  TORCH_CHECK(hw * channels <= std::numeric_limits<int>::max() / 2, "normalize_images: an image of ", hw * channels,
              " values is too large (at most ", std::numeric_limits<int>::max() / 2, ")");
  const auto aligned = [](const void* ptr, size_t alignment) {
    return reinterpret_cast<uintptr_t>(ptr) % alignment == 0;
  };
  const int64_t blocks_per_plane =
      (hw + kNormalizeThreads * kPixelsPerThread - 1) / (kNormalizeThreads * kPixelsPerThread);
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(blocks_per_plane, 65535)),
                  static_cast<unsigned>(std::min<int64_t>(planes, 65535)));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "normalize_images", [&] {
    const bool vectorized = hw % kPixelsPerThread == 0 && aligned(input.const_data_ptr(), kPixelsPerThread) &&
                            aligned(out.const_data_ptr(), sizeof(Pixels<scalar_t>));
    normalize_images_kernel<scalar_t><<<grid, kNormalizeThreads, 0, stream>>>(
        input.const_data_ptr<uint8_t>(), scale.const_data_ptr<float>(), shift.const_data_ptr<float>(),
        out.data_ptr<scalar_t>(), planes, static_cast<int>(channels), static_cast<int>(hw), channels_last, vectorized);
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

// The dispatcher operators' schemas, every one in this TORCH_LIBRARY block: they are usable from
// torch.compile and checked by torch.library.opcheck. The kernels are csrc/cpu/'s and csrc/cuda/'s.
#include <torch/library.h>

namespace fastcollate {

TORCH_LIBRARY(fastcollate, m) {
  m.def("stack_into(Tensor[] samples, Tensor(a!) out) -> ()");
  m.def("pad_into(Tensor[] samples, Scalar value, Tensor(a!) out, Tensor(b!) mask, Tensor(c!) lengths) -> ()");
  // uint8 images [N, C, H, W] to `dtype`, (x / 255 - mean) / std per channel, optionally channels-last.
  m.def("normalize_images(Tensor images, Tensor mean, Tensor std, ScalarType dtype, bool channels_last) -> Tensor");
}

}  // namespace fastcollate

// The dispatcher operators' schemas, every one in this TORCH_LIBRARY block: they are usable from
// torch.compile and checked by torch.library.opcheck. The kernels are csrc/ops/cpu/'s and csrc/ops/cuda/'s.
#include <torch/library.h>

namespace fastcollate {

TORCH_LIBRARY(fastcollate, m) {
  m.def("stack_into(Tensor[] samples, Tensor(a!) out) -> ()");
  m.def("pad_into(Tensor[] samples, Scalar value, Tensor(a!) out, Tensor(b!) mask, Tensor(c!) lengths) -> ()");
  // out[b] = source[indices[b]] (each row of source contiguous, rows any stride apart), cast to out's dtype.
  m.def("gather_into(Tensor source, Tensor indices, Tensor(a!) out) -> ()");
  // Rows values[offsets[i]:offsets[i + 1]] of a ragged column, gathered and padded on the right.
  m.def(
      "gather_ragged_into(Tensor values, Tensor offsets, Tensor indices, Scalar value, Tensor(a!) out, "
      "Tensor(b!) mask, Tensor(c!) lengths) -> ()");
  // The same rows back to back (a packed batch's column), row b at cu_seq_lens[b] (int32, batch + 1).
  m.def("gather_packed_into(Tensor values, Tensor offsets, Tensor indices, Tensor cu_seq_lens, Tensor(a!) out) -> ()");
  // A packed row's position_ids (int64, from `start` in each sample) and seq_idx (int32), from cu_seq_lens.
  m.def("packed_positions_into(Tensor cu_seq_lens, int start, Tensor(a!)? position_ids, Tensor(b!)? seq_idx) -> ()");
  // uint8 images [N, C, H, W] to `dtype`, (x / 255 - mean) / std per channel, optionally channels-last.
  m.def("normalize_images(Tensor images, Tensor mean, Tensor std, ScalarType dtype, bool channels_last) -> Tensor");
}

}  // namespace fastcollate

// One declared leaf of a contract, filled from fastcollate.contract.Field by the Python layer.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

namespace fastcollate {

enum class FieldKind {
  Tensor,  // tensors and numpy arrays
  Number,  // Python ints, floats and bools
  Text,    // str and bytes
};

// The most tokens a packed batch holds: cu_seq_lens are int32 (FlashAttention's and transformers').
constexpr int64_t kMaxPackedTokens = std::numeric_limits<int32_t>::max();

// Values must lie in [low, high).
struct ValueRange {
  double low = 0;
  double high = 0;
};

struct FieldSpec {
  std::string path;  // "meta.boxes", "0.label"
  FieldKind kind = FieldKind::Tensor;
  std::optional<at::ScalarType> dtype;            // none: the sample's own
  std::vector<at::ScalarType> cast_from;          // dtypes converted to `dtype` on copy
  std::optional<std::vector<int64_t>> shape;      // -1 where the dim is named (variable); none: any shape
  std::vector<std::string> dim_names;             // "" where the dim is fixed; one per dim of `shape`
  std::vector<std::vector<int64_t>> expand_from;  // shapes broadcast to `shape` on copy
  std::optional<ValueRange> range;
  std::optional<double> pad_value;        // named dims padded to the batch's longest with this value
  std::string mask_name;                  // padded: key of the mask put beside the field
  at::ScalarType mask_dtype = at::kBool;  // padded: the mask's dtype (1 at real positions, 0 at padding)
  std::string lengths_name;               // padded: key of the lengths put beside the field ("" for none)
  int64_t pad_to_multiple_of = 1;         // padded: each named dim padded to a multiple of this
  bool pad_left = false;                  // padded: the padding before the values (padding_side="left")
  // Packed: samples concatenated into one row [1, total, *fixed dims] (contract.Field.pack). The keys beside
  // it are the contract's Packing, the same on every packed field; "" (or no names) leaves one out.
  bool packed = false;
  std::optional<double> separator;  // written at each sample's first token
  std::string position_ids_name;
  int64_t position_ids_start = 0;
  std::vector<std::string> cu_seq_lens_names;  // q and k, or none
  std::vector<std::string> max_length_names;   // q and k, or none
  std::string seq_idx_name;
  int64_t max_tokens = 0;  // a batch of more tokens is refused; 0 for no budget (still under 2^31)
  // Keys of the packed fields' parent that the batch leaves out (Packing.drop).
  std::vector<std::string> drop_names;
  // Packed: the path of the packed field whose samples this one takes (contract.Field.copy_of); "" for
  // none. The samples hold no value of their own for it.
  std::string copy_of;

  bool padded() const { return pad_value.has_value(); }
  bool has_named_dims() const {
    return std::any_of(dim_names.begin(), dim_names.end(), [](const std::string& name) { return !name.empty(); });
  }
};

// The path of a container's child: "meta" + "boxes" is "meta.boxes"; the sample's own children have
// no prefix.
inline std::string child_path(const std::string& parent, const std::string& key) {
  return parent.empty() ? key : parent + "." + key;
}

// The path of a field's container: "" for "boxes" and for the sample itself, "meta" for "meta.boxes".
inline std::string parent_path(const std::string& path) {
  const size_t dot = path.rfind('.');
  return dot == std::string::npos ? std::string() : path.substr(0, dot);
}

// How errors name the sample itself.
inline std::string path_or_sample(const std::string& path) {
  return path.empty() ? "<sample>" : path;
}

}  // namespace fastcollate

// Packed fields (contract.Field.pack): the samples of a variable-length field concatenated into one row,
// [1, total, *fixed dims], and the keys beside it that tell attention where each sample starts (position
// ids, cu_seq_lens, max_length, seq_idx). The names and dtypes are transformers'
// DataCollatorWithFlattening's. The walk has checked each sample as any contract field (dtype, fixed dims,
// range, the named dim agreeing with the sample's other fields); here only the layout is decided.
#include <algorithm>
#include <limits>

#include "collate/messages.h"
#include "collate/plan.h"
#include "collate/walk.h"
#include "memory/copy_kernels.h"

namespace fastcollate {

namespace {

std::unique_ptr<Node> numbers_node(const std::string& path, at::ScalarType dtype, std::vector<int64_t> shape) {
  auto node = std::make_unique<Node>();
  node->path = path;
  node->kind = Node::Kind::Numbers;
  node->dtype = dtype;
  node->shape = std::move(shape);
  return node;
}

}  // namespace

void Walk::lay_out_packing(const FieldSpec& spec, Node& node) {
  const size_t count = node.inputs.size();
  node.packed = true;
  node.starts.assign(count + 1, 0);
  for (size_t i = 0; i < count; ++i) {
    const int64_t length = node.inputs[i].size(0);
    node.starts[i + 1] = node.starts[i] + length;
    if (node.starts[i + 1] > kMaxPackedTokens) {
      fail(packed_past_int32(node.starts[i + 1]), i, node.path);
    }
    if (spec.max_tokens > 0 && node.starts[i + 1] > spec.max_tokens) {
      fail(packed_past_budget(spec.max_tokens, node.starts[i + 1]), i, node.path);
    }
  }
  const int64_t total = node.starts[count];
  if (total == 0) {
    fail(packed_batch_empty(), 0, node.path);
  }
  // [count, *row] from check_contract_rows becomes [1, total, *fixed dims].
  std::vector<int64_t> shape{1, total};
  shape.insert(shape.end(), node.shape.begin() + 2, node.shape.end());
  node.shape = std::move(shape);
  const at::IntArrayRef tail = at::IntArrayRef(node.shape).slice(2);
  for (size_t i = 0; i < count; ++i) {
    const at::Tensor& value = node.inputs[i];
    const bool as_is = value.scalar_type() == node.dtype && value.sizes().slice(1) == tail && copyable_as_is(value);
    node.sources[i] = as_is ? value.const_data_ptr() : nullptr;
  }
  if (spec.separator) {
    node.has_separator = true;
    node.separator_pattern = value_pattern(*spec.separator, node.dtype, node.path, "separator",
                                           "declare a separator the field's dtype can hold");
  }
  lay_out(node);
  auto [owner, first] = pack_owners_.emplace(parent_path(node.path), &node);
  if (first) {
    lay_out_beside_packing(spec, node);
  } else if (owner->second->starts != node.starts) {
    // Fields that share the named dim agree within each sample (check_named_dim): this cannot differ.
    TORCH_INTERNAL_ASSERT(false, "packed fields ", owner->second->path, " and ", node.path, " differ in length");
  }
}

// The keys beside the parent's first packed row; the parent's other packed rows share them.
void Walk::lay_out_beside_packing(const FieldSpec& spec, Node& node) {
  const size_t count = node.inputs.size();
  const int64_t total = node.starts[count];
  node.max_length = 0;
  for (size_t i = 0; i < count; ++i) {
    node.max_length = std::max(node.max_length, node.starts[i + 1] - node.starts[i]);
  }
  node.position_ids_name = spec.position_ids_name;
  node.position_ids_start = spec.position_ids_start;
  node.seq_idx_name = spec.seq_idx_name;
  node.cu_seq_lens_names = spec.cu_seq_lens_names;
  node.max_length_names = spec.max_length_names;
  if (!spec.position_ids_name.empty()) {
    node.position_ids = numbers_node(node.path, at::kLong, {1, total});
    lay_out(*node.position_ids);
  }
  if (!spec.seq_idx_name.empty()) {
    node.seq_idx = numbers_node(node.path, at::kInt, {1, total});
    lay_out(*node.seq_idx);
  }
  if (!spec.cu_seq_lens_names.empty()) {
    node.cu_seq_lens = numbers_node(node.path, at::kInt, {static_cast<int64_t>(count) + 1});
    lay_out(*node.cu_seq_lens);
  }
}

}  // namespace fastcollate

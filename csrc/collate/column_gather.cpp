#include "collate/column_gather.h"

#include <ATen/EmptyTensor.h>

#include <algorithm>
#include <functional>
#include <unordered_map>
#include <utility>

#include "collate/contract_rules.h"
#include "collate/node.h"
#include "memory/copy_kernels.h"
#include "ops/cpu/gather_kernels.h"

namespace fastcollate {

struct ColumnGather::Shared {
  std::vector<GatheredColumn> columns;
  int64_t length = 0;
  std::string id_key;
  bool ids_are_indices = false;
};

namespace {

using Kind = GatheredColumn::Kind;

// One column's node and what its fill needs once the views exist.
struct ColumnFill {
  const GatheredColumn* column;
  Node* node;
  std::vector<int64_t> lengths;  // Ragged, Packed: each row's
};

std::unique_ptr<Node> laid_out(BatchPlan& plan, const std::string& path, Node::Kind kind, at::ScalarType dtype,
                               std::vector<int64_t> shape) {
  auto node = std::make_unique<Node>();
  node->kind = kind;
  node->path = path;
  node->dtype = dtype;
  node->shape = std::move(shape);
  node->offset = plan.reserve(static_cast<size_t>(c10::multiply_integers(node->shape)) * c10::elementSize(dtype));
  return node;
}

std::vector<int64_t> row_lengths(const GatheredColumn& column, const int64_t* index, int64_t size) {
  const int64_t* offset = column.offsets.const_data_ptr<int64_t>();
  std::vector<int64_t> lengths(static_cast<size_t>(size));
  for (int64_t b = 0; b < size; ++b) {
    lengths[b] = row_length(offset, index, b);
  }
  return lengths;
}

std::vector<int64_t> with_rows(int64_t rows, int64_t row_length, at::IntArrayRef inner) {
  std::vector<int64_t> shape{rows, row_length};
  shape.insert(shape.end(), inner.begin(), inner.end());
  return shape;
}

// Who a sample is, for make_error: its id is its index when the dataset has an id column.
py::object sample_at(bool ids_are_indices, const std::string& id_key, const int64_t* index, size_t position) {
  if (!ids_are_indices) {
    return py::none();
  }
  py::dict batch;
  py::dict sample;
  sample[py::str(id_key)] = index[position];
  batch[py::int_(position)] = sample;
  return std::move(batch);
}

// The first sample (by batch position) whose real values break the field's range, gathered into `node`,
// and the flat position within that sample; {-1, ...} when none does.
struct RangeMisfit {
  int64_t position = -1;
  int64_t flat = 0;
  double value = 0;
};

RangeMisfit first_range_misfit(const ColumnFill& fill, const ValueRange& range) {
  const Node& node = *fill.node;
  const at::Tensor& out = node.out;
  const at::ScalarType dtype = out.scalar_type();
  const auto* base = static_cast<const unsigned char*>(out.const_data_ptr());
  const size_t element_size = out.element_size();
  const int64_t size = node.packed ? static_cast<int64_t>(node.starts.size()) - 1 : out.size(0);
  RangeMisfit misfit;
  if (size == 0 || out.numel() == 0) {
    return misfit;
  }
  if (node.packed) {  // [1, total, *fixed]: sample b is tokens starts[b]..starts[b + 1]
    const int64_t token = c10::multiply_integers(out.sizes().slice(2));
    for (int64_t b = 0; b < size; ++b) {
      const int64_t begin = node.starts[b] * token;
      const int64_t flat = first_out_of_range(base + begin * element_size, dtype,
                                              (node.starts[b + 1] - node.starts[b]) * token, range, misfit.value);
      if (flat >= 0) {
        return {b, flat, misfit.value};
      }
    }
    return misfit;
  }
  const int64_t row = out.numel() / size;
  if (fill.lengths.empty()) {  // every row whole
    const int64_t flat = first_out_of_range(base, dtype, out.numel(), range, misfit.value);
    return flat < 0 ? misfit : RangeMisfit{flat / row, flat % row, misfit.value};
  }
  const int64_t step = row / std::max<int64_t>(out.size(1), 1);  // elements per position of the padded dim
  for (int64_t b = 0; b < size; ++b) {  // padding is not the sample's: only its own length is checked
    const int64_t flat =
        first_out_of_range(base + b * row * element_size, dtype, fill.lengths[b] * step, range, misfit.value);
    if (flat >= 0) {
      return {b, flat, misfit.value};
    }
  }
  return misfit;
}

void write_separators(const Node& node, uint64_t pattern) {
  const at::Tensor& out = node.out;
  const size_t element_size = out.element_size();
  const int64_t token = c10::multiply_integers(out.sizes().slice(2));
  auto* base = static_cast<unsigned char*>(out.data_ptr());
  CopyJobs jobs;
  for (size_t b = 0; b + 1 < node.starts.size(); ++b) {
    if (node.starts[b] < node.starts[b + 1]) {  // an empty sample has no first token
      jobs.fills.push_back({base + static_cast<size_t>(node.starts[b] * token) * element_size,
                            static_cast<size_t>(token), element_size, pattern});
    }
  }
  jobs.run();
}

// Gathers one column into its node's views.
void gather_column(const ColumnFill& fill, const at::Tensor& indices) {
  const GatheredColumn& column = *fill.column;
  Node& node = *fill.node;
  switch (column.kind) {
    case Kind::Rows:
      gather_into_cpu(column.rows, indices, node.out);
      return;
    case Kind::Ragged: {
      const double pad = node.padded ? *column.field->pad_value : 0;
      if (node.padded) {
        gather_ragged_into_cpu(column.values, column.offsets, indices, pad, node.out, node.mask->out,
                               node.lengths->out);
      } else {  // rows of one length: the mask and lengths are the gather's scratch
        const int64_t size = indices.numel();
        gather_ragged_into_cpu(column.values, column.offsets, indices, pad, node.out,
                               at::detail::empty_cpu({size, node.out.size(1)}, at::kBool),
                               at::detail::empty_cpu({size}, at::kLong));
      }
      return;
    }
    case Kind::Packed: {
      std::vector<int32_t> cu(node.starts.begin(), node.starts.end());
      const at::Tensor cu_seq_lens = at::from_blob(cu.data(), {static_cast<int64_t>(cu.size())}, at::kInt);
      gather_packed_into_cpu(column.values, column.offsets, indices, cu_seq_lens, node.out.select(0, 0));
      return;
    }
    case Kind::Ids:
      return;
  }
}

}  // namespace

ColumnGather::ColumnGather(std::vector<GatheredColumn> columns, int64_t length, std::string id_key,
                           bool ids_are_indices) {
  auto shared = std::make_shared<Shared>();
  shared->columns = std::move(columns);
  shared->length = length;
  shared->id_key = std::move(id_key);
  shared->ids_are_indices = ids_are_indices;
  for (const auto& column : shared->columns) {
    if (column.kind == Kind::Ragged || column.kind == Kind::Packed) {
      TORCH_CHECK(column.offsets.scalar_type() == at::kLong && column.offsets.dim() == 1 &&
                      column.offsets.numel() >= 1 && column.offsets.is_contiguous() && column.values.dim() >= 1,
                  "ColumnGather: column '", column.key, "' needs int64 offsets and values with a leading dim");
    }
    const int64_t rows = column.kind == Kind::Rows  ? column.rows.dim() >= 1 ? column.rows.size(0) : -1
                         : column.kind == Kind::Ids ? length
                                                    : column.offsets.numel() - 1;
    TORCH_CHECK(rows == length, "ColumnGather: column '", column.key, "' has ", rows, " rows, the dataset ", length);
  }
  shared_ = std::move(shared);
}

py::object ColumnGather::plan(const at::Tensor& indices) const {
  TORCH_CHECK(
      indices.device().is_cpu() && indices.scalar_type() == at::kLong && indices.dim() == 1 && indices.is_contiguous(),
      "ColumnGather.plan: indices must be a contiguous 1-D int64 CPU tensor");
  const Shared& shared = *shared_;
  const int64_t size = indices.numel();
  TORCH_CHECK(size > 0, "ColumnGather.plan: an empty batch has no rows to lay out");
  // ArrayBatch has named any bad index; this keeps the reads below inside the columns whoever calls.
  const int64_t outside = first_index_outside(indices, shared.length);
  TORCH_CHECK_INDEX(outside < 0, "ColumnGather.plan: index ", outside < 0 ? 0 : indices[outside].item<int64_t>(),
                    " (batch position ", outside, ") is out of range for ", shared.length, " rows");
  const int64_t* index = indices.const_data_ptr<int64_t>();
  auto refuse = [&](const Violation& violation, size_t position, const std::string& key) {
    raise_violation(violation, sample_at(shared.ids_are_indices, shared.id_key, index, position), position, key,
                    shared.id_key);
  };
  auto plan = std::make_shared<BatchPlan>();
  auto root = std::make_unique<Node>();
  root->kind = Node::Kind::Dict;
  std::vector<ColumnFill> fills;
  std::unordered_map<std::string, std::pair<int64_t, std::string>> named;  // dim name -> size, its field
  std::vector<int64_t> packed_lengths;
  std::vector<int64_t> starts;
  bool packing_keys_laid_out = false;
  for (const GatheredColumn& column : shared.columns) {
    const FieldSpec* field = column.field ? &*column.field : nullptr;
    const at::Tensor& source = column.kind == Kind::Rows ? column.rows : column.values;
    std::unique_ptr<Node> node;
    std::vector<int64_t> lengths;
    if (column.kind == Kind::Ids) {
      node = laid_out(*plan, column.key, Node::Kind::Numbers, at::kLong, {size});
      node->ints.assign(index, index + size);
      root->keys.push_back(py::str(column.key));
      root->children.push_back(std::move(node));
      continue;
    }
    if (column.kind != Kind::Rows) {
      // The batch is laid out by its rows' lengths: their spans are checked first, as the gather checks
      // them (the offsets may have changed since the column was made), the error naming the column.
      const std::string where = "Arrays: column '" + column.key + "'";
      check_ragged_rows(column.values, column.offsets, indices, where.c_str());
      lengths = row_lengths(column, index, size);
    }
    if (field != nullptr) {
      // Every row of a column has its dtype, and every row of a rows column its shape: sample 0 stands
      // for all (a ragged column's rows differ only along the padded or packed dim).
      if (auto violation = dtype_rule(*field, column.dtype, source.scalar_type())) {
        refuse(*violation, 0, column.key);
      }
      std::vector<int64_t> sample_shape(source.sizes().begin(), source.sizes().end());
      sample_shape[0] = column.kind == Kind::Rows ? sample_shape[0] : lengths[0];
      const at::IntArrayRef sample =
          column.kind == Kind::Rows ? at::IntArrayRef(sample_shape).slice(1) : at::IntArrayRef(sample_shape);
      if (field->shape) {
        if (auto violation = declared_shape_rule(*field, sample)) {
          refuse(*violation, 0, column.key);
        }
        for (size_t d = 0; d < field->dim_names.size(); ++d) {
          const std::string& name = field->dim_names[d];
          if (name.empty() || column.kind != Kind::Rows) {
            continue;  // a ragged column's named dim is its padded or packed one, shared with no other
          }
          auto [known, first] = named.emplace(name, std::make_pair(sample[d], column.key));
          if (!first && known->second.first != sample[d]) {
            refuse(named_dim_misfit(name, known->second.first, known->second.second, sample[d]), 0, column.key);
          }
        }
      }
      if (field->range) {
        // As the walk: a sample with no element has no value to order, so the first one with some is named.
        const int64_t row_elements = c10::multiply_integers(source.sizes().slice(1));
        const auto has_elements = [&](int64_t b) { return row_elements > 0 && (lengths.empty() || lengths[b] > 0); };
        int64_t first = 0;
        while (first < size && !has_elements(first)) {
          ++first;
        }
        if (first < size) {
          if (auto violation = range_dtype_rule(source.scalar_type())) {
            refuse(*violation, static_cast<size_t>(first), column.key);
          }
        }
      }
    }
    const at::IntArrayRef inner = source.sizes().slice(1);
    if (column.kind == Kind::Rows) {
      std::vector<int64_t> shape{size};
      shape.insert(shape.end(), inner.begin(), inner.end());
      node = laid_out(*plan, column.key, Node::Kind::Tensor, column.dtype, std::move(shape));
    } else if (column.kind == Kind::Ragged && (field == nullptr || !field->padded())) {
      if (std::adjacent_find(lengths.begin(), lengths.end(), std::not_equal_to<>()) != lengths.end()) {
        return py::none();  // unequal rows, no pad: the per-sample path names the first misfit
      }
      node = laid_out(*plan, column.key, Node::Kind::Tensor, column.dtype, with_rows(size, lengths[0], inner));
      lengths.clear();  // every row whole
    } else if (column.kind == Kind::Ragged) {
      if (auto violation = fill_value_rule(*field->pad_value, column.dtype, "pad",
                                           "declare a pad value the field's dtype can hold")) {
        refuse(*violation, 0, column.key);
      }
      const int64_t longest = *std::max_element(lengths.begin(), lengths.end());
      node = laid_out(*plan, column.key, Node::Kind::Tensor, column.dtype, with_rows(size, longest, inner));
      node->padded = true;
      node->mask_name = field->mask_name;
      node->lengths_name = field->lengths_name;
      node->mask = laid_out(*plan, column.key, Node::Kind::Numbers, field->mask_dtype, {size, longest});
      node->lengths = laid_out(*plan, column.key, Node::Kind::Numbers, at::kLong, {size});
      node->lengths->ints = lengths;
    } else {  // Packed
      if (packed_lengths.empty()) {
        packed_lengths = lengths;
        starts.assign(static_cast<size_t>(size) + 1, 0);
        for (int64_t b = 0; b < size; ++b) {
          starts[b + 1] = starts[b] + lengths[b];
        }
        const int64_t total = starts.back();
        if (total == 0 || total > kMaxPackedTokens || (field->max_tokens > 0 && total > field->max_tokens)) {
          return py::none();  // the walk names the sample that crosses the limit
        }
      } else if (lengths != packed_lengths) {
        return py::none();  // the walk names the sample whose packed fields differ in length
      }
      if (field->separator) {
        if (auto violation = fill_value_rule(*field->separator, column.dtype, "separator",
                                             "declare a separator the field's dtype can hold")) {
          refuse(*violation, 0, column.key);
        }
      }
      std::vector<int64_t> shape{1, starts.back()};
      shape.insert(shape.end(), inner.begin(), inner.end());
      node = laid_out(*plan, column.key, Node::Kind::Tensor, column.dtype, std::move(shape));
      node->packed = true;
      node->starts = starts;
      if (!packing_keys_laid_out) {  // the first packed field builds the keys beside; the others share them
        packing_keys_laid_out = true;
        node->max_length = *std::max_element(lengths.begin(), lengths.end());
        node->position_ids_name = field->position_ids_name;
        node->position_ids_start = field->position_ids_start;
        node->seq_idx_name = field->seq_idx_name;
        node->cu_seq_lens_names = field->cu_seq_lens_names;
        node->max_length_names = field->max_length_names;
        const int64_t total = starts.back();
        if (!field->position_ids_name.empty()) {
          node->position_ids = laid_out(*plan, column.key, Node::Kind::Numbers, at::kLong, {1, total});
        }
        if (!field->seq_idx_name.empty()) {
          node->seq_idx = laid_out(*plan, column.key, Node::Kind::Numbers, at::kInt, {1, total});
        }
        if (!field->cu_seq_lens_names.empty()) {
          node->cu_seq_lens = laid_out(*plan, column.key, Node::Kind::Numbers, at::kInt, {size + 1});
          node->cu_seq_lens->ints = starts;
        }
      }
    }
    node->gathered = true;
    fills.push_back({&column, node.get(), std::move(lengths)});
    root->keys.push_back(py::str(column.key));
    root->children.push_back(std::move(node));
  }
  plan->root = std::move(root);
  BatchPlan* self = plan.get();  // the fill lives in the plan: a shared_ptr to it would be a cycle
  plan->fill_gathered = [self, shared = shared_, indices, fills = std::move(fills)]() {
    const int64_t* index = indices.const_data_ptr<int64_t>();
    for (const ColumnFill& fill : fills) {
      const GatheredColumn& column = *fill.column;
      try {
        py::gil_scoped_release no_gil;  // the copy touches no Python object
        gather_column(fill, indices);
      } catch (...) {
        self->failed_key = column.key;  // the caller names the column, and its file when a read faulted
        throw;
      }
      const FieldSpec* field = column.field ? &*column.field : nullptr;
      if (field != nullptr && field->range) {
        const RangeMisfit misfit = first_range_misfit(fill, *field->range);
        if (misfit.position >= 0) {
          const size_t position = static_cast<size_t>(misfit.position);
          raise_violation(range_misfit(*field->range, misfit.flat, misfit.value),
                          sample_at(shared->ids_are_indices, shared->id_key, index, position), position, column.key,
                          shared->id_key);
        }
      }
      if (column.kind == Kind::Packed && field->separator) {  // after the range: it checks the samples' own tokens
        write_separators(*fill.node, element_pattern(*field->separator, column.dtype));
      }
    }
  };
  return py::cast(std::static_pointer_cast<BatchPlan>(plan));
}

int64_t first_index_outside(const at::Tensor& indices, int64_t length) {
  TORCH_CHECK(
      indices.device().is_cpu() && indices.scalar_type() == at::kLong && indices.dim() == 1 && indices.is_contiguous(),
      "first_index_outside: indices must be a contiguous 1-D int64 CPU tensor");
  const int64_t* index = indices.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < indices.numel(); ++b) {
    if (index[b] < 0 || index[b] >= length) {
      return b;
    }
  }
  return -1;
}

}  // namespace fastcollate

// The column gather's plan: a batch laid out column by column (each row's span found in its chunk, the
// contract's rules checked per column, one node per column), or handed to the walk. Its fill, which copies
// the rows in once the buffer exists, is column_fill.cpp.
#include "collate/column_gather.h"

#include <ATen/Dispatch_v2.h>

#include <algorithm>
#include <functional>
#include <optional>
#include <type_traits>
#include <unordered_map>
#include <utility>

#include "collate/batch_indices.h"
#include "collate/column_fill.h"
#include "collate/contract_rules.h"
#include "collate/node.h"
#include "fill/gather_kernels.h"
#include "fill/padded_rows.h"

namespace fastcollate {

struct ColumnGather::Shared {
  std::vector<GatheredColumn> columns;
  int64_t length = 0;
  int64_t rows = 0;    // each column's: `length`, or the rows `rows_of` maps into
  at::Tensor rows_of;  // int64 [length]: sample i is row rows_of[i] of every column; undefined for i
  std::string id_key;
  bool ids_are_indices = false;
  std::shared_ptr<const void> keepalive;  // the owner of chunks whose tensors do not own their memory
};

namespace {

using Kind = GatheredColumn::Kind;

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

// Where the rows `index` of `column` lie: each row's chunk (the last chunk starting at or before it), and
// there its bytes, and for a ragged column its span, checked within the chunk's values as the gathers check
// theirs (the offsets may have changed since the column was made), the error naming the column.
RowSpans spans_of(const GatheredColumn& column, const int64_t* index, int64_t size) {
  RowSpans spans;
  spans.data.resize(static_cast<size_t>(size));
  if (column.kind != Kind::Rows) {
    spans.lengths.resize(static_cast<size_t>(size));
  }
  const std::string where = "Arrays: column '" + column.key + "'";
  const std::vector<int64_t>& starts = column.starts;
  const size_t last = column.views.size() - 1;
  for (int64_t b = 0; b < size; ++b) {
    // Even chunks (as Arrow writes them): the row's chunk is a division; else, or when the guess is off
    // (an uneven or empty chunk before it), the last chunk that starts at or before it.
    size_t chunk = column.chunk_rows > 0 ? std::min(static_cast<size_t>(index[b] / column.chunk_rows), last) : 0;
    if (!(starts[chunk] <= index[b] && index[b] < starts[chunk + 1])) {
      chunk = static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), index[b]) - starts.begin() - 1);
    }
    const GatheredColumn::ChunkView& view = column.views[chunk];
    const int64_t row = index[b] - starts[chunk];
    if (column.kind == Kind::Rows) {
      spans.data[b] = view.base + row * view.step_bytes;
      continue;
    }
    const int64_t start = view.offsets[row];
    const int64_t stop = view.offsets[row + 1];
    check_row_span(start, stop, view.positions, where.c_str(), index[b], b);
    spans.data[b] = view.base + start * view.step_bytes;
    spans.lengths[b] = stop - start;
  }
  return spans;
}

std::vector<int64_t> with_rows(int64_t rows, int64_t row_length, at::IntArrayRef inner) {
  std::vector<int64_t> shape{rows, row_length};
  shape.insert(shape.end(), inner.begin(), inner.end());
  return shape;
}

}  // namespace

// Who a sample is, for make_error, as the walk names it: its id under the collate's id key, which is its
// index when the dataset's id key is that one, or the row of a column of integers under that key.
py::object sample_at(const std::vector<GatheredColumn>& columns, bool ids_are_indices, const std::string& id_key,
                     const int64_t* index, const int64_t* read, size_t position) {
  py::object id;
  if (ids_are_indices) {
    id = py::int_(index[position]);
  }
  for (const GatheredColumn& column : columns) {
    const at::Tensor& source = column.source();
    if (ids_are_indices || column.key != id_key || column.kind != Kind::Rows || source.dim() != 1 ||
        !at::isIntegralType(source.scalar_type(), /*includeBool=*/true)) {
      continue;
    }
    const void* row = spans_of(column, read + position, 1).data[0];
    AT_DISPATCH_V2(source.scalar_type(), "sample_at", AT_WRAP([&] {
                     const scalar_t value = *static_cast<const scalar_t*>(row);
                     if constexpr (std::is_same_v<scalar_t, bool>) {
                       id = py::bool_(value);
                     } else {
                       id = py::int_(value);
                     }
                   }),
                   AT_EXPAND(AT_INTEGRAL_TYPES), at::kBool, AT_EXPAND(AT_BAREBONES_UNSIGNED_TYPES));
  }
  if (!id) {
    return py::none();
  }
  py::dict batch;
  py::dict sample;
  sample[py::str(id_key)] = id;
  batch[py::int_(position)] = sample;
  return std::move(batch);
}

ColumnGather::ColumnGather(std::vector<GatheredColumn> columns, int64_t length, std::string id_key,
                           bool ids_are_indices, std::optional<at::Tensor> rows_of,
                           std::shared_ptr<const void> keepalive) {
  auto shared = std::make_shared<Shared>();
  shared->keepalive = std::move(keepalive);
  shared->columns = std::move(columns);
  shared->length = length;
  shared->rows = length;
  if (rows_of) {
    TORCH_CHECK(rows_of->device().is_cpu() && rows_of->scalar_type() == at::kLong && rows_of->dim() == 1 &&
                    rows_of->is_contiguous() && rows_of->numel() == length,
                "ColumnGather: rows_of must be a contiguous 1-D int64 CPU tensor of one row per sample");
    shared->rows_of = *rows_of;
    shared->rows = -1;  // every column's, checked below; each entry is checked against it per batch
  }
  shared->id_key = std::move(id_key);
  shared->ids_are_indices = ids_are_indices;
  for (auto& column : shared->columns) {
    if (column.kind == Kind::Ids) {
      continue;
    }
    const std::vector<at::Tensor>& chunks = column.kind == Kind::Rows ? column.rows : column.values;
    TORCH_CHECK(!chunks.empty() && (column.kind == Kind::Rows || column.offsets.size() == chunks.size()),
                "ColumnGather: column '", column.key, "' needs at least one chunk, and offsets for each");
    column.starts.assign(1, 0);
    column.views.clear();
    for (size_t c = 0; c < chunks.size(); ++c) {
      const at::Tensor& chunk = chunks[c];
      TORCH_CHECK(chunk.device().is_cpu() && chunk.dim() >= 1 && chunk.scalar_type() == chunks[0].scalar_type() &&
                      chunk.sizes().slice(1) == chunks[0].sizes().slice(1) && !chunk.is_conj() && !chunk.is_neg(),
                  "ColumnGather: column '", column.key, "': chunk ", c, " (", chunk.scalar_type(), " of shape ",
                  chunk.sizes(), ") is not a CPU tensor of the first chunk's dtype and inner dims");
      TORCH_CHECK(column.kind == Kind::Rows ? rows_are_contiguous(chunk) : chunk.is_contiguous(),
                  "ColumnGather: column '", column.key, "': the rows of chunk ", c, " are not contiguous");
      int64_t rows = chunk.size(0);
      if (column.kind != Kind::Rows) {
        const at::Tensor& offsets = column.offsets[c];
        TORCH_CHECK(offsets.device().is_cpu() && offsets.scalar_type() == at::kLong && offsets.dim() == 1 &&
                        offsets.numel() >= 1 && offsets.is_contiguous(),
                    "ColumnGather: column '", column.key, "': the offsets of chunk ", c,
                    " must be a contiguous 1-D int64 CPU tensor");
        rows = offsets.numel() - 1;
      }
      column.starts.push_back(column.starts.back() + rows);
      column.views.push_back({static_cast<const unsigned char*>(chunk.const_data_ptr()),
                              chunk.stride(0) * static_cast<int64_t>(chunk.element_size()),
                              column.kind == Kind::Rows ? nullptr : column.offsets[c].const_data_ptr<int64_t>(),
                              chunk.size(0)});
    }
    column.chunk_rows = column.starts[1];
    if (shared->rows < 0) {
      shared->rows = column.starts.back();
    }
    TORCH_CHECK(column.starts.back() == shared->rows, "ColumnGather: column '", column.key, "' has ",
                column.starts.back(), " rows, another ", shared->rows);
  }
  shared_ = std::move(shared);
}

namespace {

// What laying out one batch carries from column to column: the plan it reserves in, the batch's indices
// and the rows they read, the sizes of named dims so far, and the packed fields' shared layout.
struct BatchLayout {
  const std::vector<GatheredColumn>& columns;
  const std::string& id_key;
  bool ids_are_indices;
  BatchPlan& plan;
  int64_t size;
  const int64_t* index;  // the batch's indices: who each sample is
  const int64_t* read;   // the rows they read: a column under the id key names a sample by its row
  std::unordered_map<std::string, std::pair<int64_t, std::string>> named;  // dim name -> size, its field
  std::vector<int64_t> packed_lengths;  // the first packed field's rows' lengths, which every other must have
  std::vector<int64_t> starts;          // each packed row's first token, then the total
  bool packing_keys_laid_out = false;
  const char* handed_over = nullptr;  // why a column's node was refused: the case plan_rows returns

  // No node: the batch goes to the per-sample walk, for `reason` (a key of HANDED_TO_THE_WALK).
  std::unique_ptr<Node> handed_to_the_walk(const char* reason) {
    handed_over = reason;
    return nullptr;
  }

  [[noreturn]] void refuse(const Violation& violation, size_t position, const std::string& key) const {
    raise_violation(violation, sample_at(columns, ids_are_indices, id_key, index, read, position), position, key,
                    id_key);
  }
};

// A rule a column broke before anything is laid out, and the batch position of the sample named.
struct Misfit {
  Violation violation;
  size_t position;
};

// The rules a column's rows meet before anything is laid out: dtype, declared shape, named dims and the
// range's dtype. Every row of a column has its dtype, and every row of a rows column its shape: sample 0
// stands for all (a ragged column's rows differ only along the padded or packed dim).
std::optional<Misfit> column_misfit(BatchLayout& layout, const GatheredColumn& column, const FieldSpec& field,
                                    const std::vector<int64_t>& lengths) {
  const at::Tensor& source = column.source();
  if (auto violation = dtype_rule(field, column.dtype, source.scalar_type())) {
    return Misfit{*violation, 0};
  }
  std::vector<int64_t> sample_shape(source.sizes().begin(), source.sizes().end());
  sample_shape[0] = column.kind == Kind::Rows ? sample_shape[0] : lengths[0];
  const at::IntArrayRef sample =
      column.kind == Kind::Rows ? at::IntArrayRef(sample_shape).slice(1) : at::IntArrayRef(sample_shape);
  if (field.shape) {
    if (auto violation = declared_shape_rule(field, sample)) {
      return Misfit{*violation, 0};
    }
    for (size_t d = 0; d < field.dim_names.size(); ++d) {
      const std::string& name = field.dim_names[d];
      if (name.empty() || column.kind != Kind::Rows) {
        continue;  // a ragged column's named dim is its padded or packed one, shared with no other
      }
      auto [known, first] = layout.named.emplace(name, std::make_pair(sample[d], column.key));
      if (!first && known->second.first != sample[d]) {
        return Misfit{named_dim_misfit(name, known->second.first, known->second.second, sample[d]), 0};
      }
    }
  }
  if (field.range) {
    // As the walk: a sample with no element has no value to order, so the first one with some is named.
    const int64_t row_elements = c10::multiply_integers(source.sizes().slice(1));
    const auto has_elements = [&](int64_t b) { return row_elements > 0 && (lengths.empty() || lengths[b] > 0); };
    int64_t first = 0;
    while (first < layout.size && !has_elements(first)) {
      ++first;
    }
    if (first < layout.size) {
      if (auto violation = range_dtype_rule(source.scalar_type())) {
        return Misfit{*violation, static_cast<size_t>(first)};
      }
    }
  }
  return std::nullopt;
}

// Ids: the batch's indices, int64 [N], known now (no fill).
std::unique_ptr<Node> ids_node(BatchLayout& layout, const GatheredColumn& column) {
  auto node = laid_out(layout.plan, column.key, Node::Kind::Numbers, at::kLong, {layout.size});
  node->ints.assign(layout.index, layout.index + layout.size);
  return node;
}

// Rows: [N, *row].
std::unique_ptr<Node> rows_node(BatchLayout& layout, const GatheredColumn& column) {
  const at::IntArrayRef inner = column.source().sizes().slice(1);
  std::vector<int64_t> shape{layout.size};
  shape.insert(shape.end(), inner.begin(), inner.end());
  return laid_out(layout.plan, column.key, Node::Kind::Tensor, column.dtype, std::move(shape));
}

// Ragged under no pad: [N, length, *inner] when every row has one length (then `lengths` is cleared: every
// row whole), else none: the per-sample path names the first misfit.
std::unique_ptr<Node> ragged_node(BatchLayout& layout, const GatheredColumn& column, std::vector<int64_t>& lengths) {
  if (std::adjacent_find(lengths.begin(), lengths.end(), std::not_equal_to<>()) != lengths.end()) {
    return layout.handed_to_the_walk("ragged rows of unequal length without a pad");
  }
  auto node = laid_out(layout.plan, column.key, Node::Kind::Tensor, column.dtype,
                       with_rows(layout.size, lengths[0], column.source().sizes().slice(1)));
  lengths.clear();
  return node;
}

// Ragged under a pad: [N, padded length, *inner], with its mask and lengths beside.
std::unique_ptr<Node> padded_node(BatchLayout& layout, const GatheredColumn& column, const FieldSpec& field,
                                  const std::vector<int64_t>& lengths) {
  if (!value_fits(*field.pad_value, column.dtype)) {
    return layout.handed_to_the_walk("a pad or separator the dtype cannot hold");
  }
  const int64_t longest = padded_length(*std::max_element(lengths.begin(), lengths.end()), field.pad_to_multiple_of);
  TORCH_INTERNAL_ASSERT(longest >= 0, "rows within their values cannot pass int64 when rounded up");
  auto node = laid_out(layout.plan, column.key, Node::Kind::Tensor, column.dtype,
                       with_rows(layout.size, longest, column.source().sizes().slice(1)));
  node->padded = true;
  node->pad_left = field.pad_left;
  node->mask_name = field.mask_name;
  node->lengths_name = field.lengths_name;
  node->mask = laid_out(layout.plan, column.key, Node::Kind::Numbers, field.mask_dtype, {layout.size, longest});
  node->lengths = laid_out(layout.plan, column.key, Node::Kind::Numbers, at::kLong, {layout.size});
  return node;
}

// Packed: [1, total, *inner], the first packed field with the contract's Packing keys beside; none when the
// walk must name a sample (a total past the limit, packed fields of different lengths).
std::unique_ptr<Node> packed_node(BatchLayout& layout, const GatheredColumn& column, const FieldSpec& field,
                                  const std::vector<int64_t>& lengths) {
  if (layout.packed_lengths.empty()) {
    layout.packed_lengths = lengths;
    layout.starts.assign(static_cast<size_t>(layout.size) + 1, 0);
    for (int64_t b = 0; b < layout.size; ++b) {
      layout.starts[b + 1] = layout.starts[b] + lengths[b];
    }
    const int64_t total = layout.starts.back();
    if (total == 0) {
      return layout.handed_to_the_walk("a packed batch with no token");
    }
    if (total > kMaxPackedTokens || (field.max_tokens > 0 && total > field.max_tokens)) {
      return layout.handed_to_the_walk("a packed batch past cu_seq_lens' int32 or Packing.max_tokens");
    }
  } else if (lengths != layout.packed_lengths) {
    return layout.handed_to_the_walk("packed fields whose rows differ in length");
  }
  if (field.separator && !value_fits(*field.separator, column.dtype)) {
    return layout.handed_to_the_walk("a pad or separator the dtype cannot hold");
  }
  const int64_t total = layout.starts.back();
  const at::IntArrayRef inner = column.source().sizes().slice(1);
  std::vector<int64_t> shape{1, total};
  shape.insert(shape.end(), inner.begin(), inner.end());
  auto node = laid_out(layout.plan, column.key, Node::Kind::Tensor, column.dtype, std::move(shape));
  node->packed = true;
  node->starts = layout.starts;
  if (!layout.packing_keys_laid_out) {  // the first packed field builds the keys beside; the others share them
    layout.packing_keys_laid_out = true;
    node->max_length = *std::max_element(lengths.begin(), lengths.end());
    node->position_ids_name = field.position_ids_name;
    node->position_ids_start = field.position_ids_start;
    node->seq_idx_name = field.seq_idx_name;
    node->cu_seq_lens_names = field.cu_seq_lens_names;
    node->max_length_names = field.max_length_names;
    if (!field.position_ids_name.empty()) {
      node->position_ids = laid_out(layout.plan, column.key, Node::Kind::Numbers, at::kLong, {1, total});
    }
    if (!field.seq_idx_name.empty()) {
      node->seq_idx = laid_out(layout.plan, column.key, Node::Kind::Numbers, at::kInt, {1, total});
    }
    if (!field.cu_seq_lens_names.empty()) {
      node->cu_seq_lens = laid_out(layout.plan, column.key, Node::Kind::Numbers, at::kInt, {layout.size + 1});
    }
  }
  return node;
}

}  // namespace

py::object ColumnGather::plan(const at::Tensor& indices) const { return plan_rows(indices, /*in_order=*/false); }

py::object ColumnGather::plan_in_order() const {
  TORCH_CHECK(!shared_->rows_of.defined(), "ColumnGather.plan_in_order: the rows are read through rows_of");
  return plan_rows(at::arange(shared_->length, at::kLong), /*in_order=*/true);
}

py::object ColumnGather::plan_rows(const at::Tensor& indices, bool in_order) const {
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
  // The rows the batch reads: its indices, or the rows they map to (a shuffled or selected dataset).
  std::vector<int64_t> mapped;
  const int64_t* read = index;
  if (shared.rows_of.defined()) {
    const int64_t* rows_of = shared.rows_of.const_data_ptr<int64_t>();
    mapped.resize(static_cast<size_t>(size));
    for (int64_t b = 0; b < size; ++b) {
      mapped[b] = rows_of[index[b]];
      TORCH_CHECK_INDEX(0 <= mapped[b] && mapped[b] < shared.rows, "ColumnGather.plan: sample ", index[b],
                        " (batch position ", b, ") maps to row ", mapped[b], ", outside the ", shared.rows,
                        " rows of its columns");
    }
    read = mapped.data();
  }
  auto plan = std::make_shared<BatchPlan>();
  BatchLayout layout{shared.columns, shared.id_key, shared.ids_are_indices, *plan, size, index, read};
  auto root = std::make_unique<Node>();
  root->kind = Node::Kind::Dict;
  std::vector<ColumnFill> fills;
  bool ranged_before = false;  // whether a column laid out so far has a range, checked once it is filled
  for (const GatheredColumn& column : shared.columns) {
    if (column.kind == Kind::Ids) {
      root->keys.push_back(py::str(column.key));
      root->children.push_back(ids_node(layout, column));
      continue;
    }
    const FieldSpec* field = column.field ? &*column.field : nullptr;
    // The batch is laid out by its rows' lengths: their spans are checked first.
    // In order, a column of rows is copied chunk by chunk: no row needs finding.
    RowSpans rows = in_order && column.kind == Kind::Rows ? RowSpans{} : spans_of(column, read, size);
    std::vector<int64_t> lengths = rows.lengths;
    if (field != nullptr) {
      if (auto misfit = column_misfit(layout, column, *field, lengths)) {
        if (ranged_before) {
          // The walk checks field by field, each one's values before the next field's dtype: an earlier
          // column's range, checked here only once filled, may name a sample first.
          return handed_to_the_walk("a broken dtype, shape or named dim after a column with a range");
        }
        layout.refuse(misfit->violation, misfit->position, column.key);
      }
      ranged_before = ranged_before || field->range.has_value();
    }
    std::unique_ptr<Node> node;
    switch (column.kind) {
      case Kind::Rows:
        node = rows_node(layout, column);
        break;
      case Kind::Ragged:
        node = field != nullptr && field->padded() ? padded_node(layout, column, *field, lengths)
                                                   : ragged_node(layout, column, lengths);
        break;
      case Kind::Packed:
        node = packed_node(layout, column, *field, lengths);
        break;
      case Kind::Ids:
        break;
    }
    if (node == nullptr) {
      return handed_to_the_walk(layout.handed_over);  // the case its node's builder named
    }
    node->gathered = true;
    fills.push_back({&column, node.get(), std::move(rows), std::move(lengths)});
    root->keys.push_back(py::str(column.key));
    root->children.push_back(std::move(node));
  }
  plan->root = std::move(root);
  BatchPlan* self = plan.get();  // the fill lives in the plan: a shared_ptr to it would be a cycle
  plan->fill_gathered = [self, shared = shared_, indices, mapped = std::move(mapped), fills = std::move(fills)]() {
    const int64_t* index = indices.const_data_ptr<int64_t>();
    fill_columns(*self, shared->columns, shared->id_key, shared->ids_are_indices, index,
                 mapped.empty() ? index : mapped.data(), fills);
  };
  return py::cast(std::static_pointer_cast<BatchPlan>(plan));
}

}  // namespace fastcollate

#include "collate/arrow_gather.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <unordered_map>
#include <utility>

#include "collate/arrow_c_data.h"

namespace fastcollate {

namespace {

using Kind = GatheredColumn::Kind;

// The record batches read from one stream. The tensors over their buffers do not own them: the batch's
// ColumnGather keeps this alive until its copy has run, then Arrow's release callbacks free them.
struct StreamArrays {
  std::vector<std::unique_ptr<ArrowArray>> batches;
  StreamArrays() = default;
  StreamArrays(const StreamArrays&) = delete;
  StreamArrays& operator=(const StreamArrays&) = delete;
  ~StreamArrays() {
    for (auto& batch : batches) {
      if (batch->release != nullptr) {
        batch->release(batch.get());
      }
    }
  }
};

struct SchemaHolder {
  ArrowSchema schema{};
  ~SchemaHolder() {
    if (schema.release != nullptr) {
      schema.release(&schema);
    }
  }
};

// The tensor dtype of a primitive Arrow format, or none (booleans are bits, and everything else has no
// tensor dtype: the first table's Arrays refused those, naming the column).
std::optional<at::ScalarType> leaf_dtype(const char* format) {
  if (format[0] == '\0' || format[1] != '\0') {
    return std::nullopt;
  }
  switch (format[0]) {
    case 'c': return at::kChar;
    case 'C': return at::kByte;
    case 's': return at::kShort;
    case 'S': return at::kUInt16;
    case 'i': return at::kInt;
    case 'I': return at::kUInt32;
    case 'l': return at::kLong;
    case 'L': return at::kUInt64;
    case 'e': return at::kHalf;
    case 'f': return at::kFloat;
    case 'g': return at::kDouble;
    default: return std::nullopt;
  }
}

// How a column is laid out, read from its schema: a list on top (its offsets' width in bytes, 0 for none),
// then fixed-size lists, then numbers. Anything else (an extension type, a dictionary, a struct, deeper
// lists) is not, and goes the per-sample way, whose Arrays names it.
struct Layout {
  int offsets_width = 0;
  std::vector<int64_t> fixed;
  at::ScalarType dtype = at::kFloat;
};

std::optional<Layout> layout_of(const ArrowSchema* node) {
  Layout layout;
  if (node->metadata != nullptr) {
    return std::nullopt;  // an extension type (Hugging Face's ArrayXD, Ray's tensors): Arrays knows its shape
  }
  if (std::strcmp(node->format, "+l") == 0 || std::strcmp(node->format, "+L") == 0) {
    layout.offsets_width = node->format[1] == 'l' ? 4 : 8;
    if (node->n_children != 1 || node->dictionary != nullptr) {
      return std::nullopt;
    }
    node = node->children[0];
  }
  while (std::strncmp(node->format, "+w:", 3) == 0) {
    if (node->n_children != 1 || node->dictionary != nullptr) {
      return std::nullopt;
    }
    layout.fixed.push_back(std::atoll(node->format + 3));
    node = node->children[0];
  }
  const auto dtype = leaf_dtype(node->format);
  if (!dtype || node->n_children != 0 || node->dictionary != nullptr) {
    return std::nullopt;
  }
  layout.dtype = *dtype;
  return layout;
}

// The first null among `count` values of `array` from logical position `begin`, or -1. Costs nothing when
// Arrow counted no null.
int64_t first_null(const ArrowArray* array, int64_t begin, int64_t count) {
  if (array->null_count == 0 || array->n_buffers < 1 || array->buffers[0] == nullptr) {
    return -1;
  }
  const auto* bits = static_cast<const uint8_t*>(array->buffers[0]);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t bit = array->offset + begin + i;
    if (((bits[bit >> 3] >> (bit & 7)) & 1) == 0) {
      return begin + i;
    }
  }
  return -1;
}

int64_t offset_at(const ArrowArray* list, int width, int64_t i) {
  const void* offsets = list->buffers[1];
  const int64_t at = list->offset + i;
  return width == 4 ? static_cast<const int32_t*>(offsets)[at] : static_cast<const int64_t*>(offsets)[at];
}

// The row of `column` (one chunk's array, laid out as `layout`) that holds its first null at any level,
// or -1: each level's visible values are searched, and a null found below is traced back to its row.
int64_t row_with_null(const ArrowArray* column, const Layout& layout) {
  struct Level {
    const ArrowArray* array;
    int64_t begin, end;  // the visible logical positions
  };
  std::vector<Level> levels{{column, 0, column->length}};
  const ArrowArray* node = column;
  if (layout.offsets_width != 0) {
    const ArrowArray* values = node->children[0];
    levels.push_back({values, offset_at(node, layout.offsets_width, 0),
                      offset_at(node, layout.offsets_width, node->length)});
    node = values;
  }
  for (const int64_t size : layout.fixed) {
    const Level& above = levels.back();
    const ArrowArray* values = node->children[0];
    levels.push_back({values, (node->offset + above.begin) * size, (node->offset + above.end) * size});
    node = values;
  }
  for (size_t depth = 0; depth < levels.size(); ++depth) {
    int64_t position = first_null(levels[depth].array, levels[depth].begin, levels[depth].end - levels[depth].begin);
    if (position < 0) {
      continue;
    }
    for (size_t up = depth; up > 0; --up) {  // back to the row: through each level above
      const ArrowArray* parent = levels[up - 1].array;
      const bool is_list = layout.offsets_width != 0 && up == 1;
      if (is_list) {
        int64_t lo = levels[0].begin;
        int64_t hi = levels[0].end;  // the last row whose first offset is at or before position
        while (lo + 1 < hi) {
          const int64_t mid = (lo + hi) / 2;
          (offset_at(parent, layout.offsets_width, mid) <= position ? lo : hi) = mid;
        }
        position = lo;
      } else {
        const int64_t size = layout.fixed[up - 1 - (layout.offsets_width != 0 ? 1 : 0)];
        position = position / size - parent->offset;
      }
    }
    return position;
  }
  return -1;
}

// The physical start (in the leaf's elements) of logical position `position` of `array`, through the
// fixed-size levels below it, and that leaf.
std::pair<const ArrowArray*, int64_t> leaf_start(const ArrowArray* array, int64_t position, size_t fixed_levels,
                                                 const std::vector<int64_t>& fixed) {
  int64_t physical = array->offset + position;
  for (size_t level = 0; level < fixed_levels; ++level) {
    array = array->children[0];
    physical = physical * fixed[level] + array->offset;
  }
  return {array, physical};
}

at::Tensor view_of(const ArrowArray* leaf, int64_t start, std::vector<int64_t> shape, at::ScalarType dtype) {
  const auto* data = static_cast<const unsigned char*>(leaf->n_buffers > 1 ? leaf->buffers[1] : nullptr);
  void* first = data == nullptr ? nullptr : const_cast<unsigned char*>(data + start * c10::elementSize(dtype));
  return at::from_blob(first, shape, at::TensorOptions().dtype(dtype));
}

}  // namespace

ArrowGather::ArrowGather(std::vector<GatheredColumn> columns, std::vector<std::string> sources, std::string id_key,
                         std::string who)
    : columns_(std::move(columns)), sources_(std::move(sources)), id_key_(std::move(id_key)), who_(std::move(who)) {
  TORCH_CHECK(columns_.size() == sources_.size(), "ArrowGather: one source column for each gathered column");
  for (GatheredColumn& column : columns_) {
    TORCH_CHECK(column.kind != Kind::Ids, "ArrowGather: a table's batch has no ids column");
    const at::Tensor& source = column.source();
    stored_.push_back(source.scalar_type());
    inner_.push_back(source.sizes().slice(1).vec());
    // Only the layout is kept: the first table's buffers (in Ray's object store) are not held.
    column.rows.clear();
    column.values.clear();
    column.offsets.clear();
  }
}

py::object ArrowGather::plan(const py::capsule& capsule) const {
  auto* stream = static_cast<ArrowArrayStream*>(PyCapsule_GetPointer(capsule.ptr(), "arrow_array_stream"));
  if (stream == nullptr) {
    throw py::error_already_set();
  }
  TORCH_CHECK(stream->release != nullptr, "ArrowGather.plan: the Arrow stream was already consumed");
  SchemaHolder schema;
  if (stream->get_schema(stream, &schema.schema) != 0) {
    const char* why = stream->get_last_error(stream);
    TORCH_CHECK(false, who_, ": reading the table's schema failed: ", why ? why : "no reason given");
  }
  auto arrays = std::make_shared<StreamArrays>();
  while (true) {
    auto batch = std::make_unique<ArrowArray>();
    if (stream->get_next(stream, batch.get()) != 0) {
      const char* why = stream->get_last_error(stream);
      TORCH_CHECK(false, who_, ": reading the table's record batches failed: ", why ? why : "no reason given");
    }
    if (batch->release == nullptr) {
      break;  // the end of the stream
    }
    const bool empty = batch->length == 0;
    arrays->batches.push_back(std::move(batch));
    if (empty) {
      arrays->batches.pop_back();  // released as it goes
    }
  }
  stream->release(stream);  // its batches hold their own buffers
  if (arrays->batches.empty()) {
    return py::none();
  }
  std::unordered_map<std::string, int64_t> by_name;
  for (int64_t c = 0; c < schema.schema.n_children; ++c) {
    by_name.emplace(schema.schema.children[c]->name, c);
  }
  std::vector<GatheredColumn> columns = columns_;
  int64_t total = 0;
  for (const auto& batch : arrays->batches) {
    TORCH_CHECK(batch->offset == 0, who_, ": a record batch at offset ", batch->offset, " is not read");
    total += batch->length;
  }
  for (size_t k = 0; k < columns.size(); ++k) {
    GatheredColumn& column = columns[k];
    const auto found = by_name.find(sources_[k]);
    if (found == by_name.end()) {
      return py::none();  // the per-sample way names the missing column
    }
    const auto layout = layout_of(schema.schema.children[found->second]);
    const bool ragged = column.kind != Kind::Rows;
    if (!layout || (layout->offsets_width != 0) != ragged || layout->dtype != stored_[k] ||
        layout->fixed != inner_[k]) {
      return py::none();
    }
    int64_t start = 0;  // the chunk's first row in the table
    for (const auto& batch : arrays->batches) {
      const ArrowArray* array = batch->children[found->second];
      TORCH_CHECK(array->length == batch->length, who_, ": column '", sources_[k], "' has ", array->length,
                  " rows in a record batch of ", batch->length);
      const int64_t null_row = row_with_null(array, *layout);
      if (null_row >= 0) {
        throw py::value_error(who_ + ": column '" + sources_[k] + "' has a missing value (null) in row " +
                              std::to_string(start + null_row) +
                              " of the batch: a tensor has no null. Fill or drop them first (pyarrow.compute."
                              "fill_null in Dataset.map_batches, or Dataset.filter)");
      }
      if (!ragged) {
        auto [leaf, first] = leaf_start(array, 0, layout->fixed.size(), layout->fixed);
        std::vector<int64_t> shape{array->length};
        shape.insert(shape.end(), layout->fixed.begin(), layout->fixed.end());
        column.rows.push_back(view_of(leaf, first, std::move(shape), layout->dtype));
      } else {
        const ArrowArray* values = array->children[0];
        at::Tensor offsets = at::empty({array->length + 1}, at::kLong);
        int64_t* out = offsets.mutable_data_ptr<int64_t>();
        for (int64_t i = 0; i <= array->length; ++i) {
          out[i] = offset_at(array, layout->offsets_width, i);
        }
        auto [leaf, first] = leaf_start(values, 0, layout->fixed.size(), layout->fixed);
        std::vector<int64_t> shape{values->length};
        shape.insert(shape.end(), layout->fixed.begin(), layout->fixed.end());
        column.values.push_back(view_of(leaf, first, std::move(shape), layout->dtype));
        column.offsets.push_back(std::move(offsets));
      }
      start += array->length;
    }
  }
  const ColumnGather gather(std::move(columns), total, id_key_, /*ids_are_indices=*/false, std::nullopt,
                            std::static_pointer_cast<const void>(arrays));
  return gather.plan_in_order();
}

}  // namespace fastcollate

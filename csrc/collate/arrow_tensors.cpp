#include "collate/arrow_tensors.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <numeric>

#include "collate/arrow_arrays.h"

namespace fastcollate {

namespace {

// The layout of a storage level that holds each row's values: one list (Ray's fixed-shape tensors: list
// or large_list) or one fixed-size list (Arrow's fixed_shape_tensor) of numbers.
std::optional<Layout> values_layout(const ArrowSchema* schema) {
  Layout layout;
  layout.offsets_width = list_offsets_width(schema->format);
  const int64_t size = fixed_list_size(schema->format);
  if ((layout.offsets_width == 0 && size < 0) || schema->n_children != 1 || schema->dictionary != nullptr) {
    return std::nullopt;
  }
  if (size >= 0) {
    layout.fixed.push_back(size);
  }
  const ArrowSchema* leaf = schema->children[0];
  const auto dtype = leaf_dtype(leaf->format);
  if (!dtype || leaf->n_children != 0 || leaf->dictionary != nullptr) {
    return std::nullopt;
  }
  layout.dtype = *dtype;
  return layout;
}

// Where row `i`'s values begin among the logical positions of the level's values.
int64_t values_begin(const ArrowArray* array, const Layout& layout, int64_t i) {
  return layout.offsets_width != 0 ? offset_at(array, layout.offsets_width, i)
                                   : (array->offset + i) * layout.fixed.front();
}

// Where the level's first row's values lie, in the elements of its leaf.
int64_t first_value(const ArrowArray* array, const Layout& layout) {
  return array->children[0]->offset + values_begin(array, layout, 0);
}

int64_t product(const int64_t* begin, const int64_t* end) {
  return std::accumulate(begin, end, int64_t{1}, std::multiplies<>());
}

std::vector<int64_t> with_rows(int64_t rows, const int64_t* dims, const int64_t* dims_end) {
  std::vector<int64_t> shape{rows};
  shape.insert(shape.end(), dims, dims_end);
  return shape;
}

template <typename Offset>
bool every_row_holds(const Offset* offsets, int64_t rows, int64_t size) {
  int64_t differs = 0;  // no early exit: the loop vectorizes, and a corrupt column is rare
  for (int64_t i = 0; i < rows; ++i) {
    differs |= (static_cast<int64_t>(offsets[i + 1]) - static_cast<int64_t>(offsets[i])) ^ size;
  }
  return differs == 0;
}

// Whether every row of a list array holds `size` values.
bool every_row_holds(const ArrowArray* list, int width, int64_t size) {
  if (width == 4) {
    return every_row_holds(static_cast<const int32_t*>(list->buffers[1]) + list->offset, list->length, size);
  }
  return every_row_holds(static_cast<const int64_t*>(list->buffers[1]) + list->offset, list->length, size);
}

// A fixed-shape tensor's rows: each row's values one after another, `dims` apart.
std::optional<ColumnChunk> fixed_rows(const ArrowArray* array, const Layout& layout, const TensorReading& reading) {
  const std::vector<int64_t>& dims = reading.dims;
  const int64_t size = product(dims.data(), dims.data() + dims.size());
  const int64_t rows = array->length;
  if (layout.offsets_width == 0 && layout.fixed.front() != size) {
    return std::nullopt;
  }
  if (layout.offsets_width != 0 && !every_row_holds(array, layout.offsets_width, size)) {
    return std::nullopt;  // a corrupt column: arrow_tensors.py names its row
  }
  const ArrowArray* leaf = array->children[0];
  const int64_t first = first_value(array, layout);
  ColumnChunk chunk;
  if (!reading.ragged) {
    if (dims != reading.inner) {
      return std::nullopt;
    }
    chunk.rows = view_of(leaf, first, with_rows(rows, dims.data(), dims.data() + dims.size()), layout.dtype);
    return chunk;
  }
  // A ragged column that Ray stored with one shape in this block: ragged rows that share their first dim.
  if (dims.empty() || !std::equal(dims.begin() + 1, dims.end(), reading.inner.begin(), reading.inner.end())) {
    return std::nullopt;
  }
  chunk.offsets = at::arange(rows + 1, at::kLong).mul_(dims.front());
  chunk.values = view_of(leaf, first, with_rows(rows * dims.front(), dims.data() + 1, dims.data() + dims.size()),
                         layout.dtype);
  return chunk;
}

// A struct's child as an array of the struct's own rows: a struct's offset applies to its children. A
// shallow copy, never released (the struct's owner releases the child).
ArrowArray over_struct_rows(const ArrowArray* parent, int64_t child) {
  ArrowArray copy = *parent->children[child];
  copy.offset += parent->offset;
  copy.length = parent->length;
  return copy;
}

int64_t child_named(const ArrowSchema* schema, const char* name) {
  for (int64_t c = 0; c < schema->n_children; ++c) {
    if (schema->children[c]->name != nullptr && std::strcmp(schema->children[c]->name, name) == 0) {
      return c;
    }
  }
  return -1;
}

// Ray's ragged tensors: a struct of each row's values (`data`) and its dims (`shape`), read as rows
// ragged along their first dim, whose dims after it are the first table's.
TensorRows ragged_rows(const ArrowSchema* schema, const ArrowArray* array, const TensorReading& reading) {
  TensorRows read;
  const int64_t data_at = child_named(schema, "data");
  const int64_t shape_at = child_named(schema, "shape");
  if (std::strcmp(schema->format, "+s") != 0 || data_at < 0 || shape_at < 0 || !reading.ragged) {
    return read;
  }
  const auto data_layout = values_layout(schema->children[data_at]);
  const auto shape_layout = values_layout(schema->children[shape_at]);
  if (!data_layout || !shape_layout || shape_layout->dtype != at::kLong || data_layout->dtype != reading.dtype) {
    return read;
  }
  const ArrowArray data = over_struct_rows(array, data_at);
  const ArrowArray shapes = over_struct_rows(array, shape_at);
  const int64_t rows = array->length;
  for (const int64_t row : {first_null(array, 0, rows), row_with_null(&data, *data_layout),
                            row_with_null(&shapes, *shape_layout)}) {
    if (row >= 0 && (read.null_row < 0 || row < read.null_row)) {
      read.null_row = row;
    }
  }
  const int64_t ndim = static_cast<int64_t>(reading.dims.size());
  if (read.null_row >= 0 || static_cast<int64_t>(reading.inner.size()) != ndim - 1) {
    return read;
  }
  const int64_t inner_size = product(reading.inner.data(), reading.inner.data() + reading.inner.size());
  const ArrowArray* dims_leaf = shapes.children[0];
  const auto* all_dims = static_cast<const int64_t*>(dims_leaf->buffers[1]) + dims_leaf->offset;
  at::Tensor offsets = at::empty({rows + 1}, at::kLong);
  int64_t* out = offsets.mutable_data_ptr<int64_t>();
  out[0] = 0;
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t dims_begin = values_begin(&shapes, *shape_layout, i);
    if (values_begin(&shapes, *shape_layout, i + 1) - dims_begin != ndim) {
      return read;
    }
    const int64_t* dims = all_dims + dims_begin;
    if (dims[0] < 0 || !std::equal(dims + 1, dims + ndim, reading.inner.begin()) ||
        values_begin(&data, *data_layout, i + 1) - values_begin(&data, *data_layout, i) != dims[0] * inner_size) {
      return read;  // dims after the first that vary, or a corrupt row: arrow_tensors.py names the row
    }
    out[i + 1] = out[i] + dims[0];
  }
  ColumnChunk chunk;
  chunk.values = view_of(data.children[0], first_value(&data, *data_layout),
                         with_rows(out[rows], reading.inner.data(), reading.inner.data() + reading.inner.size()),
                         data_layout->dtype);
  chunk.offsets = std::move(offsets);
  read.chunk = std::move(chunk);
  return read;
}

}  // namespace

TensorRows read_tensor_rows(const ArrowSchema* schema, const ArrowArray* array, const TensorReading& reading) {
  const bool varies = std::any_of(reading.dims.begin(), reading.dims.end(), [](int64_t dim) { return dim < 0; });
  if (varies) {
    return ragged_rows(schema, array, reading);
  }
  TensorRows read;
  const auto layout = values_layout(schema);
  if (!layout || layout->dtype != reading.dtype) {
    return read;
  }
  read.null_row = row_with_null(array, *layout);
  if (read.null_row < 0) {
    read.chunk = fixed_rows(array, *layout, reading);
  }
  return read;
}

}  // namespace fastcollate

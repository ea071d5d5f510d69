#include "collate/arrow_arrays.h"

#include <cstdlib>
#include <cstring>

namespace fastcollate {

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

int list_offsets_width(const char* format) {
  if (std::strcmp(format, "+l") == 0) {
    return 4;
  }
  return std::strcmp(format, "+L") == 0 ? 8 : 0;
}

int64_t fixed_list_size(const char* format) {
  return std::strncmp(format, "+w:", 3) == 0 ? std::atoll(format + 3) : -1;
}

std::optional<Layout> layout_of(const ArrowSchema* node) {
  Layout layout;
  if (node->metadata != nullptr) {
    return std::nullopt;  // an extension type (Hugging Face's ArrayXD): Arrays knows its shape
  }
  layout.offsets_width = list_offsets_width(node->format);
  if (layout.offsets_width != 0) {
    if (node->n_children != 1 || node->dictionary != nullptr) {
      return std::nullopt;
    }
    node = node->children[0];
  }
  for (int64_t size = fixed_list_size(node->format); size >= 0; size = fixed_list_size(node->format)) {
    if (node->n_children != 1 || node->dictionary != nullptr) {
      return std::nullopt;
    }
    layout.fixed.push_back(size);
    node = node->children[0];
  }
  const auto dtype = leaf_dtype(node->format);
  if (!dtype || node->n_children != 0 || node->dictionary != nullptr) {
    return std::nullopt;
  }
  layout.dtype = *dtype;
  return layout;
}

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

std::string metadata_bytes(const char* metadata) {
  if (metadata == nullptr) {
    return {};
  }
  auto int32_at = [metadata](size_t at) {
    int32_t value = 0;
    std::memcpy(&value, metadata + at, sizeof(value));
    return static_cast<size_t>(value);
  };
  size_t end = sizeof(int32_t);
  const size_t pairs = int32_at(0);
  for (size_t i = 0; i < 2 * pairs; ++i) {  // each key, then its value
    end += sizeof(int32_t) + int32_at(end);
  }
  return std::string(metadata, end);
}

}  // namespace fastcollate

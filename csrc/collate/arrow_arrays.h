// Reading arrays of the Arrow C data interface (arrow_c_data.h) where their buffers lie: the layouts a
// batch of tensors is gathered from (numbers, fixed-size lists of them, one list on top), their offsets,
// their nulls, and tensor views over their values. Nothing here owns an array: the caller keeps it alive.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <vector>

#include "collate/arrow_c_data.h"

namespace fastcollate {

// The tensor dtype of a primitive Arrow format, or none (booleans are bits, and everything else has no
// tensor dtype: the first table's Arrays refused those, naming the column).
std::optional<at::ScalarType> leaf_dtype(const char* format);

// The offsets' width in bytes of a list format ("+l": 4, "+L": 8), or 0 for anything else.
int list_offsets_width(const char* format);

// The list size of a fixed-size list format ("+w:3"), or -1 for anything else.
int64_t fixed_list_size(const char* format);

// How a column is laid out, read from its schema: a list on top (its offsets' width in bytes, 0 for none),
// then fixed-size lists, then numbers.
struct Layout {
  int offsets_width = 0;
  std::vector<int64_t> fixed;
  at::ScalarType dtype = at::kFloat;
};

// The layout of a column of `node`'s schema, or none for anything else (an extension type, a dictionary, a
// struct, deeper lists), which goes the per-sample way, whose Arrays names it.
std::optional<Layout> layout_of(const ArrowSchema* node);

// The first null among `count` values of `array` from logical position `begin`, or -1. Costs nothing when
// Arrow counted no null.
int64_t first_null(const ArrowArray* array, int64_t begin, int64_t count);

// Entry `i` of a list array's offsets (logical: the array's offset applied).
int64_t offset_at(const ArrowArray* list, int width, int64_t i);

// The row of `column` (one chunk's array, laid out as `layout`) that holds its first null at any level,
// or -1: each level's visible values are searched, and a null found below is traced back to its row.
int64_t row_with_null(const ArrowArray* column, const Layout& layout);

// The physical start (in the leaf's elements) of logical position `position` of `array`, through the
// fixed-size levels below it, and that leaf.
std::pair<const ArrowArray*, int64_t> leaf_start(const ArrowArray* array, int64_t position, size_t fixed_levels,
                                                 const std::vector<int64_t>& fixed);

// A tensor of `shape` over `leaf`'s values from physical element `start` (no copy, not owning them).
at::Tensor view_of(const ArrowArray* leaf, int64_t start, std::vector<int64_t> shape, at::ScalarType dtype);

// A schema's metadata as its bytes (the C interface's encoding: a count, then each key and value with its
// length), empty for none: what two fields are compared by.
std::string metadata_bytes(const char* metadata);

}  // namespace fastcollate

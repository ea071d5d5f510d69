// The column gather's two halves meet here: its plan (column_gather.cpp) lays a batch out column by
// column and hands each column's node and rows to its fill (column_fill.cpp), which copies the rows in once
// the batch's buffer exists, then checks their range and writes the packed fields' separators.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "collate/column_gather.h"
#include "collate/node.h"
#include "collate/plan.h"
#include "fill/gather_kernels.h"

namespace fastcollate {

// One column's node and what its fill needs once the views exist.
struct ColumnFill {
  const GatheredColumn* column;
  Node* node;
  RowSpans rows;                 // where each row of the batch lies, in whichever chunk; empty: every row in order
  std::vector<int64_t> lengths;  // Ragged, Packed: each row's; empty when every row is whole
};

// Fills every gathered column of a laid-out batch, then checks its range and writes its separators.
void fill_columns(BatchPlan& plan, const std::vector<GatheredColumn>& columns, const std::string& id_key,
                  bool ids_are_indices, const int64_t* index, const int64_t* read,
                  const std::vector<ColumnFill>& fills);

// Who a sample is, for make_error, as the walk names it: its id under the collate's id key, which is its
// index when the dataset's id key is that one, or the row of a column of integers under that key.
py::object sample_at(const std::vector<GatheredColumn>& columns, bool ids_are_indices, const std::string& id_key,
                     const int64_t* index, const int64_t* read, size_t position);  // column_gather.cpp

}  // namespace fastcollate

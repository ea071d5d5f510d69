// A whole Arrow table as one batch, read through the Arrow C stream interface (a pyarrow.Table's
// __arrow_c_stream__): each record batch's column buffers are viewed where they lie (slices at any offset,
// any number of chunks), tensor extension columns through their storage (csrc/collate/arrow_tensors.h),
// then gathered by a ColumnGather in order, with the columns and contract rules that fastcollate.gather
// chose for the first table of this schema. One native call a batch, no Python per column: what
// fastcollate.ray's collate runs for each table Ray hands it.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "collate/arrow_tensors.h"
#include "collate/column_gather.h"

namespace fastcollate {

class ArrowGather {
 public:
  // `columns`: how each output key is gathered (as gather.gathered_columns chose them; their chunks are
  // only read for the dtype and inner dims every later table must have). `sources`: the table column each
  // reads. `tensor_dims`: for a tensor extension column, its rows' dims as its type gives them (-1 where
  // each row stores its own); none for a plain column. `schema`: the first table's (a capsule
  // "arrow_schema"), whose tensor columns' types every later table's must be. `who` leads the errors.
  ArrowGather(std::vector<GatheredColumn> columns, std::vector<std::string> sources,
              std::vector<std::optional<std::vector<int64_t>>> tensor_dims, const py::capsule& schema,
              std::string id_key, std::string who);

  // The plan of every row of the stream's table (a capsule "arrow_array_stream", consumed), or None when
  // the caller collates it the per-sample way: the table holds no row, lacks a column or lays one out
  // unlike the first table, or ColumnGather hands its batch over (HANDED_TO_THE_WALK lists every case).
  // Raises ValueError naming the column and row of a null.
  // `in_place` (a batch kept on the host): the batch itself instead (a dict), when every column is rows in
  // one chunk, in its stored dtype, and at least one is lent: a column of numbers or tensor rows over
  // kSmallFieldBytes (as Ray's own collate, which lends those and copies the others), handed out as a view
  // of the table's buffer that keeps the stream's arrays alive. The other columns are copied, each to
  // storage of its own (keeping a label keeps none of the table), as is a second key over the same
  // memory. Only once a table's plan has passed the contract: its rules are the same for every table
  // laid out as that one was, but for a range, checked value by value (such a column is never lent).
  py::object plan(const py::capsule& stream, bool in_place) const;

 private:
  std::vector<GatheredColumn> columns_;
  std::vector<std::string> sources_;
  std::vector<std::optional<TensorReading>> tensors_;  // how each tensor column is read; none for the others
  std::vector<std::string> metadata_;                  // each column's field metadata in the first table
  std::vector<std::vector<int64_t>> inner_;  // each column's dims after its first, as the first table's
  std::vector<at::ScalarType> stored_;       // each column's stored dtype, as the first table's
  std::string id_key_;
  std::string who_;
  std::vector<bool> lendable_;                // each column may be lent (plan's in_place)
  mutable std::atomic<bool> checked_{false};  // a table's plan has passed the contract's rules

  std::optional<py::dict> batch_as_it_lies(const std::vector<GatheredColumn>& columns,
                                           const std::shared_ptr<const void>& owner) const;
};

}  // namespace fastcollate

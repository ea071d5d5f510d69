// The batched path of fastcollate.Arrays: a batch laid out column by column and gathered by index
// straight into the buffer it goes out in, planned and filled in one native call each. fastcollate.gather
// chooses the columns once per dataset and contract; every batch then costs no Python per column.
//
// The plan is a BatchPlan like the walk's, so the batch goes where any batch goes (a ring slot, a shared
// slot) and comes out in the same structure. The contract's rules are contract_rules.h's, the walk's: a
// broken rule reads the same gathered or walked, and names the sample by its batch position.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "collate/field_spec.h"
#include "collate/plan.h"

namespace fastcollate {

// One output key of an Arrays batch and how it is gathered.
struct GatheredColumn {
  enum class Kind {
    Ids,     // the batch's indices, int64
    Rows,    // rows [N, *row] of `rows`
    Ragged,  // values[offsets[i]:offsets[i + 1]]: padded under a field with a pad, else all of one length
    Packed,  // the same rows back to back (Field(pack=True)), with the contract's Packing keys beside
  };
  Kind kind = Kind::Rows;
  std::string key;
  // The column's rows, in one chunk or several (an Arrow column comes in chunks, in one file or many):
  // Rows: rows[c] is [rows of chunk c, *row]; Ragged, Packed: values[c], and offsets[c] (int64, one entry
  // more than chunk c has rows, within values[c]). Every chunk has the first one's dtype and inner dims.
  std::vector<at::Tensor> rows;
  std::vector<at::Tensor> values;
  std::vector<at::Tensor> offsets;
  at::ScalarType dtype = at::kFloat;  // the output's: the source's, or the field's when it casts
  std::optional<FieldSpec> field;     // none without a contract
  // Each chunk's first row, then the column's rows (set by ColumnGather).
  std::vector<int64_t> starts;
  // What finding a row reads of each chunk, taken once from its tensors (set by ColumnGather): a batch
  // finds thousands of rows in hundreds of chunks.
  struct ChunkView {
    const unsigned char* base;  // rows' or values' first byte
    int64_t step_bytes;         // from one row (Rows) or one position of values (Ragged, Packed) to the next
    const int64_t* offsets;     // Ragged, Packed
    int64_t positions;          // Ragged, Packed: values' dim 0
  };
  std::vector<ChunkView> views;
  int64_t chunk_rows = 0;  // the first chunk's rows: the others' too when the chunks are even, as Arrow's are

  // The first chunk, which stands for all in dtype and inner dims.
  const at::Tensor& source() const { return kind == Kind::Rows ? rows.front() : values.front(); }
};

class ColumnGather {
 public:
  // `id_key` names samples in errors: the dataset's id column when it has one (`ids_are_indices`: a
  // sample's id is its index), else the collate function's.
  // `length`: the dataset's samples. Sample i is row i of every column, or row rows_of[i] when given (int64,
  // one entry per sample: a shuffled or selected Hugging Face dataset reads its table through such a map).
  // `keepalive` holds whatever owns the chunks' memory when their tensors do not (an Arrow stream's arrays).
  ColumnGather(std::vector<GatheredColumn> columns, int64_t length, std::string id_key, bool ids_are_indices,
               std::optional<at::Tensor> rows_of = std::nullopt, std::shared_ptr<const void> keepalive = nullptr);

  // The batch at `indices` (int64, at least one; ArrayBatch names a bad one), or None when the per-sample
  // path must collate it: rows of unequal length without a pad, packed rows the walk refuses or whose
  // fields differ in length, a pad or separator the dtype cannot hold (fastcollate/collate/gather.py lists
  // every hand-over in HANDED_TO_THE_WALK). Raises the ContractError of the first sample that breaks a
  // rule. The rows are written by csrc/fill/'s writers.
  py::object plan(const at::Tensor& indices) const;

  // The batch of every row in order (no rows_of): the same batch as plan(0..length), with each chunk of a
  // column of rows copied as one block instead of row by row (a whole Arrow table, as Ray hands one over).
  py::object plan_in_order() const;

 private:
  py::object plan_rows(const at::Tensor& indices, bool in_order) const;

  struct Shared;
  std::shared_ptr<const Shared> shared_;
};

// None: the batch goes to the per-sample walk instead, for `reason`, a key of HANDED_TO_THE_WALK in
// fastcollate/collate/gather.py. Every hand-over returns through it, naming its case, so that
// tests/test_gather_handovers.py can hold the cases here and the list there to each other.
inline py::object handed_to_the_walk([[maybe_unused]] const char* reason) {
  return py::none();
}

}  // namespace fastcollate

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
  at::Tensor rows;
  at::Tensor values;
  at::Tensor offsets;                 // int64 [N + 1], contiguous
  at::ScalarType dtype = at::kFloat;  // the output's: the source's, or the field's when it casts
  std::optional<FieldSpec> field;     // none without a contract
};

class ColumnGather {
 public:
  // `id_key` names samples in errors: the dataset's id column when it has one (`ids_are_indices`: a
  // sample's id is its index), else the collate function's.
  // `length`: the dataset's rows, which every column has.
  ColumnGather(std::vector<GatheredColumn> columns, int64_t length, std::string id_key, bool ids_are_indices);

  // The batch at `indices` (int64, at least one; ArrayBatch names a bad one), or None when the per-sample
  // path must collate it: rows of unequal length without a pad, packed rows the walk refuses or whose
  // fields differ in length. Raises the ContractError of the first sample that breaks a rule.
  py::object plan(const at::Tensor& indices) const;

 private:
  struct Shared;
  std::shared_ptr<const Shared> shared_;
};

// The batch position of the first index outside [0, length), or -1 (an ArrayBatch's check, in one pass).
int64_t first_index_outside(const at::Tensor& indices, int64_t length);

}  // namespace fastcollate

// The collate function's native half: a walk of the samples (walk.h) into a BatchPlan (plan.h), then
// its copy into a ring slot or a buffer the caller chose.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <string>
#include <vector>

#include "collate/contract_fields.h"
#include "collate/plan.h"
#include "memory/staging_ring.h"

namespace fastcollate {

class Collator {
 public:
  Collator(std::string id_key, std::vector<FieldSpec> fields, bool has_contract)
      : contract_(std::move(id_key), std::move(fields), has_contract) {}
  // Walks `samples` and lays the batch out; nothing is copied yet.
  std::shared_ptr<BatchPlan> plan(py::handle samples) const;
  // plan(), a slot of `ring`, then execute() into it, all under the GIL but the copy: the main process's
  // collate in one call. Returns (the batch, whether the ring was full: the slot is then a fresh buffer
  // outside it, the number of the batch's tensors that are views of the slot).
  py::tuple assemble_in_ring(py::handle samples, StagingRing& ring, bool small_fields_apart) const;

 private:
  ContractFields contract_;
};

}  // namespace fastcollate

// The collate function's native half for samples: a walk of them (walk.h) into a BatchPlan (plan.h), which
// the caller then executes into a ring slot or a buffer of its choosing.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "collate/contract_fields.h"
#include "collate/plan.h"

namespace fastcollate {

class Collator {
 public:
  Collator(std::string id_key, std::vector<FieldSpec> fields, bool has_contract)
      : contract_(std::move(id_key), std::move(fields), has_contract) {}
  // Walks `samples` and lays the batch out; nothing is copied yet.
  std::shared_ptr<BatchPlan> plan(py::handle samples) const;

 private:
  ContractFields contract_;
};

}  // namespace fastcollate

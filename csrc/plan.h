// Batch assembly in two steps. `Collator::plan` walks a list of samples (nested dicts, lists, tuples,
// namedtuples, tensors, numpy arrays, numbers, strings) once, checks every sample against the first one
// (drop-in mode) or against a declared contract, and lays every tensor field of the output out in one
// block of bytes. Nothing is written yet, so a bad sample costs no copy. `BatchPlan::execute` then copies
// all samples into a buffer the caller chose (a ring slot, shared memory) with the GIL released, and
// builds the output structure with views into that buffer. The walk itself is walk.h's.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "field_spec.h"
#include "memory/copy_kernels.h"
#include "memory/staging_ring.h"

namespace fastcollate {

namespace py = pybind11;

// Batch lifetimes: the fields of a batch are views of one buffer, so keeping one field keeps them all.
// A small field of a large batch (ids, labels, lengths, the masks of small batches) therefore gets
// storage of its own, on the host when the batch is built or received and on the device after its copy:
// keeping it keeps only its own bytes. Batches under kLargeBatchBytes stay whole (a kept field keeps at
// most that much), so batches of many small fields pay no allocation per field.
constexpr int64_t kSmallFieldBytes = int64_t{64} << 10;
constexpr int64_t kLargeBatchBytes = int64_t{1} << 20;
inline bool needs_own_storage(int64_t field_bytes, int64_t batch_bytes) {
  return field_bytes <= kSmallFieldBytes && batch_bytes >= kLargeBatchBytes;
}

struct Node;

class BatchPlan {
 public:
  // Bytes the buffer given to execute() must hold.
  int64_t nbytes() const { return static_cast<int64_t>(total_bytes_); }
  // Copies every sample into `buffer` (a 1-D uint8 CPU tensor of at least nbytes()) and returns the
  // batch. The buffer's storage is shared by every tensor of the batch, but for its small fields when
  // `small_fields_apart` (needs_own_storage): those get storage of their own.
  py::object execute(const at::Tensor& buffer, bool small_fields_apart);
  // The same into `storage` from byte `offset` (a multiple of kFieldAlignment) on; the caller has checked
  // that it holds nbytes() more. (`_into`, here as in stack_into: writes into memory the caller gives.)
  py::object execute_into(const at::Storage& storage, size_t offset, bool small_fields_apart);

  // The tensors execute() made as views of the buffer (the others have storage of their own).
  int64_t views() const { return views_; }

  // Reserves an aligned region and returns its offset.
  size_t reserve(size_t bytes);

  std::unique_ptr<Node> root;
  std::vector<py::object> keepalive;          // tensors made from numpy arrays, read during execute()
  std::vector<std::vector<py::object>> held;  // the values of the samples' dicts, one block per mapping
  py::object batch;                           // the samples: their tensors must outlive execute()

 private:
  size_t total_bytes_ = 0;
  bool executed_ = false;
  int64_t views_ = 0;
};

class Collator {
 public:
  Collator(std::string id_key, std::vector<FieldSpec> fields, bool has_contract);
  std::shared_ptr<BatchPlan> plan(py::handle samples) const;
  // plan(), a slot of `ring`, then execute() into it, all under the GIL but the copy: the main process's
  // collate in one call. Returns (the batch, whether the ring was full: the slot is then a fresh buffer
  // outside it, the number of the batch's tensors that are views of the slot).
  py::tuple assemble_in_ring(py::handle samples, StagingRing& ring, bool small_fields_apart) const;

  const std::string& id_key() const { return id_key_; }
  bool has_contract() const { return has_contract_; }
  const FieldSpec* field(const std::string& path) const;
  bool is_container_path(const std::string& path) const;
  const std::vector<FieldSpec>& fields() const { return fields_; }

 private:
  std::string id_key_;
  std::vector<FieldSpec> fields_;
  std::unordered_map<std::string, size_t> by_path_;
  std::unordered_map<std::string, bool> container_paths_;
  bool has_contract_;
};

void bind_batch_plan(py::module_& m);

}  // namespace fastcollate

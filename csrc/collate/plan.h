// Batch assembly in two steps. `Collator::plan` (collator.h) walks a list of samples (nested dicts, lists,
// tuples, namedtuples, tensors, numpy arrays, numbers, strings) once, checks every sample against the first
// one (drop-in mode) or against a declared contract, and lays every tensor field of the output out in one
// block of bytes; `ColumnGather::plan` (column_gather.h) lays out an Arrays batch column by column, with
// no samples. Nothing is written yet, so a bad sample costs no copy. `BatchPlan::execute` then copies into
// a buffer the caller chose (a ring slot, shared memory) with the GIL released, and builds the output
// structure with views into that buffer.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "collate/field_spec.h"
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

  // execute_into() a slot of `ring`. Returns (the batch, whether the ring was full: the slot is then a
  // fresh buffer outside it, the number of the batch's tensors that are views of the slot).
  py::tuple execute_in_ring(StagingRing& ring, bool small_fields_apart);

  // The tensors execute() made as views of the buffer (the others have storage of their own).
  int64_t views() const { return views_; }
  // Whether execute_in_ring() found every slot busy (and took a fresh buffer), even when the batch failed.
  bool overflowed_ring() const { return overflowed_ring_; }

  // Reserves an aligned region and returns its offset.
  size_t reserve(size_t bytes);

  std::unique_ptr<Node> root;
  std::vector<py::object> keepalive;          // tensors made from numpy arrays, read during execute()
  std::vector<std::vector<py::object>> held;  // the values of the samples' dicts, one block per mapping
  py::object batch;                           // the samples: their tensors must outlive execute()
  // Tensors the walk read from samples' lists of numbers (walk_lists.cpp), where node inputs point: a
  // deque, so that those pointers stay put as it grows. They hold no Python object.
  std::deque<at::Tensor> converted;
  // An Arrays batch's columns, gathered into the views once the copy jobs have run (column_gather.h).
  std::function<void()> fill_gathered;
  // The output key whose gather raised, so that the error can name its column; "" for none.
  std::string failed_key;

 private:
  size_t total_bytes_ = 0;
  bool executed_ = false;
  int64_t views_ = 0;
  bool overflowed_ring_ = false;
};

}  // namespace fastcollate

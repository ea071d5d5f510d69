// The output structure a walk lays out: one node per field path, with the samples' values for that path.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <string>
#include <vector>

#include "collate/python_refs.h"

namespace fastcollate {

struct Node {
  enum class Kind { Tensor, Numbers, Ready, Dict, Mapping, List, NamedTuple, Sequence };
  Kind kind = Kind::Ready;
  std::string path;
  py::object elem;  // the first sample's container: its type decides how the output is rebuilt
  std::vector<py::object> keys;
  std::vector<std::unique_ptr<Node>> children;

  // Tensor and Numbers: the output tensor's layout in the batch buffer.
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;  // including the batch dim
  size_t offset = 0;
  // Tensor: one input per sample, and its bytes when they can be copied as they are (the row's dtype,
  // shape and a contiguous layout), else null (an ATen copy). The pointers are read in the checking pass,
  // while the tensor is in cache, as the shapes are: the inputs are held until the copy, and resizing one
  // in place meanwhile (from another thread) would race with the copy as it would with torch.stack.
  BorrowedTensors inputs;
  std::vector<const void*> sources;
  // Padded tensors: per-sample sizes of each dim, and where the mask and lengths go.
  bool padded = false;
  uint64_t pad_pattern = 0;
  bool pad_left = false;          // the padding before the values in each named dim (padded_rows.h)
  std::vector<int64_t> var_dims;  // the named dims, in order: mask dim k is var_dims[k]
  std::unique_ptr<Node> mask;     // null when an earlier field of the same parent builds the shared mask
  std::unique_ptr<Node> lengths;
  std::string mask_name;
  std::string lengths_name;
  // Packed tensors: each sample's first token in the row (count + 1 entries, the last the total), the
  // separator's bytes, and the keys beside the row. Only the parent's first packed field builds those
  // (position_ids, seq_idx, cu_seq_lens; null where not asked for); the others share them.
  bool packed = false;
  std::vector<int64_t> starts;
  bool has_separator = false;
  uint64_t separator_pattern = 0;
  std::unique_ptr<Node> position_ids;
  int64_t position_ids_start = 0;
  std::unique_ptr<Node> seq_idx;
  std::unique_ptr<Node> cu_seq_lens;
  int64_t max_length = -1;  // -1: this field builds no keys beside it
  std::string position_ids_name;
  std::string seq_idx_name;
  std::vector<std::string> cu_seq_lens_names;
  std::vector<std::string> max_length_names;
  // Numbers: the values, already converted.
  std::vector<int64_t> ints;
  std::vector<double> floats;
  // Ready: the finished value (strings, leaves left to default_collate).
  py::object ready;
  bool text = false;  // strings: default_collate returns them as it got them (a tuple inside sequences)

  // Filled by the column gather (column_gather.h) from an Arrays column, not by the copy jobs: only the
  // keys beside a packed row are the jobs'.
  bool gathered = false;

  at::Tensor out;  // set by execute()
};

}  // namespace fastcollate

// An Arrays batch's indices, read and checked in one pass each: a DataLoader sampler's list of ints, an
// index outside the dataset, Python's negative indices.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <cstdint>

namespace fastcollate {

// A list of Python ints as an int64 tensor of its own, or None when an element is anything else (a bool,
// a numpy integer) or outside int64: the batches DataLoader's samplers hand out, read with no numpy call.
py::object indices_of_list(const py::list& list);

// The batch position of the first index outside [0, length), or -1 (an ArrayBatch's check, in one pass).
int64_t first_index_outside(const at::Tensor& indices, int64_t length);

// Python's and Hugging Face's negative indices: each index in [-length, 0) becomes index + length, in
// place. Returns the batch position of the first index outside [-length, length), left as it was, or -1.
int64_t wrap_negative_indices(at::Tensor& indices, int64_t length);

}  // namespace fastcollate

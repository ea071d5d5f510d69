// How error messages write shapes, dtypes and Python errors: as a person reads them in Python.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <string>

namespace fastcollate {

// [1, 16, 16]: a tensor's shape as torch prints it.
std::string shape_string(at::IntArrayRef sizes);
// (1, 16, 16) or (5,): how a shape is written in a Field declaration.
std::string python_tuple(at::IntArrayRef sizes);
// torch.int8, not torch.char.
std::string dtype_string(at::ScalarType dtype);
// "TypeError: can't convert ...": the error's first line, short. Torch's messages name types and
// shapes, never values.
std::string first_line(const pybind11::error_already_set& error);

}  // namespace fastcollate

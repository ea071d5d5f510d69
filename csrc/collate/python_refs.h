// References the native walk holds without counting them: the Python objects it looks up once, and the
// tensors it borrows from the samples.
#pragma once

#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <vector>

namespace fastcollate {

namespace py = pybind11;

// Python objects the walk needs, looked up once. Deliberately leaked: they must not be released after
// the interpreter has shut down.
struct PythonRefs {
  py::object make_error;        // fastcollate.collate.errors.make_error
  py::object error_kind;        // fastcollate.collate.errors.kind_of: the kind of a Python exception
  py::object rebuild_mapping;   // fastcollate.structure.tree's copy of default_collate's rules for Mapping subclasses
  py::object rebuild_sequence;  // and for Sequence subclasses
  py::object default_collate;   // fastcollate._native_support's, for leaves we deliberately leave to torch
  py::object as_tensor;         // torch.as_tensor
  py::object tensor_from_list;  // torch.tensor
  py::object mapping_abc;
  py::object sequence_abc;
  py::object ndarray;
  py::object numpy_generic;
  py::object numpy_number;  // numpy.number and numpy.bool_: scalars torch.tensor takes like numbers
  py::object numpy_bool;
  py::object float64;
};

// Looked up on first use, under the GIL.
const PythonRefs& python_refs();

bool is_instance(PyObject* obj, const py::object& type);
std::string type_name(PyObject* obj);

// Tensors borrowed from the samples: each points into a Python tensor the plan holds until execute() is
// done (BatchPlan::held or keepalive), so no reference is counted here. Holding at::Tensor copies instead
// would cost a GIL round trip per sample when they are released (a tensor with a Python object decrefs it
// under the GIL).
struct BorrowedTensors {
  std::vector<const at::Tensor*> items;
  void reserve(size_t n) { items.reserve(n); }
  void push_back(const at::Tensor& tensor) { items.push_back(&tensor); }
  void push_back(PyObject* variable) { items.push_back(&THPVariable_Unpack(variable)); }
  const at::Tensor& operator[](size_t i) const { return *items[i]; }
  size_t size() const { return items.size(); }
};

}  // namespace fastcollate

#include "collate/batch_indices.h"

#include <ATen/EmptyTensor.h>
#include <torch/csrc/autograd/python_variable.h>

namespace fastcollate {

py::object indices_of_list(const py::list& list) {
  const Py_ssize_t size = PyList_GET_SIZE(list.ptr());
  at::Tensor indices = at::detail::empty_cpu({static_cast<int64_t>(size)}, at::kLong);
  int64_t* out = indices.mutable_data_ptr<int64_t>();
  for (Py_ssize_t i = 0; i < size; ++i) {
    PyObject* item = PyList_GET_ITEM(list.ptr(), i);
    if (!PyLong_CheckExact(item)) {
      return py::none();  // a bool, a float, a numpy integer, anything else: the caller's checks name it
    }
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (overflow != 0) {
      return py::none();
    }
    out[i] = value;
  }
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(indices)));
}

int64_t first_index_outside(const at::Tensor& indices, int64_t length) {
  TORCH_CHECK(
      indices.device().is_cpu() && indices.scalar_type() == at::kLong && indices.dim() == 1 && indices.is_contiguous(),
      "first_index_outside: indices must be a contiguous 1-D int64 CPU tensor");
  const int64_t* index = indices.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < indices.numel(); ++b) {
    if (index[b] < 0 || index[b] >= length) {
      return b;
    }
  }
  return -1;
}

int64_t wrap_negative_indices(at::Tensor& indices, int64_t length) {
  TORCH_CHECK(
      indices.device().is_cpu() && indices.scalar_type() == at::kLong && indices.dim() == 1 && indices.is_contiguous(),
      "wrap_negative_indices: indices must be a contiguous 1-D int64 CPU tensor");
  int64_t* index = indices.mutable_data_ptr<int64_t>();
  for (int64_t b = 0; b < indices.numel(); ++b) {
    if (index[b] < 0 && index[b] >= -length) {
      index[b] += length;
    } else if (index[b] < 0 || index[b] >= length) {
      return b;
    }
  }
  return -1;
}

}  // namespace fastcollate

// Lists of Python numbers in tensor fields, as tokenizers and Hugging Face datasets hand out token ids:
// read with the CPython API, with no Python code per element, into a tensor of the field's declared
// dtype, one per sample. The walk then checks and copies it as it does a sample's tensor (shape, named
// dims, range, padding, packing), so a batch of lists is the batch of the same values as tensors. Each
// element follows the number fields' rules (contract_rules.h): its Python type, a value the dtype holds.
#include <ATen/Dispatch_v2.h>
#include <ATen/EmptyTensor.h>

#include <optional>
#include <type_traits>

#include "collate/contract_rules.h"
#include "collate/messages.h"
#include "collate/plan.h"
#include "collate/walk.h"

namespace fastcollate {

namespace {

bool is_list(PyObject* value) {
  return PyList_Check(value) || PyTuple_Check(value);
}

// The sizes of a nested list of the field's dims, read along its first elements; a level with no element
// takes the declared sizes of the dims under it (0 for named ones), and so does a level that is no list
// (the reader names it). The other rows are checked against these sizes while they are read.
std::vector<int64_t> list_sizes(PyObject* list, const FieldSpec& spec) {
  const size_t dims = spec.shape->size();
  std::vector<int64_t> sizes(dims, 0);
  PyObject* level = list;
  for (size_t d = 0; d < dims && is_list(level); ++d) {
    sizes[d] = PySequence_Fast_GET_SIZE(level);
    if (sizes[d] == 0) {
      for (size_t under = d + 1; under < dims; ++under) {
        sizes[under] = spec.dim_names[under].empty() ? (*spec.shape)[under] : 0;
      }
      break;
    }
    level = PySequence_Fast_GET_ITEM(level, 0);
  }
  return sizes;
}

// Reads a nested list of `sizes` into `out` in row-major order; the first element that breaks a rule
// stops it, named by its flat position within the sample.
template <typename scalar_t>
class ListReader {
 public:
  ListReader(at::ScalarType dtype, const std::vector<int64_t>& sizes, scalar_t* out)
      : dtype_(dtype), sizes_(sizes), out_(out) {}

  std::optional<Violation> read(PyObject* list, size_t depth) {
    if (!is_list(list)) {
      return list_depth_misfit(sizes_.size(), type_name(list), depth, flat_);
    }
    const Py_ssize_t length = PySequence_Fast_GET_SIZE(list);
    if (length != sizes_[depth]) {
      return list_not_rectangular(sizes_[depth], length, depth);
    }
    PyObject** elements = PySequence_Fast_ITEMS(list);
    if (depth + 1 < sizes_.size()) {
      for (Py_ssize_t k = 0; k < length; ++k) {
        if (auto violation = read(elements[k], depth + 1)) {
          return violation;
        }
      }
      return std::nullopt;
    }
    for (Py_ssize_t k = 0; k < length; ++k, ++flat_) {
      if (auto violation = number(elements[k])) {
        return violation;
      }
    }
    return std::nullopt;
  }

 private:
  std::optional<Violation> number(PyObject* element) {
    if (!takes_python_number(element, dtype_)) {
      return list_element_misfit(dtype_, type_name(element), flat_);
    }
    if constexpr (std::is_same_v<scalar_t, bool>) {
      out_[flat_] = element == Py_True;
    } else if constexpr (std::is_floating_point_v<scalar_t> || !std::is_integral_v<scalar_t>) {
      const double value = PyFloat_AsDouble(element);  // an int past float64's range fails here
      if (value == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return python_value_misfit(dtype_, flat_);
      }
      if (!std::is_same_v<scalar_t, double> && !value_fits(value, dtype_)) {
        return python_value_misfit(dtype_, flat_);
      }
      out_[flat_] = static_cast<scalar_t>(value);
    } else if constexpr (std::is_same_v<scalar_t, uint64_t>) {
      const unsigned long long value = PyLong_AsUnsignedLongLong(element);  // negative ones fail too
      if (value == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
        PyErr_Clear();
        return python_value_misfit(dtype_, flat_);
      }
      out_[flat_] = static_cast<scalar_t>(value);
    } else {
      int overflow = 0;
      const long long value = PyLong_AsLongLongAndOverflow(element, &overflow);
      if (overflow != 0 || (!std::is_same_v<scalar_t, int64_t> && !value_fits(static_cast<double>(value), dtype_))) {
        return python_value_misfit(dtype_, flat_);
      }
      out_[flat_] = static_cast<scalar_t>(value);
    }
    return std::nullopt;
  }

  at::ScalarType dtype_;
  const std::vector<int64_t>& sizes_;
  scalar_t* out_;
  int64_t flat_ = 0;
};

}  // namespace

const at::Tensor& Walk::tensor_from_list(PyObject* item, size_t index, const FieldSpec& spec) {
  if (!spec.dtype || !spec.shape || spec.shape->empty()) {
    fail(list_needs_declaration(type_name(item)), index, spec.path);
  }
  const at::ScalarType dtype = *spec.dtype;
  if (!takes_python_numbers(dtype)) {
    fail(list_of_dtype(type_name(item), dtype), index, spec.path);
  }
  const std::vector<int64_t> sizes = list_sizes(item, spec);
  at::Tensor tensor = at::detail::empty_cpu(sizes, dtype);
  std::optional<Violation> violation;
  AT_DISPATCH_V2(dtype, "tensor_from_list", AT_WRAP([&] {
                   violation = ListReader<scalar_t>(dtype, sizes, tensor.mutable_data_ptr<scalar_t>()).read(item, 0);
                 }),
                 AT_EXPAND(AT_ALL_TYPES), at::kBool, at::kHalf, at::kBFloat16, AT_EXPAND(AT_BAREBONES_UNSIGNED_TYPES),
                 AT_EXPAND(AT_FLOAT8_TYPES));
  if (violation) {
    fail(*violation, index, spec.path);
  }
  return plan_.converted.emplace_back(std::move(tensor));
}

}  // namespace fastcollate

#include "collate/contract_rules.h"

#include <ATen/Dispatch_v2.h>
#include <c10/util/overflows.h>

#include <algorithm>
#include <cmath>
#include <sstream>

#include "collate/messages.h"
#include "collate/python_refs.h"
#include "memory/copy_kernels.h"

namespace fastcollate {

void raise_violation(const Violation& violation, py::handle batch, size_t position, const std::string& field,
                     const std::string& id_key) {
  py::object error = python_refs().make_error(violation.kind, batch, position, field, violation.expected, violation.got,
                                              violation.hint, id_key);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
  throw py::error_already_set();
}

std::optional<Violation> dtype_rule(const FieldSpec& spec, at::ScalarType declared, at::ScalarType got) {
  if (got == declared || std::find(spec.cast_from.begin(), spec.cast_from.end(), got) != spec.cast_from.end()) {
    return std::nullopt;
  }
  return Violation{"type", dtype_string(declared), dtype_string(got),
                   "convert it in the transform, or declare cast_from=(" + dtype_string(got) + ",) on the field"};
}

std::optional<Violation> declared_shape_rule(const FieldSpec& spec, at::IntArrayRef sizes) {
  const std::vector<int64_t>& shape = *spec.shape;
  bool ok = sizes.size() == shape.size();
  for (size_t d = 0; ok && d < sizes.size(); ++d) {
    if (spec.dim_names[d].empty()) {
      ok = sizes[d] == shape[d];
    }
  }
  for (const auto& accepted : spec.expand_from) {
    ok |= sizes == at::IntArrayRef(accepted);
  }
  if (ok) {
    return std::nullopt;
  }
  std::ostringstream expected;
  expected << "shape [";
  for (size_t d = 0; d < shape.size(); ++d) {
    expected << (d ? ", " : "") << (spec.dim_names[d].empty() ? std::to_string(shape[d]) : spec.dim_names[d]);
  }
  expected << "]";
  // A packed field cannot expand (refused at declaration): its samples must be [tokens, *fixed dims].
  return Violation{"size", expected.str(), "shape " + shape_string(sizes),
                   spec.packed
                       ? "a packed field's sample is its tokens along the first dim: return a tensor of that shape"
                       : "fix the transform, or declare the conversion on the field (e.g. expand_from=(" +
                             python_tuple(sizes) + ",))"};
}

Violation named_dim_misfit(const std::string& name, int64_t known, const std::string& owner, int64_t size) {
  return Violation{"size", "dim " + name + " = " + std::to_string(known) + " (as in field " + owner + ")",
                   "dim " + name + " = " + std::to_string(size),
                   "fields that share a named dim must agree within a sample"};
}

bool value_fits(double value, at::ScalarType dtype) {
  if (dtype == at::kBool) {
    return true;  // any value is a bool
  }
  if (c10::elementSize(dtype) > sizeof(uint64_t)) {
    return false;  // a fill writes elements of at most 8 bytes
  }
  bool holds = false;
  AT_DISPATCH_V2(dtype, "value_fits", AT_WRAP([&] { holds = !c10::overflows<scalar_t, double>(value); }),
                 AT_EXPAND(AT_ALL_TYPES), at::kHalf, at::kBFloat16, AT_EXPAND(AT_BAREBONES_UNSIGNED_TYPES),
                 AT_EXPAND(AT_FLOAT8_TYPES), AT_EXPAND(AT_COMPLEX_TYPES), at::kComplexHalf);
  return holds && (!c10::isIntegralType(dtype, /*includeBool=*/false) || std::trunc(value) == value);
}

bool takes_python_number(PyObject* item, at::ScalarType dtype) {
  const bool is_bool = PyBool_Check(item);
  const bool is_int = PyLong_Check(item) && !is_bool;
  if (dtype == at::kBool) {
    return is_bool;
  }
  return at::isFloatingType(dtype) ? (is_int || PyFloat_Check(item)) : is_int;
}

std::string python_number_for(at::ScalarType dtype) {
  const char* python_type = dtype == at::kBool ? "bool" : at::isFloatingType(dtype) ? "float or int" : "int";
  return "a Python " + std::string(python_type) + " (declared " + dtype_string(dtype) + ")";
}

bool takes_python_numbers(at::ScalarType dtype) {
  return at::isIntegralType(dtype, /*includeBool=*/true) ||
         (at::isFloatingType(dtype) && dtype != at::kFloat4_e2m1fn_x2);
}

Violation python_value_misfit(at::ScalarType dtype, const std::string& where) {
  return Violation{"value", "a value " + dtype_string(dtype) + " can hold (the declared dtype)",
                   "a value outside its range" + where, "declare a wider dtype, or fix the value"};
}

std::optional<Violation> fill_value_rule(double value, at::ScalarType dtype, const char* what, const char* hint) {
  if (value_fits(value, dtype)) {
    return std::nullopt;
  }
  std::ostringstream declared;
  declared << what << "=" << value;
  return Violation{"value", std::string("a ") + what + " value " + dtype_string(dtype) + " can hold", declared.str(),
                   hint};
}

std::optional<Violation> range_dtype_rule(at::ScalarType dtype) {
  if (!at::isComplexType(dtype)) {
    return std::nullopt;
  }
  return Violation{"type", "a real dtype (the field declares a range)", dtype_string(dtype),
                   "complex values have no order: drop the range or convert the field"};
}

int64_t first_out_of_range(const void* data, at::ScalarType dtype, int64_t numel, const ValueRange& range,
                           double& value) {
  int64_t bad = -1;
  AT_DISPATCH_V2(dtype, "first_out_of_range", AT_WRAP([&] {
                   const auto* values = static_cast<const scalar_t*>(data);
                   for (int64_t i = 0; i < numel; ++i) {
                     const double v = static_cast<double>(values[i]);
                     if (!(v >= range.low && v < range.high)) {  // NaN fails too
                       bad = i;
                       value = v;
                       break;
                     }
                   }
                 }),
                 AT_EXPAND(AT_ALL_TYPES), at::kBool, at::kHalf, at::kBFloat16, AT_EXPAND(AT_BAREBONES_UNSIGNED_TYPES),
                 AT_EXPAND(AT_FLOAT8_TYPES));
  return bad;
}

Violation range_misfit(const ValueRange& range, int64_t flat, double value) {
  std::ostringstream expected;
  expected << "values in [" << range.low << ", " << range.high << ")";
  const std::string where = " at flat position " + std::to_string(flat);
  std::string got = std::isnan(value)   ? "NaN" + where
                    : value < range.low ? "a value below the range" + where
                                        : "a value at or above the upper bound" + where;
  return Violation{"value", expected.str(), got, "fix the label, or widen the declared range"};
}

}  // namespace fastcollate

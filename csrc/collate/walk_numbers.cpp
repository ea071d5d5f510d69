// Number fields: Python ints, floats and bools, written straight into the batch buffer; mixed numbers
// are left to torch.tensor's inference, as default_collate leaves them.
#include <cmath>
#include <sstream>

#include "collate/contract_rules.h"
#include "collate/messages.h"
#include "collate/plan.h"
#include "collate/walk.h"

namespace fastcollate {

namespace {

bool is_number(PyObject* value) {
  const PythonRefs& refs = python_refs();
  return (PyLong_Check(value) || PyFloat_Check(value) || THPVariable_Check(value) ||
          is_instance(value, refs.numpy_number) || is_instance(value, refs.numpy_bool) ||
          is_instance(value, refs.ndarray)) &&
         !PyUnicode_Check(value) && !PyBytes_Check(value);
}

}  // namespace

std::unique_ptr<Node> Walk::numbers(const Items& items, const std::string& path, const FieldSpec* spec) {
  auto node = std::make_unique<Node>();
  node->kind = Node::Kind::Numbers;
  node->path = path;
  node->shape = {static_cast<int64_t>(items.size())};
  PyObject* elem = items[0];
  if (spec != nullptr && spec->dtype) {
    node->dtype = *spec->dtype;
  } else if (PyFloat_Check(elem)) {
    node->dtype = at::kDouble;
  } else if (PyBool_Check(elem)) {
    node->dtype = at::kBool;
  } else {
    node->dtype = at::kLong;
  }
  if (at::isComplexType(node->dtype) || at::isQIntType(node->dtype)) {
    fail("type", 0, path, "a bool, integer or floating-point dtype for a number field",
         "declared " + dtype_string(node->dtype), "declare the field as a tensor");
  }
  const bool floating = at::isFloatingType(node->dtype);
  for (size_t i = 0; i < items.size(); ++i) {
    PyObject* item = items[i];
    if (!takes_python_number(item, node->dtype)) {
      // Mixed numbers (int and float, bool and int, Python and numpy scalars, one-element tensors):
      // torch.tensor's inference decides, as it does for default_collate. Anything else is no number.
      if (spec == nullptr && is_number(item)) {
        return numbers_by_torch(items, i, path, floating);
      }
      fail("type", i, path, spec ? python_number_for(node->dtype) : "a number (like sample 0)", type_name(item),
           "return a number for this field in every sample");
    }
    if (!read_number(item, i, path, spec, *node)) {
      return numbers_by_torch(items, i, path, floating);  // torch.tensor takes it beside a float, else names it
    }
  }
  lay_out(*node);
  return node;
}

std::unique_ptr<Node> Walk::numbers_by_torch(const Items& items, size_t first, const std::string& path, bool floating) {
  for (size_t j = first + 1; j < items.size(); ++j) {
    if (!is_number(items[j])) {
      fail("type", j, path, "a number (like sample 0)", type_name(items[j]),
           "return a number for this field in every sample");
    }
  }
  const PythonRefs& refs = python_refs();
  auto convert = [&](const py::list& these) {
    return floating ? refs.tensor_from_list(these, py::arg("dtype") = refs.float64) : refs.tensor_from_list(these);
  };
  py::list values(items.size());
  for (size_t j = 0; j < items.size(); ++j) {
    values[j] = py::reinterpret_borrow<py::object>(items[j]);
  }
  auto node = std::make_unique<Node>();
  node->kind = Node::Kind::Ready;
  node->path = path;
  try {
    node->ready = convert(values);
  } catch (py::error_already_set& error) {
    // Overflow, most likely: find the sample torch.tensor refuses on its own.
    size_t bad = first;
    for (size_t j = 0; j < items.size(); ++j) {
      py::list one(1);
      one[0] = py::reinterpret_borrow<py::object>(items[j]);
      try {
        convert(one);
      } catch (py::error_already_set&) {
        bad = j;
        break;
      }
    }
    fail_from(error, bad, path, "a number torch.tensor can hold (like sample 0)");
  }
  return node;
}

// Converts sample `index`'s number into node's values, checking it against a declared dtype and range.
// Returns false for an int past int64 in drop-in mode: torch.tensor decides then.
bool Walk::read_number(PyObject* item, size_t index, const std::string& path, const FieldSpec* spec, Node& node) {
  // A declared dtype narrower than int64/float64 must hold every value: 300 is no int8, 1e6 no float16.
  const bool narrow =
      spec != nullptr && node.dtype != at::kLong && node.dtype != at::kDouble && node.dtype != at::kBool;
  double as_double = 0;
  if (at::isFloatingType(node.dtype)) {
    as_double = PyFloat_AsDouble(item);  // an int too large for a double fails here
    if (as_double == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      fail("value", index, path, "a number that fits in float64", "an integer too large for float64");
    }
    node.floats.push_back(as_double);
  } else {
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (overflow != 0 && spec == nullptr) {
      return false;
    }
    if (overflow != 0) {
      fail("size", index, path, "an integer that fits in int64", "an integer out of int64's range");
    }
    as_double = static_cast<double>(value);
    node.ints.push_back(value);
  }
  // Exact for the narrow integer dtypes (at most 32 bits) and uint64's sign, the only ones checked.
  if (narrow && !value_fits(as_double, node.dtype)) {
    fail(python_value_misfit(node.dtype, ""), index, path);
  }
  if (spec != nullptr && spec->range && !(as_double >= spec->range->low && as_double < spec->range->high)) {
    std::ostringstream expected;
    expected << "a value in [" << spec->range->low << ", " << spec->range->high << ")";
    fail("value", index, path, expected.str(), std::isnan(as_double) ? "NaN" : "a value outside that range",
         "fix the label, or widen the declared range");
  }
  return true;
}

}  // namespace fastcollate

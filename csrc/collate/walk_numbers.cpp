// Number fields: Python ints, floats and bools, written straight into the batch buffer; mixed numbers
// are left to torch.tensor's inference, as default_collate leaves them. Under a contract a number may
// also be a 0-d tensor, as an Arrays column of one number per sample hands it out.
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
  if (spec != nullptr && THPVariable_Check(items[0])) {
    return number_tensors(items, path, *spec);
  }
  auto node = std::make_unique<Node>();
  node->kind = Node::Kind::Numbers;
  node->path = path;
  node->shape = {static_cast<int64_t>(items.size())};
  PyObject* elem = items[0];
  if (spec != nullptr && spec->dtype) {
    node->dtype = *spec->dtype;
  } else {
    // Not a Python number (a numpy scalar, a tensor): the loop below leaves it to torch.tensor's inference.
    node->dtype = python_number_dtype(elem).value_or(at::kLong);
  }
  if (auto violation = number_dtype_rule(node->dtype)) {
    fail(*violation, 0, path);
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
      fail(not_a_number(type_name(item), spec ? std::optional(node->dtype) : std::nullopt), i, path);
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
      fail(not_a_number(type_name(items[j]), std::nullopt), j, path);
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
    fail(number_refusal(error_kind(error), first_line(error)), bad, path);
  }
  return node;
}

// An Arrays column's element is a 0-d tensor: the number field's samples are then that column's rows,
// checked as a tensor field of shape [] (dtype, cast_from, range), as the column gather checks them.
std::unique_ptr<Node> Walk::number_tensors(const Items& items, const std::string& path, const FieldSpec& spec) {
  const at::ScalarType declared = spec.dtype.value_or(THPVariable_Unpack(items[0]).scalar_type());
  for (size_t i = 0; i < items.size(); ++i) {
    if (!THPVariable_Check(items[i])) {
      fail(not_a_tensor_like_first(type_name(items[i])), i, path);
    }
    const at::Tensor& value = THPVariable_Unpack(items[i]);
    if (value.dim() != 0) {
      fail(number_tensor_misfit(declared, value.sizes()), i, path);
    }
  }
  return tensors(items, path, &spec);
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
      fail(number_past_float64(), index, path);
    }
    node.floats.push_back(as_double);
  } else {
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (overflow != 0 && spec == nullptr) {
      return false;
    }
    if (overflow != 0) {
      fail(number_past_int64(), index, path);
    }
    as_double = static_cast<double>(value);
    node.ints.push_back(value);
  }
  // Exact for the narrow integer dtypes (at most 32 bits) and uint64's sign, the only ones checked.
  if (narrow && !value_fits(as_double, node.dtype)) {
    fail(python_value_misfit(node.dtype, /*flat=*/-1), index, path);
  }
  if (spec != nullptr && spec->range && !(as_double >= spec->range->low && as_double < spec->range->high)) {
    fail(range_misfit(*spec->range, /*flat=*/-1, as_double), index, path);
  }
  return true;
}

}  // namespace fastcollate

// The walk's structure: which kind of node each value makes, containers (dicts, mappings, lists, tuples,
// namedtuples, sequences), strings, and where each tensor goes in the batch buffer.
#include "collate/walk.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>

#include "collate/messages.h"
#include "collate/plan.h"

namespace fastcollate {

void Walk::fail(const Violation& violation, size_t index, const std::string& field) const {
  raise_violation(violation, batch_, index, field, contract_.id_key());
}

std::string Walk::error_kind(const py::error_already_set& error) {
  // The ContractError kind whose class is also the class of `error` (TypeError stays a TypeError, ...),
  // so code written for default_collate's errors still works. The table is fastcollate.collate.errors'.
  return python_refs().error_kind(error.value()).cast<std::string>();
}

const FieldSpec* Walk::leaf_spec(const std::string& path, size_t index) const {
  if (!contract_.has_contract()) {
    return nullptr;
  }
  const FieldSpec* spec = contract_.field(path);
  if (spec == nullptr) {
    fail(undeclared_field(), index, path);
  }
  return spec;
}

void Walk::check_all_fields_seen() {
  if (!contract_.has_contract()) {
    return;
  }
  for (const auto& spec : contract_.fields()) {
    if (std::find(seen_fields_.begin(), seen_fields_.end(), spec.path) == seen_fields_.end()) {
      fail(missing_declared_field(), 0, spec.path);
    }
  }
}

std::unique_ptr<Node> Walk::node(const Items& items, const std::string& path) {
  PyObject* elem = items[0];
  const PythonRefs& refs = python_refs();
  if (contract_.has_contract() && !contract_.is_container_path(path)) {
    const FieldSpec* spec = leaf_spec(path, 0);
    seen_fields_.push_back(path);
    switch (spec->kind) {
      case FieldKind::Number:
        return numbers(items, path, spec);
      case FieldKind::Text:
        return texts(items, path, spec);
      case FieldKind::Tensor:
        return tensors(items, path, spec);
    }
  }
  if (THPVariable_Check(elem) || is_instance(elem, refs.ndarray)) {
    return tensors(items, path, nullptr);
  }
  if (is_instance(elem, refs.numpy_generic) && !PyUnicode_Check(elem) && !PyBytes_Check(elem)) {
    return left_to_default(items, path);  // numpy scalars: torch.as_tensor(batch), as default_collate does
  }
  if (PyFloat_Check(elem) || PyLong_Check(elem)) {
    return numbers(items, path, nullptr);
  }
  if (PyUnicode_Check(elem) || PyBytes_Check(elem)) {
    return texts(items, path, nullptr);
  }
  if (PyDict_Check(elem) || is_instance(elem, refs.mapping_abc)) {
    return mapping(items, path, PyDict_Check(elem));
  }
  if (PyTuple_Check(elem) || PyList_Check(elem) || is_instance(elem, refs.sequence_abc)) {
    return sequence(items, path);
  }
  fail(unsupported_value(type_name(elem)), 0, path);
}

std::unique_ptr<Node> Walk::left_to_default(const Items& items, const std::string& path) {
  auto node = std::make_unique<Node>();
  node->kind = Node::Kind::Ready;
  node->path = path;
  py::list values(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    values[i] = py::reinterpret_borrow<py::object>(items[i]);
  }
  node->ready = python_refs().default_collate(values, path, batch_, contract_.id_key());
  return node;
}

std::unique_ptr<Node> Walk::texts(const Items& items, const std::string& path, const FieldSpec* spec) {
  auto node = std::make_unique<Node>();
  node->kind = Node::Kind::Ready;
  node->path = path;
  py::list values(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    if (spec != nullptr && !PyUnicode_Check(items[i]) && !PyBytes_Check(items[i])) {
      fail(not_text(type_name(items[i])), i, path);
    }
    values[i] = py::reinterpret_borrow<py::object>(items[i]);
  }
  node->ready = std::move(values);
  node->text = true;
  return node;
}

namespace {

std::vector<py::object> keys_of(PyObject* elem, bool is_dict) {
  std::vector<py::object> keys;
  if (is_dict) {
    PyObject* key = nullptr;
    PyObject* value = nullptr;
    Py_ssize_t position = 0;
    while (PyDict_Next(elem, &position, &key, &value)) {
      keys.push_back(py::reinterpret_borrow<py::object>(key));
    }
  } else {
    for (py::handle key : py::reinterpret_borrow<py::object>(elem).attr("keys")()) {
      keys.push_back(py::reinterpret_borrow<py::object>(key));
    }
  }
  return keys;
}

// Whether a sample's dict key is sample 0's key at the same place, told without running Python code:
// the same object, or two exact strs. Keys made anew in every sample (parsed JSON, f-strings) are equal
// strings at other addresses, one comparison per key per sample: they are compared by their characters
// here, as str.__eq__ compares them, since Python's generic == (its dispatch, a bool object) made such a
// batch a third slower than one whose samples share their keys. Anything else (a str subclass, which
// may define __eq__; an int, a tuple) is left to Python's ==.
enum class KeyMatch { kSame, kDifferent, kAskPython };

KeyMatch match_without_python(PyObject* key, PyObject* first) {
  if (key == first) {
    return KeyMatch::kSame;
  }
  bool plain_strs = PyUnicode_CheckExact(key) && PyUnicode_CheckExact(first);
#if PY_VERSION_HEX < 0x030C0000
  // Before 3.12 a str made through the old wchar_t API may not hold its characters in canonical form yet.
  plain_strs = plain_strs && PyUnicode_IS_READY(key) && PyUnicode_IS_READY(first);
#endif
  if (!plain_strs) {
    return KeyMatch::kAskPython;
  }
  const Py_ssize_t length = PyUnicode_GET_LENGTH(key);
  const int kind = PyUnicode_KIND(key);
  const bool same = length == PyUnicode_GET_LENGTH(first) && kind == PyUnicode_KIND(first) &&
                    std::memcmp(PyUnicode_DATA(key), PyUnicode_DATA(first), static_cast<size_t>(length) * kind) == 0;
  return same ? KeyMatch::kSame : KeyMatch::kDifferent;
}

// `value`, held, when `key` == `first` by Python's ==; null when not. Both are held across the comparison:
// a key's __eq__ may remove the entry from its dict.
py::object value_if_equal_by_python(PyObject* key, PyObject* value, PyObject* first) {
  const py::object held_key = py::reinterpret_borrow<py::object>(key);
  py::object held_value = py::reinterpret_borrow<py::object>(value);
  const int equal = PyObject_RichCompareBool(key, first, Py_EQ);
  if (equal < 0) {
    throw py::error_already_set();
  }
  return equal == 1 ? held_value : py::object();
}

// Fast path: a dict whose keys come in sample 0's order (the usual case: one code path made every
// sample) is read in one PyDict_Next pass with no hashing; what does not line up stays null. Value k of
// sample i is at k * count + i.
std::vector<py::object> values_in_key_order(const std::vector<PyObject*>& items, const std::vector<py::object>& keys) {
  const size_t count = items.size();
  std::vector<py::object> in_order(keys.size() * count);
  // Locals, not the vectors' fields: those would be read again after every call into Python.
  const size_t key_count = keys.size();
  const py::object* first_keys = keys.data();
  for (size_t i = 0; i < count; ++i) {
    if (!PyDict_Check(items[i])) {
      continue;
    }
    py::object* values = in_order.data() + i;  // value k at values[k * count]
    PyObject* key = nullptr;
    PyObject* value = nullptr;
    Py_ssize_t position = 0;
    for (size_t k = 0; k < key_count && PyDict_Next(items[i], &position, &key, &value); ++k) {
      const KeyMatch match = match_without_python(key, first_keys[k].ptr());
      if (match == KeyMatch::kSame) {
        values[k * count] = py::reinterpret_borrow<py::object>(value);
        continue;
      }
      py::object held = match == KeyMatch::kAskPython ? value_if_equal_by_python(key, value, first_keys[k].ptr())
                                                      : py::object();
      if (!held) {
        break;
      }
      values[k * count] = std::move(held);
    }
  }
  return in_order;
}

// The value of `key` in `item`, looked up; null when it has none.
py::object look_up(PyObject* item, const py::object& key) {
  if (PyDict_Check(item)) {
    PyObject* found = PyDict_GetItemWithError(item, key.ptr());
    if (found == nullptr && PyErr_Occurred()) {
      throw py::error_already_set();
    }
    return py::reinterpret_borrow<py::object>(found);
  }
  py::object value = py::reinterpret_steal<py::object>(PyObject_GetItem(item, key.ptr()));
  if (!value) {
    PyErr_Clear();
  }
  return value;
}

}  // namespace

std::unique_ptr<Node> Walk::mapping(const Items& items, const std::string& path, bool is_dict) {
  PyObject* elem = items[0];
  auto node = std::make_unique<Node>();
  node->kind = PyDict_CheckExact(elem) ? Node::Kind::Dict : Node::Kind::Mapping;
  node->path = path;
  node->elem = py::reinterpret_borrow<py::object>(elem);
  node->keys = keys_of(elem, is_dict);
  check_same_keys(items, path, *node);
  // Every value is held from here until the plan is done (BatchPlan::held): Python code the walk runs (a
  // key's __eq__, a mapping's __getitem__, a tensor subclass's __torch_function__, another thread meanwhile)
  // may remove values from their dicts, and execute() reads the tensors without the GIL.
  const size_t count = items.size();
  std::vector<py::object> in_order = values_in_key_order(items, node->keys);
  std::vector<PyObject*> values(count);
  std::vector<py::object> kept;  // the batch's keys: the samples' but those dropped, and the copies
  for (size_t k = 0; k < node->keys.size(); ++k) {
    const py::object& key = node->keys[k];
    const std::string key_path = child_path(path, py::str(key));
    if (contract_.is_dropped(key_path)) {
      continue;
    }
    const FieldSpec* declared = contract_.field(key_path);
    if (declared != nullptr && !declared->copy_of.empty()) {
      // The samples hold every key sample 0 holds (check_same_keys): sample 0 is the first to hold it.
      fail(copied_key_in_sample(declared->copy_of), 0, key_path);
    }
    for (size_t i = 0; i < count; ++i) {
      py::object& value = in_order[k * count + i];
      if (!value) {
        value = look_up(items[i], key);
      }
      if (!value) {
        fail(missing_key_of_first(), i, key_path);
      }
      values[i] = value.ptr();
    }
    node->children.push_back(this->node(values, key_path));
    kept.push_back(key);
    // A copy reads the same samples under its own declaration (dtype, separator), right after its source.
    for (const FieldSpec* copy : contract_.copies_of(key_path)) {
      seen_fields_.push_back(copy->path);
      node->children.push_back(tensors(values, copy->path, copy));
      kept.push_back(py::str(copy->path.substr(copy->path.rfind('.') + 1)));
    }
  }
  node->keys = std::move(kept);
  plan_.held.push_back(std::move(in_order));
  return node;
}

void Walk::check_same_keys(const Items& items, const std::string& path, const Node& node) {
  PyObject* elem = items[0];
  const Py_ssize_t key_count = static_cast<Py_ssize_t>(node.keys.size());
  // Under a contract the sample that breaks the contract is named: sample 0 when it lacks a declared
  // field or has an undeclared one.
  auto declared = [&](const std::string& key_path) {
    return contract_.field(key_path) != nullptr || contract_.is_container_path(key_path);
  };
  for (size_t i = 1; i < items.size(); ++i) {
    PyObject* item = items[i];
    if (!PyDict_Check(item) && !is_instance(item, python_refs().mapping_abc)) {
      fail(not_a_mapping_like_first(type_name(item)), i, path_or_sample(path));
    }
    const Py_ssize_t size = PyObject_Length(item);
    if (size < 0) {
      throw py::error_already_set();
    }
    if (size == key_count) {
      continue;
    }
    // Find a key one side has and the other lacks, to name it.
    for (const auto& key : node.keys) {
      if (PySequence_Contains(py::handle(item).attr("keys")().ptr(), key.ptr()) != 1) {
        const std::string key_path = child_path(path, py::str(key));
        if (contract_.has_contract() && !declared(key_path)) {
          fail(undeclared_field(), 0, key_path);
        }
        fail(missing_key_of_first(), i, key_path);
      }
    }
    for (py::handle key : py::handle(item).attr("keys")()) {
      if (PySequence_Contains(py::handle(elem).attr("keys")().ptr(), key.ptr()) != 1) {
        const std::string key_path = child_path(path, py::str(key));
        if (contract_.has_contract() && declared(key_path)) {
          fail(missing_declared_field(), 0, key_path);
        }
        fail(extra_key_of_first(), i, key_path);
      }
    }
  }
}

std::unique_ptr<Node> Walk::sequence(const Items& items, const std::string& path) {
  PyObject* elem = items[0];
  auto node = std::make_unique<Node>();
  node->path = path;
  node->elem = py::reinterpret_borrow<py::object>(elem);
  const bool named_tuple =
      PyTuple_Check(elem) && PyObject_HasAttrString(reinterpret_cast<PyObject*>(Py_TYPE(elem)), "_fields");
  node->kind = named_tuple                                      ? Node::Kind::NamedTuple
               : PyTuple_Check(elem) || PyList_CheckExact(elem) ? Node::Kind::List
                                                                : Node::Kind::Sequence;
  // PySequence_Fast gives list/tuple items without copying; other sequences are listed once.
  std::vector<py::object> fast(items.size());
  const Py_ssize_t length = PyObject_Length(elem);
  if (length < 0) {
    throw py::error_already_set();
  }
  for (size_t i = 0; i < items.size(); ++i) {
    PyObject* item = items[i];
    const bool is_sequence =
        PyList_Check(item) || PyTuple_Check(item) ||
        (!PyUnicode_Check(item) && !PyBytes_Check(item) && is_instance(item, python_refs().sequence_abc));
    if (!is_sequence) {
      fail(not_a_sequence_like_first(type_name(item)), i, path_or_sample(path));
    }
    // A tuple: its length and items stay fixed while the walk runs Python code (a list could shrink).
    fast[i] = py::reinterpret_steal<py::object>(PySequence_Tuple(item));
    if (!fast[i]) {
      throw py::error_already_set();
    }
    const Py_ssize_t got = PySequence_Fast_GET_SIZE(fast[i].ptr());
    if (got != length) {
      // Lists of numbers of other lengths are what a padded field takes (token ids): say how to declare one.
      PyObject* list = fast[length > 0 ? 0 : i].ptr();
      const std::optional<at::ScalarType> numbers =
          PySequence_Fast_GET_SIZE(list) > 0 ? python_number_dtype(PySequence_Fast_GET_ITEM(list, 0)) : std::nullopt;
      const std::string padding = numbers && !contract_.has_contract()
                                      ? padded_field(path, *numbers, {int64_t{length}}, {int64_t{got}})
                                      : "";
      fail(sequence_length_misfit(length, got, padding), i, path_or_sample(path));
    }
  }
  std::vector<PyObject*> values(items.size());
  for (Py_ssize_t k = 0; k < length; ++k) {
    for (size_t i = 0; i < items.size(); ++i) {
      values[i] = PySequence_Fast_GET_ITEM(fast[i].ptr(), k);
    }
    std::string name =
        named_tuple ? py::str(py::handle(elem).attr("_fields")[py::int_(k)]).cast<std::string>() : std::to_string(k);
    auto child = this->node(values, child_path(path, name));
    if (child->padded) {
      fail(padded_in_sequence(type_name(elem)), 0, child->path);
    }
    if (child->packed) {
      fail(packed_in_sequence(type_name(elem)), 0, child->path);
    }
    if (child->text) {
      child->ready = py::tuple(child->ready);  // default_collate hands strings back as zip gave them
    }
    node->children.push_back(std::move(child));
  }
  for (auto& sequence : fast) {
    plan_.keepalive.push_back(std::move(sequence));
  }
  return node;
}

void Walk::lay_out(Node& node) {
  // Sizes come from samples (a stride-0 expand can claim any size): the product must not wrap.
  uint64_t bytes = c10::elementSize(node.dtype);
  bool overflow = false;
  for (int64_t size : node.shape) {
    overflow |= __builtin_mul_overflow(bytes, static_cast<uint64_t>(size), &bytes);
  }
  const uint64_t limit = static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) - 2 * kFieldAlignment;
  if (overflow || bytes > limit - static_cast<uint64_t>(plan_.nbytes())) {
    fail(batch_past_memory(node.shape, node.dtype), 0, path_or_sample(node.path));
  }
  node.offset = plan_.reserve(static_cast<size_t>(bytes));
}

}  // namespace fastcollate

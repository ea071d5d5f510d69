#include "batch_plan.h"

#include <ATen/Dispatch.h>
#include <ATen/Dispatch_v2.h>
#include <c10/util/overflows.h>
#include <pybind11/gil_safe_call_once.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>

namespace fastcollate {

namespace {

// Python objects the walk needs, looked up once. Deliberately leaked: they must not be released after
// the interpreter has shut down.
struct PythonHelpers {
  py::object contract_error;    // fastcollate.errors.make_error
  py::object rebuild_mapping;   // copies default_collate's rules for Mapping subclasses
  py::object rebuild_sequence;  // and for Sequence subclasses
  py::object default_collate;   // torch's, for leaves we deliberately leave to it
  py::object as_tensor;         // torch.as_tensor
  py::object tensor_from_list;  // torch.tensor
  py::object mapping_abc;
  py::object sequence_abc;
  py::object ndarray;
  py::object numpy_generic;
  py::object numpy_number;  // numpy.number and numpy.bool_: scalars torch.tensor takes like numbers
  py::object numpy_bool;
  py::object str_type;
  py::object float64;
};

const PythonHelpers& helpers() {
  // Initialised once even when two threads collate first at the same time: a plain function-local
  // static would deadlock if its initialiser (which imports) gave up the GIL while another thread
  // waited on the static's guard holding it. Never destroyed: it must outlive the interpreter.
  PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<PythonHelpers*> storage;
  return *storage.call_once_and_store_result([] {
    auto* h = new PythonHelpers();
    py::module_ support = py::module_::import("fastcollate._native_support");
    h->contract_error = py::module_::import("fastcollate.errors").attr("make_error");
    h->rebuild_mapping = support.attr("rebuild_mapping");
    h->rebuild_sequence = support.attr("rebuild_sequence");
    h->default_collate = support.attr("default_collate");
    h->as_tensor = py::module_::import("torch").attr("as_tensor");
    h->tensor_from_list = py::module_::import("torch").attr("tensor");
    py::module_ abc = py::module_::import("collections.abc");
    h->mapping_abc = abc.attr("Mapping");
    h->sequence_abc = abc.attr("Sequence");
    py::module_ numpy = py::module_::import("numpy");
    h->ndarray = numpy.attr("ndarray");
    h->numpy_generic = numpy.attr("generic");
    h->numpy_number = numpy.attr("number");
    h->numpy_bool = numpy.attr("bool_");
    h->str_type = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(&PyUnicode_Type));
    h->float64 = py::module_::import("torch").attr("float64");
    return h;
  }).get_stored();
}

bool is_instance(PyObject* obj, const py::object& type) {
  const int result = PyObject_IsInstance(obj, type.ptr());
  if (result < 0) {
    throw py::error_already_set();
  }
  return result == 1;
}

std::string type_name(PyObject* obj) {
  return Py_TYPE(obj)->tp_name;
}

// The ContractError kind whose class is also the class of the Python error `error` (TypeError stays a
// TypeError, ValueError a ValueError, ...), so code written for default_collate's errors still works.
const char* kind_of(const py::error_already_set& error) {
  if (error.matches(PyExc_TypeError)) {
    return "type";
  }
  if (error.matches(PyExc_ValueError)) {
    return "value";
  }
  if (error.matches(PyExc_KeyError)) {
    return "key";
  }
  if (error.matches(PyExc_IndexError)) {
    return "empty";
  }
  return "size";
}

// "TypeError: can't convert ...": the error's first line, short. Torch's messages name types and
// shapes, never values.
std::string describe(const py::error_already_set& error) {
  std::string text = error.what();
  const size_t newline = text.find('\n');
  if (newline != std::string::npos) {
    text.resize(newline);
  }
  if (text.size() > 200) {
    text = text.substr(0, 197) + "...";
  }
  return text;
}

std::string shape_string(at::IntArrayRef sizes) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    out << (i ? ", " : "") << sizes[i];
  }
  out << "]";
  return out.str();
}

// (1, 16, 16) or (5,): how a shape is written in a Field declaration.
std::string python_tuple(at::IntArrayRef sizes) {
  std::ostringstream out;
  out << "(";
  for (size_t i = 0; i < sizes.size(); ++i) {
    out << (i ? ", " : "") << sizes[i];
  }
  out << (sizes.size() == 1 ? ",)" : ")");
  return out.str();
}

std::string dtype_string(at::ScalarType dtype) {
  // As Python writes it: torch.int8, not torch.char.
  switch (dtype) {
    case at::kByte: return "torch.uint8";
    case at::kChar: return "torch.int8";
    case at::kShort: return "torch.int16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kHalf: return "torch.float16";
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kComplexHalf: return "torch.complex32";
    case at::kComplexFloat: return "torch.complex64";
    case at::kComplexDouble: return "torch.complex128";
    default: break;
  }
  std::string text = std::string("torch.") + c10::toString(dtype);
  for (auto& c : text) {
    c = static_cast<char>(std::tolower(c));
  }
  return text;
}

std::string child_path(const std::string& parent, const std::string& key) {
  return parent.empty() ? key : parent + "." + key;
}

}  // namespace

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

// Batches of many small fields are bound by memory latency, not work: each leaf is a Python object, a
// TensorImpl and a StorageImpl in three places of the heap. The walk asks for the lines it reads next a
// few samples ahead.
// Measured on 256 samples of 18 fields with the caches flushed before each batch: three stages 6 samples
// apart gain 40% over no prefetch; two stages 8 apart 35%; farther is slower.
constexpr size_t kPrefetchAhead = 6;
constexpr size_t kPythonObjectBytes = 64;  // a tensor's PyObject header and handle (THPVariable)

inline void prefetch(const void* address, size_t bytes) {
  for (size_t offset = 0; offset < bytes; offset += 64) {
    __builtin_prefetch(static_cast<const char*>(address) + offset);
  }
}

// The address of a dense CPU tensor's first element. Tensor::const_data_ptr() with its checks inlined away
// (two calls per leaf): the walk has already checked that the tensor is dense, strided and on the CPU.
inline const void* first_element(const at::Tensor& tensor) {
  const c10::TensorImpl* impl = tensor.unsafeGetTensorImpl();
  return static_cast<const char*>(impl->unsafe_storage().data()) + impl->storage_offset() * impl->itemsize();
}

// ArrayRef's == calls memcmp; shapes have a handful of dims.
inline bool same_sizes(at::IntArrayRef a, at::IntArrayRef b) {
  if (a.size() != b.size()) {
    return false;
  }
  for (size_t d = 0; d < a.size(); ++d) {
    if (a[d] != b[d]) {
      return false;
    }
  }
  return true;
}

inline void prefetch_storage(const at::Tensor& tensor) {
  // unsafe_storage(): no check, an empty Storage for tensors without one (a prefetch of null is harmless
  // but skipped).
  if (const c10::StorageImpl* storage = tensor.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl()) {
    prefetch(storage, sizeof(c10::StorageImpl));
  }
}

// The output structure, one node per field path, with the samples' values for that path.
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
  std::vector<int64_t> var_dims;  // the named dims, in order: mask dim k is var_dims[k]
  std::unique_ptr<Node> mask;
  std::unique_ptr<Node> lengths;
  std::string mask_name;
  std::string lengths_name;
  // Numbers: the values, already converted.
  std::vector<int64_t> ints;
  std::vector<double> floats;
  // Ready: the finished value (strings, leaves left to default_collate).
  py::object ready;
  bool text = false;  // strings: default_collate returns them as it got them (a tuple inside sequences)

  at::Tensor out;  // set by execute()
};

namespace {

// One walk over a batch: which samples, against what, and what has been seen.
class Walk {
 public:
  Walk(const Collator& collator, py::handle batch, BatchPlan& plan)
      : collator_(collator), batch_(batch), plan_(plan) {}

  std::unique_ptr<Node> node(const std::vector<PyObject*>& items, const std::string& path);
  void check_all_fields_seen();

 private:
  [[noreturn]] void fail(const char* kind, size_t index, const std::string& field, const std::string& expected,
                         const std::string& got, const std::string& hint = "") const;
  std::unique_ptr<Node> tensors(const std::vector<PyObject*>& items, const std::string& path, const FieldSpec* spec);
  bool stack_plain_tensors(const std::vector<PyObject*>& items, const FieldSpec* spec, Node& node);
  std::unique_ptr<Node> numbers(const std::vector<PyObject*>& items, const std::string& path, const FieldSpec* spec);
  std::unique_ptr<Node> texts(const std::vector<PyObject*>& items, const std::string& path, const FieldSpec* spec);
  std::unique_ptr<Node> mapping(const std::vector<PyObject*>& items, const std::string& path, bool is_dict);
  std::unique_ptr<Node> sequence(const std::vector<PyObject*>& items, const std::string& path);
  std::unique_ptr<Node> left_to_default(const std::vector<PyObject*>& items, const std::string& path);
  const FieldSpec* leaf_spec(const std::string& path, size_t index) const;
  void check_range(const at::Tensor& value, const FieldSpec& spec, size_t index);
  void check_cast(const at::Tensor& value, at::ScalarType dtype, const std::string& path, size_t index);
  void check_named_dim(const std::string& name, size_t index, int64_t size, const std::string& path, size_t count);
  void lay_out(Node& node);

  const Collator& collator_;
  py::handle batch_;
  BatchPlan& plan_;
  std::vector<std::string> seen_fields_;
  // Named dims ("T") must agree between the fields of one sample: name -> size per sample (-1 unset).
  std::unordered_map<std::string, std::pair<std::string, std::vector<int64_t>>> named_dims_;
};

void Walk::fail(const char* kind, size_t index, const std::string& field, const std::string& expected,
                const std::string& got, const std::string& hint) const {
  py::object error = helpers().contract_error(kind, batch_, index, field, expected, got, hint, collator_.id_key());
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
  throw py::error_already_set();
}

const FieldSpec* Walk::leaf_spec(const std::string& path, size_t index) const {
  if (!collator_.has_contract()) {
    return nullptr;
  }
  const FieldSpec* spec = collator_.field(path);
  if (spec == nullptr) {
    fail("key", index, path, "no such field (the contract does not declare it)", "a value",
         "declare the field in the contract, or remove it in the dataset's transform");
  }
  return spec;
}

void Walk::check_all_fields_seen() {
  if (!collator_.has_contract()) {
    return;
  }
  for (const auto& spec : collator_.fields()) {
    if (std::find(seen_fields_.begin(), seen_fields_.end(), spec.path) == seen_fields_.end()) {
      fail("key", 0, spec.path, "a value (the contract declares this field)", "no such field",
           "return the field from the dataset, or remove it from the contract");
    }
  }
}

std::unique_ptr<Node> Walk::node(const std::vector<PyObject*>& items, const std::string& path) {
  PyObject* elem = items[0];
  const PythonHelpers& h = helpers();
  if (collator_.has_contract() && !collator_.is_container_path(path)) {
    const FieldSpec* spec = leaf_spec(path, 0);
    seen_fields_.push_back(path);
    if (spec->kind == "number") {
      return numbers(items, path, spec);
    }
    if (spec->kind == "text") {
      return texts(items, path, spec);
    }
    return tensors(items, path, spec);
  }
  if (THPVariable_Check(elem) || is_instance(elem, h.ndarray)) {
    return tensors(items, path, nullptr);
  }
  if (is_instance(elem, h.numpy_generic) && !PyUnicode_Check(elem) && !PyBytes_Check(elem)) {
    return left_to_default(items, path);  // numpy scalars: torch.as_tensor(batch), as default_collate does
  }
  if (PyFloat_Check(elem) || PyLong_Check(elem)) {
    return numbers(items, path, nullptr);
  }
  if (PyUnicode_Check(elem) || PyBytes_Check(elem)) {
    return texts(items, path, nullptr);
  }
  if (PyDict_Check(elem) || is_instance(elem, h.mapping_abc)) {
    return mapping(items, path, PyDict_Check(elem));
  }
  if (PyTuple_Check(elem) || PyList_Check(elem) || is_instance(elem, h.sequence_abc)) {
    return sequence(items, path);
  }
  fail("type", 0, path, "tensors, numpy arrays, numbers, strings, dicts or lists", type_name(elem),
       "convert the field to a tensor in the dataset, or drop it there explicitly");
}

std::unique_ptr<Node> Walk::left_to_default(const std::vector<PyObject*>& items, const std::string& path) {
  auto node = std::make_unique<Node>();
  node->kind = Node::Kind::Ready;
  node->path = path;
  py::list values(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    values[i] = py::reinterpret_borrow<py::object>(items[i]);
  }
  node->ready = helpers().default_collate(values, path, batch_, collator_.id_key());
  return node;
}

void Walk::check_named_dim(const std::string& name, size_t index, int64_t size, const std::string& path,
                           size_t count) {
  auto& entry = named_dims_[name];
  if (entry.second.empty()) {
    entry.first = path;
    entry.second.assign(count, -1);
  }
  int64_t& known = entry.second[index];
  if (known == -1) {
    known = size;
  } else if (known != size) {
    fail("size", index, path, "dim " + name + " = " + std::to_string(known) + " (as in field " + entry.first + ")",
         "dim " + name + " = " + std::to_string(size), "fields that share a named dim must agree within a sample");
  }
}

void Walk::check_range(const at::Tensor& value, const FieldSpec& spec, size_t index) {
  if (!spec.has_range || value.numel() == 0) {
    return;
  }
  if (value.is_complex()) {
    fail("type", index, spec.path, "a real dtype (the field declares a range)", dtype_string(value.scalar_type()),
         "complex values have no order: drop the range or convert the field");
  }
  at::Tensor contiguous = value.contiguous();
  int64_t bad = -1;
  double bad_value = 0;
  AT_DISPATCH_V2(contiguous.scalar_type(), "check_range", AT_WRAP([&] {
    const scalar_t* data = contiguous.const_data_ptr<scalar_t>();
    for (int64_t i = 0; i < contiguous.numel(); ++i) {
      const double v = static_cast<double>(data[i]);
      if (!(v >= spec.low && v < spec.high)) {  // NaN fails too
        bad = i;
        bad_value = v;
        break;
      }
    }
  }), AT_EXPAND(AT_ALL_TYPES), at::kBool, at::kHalf, at::kBFloat16, AT_EXPAND(AT_BAREBONES_UNSIGNED_TYPES),
      AT_EXPAND(AT_FLOAT8_TYPES));
  if (bad >= 0) {
    std::ostringstream expected;
    expected << "values in [" << spec.low << ", " << spec.high << ")";
    // Report where, not the value: sample contents may be sensitive; the bound is enough to act on.
    std::string got = std::isnan(bad_value) ? "NaN at flat position " + std::to_string(bad)
                      : bad_value < spec.low ? "a value below the range at flat position " + std::to_string(bad)
                                             : "a value at or above the upper bound at flat position " +
                                                   std::to_string(bad);
    fail("value", index, spec.path, expected.str(), got, "fix the label, or widen the declared range");
  }
}

// A declared cast from floating point to an integer dtype must not turn NaN, infinities or values past
// the dtype's range into arbitrary integers (C++ leaves those conversions undefined).
void Walk::check_cast(const at::Tensor& value, at::ScalarType dtype, const std::string& path, size_t index) {
  if (value.scalar_type() == dtype || value.numel() == 0 || !at::isFloatingType(value.scalar_type()) ||
      !at::isIntegralType(dtype, /*includeBool=*/false)) {
    return;
  }
  const at::Tensor as_double = value.to(at::kDouble);
  const bool finite = at::isfinite(as_double).all().item<bool>();
  bool fits = finite;
  if (finite) {
    const double low = as_double.min().item<double>();
    const double high = as_double.max().item<double>();
    AT_DISPATCH_V2(dtype, "check_cast", AT_WRAP([&] {
      fits = !c10::overflows<scalar_t, double>(low) && !c10::overflows<scalar_t, double>(high);
    }), AT_EXPAND(AT_INTEGRAL_TYPES), AT_EXPAND(AT_BAREBONES_UNSIGNED_TYPES));
  }
  if (!fits) {
    fail("value", index, path,
         "values " + dtype_string(dtype) + " can hold (declared cast from " + dtype_string(value.scalar_type()) + ")",
         finite ? "a value outside that range" : "NaN or an infinity",
         "fix the value in the dataset, or declare a floating-point dtype");
  }
}

// The common case in one pass over the samples, each read once while it is in cache: every sample a plain
// tensor (not a subclass), dense on the CPU, without grad, with sample 0's dispatch keys, and the dtype
// and shape of sample 0 (drop-in) or the declared ones (a contract, fixed dims only; ranges are checked
// here too). Returns false at the first sample that is not, and the general path decides (and names the
// sample, when it is an error).
bool Walk::stack_plain_tensors(const std::vector<PyObject*>& items, const FieldSpec* spec, Node& node) {
  const size_t count = items.size();
  if (!THPVariable_CheckExact(items[0])) {
    return false;
  }
  const at::Tensor& first = THPVariable_Unpack(items[0]);
  const bool dense = first.device().is_cpu() && first.layout() == at::kStrided && !first.is_quantized() &&
                     !first.is_nested();
  if (!dense || first.requires_grad() || first.is_conj() || first.is_neg()) {
    return false;
  }
  const auto keys = first.key_set();
  at::IntArrayRef sizes = first.sizes();
  at::ScalarType dtype = first.scalar_type();
  if (spec != nullptr) {
    const bool named_dims = std::any_of(spec->dim_names.begin(), spec->dim_names.end(),
                                        [](const std::string& name) { return !name.empty(); });
    if (spec->padded || named_dims) {
      return false;
    }
    sizes = spec->has_shape ? at::IntArrayRef(spec->shape) : sizes;
    dtype = spec->has_dtype ? spec->dtype : dtype;
  }
  node.inputs.items.resize(count);
  node.sources.resize(count);
  for (size_t i = 0; i < count; ++i) {
    // Three stages, each reading what the one before asked for: a later sample's Python object, then the
    // TensorImpl it points to, then the StorageImpl (where the data pointer lives) of a nearer one.
    if (i + 3 * kPrefetchAhead < count) {
      prefetch(items[i + 3 * kPrefetchAhead], kPythonObjectBytes);
    }
    if (i + 2 * kPrefetchAhead < count && THPVariable_CheckExact(items[i + 2 * kPrefetchAhead])) {
      prefetch(THPVariable_Unpack(items[i + 2 * kPrefetchAhead]).unsafeGetTensorImpl(), sizeof(c10::TensorImpl));
    }
    if (i + kPrefetchAhead < count && THPVariable_CheckExact(items[i + kPrefetchAhead])) {
      prefetch_storage(THPVariable_Unpack(items[i + kPrefetchAhead]));
    }
    if (!THPVariable_CheckExact(items[i])) {
      return false;
    }
    const at::Tensor& value = THPVariable_Unpack(items[i]);
    // The same dispatch keys as sample 0 mean the same device type and layout, and no conj or neg bit.
    if (value.key_set() != keys || value.scalar_type() != dtype || !same_sizes(value.sizes(), sizes) ||
        value.requires_grad()) {
      return false;
    }
    if (spec != nullptr && spec->has_range) {
      check_range(value, *spec, i);
    }
    node.inputs.items[i] = &value;
    node.sources[i] = value.is_contiguous() ? first_element(value) : nullptr;
  }
  node.dtype = dtype;
  node.shape.reserve(sizes.size() + 1);
  node.shape.push_back(static_cast<int64_t>(count));
  node.shape.insert(node.shape.end(), sizes.begin(), sizes.end());
  return true;
}

std::unique_ptr<Node> Walk::tensors(const std::vector<PyObject*>& items, const std::string& path,
                                    const FieldSpec* spec) {
  const PythonHelpers& h = helpers();
  const size_t count = items.size();
  auto node = std::make_unique<Node>();
  node->kind = Node::Kind::Tensor;
  node->path = path;
  if (stack_plain_tensors(items, spec, *node)) {
    lay_out(*node);
    return node;
  }
  node->inputs.items.clear();
  node->sources.clear();
  node->shape.clear();
  node->inputs.reserve(count);
  bool leave_to_default = false;
  const bool first_is_tensor = THPVariable_Check(items[0]);
  for (size_t i = 0; i < count; ++i) {
    PyObject* item = items[i];
    if (i + kPrefetchAhead < count && THPVariable_CheckExact(items[i + kPrefetchAhead])) {
      prefetch(THPVariable_Unpack(items[i + kPrefetchAhead]).unsafeGetTensorImpl(), sizeof(c10::TensorImpl));
    }
    if (THPVariable_Check(item)) {
      node->inputs.push_back(item);
      leave_to_default |= !THPVariable_CheckExact(item);  // subclasses keep their own semantics
      continue;
    }
    const bool array = is_instance(item, h.ndarray);
    if (spec == nullptr && first_is_tensor) {
      // default_collate stacks sample 0's tensors with torch.stack, which takes nothing but tensors.
      fail("type", i, path, "a tensor (like sample 0)", type_name(item),
           "every sample must give the same type for a field");
    }
    if (spec != nullptr && !array) {
      fail("type", i, path, "a tensor or numpy array", type_name(item));
    }
    if (array) {
      const char kind = py::str(py::handle(item).attr("dtype").attr("kind")).cast<std::string>()[0];
      if (kind == 'S' || kind == 'a' || kind == 'U' || kind == 'O') {
        fail("type", i, path, "a numeric numpy array", "a numpy array of dtype kind '" + std::string(1, kind) + "'",
             "numpy arrays of strings or objects cannot become tensors: convert them in the dataset");
      }
    }
    // A numpy array, or (after sample 0's numpy array) anything: default_collate converts each sample
    // with torch.as_tensor, and so do we. Its refusals (datetime or big-endian arrays, negative strides,
    // None) are named here.
    py::object tensor;
    try {
      tensor = h.as_tensor(py::handle(item));
    } catch (py::error_already_set& error) {
      fail(kind_of(error), i, path, array ? "a numpy array torch can convert" : "a value torch.as_tensor converts",
           describe(error), "convert the field to a tensor in the dataset");
    }
    node->inputs.push_back(THPVariable_Unpack(tensor.ptr()));
    plan_.keepalive.push_back(std::move(tensor));
  }
  // Leaves that are not dense CPU tensors are default_collate's (drop-in) or an error (contract). This
  // comes before any size is read: a nested tensor has none.
  auto is_dense = [](const at::Tensor& value) {
    return value.device().is_cpu() && value.layout() == at::kStrided && !value.is_quantized() && !value.is_nested();
  };
  const at::Tensor& first = node->inputs[0];
  if (spec == nullptr && (leave_to_default || !is_dense(first) || first.requires_grad())) {
    return left_to_default(items, path);
  }
  std::vector<int64_t> row_shape;
  at::ScalarType dtype = first.scalar_type();
  if (spec == nullptr) {
    // One pass per sample (batches of many small fields are bound by touching each tensor): dense,
    // same shape, same dtype, and whether its bytes can be copied as they are.
    const auto first_keys = first.key_set();
    const auto first_sizes = first.sizes();
    row_shape.assign(first_sizes.begin(), first_sizes.end());
    node->sources.resize(count);
    for (size_t i = 0; i < count; ++i) {
      const at::Tensor& value = node->inputs[i];
      if (i + kPrefetchAhead < count) {  // its data pointer, read below
        prefetch_storage(node->inputs[i + kPrefetchAhead]);
      }
      // The same dispatch keys as sample 0 mean the same device type, layout, conj and neg bits.
      if ((value.key_set() != first_keys && !is_dense(value)) || value.requires_grad()) {
        return left_to_default(items, path);
      }
      if (!same_sizes(value.sizes(), first_sizes)) {
        fail("size", i, path, "shape " + shape_string(first_sizes) + " (as sample 0)",
             "shape " + shape_string(value.sizes()),
             "Resize or crop it in the transform, or declare the conversion or padding in a Contract");
      }
      if (value.scalar_type() != dtype) {
        return left_to_default(items, path);  // type promotion: default_collate's rules
      }
      const bool as_is = value.is_contiguous() && !value.is_conj() && !value.is_neg();
      node->sources[i] = as_is ? first_element(value) : nullptr;
    }
  } else {
    const bool first_dense = is_dense(first);  // else the loop below fails on sample 0: no sizes to read
    dtype = spec->has_dtype ? spec->dtype : dtype;
    if (spec->has_shape) {
      row_shape = spec->shape;
    } else if (first_dense) {
      row_shape.assign(first.sizes().begin(), first.sizes().end());
    }
    node->padded = spec->padded;
    for (size_t i = 0; i < count; ++i) {
      const at::Tensor& value = node->inputs[i];
      if (!is_dense(value)) {
        fail("type", i, path, "a dense CPU tensor",
             "a tensor with layout/device " + std::string(c10::str(value.layout())) + "/" + value.device().str() +
                 (value.is_nested() ? " (nested)" : value.is_quantized() ? " (quantized)" : ""));
      }
      if (value.scalar_type() != dtype &&
          std::find(spec->cast_from.begin(), spec->cast_from.end(), value.scalar_type()) == spec->cast_from.end()) {
        fail("type", i, path, dtype_string(dtype), dtype_string(value.scalar_type()),
             "convert it in the transform, or declare cast_from=(" + dtype_string(value.scalar_type()) +
                 ",) on the field");
      }
      if (spec->has_shape) {
        bool ok = value.dim() == static_cast<int64_t>(spec->shape.size());
        for (int64_t d = 0; ok && d < value.dim(); ++d) {
          if (spec->dim_names[d].empty()) {
            ok = value.size(d) == spec->shape[d];
          }
        }
        bool expandable = false;
        for (const auto& accepted : spec->expand_from) {
          expandable |= !ok && value.sizes() == at::IntArrayRef(accepted);
        }
        if (!ok && !expandable) {
          std::ostringstream expected;
          expected << "shape [";
          for (size_t d = 0; d < spec->shape.size(); ++d) {
            expected << (d ? ", " : "") << (spec->dim_names[d].empty() ? std::to_string(spec->shape[d]) : spec->dim_names[d]);
          }
          expected << "]";
          fail("size", i, path, expected.str(), "shape " + shape_string(value.sizes()),
               "fix the transform, or declare the conversion on the field (e.g. expand_from=(" +
                   python_tuple(value.sizes()) + ",))");
        }
        if (ok) {
          for (int64_t d = 0; d < value.dim(); ++d) {
            if (!spec->dim_names[d].empty()) {
              check_named_dim(spec->dim_names[d], i, value.size(d), path, count);
            }
          }
        }
      } else if (value.sizes() != first.sizes()) {
        fail("size", i, path, "shape " + shape_string(first.sizes()) + " (as sample 0)",
             "shape " + shape_string(value.sizes()), "declare the field's shape with named variable dims and a pad");
      }
      check_range(value, *spec, i);
      check_cast(value, dtype, path, i);
    }
    // Named dims: padded to the longest, or equal across the batch.
    if (spec->has_shape) {
      for (size_t d = 0; d < spec->shape.size(); ++d) {
        if (spec->dim_names[d].empty()) {
          continue;
        }
        int64_t longest = 0;
        for (size_t i = 0; i < count; ++i) {
          const int64_t size = node->inputs[i].size(static_cast<int64_t>(d));
          if (!spec->padded && i > 0 && size != node->inputs[0].size(static_cast<int64_t>(d))) {
            fail("size", i, path,
                 "dim " + spec->dim_names[d] + " = " + std::to_string(node->inputs[0].size(static_cast<int64_t>(d))) +
                     " (as sample 0)",
                 "dim " + spec->dim_names[d] + " = " + std::to_string(size),
                 "declare pad=<value> on the field to pad it to the batch's longest");
          }
          longest = std::max(longest, size);
        }
        row_shape[d] = longest;
      }
    }
  }

  node->dtype = dtype;
  node->shape.push_back(static_cast<int64_t>(count));
  node->shape.insert(node->shape.end(), row_shape.begin(), row_shape.end());
  if (spec != nullptr) {
    node->sources.resize(count);
    for (size_t i = 0; i < count; ++i) {
      const at::Tensor& value = node->inputs[i];
      const bool as_is = value.scalar_type() == dtype && value.sizes() == at::IntArrayRef(row_shape) &&
                         value.is_contiguous() && !value.is_conj() && !value.is_neg();
      node->sources[i] = as_is ? first_element(value) : nullptr;
    }
  }
  if (node->padded) {
    try {
      // Not 1e10 as float16 (inf) or 300 as int8 (44): the pad must be a value of the dtype.
      if (dtype != at::kBool) {  // any value is a bool
        bool holds = false;
        AT_DISPATCH_V2(dtype, "pad_value", AT_WRAP([&] { holds = !c10::overflows<scalar_t, double>(spec->pad_value); }),
                       AT_EXPAND(AT_ALL_TYPES), at::kHalf, at::kBFloat16, AT_EXPAND(AT_BAREBONES_UNSIGNED_TYPES),
                       AT_EXPAND(AT_FLOAT8_TYPES), AT_EXPAND(AT_COMPLEX_TYPES));
        TORCH_CHECK(holds, "pad value out of range");
      }
      node->pad_pattern = element_pattern(spec->pad_value, dtype);
    } catch (const std::exception&) {  // c10::Error, or std::runtime_error from c10's checked conversion
      std::ostringstream pad;
      pad << "pad=" << spec->pad_value;
      fail("value", 0, path, "a pad value " + dtype_string(dtype) + " can hold", pad.str(),
           "declare a pad value the field's dtype can hold");
    }
    node->mask_name = spec->mask_name;
    node->lengths_name = spec->lengths_name;
    std::vector<int64_t>& var_dims = node->var_dims;
    for (size_t d = 0; d < spec->dim_names.size(); ++d) {
      if (!spec->dim_names[d].empty()) {
        var_dims.push_back(static_cast<int64_t>(d));
      }
    }
    node->mask = std::make_unique<Node>();
    node->mask->path = path;
    node->mask->kind = Node::Kind::Numbers;
    node->mask->dtype = at::kBool;
    node->mask->shape = {static_cast<int64_t>(count)};
    for (int64_t d : var_dims) {
      node->mask->shape.push_back(row_shape[d]);
    }
    node->lengths = std::make_unique<Node>();
    node->lengths->path = path;
    node->lengths->kind = Node::Kind::Numbers;
    node->lengths->dtype = at::kLong;
    node->lengths->shape = {static_cast<int64_t>(count)};
    if (var_dims.size() > 1) {
      node->lengths->shape.push_back(static_cast<int64_t>(var_dims.size()));
    }
    for (size_t i = 0; i < count; ++i) {
      for (int64_t d : var_dims) {
        node->lengths->ints.push_back(node->inputs[i].size(d));
      }
    }
    lay_out(*node->mask);
    lay_out(*node->lengths);
  }
  lay_out(*node);
  return node;
}

std::unique_ptr<Node> Walk::numbers(const std::vector<PyObject*>& items, const std::string& path,
                                    const FieldSpec* spec) {
  auto node = std::make_unique<Node>();
  node->kind = Node::Kind::Numbers;
  node->path = path;
  node->shape = {static_cast<int64_t>(items.size())};
  PyObject* elem = items[0];
  if (spec != nullptr && spec->has_dtype) {
    node->dtype = spec->dtype;
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
  const bool boolean = node->dtype == at::kBool;
  // A declared dtype narrower than int64/float64 must hold every value: 300 is no int8, 1e6 no float16.
  const bool narrow = spec != nullptr && node->dtype != at::kLong && node->dtype != at::kDouble && !boolean;
  for (size_t i = 0; i < items.size(); ++i) {
    PyObject* item = items[i];
    const bool is_bool = PyBool_Check(item);
    const bool is_int = PyLong_Check(item) && !is_bool;
    const bool is_float = PyFloat_Check(item);
    bool accepted = boolean ? is_bool : floating ? (is_float || is_int) : is_int;
    // Mixed numbers (int and float, bool and int, Python and numpy scalars, one-element tensors, ints
    // past int64 beside floats): torch.tensor's inference decides, as it does for default_collate.
    // Anything else is not a number. Returns null when item i is no number either.
    auto by_torch_tensor = [&](size_t i) -> std::unique_ptr<Node> {
      PyObject* item = items[i];
      const PythonHelpers& h = helpers();
      auto is_number = [&](PyObject* value) {
        return (PyLong_Check(value) || PyFloat_Check(value) || THPVariable_Check(value) ||
                is_instance(value, h.numpy_number) || is_instance(value, h.numpy_bool) ||
                is_instance(value, h.ndarray)) && !PyUnicode_Check(value) && !PyBytes_Check(value);
      };
      if (is_number(item)) {
        for (size_t j = i + 1; j < items.size(); ++j) {
          if (!is_number(items[j])) {
            fail("type", j, path, "a number (like sample 0)", type_name(items[j]),
                 "return a number for this field in every sample");
          }
        }
        node->kind = Node::Kind::Ready;
        py::list values(items.size());
        for (size_t j = 0; j < items.size(); ++j) {
          values[j] = py::reinterpret_borrow<py::object>(items[j]);
        }
        auto convert = [&](const py::list& these) {
          return floating ? h.tensor_from_list(these, py::arg("dtype") = h.float64) : h.tensor_from_list(these);
        };
        try {
          node->ready = convert(values);
        } catch (py::error_already_set& error) {
          // Overflow, most likely: find the sample torch.tensor refuses on its own.
          size_t bad = i;
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
          fail(kind_of(error), bad, path, "a number torch.tensor can hold (like sample 0)", describe(error));
        }
        return std::move(node);
      }
      return nullptr;
    };
    if (!accepted && spec == nullptr) {
      if (auto ready = by_torch_tensor(i)) {
        return ready;
      }
    }
    if (!accepted) {
      fail("type", i, path, spec ? "a Python " + std::string(boolean ? "bool" : floating ? "float or int" : "int") +
                                      " (declared " + dtype_string(node->dtype) + ")"
                                 : "a number (like sample 0)",
           type_name(item), "return a number for this field in every sample");
    }
    double as_double = 0;
    bool out_of_dtype = false;
    if (floating) {
      as_double = PyFloat_AsDouble(item);  // an int too large for a double fails here
      if (as_double == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        fail("value", i, path, "a number that fits in float64", "an integer too large for float64");
      }
      node->floats.push_back(as_double);
      if (narrow) {
        AT_DISPATCH_V2(node->dtype, "numbers", AT_WRAP([&] { out_of_dtype = c10::overflows<scalar_t, double>(as_double); }),
                       AT_EXPAND(AT_FLOATING_TYPES), at::kHalf, at::kBFloat16, AT_EXPAND(AT_FLOAT8_TYPES));
      }
    } else {
      int overflow = 0;
      const long long value = PyLong_AsLongLongAndOverflow(item, &overflow);
      if (overflow != 0 && spec == nullptr) {
        return by_torch_tensor(i);  // torch.tensor takes it beside a float, else names it
      }
      if (overflow != 0) {
        fail("size", i, path, "an integer that fits in int64", "an integer out of int64's range");
      }
      as_double = static_cast<double>(value);
      node->ints.push_back(value);
      if (narrow) {
        AT_DISPATCH_V2(node->dtype, "numbers", AT_WRAP([&] {
          out_of_dtype = c10::overflows<scalar_t, int64_t>(static_cast<int64_t>(value), /*strict_unsigned=*/true);
        }), AT_EXPAND(AT_INTEGRAL_TYPES), AT_EXPAND(AT_BAREBONES_UNSIGNED_TYPES));
      }
    }
    if (out_of_dtype) {
      fail("value", i, path, "a value " + dtype_string(node->dtype) + " can hold (the declared dtype)",
           "a value outside its range", "declare a wider dtype, or fix the value");
    }
    if (spec != nullptr && spec->has_range && !(as_double >= spec->low && as_double < spec->high)) {
      std::ostringstream expected;
      expected << "a value in [" << spec->low << ", " << spec->high << ")";
      fail("value", i, path, expected.str(), std::isnan(as_double) ? "NaN" : "a value outside that range",
           "fix the label, or widen the declared range");
    }
  }
  lay_out(*node);
  return node;
}

std::unique_ptr<Node> Walk::texts(const std::vector<PyObject*>& items, const std::string& path,
                                  const FieldSpec* spec) {
  auto node = std::make_unique<Node>();
  node->kind = Node::Kind::Ready;
  node->path = path;
  py::list values(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    if (spec != nullptr && !PyUnicode_Check(items[i]) && !PyBytes_Check(items[i])) {
      fail("type", i, path, "a str or bytes (declared text)", type_name(items[i]));
    }
    values[i] = py::reinterpret_borrow<py::object>(items[i]);
  }
  node->ready = std::move(values);
  node->text = true;
  return node;
}

std::unique_ptr<Node> Walk::mapping(const std::vector<PyObject*>& items, const std::string& path, bool is_dict) {
  const PythonHelpers& h = helpers();
  PyObject* elem = items[0];
  auto node = std::make_unique<Node>();
  node->kind = PyDict_CheckExact(elem) ? Node::Kind::Dict : Node::Kind::Mapping;
  node->path = path;
  node->elem = py::reinterpret_borrow<py::object>(elem);
  if (is_dict) {
    PyObject* key = nullptr;
    PyObject* value = nullptr;
    Py_ssize_t position = 0;
    while (PyDict_Next(elem, &position, &key, &value)) {
      node->keys.push_back(py::reinterpret_borrow<py::object>(key));
    }
  } else {
    for (py::handle key : py::reinterpret_borrow<py::object>(elem).attr("keys")()) {
      node->keys.push_back(py::reinterpret_borrow<py::object>(key));
    }
  }
  const Py_ssize_t key_count = static_cast<Py_ssize_t>(node->keys.size());
  for (size_t i = 1; i < items.size(); ++i) {
    PyObject* item = items[i];
    if (!PyDict_Check(item) && !is_instance(item, h.mapping_abc)) {
      fail("type", i, path.empty() ? "<sample>" : path, "a mapping (like sample 0)", type_name(item));
    }
    const Py_ssize_t size = PyObject_Length(item);
    if (size < 0) {
      throw py::error_already_set();
    }
    if (size != key_count) {
      // Find a key one side has and the other lacks, to name it. Under a contract the sample that
      // breaks the contract is named: sample 0 when it lacks a declared field or has an undeclared one.
      auto declared = [&](const std::string& key_path) {
        return collator_.field(key_path) != nullptr || collator_.is_container_path(key_path);
      };
      for (const auto& key : node->keys) {
        if (PySequence_Contains(py::handle(item).attr("keys")().ptr(), key.ptr()) != 1) {
          const std::string key_path = child_path(path, py::str(key));
          if (collator_.has_contract() && !declared(key_path)) {
            fail("key", 0, key_path, "no such field (the contract does not declare it)", "a value",
                 "declare the field in the contract, or remove it in the dataset's transform");
          }
          fail("key", i, key_path, "a value (sample 0 has this field)", "no such field",
               "every sample must have the same fields");
        }
      }
      for (py::handle key : py::handle(item).attr("keys")()) {
        if (PySequence_Contains(py::handle(elem).attr("keys")().ptr(), key.ptr()) != 1) {
          const std::string key_path = child_path(path, py::str(key));
          if (collator_.has_contract() && declared(key_path)) {
            fail("key", 0, key_path, "a value (the contract declares this field)", "no such field",
                 "return the field from the dataset, or remove it from the contract");
          }
          fail("key", i, key_path, "no such field (sample 0 lacks it)", "a value",
               "every sample must have the same fields; default_collate would have dropped this one silently");
        }
      }
    }
  }
  // Every value is held from here until the plan is done (BatchPlan::held): Python code the walk runs (a
  // key's __eq__, a mapping's __getitem__, a tensor subclass's __torch_function__, another thread meanwhile)
  // may remove values from their dicts, and execute() reads the tensors without the GIL.
  // Fast path: a dict whose keys come in sample 0's order (the usual case: one code path made every
  // sample) is read in one PyDict_Next pass with no hashing; whatever does not line up is looked up.
  const size_t count = items.size();
  std::vector<py::object> in_order(node->keys.size() * count);
  for (size_t i = 0; i < count; ++i) {
    if (!PyDict_Check(items[i])) {
      continue;
    }
    PyObject* key = nullptr;
    PyObject* value = nullptr;
    Py_ssize_t position = 0;
    for (size_t k = 0; k < node->keys.size() && PyDict_Next(items[i], &position, &key, &value); ++k) {
      if (key != node->keys[k].ptr()) {
        const int equal = PyObject_RichCompareBool(key, node->keys[k].ptr(), Py_EQ);
        if (equal < 0) {
          throw py::error_already_set();
        }
        if (equal == 0) {
          break;
        }
      }
      in_order[k * count + i] = py::reinterpret_borrow<py::object>(value);
    }
  }
  std::vector<PyObject*> values(count);
  for (size_t k = 0; k < node->keys.size(); ++k) {
    const py::object& key = node->keys[k];
    const std::string key_path = child_path(path, py::str(key));
    for (size_t i = 0; i < count; ++i) {
      PyObject* item = items[i];
      py::object& value = in_order[k * count + i];
      if (!value && PyDict_Check(item)) {
        PyObject* found = PyDict_GetItemWithError(item, key.ptr());
        if (found == nullptr && PyErr_Occurred()) {
          throw py::error_already_set();
        }
        value = py::reinterpret_borrow<py::object>(found);
      }
      if (!value && !PyDict_Check(item)) {
        value = py::reinterpret_steal<py::object>(PyObject_GetItem(item, key.ptr()));
        if (!value) {
          PyErr_Clear();
        }
      }
      if (!value) {
        fail("key", i, key_path, "a value (sample 0 has this field)", "no such field",
             "every sample must have the same fields");
      }
      values[i] = value.ptr();
    }
    node->children.push_back(this->node(values, key_path));
  }
  plan_.held.push_back(std::move(in_order));
  return node;
}

}  // namespace

namespace {

std::unique_ptr<Node> Walk::sequence(const std::vector<PyObject*>& items, const std::string& path) {
  PyObject* elem = items[0];
  auto node = std::make_unique<Node>();
  node->path = path;
  node->elem = py::reinterpret_borrow<py::object>(elem);
  const bool named_tuple = PyTuple_Check(elem) && PyObject_HasAttrString(reinterpret_cast<PyObject*>(Py_TYPE(elem)), "_fields");
  node->kind = named_tuple           ? Node::Kind::NamedTuple
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
    const bool is_sequence = PyList_Check(item) || PyTuple_Check(item) ||
                             (!PyUnicode_Check(item) && !PyBytes_Check(item) && is_instance(item, helpers().sequence_abc));
    if (!is_sequence) {
      fail("type", i, path.empty() ? "<sample>" : path, "a sequence (like sample 0)", type_name(item));
    }
    // A tuple: its length and items stay fixed while the walk runs Python code (a list could shrink).
    fast[i] = py::reinterpret_steal<py::object>(PySequence_Tuple(item));
    if (!fast[i]) {
      throw py::error_already_set();
    }
    if (PySequence_Fast_GET_SIZE(fast[i].ptr()) != length) {
      fail("size", i, path.empty() ? "<sample>" : path,
           std::to_string(length) + " elements (as sample 0)",
           std::to_string(PySequence_Fast_GET_SIZE(fast[i].ptr())) + " elements",
           "each element in list of batch should be of equal size");
    }
  }
  std::vector<PyObject*> values(items.size());
  for (Py_ssize_t k = 0; k < length; ++k) {
    for (size_t i = 0; i < items.size(); ++i) {
      values[i] = PySequence_Fast_GET_ITEM(fast[i].ptr(), k);
    }
    std::string name = named_tuple ? py::str(py::handle(elem).attr("_fields")[py::int_(k)]).cast<std::string>()
                                   : std::to_string(k);
    auto child = this->node(values, child_path(path, name));
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
    fail("size", 0, node.path.empty() ? "<sample>" : node.path, "a batch that fits in memory",
         "a batch of shape " + shape_string(node.shape) + " " + dtype_string(node.dtype) + " (over 2^63 bytes)",
         "check the sample's shape (an expand() can claim any size)");
  }
  node.offset = plan_.reserve(static_cast<size_t>(bytes));
}

}  // namespace

namespace {

at::Tensor view_into(const at::Storage& storage, size_t offset, at::ScalarType dtype, const std::vector<int64_t>& shape) {
  const size_t element_size = c10::elementSize(dtype);
  TORCH_INTERNAL_ASSERT(offset % element_size == 0, "misaligned field offset");
  // Built directly on the storage, as ATen builds its own views: two dispatcher calls per field
  // (empty + set_) cost more than the copy for batches of many small fields.
  at::Tensor view = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(storage), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                             c10::scalarTypeToTypeMeta(dtype));
  view.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
  view.unsafeGetTensorImpl()->set_storage_offset(static_cast<int64_t>(offset / element_size));
  return view;
}

void make_views(Node& node, const at::Storage& storage, size_t offset) {
  for (auto& child : node.children) {
    make_views(*child, storage, offset);
  }
  if (node.kind == Node::Kind::Tensor || node.kind == Node::Kind::Numbers) {
    node.out = view_into(storage, offset + node.offset, node.dtype, node.shape);
  }
  if (node.padded) {
    make_views(*node.mask, storage, offset);
    make_views(*node.lengths, storage, offset);
  }
}

void write_numbers(Node& node) {
  void* dst = node.out.data_ptr();
  if (node.dtype == at::kBool) {
    auto* out = static_cast<bool*>(dst);
    for (size_t i = 0; i < node.ints.size(); ++i) {
      out[i] = node.ints[i] != 0;
    }
    return;
  }
  // Values were converted to the declared dtype's family when read; cast to its width here.
  AT_DISPATCH_V2(node.dtype, "write_numbers", AT_WRAP([&] {
    auto* out = static_cast<scalar_t*>(dst);
    if (!node.floats.empty()) {
      for (size_t i = 0; i < node.floats.size(); ++i) {
        out[i] = static_cast<scalar_t>(node.floats[i]);
      }
    } else {
      for (size_t i = 0; i < node.ints.size(); ++i) {
        out[i] = static_cast<scalar_t>(node.ints[i]);
      }
    }
  }), AT_EXPAND(AT_ALL_TYPES), at::kHalf, at::kBFloat16, AT_EXPAND(AT_BAREBONES_UNSIGNED_TYPES),
      AT_EXPAND(AT_FLOAT8_TYPES));
}

// Copies into a padded field: fill with the pad value, then each sample into the top-left corner of its
// row. When only dim 0 of a contiguous sample varies its bytes are a prefix of the row: one memcpy.
void add_padded_jobs(Node& node, CopyJobs& jobs) {
  const size_t element_size = c10::elementSize(node.dtype);
  const size_t var_dims = node.mask->shape.size() - 1;
  const size_t count = node.inputs.size();
  if (count == 0) {
    return;
  }
  const size_t row_elements = static_cast<size_t>(node.out.numel()) / count;
  const size_t mask_row_elements = static_cast<size_t>(node.mask->out.numel()) / count;
  const auto row_tail_shape = node.out.sizes().slice(2);
  auto* out = static_cast<unsigned char*>(node.out.data_ptr());
  auto* mask = static_cast<unsigned char*>(node.mask->out.data_ptr());
  for (size_t i = 0; i < count; ++i) {
    const at::Tensor& value = node.inputs[i];
    unsigned char* row = out + i * row_elements * element_size;
    unsigned char* mask_row = mask + i * mask_row_elements;
    const bool prefix = node.var_dims == std::vector<int64_t>{0} && value.scalar_type() == node.dtype &&
                        value.is_contiguous() && !value.is_conj() && !value.is_neg() &&
                        value.sizes().slice(1) == row_tail_shape;
    if (prefix) {
      // Pointer arithmetic, not select(): two dispatcher calls per sample would cost more than its bytes.
      const size_t used = static_cast<size_t>(value.numel());
      const size_t length = static_cast<size_t>(value.size(0));
      jobs.add_memcpy(value.const_data_ptr(), row, used * element_size);
      jobs.fills.push_back({row + used * element_size, row_elements - used, element_size, node.pad_pattern});
      jobs.fills.push_back({mask_row, length, 1, 1});
      jobs.fills.push_back({mask_row + length, mask_row_elements - length, 1, 0});
      continue;
    }
    // Pad the whole row, then copy the sample into its corner (fills run before copies). Named dims are
    // narrowed to the sample's size; fixed dims stay whole (a declared expand broadcasts).
    jobs.fills.push_back({row, row_elements, element_size, node.pad_pattern});
    jobs.fills.push_back({mask_row, mask_row_elements, 1, 0});
    at::Tensor target = node.out.select(0, static_cast<int64_t>(i));
    at::Tensor mask_target = node.mask->out.select(0, static_cast<int64_t>(i));
    for (size_t k = 0; k < var_dims; ++k) {
      const int64_t d = node.var_dims[k];
      target = target.narrow(d, 0, value.size(d));
      mask_target = mask_target.narrow(static_cast<int64_t>(k), 0, value.size(d));
    }
    jobs.tensor_copies.push_back({value, target});
    jobs.tensor_copies.push_back({at::ones({}, at::TensorOptions().dtype(at::kBool)), mask_target});
  }
}

void add_tensor_jobs(Node& node, CopyJobs& jobs) {
  if (node.padded) {
    add_padded_jobs(node, jobs);
    return;
  }
  const size_t count = node.inputs.size();
  const size_t row_bytes = count == 0 ? 0 : static_cast<size_t>(node.out.nbytes()) / count;
  if (row_bytes == 0) {
    return;
  }
  // One job for the field's plain rows (no per-row bookkeeping: batches of many small fields are bound
  // by it); the rest go through ATen.
  jobs.add_rows(node.sources.data(), node.out.data_ptr(), row_bytes, count);
  for (size_t i = 0; i < count; ++i) {
    if (node.sources[i] == nullptr) {
      jobs.tensor_copies.push_back({node.inputs[i], node.out.select(0, static_cast<int64_t>(i))});
    }
  }
}

void collect_jobs(Node& node, CopyJobs& jobs) {
  for (auto& child : node.children) {
    collect_jobs(*child, jobs);
  }
  if (node.kind == Node::Kind::Tensor) {
    add_tensor_jobs(node, jobs);
  } else if (node.kind == Node::Kind::Numbers) {
    write_numbers(node);
  }
  if (node.padded) {
    write_numbers(*node.lengths);
  }
}

py::object build_output(Node& node) {
  const PythonHelpers& h = helpers();
  switch (node.kind) {
    case Node::Kind::Tensor:
    case Node::Kind::Numbers:
      return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(node.out)));
    case Node::Kind::Ready:
      return node.ready;
    case Node::Kind::Dict:
    case Node::Kind::Mapping: {
      py::dict values;
      for (size_t k = 0; k < node.keys.size(); ++k) {
        Node& child = *node.children[k];
        values[node.keys[k]] = build_output(child);
        if (child.padded) {
          values[py::str(child.mask_name)] = build_output(*child.mask);
          if (!child.lengths_name.empty()) {
            values[py::str(child.lengths_name)] = build_output(*child.lengths);
          }
        }
      }
      return node.kind == Node::Kind::Dict ? py::object(values) : h.rebuild_mapping(node.elem, values);
    }
    case Node::Kind::List:
    case Node::Kind::NamedTuple:
    case Node::Kind::Sequence: {
      py::list values(node.children.size());
      for (size_t k = 0; k < node.children.size(); ++k) {
        values[k] = build_output(*node.children[k]);
      }
      if (node.kind == Node::Kind::List) {
        return std::move(values);
      }
      if (node.kind == Node::Kind::NamedTuple) {
        return py::type::of(node.elem)(*values);
      }
      return h.rebuild_sequence(node.elem, values);
    }
  }
  throw std::logic_error("unreachable");
}

}  // namespace

size_t BatchPlan::reserve(size_t bytes) {
  const size_t offset = total_bytes_;
  total_bytes_ += align_up(bytes);
  return offset;
}

py::object BatchPlan::execute(const at::Tensor& buffer) {
  TORCH_CHECK(buffer.device().is_cpu() && buffer.scalar_type() == at::kByte && buffer.dim() == 1 &&
                  buffer.is_contiguous(),
              "BatchPlan.execute: buffer must be a 1-D contiguous uint8 CPU tensor");
  TORCH_CHECK(buffer.numel() >= nbytes(), "BatchPlan.execute: buffer holds ", buffer.numel(), " bytes, the batch needs ",
              nbytes());
  TORCH_CHECK(buffer.storage_offset() % static_cast<int64_t>(kFieldAlignment) == 0,
              "BatchPlan.execute: buffer must start at a multiple of ", kFieldAlignment, " bytes in its storage");
  return execute_into(buffer.storage(), static_cast<size_t>(buffer.storage_offset()));
}

py::object BatchPlan::execute_into(const at::Storage& storage, size_t offset) {
  TORCH_CHECK(!executed_, "BatchPlan.execute: a plan runs once");
  TORCH_INTERNAL_ASSERT(offset % kFieldAlignment == 0 && storage.nbytes() >= offset + total_bytes_);
  executed_ = true;
  make_views(*root, storage, offset);
  CopyJobs jobs;
  collect_jobs(*root, jobs);
  {
    py::gil_scoped_release no_gil;  // the copy touches no Python object; other threads run meanwhile
    jobs.run();
  }
  py::object out = build_output(*root);
  root.reset();
  keepalive.clear();
  held.clear();
  batch = py::none();
  return out;
}

Collator::Collator(std::string id_key, std::vector<FieldSpec> fields, bool has_contract)
    : id_key_(std::move(id_key)), fields_(std::move(fields)), has_contract_(has_contract) {
  for (size_t i = 0; i < fields_.size(); ++i) {
    const auto& field = fields_[i];
    TORCH_CHECK(by_path_.emplace(field.path, i).second, "Contract: field '", field.path, "' declared twice");
    TORCH_CHECK(field.dim_names.size() == field.shape.size(), "Contract: field '", field.path,
                "': dim_names and shape differ in length");
    // Every prefix of a declared path is a container ("" is the sample itself).
    if (!field.path.empty()) {
      container_paths_[""] = true;
    }
    for (size_t dot = field.path.find('.'); dot != std::string::npos; dot = field.path.find('.', dot + 1)) {
      container_paths_[field.path.substr(0, dot)] = true;
    }
  }
}

const FieldSpec* Collator::field(const std::string& path) const {
  auto found = by_path_.find(path);
  return found == by_path_.end() ? nullptr : &fields_[found->second];
}

bool Collator::is_container_path(const std::string& path) const {
  return container_paths_.count(path) != 0;
}

std::shared_ptr<BatchPlan> Collator::plan(py::handle samples) const {
  auto plan = std::make_shared<BatchPlan>();
  plan->batch = py::reinterpret_borrow<py::object>(samples);
  // A tuple of the samples: strong references, whatever Python code the walk runs meanwhile.
  py::object fast = py::reinterpret_steal<py::object>(PySequence_Tuple(samples.ptr()));
  if (!fast) {
    throw py::error_already_set();
  }
  const Py_ssize_t count = PySequence_Fast_GET_SIZE(fast.ptr());
  TORCH_CHECK(count > 0, "Collator.plan: an empty batch has no structure to follow");
  std::vector<PyObject*> items(static_cast<size_t>(count));
  for (Py_ssize_t i = 0; i < count; ++i) {
    items[static_cast<size_t>(i)] = PySequence_Fast_GET_ITEM(fast.ptr(), i);
  }
  plan->keepalive.push_back(fast);
  Walk walk(*this, fast, *plan);
  plan->root = walk.node(items, "");
  walk.check_all_fields_seen();
  if (plan->root->text && PyTuple_Check(samples.ptr())) {
    plan->root->ready = py::tuple(plan->root->ready);  // default_collate returns the batch it got
  }
  return plan;
}

std::pair<py::object, bool> Collator::assemble_into(py::handle samples, HostRing& ring) const {
  std::shared_ptr<BatchPlan> planned = plan(samples);
  bool overflowed = false;
  at::Storage slot;
  {
    py::gil_scoped_release no_gil;  // acquire may wait for a device copy to free a slot
    slot = ring.acquire_storage(planned->nbytes(), overflowed);
  }
  return {planned->execute_into(slot, 0), overflowed};
}

void bind_batch_plan(py::module_& m) {
  py::class_<FieldSpec>(m, "FieldSpec")
      .def(py::init<>())
      .def_readwrite("path", &FieldSpec::path)
      .def_readwrite("kind", &FieldSpec::kind)
      .def_readwrite("has_dtype", &FieldSpec::has_dtype)
      .def_readwrite("dtype", &FieldSpec::dtype)
      .def_readwrite("cast_from", &FieldSpec::cast_from)
      .def_readwrite("has_shape", &FieldSpec::has_shape)
      .def_readwrite("shape", &FieldSpec::shape)
      .def_readwrite("dim_names", &FieldSpec::dim_names)
      .def_readwrite("expand_from", &FieldSpec::expand_from)
      .def_readwrite("has_range", &FieldSpec::has_range)
      .def_readwrite("low", &FieldSpec::low)
      .def_readwrite("high", &FieldSpec::high)
      .def_readwrite("padded", &FieldSpec::padded)
      .def_readwrite("pad_value", &FieldSpec::pad_value)
      .def_readwrite("mask_name", &FieldSpec::mask_name)
      .def_readwrite("lengths_name", &FieldSpec::lengths_name);
  py::class_<BatchPlan, std::shared_ptr<BatchPlan>>(m, "BatchPlan")
      .def_property_readonly("nbytes", &BatchPlan::nbytes)
      .def("execute", &BatchPlan::execute, py::arg("buffer"));
  py::class_<Collator>(m, "Collator")
      .def(py::init<std::string, std::vector<FieldSpec>, bool>(), py::arg("id_key"), py::arg("fields"),
           py::arg("has_contract"))
      .def("plan", &Collator::plan, py::arg("samples"))
      .def("assemble_into", &Collator::assemble_into, py::arg("samples"), py::arg("ring"));
}

}  // namespace fastcollate

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

namespace {

// A padded field's declaration (padded_field) among the others of the contract the hint suggests.
std::string in_a_contract(const std::string& padded) {
  return "assemble.using(fastcollate.Contract({" + padded + ", ...}))";
}

// Where in a sample a value is: its position, not the value (sample contents may be sensitive).
std::string at_flat_position(int64_t flat) {
  return flat < 0 ? "" : " at flat position " + std::to_string(flat);
}

}  // namespace

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
  if (c10::elementSize(dtype) > sizeof(uint64_t) || dtype == at::kFloat4_e2m1fn_x2) {
    return false;  // a fill writes whole elements of at most 8 bytes (not two values a byte)
  }
  bool holds = false;
  AT_DISPATCH_V2(dtype, "value_fits", AT_WRAP([&] { holds = !c10::overflows<scalar_t, double>(value); }),
                 AT_EXPAND(AT_ALL_TYPES), at::kHalf, at::kBFloat16, AT_EXPAND(AT_BAREBONES_UNSIGNED_TYPES),
                 AT_EXPAND(AT_FLOAT8_TYPES), AT_EXPAND(AT_COMPLEX_TYPES), at::kComplexHalf);
  return holds && (!c10::isIntegralType(dtype, /*includeBool=*/false) || std::trunc(value) == value);
}

std::optional<at::ScalarType> python_number_dtype(PyObject* item) {
  if (PyBool_Check(item)) {  // before PyLong_Check: a bool is an int
    return at::kBool;
  }
  if (PyLong_Check(item)) {
    return at::kLong;
  }
  if (PyFloat_Check(item)) {
    return at::kDouble;
  }
  return std::nullopt;
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

Violation python_value_misfit(at::ScalarType dtype, int64_t flat) {
  return Violation{"value", "a value " + dtype_string(dtype) + " can hold (the declared dtype)",
                   "a value outside its range" + at_flat_position(flat), "declare a wider dtype, or fix the value"};
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
  if (!at::isComplexType(dtype) && !at::isQIntType(dtype)) {
    return std::nullopt;
  }
  return Violation{"type", "a real dtype (the field declares a range)", dtype_string(dtype),
                   std::string(at::isComplexType(dtype) ? "complex" : "quantized") +
                       " values have no order: drop the range or convert the field"};
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
  expected << (flat < 0 ? "a value in [" : "values in [") << range.low << ", " << range.high << ")";
  const std::string where = at_flat_position(flat);
  std::string got = std::isnan(value)   ? "NaN" + where
                    : value < range.low ? "a value below the range" + where
                                        : "a value at or above the upper bound" + where;
  return Violation{"value", expected.str(), got, "fix the label, or widen the declared range"};
}

std::optional<Violation> cast_rule(const at::Tensor& value, at::ScalarType dtype) {
  if (value.scalar_type() == dtype || value.numel() == 0 || !at::isFloatingType(value.scalar_type()) ||
      !at::isIntegralType(dtype, /*includeBool=*/false)) {
    return std::nullopt;
  }
  const at::Tensor as_double = value.to(at::kDouble);
  const bool finite = at::isfinite(as_double).all().item<bool>();
  bool fits = finite;
  if (finite) {
    const double low = as_double.min().item<double>();
    const double high = as_double.max().item<double>();
    AT_DISPATCH_V2(dtype, "cast_rule", AT_WRAP([&] {
                     fits = !c10::overflows<scalar_t, double>(low) && !c10::overflows<scalar_t, double>(high);
                   }),
                   AT_EXPAND(AT_INTEGRAL_TYPES), AT_EXPAND(AT_BAREBONES_UNSIGNED_TYPES));
  }
  if (fits) {
    return std::nullopt;
  }
  return Violation{
      "value",
      "values " + dtype_string(dtype) + " can hold (declared cast from " + dtype_string(value.scalar_type()) + ")",
      finite ? "a value outside that range" : "NaN or an infinity",
      "fix the value in the dataset, or declare a floating-point dtype"};
}

bool keeps_values(at::ScalarType source, at::ScalarType target) {
  if (source == target || source == at::kBool) {
    return true;  // 0 and 1 are values of every dtype
  }
  const auto floating = [](at::ScalarType dtype) { return at::isFloatingType(dtype) || at::isComplexType(dtype); };
  if (target == at::kBool || !(floating(target) || at::isIntegralType(target, /*includeBool=*/false))) {
    return false;
  }
  if (floating(source)) {
    if (!floating(target)) {
      return false;
    }
    try {
      return at::promoteTypes(source, target) == target;
    } catch (const c10::Error&) {
      return false;  // float8 types promote with none
    }
  }
  if (!at::isIntegralType(source, /*includeBool=*/false)) {
    return false;
  }
  const bool source_signed = c10::isSignedType(source);
  const size_t source_size = c10::elementSize(source);
  if (floating(target)) {
    // The integers a floating-point dtype holds exactly: those within its mantissa's bits.
    static constexpr std::pair<at::ScalarType, int> kMantissaBits[] = {
        {at::kHalf, 11},   {at::kBFloat16, 8},      {at::kFloat, 24},
        {at::kDouble, 53}, {at::kComplexFloat, 24}, {at::kComplexDouble, 53},
    };
    int mantissa = 0;
    for (const auto& [type, bits] : kMantissaBits) {
      mantissa = type == target ? bits : mantissa;
    }
    return static_cast<int>(source_size * 8) - (source_signed ? 1 : 0) <= mantissa;
  }
  const size_t target_size = c10::elementSize(target);
  if (c10::isSignedType(target)) {
    return source_signed ? target_size >= source_size : target_size > source_size;
  }
  return !source_signed && target_size >= source_size;
}

Violation undeclared_field() {
  return Violation{"key", "no such field (the contract does not declare it)", "a value",
                   "declare the field in the contract, or remove it in the dataset's transform"};
}

Violation missing_declared_field() {
  return Violation{"key", "a value (the contract declares this field)", "no such field",
                   "return the field from the dataset, or remove it from the contract"};
}

Violation missing_key_of_first() {
  return Violation{"key", "a value (sample 0 has this field)", "no such field",
                   "every sample must have the same fields"};
}

Violation extra_key_of_first() {
  return Violation{"key", "no such field (sample 0 lacks it)", "a value",
                   "every sample must have the same fields; default_collate would have dropped this one silently"};
}

Violation copied_key_in_sample(const std::string& copy_of) {
  return Violation{"key", "no such key in the samples (the contract makes the field a copy of " + copy_of + ")",
                   "a value", "drop the key from the samples, or declare the field without copy_of"};
}

Violation unsupported_value(const std::string& type) {
  return Violation{"type", "tensors, numpy arrays, numbers, strings, dicts or lists", type,
                   "convert the field to a tensor in the dataset, or drop it there explicitly"};
}

Violation not_a_mapping_like_first(const std::string& type) {
  return Violation{"type", "a mapping (like sample 0)", type, ""};
}

Violation not_a_sequence_like_first(const std::string& type) {
  return Violation{"type", "a sequence (like sample 0)", type, ""};
}

Violation sequence_length_misfit(int64_t first, int64_t got, const std::string& padded) {
  // default_collate's words first: what code written for its RuntimeError may look for.
  std::string hint = "each element in list of batch should be of equal size";
  if (!padded.empty()) {
    hint += "; to pad such lists to the batch's longest instead, declare the field padded in a contract: " +
            in_a_contract(padded);
  }
  return Violation{"size", std::to_string(first) + " elements (as sample 0)", std::to_string(got) + " elements",
                   hint};
}

Violation padded_in_sequence(const std::string& container) {
  // A sequence's batch is a sequence of the same length: no place for the mask and lengths beside it.
  return Violation{"type", "a padded field in a mapping (its mask and lengths go beside it, by key)",
                   "a padded field in a " + container,
                   "make the sample a dict (e.g. {\"tokens\": ..., \"label\": ...}), or declare no pad"};
}

Violation packed_in_sequence(const std::string& container) {
  return Violation{"type", "a packed field in a mapping (the keys beside it go there, by key)",
                   "a packed field in a " + container,
                   "make the sample a dict (e.g. {\"input_ids\": ..., \"id\": ...})"};
}

Violation batch_past_memory(at::IntArrayRef shape, at::ScalarType dtype) {
  return Violation{"size", "a batch that fits in memory",
                   "a batch of shape " + shape_string(shape) + " " + dtype_string(dtype) + " (over 2^63 bytes)",
                   "check the sample's shape (an expand() can claim any size)"};
}

Violation padded_dim_past_memory(const std::string& name, int64_t longest, int64_t multiple) {
  return Violation{"size", "a batch that fits in memory",
                   "dim " + name + " = " + std::to_string(longest) + " padded to a multiple of " +
                       std::to_string(multiple) + " (over 2^63)",
                   "check the sample's shape (an expand() can claim any size)"};
}

Violation not_text(const std::string& type) {
  return Violation{"type", "a str or bytes (declared text)", type, ""};
}

Violation not_a_tensor_like_first(const std::string& type) {
  // default_collate stacks sample 0's tensors with torch.stack, which takes nothing but tensors.
  return Violation{"type", "a tensor (like sample 0)", type, "every sample must give the same type for a field"};
}

Violation not_a_tensor_or_list(const std::string& type) {
  return Violation{"type", "a tensor, numpy array or list of numbers", type, ""};
}

Violation numpy_of_kind(char kind) {
  return Violation{"type", "a numeric numpy array", "a numpy array of dtype kind '" + std::string(1, kind) + "'",
                   "numpy arrays of strings or objects cannot become tensors: convert them in the dataset"};
}

Violation as_tensor_refusal(const std::string& kind, const std::string& message, bool array) {
  return Violation{kind, array ? "a numpy array torch can convert" : "a value torch.as_tensor converts", message,
                   "convert the field to a tensor in the dataset"};
}

Violation not_dense(const at::Tensor& value) {
  return Violation{"type", "a dense CPU tensor",
                   "a tensor with layout/device " + std::string(c10::str(value.layout())) + "/" + value.device().str() +
                       (value.is_nested()      ? " (nested)"
                        : value.is_quantized() ? " (quantized)"
                                               : ""),
                   ""};
}

Violation shape_unlike_first(at::IntArrayRef first, at::IntArrayRef got, bool has_contract,
                             const std::string& padded) {
  std::string hint;
  if (has_contract) {
    hint = "declare the field's shape with named variable dims and a pad" + (padded.empty() ? "" : ": " + padded);
  } else if (padded.empty()) {
    hint = "resize or crop it in the transform, or declare the conversion or padding in a Contract";
  } else {
    hint = "resize or crop it in the transform, or pad it to the batch's longest with a contract: " +
           in_a_contract(padded);
  }
  return Violation{"size", "shape " + shape_string(first) + " (as sample 0)", "shape " + shape_string(got), hint};
}

std::string padded_field(const std::string& path, at::ScalarType dtype, at::IntArrayRef first, at::IntArrayRef got) {
  if (path.empty() || first.size() != got.size()) {
    return "";
  }
  const auto differ = [&](size_t d) { return first[d] != got[d]; };
  size_t named = 0;
  for (size_t d = 0; d < first.size(); ++d) {
    named += differ(d) ? 1 : 0;
  }
  std::string shape = "(";
  size_t name = 0;
  for (size_t d = 0; d < first.size(); ++d) {
    shape += d > 0 ? ", " : "";
    shape += !differ(d) ? std::to_string(first[d]) : named == 1 ? "\"T\"" : "\"T" + std::to_string(name++) + "\"";
  }
  shape += first.size() == 1 ? ",)" : ")";
  return py::repr(py::str(path)).cast<std::string>() + ": fastcollate.Field(dtype=" + dtype_string(dtype) +
         ", shape=" + shape + ", pad=0)";
}

Violation named_dim_unlike_first(const std::string& name, int64_t first, int64_t size) {
  return Violation{"size", "dim " + name + " = " + std::to_string(first) + " (as sample 0)",
                   "dim " + name + " = " + std::to_string(size),
                   "declare pad=<value> on the field to pad it to the batch's longest"};
}

std::optional<Violation> number_dtype_rule(at::ScalarType dtype) {
  if (!at::isComplexType(dtype) && !at::isQIntType(dtype)) {
    return std::nullopt;
  }
  return Violation{"type", "a bool, integer or floating-point dtype for a number field",
                   "declared " + dtype_string(dtype), "declare the field as a tensor"};
}

Violation not_a_number(const std::string& type, std::optional<at::ScalarType> declared) {
  return Violation{"type", declared ? python_number_for(*declared) : "a number (like sample 0)", type,
                   "return a number for this field in every sample"};
}

Violation number_tensor_misfit(at::ScalarType dtype, at::IntArrayRef sizes) {
  return Violation{"size", "a number: " + python_number_for(dtype) + ", or a tensor of shape []",
                   "a tensor of shape " + shape_string(sizes),
                   "return one number per sample for a number field, or declare the field as a tensor"};
}

Violation number_past_float64() {
  return Violation{"value", "a number that fits in float64", "an integer too large for float64", ""};
}

Violation number_past_int64() {
  return Violation{"size", "an integer that fits in int64", "an integer out of int64's range", ""};
}

Violation number_refusal(const std::string& kind, const std::string& message) {
  return Violation{kind, "a number torch.tensor can hold (like sample 0)", message, ""};
}

Violation list_needs_declaration(const std::string& type) {
  return Violation{"type",
                   "a tensor or numpy array (a list needs the field's dtype and a shape of one dim or more declared)",
                   type, "declare them on the field, e.g. Field(dtype=torch.int64, shape=(\"T\",), ...)"};
}

Violation list_of_dtype(const std::string& type, at::ScalarType dtype) {
  return Violation{"type", "a tensor or numpy array (a list is read into bool, integer or floating-point dtypes)",
                   type + " for a field of " + dtype_string(dtype), "convert the field to a tensor in the dataset"};
}

Violation list_depth_misfit(size_t dims, const std::string& type, size_t depth, int64_t flat) {
  return Violation{"size", "lists nested " + std::to_string(dims) + " deep (the declared dims)",
                   type + " at dim " + std::to_string(depth) + ", flat position " + std::to_string(flat),
                   "give each sample as many levels of lists as the field declares dims"};
}

Violation list_not_rectangular(int64_t expected, int64_t got, size_t depth) {
  return Violation{"size",
                   "a rectangular nested list: " + std::to_string(expected) + " elements in every list at dim " +
                       std::to_string(depth) + " (as in the first)",
                   std::to_string(got) + " elements in one of them",
                   "make the sample's rows equally long in the dataset"};
}

Violation list_element_misfit(at::ScalarType dtype, const std::string& type, int64_t flat) {
  return Violation{"type", python_number_for(dtype), type + at_flat_position(flat),
                   "give every element as that Python type, or the sample as a tensor"};
}

Violation packed_past_int32(int64_t tokens) {
  return Violation{"size", "a packed batch of at most 2^31 - 1 tokens (cu_seq_lens are int32)",
                   std::to_string(tokens) + " tokens up to this sample",
                   "make the batch smaller: fastcollate.TokenBudgetBatches(lengths, max_tokens=...) fills batches "
                   "by tokens"};
}

Violation packed_past_budget(int64_t max_tokens, int64_t tokens) {
  return Violation{"size", "a batch of at most " + std::to_string(max_tokens) + " tokens (Packing.max_tokens)",
                   std::to_string(tokens) + " tokens up to this sample",
                   "batch with fastcollate.TokenBudgetBatches(lengths, max_tokens=" + std::to_string(max_tokens) +
                       "), or raise the budget"};
}

Violation packed_batch_empty() {
  // DataCollatorWithFlattening refuses it too (a ValueError): there is no row to attend over.
  return Violation{"value", "at least one token in the batch", "every sample of the batch empty",
                   "drop empty samples in the dataset, or batch them with others"};
}

}  // namespace fastcollate

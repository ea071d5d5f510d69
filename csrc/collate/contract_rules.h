// The contract's rules, stated once: the walk (per sample) and the column gather (per column of an
// Arrays batch) both ask these, so a broken rule reads the same on either path. A rule returns what is
// wrong as a Violation; the caller names the sample and raises it (raise_violation).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string>

#include "collate/field_spec.h"

namespace fastcollate {

// What a sample's field broke: the ContractError kind (a key of fastcollate.collate.errors.ERROR_KINDS) and the
// words of its message.
struct Violation {
  std::string kind;
  std::string expected;
  std::string got;
  std::string hint;
};

// Raises the ContractError for sample `batch[position]` (its id read under `id_key`; `batch` None when no
// sample carries one).
[[noreturn]] void raise_violation(const Violation& violation, py::handle batch, size_t position,
                                  const std::string& field, const std::string& id_key);

// The declared dtype, or one the field declares castable to it (cast_from).
std::optional<Violation> dtype_rule(const FieldSpec& spec, at::ScalarType declared, at::ScalarType got);

// The declared shape's fixed dims (or the whole shape one of expand_from). Named dims are not compared
// here: they agree between fields (named_dim_misfit) or are padded.
std::optional<Violation> declared_shape_rule(const FieldSpec& spec, at::IntArrayRef sizes);

// A named dim of `size` in field `path` where field `owner` of the same sample gave it `known`.
Violation named_dim_misfit(const std::string& name, int64_t known, const std::string& owner, int64_t size);

// Whether `value` is one of `dtype`'s: not 1e10 as float16 (inf), 300 as int8 (44) or 2.5 as int64 (2).
bool value_fits(double value, at::ScalarType dtype);

// Python numbers (number fields, and the elements of lists in tensor fields) are taken by the kind of the
// declared dtype: a bool only as bool, an int (not a bool) as an integer or floating-point dtype, a float
// only as a floating-point one. No silent bool-to-int or float-to-int conversion.
bool takes_python_number(PyObject* item, at::ScalarType dtype);
// The dtype default_collate gives Python numbers like `item` (bool, int64, float64); none for anything else.
std::optional<at::ScalarType> python_number_dtype(PyObject* item);
// What takes_python_number accepts for `dtype`, in words: "a Python int (declared torch.int8)".
std::string python_number_for(at::ScalarType dtype);
// Whether lists of Python numbers are read into `dtype`: bool, integer and floating-point dtypes of at
// most 8 bytes, not complex, quantized or packed sub-byte ones.
bool takes_python_numbers(at::ScalarType dtype);
// A Python number the declared dtype cannot hold (300 as int8, -1 as uint8, 1e6 as float16), at `flat`
// in the sample's list (-1 for a number field).
Violation python_value_misfit(at::ScalarType dtype, int64_t flat);

// The bytes of `value` as `dtype` for a fill, when it fits; `what` (pad, separator) names the declared value.
std::optional<Violation> fill_value_rule(double value, at::ScalarType dtype, const char* what, const char* hint);

// A range bounds real values: complex ones have none.
std::optional<Violation> range_dtype_rule(at::ScalarType dtype);

// The first of `numel` elements of `dtype` at `data` outside [low, high) (NaN included), compared as
// doubles; -1 when all lie inside. `value` gets the element.
int64_t first_out_of_range(const void* data, at::ScalarType dtype, int64_t numel, const ValueRange& range,
                           double& value);

// The range rule's words for the element at `flat` (the position within the sample, not its value:
// sample contents may be sensitive, and the bound is enough to act on); `flat` -1 for a Python number.
Violation range_misfit(const ValueRange& range, int64_t flat, double value);

// A declared cast from floating point to an integer dtype must not turn NaN, infinities or values past
// the dtype's range into arbitrary integers (C++ leaves those conversions undefined).
std::optional<Violation> cast_rule(const at::Tensor& value, at::ScalarType dtype);
// Whether every value of `source` is one of `target`'s: a range checked after the cast then holds for
// the source. Integers against a floating-point dtype compare their magnitude bits with its mantissa.
bool keeps_values(at::ScalarType source, at::ScalarType target);

// Keys and structure: a sample's fields against the contract's, or against sample 0's without one.
Violation undeclared_field();
Violation missing_declared_field();
Violation missing_key_of_first();
Violation extra_key_of_first();
Violation copied_key_in_sample(const std::string& copy_of);
Violation unsupported_value(const std::string& type);
Violation not_a_mapping_like_first(const std::string& type);
Violation not_a_sequence_like_first(const std::string& type);
// `padded`: the declaration that pads such samples (padded_field below), or "" where none can.
Violation sequence_length_misfit(int64_t first, int64_t got, const std::string& padded);
Violation padded_in_sequence(const std::string& container);
Violation packed_in_sequence(const std::string& container);
Violation batch_past_memory(at::IntArrayRef shape, at::ScalarType dtype);
Violation padded_dim_past_memory(const std::string& name, int64_t longest, int64_t multiple);

// Text fields.
Violation not_text(const std::string& type);

// Tensor fields: what a sample is, its layout, and its shape against sample 0's.
Violation not_a_tensor_like_first(const std::string& type);
Violation not_a_tensor_or_list(const std::string& type);
Violation numpy_of_kind(char kind);
// torch.as_tensor refused the sample (`kind` follows the error's class, `message` is its first line).
Violation as_tensor_refusal(const std::string& kind, const std::string& message, bool array);
Violation not_dense(const at::Tensor& value);
Violation shape_unlike_first(at::IntArrayRef first, at::IntArrayRef got, bool has_contract,
                             const std::string& padded);
// The declaration that pads the field at `path` whose samples differ in size (`first` against `got`), as
// hints write it: 'x': fastcollate.Field(dtype=..., shape=(...), pad=0), the dims that differ named ("T";
// "T0", "T1", ... when several), the others fixed. "" where padding cannot take them: the sample itself
// (a padded field goes in a dict, its mask and lengths beside it) or sizes of another rank.
std::string padded_field(const std::string& path, at::ScalarType dtype, at::IntArrayRef first, at::IntArrayRef got);
Violation named_dim_unlike_first(const std::string& name, int64_t first, int64_t size);

// Number fields: Python numbers of the declared dtype's kind, or 0-d tensors (an Arrays column's element).
std::optional<Violation> number_dtype_rule(at::ScalarType dtype);
Violation not_a_number(const std::string& type, std::optional<at::ScalarType> declared);
Violation number_tensor_misfit(at::ScalarType dtype, at::IntArrayRef sizes);
Violation number_past_float64();
Violation number_past_int64();
// torch.tensor refused a number (overflow, most likely).
Violation number_refusal(const std::string& kind, const std::string& message);

// Lists of numbers in tensor fields.
Violation list_needs_declaration(const std::string& type);
Violation list_of_dtype(const std::string& type, at::ScalarType dtype);
Violation list_depth_misfit(size_t dims, const std::string& type, size_t depth, int64_t flat);
Violation list_not_rectangular(int64_t expected, int64_t got, size_t depth);
Violation list_element_misfit(at::ScalarType dtype, const std::string& type, int64_t flat);

// Packed fields.
Violation packed_past_int32(int64_t tokens);
Violation packed_past_budget(int64_t max_tokens, int64_t tokens);
Violation packed_batch_empty();

}  // namespace fastcollate

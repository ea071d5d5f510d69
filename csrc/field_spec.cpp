#include "field_spec.h"

#include <algorithm>
#include <utility>

namespace fastcollate {

namespace py = pybind11;

namespace {

// The names fastcollate.contract.Field.kind takes.
constexpr std::pair<FieldKind, const char*> kKindNames[] = {
    {FieldKind::Tensor, "tensor"},
    {FieldKind::Number, "number"},
    {FieldKind::Text, "text"},
};

const char* kind_name(FieldKind kind) {
  for (const auto& [each, name] : kKindNames) {
    if (each == kind) {
      return name;
    }
  }
  return "tensor";
}

FieldKind kind_from_name(const std::string& name) {
  for (const auto& [kind, each] : kKindNames) {
    if (name == each) {
      return kind;
    }
  }
  TORCH_CHECK(false, "FieldSpec.kind must be 'tensor', 'number' or 'text', got '", name, "'");
}

// has_<value> = True declares the value with `placeholder` until it is set; False drops it.
template <typename T>
void declare(std::optional<T>& value, bool declared, T placeholder) {
  if (!declared) {
    value.reset();
  } else if (!value) {
    value = placeholder;
  }
}

}  // namespace

bool FieldSpec::has_named_dims() const {
  return std::any_of(dim_names.begin(), dim_names.end(), [](const std::string& name) { return !name.empty(); });
}

void bind_field_spec(py::module_& m) {
  py::class_<FieldSpec>(m, "FieldSpec")
      .def(py::init<>())
      .def_readwrite("path", &FieldSpec::path)
      .def_property(
          "kind", [](const FieldSpec& spec) { return kind_name(spec.kind); },
          [](FieldSpec& spec, const std::string& name) { spec.kind = kind_from_name(name); })
      .def_property(
          "has_dtype", [](const FieldSpec& spec) { return spec.dtype.has_value(); },
          [](FieldSpec& spec, bool declared) { declare(spec.dtype, declared, at::kFloat); })
      .def_property(
          "dtype", [](const FieldSpec& spec) { return spec.dtype.value_or(at::kFloat); },
          [](FieldSpec& spec, at::ScalarType dtype) { spec.dtype = dtype; })
      .def_readwrite("cast_from", &FieldSpec::cast_from)
      .def_property(
          "has_shape", [](const FieldSpec& spec) { return spec.shape.has_value(); },
          [](FieldSpec& spec, bool declared) { declare(spec.shape, declared, std::vector<int64_t>{}); })
      .def_property(
          "shape", [](const FieldSpec& spec) { return spec.shape.value_or(std::vector<int64_t>{}); },
          [](FieldSpec& spec, std::vector<int64_t> shape) { spec.shape = std::move(shape); })
      .def_readwrite("dim_names", &FieldSpec::dim_names)
      .def_readwrite("expand_from", &FieldSpec::expand_from)
      .def_property(
          "has_range", [](const FieldSpec& spec) { return spec.range.has_value(); },
          [](FieldSpec& spec, bool declared) { declare(spec.range, declared, ValueRange{}); })
      .def_property(
          "low", [](const FieldSpec& spec) { return spec.range.value_or(ValueRange{}).low; },
          [](FieldSpec& spec, double low) { spec.range = ValueRange{low, spec.range.value_or(ValueRange{}).high}; })
      .def_property(
          "high", [](const FieldSpec& spec) { return spec.range.value_or(ValueRange{}).high; },
          [](FieldSpec& spec, double high) { spec.range = ValueRange{spec.range.value_or(ValueRange{}).low, high}; })
      .def_property(
          "padded", [](const FieldSpec& spec) { return spec.padded(); },
          [](FieldSpec& spec, bool padded) { declare(spec.pad_value, padded, 0.0); })
      .def_property(
          "pad_value", [](const FieldSpec& spec) { return spec.pad_value.value_or(0.0); },
          [](FieldSpec& spec, double value) { spec.pad_value = value; })
      .def_readwrite("mask_name", &FieldSpec::mask_name)
      .def_readwrite("mask_dtype", &FieldSpec::mask_dtype)
      .def_readwrite("lengths_name", &FieldSpec::lengths_name)
      .def_readwrite("packed", &FieldSpec::packed)
      .def_property(
          "has_separator", [](const FieldSpec& spec) { return spec.separator.has_value(); },
          [](FieldSpec& spec, bool declared) { declare(spec.separator, declared, 0.0); })
      .def_property(
          "separator", [](const FieldSpec& spec) { return spec.separator.value_or(0.0); },
          [](FieldSpec& spec, double value) { spec.separator = value; })
      .def_readwrite("position_ids_name", &FieldSpec::position_ids_name)
      .def_readwrite("position_ids_start", &FieldSpec::position_ids_start)
      .def_readwrite("cu_seq_lens_names", &FieldSpec::cu_seq_lens_names)
      .def_readwrite("max_length_names", &FieldSpec::max_length_names)
      .def_readwrite("seq_idx_name", &FieldSpec::seq_idx_name)
      .def_readwrite("max_tokens", &FieldSpec::max_tokens);
}

}  // namespace fastcollate

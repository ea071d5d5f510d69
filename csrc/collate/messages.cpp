#include "collate/messages.h"

#include <cctype>
#include <sstream>
#include <utility>

namespace fastcollate {

namespace {

std::string joined(at::IntArrayRef sizes, const char* open, const char* close) {
  std::ostringstream out;
  out << open;
  for (size_t i = 0; i < sizes.size(); ++i) {
    out << (i ? ", " : "") << sizes[i];
  }
  out << close;
  return out.str();
}

}  // namespace

std::string shape_string(at::IntArrayRef sizes) {
  return joined(sizes, "[", "]");
}

std::string python_tuple(at::IntArrayRef sizes) {
  return joined(sizes, "(", sizes.size() == 1 ? ",)" : ")");
}

std::string dtype_string(at::ScalarType dtype) {
  // Where c10's name is not Python's (Byte, Char, Half, ComplexFloat, ...).
  static constexpr std::pair<at::ScalarType, const char*> kPythonNames[] = {
      {at::kByte, "torch.uint8"},
      {at::kChar, "torch.int8"},
      {at::kShort, "torch.int16"},
      {at::kInt, "torch.int32"},
      {at::kLong, "torch.int64"},
      {at::kHalf, "torch.float16"},
      {at::kFloat, "torch.float32"},
      {at::kDouble, "torch.float64"},
      {at::kComplexHalf, "torch.complex32"},
      {at::kComplexFloat, "torch.complex64"},
      {at::kComplexDouble, "torch.complex128"},
  };
  for (const auto& [type, name] : kPythonNames) {
    if (type == dtype) {
      return name;
    }
  }
  std::string text = std::string("torch.") + c10::toString(dtype);
  for (auto& c : text) {
    c = static_cast<char>(std::tolower(c));
  }
  return text;
}

std::string first_line(const pybind11::error_already_set& error) {
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

}  // namespace fastcollate

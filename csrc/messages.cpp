#include "messages.h"

#include <cctype>
#include <sstream>

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
  switch (dtype) {
    case at::kByte:
      return "torch.uint8";
    case at::kChar:
      return "torch.int8";
    case at::kShort:
      return "torch.int16";
    case at::kInt:
      return "torch.int32";
    case at::kLong:
      return "torch.int64";
    case at::kHalf:
      return "torch.float16";
    case at::kFloat:
      return "torch.float32";
    case at::kDouble:
      return "torch.float64";
    case at::kComplexHalf:
      return "torch.complex32";
    case at::kComplexFloat:
      return "torch.complex64";
    case at::kComplexDouble:
      return "torch.complex128";
    default:
      break;
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

#pragma once
/// \file
/// Bodies of ir/type.hpp (core/config.hpp): compiled once in src/compiled_bodies.cpp, or
/// inline in every translation unit of a header-only build.
#include <stagejit/core/config.hpp>
#include <stagejit/ir/type.hpp>
#include <stagejit/core/error.hpp>

#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace stagejit::ir {

STAGEJIT_FUNC std::vector<bool> noncontiguous_marks(at::IntArrayRef sizes, at::IntArrayRef strides) {
  STAGEJIT_CHECK_AS(IrError, sizes.size() == strides.size(), "tensor type has ", sizes.size(),
                    " sizes but ", strides.size(), " strides");
  std::vector<bool> marks(sizes.size(), false);
  for (size_t d = 0; d < sizes.size(); ++d) {
    int64_t expected = d + 1 == sizes.size() ? 1 : sizes[d + 1] * strides[d + 1];
    marks[d] = strides[d] != expected;
  }
  return marks;
}

STAGEJIT_FUNC bool TensorType::is_contiguous() const {
  for (bool m : noncontiguous_marks(sizes, strides))
    if (m) return false;
  return true;
}

STAGEJIT_FUNC DimList parse_strides(at::IntArrayRef sizes, const std::vector<bool>& marks) {
  DimList strides(sizes.size());
  for (size_t d = sizes.size(); d-- > 0;) {
    int64_t expected = d + 1 == sizes.size() ? 1 : sizes[d + 1] * strides[d + 1];
    strides[d] = marks[d] ? (expected == 0 ? 1 : 2 * expected) : expected;
  }
  return strides;
}

STAGEJIT_FUNC const std::vector<at::ScalarType>& printable_dtypes() {
  static const std::vector<at::ScalarType> all = {
      at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kLong, at::kInt,
      at::kShort, at::kChar,   at::kByte, at::kBool,     at::kComplexFloat,
      at::kComplexDouble};
  return all;
}

STAGEJIT_FUNC std::optional<at::ScalarType> dtype_from_name(std::string_view name) {
  for (auto t : printable_dtypes())
    if (name == c10::toString(t)) return t;
  return std::nullopt;
}

STAGEJIT_FUNC std::string to_string(const Type& type) {
  if (std::holds_alternative<HandleType>(type)) return "Handle";
  if (std::holds_alternative<UnknownType>(type)) return "UNKNOWN_TYPE";
  const auto& t = std::get<TensorType>(type);
  std::string out = c10::toString(t.dtype);
  out += '(';
  auto marks = noncontiguous_marks(t.sizes, t.strides);
  for (size_t d = 0; d < t.sizes.size(); ++d) {
    if (d) out += ", ";
    out += std::to_string(t.sizes[d]);
    if (marks[d]) out += '!';
  }
  if (t.device != at::Device(at::kCPU)) {
    if (!t.sizes.empty()) out += ", ";
    out += "device=" + t.device.str();
  }
  out += ')';
  return out;
}

}  // namespace stagejit::ir

#pragma once
/// \file
/// Bodies of ir/detail/literals.hpp (core/config.hpp): compiled once in
/// src/compiled_bodies.cpp, or inline in every translation unit of a header-only build.
#include <stagejit/core/config.hpp>
#include <stagejit/ir/detail/literals.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/ir/type.hpp>

#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>

namespace stagejit::ir::detail {

STAGEJIT_FUNC std::string quote(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default: out += c;
    }
  }
  return out + '"';
}

STAGEJIT_FUNC std::string format_tensor(const at::Tensor& t) {
  if (!t.defined()) return "<undefined>";
  if (!literal_dtype(t.scalar_type())) return "<Tensor>";
  auto type = TensorType::contiguous(t.scalar_type(), t.sizes().vec(), t.device());
  std::string out = to_string(Type{type});
  at::Tensor c = t.detach().to(at::kCPU).contiguous();
  out += '{';
  int64_t n = c.numel();
  for (int64_t i = 0; i < n; ++i) {
    if (i) out += ", ";
    switch (c.scalar_type()) {
      case at::kDouble: out += format_floating(c.data_ptr<double>()[i]); break;
      case at::kFloat: out += format_floating(c.data_ptr<float>()[i]); break;
      case at::kHalf: out += format_floating(static_cast<float>(c.data_ptr<at::Half>()[i])); break;
      case at::kBFloat16:
        out += format_floating(static_cast<float>(c.data_ptr<at::BFloat16>()[i]));
        break;
      case at::kLong: out += std::to_string(c.data_ptr<int64_t>()[i]); break;
      case at::kInt: out += std::to_string(c.data_ptr<int32_t>()[i]); break;
      case at::kShort: out += std::to_string(c.data_ptr<int16_t>()[i]); break;
      case at::kChar: out += std::to_string(c.data_ptr<int8_t>()[i]); break;
      case at::kByte: out += std::to_string(c.data_ptr<uint8_t>()[i]); break;
      case at::kBool: out += c.data_ptr<bool>()[i] ? "true" : "false"; break;
      default: STAGEJIT_ASSERT(false, "unreachable dtype");
    }
  }
  return out + '}';
}

STAGEJIT_FUNC bool set_element(at::Tensor& t, int64_t i, std::string_view text) {
  auto floating = [&](auto& out) {
    if (text == "inf" || text == "+inf") out = INFINITY;
    else if (text == "-inf") out = -INFINITY;
    else if (text == "nan") out = NAN;
    else return parse_number(text, out);
    return true;
  };
  auto integral = [&](auto* data) {
    int64_t v;
    if (!parse_number(text, v)) return false;
    using T = std::remove_pointer_t<decltype(data)>;
    if (v < int64_t(std::numeric_limits<T>::min()) || v > int64_t(std::numeric_limits<T>::max()))
      return false;
    data[i] = static_cast<T>(v);
    return true;
  };
  switch (t.scalar_type()) {
    case at::kDouble: return floating(t.data_ptr<double>()[i]);
    case at::kFloat: return floating(t.data_ptr<float>()[i]);
    case at::kHalf: {
      float f;
      if (!floating(f)) return false;
      t.data_ptr<at::Half>()[i] = at::Half(f);
      return true;
    }
    case at::kBFloat16: {
      float f;
      if (!floating(f)) return false;
      t.data_ptr<at::BFloat16>()[i] = at::BFloat16(f);
      return true;
    }
    case at::kLong: return integral(t.data_ptr<int64_t>());
    case at::kInt: return integral(t.data_ptr<int32_t>());
    case at::kShort: return integral(t.data_ptr<int16_t>());
    case at::kChar: return integral(t.data_ptr<int8_t>());
    case at::kByte: return integral(t.data_ptr<uint8_t>());
    case at::kBool:
      if (text == "true" || text == "1") t.data_ptr<bool>()[i] = true;
      else if (text == "false" || text == "0") t.data_ptr<bool>()[i] = false;
      else return false;
      return true;
    default: return false;
  }
}

}  // namespace stagejit::ir::detail

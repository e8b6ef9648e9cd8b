#pragma once
/// \file
/// Text of scalar literals shared by the IR printer and parser: doubles that parse back
/// exactly, quoted strings, and inline tensor literals.
///
/// Tensor literal format (Constant values, `t` attributes):
///   `Dtype(size0, size1, ...){v0, v1, ...}` with the values in row-major order, e.g.
///   `Float(2, 2){1.0, -2.5, 3.0, 4.0}`, `Long(){7}`, `Bool(2){true, false}`.
///   Floating values use the shortest text that parses back to the same value in that
///   dtype (`inf`, `-inf`, `nan` allowed); a non-CPU tensor adds `device=...` after its
///   sizes, as in types. Complex and undefined tensors print as `<Tensor>` and
///   `<undefined>` and cannot be parsed back.

#include <stagejit/core/detail/bodies_begin.hpp>
#include <ATen/ATen.h>

#include <charconv>
#include <cmath>
#include <string>
#include <string_view>
#include <system_error>

#include <stagejit/core/error.hpp>
#include <stagejit/ir/type.hpp>

namespace stagejit::ir::detail {

template <class F>
std::string format_floating(F value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value < 0 ? "-inf" : "inf";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, value);
  std::string out(buf, res.ptr);
  if (out.find_first_of(".e") == std::string::npos) out += ".0";
  return out;
}

/// Shortest decimal text of `value` that parses back to the same double; always has a
/// `.` or exponent so it reads as a double, not an integer (`1.0`, `0.1`, `1e+300`).
inline std::string format_double(double value) { return format_floating(value); }

/// `"text"` with `\"`, `\\`, `\n`, `\t` escaped.
inline std::string quote(std::string_view s) {
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

/// True for the dtypes a tensor literal can hold.
inline bool literal_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: case at::kDouble: case at::kHalf: case at::kBFloat16:
    case at::kLong: case at::kInt: case at::kShort: case at::kChar: case at::kByte:
    case at::kBool:
      return true;
    default:
      return false;
  }
}

/// The tensor literal of `t` (see the file comment).
inline std::string format_tensor(const at::Tensor& t) {
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

template <class T>
bool parse_number(std::string_view text, T& out) {
  const char* b = text.data();
  const char* e = b + text.size();
  if (b != e && *b == '+') ++b;
  auto res = std::from_chars(b, e, out);
  return res.ec == std::errc() && res.ptr == e;
}

/// Writes element `i` of the contiguous CPU tensor `t` from its literal text; false
/// when the text is not a value of that dtype.
inline bool set_element(at::Tensor& t, int64_t i, std::string_view text) {
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

#ifdef STAGEJIT_HEADER_TEST_CASES
#include <stagejit/testing/doctest.hpp>
TEST_SUITE("ir") {
  TEST_CASE("format_double is exact and always reads as a double") {
    using stagejit::ir::detail::format_double;
    CHECK(format_double(1.0) == "1.0");
    CHECK(format_double(0.1) == "0.1");
    CHECK(format_double(-2.5) == "-2.5");
    CHECK(format_double(1e300) == "1e+300");
    CHECK(format_double(-INFINITY) == "-inf");
    for (double v : {0.1, 1.0 / 3.0, 2.0 / 7.0 * 1e-200, 6.02214076e23}) {
      double back = 0;
      REQUIRE(stagejit::ir::detail::parse_number(format_double(v), back));
      CHECK(back == v);
    }
  }
  TEST_CASE("tensor literals print row-major values of the tensor's dtype") {
    using stagejit::ir::detail::format_tensor;
    CHECK(format_tensor(at::arange(4, at::kFloat).reshape({2, 2}).t()) ==
          "Float(2, 2){0.0, 2.0, 1.0, 3.0}");
    CHECK(format_tensor(at::scalar_tensor(7, at::kLong)) == "Long(){7}");
    CHECK(format_tensor(at::tensor({0.1f})) == "Float(1){0.1}");
  }
}
#endif
#include <stagejit/core/detail/bodies_end.hpp>

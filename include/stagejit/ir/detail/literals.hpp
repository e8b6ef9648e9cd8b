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
///
/// The longer functions' bodies are in ir/detail/literals-inl.hpp (core/config.hpp).

#include <ATen/ATen.h>

#include <charconv>
#include <cmath>
#include <string>
#include <string_view>
#include <system_error>

#include <stagejit/core/config.hpp>
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
STAGEJIT_FUNC std::string quote(std::string_view s);

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
STAGEJIT_FUNC std::string format_tensor(const at::Tensor& t);

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
STAGEJIT_FUNC bool set_element(at::Tensor& t, int64_t i, std::string_view text);

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

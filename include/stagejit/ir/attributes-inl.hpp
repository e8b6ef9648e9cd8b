#pragma once
/// \file
/// Bodies of ir/attributes.hpp (core/config.hpp): compiled once in src/compiled_bodies.cpp,
/// or inline in every translation unit of a header-only build.
#include <stagejit/core/config.hpp>
#include <stagejit/ir/attributes.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/core/scalar.hpp>
#include <stagejit/ir/detail/literals.hpp>

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

namespace stagejit::ir {

STAGEJIT_FUNC AttributeValue to_attribute(const Scalar& s) {
  return std::visit(
      [](const auto& v) -> AttributeValue {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, bool>) return int64_t(v ? 1 : 0);
        else if constexpr (std::is_same_v<T, NoneScalar>) throw IrError("a None scalar has no attribute form (attributes are ints, floats, strings, tensors and lists of them)");
        else return v;
      },
      s);
}

STAGEJIT_FUNC AttributeList to_attribute_list(const Attributes& attrs) {
  AttributeList out;
  out.reserve(attrs.size());
  for (const auto& [name, value] : attrs) out.emplace_back(name, to_attribute(value));
  return out;
}

STAGEJIT_FUNC bool tensor_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.defined() != b.defined()) return false;
  if (!a.defined()) return true;
  return a.scalar_type() == b.scalar_type() && a.device() == b.device() &&
         a.sizes() == b.sizes() && at::equal(a, b);
}

STAGEJIT_FUNC bool attribute_equal(const AttributeValue& a, const AttributeValue& b) {
  if (a.index() != b.index()) return false;
  return std::visit(
      [&](const auto& x) -> bool {
        using T = std::decay_t<decltype(x)>;
        const auto& y = std::get<T>(b);
        if constexpr (std::is_same_v<T, at::Tensor>) {
          return tensor_equal(x, y);
        } else if constexpr (std::is_same_v<T, std::vector<at::Tensor>>) {
          if (x.size() != y.size()) return false;
          for (size_t i = 0; i < x.size(); ++i)
            if (!tensor_equal(x[i], y[i])) return false;
          return true;
        } else {
          return x == y;
        }
      },
      a);
}

STAGEJIT_FUNC std::string format_attribute(const AttributeValue& v) {
  auto list = [&](const auto& xs, auto&& fmt) {
    if (xs.empty()) return std::string(attribute_kind(v)) + "[]";
    std::string out = "[";
    for (size_t i = 0; i < xs.size(); ++i) out += (i ? ", " : "") + fmt(xs[i]);
    return out + "]";
  };
  return std::visit(
      [&](const auto& x) -> std::string {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, double>) return detail::format_double(x);
        else if constexpr (std::is_same_v<T, int64_t>) return std::to_string(x);
        else if constexpr (std::is_same_v<T, std::string>) return detail::quote(x);
        else if constexpr (std::is_same_v<T, at::Tensor>) return detail::format_tensor(x);
        else if constexpr (std::is_same_v<T, std::shared_ptr<Graph>>) return "<Graph>";
        else if constexpr (std::is_same_v<T, std::vector<double>>)
          return list(x, [](double d) { return detail::format_double(d); });
        else if constexpr (std::is_same_v<T, std::vector<int64_t>>)
          return list(x, [](int64_t i) { return std::to_string(i); });
        else if constexpr (std::is_same_v<T, std::vector<std::string>>)
          return list(x, [](const std::string& s) { return detail::quote(s); });
        else if constexpr (std::is_same_v<T, std::vector<at::Tensor>>)
          return list(x, [](const at::Tensor& t) { return detail::format_tensor(t); });
        else
          return x.empty() ? std::string("gs[]") : std::string("[<Graphs>]");
      },
      v);
}

STAGEJIT_FUNC std::string format_scalar(const Scalar& s) {
  if (auto b = std::get_if<bool>(&s)) return *b ? "true" : "false";
  if (std::holds_alternative<NoneScalar>(s)) return "None";
  return format_attribute(to_attribute(s));
}

}  // namespace stagejit::ir

namespace stagejit::detail {

STAGEJIT_FUNC Attributes to_core_attributes(const ir::AttributeList& attrs) {
  Attributes out;
  out.reserve(attrs.size());
  for (const auto& [name, value] : attrs) {
    std::visit(
        [&, &name = name, &value = value](const auto& v) {  // clang < 16 cannot capture bindings
          using T = std::decay_t<decltype(v)>;
          if constexpr (std::is_same_v<T, double> || std::is_same_v<T, int64_t> ||
                        std::is_same_v<T, std::string> ||
                        std::is_same_v<T, std::vector<int64_t>> ||
                        std::is_same_v<T, std::vector<double>>) {
            out.emplace_back(name, Scalar(v));
          } else {
            throw CompileError("attribute '" + name + "' of kind " +
                               std::string(ir::attribute_kind(value)) +
                               " cannot be passed to a table op");
          }
        },
        value);
  }
  return out;
}

}  // namespace stagejit::detail

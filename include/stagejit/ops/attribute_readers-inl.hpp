#pragma once
/// \file
/// Bodies of ops/detail/attribute_readers.hpp: the readers of an op's attributes that the
/// op table's forwards and backwards use.
///
/// Function bodies (core/config.hpp): compiled once in src/compiled_bodies.cpp, or
/// inline in every translation unit of a header-only build.
#include <stagejit/core/config.hpp>
#include <stagejit/ops/detail/attribute_readers.hpp>
#include <stagejit/core/error.hpp>

#include <ATen/ATen.h>

#include <optional>
#include <string_view>
#include <vector>

namespace stagejit::detail::ops_impl {

// ------------------------------------------------------------------ attributes
STAGEJIT_FUNC const Scalar* find_attr(const Attributes& a, std::string_view n) {
  for (const auto& [k, v] : a)
    if (k == n) return &v;
  return nullptr;
}

STAGEJIT_FUNC const Scalar& need_attr(const Attributes& a, std::string_view n) {
  const Scalar* s = find_attr(a, n);
  STAGEJIT_CHECK(s, "missing attribute '", n, "'");
  return *s;
}

STAGEJIT_FUNC double as_double(const Scalar& s, std::string_view n) {
  if (auto* d = std::get_if<double>(&s)) return *d;
  if (auto* i = std::get_if<int64_t>(&s)) return static_cast<double>(*i);
  if (auto* b = std::get_if<bool>(&s)) return *b ? 1.0 : 0.0;
  throw Error(detail::str_cat("attribute '", n, "' must be a number"));
}

STAGEJIT_FUNC double attr_double(const Attributes& a, std::string_view n, double dflt) {
  const Scalar* s = find_attr(a, n);
  return s ? as_double(*s, n) : dflt;
}

STAGEJIT_FUNC std::optional<double> attr_opt_double(const Attributes& a, std::string_view n) {
  const Scalar* s = find_attr(a, n);
  if (!s) return std::nullopt;
  return as_double(*s, n);
}

STAGEJIT_FUNC at::Scalar attr_scalar(const Attributes& a, std::string_view n, std::optional<double> dflt) {
  const Scalar* s = find_attr(a, n);
  if (!s) {
    STAGEJIT_CHECK(dflt, "missing attribute '", n, "'");
    return at::Scalar(*dflt);
  }
  if (auto* d = std::get_if<double>(s)) return at::Scalar(*d);
  if (auto* i = std::get_if<int64_t>(s)) return at::Scalar(*i);
  if (auto* b = std::get_if<bool>(s)) return at::Scalar(*b);
  throw Error(detail::str_cat("attribute '", n, "' must be a number"));
}

STAGEJIT_FUNC int64_t attr_int(const Attributes& a, std::string_view n, std::optional<int64_t> dflt) {
  const Scalar* s = find_attr(a, n);
  if (!s) {
    STAGEJIT_CHECK(dflt, "missing attribute '", n, "'");
    return *dflt;
  }
  if (auto* i = std::get_if<int64_t>(s)) return *i;
  if (auto* b = std::get_if<bool>(s)) return *b;
  throw Error(detail::str_cat("attribute '", n, "' must be an integer"));
}

STAGEJIT_FUNC bool attr_bool(const Attributes& a, std::string_view n, bool dflt) {
  const Scalar* s = find_attr(a, n);
  if (!s) return dflt;
  if (auto* b = std::get_if<bool>(s)) return *b;
  if (auto* i = std::get_if<int64_t>(s)) return *i != 0;
  throw Error(detail::str_cat("attribute '", n, "' must be a bool"));
}

STAGEJIT_FUNC std::vector<int64_t> attr_ints(const Attributes& a, std::string_view n) {
  const Scalar& s = need_attr(a, n);
  if (auto* v = std::get_if<std::vector<int64_t>>(&s)) return *v;
  if (auto* i = std::get_if<int64_t>(&s)) return {*i};
  throw Error(detail::str_cat("attribute '", n, "' must be a list of integers"));
}

}  // namespace stagejit::detail::ops_impl

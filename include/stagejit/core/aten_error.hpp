#pragma once
/// \file
/// ATen's errors as stagejit errors: `rethrow_aten_error` throws the stagejit class of a
/// `c10::Error`'s kind, by the mapping in core/error.hpp ("ATen errors").

#include <stagejit/core/error.hpp>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <string>
#include <string_view>
#include <typeinfo>

namespace stagejit {

/// The stagejit class an ATen error maps to (core/error.hpp, "ATen errors").
enum class AtenErrorKind { Shape, Dtype, Other };

/// Classifies `e` by its kind and, for a plain `c10::Error`, by its message.
inline AtenErrorKind classify_aten_error(const c10::Error& e) {
  if (dynamic_cast<const c10::TypeError*>(&e) || dynamic_cast<const c10::NotImplementedError*>(&e))
    return AtenErrorKind::Dtype;
  if (dynamic_cast<const c10::IndexError*>(&e)) return AtenErrorKind::Shape;
  if (typeid(e) != typeid(c10::Error)) return AtenErrorKind::Other;  // ValueError, LinAlgError, ...
  std::string msg = e.what_without_backtrace();
  std::transform(msg.begin(), msg.end(), msg.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  for (std::string_view phrase : {"not implemented for '", "scalar type", "dtype", "can't be cast to", "device",
                                  "could not run '"})
    if (msg.find(phrase) != std::string::npos) return AtenErrorKind::Dtype;
  return AtenErrorKind::Shape;
}

/// Throws `e` as the stagejit error of its kind (`ShapeError`, `DtypeError` or `Error`),
/// with message `prefix` followed by ATen's message without its backtrace.
[[noreturn]] inline void rethrow_aten_error(const c10::Error& e, const std::string& prefix) {
  std::string msg = prefix + e.what_without_backtrace();
  switch (classify_aten_error(e)) {
    case AtenErrorKind::Shape: throw ShapeError(msg);
    case AtenErrorKind::Dtype: throw DtypeError(msg);
    default: throw Error(msg);
  }
}

}  // namespace stagejit

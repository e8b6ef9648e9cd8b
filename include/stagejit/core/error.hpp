#pragma once
/// \file
/// The error hierarchy of stagejit and the always-on check macro.
///
/// Every error a user can cause is reported by throwing a subclass of
/// `stagejit::Error` whose message names the node, value, function or stage concerned
/// and what was expected. Internal invariants use `STAGEJIT_ASSERT` (debug builds only).
///
/// ATen errors. An op that ATen refuses reports ATen's message (without its backtrace)
/// after the op's name, as the stagejit class of its kind (`rethrow_aten_error` in
/// core/aten_error.hpp; the autograd engine maps errors escaping a Function the same way):
///
/// - `c10::TypeError`, `c10::NotImplementedError` -> `DtypeError`;
/// - `c10::IndexError` (a dimension or index out of range) -> `ShapeError`;
/// - `c10::ValueError`, `LinAlgError`, `OutOfMemoryError` and other kinds -> `Error`;
/// - a plain `c10::Error` about dtypes or devices (its message has `not implemented for '`,
///   `scalar type`, `dtype`, `can't be cast to`, `device` or `Could not run '`, case
///   ignored) -> `DtypeError`;
/// - any other plain `c10::Error` (ATen's `TORCH_CHECK` of arguments: mostly shapes) ->
///   `ShapeError`.
///
/// The message test is needed because ATen 1.13 reports most dtype errors
/// (`"addmm_impl_cpu_" not implemented for 'Half'`, `expected scalar type Float but found
/// Double`) as a plain `c10::Error`.

#include <cstddef>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace stagejit {

/// Base of every exception stagejit throws. Derives `std::runtime_error`.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

/// A graph violates an IR invariant (thrown by `ir::lint` and IR mutators).
class IrError : public Error {
 public:
  using Error::Error;
};

/// Malformed IR text. `line()` and `column()` are 1-based positions in the parsed text;
/// `what()` reads `line:column: message`.
class ParseError : public Error {
 public:
  ParseError(std::size_t line, std::size_t column, const std::string& message)
      : Error(std::to_string(line) + ":" + std::to_string(column) + ": " + message),
        line_(line), column_(column), message_(message) {}
  std::size_t line() const noexcept { return line_; }
  std::size_t column() const noexcept { return column_; }
  /// The message without the `line:column: ` prefix.
  const std::string& message() const noexcept { return message_; }

 private:
  std::size_t line_, column_;
  std::string message_;
};

/// Something the tracer cannot record (untraced output, in-place op on an input, ...).
class TraceError : public Error {
 public:
  using Error::Error;
};

/// The closure compiler or `compile()` cannot serve a graph or a call.
class CompileError : public Error {
 public:
  using Error::Error;
};

/// Tensor shapes that do not fit an op or a traced signature.
class ShapeError : public Error {
 public:
  using Error::Error;
};

/// A tensor's dtype (or device) that an op or a traced signature does not support, or
/// tensors whose dtypes (or devices) do not agree; see "ATen errors" above.
class DtypeError : public Error {
 public:
  using Error::Error;
};

/// A bug in stagejit, not in the caller's input: an internal invariant failed
/// (`STAGEJIT_ASSERT`, checked in debug builds). The message says so, names the file and
/// line and asks for a report; the caller's program and data are not at fault.
class InternalError : public Error {
 public:
  using Error::Error;
};

/// A fusion kernel could not be generated, compiled, loaded or launched.
class FusionError : public Error {
 public:
  using Error::Error;
};

/// A distributed process group or data-parallel step failed: a peer did not arrive or was
/// lost, a collective timed out, or the ranks disagree (distributed/). The message names
/// this rank, the store's address and the timeout, and the lost rank(s) when known.
class DistributedError : public Error {
 public:
  using Error::Error;
};

namespace detail {

inline void append_all(std::ostringstream&) {}
template <class T, class... Rest>
void append_all(std::ostringstream& os, const T& first, const Rest&... rest) {
  os << first;
  append_all(os, rest...);
}

/// Concatenates every argument with `operator<<` into one string.
template <class... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  append_all(os, args...);
  return os.str();
}

template <class E, class... Args>
[[noreturn]] void throw_error(const Args&... args) {
  throw E(str_cat(args...));
}

}  // namespace detail
}  // namespace stagejit

/// Always-on check of user input: throws `stagejit::Error` with the streamed message.
#define STAGEJIT_CHECK(cond, ...)                                   \
  do {                                                              \
    if (!(cond)) ::stagejit::detail::throw_error<::stagejit::Error>(__VA_ARGS__); \
  } while (false)

/// Always-on check that throws the given `stagejit::Error` subclass.
#define STAGEJIT_CHECK_AS(ErrorType, cond, ...)                      \
  do {                                                              \
    if (!(cond)) ::stagejit::detail::throw_error<ErrorType>(__VA_ARGS__); \
  } while (false)

/// Internal invariant, checked in debug builds only (never for user input): throws
/// `stagejit::InternalError` ("bug in stagejit: ...").
#ifdef NDEBUG
#define STAGEJIT_ASSERT(cond, ...) ((void)0)
#else
#define STAGEJIT_ASSERT(cond, ...)                                                  \
  do {                                                                              \
    if (!(cond))                                                                    \
      ::stagejit::detail::throw_error<::stagejit::InternalError>(                    \
          "bug in stagejit (please report it): internal assertion `" #cond       \
          "` failed at " __FILE__ ":", __LINE__, ": " __VA_OPT__(, ) __VA_ARGS__); \
  } while (false)
#endif

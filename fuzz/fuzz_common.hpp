#pragma once
// What both fuzz targets share: reporting a finding (a message on stderr, then
// __builtin_trap so libFuzzer saves the input as a crash) and the checks that tell an
// expected rejection from a finding (fuzz/README.md, "What counts as a finding").
#include <cstdio>
#include <exception>
#include <string>
#include <string_view>
#include <typeinfo>

#include <stagejit/core/error.hpp>

namespace stagejit::fuzz {

[[noreturn]] inline void finding(std::string_view what, std::string_view detail = {}) {
  std::fprintf(stderr, "\n==== stagejit fuzz finding: %.*s\n%.*s\n", int(what.size()), what.data(),
               int(detail.size()), detail.data());
  std::fflush(stderr);
  __builtin_trap();
}

/// An error a library call threw on purpose: a finding when it is a failed internal
/// assertion (STAGEJIT_ASSERT throws stagejit::Error in builds without NDEBUG).
inline void check_not_internal(const Error& e, std::string_view where) {
  if (std::string_view(e.what()).find("internal assertion") != std::string_view::npos)
    finding(std::string(where) + ": internal assertion failed", e.what());
}

/// Runs `f`; an exception that is not a stagejit::Error (std::out_of_range from an
/// `.at()`, std::bad_variant_access, an unmapped c10::Error, ...) is a finding.
template <class F>
void no_foreign_exceptions(std::string_view where, F&& f) {
  try {
    f();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    finding(std::string(where) + ": an exception that is not a stagejit::Error escaped",
            std::string(typeid(e).name()) + ": " + e.what());
  } catch (...) {
    finding(std::string(where) + ": a non-std exception escaped");
  }
}

}  // namespace stagejit::fuzz

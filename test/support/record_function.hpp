#pragma once
// Runs a function with an ATen RecordFunction callback installed, for the tests and the
// benchmarks that count or time ATen ops (test/closure/product_count_test.cpp,
// bench/gemm_profile.hpp). Not part of the library.
#include <ATen/record_function.h>

#include <utility>

namespace stagejit::testing {

/// Calls `f()` with `callback` added as a global RecordFunction callback; removes it
/// afterwards, also when `f` throws.
template <class F>
void with_global_callback(at::RecordFunctionCallback callback, F&& f) {
  auto handle = at::addGlobalCallback(std::move(callback));
  try {
    f();
  } catch (...) {
    at::removeCallback(handle);
    throw;
  }
  at::removeCallback(handle);
}

}  // namespace stagejit::testing

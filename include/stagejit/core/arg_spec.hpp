#pragma once
/// \file
/// `ArgSpec`: what a compiled function's trace depends on, per input — defined,
/// requires_grad, dtype, device, sizes and contiguity (docs/design.md: the trace cache keyed
/// on an argument spec, which retraces on a new spec instead of throwing). Two calls with
/// equal specs can share one compiled closure.

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace stagejit {

/// The spec of one input.
struct TensorSpec {
  bool defined = false;
  bool requires_grad = false;
  at::ScalarType dtype = at::ScalarType::Undefined;
  at::Device device = at::kCPU;
  std::vector<int64_t> sizes;
  bool contiguous = true;

  static TensorSpec of(const at::Tensor& t, bool requires_grad) {
    TensorSpec s;
    if (!t.defined()) return s;
    s.defined = true;
    s.requires_grad = requires_grad;
    s.dtype = t.scalar_type();
    s.device = t.device();
    s.sizes.assign(t.sizes().begin(), t.sizes().end());
    s.contiguous = t.is_contiguous();
    return s;
  }
  friend bool operator==(const TensorSpec&, const TensorSpec&) = default;
};

/// The spec of a whole argument list.
struct ArgSpec {
  std::vector<TensorSpec> inputs;
  friend bool operator==(const ArgSpec&, const ArgSpec&) = default;

  /// A readable form, e.g. `(Double(2, 3) rg, Float(4) nc)`.
  std::string to_string() const {
    std::ostringstream os;
    os << '(';
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      const auto& t = inputs[i];
      if (i) os << ", ";
      if (!t.defined) { os << "undefined"; continue; }
      os << at::toString(t.dtype) << '(';
      for (std::size_t d = 0; d < t.sizes.size(); ++d) os << (d ? ", " : "") << t.sizes[d];
      os << ')';
      if (t.device != at::kCPU) os << ' ' << t.device;
      if (t.requires_grad) os << " rg";
      if (!t.contiguous) os << " nc";
    }
    os << ')';
    return os.str();
  }
};

/// Hash of an ArgSpec (for unordered containers).
struct ArgSpecHash {
  std::size_t operator()(const ArgSpec& s) const noexcept {
    std::size_t h = s.inputs.size();
    auto mix = [&h](std::size_t v) { h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2); };
    for (const auto& t : s.inputs) {
      mix(t.defined);
      mix(t.requires_grad);
      mix(static_cast<std::size_t>(t.dtype));
      mix(std::hash<std::string>()(t.device.str()));
      for (auto d : t.sizes) mix(static_cast<std::size_t>(d));
      mix(t.contiguous);
    }
    return h;
  }
};

}  // namespace stagejit

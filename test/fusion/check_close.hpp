#pragma once
// Comparison of fused-kernel results with ATen's, shared by the fusion suites.

#include <stagejit/testing/doctest.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace stagejit::testing {

/// Distance in units in the last place between two floats (0 for equal values and for
/// two NaNs; INT64_MAX for NaN against a number or an infinity against anything else).
inline int64_t ulps(float x, float y) {
  if (std::isnan(x) || std::isnan(y)) return (std::isnan(x) && std::isnan(y)) ? 0 : INT64_MAX;
  if (x == y) return 0;
  if (std::isinf(x) || std::isinf(y)) return INT64_MAX;
  int32_t ix, iy;
  std::memcpy(&ix, &x, 4);
  std::memcpy(&iy, &y, 4);
  if ((ix < 0) != (iy < 0)) return int64_t(ix & 0x7fffffff) + int64_t(iy & 0x7fffffff);
  return std::llabs(int64_t(ix) - int64_t(iy));
}

/// Float within 4 ulp, double within 1e-12 relative to max(1, |want|); NaN and
/// infinities must match exactly; bool exactly.
inline void check_close(const at::Tensor& got, const at::Tensor& want) {
  REQUIRE(got.sizes() == want.sizes());
  REQUIRE((got.scalar_type() == want.scalar_type()));
  const at::Tensor g = got.contiguous().reshape({-1}), w = want.contiguous().reshape({-1});
  int64_t worst = 0;
  double worst_d = 0;
  for (int64_t i = 0; i < w.numel(); ++i) {
    if (w.scalar_type() == at::kFloat) {
      worst = std::max(worst, ulps(g.data_ptr<float>()[i], w.data_ptr<float>()[i]));
    } else if (w.scalar_type() == at::kBool) {
      if (g.data_ptr<bool>()[i] != w.data_ptr<bool>()[i]) worst = INT64_MAX;
    } else {
      const double x = g.data_ptr<double>()[i], y = w.data_ptr<double>()[i];
      if (!std::isfinite(x) || !std::isfinite(y)) {
        if (!((std::isnan(x) && std::isnan(y)) || x == y)) worst_d = INFINITY;
        continue;
      }
      worst_d = std::max(worst_d, std::abs(x - y) / std::max(1.0, std::abs(y)));
    }
  }
  CHECK(worst <= 4);
  CHECK(worst_d <= 1e-12);
}

}  // namespace stagejit::testing

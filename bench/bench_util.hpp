#pragma once
// Helpers shared by the benchmarks: median wall time of repeated runs after a warm-up,
// in milliseconds, a fixed-width table row, and the relative difference used to check
// results against libtorch. Not part of the library.
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <vector>

namespace stagejit::bench {

/// Median of `reps` timed runs of `f` after `warmup` untimed ones, in ms.
inline double median_ms(const std::function<void()>& f, int reps = 20, int warmup = 3) {
  for (int i = 0; i < warmup; ++i) f();
  std::vector<double> t;
  t.reserve(reps);
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    const auto t1 = std::chrono::steady_clock::now();
    t.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  std::nth_element(t.begin(), t.begin() + t.size() / 2, t.end());
  return t[t.size() / 2];
}

/// Wall time of one run of `f`, in ms.
inline double once_ms(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

/// `  name   time ms   speed-up vs reference` (speed-up = reference / time).
inline void row(const char* name, double ms, double reference_ms) {
  std::printf("  %-36s %9.3f ms   %6.2fx\n", name, ms, reference_ms / ms);
}

/// max |x - ref| / max |ref| (ref all zeros: divided by 1e-30).
inline double max_rel_diff(const at::Tensor& x, const at::Tensor& ref) {
  return ((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item<double>();
}

}  // namespace stagejit::bench

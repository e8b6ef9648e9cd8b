// Fusion backend benchmark: y = tanh(a*b + c) * sigmoid(a) on 16M floats.
// Compares a kernel written against the CPU prelude (at::vec::Vectorized + SLEEF), a
// plain scalar loop compiled by the same backend, and libtorch eager; prints times and
// ratios measured in this run. Not part of the test suite.
#include <stagejit/fusion/cpu_backend.hpp>
#include <stagejit/implementation.hpp>  // header-only builds: the bodies

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <vector>

using namespace stagejit::fusion;

namespace {

double best_ms(const std::function<void()>& f, int reps = 10) {
  f();  // warm-up (page faults, lazy loads)
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    const auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  return best;
}

const char* kVectorised = R"(
extern "C" void fused_vec(int64_t begin, int64_t end, int32_t rank, const stagejit_TensorArg* args) {
  sjk::elementwise<float, sjk::types<float, float, float>, sjk::types<float>>(
      begin, end, rank, args, [](const sjk::Vec<float>* in, sjk::Vec<float>* out) {
        out[0] = (in[0] * in[1] + in[2]).tanh() * sjk::sigmoid(in[0]);
      });
}
)";

// Scalar loop over contiguous rank-1 arguments (what a naive generator would emit).
const char* kScalar = R"(
#include <cmath>
extern "C" void fused_scalar(int64_t begin, int64_t end, int32_t rank, const stagejit_TensorArg* args) {
  const float* a = static_cast<const float*>(args[0].data);
  const float* b = static_cast<const float*>(args[1].data);
  const float* c = static_cast<const float*>(args[2].data);
  float* y = static_cast<float*>(args[3].data);
  for (int64_t i = begin; i < end; ++i) y[i] = std::tanh(a[i] * b[i] + c[i]) * (1.0f / (1.0f + std::exp(-a[i])));
}
)";

}  // namespace

int main() {
  const int64_t n = int64_t(1) << 24;
  at::manual_seed(0);
  at::Tensor a = at::randn({n}), b = at::randn({n}), c = at::randn({n});
  at::Tensor out = at::empty({n});

  KernelKey key;
  key.inputs.assign(3, TensorDesc{at::kFloat, 1, true});
  key.outputs.assign(1, TensorDesc{at::kFloat, 1, true});
  CpuBackend& backend = default_cpu_backend();
  auto t0 = std::chrono::steady_clock::now();
  auto vec = backend.get(KernelSource{kVectorised, "fused_vec", key});
  auto t1 = std::chrono::steady_clock::now();
  auto scalar = backend.get(KernelSource{kScalar, "fused_scalar", key});
  auto t2 = std::chrono::steady_clock::now();
  const PackedArgs args = pack_tensor_args({n}, {a, b, c}, {out});

  const double eager = best_ms([&] { at::Tensor y = at::tanh(a * b + c) * at::sigmoid(a); });
  const double fused_vec = best_ms([&] { vec->run(args); });
  const double fused_vec_alloc = best_ms([&] {
    at::Tensor y = at::empty({n});
    vec->run(pack_tensor_args({n}, {a, b, c}, {y}));
  });
  const double fused_scalar = best_ms([&] { scalar->run(args); });
  const double copy = best_ms([&] { out.copy_(a); });
  const at::Tensor want = at::tanh(a * b + c) * at::sigmoid(a);
  vec->run(args);
  const double max_diff = (out - want).abs().max().item<double>();

  // Bytes that must move: 3 inputs read + 1 output written; copy moves 2 arrays.
  const double bytes = 4.0 * n * sizeof(float);
  const double copy_bw = 2.0 * n * sizeof(float) / (copy * 1e-3);
  std::printf("fusion_backend: y = tanh(a*b+c)*sigmoid(a), %lld floats, %d ATen threads\n", (long long)n,
              at::get_num_threads());
  std::printf("  compile (cache %s): vectorised %.0f ms, scalar %.0f ms\n", backend.options().cache_dir.c_str(),
              std::chrono::duration<double, std::milli>(t1 - t0).count(),
              std::chrono::duration<double, std::milli>(t2 - t1).count());
  std::printf("  libtorch eager              %8.2f ms\n", eager);
  std::printf("  fused, Vectorized (planned) %8.2f ms   %.2fx eager\n", fused_vec, eager / fused_vec);
  std::printf("  fused, Vectorized (+alloc)  %8.2f ms   %.2fx eager\n", fused_vec_alloc, eager / fused_vec_alloc);
  std::printf("  fused, scalar loop          %8.2f ms   %.2fx eager\n", fused_scalar, eager / fused_scalar);
  std::printf("  bandwidth limit             %8.2f ms   (copy bandwidth %.1f GB/s)\n", bytes / copy_bw * 1e3,
              copy_bw / 1e9);
  std::printf("  max |fused - eager|         %.3g\n", max_diff);
  return 0;
}

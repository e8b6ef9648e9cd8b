// bench/fusion: y = tanh(a*b + c) * sigmoid(a) on 16M floats (2^24), forward and
// forward+backward (gradients of a, b, c for a grad output of ones), through
//   - stagejit compile() with fusion (one generated kernel per fusion group and stage),
//   - stagejit compile() without fusion (the same closures, one ATen kernel per op),
//   - stagejit eager autograd,
//   - libtorch eager (the reference of the ratios),
// all in one run, plus the bandwidth limit: the bytes that must move (forward: read a, b,
// c, write y; forward+backward: also read the grad output and write the three gradients)
// divided by the copy bandwidth measured in the same run. Prints median times (ms) and
// speed-ups over libtorch eager; checks that every variant agrees with libtorch.
// Options: --n N (elements, default 2^24), --reps R (default 10), --print-graph (the
// fused forward+backward graph), --device cpu|cuda (default cpu).
// On CUDA (libtorch with CUDA, a GPU): every time is the mean of back-to-back calls
// followed by one synchronisation (so host overheads overlap the kernels, as in a training
// loop), the bandwidth limit is the device's peak DRAM bandwidth from the driver (and the
// measured device-to-device copy is printed beside it), and the fused forward kernel's
// achieved GB/s is printed against that peak; --min-bandwidth F makes the run fail (exit
// 4) when the fused forward reaches less than the fraction F of it (scripts/gpu-check: 0.8).
#include <stagejit/fusion/cuda_backend.hpp>
#include <stagejit/stagejit.hpp>
#include <torch/torch.h>

#include "bench_util.hpp"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>

namespace sj = stagejit;
using sj::bench::max_rel_diff;
using sj::bench::row;

namespace {

template <class T>
T model(const T& a, const T& b, const T& c) {
  return tanh(a * b + c) * sigmoid(a);
}

}  // namespace

int main(int argc, char** argv) {
  int64_t n = int64_t(1) << 24;
  int reps = 10;
  bool print_graph = false;
  std::string device_name = "cpu";
  double min_bandwidth = 0;
  for (int i = 1; i < argc; ++i)
    if (!std::strcmp(argv[i], "--print-graph")) print_graph = true;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--print-graph")) --i;
    else if (!std::strcmp(argv[i], "--n")) n = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--device")) device_name = argv[i + 1];
    else if (!std::strcmp(argv[i], "--min-bandwidth")) min_bandwidth = std::atof(argv[i + 1]);
    else {
      std::fprintf(stderr, "usage: %s [--n ELEMENTS] [--reps R] [--print-graph] [--device cpu|cuda] "
                   "[--min-bandwidth FRACTION]\n", argv[0]);
      return 1;
    }
  }
  const bool cuda = device_name == "cuda";
  if (!cuda && device_name != "cpu") {
    std::fprintf(stderr, "bench/fusion: --device must be cpu or cuda, got '%s'\n", device_name.c_str());
    return 1;
  }
  if (cuda && (!at::hasCUDA() || !sj::fusion::cuda_driver_available())) {
    std::fprintf(stderr, "bench/fusion: --device cuda needs a libtorch with CUDA (meson summary: \"CUDA tensors\") "
                 "and a GPU; this build/machine has %s\n",
                 at::hasCUDA() ? "no usable CUDA driver" : "a libtorch without CUDA");
    return 1;
  }
  const at::Device dev = cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  // On CUDA a timed call is `inner` back-to-back calls and one synchronisation.
  const int inner = cuda ? 20 : 1;
  auto median_ms = [&](const std::function<void()>& f, int r) {
    return sj::bench::median_ms([&] {
      for (int k = 0; k < inner; ++k) f();
      if (cuda) sj::fusion::cuda_synchronize(0);
    }, r) / inner;
  };
  at::manual_seed(0);
  at::Tensor a = at::randn({n}).to(dev), b = at::randn({n}).to(dev), c = at::randn({n}).to(dev);
  at::Tensor gy = at::ones({n}).to(dev);

  auto fn = [](const sj::variable_list& in) -> sj::variable_list {
    return {model(in[0], in[1], in[2])};
  };
  auto fused = sj::compile(fn, {.derivatives = 1, .fuse = true});
  auto unfused = sj::compile(fn, {.derivatives = 1, .fuse = false});

  // ---- forward (no input requires grad: stage 0 only)
  const sj::variable_list in_nograd = {sj::Variable(a), sj::Variable(b), sj::Variable(c)};
  const double compile_fwd_ms = sj::bench::once_ms([&] { fused(in_nograd); });
  at::Tensor ref_y = model(a, b, c);
  const double fwd_torch = median_ms([&] { torch::NoGradGuard g; auto y = model(a, b, c); }, reps);
  const double fwd_fused = median_ms([&] { auto y = fused(in_nograd); }, reps);
  const double fwd_unfused = median_ms([&] { auto y = unfused(in_nograd); }, reps);
  const double fwd_eager = median_ms([&] {
    sj::NoGradGuard g;
    auto y = model(in_nograd[0], in_nograd[1], in_nograd[2]);
  }, reps);
  const double fwd_diff = max_rel_diff(fused(in_nograd)[0].data(), ref_y);

  // ---- forward + backward
  const sj::variable_list in = {sj::Variable(a, true), sj::Variable(b, true), sj::Variable(c, true)};
  const sj::Variable g(gy);
  auto sj_step = [&](sj::CompiledFunction& f) {
    auto y = f(in);
    return sj::grad(y, in, {g});
  };
  const double compile_bwd_ms = sj::bench::once_ms([&] { sj_step(fused); });
  std::vector<torch::Tensor> leaves = {a.detach().requires_grad_(true), b.detach().requires_grad_(true),
                                       c.detach().requires_grad_(true)};
  auto torch_step = [&] {
    auto y = model(leaves[0], leaves[1], leaves[2]);
    return torch::autograd::grad({y}, leaves, {gy});
  };
  const double bwd_torch = median_ms([&] { torch_step(); }, reps);
  const double bwd_fused = median_ms([&] { sj_step(fused); }, reps);
  const double bwd_unfused = median_ms([&] { sj_step(unfused); }, reps);
  const double bwd_eager = median_ms([&] {
    auto y = model(in[0], in[1], in[2]);
    sj::grad({y}, in, {g});
  }, reps);
  double bwd_diff = 0;
  {
    auto want = torch_step();
    auto got = sj_step(fused);
    for (int i = 0; i < 3; ++i) bwd_diff = std::max(bwd_diff, max_rel_diff(got[i].data(), want[i]));
  }

  // ---- bandwidth limit: bytes that must move at the measured copy bandwidth (CPU) or
  // at the device's peak DRAM bandwidth (CUDA)
  at::Tensor dst = at::empty({n}, a.options());
  const double copy_ms = median_ms([&] { dst.copy_(a); }, reps);
  const double copy_bw = 2.0 * double(n) * sizeof(float) / (copy_ms * 1e-3);  // bytes/s
  sj::fusion::CudaDeviceInfo gpu;
  if (cuda) gpu = sj::fusion::cuda_device_info(0);
  const double peak_bw = cuda && gpu.peak_bandwidth_gbs() > 0 ? gpu.peak_bandwidth_gbs() * 1e9 : copy_bw;
  const double limit_fwd = 4.0 * double(n) * sizeof(float) / peak_bw * 1e3;
  const double limit_bwd = 8.0 * double(n) * sizeof(float) / peak_bw * 1e3;
  // The fused forward kernel alone: its group run through fusion::FusedGroup (the
  // closure's runner, plan memoised) without the compiled function around it.
  double kernel_fwd = 0;
  if (cuda)
  for (auto* node : fused.graph_for(in_nograd)->nodes())
    if (auto* group = node->get_if<sj::ir::FusionGroup>(); group && kernel_fwd == 0) {
      const sj::fusion::FusedGroup runner(group->subgraph, "bench forward group");
      const std::vector<at::Tensor> args = {a, b, c};
      if (group->subgraph->inputs().size() == 3) kernel_fwd = median_ms([&] { runner.run(args); }, reps);
    }

  int groups = 0;
  for (auto* node : fused.graph_for(in)->nodes()) groups += node->is<sj::ir::FusionGroup>();
  if (print_graph) std::printf("%s\n", sj::ir::to_string(*fused.graph_for(in)).c_str());

  std::printf("bench/fusion: y = tanh(a*b + c) * sigmoid(a), %lld floats on %s, ATen threads %d, "
              "median of %d\n", static_cast<long long>(n), cuda ? ("cuda:0 (" + gpu.name + ")").c_str() : "the CPU",
              at::get_num_threads(), reps);
  std::printf("  first call (trace + compile kernels, or disk-cache hits): forward %.0f ms, "
              "forward+backward %.0f ms; %d fusion groups over both stages\n",
              compile_fwd_ms, compile_bwd_ms, groups);
  std::printf(" forward                                      time      vs libtorch\n");
  row("libtorch eager", fwd_torch, fwd_torch);
  row("stagejit eager", fwd_eager, fwd_torch);
  row("stagejit compiled, unfused", fwd_unfused, fwd_torch);
  row("stagejit compiled, fused", fwd_fused, fwd_torch);
  row("bandwidth limit (4 arrays)", limit_fwd, fwd_torch);
  std::printf(" forward + backward\n");
  row("libtorch eager", bwd_torch, bwd_torch);
  row("stagejit eager", bwd_eager, bwd_torch);
  row("stagejit compiled, unfused", bwd_unfused, bwd_torch);
  row("stagejit compiled, fused", bwd_fused, bwd_torch);
  row("bandwidth limit (8 arrays)", limit_bwd, bwd_torch);
  std::printf("  copy bandwidth %.1f GB/s; max relative difference to libtorch: forward %.2g, "
              "gradients %.2g\n", copy_bw / 1e9, fwd_diff, bwd_diff);
  const bool correct = fwd_diff < 1e-5 && bwd_diff < 1e-5;
  if (!cuda) {
    std::printf("  targets: fused forward >= 4x libtorch (%s), fused forward+backward >= 6x (%s)\n",
                fwd_torch / fwd_fused >= 4 ? "met" : "NOT met", bwd_torch / bwd_fused >= 6 ? "met" : "NOT met");
    return correct ? 0 : 3;
  }
  const double bytes_fwd = 4.0 * double(n) * sizeof(float);
  const double gbs_compiled = bytes_fwd / (fwd_fused * 1e-3) / 1e9;
  const double gbs_kernel = kernel_fwd > 0 ? bytes_fwd / (kernel_fwd * 1e-3) / 1e9 : 0;
  const double peak_gbs = peak_bw / 1e9;
  std::printf("  device: %s, sm_%d, %d SMs, memory clock %d MHz x %d-bit bus: peak %.0f GB/s%s; "
              "measured device-to-device copy %.0f GB/s (%.0f%% of peak)\n",
              gpu.name.c_str(), gpu.compute_capability, gpu.multiprocessors, gpu.memory_clock_khz / 1000,
              gpu.memory_bus_width_bits, peak_gbs, gpu.peak_bandwidth_gbs() > 0 ? "" : " (driver gave no clock: copy)",
              copy_bw / 1e9, 100 * copy_bw / peak_bw);
  std::printf("  fused forward (16 bytes per element): kernel alone (FusedGroup) %.3f ms = %.0f GB/s = %.0f%% of "
              "peak; compiled call %.3f ms = %.0f GB/s = %.0f%% of peak\n",
              kernel_fwd, gbs_kernel, 100 * gbs_kernel / peak_gbs, fwd_fused, gbs_compiled,
              100 * gbs_compiled / peak_gbs);
  const double best = std::max(gbs_kernel, gbs_compiled) / peak_gbs;
  std::printf("  target: fused forward >= 80%% of the device's memory bandwidth: %s (%.0f%%)\n",
              best >= 0.8 ? "met" : "NOT met", 100 * best);
  if (!correct) return 3;
  return best >= min_bandwidth ? 0 : 4;
}

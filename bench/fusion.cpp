// bench/fusion: y = tanh(a*b + c) * sigmoid(a) on 16M floats (2^24), forward and
// forward+backward (gradients of a, b, c for a grad output of ones), through
//   - stagejit compile() with fusion (one generated kernel per fusion group and stage),
//   - stagejit compile() without fusion (the same closures, one ATen kernel per op),
//   - the step compiled in one stage: a function that computes y and calls sj::grad on it
//     inside, compiled with {.derivatives = 0}; the forward and its backward are one
//     trace, so the fuser makes one kernel of both (one pass over the 8 arrays),
//   - stagejit eager autograd,
//   - libtorch eager (the reference of the ratios), with glibc's malloc as it comes
//     (every 64 MiB tensor is a fresh mmap: page faults on first touch) and on the level
//     field (inside a memory::HostCacheScope: freed blocks are reused, no page faults,
//     as for the compiled stages; bench/closure.md),
//   - hand-written kernels compiled by the same CPU backend (compiler, flags, prelude):
//     forward+backward in one pass over the 8 arrays, and in the compiled stages' two
//     passes (the forward also writes sigmoid(a) and tanh(a*b+c), the backward reads
//     them) - the yardsticks of the generated code,
// all in one run, plus the bandwidth limit: the bytes that must move (forward: read a, b,
// c, write y; forward+backward: also read the grad output and write the three gradients)
// divided by the copy bandwidth measured in the same run. Prints median times (ms),
// speed-ups over libtorch eager, page faults per call, the fused and hand-written times
// as shares of the bandwidth limit, and the load average; checks that every variant
// agrees with libtorch.
// Options: --n N (elements, default 2^24), --reps R (default 10), --print-graph (the
// fused forward+backward graph), --fused-only R (profiling: only the fused
// forward+backward, R times), --device cpu|cuda (default cpu).
// On CUDA (libtorch with CUDA, a GPU): every time is the mean of back-to-back calls
// followed by one synchronisation (so host overheads overlap the kernels, as in a training
// loop), the bandwidth limit is the device's peak DRAM bandwidth from the driver (and the
// measured device-to-device copy is printed beside it), and the fused forward kernel's
// achieved GB/s is printed against that peak; --min-bandwidth F makes the run fail (exit
// 4) when the fused forward reaches less than the fraction F of it (scripts/gpu-check: 0.8).
// The level field, page faults and the hand-written kernels are CPU-only.
#include <stagejit/fusion/cuda_backend.hpp>
#include <stagejit/compiler.hpp>
#include <torch/torch.h>

#include "bench_util.hpp"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
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

/// Minor page faults of the process so far.
long minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

/// Page faults per call of `f` in steady state (3 calls after 1).
double faults_per_call(const std::function<void()>& f) {
  f();
  const long before = minor_faults();
  for (int i = 0; i < 3; ++i) f();
  return double(minor_faults() - before) / 3;
}

std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  in >> a >> b >> c;
  return a.empty() ? std::string("unknown") : a + " " + b + " " + c;
}

// Hand-written kernels (launch ABI of fusion/kernel_spec.hpp, prelude of the CPU backend):
// raw pointers, one vector loop, streaming stores aligned by a peeled partial vector.
constexpr const char* kHandKernels = R"HAND(
namespace hand {
using V = sjk::Vec<float>;
constexpr int64_t W = V::size();
inline V sigmoid(const V& x) { return V(1.f) / (V(1.f) + x.neg().exp()); }
// Calls step(i, n) over [begin, end): a partial vector until `align` is aligned to
// the vector size, whole vectors (streamed = true), then a partial tail.
template <class Step>
inline void loop(int64_t begin, int64_t end, const float* align, Step step) {
  int64_t i = begin;
  const uintptr_t mis = reinterpret_cast<uintptr_t>(align + i) % sizeof(V);
  const int64_t peel = std::min<int64_t>(end - i, int64_t((sizeof(V) - mis) % sizeof(V) / sizeof(float)));
  if (peel > 0) step(i, peel, false), i += peel;
  for (; i + W <= end; i += W) step(i, W, true);
  if (i < end) step(i, end - i, false);
#if defined(__x86_64__)
  _mm_sfence();
#endif
}
inline void put(const V& v, float* p, int64_t n, bool whole) {
  if (whole) sjk::store_stream<float>(v, p);
  else v.store(p, static_cast<int>(n));
}
// Calls kernel(begin, end, p...) with the k-th pointer parameter args[k].data (const
// float* for an input, float* for an output): the entry points below unpack this way.
template <class... P, std::size_t... K>
inline void call(void (*kernel)(int64_t, int64_t, P...), int64_t begin, int64_t end,
                 const stagejit_TensorArg* args, std::index_sequence<K...>) {
  kernel(begin, end, static_cast<P>(args[K].data)...);
}
template <class... P>
inline void call(void (*kernel)(int64_t, int64_t, P...), int64_t begin, int64_t end,
                 const stagejit_TensorArg* args) {
  call(kernel, begin, end, args, std::index_sequence_for<P...>{});
}
static void single(int64_t begin, int64_t end, const float* __restrict a, const float* __restrict b,
                   const float* __restrict c, const float* __restrict g, float* __restrict y, float* __restrict da,
                   float* __restrict db, float* __restrict dc) {
  hand::loop(begin, end, y, [&](int64_t i, int64_t n, bool whole) {
    const V x0 = V::loadu(a + i, n), x1 = V::loadu(b + i, n), x2 = V::loadu(c + i, n), gy = V::loadu(g + i, n);
    const V s = hand::sigmoid(x0), t = sjk::tanh(x0 * x1 + x2);
    const V dp = gy * s * (V(1.f) - t * t);
    const V ds = gy * t;
    hand::put(t * s, y + i, n, whole);
    hand::put(dp, dc + i, n, whole);
    hand::put(dp * x0, db + i, n, whole);
    hand::put(dp * x1 + ds * (V(1.f) - s) * s, da + i, n, whole);
  });
}
static void forward(int64_t begin, int64_t end, const float* __restrict a, const float* __restrict b,
                    const float* __restrict c, float* __restrict y, float* __restrict so, float* __restrict to) {
  hand::loop(begin, end, y, [&](int64_t i, int64_t n, bool whole) {
    const V x0 = V::loadu(a + i, n), x1 = V::loadu(b + i, n), x2 = V::loadu(c + i, n);
    const V s = hand::sigmoid(x0), t = sjk::tanh(x0 * x1 + x2);
    hand::put(t * s, y + i, n, whole);
    hand::put(s, so + i, n, whole);
    hand::put(t, to + i, n, whole);
  });
}
static void backward(int64_t begin, int64_t end, const float* __restrict g, const float* __restrict sp,
                     const float* __restrict tp, const float* __restrict a, const float* __restrict b,
                     float* __restrict da, float* __restrict db, float* __restrict dc) {
  hand::loop(begin, end, da, [&](int64_t i, int64_t n, bool whole) {
    const V gy = V::loadu(g + i, n), s = V::loadu(sp + i, n), t = V::loadu(tp + i, n);
    const V x0 = V::loadu(a + i, n), x1 = V::loadu(b + i, n);
    const V dp = gy * s * (V(1.f) - t * t);
    const V ds = gy * t;
    hand::put(dp, dc + i, n, whole);
    hand::put(dp * x0, db + i, n, whole);
    hand::put(dp * x1 + ds * (V(1.f) - s) * s, da + i, n, whole);
  });
}
}  // namespace hand
// in: a, b, c, gy; out: y, da, db, dc
extern "C" void hand_single(int64_t begin, int64_t end, int32_t, const stagejit_TensorArg* args) {
  hand::call(hand::single, begin, end, args);
}
// in: a, b, c; out: y, s, t
extern "C" void hand_forward(int64_t begin, int64_t end, int32_t, const stagejit_TensorArg* args) {
  hand::call(hand::forward, begin, end, args);
}
// in: gy, s, t, a, b; out: da, db, dc
extern "C" void hand_backward(int64_t begin, int64_t end, int32_t, const stagejit_TensorArg* args) {
  hand::call(hand::backward, begin, end, args);
}
)HAND";

/// Median times (ms) of the variants both tables show.
struct VariantTimes {
  double torch, torch_level, eager, unfused, fused;
};

/// The rows of those variants, with speed-ups over libtorch eager.
void variant_rows(const VariantTimes& t) {
  row("libtorch eager", t.torch, t.torch);
  row("libtorch eager, level field", t.torch_level, t.torch);
  row("stagejit eager", t.eager, t.torch);
  row("stagejit compiled, unfused", t.unfused, t.torch);
  row("stagejit compiled, fused", t.fused, t.torch);
}

/// A hand-written kernel of kHandKernels, compiled by the default CPU backend.
std::shared_ptr<const sj::fusion::CpuKernel> hand_kernel(const char* entry, int inputs, int outputs) {
  sj::fusion::KernelSource src;
  src.source = kHandKernels;
  src.entry = entry;
  src.key.device = sj::fusion::DeviceKind::CPU;
  for (int i = 0; i < inputs; ++i) src.key.inputs.push_back({at::kFloat, 1, true});
  for (int i = 0; i < outputs; ++i) src.key.outputs.push_back({at::kFloat, 1, true});
  return sj::fusion::default_cpu_backend().get(src);
}

/// Runs a hand kernel on `inputs`, writing fresh outputs (from the host cache, as fused
/// kernels' outputs are).
std::vector<at::Tensor> run_hand(const sj::fusion::CpuKernel& k, const std::vector<at::Tensor>& inputs, int outputs) {
  sj::memory::HostCacheScope scope;
  std::vector<at::Tensor> out;
  for (int i = 0; i < outputs; ++i) out.push_back(at::empty(inputs[0].sizes()));
  k.run(sj::fusion::pack_tensor_args(inputs[0].sizes(), inputs, out));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t n = int64_t(1) << 24;
  int reps = 10;
  int fused_only = 0;
  bool print_graph = false;
  std::string device_name = "cpu";
  double min_bandwidth = 0;
  for (int i = 1; i < argc; ++i) {
    const bool has_value = i + 1 < argc;
    if (!std::strcmp(argv[i], "--print-graph")) print_graph = true;
    else if (!std::strcmp(argv[i], "--n") && has_value) n = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--reps") && has_value) reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--fused-only") && has_value) fused_only = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--device") && has_value) device_name = argv[++i];
    else if (!std::strcmp(argv[i], "--min-bandwidth") && has_value) min_bandwidth = std::atof(argv[++i]);
    else {
      std::fprintf(stderr, "usage: %s [--n ELEMENTS] [--reps R] [--print-graph] [--fused-only R] "
                   "[--device cpu|cuda] [--min-bandwidth FRACTION]\n", argv[0]);
      return 1;
    }
  }
  if (n < 1 || reps < 1 || fused_only < 0) {
    std::fprintf(stderr, "fusion: --n and --reps must be positive\n");
    return 1;
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
  const std::string load_before = load_average();
  const at::Device dev = cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  // On CUDA a timed call is `inner` back-to-back calls and one synchronisation.
  const int inner = cuda ? 20 : 1;
  auto median_ms = [&](const std::function<void()>& f, int r, int warmup = 3) {
    return sj::bench::median_ms([&] {
      for (int k = 0; k < inner; ++k) f();
      if (cuda) sj::fusion::cuda_synchronize(0);
    }, r, warmup) / inner;
  };
  at::manual_seed(0);
  at::Tensor a = at::randn({n}).to(dev), b = at::randn({n}).to(dev), c = at::randn({n}).to(dev);
  at::Tensor gy = at::ones({n}).to(dev);

  auto fn = [](const sj::variable_list& in) -> sj::variable_list {
    return {model(in[0], in[1], in[2])};
  };
  auto fused = sj::compile(fn, {.derivatives = 1, .fuse = true});
  auto unfused = sj::compile(fn, {.derivatives = 1, .fuse = false});
  // The forward and its gradients traced together: in = {a, b, c, gy}, out = {y, da, db, dc}.
  auto one_stage = sj::compile([](const sj::variable_list& in) -> sj::variable_list {
    const sj::variable_list x = {in[0], in[1], in[2]};
    sj::Variable y = model(in[0], in[1], in[2]);
    sj::variable_list out = sj::grad({y}, x, {in[3]});
    out.insert(out.begin(), y);
    return out;
  }, {.derivatives = 0, .fuse = true});

  const sj::variable_list in = {sj::Variable(a, true), sj::Variable(b, true), sj::Variable(c, true)};
  const sj::Variable g(gy);
  const sj::variable_list in_step = {in[0], in[1], in[2], g};
  // {da, db, dc, y}, the order of sj_step
  auto one_stage_step = [&] {
    sj::variable_list out = one_stage(in_step);
    return sj::variable_list{out[1], out[2], out[3], out[0]};
  };
  auto sj_step = [&](sj::CompiledFunction& f) {
    auto y = f(in);
    auto grads = sj::grad(y, in, {g});
    grads.push_back(y[0]);
    return grads;
  };
  // The fused step's stages timed apart: stage 0 (the forward, also saving what the
  // backward reads) and stage 1 (sj::grad through the compiled backward).
  auto stage_times = [&](int r) {
    std::vector<double> t0, t1;
    for (int i = 0; i < r + 1; ++i) {
      const auto a0 = std::chrono::steady_clock::now();
      auto y = fused(in);
      const auto a1 = std::chrono::steady_clock::now();
      auto grads = sj::grad(y, in, {g});
      const auto a2 = std::chrono::steady_clock::now();
      if (i == 0) continue;  // warm-up
      t0.push_back(std::chrono::duration<double, std::milli>(a1 - a0).count());
      t1.push_back(std::chrono::duration<double, std::milli>(a2 - a1).count());
    }
    std::sort(t0.begin(), t0.end());
    std::sort(t1.begin(), t1.end());
    return std::make_pair(t0[t0.size() / 2], t1[t1.size() / 2]);
  };
  if (fused_only > 0) {  // for perf record: nothing but the fused forward+backward
    sj_step(fused);
    const double ms = median_ms([&] { sj_step(fused); }, fused_only, 1);
    const auto [s0, s1] = stage_times(fused_only);
    std::printf("fused forward+backward: %.3f ms (median of %d; stage 0 %.3f ms, stage 1 %.3f ms); load "
                "average %s\n", ms, fused_only, s0, s1, load_average().c_str());
    return 0;
  }

  // ---- forward (no input requires grad: stage 0 only)
  const sj::variable_list in_nograd = {sj::Variable(a), sj::Variable(b), sj::Variable(c)};
  const double compile_fwd_ms = sj::bench::once_ms([&] { fused(in_nograd); });
  at::Tensor ref_y = model(a, b, c);
  auto torch_fwd = [&] { torch::NoGradGuard ng; auto y = model(a, b, c); };
  const double fwd_torch = median_ms(torch_fwd, reps);
  const double fwd_torch_level = median_ms([&] {
    sj::memory::HostCacheScope scope;
    torch_fwd();
  }, reps);
  const double fwd_fused = median_ms([&] { auto y = fused(in_nograd); }, reps);
  const double fwd_unfused = median_ms([&] { auto y = unfused(in_nograd); }, reps);
  const double fwd_eager = median_ms([&] {
    sj::NoGradGuard ng;
    auto y = model(in_nograd[0], in_nograd[1], in_nograd[2]);
  }, reps);
  const double fwd_diff = max_rel_diff(fused(in_nograd)[0].data(), ref_y);

  // ---- forward + backward
  const double compile_bwd_ms = sj::bench::once_ms([&] { sj_step(fused); });
  std::vector<torch::Tensor> leaves = {a.detach().requires_grad_(true), b.detach().requires_grad_(true),
                                       c.detach().requires_grad_(true)};
  auto torch_step = [&] {
    auto y = model(leaves[0], leaves[1], leaves[2]);
    auto grads = torch::autograd::grad({y}, leaves, {gy});
    grads.push_back(y.detach());
    return grads;
  };
  auto torch_step_level = [&] {
    sj::memory::HostCacheScope scope;
    return torch_step();
  };
  const double bwd_torch = median_ms([&] { torch_step(); }, reps);
  const double bwd_torch_level = median_ms([&] { torch_step_level(); }, reps);
  const double bwd_fused = median_ms([&] { sj_step(fused); }, reps);
  const double compile_one_stage_ms = sj::bench::once_ms([&] { one_stage_step(); });
  const double bwd_one_stage = median_ms([&] { one_stage_step(); }, reps);
  const double bwd_unfused = median_ms([&] { sj_step(unfused); }, reps);
  const double bwd_eager = median_ms([&] {
    auto y = model(in[0], in[1], in[2]);
    sj::grad({y}, in, {g});
  }, reps);

  // ---- hand-written kernels through the same CPU backend (CPU only)
  std::shared_ptr<const sj::fusion::CpuKernel> k_single, k_forward, k_backward;
  if (!cuda) {
    k_single = hand_kernel("hand_single", 4, 4);
    k_forward = hand_kernel("hand_forward", 3, 3);
    k_backward = hand_kernel("hand_backward", 5, 3);
  }
  auto hand_single = [&] { return run_hand(*k_single, {a, b, c, gy}, 4); };
  auto hand_two = [&] {
    auto f = run_hand(*k_forward, {a, b, c}, 3);
    auto d = run_hand(*k_backward, {gy, f[1], f[2], a, b}, 3);
    return std::vector<at::Tensor>{d[0], d[1], d[2], f[0]};
  };
  double bwd_hand_single = 0, bwd_hand_two = 0, hand_stage0 = 0, hand_stage1 = 0;
  if (!cuda) {
    bwd_hand_single = median_ms([&] { hand_single(); }, reps);
    bwd_hand_two = median_ms([&] { hand_two(); }, reps);
    std::vector<at::Tensor> saved = run_hand(*k_forward, {a, b, c}, 3);
    hand_stage0 = median_ms([&] { run_hand(*k_forward, {a, b, c}, 3); }, reps);
    hand_stage1 = median_ms([&] { run_hand(*k_backward, {gy, saved[1], saved[2], a, b}, 3); }, reps);
  }
  const auto [fused_stage0, fused_stage1] = stage_times(reps);

  // Results: gradients of a, b, c and y against libtorch.
  double bwd_diff = 0, one_stage_diff = 0, hand_diff = 0;
  {
    auto want = torch_step();
    auto got = sj_step(fused);
    const int order[4] = {1, 2, 3, 0};  // hand outputs: y, da, db, dc
    auto got_one = one_stage_step();
    for (int i = 0; i < 4; ++i) {
      bwd_diff = std::max(bwd_diff, max_rel_diff(got[i].data(), want[i]));
      one_stage_diff = std::max(one_stage_diff, max_rel_diff(got_one[i].data(), want[i]));
    }
    if (!cuda) {
      auto single = hand_single();
      auto two = hand_two();
      for (int i = 0; i < 4; ++i) {
        hand_diff = std::max(hand_diff, max_rel_diff(single[order[i]], want[i]));
        hand_diff = std::max(hand_diff, max_rel_diff(two[i], want[i]));
      }
    }
  }

  // ---- page faults per call in steady state (the level field: none for anyone)
  const double pf_torch = cuda ? 0 : faults_per_call([&] { torch_step(); });
  const double pf_torch_level = cuda ? 0 : faults_per_call([&] { torch_step_level(); });
  const double pf_fused = cuda ? 0 : faults_per_call([&] { sj_step(fused); });

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

  int groups = 0, one_stage_groups = 0;
  for (auto* node : fused.graph_for(in)->nodes()) groups += node->is<sj::ir::FusionGroup>();
  for (auto* node : one_stage.graph_for(in_step)->nodes()) one_stage_groups += node->is<sj::ir::FusionGroup>();
  if (print_graph)
    std::printf("%s\none stage:\n%s\n", sj::ir::to_string(*fused.graph_for(in)).c_str(),
                sj::ir::to_string(*one_stage.graph_for(in_step)).c_str());

  const char* blas = std::getenv("OPENBLAS_NUM_THREADS");
  std::printf("bench/fusion: y = tanh(a*b + c) * sigmoid(a), %lld floats on %s, ATen threads %d, "
              "OPENBLAS_NUM_THREADS %s, median of %d\n", static_cast<long long>(n),
              cuda ? ("cuda:0 (" + gpu.name + ")").c_str() : "the CPU", at::get_num_threads(),
              blas ? blas : "unset", reps);
  std::printf("  load average before %s, after %s\n", load_before.c_str(), load_average().c_str());
  std::printf("  first call (trace + compile kernels, or disk-cache hits): forward %.0f ms, "
              "forward+backward %.0f ms (%d fusion groups over both stages), one stage %.0f ms (%d fusion "
              "group%s)\n", compile_fwd_ms, compile_bwd_ms, groups, compile_one_stage_ms, one_stage_groups,
              one_stage_groups == 1 ? "" : "s");
  std::printf(" forward                                      time      vs libtorch\n");
  variant_rows({fwd_torch, fwd_torch_level, fwd_eager, fwd_unfused, fwd_fused});
  row("bandwidth limit (4 arrays)", limit_fwd, fwd_torch);
  std::printf(" forward + backward\n");
  variant_rows({bwd_torch, bwd_torch_level, bwd_eager, bwd_unfused, bwd_fused});
  row("stagejit compiled, fused, one stage", bwd_one_stage, bwd_torch);
  if (!cuda) {
    row("hand-written, one pass", bwd_hand_single, bwd_torch);
    row("hand-written, the stages' two passes", bwd_hand_two, bwd_torch);
  }
  row("bandwidth limit (8 arrays)", limit_bwd, bwd_torch);
  std::printf("  copy bandwidth %.1f GB/s; max relative difference to libtorch: forward %.2g, "
              "gradients %.2g (one stage %.2g), hand-written %.2g\n", copy_bw / 1e9, fwd_diff, bwd_diff,
              one_stage_diff, hand_diff);
  const bool correct = fwd_diff < 1e-5 && bwd_diff < 1e-5 && one_stage_diff < 1e-5 && hand_diff < 1e-5;
  if (!cuda) {
    std::printf("  stages apart: fused stage 0 %.3f ms + stage 1 %.3f ms; hand-written forward %.3f ms + "
                "backward %.3f ms\n", fused_stage0, fused_stage1, hand_stage0, hand_stage1);
    std::printf("  page faults per forward+backward: libtorch %.0f, libtorch on the level field %.0f, "
                "fused %.0f\n", pf_torch, pf_torch_level, pf_fused);
    std::printf("  level field (libtorch reuses freed memory as the compiled stages do): fused forward "
                "%.2fx, forward+backward %.2fx libtorch (one stage %.2fx)\n", fwd_torch_level / fwd_fused,
                bwd_torch_level / bwd_fused, bwd_torch_level / bwd_one_stage);
    std::printf("  share of the bandwidth limit: fused forward %.0f%%, forward+backward %.0f%% (one stage "
                "%.0f%%); hand-written one pass %.0f%%, two passes %.0f%%\n", 100 * limit_fwd / fwd_fused,
                100 * limit_bwd / bwd_fused, 100 * limit_bwd / bwd_one_stage, 100 * limit_bwd / bwd_hand_single,
                100 * limit_bwd / bwd_hand_two);
    std::printf("  the most any kernel moving the 8 arrays at copy bandwidth could show on the level field: "
                "%.2fx libtorch (libtorch on the level field / bandwidth limit)\n", bwd_torch_level / limit_bwd);
    const bool level_ok = pf_torch_level < 1;
    auto met = [](bool ok) { return ok ? "met" : "NOT met"; };
    std::printf("  targets: fused forward >= 4x libtorch (%s); fused forward+backward >= 6x libtorch on the "
                "level field%s: two stages %s, one stage %s; >= 60%% of the bandwidth limit: two stages %s, one "
                "stage %s\n", met(fwd_torch / fwd_fused >= 4), level_ok ? "" : " (but libtorch page-faulted there)",
                met(bwd_torch_level / bwd_fused >= 6), met(bwd_torch_level / bwd_one_stage >= 6),
                met(limit_bwd / bwd_fused >= 0.6), met(limit_bwd / bwd_one_stage >= 0.6));
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

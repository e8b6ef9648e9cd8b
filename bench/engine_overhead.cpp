// Autograd overhead per node: a chain of 1000 elementwise ops on 1-element float tensors,
// forward + backward, stagejit eager vs libtorch eager in the same binary.
// Prints µs per node for each, their ratio, the raw ATen op cost, and the autograd
// overhead per node (fwd+bwd per node minus 2x the raw op cost).
#include <stagejit/stagejit.hpp>
#include <torch/torch.h>

#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdio>

namespace sj = stagejit;

namespace {

constexpr int kChain = 1000;

// The chain alternates mul and add with scalars (each is one elementwise node).
void stagejit_chain() {
  sj::Variable x(at::full({1}, 0.5f), true);
  sj::Variable y = x;
  for (int i = 0; i < kChain; ++i) y = (i % 2 == 0) ? y * 1.0001 : y + 0.0001;
  y.backward(sj::Variable(at::ones({1})));
  benchmark::DoNotOptimize(x.grad().data().data_ptr());
}

void torch_chain() {
  torch::Tensor x = torch::full({1}, 0.5f).requires_grad_(true);
  torch::Tensor y = x;
  for (int i = 0; i < kChain; ++i) y = (i % 2 == 0) ? y * 1.0001 : y + 0.0001;
  y.backward(torch::ones({1}));
  benchmark::DoNotOptimize(x.grad().data_ptr());
}

void raw_chain() {
  at::Tensor y = at::full({1}, 0.5f);
  for (int i = 0; i < kChain; ++i) y = (i % 2 == 0) ? at::mul(y, 1.0001) : at::add(y, 0.0001);
  benchmark::DoNotOptimize(y.data_ptr());
}

void BM_stagejit(benchmark::State& s) { for (auto _ : s) stagejit_chain(); }
void BM_libtorch(benchmark::State& s) { for (auto _ : s) torch_chain(); }
void BM_raw_aten(benchmark::State& s) {
  at::AutoDispatchBelowADInplaceOrView guard;
  for (auto _ : s) raw_chain();
}
BENCHMARK(BM_stagejit)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_libtorch)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_raw_aten)->Unit(benchmark::kMicrosecond);

// Median of `reps` timings of `f`, in µs per node.
template <class F>
double per_node_us(F f, int reps) {
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    auto a = std::chrono::steady_clock::now();
    f();
    auto b = std::chrono::steady_clock::now();
    t.push_back(std::chrono::duration<double, std::micro>(b - a).count() / kChain);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  for (int i = 0; i < 20; ++i) { stagejit_chain(); torch_chain(); raw_chain(); }
  const int reps = 201;
  double sj_us = per_node_us(stagejit_chain, reps);
  double th_us = per_node_us(torch_chain, reps);
  double raw_us;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    raw_us = per_node_us(raw_chain, reps);
  }
  std::printf("\nchain of %d ops on 1-element float tensors, forward + backward (median of %d runs)\n",
              kChain, reps);
  std::printf("  raw ATen op:           %.3f us\n", raw_us);
  std::printf("  stagejit eager:        %.3f us/node  (overhead %.3f us/node)\n", sj_us, sj_us - 2 * raw_us);
  std::printf("  libtorch eager:        %.3f us/node  (overhead %.3f us/node)\n", th_us, th_us - 2 * raw_us);
  std::printf("  ratio stagejit/libtorch: %.2f ; overhead ratio: %.2f\n", sj_us / th_us,
              (sj_us - 2 * raw_us) / (th_us - 2 * raw_us));
  return 0;
}

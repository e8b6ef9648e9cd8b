// The `gpu` suite, the main job's training steps on CUDA tensors (issue 18): the
// Fashion-MNIST MLP step (examples/mlp.hpp) and the Burgers PINN step (examples/pinn/
// burgers.hpp) compiled with fusion on CUDA, against the same steps on libtorch's
// autograd on CUDA: equal losses and gradients (double 1e-10, float 1e-5 relative, as the
// CPU tests), and the time per step of each side printed (medians of interleaved rounds,
// the device synchronised around each step). Compiles everywhere; skipped (reported by
// doctest) unless libtorch has CUDA and a GPU is present (scripts/gpu-check runs it).
#include <stagejit/fusion/cuda_backend.hpp>
#include <stagejit/compiler.hpp>
#include <stagejit/testing/doctest.hpp>

#include "../../examples/mlp.hpp"
#include "../../examples/pinn/burgers.hpp"

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace sj = stagejit;

namespace {

bool no_cuda_tensors() { return !at::hasCUDA() || !sj::fusion::cuda_driver_available(); }

/// max |x - ref| / max |ref|, in double, on the host.
double rel_diff(const at::Tensor& x, const at::Tensor& ref) {
  const at::Tensor a = x.cpu().to(at::kDouble), b = ref.cpu().to(at::kDouble);
  return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item<double>();
}

/// Median milliseconds of `rounds` calls of each of `fns`, interleaved (one call of each
/// per round after one warm-up call of each), the device synchronised around every call.
std::vector<double> median_ms(const std::vector<std::function<void()>>& fns, int rounds) {
  using Clock = std::chrono::steady_clock;
  std::vector<std::vector<double>> ms(fns.size());
  for (const auto& f : fns) f();
  for (int r = 0; r < rounds; ++r)
    for (std::size_t i = 0; i < fns.size(); ++i) {
      sj::fusion::cuda_synchronize(0);
      const auto t0 = Clock::now();
      fns[i]();
      sj::fusion::cuda_synchronize(0);
      ms[i].push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    }
  std::vector<double> med;
  for (auto& v : ms) {
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    med.push_back(v[v.size() / 2]);
  }
  return med;
}

}  // namespace

TEST_SUITE("gpu") {
  TEST_CASE("Fashion-MNIST MLP step on CUDA: compiled with fusion equals libtorch on CUDA" *
            doctest::skip(no_cuda_tensors())) {
    // Batches of random images in [0, 1) and labels: the GPU machine has no dataset, and
    // the step's arithmetic does not depend on what the pixels show.
    const at::TensorOptions gpu = at::TensorOptions().device(at::kCUDA, 0);
    mlp::Params p = mlp::init_params(0);
    for (auto& t : p) t = t.to(gpu);
    auto compiled = sj::compile(mlp::step_fn, {.derivatives = 1});
    auto step_sj = [&](const at::Tensor& x, const at::Tensor& y, mlp::Params& g) {
      sj::variable_list in = {sj::Variable(x), sj::Variable(y)};
      for (const auto& t : p) in.emplace_back(t.detach(), /*requires_grad=*/true);
      const sj::Variable loss = compiled(in)[0];
      g.clear();
      for (const auto& v : sj::grad({loss}, sj::variable_list(in.begin() + 2, in.end()))) g.push_back(v.data());
      return loss.data();
    };
    auto step_torch = [&](const at::Tensor& x, const at::Tensor& y, mlp::Params& g) {
      std::vector<torch::Tensor> w;
      for (const auto& t : p) w.push_back(t.detach().requires_grad_(true));
      auto h1 = torch::relu(torch::addmm(w[1], x, w[0].t()));
      auto h2 = torch::relu(torch::addmm(w[3], h1, w[2].t()));
      auto loss = torch::cross_entropy_loss(torch::addmm(w[5], h2, w[4].t()), y);
      auto gs = torch::autograd::grad({loss}, w);
      g.assign(gs.begin(), gs.end());
      return loss.detach();
    };
    mlp::Sgd sgd{0.05, 0.9, {}};
    at::manual_seed(3);
    for (int step = 0; step < 3; ++step) {  // the later steps run from the compiled cache
      CAPTURE(step);
      const at::Tensor x = at::rand({128, 784}, gpu.dtype(at::kFloat));
      const at::Tensor y = at::randint(0, 10, {128}, gpu.dtype(at::kLong));
      mlp::Params g, g_ref;
      const at::Tensor loss = step_sj(x, y, g), loss_ref = step_torch(x, y, g_ref);
      CHECK(loss.is_cuda());
      CHECK(rel_diff(loss, loss_ref) <= 1e-5);
      REQUIRE(g.size() == g_ref.size());
      for (std::size_t i = 0; i < g.size(); ++i) {
        CAPTURE(i);
        CHECK(g[i].is_cuda());
        CHECK(rel_diff(g[i], g_ref[i]) <= 1e-5);
      }
      sgd.apply(p, g);
    }
    CHECK(compiled.stats().misses == 1);

    const at::Tensor x = at::rand({128, 784}, gpu.dtype(at::kFloat));
    const at::Tensor y = at::randint(0, 10, {128}, gpu.dtype(at::kLong));
    mlp::Params g;
    const auto ms = median_ms({[&] { step_sj(x, y, g); }, [&] { step_torch(x, y, g); }}, 50);
    MESSAGE("Fashion-MNIST MLP step on CUDA, batch 128: compiled ", ms[0], " ms, libtorch ", ms[1],
            " ms, ratio ", ms[1] / ms[0], "x (", 128.0 / ms[0] * 1e3, " images/s compiled)");
  }

  TEST_CASE("Burgers PINN step on CUDA: compiled stages, compiled loss and eager equal libtorch on CUDA" *
            doctest::skip(no_cuda_tensors())) {
    using namespace pinn::burgers;
    const at::Device gpu(at::kCUDA, 0);
    const ReferenceSolution ref = reference_solution(20, 33);
    for (at::ScalarType dtype : {at::kDouble, at::kFloat}) {
      CAPTURE(std::string(at::toString(dtype)));
      const double tol = dtype == at::kFloat ? 1e-5 : 1e-10;
      const TrainingData data = make_training_data(ref, 100, 10000, 1).to(dtype).to(gpu);
      Params p = xavier_init(paper_layers(), 0, dtype);
      for (auto& t : p) t = t.detach().to(gpu).requires_grad_(true);
      Stepper libtorch(Mode::Libtorch, data);
      std::vector<std::unique_ptr<Stepper>> steppers;
      for (Mode m : {Mode::Compiled, Mode::CompileLoss, Mode::Eager})
        steppers.push_back(std::make_unique<Stepper>(m, data));
      Params g_ref;
      const at::Tensor loss_ref = libtorch.step(p, g_ref);
      for (auto& s : steppers) {
        CAPTURE(mode_name(s->mode()));
        for (int call = 0; call < 2; ++call) {  // the second call runs from the cache
          CAPTURE(call);
          Params g;
          const at::Tensor loss = s->step(p, g);
          CHECK(loss.is_cuda());
          CHECK(rel_diff(loss, loss_ref) <= tol);
          REQUIRE(g.size() == p.size());
          for (std::size_t i = 0; i < p.size(); ++i) {
            CAPTURE(i);
            CHECK(g[i].is_cuda());
            CHECK(rel_diff(g[i], g_ref[i]) <= tol);
          }
        }
      }
      Params g;
      std::vector<std::function<void()>> fns;
      for (auto& s : steppers) fns.push_back([&] { s->step(p, g); });
      fns.push_back([&] { libtorch.step(p, g); });
      const auto ms = median_ms(fns, 20);
      MESSAGE("Burgers PINN step on CUDA, N_f = 10000, ", at::toString(dtype), ": compiled ", ms[0],
              " ms (", ms[3] / ms[0], "x libtorch), compile-loss ", ms[1], " ms (", ms[3] / ms[1],
              "x), eager ", ms[2], " ms (", ms[3] / ms[2], "x), libtorch ", ms[3], " ms");
    }
  }
}

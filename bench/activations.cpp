// bench/activations: a PINN residual written as a user writes it, over activations,
// widths and dtypes; how the staged and whole-loss forms compare with libtorch eager off
// the workloads the project was tuned on (issue 32: "other widths, activations, point
// counts and loss terms").
//
// The network u(t, x) = MLP(X), X [N, 2], `depth` hidden layers of `width` units with
// the activation under test, weights scaled by 1/sqrt(fan-in), biases 0.1 N(0, 1). The
// loss: r = u_t + u u_x - 0.01 u_xx, L = mean(r^2) + 0.5 mean(u^2); its gradients in the
// weights are third derivatives of the network. Four forms, each run once per round in
// the order of a balanced Latin square's rows, in one process (one ATen thread, one
// stagejit engine thread):
//
//   libtorch         the step on libtorch's autograd (torch::autograd::grad)
//   staged           the network compiled with 3 derivatives; the user's grad calls and
//                    loss run its stages (stage 1, stage 2, then the joint backward)
//   staged/no-remat  the same with CompileOptions::rematerialize off (later stages read
//                    every earlier-stage value saved instead of recomputing cheap ones)
//   whole loss       the whole loss, inner grads included, compiled with 1 derivative
//
// Every form's gradients are checked against libtorch's first (relative max difference:
// <= 1e-10 in double, <= 1e-4 in float) after the background kernel builds have finished.
// Prints one line per configuration: medians in ms, ratios to libtorch, and how far staged
// trails the whole loss ("lag").
//
// `--activation all` runs tanh, sin, sigmoid, silu, softplus, gelu and elu; `--width`
// and `--dtype` take lists (`--width 20 64 --dtype float double`). Above 128 units or
// under 1 000 points the staged net takes cross-stage gradients (its stages are not
// row-tiled), where no value is recomputed: there the no-remat column repeats the staged one.
#include "bench_util.hpp"

#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <stagejit/fusion/cpu_backend.hpp>
#include <stagejit/stagejit.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace sj = stagejit;

namespace {

const std::vector<std::string> kActivations{"tanh", "sin", "sigmoid", "silu", "softplus", "gelu", "elu"};

// One activation for both autograds: stagejit's free functions and ATen's, by name.
template <class V>
V activate(const std::string& name, const V& h) {
  if (name == "tanh") return tanh(h);
  if (name == "sin") return sin(h);
  if (name == "sigmoid") return sigmoid(h);
  if (name == "silu") return silu(h);
  if (name == "softplus") return softplus(h);
  if (name == "gelu") return gelu(h);
  return elu(h);
}

template <class V>
V mlp(const std::string& act, const V& x, const std::vector<V>& w) {
  V h = x;
  for (std::size_t l = 0; l + 2 < w.size(); l += 2) h = activate(act, mm(h, w[l]) + w[l + 1]);
  return mm(h, w[w.size() - 2]) + w.back();
}

// r = u_t + u u_x - 0.01 u_xx, L = mean(r^2) + 0.5 mean(u^2); `d(y, x)` is
// grad(y, x, ones_like(y), create_graph).
template <class V, class D>
V residual_loss(const V& x, const V& u, D d) {
  V du = d(u, x);
  V ut = narrow(du, 1, 0, 1), ux = narrow(du, 1, 1, 1);
  V uxx = narrow(d(ux, x), 1, 1, 1);
  V r = ut + u * ux - 0.01 * uxx;
  return mean(r * r) + 0.5 * mean(u * u);
}

struct Result {
  double libtorch = 0, staged = 0, staged_no_remat = 0, whole = 0;
  double max_diff = 0;        // the largest over the three stagejit forms
  std::string failed;         // the forms over the tolerance, if any
};

Result run(const std::string& act, int64_t width, int64_t depth, int64_t n, at::ScalarType dt, int rounds) {
  at::manual_seed(0);
  std::vector<int64_t> sizes{2};
  for (int64_t i = 0; i < depth; ++i) sizes.push_back(width);
  sizes.push_back(1);
  std::vector<at::Tensor> weights;
  for (std::size_t i = 0; i + 1 < sizes.size(); ++i) {
    weights.push_back(at::randn({sizes[i], sizes[i + 1]}, dt) / std::sqrt(double(sizes[i])));
    weights.push_back(at::randn({sizes[i + 1]}, dt) * 0.1);
  }
  const at::Tensor X = at::rand({n, 2}, dt);

  auto sj_d = [](const sj::Variable& y, const sj::Variable& x) {
    return sj::grad(sj::variable_list{y}, sj::variable_list{x}, sj::variable_list{sj::ones_like(y)}, true)[0];
  };
  auto net = [act](const sj::variable_list& in) {
    return sj::variable_list{mlp<sj::Variable>(act, in[0], sj::variable_list(in.begin() + 1, in.end()))};
  };
  sj::CompiledFunction staged_net = sj::compile(net, {.derivatives = 3});
  sj::CompiledFunction staged_net_no_remat = sj::compile(net, {.derivatives = 3, .rematerialize = false});
  sj::CompiledFunction whole = sj::compile(
      [&](const sj::variable_list& in) {
        sj::variable_list w(in.begin() + 1, in.end());
        sj::Variable loss = residual_loss(in[0], mlp<sj::Variable>(act, in[0], w), sj_d);
        sj::variable_list out{loss};
        for (const sj::Variable& g : sj::grad(sj::variable_list{loss}, w)) out.push_back(g);
        return out;
      },
      {.derivatives = 1});
  auto inputs = [&] {
    sj::variable_list in{sj::Variable(X, true)};
    for (const at::Tensor& w : weights) in.emplace_back(w, true);
    return in;
  };
  auto staged_step = [&](sj::CompiledFunction& f) {
    sj::variable_list in = inputs();
    sj::Variable u = f(in)[0];
    sj::Variable loss = residual_loss(in[0], u, sj_d);
    std::vector<at::Tensor> g;
    for (const sj::Variable& v : sj::grad(sj::variable_list{loss}, sj::variable_list(in.begin() + 1, in.end())))
      g.push_back(v.data());
    return g;
  };
  auto whole_step = [&] {
    sj::variable_list out = whole(inputs());
    std::vector<at::Tensor> g;
    for (std::size_t i = 1; i < out.size(); ++i) g.push_back(out[i].data());
    return g;
  };
  // libtorch's leaves, made once as stagejit's tensors are (autograd::grad does not
  // accumulate into them, so every step starts alike).
  std::vector<torch::Tensor> torch_w;
  for (const at::Tensor& t : weights) torch_w.push_back(t.detach().clone().requires_grad_(true));
  const torch::Tensor torch_x = X.detach().clone().requires_grad_(true);
  auto libtorch_step = [&] {
    const std::vector<torch::Tensor>& w = torch_w;
    const torch::Tensor& x = torch_x;
    auto d = [](const torch::Tensor& y, const torch::Tensor& v) {
      return torch::autograd::grad({y}, {v}, {torch::ones_like(y)}, true, true)[0];
    };
    torch::Tensor loss = residual_loss(x, mlp<torch::Tensor>(act, x, w), d);
    return torch::autograd::grad({loss}, w);
  };

  // First calls and two more (the third runs the backward stages ahead: Note [Anticipated
  // stages]), then the background kernel builds, then the check.
  std::function<std::vector<at::Tensor>()> forms[] = {[&] { return staged_step(staged_net); },
                                                      [&] { return staged_step(staged_net_no_remat); },
                                                      whole_step};
  for (int k = 0; k < 3; ++k)
    for (auto& f : forms) f();
  sj::fusion::default_cpu_backend().wait_for_prefetches();
  Result r;
  const std::vector<torch::Tensor> ref = libtorch_step();
  const char* form_names[] = {"staged", "staged/no-remat", "whole loss"};
  const double tolerance = dt == at::kDouble ? 1e-10 : 1e-4;
  for (std::size_t k = 0; k < 3; ++k) {
    const std::vector<at::Tensor> g = forms[k]();
    double diff = 0;
    for (std::size_t i = 0; i < g.size(); ++i)
      diff = std::max(diff, sj::bench::max_rel_diff(g[i].to(at::kDouble), ref[i].to(at::kDouble)));
    if (!(diff <= tolerance)) r.failed += std::string(r.failed.empty() ? "" : ", ") + form_names[k];
    r.max_diff = std::max(r.max_diff, diff);
  }
  std::vector<double> t[4];
  auto timed = [](const std::function<void()>& f) { return sj::bench::once_ms(f); };
  for (int k = 0; k < 2; ++k) {  // warm-up rounds
    libtorch_step();
    for (auto& f : forms) f();
  }
  // Each round runs the four forms in the order of one row of a balanced Latin square, the
  // rows taken in turn: over four rounds every form runs once in each position and follows
  // each other form exactly once (the step before leaves the caches and the allocator in
  // its own state), and drifts of the machine shift every form alike.
  static constexpr int kOrder[4][4] = {{0, 1, 3, 2}, {1, 2, 0, 3}, {2, 3, 1, 0}, {3, 0, 2, 1}};
  const std::function<void()> steps[4] = {[&] { libtorch_step(); }, [&] { forms[0](); }, [&] { forms[1](); },
                                          [&] { forms[2](); }};
  for (int k = 0; k < rounds; ++k)
    for (int m : kOrder[k % 4]) t[m].push_back(timed(steps[m]));
  auto median = [](std::vector<double>& v) {
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return v[v.size() / 2];
  };
  r.libtorch = median(t[0]);
  r.staged = median(t[1]);
  r.staged_no_remat = median(t[2]);
  r.whole = median(t[3]);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"A user-written PINN residual over activations, widths and dtypes: libtorch eager, staged, "
               "staged without rematerialisation and the whole loss, interleaved in one process"};
  std::vector<std::string> activations{"all"};
  std::vector<int64_t> widths{20, 64};
  std::vector<std::string> dtypes{"float"};
  int64_t depth = 4, points = 4000;
  int rounds = 12;
  std::vector<std::string> choices = kActivations;
  choices.push_back("all");
  app.add_option("--activation", activations, "Activations (or all)")->capture_default_str()->check(CLI::IsMember(choices));
  app.add_option("--width", widths, "Hidden widths (above 128, the staged net takes cross-stage gradients: no-remat repeats staged)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t(1), int64_t(1024)));
  app.add_option("--depth", depth, "Hidden layers")->capture_default_str()->check(CLI::Range(int64_t(1), int64_t(32)));
  app.add_option("--points", points, "Collocation points N (under 1 000, the staged net takes cross-stage gradients)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t(16), int64_t(1) << 22));
  app.add_option("--dtype", dtypes, "float and/or double")->capture_default_str()->check(CLI::IsMember({"float", "double"}));
  app.add_option("--rounds", rounds, "Timed rounds")->capture_default_str()->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  if (std::find(activations.begin(), activations.end(), "all") != activations.end()) activations = kActivations;

  at::set_num_threads(1);
  sj::engine::set_num_threads(1);
  std::printf("ATen threads 1, stagejit engine threads 1; %d rounds; depth %ld, %ld points; ms per step (ratio to "
              "libtorch); lag: staged over whole loss - 1\n",
              rounds, long(depth), long(points));
  std::printf("%-9s %5s %-6s %9s %16s %16s %16s %7s %8s\n", "act", "width", "dtype", "libtorch", "staged",
              "staged/no-remat", "whole loss", "lag", "max diff");
  bool ok = true;
  for (const std::string& d : dtypes)
    for (int64_t w : widths)
      for (const std::string& a : activations) {
        const at::ScalarType dt = d == "double" ? at::kDouble : at::kFloat;
        const Result r = run(a, w, depth, points, dt, rounds);
        const bool pass = r.failed.empty();
        ok = ok && pass;
        std::printf("%-9s %5ld %-6s %9.2f %8.2f (%4.2fx) %8.2f (%4.2fx) %8.2f (%4.2fx) %+6.0f%% %8.1e%s\n", a.c_str(),
                    long(w), d.c_str(), r.libtorch, r.staged, r.libtorch / r.staged, r.staged_no_remat,
                    r.libtorch / r.staged_no_remat, r.whole, r.libtorch / r.whole, 100.0 * (r.staged / r.whole - 1),
                    r.max_diff, pass ? "" : ("  FAILED: " + r.failed).c_str());
        std::fflush(stdout);
      }
  std::printf("check against libtorch: %s\n", ok ? "passed" : "FAILED");
  return ok ? 0 : 1;
}

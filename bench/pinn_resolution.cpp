// bench/pinn_resolution: can a float32 evaluation of the Burgers PINN loss still see the
// descent that exists at given weights? The question behind `burgers_pinn --paper` in
// float: L-BFGS stops there when its line search finds no lower float loss (issue 14).
//
// At the weights of a file written by `burgers_pinn --save-weights` (double), it
// evaluates the loss and its gradient in the parameters
//   - in double through libtorch (the oracle),
//   - in float through stagejit's staged compiled step and through libtorch,
// and prints:
//   - each float loss's difference from the double loss at the same float-rounded
//     weights and points (the evaluation's rounding, nothing else: the double oracle
//     reads the float training data widened back to double) and each float gradient's
//     relative error and cosine against the double one;
//   - a line search by hand along the double gradient, w - t g for t from 1e-5 to 1: the
//     loss change from t = 0 in double and in both float evaluations.
// Where the largest decrease along the gradient in double is smaller than a float
// evaluation's rounding of the loss, no line search that compares such float losses can
// find it. The rounding is one sample, at t = 0; where an optimiser chose the weights
// by comparing one evaluation's losses, that evaluation's rounding there is biased
// (bench/pinn.md), so both are printed and the verdict takes the smaller.
//
// The points are not stored with the weights: --seed, --collocation and --boundary must
// be those of the run that wrote them (a mismatch cannot be detected; the losses are then
// of other points). Run with OPENBLAS_NUM_THREADS=1 or --threads 1 (the default), which
// also sets OpenBLAS's threads.
//
// Options: --weights FILE (required), --seed S, --collocation N, --boundary N,
// --threads (ATen and OpenBLAS threads, default 1).
#include "../examples/cli.hpp"
#include "../examples/pinn/burgers.hpp"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace sj = stagejit;
using namespace pinn::burgers;

namespace {

/// The weights `w - t * dir` (dir flat, in the order of w) rounded to `dtype`.
Params shifted(const Params& w, const at::Tensor& dir, double t, at::ScalarType dtype) {
  Params p;
  int64_t offset = 0;
  for (const auto& x : w) {
    at::Tensor v = x.detach().clone();
    if (dir.defined() && t != 0) v.sub_(dir.narrow(0, offset, x.numel()).view(x.sizes()), t);
    offset += x.numel();
    p.push_back(v.to(dtype));
  }
  return p;
}

at::Tensor flat(const Params& g) {
  std::vector<at::Tensor> parts;
  for (const auto& x : g) parts.push_back(x.reshape(-1).to(at::kDouble));
  return at::cat(parts);
}

struct Eval {
  double loss;
  at::Tensor grad;  // flat, double
};

Eval evaluate(Stepper& s, const Params& p) {
  Params g;
  const double loss = s.step(p, g).item<double>();
  return {loss, flat(g)};
}

}  // namespace

int main(int argc, char** argv) {
  std::string weights;
  uint64_t seed = 0;
  int64_t n_f = 10000, n_u = 100;
  int threads = 1;
  CLI::App app{"At weights written by burgers_pinn --save-weights: the float32 loss's rounding against "
               "the descent left along the gradient (double oracle)."};
  app.add_option("--weights", weights, "Weights file of burgers_pinn --save-weights")->required()
      ->check(CLI::ExistingFile);
  app.add_option("--seed", seed, "The --seed of the run that wrote the weights (its points)")
      ->capture_default_str();
  app.add_option("--collocation", n_f, "The --collocation of that run")->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--boundary", n_u, "The --boundary (N_u) of that run")->capture_default_str()
      ->check(CLI::Range(int64_t(1), int64_t(2 * kGridT + kGridX)));
  app.add_option("--threads", threads, "ATen and OpenBLAS threads")->capture_default_str()
      ->check(CLI::Range(1, 256));
  if (auto status = stagejit_examples::parse_command_line(app, argc, argv)) return *status;
  at::set_num_threads(threads);
  stagejit_examples::set_blas_threads(threads);

  try {
    std::vector<at::Tensor> loaded;
    torch::load(loaded, weights);
    const auto layers = paper_layers();
    if (loaded.size() != 2 * (layers.size() - 1))
      throw std::runtime_error("expected " + std::to_string(2 * (layers.size() - 1)) +
                               " tensors (W1, b1, ...) in " + weights + ", got " + std::to_string(loaded.size()));
    Params w;
    for (std::size_t i = 0; i < loaded.size(); ++i) {
      const int64_t l = int64_t(i / 2);
      const std::vector<int64_t> want = i % 2 == 0 ? std::vector<int64_t>{layers[l], layers[l + 1]}
                                                   : std::vector<int64_t>{1, layers[l + 1]};
      if (loaded[i].sizes() != at::IntArrayRef(want))
        throw std::runtime_error("tensor " + std::to_string(i) + " of " + weights + " has shape " +
                                 c10::str(loaded[i].sizes()) + ", expected " + c10::str(at::IntArrayRef(want)));
      if (!at::isfinite(loaded[i]).all().item<bool>())
        throw std::runtime_error("tensor " + std::to_string(i) + " of " + weights + " is not finite");
      w.push_back(loaded[i].to(at::kDouble));
    }
    const ReferenceSolution ref = reference_solution();
    const TrainingData d64 = make_training_data(ref, n_u, n_f, seed + 1).to(at::kDouble);
    const TrainingData d32 = d64.to(at::kFloat);
    // The oracle reads the float points and data widened back, so that only the
    // evaluation's precision differs.
    const TrainingData d32_in_double = d32.to(at::kDouble);
    Stepper oracle(Mode::Libtorch, d32_in_double), staged(Mode::Compiled, d32), torch32(Mode::Libtorch, d32);

    // The float evaluations see the weights rounded to float; so does the double one
    // here, so that the differences are the evaluations' rounding alone.
    const Params w32 = shifted(w, {}, 0, at::kFloat);
    Params w32_in_double;
    for (const auto& x : w32) w32_in_double.push_back(x.to(at::kDouble));
    const Eval d = evaluate(oracle, w32_in_double);
    const Eval s = evaluate(staged, w32);
    const Eval l = evaluate(torch32, w32);
    auto cosine = [](const at::Tensor& a, const at::Tensor& b) {
      return (a.dot(b) / (a.norm() * b.norm())).item<double>();
    };
    auto rel = [](const at::Tensor& a, const at::Tensor& b) { return ((a - b).norm() / b.norm()).item<double>(); };
    std::printf("bench/pinn_resolution: %s (%lld parameters), seed %llu, N_f %lld, N_u %lld, relative L2 "
                "error %.4e\n", weights.c_str(), (long long)d.grad.numel(), (unsigned long long)seed,
                (long long)n_f, (long long)n_u, relative_l2_error(w, d64));
    std::printf("  loss in double           %.9e\n", d.loss);
    std::printf("  float, staged compiled   %.9e  (%+.2e, %+.1e relative)\n", s.loss, s.loss - d.loss,
                (s.loss - d.loss) / d.loss);
    std::printf("  float, libtorch          %.9e  (%+.2e, %+.1e relative)\n", l.loss, l.loss - d.loss,
                (l.loss - d.loss) / d.loss);
    std::printf("  gradient: |g| %.3e in double; float staged compiled: relative error %.2e, cosine %.6f; "
                "float libtorch: %.2e, %.6f\n", d.grad.norm().item<double>(), rel(s.grad, d.grad),
                cosine(s.grad, d.grad), rel(l.grad, d.grad), cosine(l.grad, d.grad));

    // The line search by hand: along the double gradient at the weights as saved.
    const Eval d0 = evaluate(oracle, w);
    std::printf("  along -g (double gradient at the saved weights): loss change from t = 0\n");
    std::printf("  %8s %14s %16s %16s\n", "t", "double", "float staged", "float libtorch");
    const double steps[] = {1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0};
    double best = 0, best_t = 0;
    for (double t : steps) {
      Params g;
      const double dd = oracle.step(shifted(w, d0.grad, t, at::kDouble), g).item<double>() - d0.loss;
      const double ds = staged.step(shifted(w, d0.grad, t, at::kFloat), g).item<double>() - s.loss;
      const double dl = torch32.step(shifted(w, d0.grad, t, at::kFloat), g).item<double>() - l.loss;
      std::printf("  %8.0e %+14.4e %+16.4e %+16.4e\n", t, dd, ds, dl);
      if (dd < best) best = dd, best_t = t;
    }
    if (best == 0) {
      std::printf("  no decrease in double at any t of the grid: nothing for a line search to find\n");
      return 0;
    }
    const double r_staged = std::abs(s.loss - d.loss), r_torch = std::abs(l.loss - d.loss);
    const double rounding = std::min(r_staged, r_torch);
    std::printf("  largest decrease in double: %.3e (t = %.0e%s); float rounding of the loss at t = 0: staged "
                "%.3e (%.2gx the decrease), libtorch %.3e (%.2gx)\n", -best, best_t,
                best_t == steps[std::size(steps) - 1] ? ", the grid's end: it may go on" : "", r_staged,
                r_staged / -best, r_torch, r_torch / -best);
    std::printf("  %s\n", -best < rounding
                              ? "below both float evaluations' rounding of the loss: a line search comparing their "
                                "losses cannot find this descent"
                              : "above a float evaluation's rounding of the loss: a float line search can still "
                                "descend here");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}

#pragma once
// The continuous-time physics-informed neural network (PINN) for the viscous Burgers
// equation of Raissi, Perdikaris & Karniadakis, "Physics-informed neural networks",
// J. Comput. Phys. 378 (2019), section 3.1 (issue 14):
//
//     u_t + u u_x - nu u_xx = 0,   x in [-1, 1], t in [0, 1],   nu = 0.01 / pi,
//     u(0, x) = -sin(pi x),   u(t, -1) = u(t, 1) = 0.
//
// A network u(t, x) (2-20x8-1, tanh) is trained on
//
//     loss = MSE_u + MSE_f,
//     MSE_u = mean over the N_u initial/boundary points of (u(t, x) - u_data)^2,
//     MSE_f = mean over the N_f collocation points of f^2,  f = u_t + u u_x - nu u_xx,
//
// where u_t, u_x, u_xx are derivatives of the network with respect to its input. The
// gradient of the loss with respect to the weights is thus a third derivative of the
// network. This header holds what the example (examples/burgers_pinn.cpp), the benchmark
// (bench/pinn.cpp) and the test (test/examples/pinn_test.cpp) share: the reference
// solution, the training data, the network, and the loss-and-gradient step in four
// modes (staged compiled network, compiled loss, stagejit eager, libtorch).
//
// Not part of the library.
#include <stagejit/stagejit.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace pinn::burgers {

namespace sj = stagejit;

inline constexpr double kPi = 3.14159265358979323846;
/// The viscosity of section 3.1.
inline constexpr double kNu = 0.01 / kPi;
/// The domain: t in [0, 1], x in [-1, 1]; inputs are stored as (t, x) columns.
inline constexpr double kTMin = 0, kTMax = 1, kXMin = -1, kXMax = 1;
/// The paper's evaluation grid (the `burgers_shock.mat` file of the paper's code): 100
/// times (linspace 0..1) by 256 positions (linspace -1..1).
inline constexpr int64_t kGridT = 100, kGridX = 256;

// ------------------------------------------------------------------ reference solution

/// Quadrature points of the Cole-Hopf integrals (trapezoid rule on s in [-kQuadS, kQuadS]).
inline constexpr int kQuadDefault = 2000;
/// The integrands carry exp(-s^2) times a factor between exp(-1/(2 pi nu)) = exp(-50) and
/// exp(50) relative to its peak, so |s| > 12 contributes below exp(-144 + 100) ~ 1e-19.
inline constexpr double kQuadS = 12;

/// The exact solution by the Cole-Hopf transformation (Basdevant et al., Comput. Fluids
/// 14 (1986), the reference used for the paper's data):
///
///   u(t, x) = -int sin(pi (x - eta)) F(x - eta) G(eta) d eta / int F(x - eta) G(eta) d eta,
///   F(y) = exp(-cos(pi y) / (2 pi nu)),  G(eta) = exp(-eta^2 / (4 nu t)).
///
/// Substituting eta = sqrt(4 nu t) s makes the Gaussian exp(-s^2) whatever t; the
/// exponent E(s) = -s^2 - cos(pi (x - eta)) / (2 pi nu) spans about +-150, so both sums
/// are scaled by exp(-max E) (log-sum-exp) before exponentiation. The trapezoid rule on
/// [-12, 12] with `n` intervals converges spectrally for this smooth, rapidly decaying
/// integrand (Gauss-Hermite rules of high order lose accuracy on its narrow peak when t
/// is large: the peak of F is not where the Hermite nodes are dense). t = 0 returns the
/// initial condition. Double precision.
inline double exact_solution(double t, double x, int n = kQuadDefault) {
  if (t <= 0) return -std::sin(kPi * x);
  const double c = std::sqrt(4 * kNu * t);
  const double h = 2 * kQuadS / n;
  const double k = 1 / (2 * kPi * kNu);
  auto exponent = [&](double s) { return -s * s - k * std::cos(kPi * (x - c * s)); };
  double e_max = -std::numeric_limits<double>::infinity();
  for (int i = 0; i <= n; ++i) e_max = std::max(e_max, exponent(-kQuadS + i * h));
  double num = 0, den = 0;
  for (int i = 0; i <= n; ++i) {
    const double s = -kQuadS + i * h;
    const double w = (i == 0 || i == n ? 0.5 : 1.0) * std::exp(exponent(s) - e_max);
    num += w * std::sin(kPi * (x - c * s));
    den += w;
  }
  return -num / den;
}

/// The evaluation grid and the exact solution on it: t [nt], x [nx], u [nt, nx] (row i is
/// time t[i]) and the (t, x) pairs [nt * nx, 2] in the same row-major order. Double.
struct ReferenceSolution {
  at::Tensor t, x, u, points;
};

inline ReferenceSolution reference_solution(int64_t nt = kGridT, int64_t nx = kGridX,
                                            int n_quad = kQuadDefault) {
  ReferenceSolution r;
  r.t = at::linspace(kTMin, kTMax, nt, at::kDouble);
  r.x = at::linspace(kXMin, kXMax, nx, at::kDouble);
  r.u = at::empty({nt, nx}, at::kDouble);
  auto t = r.t.accessor<double, 1>();
  auto x = r.x.accessor<double, 1>();
  auto u = r.u.accessor<double, 2>();
  at::parallel_for(0, nt, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t j = 0; j < nx; ++j) u[i][j] = exact_solution(t[i], x[j], n_quad);
  });
  auto mesh = at::meshgrid({r.t, r.x}, "ij");
  r.points = at::stack({mesh[0].reshape({-1}), mesh[1].reshape({-1})}, 1);
  return r;
}

// ------------------------------------------------------------------ training data

/// The training set of section 3.1: N_u initial/boundary points with their data u, N_f
/// collocation points, and the affine map of (t, x) onto [-1, 1]^2 applied at the network
/// input (the paper's `H = 2 (X - lb) / (ub - lb) - 1`): H = X * input_scale + input_shift.
struct TrainingData {
  at::Tensor x_u;    // [N_u, 2] (t, x) on t = 0 or x = +-1
  at::Tensor u_u;    // [N_u, 1]
  at::Tensor x_f;    // [N_f, 2] (t, x) collocation points
  at::Tensor input_scale, input_shift;  // [2]
  at::Tensor x_star;  // [nt * nx, 2] the evaluation grid's points
  at::Tensor u_star;  // [nt * nx, 1] the exact solution there (double)

  TrainingData to(at::ScalarType dtype) const {
    return {x_u.to(dtype), u_u.to(dtype), x_f.to(dtype), input_scale.to(dtype),
            input_shift.to(dtype), x_star.to(dtype), u_star};
  }
  /// Every tensor on `device` (the GPU check runs the step on CUDA).
  TrainingData to(at::Device device) const {
    return {x_u.to(device), u_u.to(device), x_f.to(device), input_scale.to(device),
            input_shift.to(device), x_star.to(device), u_star.to(device)};
  }
};

/// Latin hypercube sample of n points in [0, 1]^d: each coordinate takes one point from
/// each of n equal strata (a random permutation of the strata, a uniform offset within
/// each), as pyDOE's `lhs(d, n)` of the paper's code does.
inline at::Tensor latin_hypercube(int64_t n, int64_t d, std::mt19937_64& rng) {
  at::Tensor out = at::empty({n, d}, at::kDouble);
  auto a = out.accessor<double, 2>();
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  std::vector<int64_t> strata(static_cast<std::size_t>(n));
  for (int64_t j = 0; j < d; ++j) {
    std::iota(strata.begin(), strata.end(), 0);
    std::shuffle(strata.begin(), strata.end(), rng);
    for (int64_t i = 0; i < n; ++i)
      a[i][j] = (double(strata[std::size_t(i)]) + uniform(rng)) / double(n);
  }
  return out;
}

/// As the paper's code: the N_u points are drawn without replacement from the grid's
/// initial line (t = 0, 256 x) and two boundaries (x = -1 and x = 1, 100 t each), with the
/// reference values there as data; the N_f collocation points are a Latin hypercube
/// sample of the domain. (The paper's code also appends the N_u points to the collocation
/// set; here the collocation set is exactly the N_f sampled points.) Double precision.
inline TrainingData make_training_data(const ReferenceSolution& ref, int64_t n_u, int64_t n_f,
                                       uint64_t seed) {
  const int64_t nt = ref.t.size(0), nx = ref.x.size(0);
  // Candidates: (t = 0, x_j) for all j, (t_i, x = -1), (t_i, x = 1) for all i.
  at::Tensor cand = at::cat({at::stack({at::zeros({nx}, at::kDouble), ref.x}, 1),
                             at::stack({ref.t, at::full({nt}, kXMin, at::kDouble)}, 1),
                             at::stack({ref.t, at::full({nt}, kXMax, at::kDouble)}, 1)});
  at::Tensor cand_u = at::cat({ref.u.select(0, 0), ref.u.select(1, 0), ref.u.select(1, nx - 1)});
  std::mt19937_64 rng(seed);
  std::vector<int64_t> idx(static_cast<std::size_t>(cand.size(0)));
  std::iota(idx.begin(), idx.end(), 0);
  std::shuffle(idx.begin(), idx.end(), rng);
  idx.resize(static_cast<std::size_t>(std::min<int64_t>(n_u, cand.size(0))));
  at::Tensor pick = at::tensor(idx, at::kLong);

  TrainingData d;
  d.x_u = cand.index_select(0, pick).contiguous();
  d.u_u = cand_u.index_select(0, pick).unsqueeze(1).contiguous();
  const at::Tensor lb = at::tensor({kTMin, kXMin}, at::kDouble);
  const at::Tensor ub = at::tensor({kTMax, kXMax}, at::kDouble);
  d.x_f = (lb + (ub - lb) * latin_hypercube(n_f, 2, rng)).contiguous();
  d.input_scale = 2 / (ub - lb);
  d.input_shift = -2 * lb / (ub - lb) - 1;
  d.x_star = ref.points;
  d.u_star = ref.u.reshape({-1, 1});
  return d;
}

// ------------------------------------------------------------------ the network

/// W1, b1, ..., W9, b9 with W_l [fan_in, fan_out] (H W + b, as the paper's code) and b_l
/// [1, fan_out].
using Params = std::vector<at::Tensor>;

/// The paper's layer sizes: input (t, x), 8 hidden layers of 20 tanh units, output u.
inline std::vector<int64_t> paper_layers() { return {2, 20, 20, 20, 20, 20, 20, 20, 20, 1}; }

/// Xavier initialisation as the paper's code: Glorot *normal*, standard deviation
/// sqrt(2 / (fan_in + fan_out)), truncated at two standard deviations (TensorFlow's
/// truncated_normal: redrawn until inside), biases zero. Drawn in double from `seed`,
/// then converted, so float and double runs start from the same weights (rounded).
/// The tensors are leaves requiring grad (the optimisers' parameters).
inline Params xavier_init(const std::vector<int64_t>& layers, uint64_t seed, at::ScalarType dtype) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  Params p;
  for (std::size_t l = 0; l + 1 < layers.size(); ++l) {
    const int64_t fan_in = layers[l], fan_out = layers[l + 1];
    const double std_dev = std::sqrt(2.0 / double(fan_in + fan_out));
    at::Tensor w = at::empty({fan_in, fan_out}, at::kDouble);
    double* wp = w.data_ptr<double>();
    for (int64_t i = 0; i < w.numel(); ++i) {
      double z;
      do z = normal(rng);
      while (std::abs(z) > 2);
      wp[i] = z * std_dev;
    }
    p.push_back(w.to(dtype).requires_grad_(true));
    p.push_back(at::zeros({1, fan_out}, dtype).requires_grad_(true));
  }
  return p;
}

/// u(X) for X [N, 2] = (t, x): H = X * input_scale + input_shift (onto [-1, 1]^2), then
/// tanh(H W + b) for every hidden layer and a linear output layer. Generic over
/// sj::Variable and torch::Tensor (the ops are found by argument-dependent lookup).
template <class V>
V mlp(const V& x, const V& input_scale, const V& input_shift, std::span<const V> params) {
  V h = x * input_scale + input_shift;
  const std::size_t layers = params.size() / 2;
  for (std::size_t l = 0; l + 1 < layers; ++l) h = tanh(addmm(params[2 * l + 1], h, params[2 * l]));
  return addmm(params[2 * layers - 1], h, params[2 * layers - 2]);
}

/// The PINN loss MSE_u + MSE_f (section 3.1, equations (3)-(5)). `net(X)` evaluates u;
/// `grad_sum(y, X)` is d(sum y)/dX with a graph (create_graph), so that the result can be
/// differentiated again. Derivatives: (u_t, u_x) = grad_sum(u, X_f); u_xx = column x of
/// grad_sum(u_x, X_f). Generic over sj::Variable and torch::Tensor.
template <class V, class Net, class GradSum>
V pinn_loss(const Net& net, const GradSum& grad_sum, const V& x_f, const V& x_u, const V& u_u) {
  const V err_u = net(x_u) - u_u;
  const V mse_u = mean(err_u * err_u);
  const V u = net(x_f);
  const V du = grad_sum(u, x_f);  // [N_f, 2]: (u_t, u_x)
  const V u_t = narrow(du, 1, 0, 1);
  const V u_x = narrow(du, 1, 1, 1);
  const V u_xx = narrow(grad_sum(u_x, x_f), 1, 1, 1);
  const V f = u_t + u * u_x - u_xx * kNu;
  return mse_u + mean(f * f);
}

/// d(sum y)/dx with a graph, through stagejit (eager, or the compiled stages when y comes
/// from a compiled function) and through libtorch.
inline sj::Variable grad_sum(const sj::Variable& y, const sj::Variable& x) {
  return sj::grad({y}, {x}, {sj::Variable(at::ones_like(y.data()))}, /*create_graph=*/true)[0];
}
inline torch::Tensor grad_sum(const torch::Tensor& y, const torch::Tensor& x) {
  return torch::autograd::grad({y}, {x}, {torch::ones_like(y)}, /*retain_graph=*/true,
                               /*create_graph=*/true)[0];
}

/// u at the points X [N, 2] without autograd (ATen), for the error and the plot.
inline at::Tensor predict(const Params& p, const TrainingData& d, const at::Tensor& x) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> w;
  for (const auto& t : p) w.push_back(t.detach());
  return mlp<at::Tensor>(x, d.input_scale, d.input_shift, w);
}

/// ||u_pred - u_exact||_2 / ||u_exact||_2 over the evaluation grid (the paper's error).
inline double relative_l2_error(const Params& p, const TrainingData& d) {
  at::Tensor u = predict(p, d, d.x_star).to(at::kDouble);
  return ((u - d.u_star).norm() / d.u_star.norm()).item<double>();
}

// ------------------------------------------------------------------ the step, four ways

enum class Mode {
  Compiled,     // the network compiled with 3 derivatives; the loss's grads run its stages
  CompileLoss,  // the whole loss (with its inner grads) compiled with 1 derivative
  Eager,        // the same code as Compiled on stagejit's eager autograd
  Libtorch,     // the same code on libtorch's autograd
};

inline const char* mode_name(Mode m) {
  switch (m) {
    case Mode::Compiled: return "compiled";
    case Mode::CompileLoss: return "compile-loss";
    case Mode::Eager: return "eager";
    case Mode::Libtorch: return "libtorch";
  }
  return "?";
}

/// Computes the loss and its gradients with respect to the parameters in one of the four
/// modes, on fixed training data (converted to the parameters' dtype by the caller).
///
/// - Compiled: `u = net(X, params)` is `sj::compile(net, {.derivatives = 3})`. In the loss,
///   grad_sum(u, X_f) runs compiled stage 1, grad_sum(u_x, X_f) stage 2, and the final
///   grad(loss, params) stage 3 (and stage 1 for the MSE_u branch, a second trace of the
///   network at the N_u points' shape).
/// - CompileLoss: the function traced is the whole loss, its two inner grads included,
///   compiled with `{.derivatives = 1}`; grad(loss, params) runs its compiled stage 1.
/// - Eager: the Compiled code with the network run on stagejit Variables directly.
/// - Libtorch: the same code with torch::Tensor and torch::autograd::grad.
class Stepper {
 public:
  /// `cross_stage_gradients`: the Compiled mode's `CompileOptions::cross_stage_gradients`
  /// (unset: chosen when compiling; bench/pinn --cross-stage-gradients on|off measures what
  /// it brings); `tile_rows`: both
  /// compiled modes' `CompileOptions::tile_rows` (0: no row-tiled regions; bench/pinn
  /// --tile-rows); `rematerialize`: both compiled modes' `CompileOptions::rematerialize`
  /// (bench/pinn --no-rematerialize).
  Stepper(Mode mode, const TrainingData& data, std::optional<bool> cross_stage_gradients = std::nullopt,
          int64_t tile_rows = sj::CompileOptions{}.tile_rows,
          bool rematerialize = sj::CompileOptions{}.rematerialize)
      : mode_(mode), data_(data),
        net_(sj::compile(&Stepper::net_fn, {.derivatives = 3,
                                            .cross_stage_gradients = cross_stage_gradients,
                                            .tile_rows = tile_rows,
                                            .rematerialize = rematerialize})),
        loss_(sj::compile(&Stepper::loss_fn, {.derivatives = 1, .tile_rows = tile_rows, .rematerialize = rematerialize})) {}

  Mode mode() const { return mode_; }

  /// Returns the loss (a 0-dim tensor of the parameters' dtype); `grads` receives
  /// dloss/dparam in the order of `p`. `p` is read, never written.
  at::Tensor step(const Params& p, Params& grads) {
    grads.clear();
    if (mode_ == Mode::Libtorch) {
      std::vector<torch::Tensor> w;
      for (const auto& t : p) w.push_back(t.detach().requires_grad_(true));
      const torch::Tensor x_f = data_.x_f.detach().requires_grad_(true);
      auto net = [&](const torch::Tensor& x) {
        return mlp<torch::Tensor>(x, data_.input_scale, data_.input_shift, w);
      };
      auto sum_grad = [](const torch::Tensor& y, const torch::Tensor& x) { return grad_sum(y, x); };
      torch::Tensor loss = pinn_loss<torch::Tensor>(net, sum_grad, x_f, data_.x_u, data_.u_u);
      auto g = torch::autograd::grad({loss}, w);
      grads.assign(g.begin(), g.end());
      return loss.detach();
    }
    // The stagejit Variables wrap the parameters' storage (detach() shares it).
    sj::variable_list in = {sj::Variable(data_.x_f, /*requires_grad=*/true), sj::Variable(data_.x_u),
                            sj::Variable(data_.u_u), sj::Variable(data_.input_scale),
                            sj::Variable(data_.input_shift)};
    for (const auto& t : p) in.emplace_back(t.detach(), /*requires_grad=*/true);
    const sj::variable_list w(in.begin() + kFixedInputs, in.end());
    sj::Variable loss;
    if (mode_ == Mode::CompileLoss) {
      loss = loss_(in)[0];
    } else {
      auto net = [&](const sj::Variable& x) {
        sj::variable_list net_in = {x, in[3], in[4]};
        net_in.insert(net_in.end(), w.begin(), w.end());
        return mode_ == Mode::Compiled ? net_(net_in)[0] : net_fn(net_in)[0];
      };
      auto sum_grad = [](const sj::Variable& y, const sj::Variable& x) { return grad_sum(y, x); };
      loss = pinn_loss<sj::Variable>(net, sum_grad, in[0], in[1], in[2]);
    }
    for (const auto& g : sj::grad({loss}, w)) grads.push_back(g.data());
    return loss.data();
  }

  /// The compiled network (Compiled mode) and compiled loss (CompileLoss mode), for
  /// their cache statistics, graphs and other call patterns.
  sj::CompiledFunction& compiled_net() { return net_; }
  sj::CompiledFunction& compiled_loss() { return loss_; }

  /// The traced network: in = {X [N, 2], input_scale, input_shift, W1, b1, ...}.
  static sj::variable_list net_fn(const sj::variable_list& in) {
    return {mlp<sj::Variable>(in[0], in[1], in[2], std::span(in).subspan(3))};
  }

  /// The traced loss: in = {X_f (requires grad), X_u, u_u, input_scale, input_shift, W1,
  /// b1, ...}; the network is run eagerly inside (the trace records it).
  static sj::variable_list loss_fn(const sj::variable_list& in) {
    const std::span<const sj::Variable> w = std::span(in).subspan(kFixedInputs);
    auto net = [&](const sj::Variable& x) { return mlp<sj::Variable>(x, in[3], in[4], w); };
    auto sum_grad = [](const sj::Variable& y, const sj::Variable& x) { return grad_sum(y, x); };
    return {pinn_loss<sj::Variable>(net, sum_grad, in[0], in[1], in[2])};
  }

  static constexpr std::size_t kFixedInputs = 5;

 private:
  Mode mode_;
  const TrainingData& data_;
  sj::CompiledFunction net_;
  sj::CompiledFunction loss_;
};

}  // namespace pinn::burgers

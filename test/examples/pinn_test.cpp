// The Burgers PINN of examples/burgers_pinn (issue 14; examples/pinn/burgers.hpp): the
// reference solution (Cole-Hopf by quadrature) and the training step's loss and
// parameter gradients in the compiled modes against libtorch's autograd.
#include <stagejit/stagejit.hpp>
#include <stagejit/testing/doctest.hpp>

#include "../../examples/pinn/burgers.hpp"

#include <ATen/core/grad_mode.h>  // at::NoGradGuard

#include <cmath>

namespace sj = stagejit;
using namespace pinn::burgers;

namespace {

/// max |x - ref| / max |ref|, in double.
double rel_diff(const at::Tensor& x, const at::Tensor& ref) {
  const at::Tensor a = x.to(at::kDouble), b = ref.to(at::kDouble);
  return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item<double>();
}

/// Runs `stepper` and libtorch at `p`; checks the loss and every gradient within `tol`
/// relative (max |diff| / max |libtorch|, per tensor). In float, a value also passes within
/// `tol` of libtorch in double on the same numbers (`data` and `p` cast): the PINN's
/// gradients are sums over the points with cancellation, and libtorch's float can itself
/// be 1e-5 off (a bias gradient: libtorch's float 9.5e-6 from double, stagejit's 1.1e-6).
void check_against_libtorch(Stepper& stepper, Stepper& libtorch, const TrainingData& data, const Params& p,
                            double tol) {
  Params g, g_ref;
  const at::Tensor loss = stepper.step(p, g);
  const at::Tensor loss_ref = libtorch.step(p, g_ref);
  Params g64;
  at::Tensor loss64;
  const bool is_float = p.front().scalar_type() == at::kFloat;
  if (is_float) {
    Params p64;
    for (const auto& t : p) p64.push_back(t.to(at::kDouble));
    const TrainingData data64 = data.to(at::kDouble);  // the Stepper refers to it
    Stepper libtorch64(Mode::Libtorch, data64);
    loss64 = libtorch64.step(p64, g64);
  }
  // Within tol of libtorch, or (float) of libtorch in double; the distances print otherwise.
  auto close = [&](const at::Tensor& x, const at::Tensor& ref, const at::Tensor& ref64) {
    const double d = rel_diff(x, ref);
    if (d <= tol || !is_float) return d <= tol;
    const double own = rel_diff(x, ref64), libtorch_own = rel_diff(ref, ref64);
    MESSAGE(d << " from libtorch's float; from libtorch in double: " << own << ", libtorch's float "
              << libtorch_own);
    return own <= tol;
  };
  CAPTURE(mode_name(stepper.mode()));
  CHECK(close(loss, loss_ref, loss64));
  REQUIRE(g.size() == p.size());
  REQUIRE(g_ref.size() == p.size());
  for (std::size_t i = 0; i < p.size(); ++i) {
    CAPTURE(i);
    CHECK((g[i].scalar_type() == p[i].scalar_type()));
    CHECK(g[i].sizes() == p[i].sizes());
    CHECK(close(g[i], g_ref[i], is_float ? g64[i] : at::Tensor()));
  }
}

/// A plain gradient step p -= lr * g under no_grad, so that later steps see new weights.
void descend(Params& p, const Params& g, double lr) {
  at::NoGradGuard no_grad;
  for (std::size_t i = 0; i < p.size(); ++i) p[i].sub_(g[i], lr);
}

// Runs `body(data, dtype, tol)` in float (tolerance 1e-5) and double (1e-10) on small
// training data drawn with `data_seed` from one reference solution.
template <class Body>
void for_each_dtype(int data_seed, Body&& body) {
  const ReferenceSolution ref = reference_solution(20, 33);
  for (at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    CAPTURE(std::string(at::toString(dtype)));
    const double tol = dtype == at::kFloat ? 1e-5 : 1e-10;
    body(make_training_data(ref, 40, 500, data_seed).to(dtype), dtype, tol);
  }
}

}  // namespace

TEST_SUITE("pinn") {
  TEST_CASE("reference solution: quadrature converged, initial and boundary conditions") {
    // Two quadrature resolutions on a subset of the paper's grid (every 3rd time, every
    // 5th position, t = 0 excluded: it is the initial condition by definition).
    double worst = 0, scale = 0;
    for (int i = 3; i < kGridT; i += 3)
      for (int j = 0; j < kGridX; j += 5) {
        const double t = double(i) / (kGridT - 1), x = -1 + 2 * double(j) / (kGridX - 1);
        const double a = exact_solution(t, x, 2000), b = exact_solution(t, x, 4000);
        worst = std::max(worst, std::abs(a - b));
        scale = std::max(scale, std::abs(b));
      }
    // Measured: 2e-14 (the trapezoid rule has converged already at 500 points: the
    // integrand is smooth and decays like exp(-s^2)).
    CHECK(scale > 0.5);  // the solution is of order one: the check compares non-trivial values
    CHECK(worst <= 1e-12);

    // As t -> 0+ the integral tends to the initial condition -sin(pi x) (the t = 0 branch
    // is not used here): u(t, x) = u(0, x) + t u_t + O(t^2) with |u_t| = |u u_x - nu u_xx|
    // <= pi + nu pi^2 < 3.2 at t = 0, so at t = 1e-8 the deviation is below 3.2e-8
    // (measured 1.6e-8).
    for (double x = -1; x <= 1; x += 0.125) {
      CAPTURE(x);
      CHECK(std::abs(exact_solution(1e-8, x) + std::sin(kPi * x)) <= 3.2e-8);
    }
    // u(t, +-1) = 0: the integrand is odd about eta = 0 there, the symmetric trapezoid
    // rule cancels it up to rounding.
    for (double t : {0.01, 0.1, 0.3, 0.5, 0.75, 0.99, 1.0}) {
      CAPTURE(t);
      CHECK(std::abs(exact_solution(t, -1.0)) <= 1e-14);
      CHECK(std::abs(exact_solution(t, 1.0)) <= 1e-14);
    }
    // The grid the example uses: row 0 is the initial condition.
    const ReferenceSolution ref = reference_solution(10, 17);
    CHECK(rel_diff(ref.u.select(0, 0), -at::sin(kPi * ref.x)) <= 1e-15);
    CHECK(ref.points.size(0) == 170);
    CHECK(ref.u[3][5].item<double>() == exact_solution(ref.t[3].item<double>(), ref.x[5].item<double>()));
  }

  TEST_CASE("reference solution: finite-difference residual of Burgers' equation is small where smooth") {
    // Central differences with step h = 1e-3 in t and x. Smooth region: t in [0.1, 0.9],
    // 0.3 <= |x| <= 0.9, away from the shock that forms at x = 0 (t ~ 1/pi) and whose
    // width there is O(nu / |u|) ~ 5e-3. The residual is then the differences' truncation
    // error, h^2/6 (|u_ttt| + |u u_xxx|) + nu h^2/12 |u_xxxx|: measured 7.0e-5, 1.7e-5 and
    // 4.4e-6 at h = 2e-3, 1e-3 and 5e-4 (the h^2 rate: the quadrature's rounding, ~1e-14
    // through nu / h^2 ~ 1e-8, is no part of it). The terms of the residual are O(1)
    // (|u_t| up to 1.2 here), so the bound 5e-5 fails on any wrong sign or factor.
    const double h = 1e-3;
    double worst = 0, largest_term = 0;
    for (double t = 0.1; t <= 0.9 + 1e-9; t += 0.1)
      for (double ax = 0.3; ax <= 0.9 + 1e-9; ax += 0.15)
        for (double x : {-ax, ax}) {
          const double u = exact_solution(t, x);
          const double u_t = (exact_solution(t + h, x) - exact_solution(t - h, x)) / (2 * h);
          const double up = exact_solution(t, x + h), um = exact_solution(t, x - h);
          const double u_x = (up - um) / (2 * h);
          const double u_xx = (up - 2 * u + um) / (h * h);
          worst = std::max(worst, std::abs(u_t + u * u_x - kNu * u_xx));
          largest_term = std::max(largest_term, std::abs(u_t));
        }
    CHECK(largest_term > 1);
    CHECK(worst <= 5e-5);
  }

  TEST_CASE("training data: Latin hypercube in the domain, N_u points on the initial line and boundaries") {
    const ReferenceSolution ref = reference_solution(20, 33);
    const TrainingData d = make_training_data(ref, 30, 64, 7);
    CHECK(d.x_f.sizes() == at::IntArrayRef({64, 2}));
    CHECK(d.x_u.sizes() == at::IntArrayRef({30, 2}));
    // One point per stratum in each coordinate.
    for (int64_t c = 0; c < 2; ++c) {
      const double lo = c == 0 ? kTMin : kXMin, hi = c == 0 ? kTMax : kXMax;
      at::Tensor strata = ((d.x_f.select(1, c) - lo) / (hi - lo) * 64).floor().to(at::kLong);
      CHECK(std::get<0>(at::_unique(strata)).numel() == 64);
    }
    // Every N_u point is at t = 0 or x = +-1, with the reference value as data.
    for (int64_t i = 0; i < 30; ++i) {
      const double t = d.x_u[i][0].item<double>(), x = d.x_u[i][1].item<double>();
      CHECK((t == 0 || std::abs(x) == 1));
      CHECK(std::abs(d.u_u[i][0].item<double>() - exact_solution(t, x)) <= 1e-15);
    }
    // The input map sends the domain's corners onto [-1, 1]^2.
    at::Tensor corners = at::tensor({kTMin, kXMin, kTMax, kXMax}, at::kDouble).reshape({2, 2});
    CHECK(rel_diff(corners * d.input_scale + d.input_shift,
                   at::tensor({-1.0, -1.0, 1.0, 1.0}, at::kDouble).reshape({2, 2})) <= 1e-15);
  }

  TEST_CASE("compiled step equals libtorch's loss and parameter gradients (float 1e-5, double 1e-10)") {
    for_each_dtype(1, [](const TrainingData& data, at::ScalarType dtype, double tol) {
      const Params p = xavier_init(paper_layers(), 0, dtype);
      Stepper libtorch(Mode::Libtorch, data);
      for (Mode m : {Mode::Compiled, Mode::CompileLoss, Mode::Eager}) {
        Stepper s(m, data);
        check_against_libtorch(s, libtorch, data, p, tol);
      }
    });
  }

  TEST_CASE("compiled step after cached runs and after another call pattern on the same function") {
    for_each_dtype(2, [](const TrainingData& data, at::ScalarType dtype, double tol) {
      Params p = xavier_init(paper_layers(), 3, dtype);
      Stepper compiled(Mode::Compiled, data), libtorch(Mode::Libtorch, data);

      // A few steps with descent in between: the compiled stages run from the cache on
      // new weights each time.
      for (int i = 0; i < 3; ++i) {
        Params g;
        (void)compiled.step(p, g);
        descend(p, g, 1e-2);
      }
      // Two traces: the network at the collocation points (X requires grad) and at the
      // N_u points (no grad); every later call is a cache hit.
      CHECK(compiled.compiled_net().stats().misses == 2);
      check_against_libtorch(compiled, libtorch, data, p, tol);

      // Another call pattern on the same compiled network: d(sum u)/d(params) at the
      // N_u points, compiled stage 1 only (no create_graph), against libtorch.
      sj::variable_list in = {sj::Variable(data.x_u), sj::Variable(data.input_scale),
                              sj::Variable(data.input_shift)};
      for (const auto& t : p) in.emplace_back(t.detach(), true);
      const sj::variable_list w(in.begin() + 3, in.end());
      const sj::Variable u = compiled.compiled_net()(in)[0];
      const sj::variable_list gw = sj::grad({sj::sum(u)}, w);
      std::vector<torch::Tensor> tw;
      for (const auto& t : p) tw.push_back(t.detach().requires_grad_(true));
      const torch::Tensor tu = mlp<torch::Tensor>(data.x_u, data.input_scale, data.input_shift, tw);
      const auto tg = torch::autograd::grad({tu.sum()}, tw);
      CHECK(rel_diff(u.data(), tu.detach()) <= tol);
      for (std::size_t i = 0; i < gw.size(); ++i) {
        CAPTURE(i);
        CHECK(rel_diff(gw[i].data(), tg[i]) <= tol);
      }
      // ... and a first derivative in the input with create_graph, then its gradient in
      // the weights (stages 1 and 2): the gradient of sum(u_x) at the collocation points.
      // u_x does not depend on the output bias (the last parameter): left out.
      sj::variable_list in_f = in;
      in_f[0] = sj::Variable(data.x_f, true);
      const sj::variable_list w_f(in_f.begin() + 3, in_f.end() - 1);
      const sj::Variable uf = compiled.compiled_net()(in_f)[0];
      const sj::Variable du = grad_sum(uf, in_f[0]);
      const sj::variable_list gx = sj::grad({sj::sum(sj::narrow(du, 1, 1, 1))}, w_f);
      const torch::Tensor tx = data.x_f.detach().requires_grad_(true);
      const torch::Tensor tuf = mlp<torch::Tensor>(tx, data.input_scale, data.input_shift, tw);
      const std::vector<torch::Tensor> tw_f(tw.begin(), tw.end() - 1);
      const auto tgx = torch::autograd::grad({grad_sum(tuf, tx).narrow(1, 1, 1).sum()}, tw_f);
      // The same in double, the oracle for float's rounding: these gradients are sums over
      // the 500 points with cancellation, so libtorch's float itself can be 1e-5 off (the
      // bias gradient 15: libtorch's float 1.14e-5 from double, stagejit's 7.9e-7, 1.10e-5
      // apart). A float gradient passes within 1e-5 of libtorch's float, or within 1e-5
      // of libtorch in double.
      std::vector<torch::Tensor> tw64;
      for (const auto& t : p) tw64.push_back(t.detach().to(at::kDouble).requires_grad_(true));
      const torch::Tensor tx64 = data.x_f.detach().to(at::kDouble).requires_grad_(true);
      const torch::Tensor tuf64 = mlp<torch::Tensor>(tx64, data.input_scale.to(at::kDouble),
                                                     data.input_shift.to(at::kDouble), tw64);
      const auto tgx64 = torch::autograd::grad({grad_sum(tuf64, tx64).narrow(1, 1, 1).sum()},
                                               std::vector<torch::Tensor>(tw64.begin(), tw64.end() - 1));
      REQUIRE(gx.size() == tgx.size());
      for (std::size_t i = 0; i < gx.size(); ++i) {
        CAPTURE(i);
        const double d = rel_diff(gx[i].data(), tgx[i]);
        const double own = rel_diff(gx[i].data().to(at::kDouble), tgx64[i]),
                     libtorch_own = rel_diff(tgx[i].to(at::kDouble), tgx64[i]);
        CAPTURE(own);
        CAPTURE(libtorch_own);
        if (d > tol)
          MESSAGE("gradient " << i << ": " << d << " from libtorch's float; from libtorch in double: "
                              << own << ", libtorch's float " << libtorch_own);
        CHECK((d <= tol || (dtype == at::kFloat && own <= tol)));
      }
      CHECK(compiled.compiled_net().stats().misses == 2);

      // The training step again, after the other patterns.
      check_against_libtorch(compiled, libtorch, data, p, tol);
    });
  }
}

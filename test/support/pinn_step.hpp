#pragma once
// The physics-informed step of examples/pinn in small, for the closure suite's tests of
// compiled stages (cross_stage_test.cpp, tiled_region_test.cpp): a two-hidden-layer tanh
// MLP u(X), its first and second derivatives in the input X (create_graph), a
// Burgers-like residual loss of all three, and the loss's gradient in the weights, i.e.
// stages 0-3 of a net compiled with three derivatives. `sj_step` runs it on stagejit
// (through a compiled net), `torch_step` on libtorch's autograd, the oracle.

#include <stagejit/stagejit.hpp>

#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace stagejit::testing::pinn_step {

// in = {X [n, 2], W1 [2, h], b1 [h], W2 [h, h], b2 [h], W3 [h, 1]}: a tanh MLP, u [n, 1].
inline variable_list mlp(const variable_list& in) {
  auto h = tanh(add(mm(in[0], in[1]), in[2]));
  h = tanh(add(mm(h, in[3]), in[4]));
  return {mm(h, in[5])};
}
inline torch::Tensor torch_mlp(const std::vector<torch::Tensor>& in) {
  auto h = torch::tanh(torch::mm(in[0], in[1]) + in[2]);
  h = torch::tanh(torch::mm(h, in[3]) + in[4]);
  return torch::mm(h, in[5]);
}

/// Random double inputs of `mlp`: X [n, 2] in [-1, 1), W1 [2, h], b1 [h], W2 [h, h],
/// b2 [h], W3 [h, 1], scaled as an initialisation would (from ATen's default generator).
inline std::vector<at::Tensor> mlp_data(int64_t n, int64_t h) {
  return {at::rand({n, 2}, at::kDouble) * 2 - 1, at::randn({2, h}, at::kDouble) * 0.7,
          at::randn({h}, at::kDouble) * 0.1,     at::randn({h, h}, at::kDouble) / std::sqrt(double(h)),
          at::randn({h}, at::kDouble) * 0.1,     at::randn({h, 1}, at::kDouble) / std::sqrt(double(h))};
}

/// The loss (as double) and the gradients of W1..W3 (in the inputs' dtype).
struct Step {
  double loss;
  std::vector<at::Tensor> grads;
};

/// The loss of u = net(X) (`in[0]` = X, requiring grad): u_x, u_t and u_xx by `grad`
/// with create_graph, then a Burgers-like residual.
inline Variable step_loss(const variable_list& in, const Variable& u) {
  auto du = grad({u}, {in[0]}, {Variable(at::ones_like(u.data()))}, true)[0];  // [n, 2]
  auto u_x = narrow(du, 1, 1, 1);
  auto u_t = narrow(du, 1, 0, 1);
  auto ddu = grad({u_x}, {in[0]}, {Variable(at::ones_like(u_x.data()))}, true)[0];
  auto u_xx = narrow(ddu, 1, 1, 1);
  auto f = sub(add(u_t, mul(u, u_x)), mul(u_xx, 0.01));
  return add(mean(mul(f, f)), mean(mul(u, u)));
}

/// The whole loss of `mlp` as one function (bench/pinn's --compile-loss form): compiled
/// with one derivative, its inner grads are traced into stage 0.
inline variable_list mlp_loss(const variable_list& in) { return {step_loss(in, mlp(in)[0])}; }

/// The gradients of `loss` in the weights (`in[1..]`).
inline Step step_of(const Variable& loss, const variable_list& in) {
  variable_list params(in.begin() + 1, in.end());
  auto g = grad({loss}, params);
  Step s{loss.data().to(at::kDouble).item<double>(), {}};
  for (const auto& v : g) s.grads.push_back(v.data());
  return s;
}

/// The step through `net` (`mlp` compiled with three derivatives) on `data` (mlp's inputs).
inline Step sj_step(CompiledFunction& net, const std::vector<at::Tensor>& data) {
  variable_list in;
  for (const auto& t : data) in.emplace_back(t, true);
  return step_of(step_loss(in, net(in)[0]), in);
}

/// The step through `loss` (`mlp_loss` compiled with one derivative) on `data`.
inline Step sj_loss_step(CompiledFunction& loss, const std::vector<at::Tensor>& data) {
  variable_list in;
  for (const auto& t : data) in.emplace_back(t, true);
  return step_of(loss(in)[0], in);
}

/// `step_loss` of `torch_mlp` on libtorch's autograd, with a graph (`in`: leaves
/// requiring grad).
inline torch::Tensor torch_loss(const std::vector<torch::Tensor>& in) {
  auto u = torch_mlp(in);
  auto du = torch::autograd::grad({u}, {in[0]}, {torch::ones_like(u)}, true, true)[0];
  auto u_x = du.narrow(1, 1, 1);
  auto u_t = du.narrow(1, 0, 1);
  auto ddu = torch::autograd::grad({u_x}, {in[0]}, {torch::ones_like(u_x)}, true, true)[0];
  auto u_xx = ddu.narrow(1, 1, 1);
  auto f = u_t + u * u_x - u_xx * 0.01;
  return (f * f).mean() + (u * u).mean();
}

/// The same step on libtorch's autograd.
inline Step torch_step(const std::vector<at::Tensor>& data) {
  std::vector<torch::Tensor> in;
  for (const auto& t : data) in.push_back(t.detach().clone().set_requires_grad(true));
  auto loss = torch_loss(in);
  std::vector<torch::Tensor> params(in.begin() + 1, in.end());
  auto g = torch::autograd::grad({loss}, params);
  return Step{loss.to(at::kDouble).item<double>(), {g.begin(), g.end()}};
}

}  // namespace stagejit::testing::pinn_step

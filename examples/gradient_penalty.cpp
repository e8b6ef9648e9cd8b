// Gradient penalty through compiled second derivatives (stagejit sample).
//
// A small critic D(x) = tanh(x W1 + b1) w2 (x: [B, 4], W1: [4, 16], b1: [16], w2: [16, 1],
// all double) is compiled with two derivatives. The WGAN-GP style loss
//
//     L = mean(D(x)) + lambda * mean((|dD/dx|_2 - 1)^2)
//
// needs the gradient of D with respect to x *as a differentiable value*: `grad(...,
// create_graph=true)` runs the compiled stage 1 and returns Variables whose grad_fn is the
// compiled stage 2, so `grad(L, weights)` runs the compiled double backward. The program
// prints the traced three-stage graph's size, L and the weight gradients, and compares
// them with libtorch's autograd on the same numbers; it exits with status 1 if they
// differ by more than 1e-10 (the test suite runs it).
#include <stagejit/compiler.hpp>
#include <torch/torch.h>

#include <cstdio>

namespace sj = stagejit;

namespace {

constexpr double kLambda = 10.0;

/// The critic, generic over stagejit::Variable and torch::Tensor: inputs (x, W1, b1, w2).
template <class V>
V critic(const V& x, const V& w1, const V& b1, const V& w2) {
  return matmul(tanh(matmul(x, w1) + b1), w2);
}

/// mean(D) + lambda * mean((|g|_2 - 1)^2) with g = dD/dx, rows of g are per-sample gradients.
template <class V>
V wgan_gp_loss(const V& d, const V& g) {
  auto norm = sqrt(sum(g * g, std::vector<int64_t>{1}) + 1e-12);
  auto gap = norm - 1.0;
  return mean(d) + mean(gap * gap) * kLambda;
}

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); }

}  // namespace

int main() {
  at::manual_seed(0);
  const std::vector<at::Tensor> data = {at::randn({32, 4}, at::kDouble), at::randn({4, 16}, at::kDouble) * 0.5,
                                        at::randn({16}, at::kDouble) * 0.1, at::randn({16, 1}, at::kDouble) * 0.5};

  // ---- stagejit: the critic compiled with forward, backward and double backward.
  auto d_fn = sj::compile(
      [](const sj::variable_list& in) -> sj::variable_list { return {critic(in[0], in[1], in[2], in[3])}; },
      {.derivatives = 2});
  sj::variable_list in;
  for (const auto& t : data) in.emplace_back(t, /*requires_grad=*/true);
  const sj::variable_list weights(in.begin() + 1, in.end());

  sj::Variable d = d_fn(in)[0];                                              // stage 0
  sj::Variable ones(at::ones_like(d.data()));
  sj::Variable g = sj::grad({d}, {in[0]}, {ones}, /*create_graph=*/true)[0];  // stage 1
  sj::Variable loss = wgan_gp_loss(d, g);
  sj::variable_list grads = sj::grad({loss}, weights);                       // stage 2 + stage 1

  auto graph = d_fn.graph_for(in);
  std::printf("compiled critic: %zu stages, %zu nodes (forward, backward, double backward)\n",
              graph->num_stages(), graph->nodes().size());
  std::printf("loss = %.12f\n", loss.data().item<double>());

  // ---- libtorch on the same numbers.
  std::vector<torch::Tensor> t;
  for (const auto& x : data) t.push_back(x.clone().requires_grad_(true));
  auto td = critic(t[0], t[1], t[2], t[3]);
  auto tg = torch::autograd::grad({td}, {t[0]}, {torch::ones_like(td)}, /*retain_graph=*/true,
                                  /*create_graph=*/true)[0];
  auto tloss = wgan_gp_loss(td, tg);
  auto tgrads = torch::autograd::grad({tloss}, {t[1], t[2], t[3]});

  double worst = max_abs_diff(loss.data(), tloss.detach());
  const char* names[] = {"W1", "b1", "w2"};
  for (std::size_t i = 0; i < grads.size(); ++i) {
    const double diff = max_abs_diff(grads[i].data(), tgrads[i]);
    worst = std::max(worst, diff);
    std::printf("dL/d%-2s  |grad| = %.6f   max |stagejit - libtorch| = %.2e\n", names[i],
                grads[i].data().norm().item<double>(), diff);
  }
  if (worst > 1e-10) {
    std::printf("FAILED: stagejit and libtorch differ by %.3g (> 1e-10)\n", worst);
    return 1;
  }
  std::printf("stagejit's compiled double backward equals libtorch's autograd (<= 1e-10)\n");
  return 0;
}

#pragma once
// The MLP of the main job (784-256-128-10, ReLU, cross-entropy; PyTorch nn.Linear
// initialisation) and SGD with momentum as torch.optim.SGD: shared by
// examples/fashion_mnist, bench/data_parallel and the distributed tests.
#include <stagejit/stagejit.hpp>

#include <cmath>
#include <cstdint>
#include <vector>

namespace mlp {

namespace sj = stagejit;

/// W1, b1, W2, b2, W3, b3 as at::Tensors (float).
using Params = std::vector<at::Tensor>;

/// nn.Linear's default initialisation: kaiming_uniform_(a = sqrt(5)) on the weight, which
/// is U(-1/sqrt(fan_in), 1/sqrt(fan_in)), and the same bound for the bias.
inline Params init_params(uint64_t seed) {
  at::manual_seed(seed);
  const int64_t sizes[][2] = {{256, 784}, {128, 256}, {10, 128}};
  Params p;
  for (auto [out, in] : sizes) {
    const double bound = 1.0 / std::sqrt(double(in));
    p.push_back((at::rand({out, in}, at::kFloat) * 2 - 1) * bound);
    p.push_back((at::rand({out}, at::kFloat) * 2 - 1) * bound);
  }
  return p;
}

/// The logits: in = {x [B,784] float, W1, b1, W2, b2, W3, b3} -> [B,10].
inline sj::Variable logits(const sj::Variable& x, const sj::variable_list& w) {
  sj::Variable h1 = sj::relu(sj::addmm(w[1], x, sj::t(w[0])));
  sj::Variable h2 = sj::relu(sj::addmm(w[3], h1, sj::t(w[2])));
  return sj::addmm(w[5], h2, sj::t(w[4]));
}

/// The training step traced by compile(): in = {x [B,784] float, target [B] int64, W1, b1,
/// W2, b2, W3, b3}; returns {mean cross-entropy loss}.
inline sj::variable_list step_fn(const sj::variable_list& in) {
  return {sj::cross_entropy(logits(in[0], sj::variable_list(in.begin() + 2, in.end())), in[1])};
}

/// SGD with momentum as torch.optim.SGD does it (dampening 0, no Nesterov, no weight decay):
/// buf = momentum * buf + g (buf = g on the first step); p -= lr * buf.
struct Sgd {
  double lr, momentum;
  Params bufs;
  void apply(Params& p, const Params& g) {
    at::NoGradGuard no_grad;
    if (bufs.empty())
      for (const auto& t : g) bufs.push_back(t.clone());
    else
      for (std::size_t i = 0; i < g.size(); ++i) bufs[i].mul_(momentum).add_(g[i]);
    for (std::size_t i = 0; i < p.size(); ++i) p[i].sub_(bufs[i], lr);
  }
};

}  // namespace mlp

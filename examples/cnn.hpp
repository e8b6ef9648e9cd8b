#pragma once
// The CNN of the main job (issue 19): conv(1->32, 5x5, pad 2) - [batch norm] - ReLU -
// max pool 2 - conv(32->64, 5x5, pad 2) - [batch norm] - ReLU - max pool 2 - flatten -
// linear(3136->256) - ReLU - dropout 0.25 - linear(256->10), PyTorch's default
// initialisation; its training step on stagejit Variables (traced by compile()) and the
// same step on libtorch's autograd. Shared by examples/fashion_mnist and its tests.
#include <stagejit/stagejit.hpp>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace cnn {

namespace sj = stagejit;

/// The parameters as at::Tensors (float), in this order: conv1 weight [32, 1, 5, 5] and
/// bias [32], [bn1 weight [32], bias [32]], conv2 weight [64, 32, 5, 5] and bias [64],
/// [bn2 weight [64], bias [64]], fc1 weight [256, 3136] and bias [256], fc2 weight
/// [10, 256] and bias [10] (the batch-norm pairs only with batch norm).
using Params = std::vector<at::Tensor>;

/// The model's shape options.
struct Config {
  bool batch_norm = false;  ///< batch norm after each convolution
  double dropout = 0.25;    ///< dropout probability before the last linear layer
  double bn_momentum = 0.1, bn_eps = 1e-5;
};

/// Number of parameter tensors of a model with `batch_norm`.
inline std::size_t num_params(bool batch_norm) { return batch_norm ? 12 : 8; }

/// PyTorch's default initialisation (nn.Conv2d and nn.Linear: kaiming_uniform_(a =
/// sqrt(5)) on the weight, i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in)), the same bound for
/// the bias; nn.BatchNorm2d: weight 1, bias 0), drawn from `seed`.
inline Params init_params(uint64_t seed, bool batch_norm) {
  at::manual_seed(seed);
  Params p;
  auto layer = [&](std::vector<int64_t> weight_shape) {
    int64_t fan_in = 1;
    for (std::size_t i = 1; i < weight_shape.size(); ++i) fan_in *= weight_shape[i];
    const double bound = 1.0 / std::sqrt(double(fan_in));
    p.push_back((at::rand(weight_shape, at::kFloat) * 2 - 1) * bound);
    p.push_back((at::rand({weight_shape[0]}, at::kFloat) * 2 - 1) * bound);
  };
  auto norm = [&](int64_t channels) {
    p.push_back(at::ones({channels}, at::kFloat));
    p.push_back(at::zeros({channels}, at::kFloat));
  };
  layer({32, 1, 5, 5});
  if (batch_norm) norm(32);
  layer({64, 32, 5, 5});
  if (batch_norm) norm(64);
  layer({256, 3136});
  layer({10, 256});
  return p;
}

/// The batch norms' running statistics (ATen's rule: updated in place by every training
/// step, read in evaluation): mean and variance of bn1 ([32]) and bn2 ([64]); empty
/// without batch norm. Start at mean 0, variance 1 (nn.BatchNorm2d).
struct RunningStats {
  std::vector<at::Tensor> tensors;  // mean1, var1, mean2, var2

  static RunningStats initial(bool batch_norm) {
    RunningStats s;
    if (batch_norm)
      s.tensors = {at::zeros({32}), at::ones({32}), at::zeros({64}), at::ones({64})};
    return s;
  }
  RunningStats clone() const {
    RunningStats s;
    for (const auto& t : tensors) s.tensors.push_back(t.clone());
    return s;
  }
};

/// The logits [B, 10] of images `x` [B, 784] (standardised pixels) on stagejit Variables;
/// `w` as Params. In training, batch norm normalises with the batch's statistics and
/// updates `stats`, and dropout draws its mask from ATen's default generator.
inline sj::Variable logits(const Config& c, const sj::Variable& x, const sj::variable_list& w,
                           RunningStats& stats, bool train) {
  std::size_t i = 0;
  sj::Variable h = sj::reshape(x, {-1, 1, 28, 28});
  for (int block = 0; block < 2; ++block) {
    h = sj::conv2d(h, w[i], w[i + 1], {1, 1}, {2, 2});
    i += 2;
    if (c.batch_norm) {
      h = sj::batch_norm(h, w[i], w[i + 1], stats.tensors[2 * block], stats.tensors[2 * block + 1], train,
                         c.bn_momentum, c.bn_eps);
      i += 2;
    }
    h = sj::max_pool2d(sj::relu(h), {2, 2});
  }
  h = sj::relu(sj::addmm(w[i + 1], sj::flatten(h, 1), sj::t(w[i])));
  h = sj::dropout(h, c.dropout, train);
  return sj::addmm(w[i + 3], h, sj::t(w[i + 2]));
}

/// The same network on libtorch (autograd when `w` requires grad; ATen's batch norm and
/// native dropout, the functions stagejit's ops run).
inline torch::Tensor logits(const Config& c, const torch::Tensor& x, const std::vector<torch::Tensor>& w,
                            RunningStats& stats, bool train) {
  std::size_t i = 0;
  torch::Tensor h = x.reshape({-1, 1, 28, 28});
  for (int block = 0; block < 2; ++block) {
    h = torch::conv2d(h, w[i], w[i + 1], {1, 1}, {2, 2});
    i += 2;
    if (c.batch_norm) {
      h = torch::batch_norm(h, w[i], w[i + 1], stats.tensors[2 * block], stats.tensors[2 * block + 1], train,
                            c.bn_momentum, c.bn_eps, /*cudnn_enabled=*/true);
      i += 2;
    }
    h = torch::max_pool2d(torch::relu(h), {2, 2});
  }
  h = torch::relu(torch::addmm(w[i + 1], h.flatten(1), w[i].t()));
  if (train && c.dropout > 0) h = std::get<0>(torch::native_dropout(h, c.dropout, true));
  return torch::addmm(w[i + 3], h, w[i + 2].t());
}

/// Test-set accuracy in evaluation mode (running statistics, no dropout), in batches of
/// 1000 images without autograd.
inline double accuracy(const Config& c, const Params& p, RunningStats& stats, const at::Tensor& images,
                       const at::Tensor& labels) {
  at::NoGradGuard no_grad;
  int64_t correct = 0;
  const int64_t n = images.size(0);
  for (int64_t start = 0; start < n; start += 1000) {
    const int64_t len = std::min<int64_t>(1000, n - start);
    const torch::Tensor out = logits(c, images.narrow(0, start, len), p, stats, /*train=*/false);
    correct += out.argmax(1).eq(labels.narrow(0, start, len)).sum().item<int64_t>();
  }
  return double(correct) / double(n);
}

}  // namespace cnn

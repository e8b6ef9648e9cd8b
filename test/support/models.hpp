#pragma once
// Small models written once, generically, and run both on stagejit::Variable and on
// libtorch tensors (unqualified calls find stagejit's ops or ATen's through ADL).

#include <torch/torch.h>

#include <vector>

namespace stagejit::testing {

// libtorch spellings of the stagejit ops whose ATen name differs.
inline torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& target) {
  return at::cross_entropy_loss(logits, target);
}

/// Two-layer tanh MLP: inputs (x [B,I], w1 [I,H], b1 [H], w2 [H,O]); output sum of squares.
template <class V>
std::vector<V> tanh_mlp(const std::vector<V>& in) {
  auto h = tanh(matmul(in[0], in[1]) + in[2]);
  auto y = tanh(matmul(h, in[3]));
  return {sum(y * y)};
}

/// LSTM cell: inputs (x [B,I], hx [B,H], cx [B,H], w_ih [4H,I], w_hh [4H,H], b [4H]);
/// outputs (hy, cy).
template <class V>
std::vector<V> lstm_cell(const std::vector<V>& in) {
  auto gates = matmul(in[0], t(in[3])) + matmul(in[1], t(in[4])) + in[5];
  auto g = chunk(gates, 4, 1);
  auto i = sigmoid(g[0]);
  auto f = sigmoid(g[1]);
  auto c = tanh(g[2]);
  auto o = sigmoid(g[3]);
  auto cy = f * in[2] + i * c;
  auto hy = o * tanh(cy);
  return {hy, cy};
}

/// x^5 (elementwise), summed: input (x).
template <class V>
std::vector<V> pow5(const std::vector<V>& in) {
  return {sum(pow(in[0], 5.0))};
}

/// where + log_softmax + cross_entropy: inputs (logits [B,C], w [B,C]), a fixed target.
template <class V, class Target>
std::vector<V> classifier_loss(const std::vector<V>& in, const Target& target) {
  auto z = where(gt(in[1], 0.0), in[0] * in[1], in[0] - in[1]);
  auto lp = log_softmax(z, 1);
  return {cross_entropy(z, target) + sum(lp * lp) * 0.01};
}

}  // namespace stagejit::testing

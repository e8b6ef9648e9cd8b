#pragma once
/// \file
/// Ops for models: activations, embeddings and indexing, batched products, shapes,
/// reductions, losses and dropout (docs/api.md "Ops for models"), as free functions with
/// ATen's names, argument order and semantics; each runs one entry of the op table, so it
/// is differentiable to any order and reported to the trace hook.
///
/// Errors name the op: `ShapeError` for shapes or dimensions ATen rejects, `DtypeError`
/// for dtypes (an index that is not int64/int32, a floating op on integers), `Error` for
/// other bad arguments (a dropout probability outside [0, 1], an unknown GELU
/// approximation). Backward formulas follow libtorch 1.13's tools/autograd/derivatives.yaml
/// and are written in stagejit ops (ops/tensor_ops-inl.hpp).
#include <stagejit/autograd/variable.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace stagejit {

// ------------------------------------------------------------------ activations
/// Gaussian error linear unit (ATen `gelu`): `x * Phi(x)` with the normal CDF `Phi`
/// (`approximate = "none"`) or its tanh approximation `0.5 x (1 + tanh(sqrt(2/pi) (x +
/// 0.044715 x^3)))` (`"tanh"`). Floating inputs; any other `approximate` is an `Error`.
/// Backward: ATen's gelu_backward for the chosen form, in stagejit ops (erf, exp, tanh).
Variable gelu(const Variable& input, std::string approximate = "none");
/// Error function, elementwise (ATen `erf`); backward `2/sqrt(pi) exp(-x^2)`. The exact
/// GELU's derivative uses it.
Variable erf(const Variable& input);
/// Sigmoid linear unit `x * sigmoid(x)` (ATen `silu`); backward `s (1 + x (1 - s))`.
Variable silu(const Variable& input);
/// `log(1 + exp(beta x)) / beta`, and `x` itself where `beta x > threshold` (ATen
/// `softplus`); backward `sigmoid(beta x)` there, 1 in the linear region.
Variable softplus(const Variable& input, double beta = 1, double threshold = 20);
/// `x > 0 ? x : alpha (exp(x) - 1)` (ATen `elu` with scale and input_scale 1); backward
/// `alpha exp(x)` where `x <= 0`, 1 elsewhere (ATen's elu_backward on the input).
Variable elu(const Variable& input, double alpha = 1);
/// `x > 0 ? x : negative_slope x` (ATen `leaky_relu`); backward as ATen's
/// leaky_relu_backward (the slope where `x <= 0`).
Variable leaky_relu(const Variable& input, double negative_slope = 0.01);
/// `log(sum(exp(x)))` over `dims`, computed stably (ATen `logsumexp`). `dims` must name at
/// least one dimension (`ShapeError` otherwise, or for one out of range). Backward
/// `grad * exp(x - result)` (the softmax over `dims`).
Variable logsumexp(const Variable& input, std::vector<int64_t> dims, bool keepdim = false);

// ------------------------------------------------------------------ embeddings and indexing
/// Rows of `weight` ([num_embeddings, dim]) at `indices` (int64 or int32, any shape):
/// result [*indices.shape, dim] (ATen `embedding`, no padding_idx, no scale_grad_by_freq,
/// dense). Backward for `weight`: the gradient rows summed into zeros at their indices
/// (`index_add`; ATen's embedding_dense_backward). `indices` is not differentiable;
/// another dtype is a `DtypeError`, an index out of range an `Error`.
Variable embedding(const Variable& weight, const Variable& indices);
/// The slices of `input` at `index` (int64 or int32, 0-d or 1-d) along `dim` (ATen
/// `index_select`). Backward: `index_add` of the gradient into zeros of the input's shape.
Variable index_select(const Variable& input, int64_t dim, const Variable& index);
/// A copy of `input` with the slices of `source` added at `index` along `dim` (ATen
/// `index_add`, out of place, alpha 1). Backward: the gradient for `input`, its
/// `index_select` at `index` for `source`; `index` is not differentiable.
Variable index_add(const Variable& input, int64_t dim, const Variable& index, const Variable& source);

// ------------------------------------------------------------------ shapes and batched products
/// The dimensions of `input` reordered (ATen `permute`; a view). Backward: the inverse
/// permutation. `dims` must be a permutation of the dimensions (`ShapeError`).
Variable permute(const Variable& input, std::vector<int64_t> dims);
/// Dimensions `start_dim..end_dim` merged into one (ATen `flatten`; a view where possible).
/// Backward: the gradient reshaped to the input's sizes.
Variable flatten(const Variable& input, int64_t start_dim = 0, int64_t end_dim = -1);
/// Batched matrix product of [b, n, m] and [b, m, p] (ATen `bmm`; no broadcasting).
/// Backward: `bmm(grad, b^T)` and `bmm(a^T, grad)`.
Variable bmm(const Variable& a, const Variable& b);

// ------------------------------------------------------------------ reductions and losses
/// Variance over `dims` (all dimensions when empty), with Bessel's correction when
/// `unbiased` (ATen `var`). Backward: `2 (x - mean) / (N - correction) * grad` (ATen's
/// var_backward).
Variable var(const Variable& input, std::vector<int64_t> dims, bool unbiased = true, bool keepdim = false);
/// Mean of `max(x, 0) - x t + log(1 + exp(-|x|))` over all elements: binary cross entropy
/// of `sigmoid(input)` against `target` (same shape), in ATen's stable form (ATen
/// `binary_cross_entropy_with_logits`, no weights, mean reduction). Backward:
/// `(sigmoid(x) - t) grad / N` for the input, `-x grad / N` for the target.
Variable binary_cross_entropy_with_logits(const Variable& input, const Variable& target);

// ------------------------------------------------------------------ randomness
/// Dropout (ATen `dropout`): when `train` and `0 < p`, zeroes each element with
/// probability `p` and scales the others by `1 / (1 - p)` (all zeros when `p == 1`);
/// otherwise returns `input` itself. The mask is a fresh draw from ATen's default
/// generator on every run, eager or compiled (the same draw as ATen's after the same
/// `at::manual_seed`), recorded as its own `dropout` node with the result and the mask
/// (bool) as outputs (ATen's native_dropout); the backward is `grad * mask * scale` with
/// that saved mask. `p` outside [0, 1] is an `Error`.
Variable dropout(const Variable& input, double p, bool train);

}  // namespace stagejit

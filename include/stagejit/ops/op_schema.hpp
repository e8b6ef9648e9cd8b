#pragma once
/// \file
/// The op set: every op of the table as an `OpId`, and what the IR, the passes and the
/// fuser need to know of it (`OpSchema`: arity, elementwise, differentiable, side effects,
/// saved inputs, attributes, fusion code template, backward name) in one constexpr table
/// written with designated initializers. This header needs neither `Variable` nor ATen:
/// `ir`, `passes` and `fusion` know an op from it, and test it by id (`op.id() ==
/// OpId::add`), never by name. The forwards and backward formulas (autograd) live in
/// ops/op_def.hpp and its implementation, indexed by the same ids.
///
/// Names that are not in the table (IR text may call any op) are interned too
/// (`intern_op`): they get `OpId::unknown`, a stable `OpSchema` of their own (so two
/// nodes calling the same unknown op compare equal), and cannot be run: the closure
/// compiler and the interpreter refuse them with a `CompileError` naming the op.

#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>

namespace stagejit {

/// X-macro over every op name of the table, in table order.
#define STAGEJIT_FOR_EACH_OP(X) \
  X(add) \
  X(sub) \
  X(rsub) \
  X(mul) \
  X(div) \
  X(neg) \
  X(exp) \
  X(log) \
  X(tanh) \
  X(sigmoid) \
  X(relu) \
  X(sqrt) \
  X(rsqrt) \
  X(abs) \
  X(sin) \
  X(cos) \
  X(reciprocal) \
  X(sign) \
  X(pow) \
  X(maximum) \
  X(minimum) \
  X(clamp) \
  X(where) \
  X(masked_fill) \
  X(eq) \
  X(ne) \
  X(lt) \
  X(le) \
  X(gt) \
  X(ge) \
  X(logical_and) \
  X(zeros_like) \
  X(ones_like) \
  X(zeros) \
  X(to) \
  X(mm) \
  X(matmul) \
  X(addmm) \
  X(t) \
  X(transpose) \
  X(reshape) \
  X(view) \
  X(expand) \
  X(unsqueeze) \
  X(squeeze) \
  X(sum) \
  X(mean) \
  X(sum_to_size) \
  X(chunk) \
  X(cat) \
  X(narrow) \
  X(softmax) \
  X(log_softmax) \
  X(nll_loss) \
  X(nll_loss_backward) \
  X(mse_loss) \
  X(gelu) \
  X(erf) \
  X(silu) \
  X(softplus) \
  X(elu) \
  X(leaky_relu) \
  X(logsumexp) \
  X(embedding) \
  X(index_select) \
  X(index_add) \
  X(permute) \
  X(flatten) \
  X(bmm) \
  X(var) \
  X(binary_cross_entropy_with_logits) \
  X(dropout) \
  X(threshold) \
  X(select) \
  X(split) \
  X(cross) \
  X(convolution) \
  X(convolution_weight_backward) \
  X(convolution_input_backward) \
  X(max_pool2d_with_indices) \
  X(max_pool2d_with_indices_backward) \
  X(avg_pool2d) \
  X(avg_pool2d_backward) \
  X(adaptive_avg_pool2d) \
  X(adaptive_avg_pool2d_backward) \
  X(native_batch_norm) \
  X(native_layer_norm) \
  X(native_group_norm) \
  X(gather) \
  X(scatter_add)

/// One op of the table (ATen's name). `unknown`: an interned name the table lacks.
enum class OpId : uint16_t {
#define STAGEJIT_OP_ID(name) name,
  STAGEJIT_FOR_EACH_OP(STAGEJIT_OP_ID)
#undef STAGEJIT_OP_ID
  unknown
};

/// Number of ops in the table (`OpId::unknown` excluded).
inline constexpr std::size_t num_ops = static_cast<std::size_t>(OpId::unknown);

/// What is known of an op without running it.
struct OpSchema {
  OpId id = OpId::unknown;
  std::string_view name;            ///< ATen's name, e.g. "mul"
  int min_inputs = 1;               ///< tensor inputs accepted: [min_inputs, max_inputs]
  int max_inputs = 1;               ///< -1: any number (cat)
  bool elementwise = false;         ///< pointwise with broadcasting (fusable)
  bool differentiable = true;       ///< false: outputs never require grad (comparisons, ...)
  bool side_effects = false;        ///< in place or random: never removed nor merged by passes
  uint64_t saved_inputs = 0;        ///< bit i: the backward needs input i
  bool saves_outputs = false;       ///< the backward needs the outputs
  /// Attribute names in ATen's argument order, with a short note (optional ones say so).
  std::string_view attributes;
  /// Fusion code template for elementwise ops: `$0`, `$1`.. are the inputs, `$name` an
  /// attribute; in scalar forms (one input plus attribute `other`) `$1` stands for the
  /// attribute. A C expression; the CPU code generator finalises it for ATen's
  /// `Vectorized` (fusion/detail/codegen_ops.hpp, which also holds the ops whose ATen
  /// kernels differ from the C form), the CUDA one as it is. Empty: not fusable.
  std::string_view fusion_template;
  /// Name of its backward function, e.g. "MulBackward" (empty: not differentiable).
  std::string_view backward_name;
};

/// The table, indexed by `OpId`. Fields a row leaves out keep their defaults (GCC's
/// -Wmissing-field-initializers would flag every designated initializer that does so).
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#endif
inline constexpr std::array<OpSchema, num_ops> op_schemas{{
    {.id = OpId::add, .name = "add", .max_inputs = 2, .elementwise = true, .attributes = "other (scalar form), alpha (default 1)", .fusion_template = "($0 + $alpha * $1)", .backward_name = "AddBackward"},
    {.id = OpId::sub, .name = "sub", .max_inputs = 2, .elementwise = true, .attributes = "other (scalar form), alpha (default 1)", .fusion_template = "($0 - $alpha * $1)", .backward_name = "SubBackward"},
    {.id = OpId::rsub, .name = "rsub", .max_inputs = 2, .elementwise = true, .attributes = "other (scalar form), alpha (default 1): other - alpha * self", .fusion_template = "($1 - $alpha * $0)", .backward_name = "RsubBackward"},
    {.id = OpId::mul, .name = "mul", .max_inputs = 2, .elementwise = true, .saved_inputs = 0b11, .attributes = "other (scalar form)", .fusion_template = "($0 * $1)", .backward_name = "MulBackward"},
    {.id = OpId::div, .name = "div", .max_inputs = 2, .elementwise = true, .saved_inputs = 0b11, .attributes = "other (scalar form)", .fusion_template = "($0 / $1)", .backward_name = "DivBackward"},
    {.id = OpId::neg, .name = "neg", .elementwise = true, .fusion_template = "(-$0)", .backward_name = "NegBackward"},
    {.id = OpId::exp, .name = "exp", .elementwise = true, .saves_outputs = true, .fusion_template = "exp($0)", .backward_name = "ExpBackward"},
    {.id = OpId::log, .name = "log", .elementwise = true, .saved_inputs = 0b1, .fusion_template = "log($0)", .backward_name = "LogBackward"},
    {.id = OpId::tanh, .name = "tanh", .elementwise = true, .saves_outputs = true, .fusion_template = "tanh($0)", .backward_name = "TanhBackward"},
    {.id = OpId::sigmoid, .name = "sigmoid", .elementwise = true, .saves_outputs = true, .fusion_template = "(1 / (1 + exp(-$0)))", .backward_name = "SigmoidBackward"},
    {.id = OpId::relu, .name = "relu", .elementwise = true, .saves_outputs = true, .fusion_template = "($0 <= 0 ? 0 : $0)", .backward_name = "ReluBackward"},
    {.id = OpId::sqrt, .name = "sqrt", .elementwise = true, .saves_outputs = true, .fusion_template = "sqrt($0)", .backward_name = "SqrtBackward"},
    {.id = OpId::rsqrt, .name = "rsqrt", .elementwise = true, .saves_outputs = true, .fusion_template = "(1 / sqrt($0))", .backward_name = "RsqrtBackward"},
    {.id = OpId::abs, .name = "abs", .elementwise = true, .saved_inputs = 0b1, .fusion_template = "fabs($0)", .backward_name = "AbsBackward"},
    {.id = OpId::sin, .name = "sin", .elementwise = true, .saved_inputs = 0b1, .fusion_template = "sin($0)", .backward_name = "SinBackward"},
    {.id = OpId::cos, .name = "cos", .elementwise = true, .saved_inputs = 0b1, .fusion_template = "cos($0)", .backward_name = "CosBackward"},
    {.id = OpId::reciprocal, .name = "reciprocal", .elementwise = true, .saves_outputs = true, .fusion_template = "(1 / $0)", .backward_name = "ReciprocalBackward"},
    {.id = OpId::sign, .name = "sign", .elementwise = true, .differentiable = false, .fusion_template = "(($0 > 0) - ($0 < 0))", .backward_name = "SignBackward"},
    {.id = OpId::pow, .name = "pow", .max_inputs = 2, .elementwise = true, .saved_inputs = 0b11, .saves_outputs = true, .attributes = "exponent (scalar form)", .fusion_template = "pow($0, $1)", .backward_name = "PowBackward"},
    {.id = OpId::maximum, .name = "maximum", .min_inputs = 2, .max_inputs = 2, .elementwise = true, .saved_inputs = 0b11, .fusion_template = "(($0 != $0 || $0 > $1) ? $0 : $1)", .backward_name = "MaximumBackward"},
    {.id = OpId::minimum, .name = "minimum", .min_inputs = 2, .max_inputs = 2, .elementwise = true, .saved_inputs = 0b11, .fusion_template = "(($0 != $0 || $0 < $1) ? $0 : $1)", .backward_name = "MinimumBackward"},
    {.id = OpId::clamp, .name = "clamp", .elementwise = true, .saved_inputs = 0b1, .attributes = "min (optional), max (optional)", .fusion_template = "fmin(fmax($0, $min), $max)", .backward_name = "ClampBackward"},
    {.id = OpId::where, .name = "where", .min_inputs = 3, .max_inputs = 3, .elementwise = true, .saved_inputs = 0b1, .attributes = "inputs: condition (bool), self, other", .fusion_template = "($0 ? $1 : $2)", .backward_name = "WhereBackward"},
    {.id = OpId::masked_fill, .name = "masked_fill", .min_inputs = 2, .max_inputs = 2, .elementwise = true, .saved_inputs = 0b10, .attributes = "value; inputs: self, mask (bool)", .fusion_template = "($1 ? $value : $0)", .backward_name = "MaskedFillBackward"},
    {.id = OpId::eq, .name = "eq", .max_inputs = 2, .elementwise = true, .differentiable = false, .attributes = "other (scalar form)", .fusion_template = "($0 == $1)"},
    {.id = OpId::ne, .name = "ne", .max_inputs = 2, .elementwise = true, .differentiable = false, .attributes = "other (scalar form)", .fusion_template = "($0 != $1)"},
    {.id = OpId::lt, .name = "lt", .max_inputs = 2, .elementwise = true, .differentiable = false, .attributes = "other (scalar form)", .fusion_template = "($0 < $1)"},
    {.id = OpId::le, .name = "le", .max_inputs = 2, .elementwise = true, .differentiable = false, .attributes = "other (scalar form)", .fusion_template = "($0 <= $1)"},
    {.id = OpId::gt, .name = "gt", .max_inputs = 2, .elementwise = true, .differentiable = false, .attributes = "other (scalar form)", .fusion_template = "($0 > $1)"},
    {.id = OpId::ge, .name = "ge", .max_inputs = 2, .elementwise = true, .differentiable = false, .attributes = "other (scalar form)", .fusion_template = "($0 >= $1)"},
    {.id = OpId::logical_and, .name = "logical_and", .min_inputs = 2, .max_inputs = 2, .elementwise = true, .differentiable = false, .fusion_template = "($0 && $1)"},
    {.id = OpId::zeros_like, .name = "zeros_like", .differentiable = false},
    {.id = OpId::ones_like, .name = "ones_like", .differentiable = false},
    {.id = OpId::zeros, .name = "zeros", .min_inputs = 0, .max_inputs = 0, .differentiable = false, .attributes = "size (int list), dtype (int, at::ScalarType), device (string, optional, default cpu)"},
    {.id = OpId::to, .name = "to", .elementwise = true, .attributes = "dtype (int, at::ScalarType)", .fusion_template = "(($dtype) $0)", .backward_name = "ToBackward"},
    {.id = OpId::mm, .name = "mm", .min_inputs = 2, .max_inputs = 2, .saved_inputs = 0b11, .backward_name = "MmBackward"},
    {.id = OpId::matmul, .name = "matmul", .min_inputs = 2, .max_inputs = 2, .saved_inputs = 0b11, .backward_name = "MatmulBackward"},
    {.id = OpId::addmm, .name = "addmm", .min_inputs = 3, .max_inputs = 3, .saved_inputs = 0b110, .attributes = "beta (default 1), alpha (default 1); inputs: self, mat1, mat2", .backward_name = "AddmmBackward"},
    {.id = OpId::t, .name = "t", .backward_name = "TBackward"},
    {.id = OpId::transpose, .name = "transpose", .attributes = "dim0, dim1", .backward_name = "TransposeBackward"},
    {.id = OpId::reshape, .name = "reshape", .attributes = "shape (int list)", .backward_name = "ReshapeBackward"},
    {.id = OpId::view, .name = "view", .attributes = "size (int list)", .backward_name = "ViewBackward"},
    {.id = OpId::expand, .name = "expand", .attributes = "size (int list)", .backward_name = "ExpandBackward"},
    {.id = OpId::unsqueeze, .name = "unsqueeze", .attributes = "dim", .backward_name = "UnsqueezeBackward"},
    {.id = OpId::squeeze, .name = "squeeze", .attributes = "dim (optional: all size-1 dims)", .backward_name = "SqueezeBackward"},
    {.id = OpId::sum, .name = "sum", .attributes = "dim (int list, optional: all), keepdim (default false)", .backward_name = "SumBackward"},
    {.id = OpId::mean, .name = "mean", .attributes = "dim (int list, optional: all), keepdim (default false)", .backward_name = "MeanBackward"},
    {.id = OpId::sum_to_size, .name = "sum_to_size", .attributes = "size (int list)", .backward_name = "SumToSizeBackward"},
    {.id = OpId::chunk, .name = "chunk", .attributes = "chunks, dim (default 0); one output per chunk", .backward_name = "ChunkBackward"},
    {.id = OpId::cat, .name = "cat", .max_inputs = -1, .attributes = "dim (default 0)", .backward_name = "CatBackward"},
    {.id = OpId::narrow, .name = "narrow", .attributes = "dim, start, length", .backward_name = "NarrowBackward"},
    {.id = OpId::softmax, .name = "softmax", .saves_outputs = true, .attributes = "dim", .backward_name = "SoftmaxBackward"},
    {.id = OpId::log_softmax, .name = "log_softmax", .saves_outputs = true, .attributes = "dim", .backward_name = "LogSoftmaxBackward"},
    {.id = OpId::nll_loss, .name = "nll_loss", .min_inputs = 2, .max_inputs = 2, .saved_inputs = 0b11, .attributes = "reduction (default 1 = mean; 0 none, 2 sum), ignore_index (default -100); inputs: self, target (int64)", .backward_name = "NllLossBackward"},
    {.id = OpId::nll_loss_backward, .name = "nll_loss_backward", .min_inputs = 3, .max_inputs = 3, .saved_inputs = 0b110, .attributes = "reduction, ignore_index (as nll_loss); inputs: grad_output, self, target", .backward_name = "NllLossBackwardBackward"},
    {.id = OpId::mse_loss, .name = "mse_loss", .min_inputs = 2, .max_inputs = 2, .saved_inputs = 0b11, .attributes = "reduction (default 1 = mean; 0 none, 2 sum)", .backward_name = "MseLossBackward"},
    {.id = OpId::gelu, .name = "gelu", .elementwise = true, .saved_inputs = 0b1, .attributes = "approximate (string: \"none\" (default) or \"tanh\")", .fusion_template = "($0 * 0.5 * (1 + erf($0 * 0.70710678118654752440)))", .backward_name = "GeluBackward"},
    {.id = OpId::erf, .name = "erf", .elementwise = true, .saved_inputs = 0b1, .fusion_template = "erf($0)", .backward_name = "ErfBackward"},
    {.id = OpId::silu, .name = "silu", .elementwise = true, .saved_inputs = 0b1, .fusion_template = "($0 / (1 + exp(-$0)))", .backward_name = "SiluBackward"},
    {.id = OpId::softplus, .name = "softplus", .elementwise = true, .saved_inputs = 0b1, .attributes = "beta (default 1), threshold (default 20): linear where beta * self > threshold", .fusion_template = "($0 * $beta > $threshold ? $0 : log1p(exp($0 * $beta)) / $beta)", .backward_name = "SoftplusBackward"},
    {.id = OpId::elu, .name = "elu", .elementwise = true, .saved_inputs = 0b1, .attributes = "alpha (default 1)", .fusion_template = "($0 <= 0 ? (exp($0) - 1) * $alpha : $0)", .backward_name = "EluBackward"},
    {.id = OpId::leaky_relu, .name = "leaky_relu", .elementwise = true, .saved_inputs = 0b1, .attributes = "negative_slope (default 0.01)", .fusion_template = "($0 > 0 ? $0 : $0 * $negative_slope)", .backward_name = "LeakyReluBackward"},
    {.id = OpId::logsumexp, .name = "logsumexp", .saved_inputs = 0b1, .saves_outputs = true, .attributes = "dim (int list), keepdim (default false)", .backward_name = "LogsumexpBackward"},
    {.id = OpId::embedding, .name = "embedding", .min_inputs = 2, .max_inputs = 2, .saved_inputs = 0b10, .attributes = "inputs: weight, indices (int64 or int32)", .backward_name = "EmbeddingBackward"},
    {.id = OpId::index_select, .name = "index_select", .min_inputs = 2, .max_inputs = 2, .saved_inputs = 0b10, .attributes = "dim; inputs: self, index (int64 or int32, at most 1-d)", .backward_name = "IndexSelectBackward"},
    {.id = OpId::index_add, .name = "index_add", .min_inputs = 3, .max_inputs = 3, .saved_inputs = 0b10, .attributes = "dim; inputs: self, index (int64 or int32, at most 1-d), source", .backward_name = "IndexAddBackward"},
    {.id = OpId::permute, .name = "permute", .attributes = "dims (int list)", .backward_name = "PermuteBackward"},
    {.id = OpId::flatten, .name = "flatten", .attributes = "start_dim (default 0), end_dim (default -1)", .backward_name = "FlattenBackward"},
    {.id = OpId::bmm, .name = "bmm", .min_inputs = 2, .max_inputs = 2, .saved_inputs = 0b11, .backward_name = "BmmBackward"},
    {.id = OpId::var, .name = "var", .saved_inputs = 0b1, .attributes = "dim (int list, optional: all), unbiased (default true), keepdim (default false)", .backward_name = "VarBackward"},
    {.id = OpId::binary_cross_entropy_with_logits, .name = "binary_cross_entropy_with_logits", .min_inputs = 2, .max_inputs = 2, .saved_inputs = 0b11, .attributes = "reduction (default 1 = mean; 0 none, 2 sum); inputs: self (logits), target", .backward_name = "BinaryCrossEntropyWithLogitsBackward"},
    {.id = OpId::dropout, .name = "dropout", .side_effects = true, .saves_outputs = true, .attributes = "p, train (default true); outputs: result, mask (bool; a fresh draw from ATen's default generator on every run)", .backward_name = "DropoutBackward"},
    {.id = OpId::threshold, .name = "threshold", .elementwise = true, .saved_inputs = 0b1, .attributes = "threshold, value: self <= threshold ? value : self", .fusion_template = "($0 <= $threshold ? $value : $0)", .backward_name = "ThresholdBackward"},
    {.id = OpId::select, .name = "select", .attributes = "dim, index", .backward_name = "SelectBackward"},
    {.id = OpId::split, .name = "split", .attributes = "split_size (int: equal pieces, the last smaller; int list: split_with_sizes), dim (default 0); one output per piece", .backward_name = "SplitBackward"},
    {.id = OpId::cross, .name = "cross", .min_inputs = 2, .max_inputs = 2, .saved_inputs = 0b11, .attributes = "dim (optional: the first dimension of size 3)", .backward_name = "CrossBackward"},
    {.id = OpId::convolution, .name = "convolution", .min_inputs = 2, .max_inputs = 3, .saved_inputs = 0b011, .attributes = "stride, padding, dilation (int lists), transposed (bool), output_padding (int list), groups; inputs: input, weight, bias (optional)", .backward_name = "ConvolutionBackward"},
    {.id = OpId::convolution_weight_backward, .name = "convolution_weight_backward", .min_inputs = 2, .max_inputs = 2, .saved_inputs = 0b11, .attributes = "weight_size, stride, padding, dilation (int lists), groups; inputs: input, grad_output of a (non-transposed) convolution; result: the weight's gradient", .backward_name = "ConvolutionWeightBackwardBackward"},
    {.id = OpId::convolution_input_backward, .name = "convolution_input_backward", .min_inputs = 2, .max_inputs = 2, .saved_inputs = 0b11, .attributes = "input_size, stride, padding, dilation (int lists), groups; inputs: grad_output, weight of a (non-transposed) convolution; result: the input's gradient (ATen's convolution_backward, not a transposed convolution)", .backward_name = "ConvolutionInputBackwardBackward"},
    {.id = OpId::max_pool2d_with_indices, .name = "max_pool2d_with_indices", .saves_outputs = true, .attributes = "kernel_size, stride, padding, dilation (int lists), ceil_mode (bool); outputs: values, indices (int64, flat over H*W, not differentiable)", .backward_name = "MaxPool2DWithIndicesBackward"},
    {.id = OpId::max_pool2d_with_indices_backward, .name = "max_pool2d_with_indices_backward", .min_inputs = 2, .max_inputs = 2, .saved_inputs = 0b10, .attributes = "input_size (int list), kernel_size, stride, padding, dilation, ceil_mode (as max_pool2d_with_indices); inputs: grad_output, indices (int64)", .backward_name = "MaxPool2DWithIndicesBackwardBackward"},
    {.id = OpId::avg_pool2d, .name = "avg_pool2d", .attributes = "kernel_size, stride, padding (int lists), ceil_mode (default false), count_include_pad (default true)", .backward_name = "AvgPool2DBackward"},
    {.id = OpId::avg_pool2d_backward, .name = "avg_pool2d_backward", .attributes = "input_size (int list), kernel_size, stride, padding, ceil_mode, count_include_pad (as avg_pool2d); inputs: grad_output", .backward_name = "AvgPool2DBackwardBackward"},
    {.id = OpId::adaptive_avg_pool2d, .name = "adaptive_avg_pool2d", .attributes = "output_size (int list)", .backward_name = "AdaptiveAvgPool2DBackward"},
    {.id = OpId::adaptive_avg_pool2d_backward, .name = "adaptive_avg_pool2d_backward", .attributes = "input_size (int list); inputs: grad_output", .backward_name = "AdaptiveAvgPool2DBackwardBackward"},
    {.id = OpId::native_batch_norm, .name = "native_batch_norm", .max_inputs = 3, .side_effects = true, .saved_inputs = 0b011, .saves_outputs = true, .attributes = "training (bool), momentum, eps, has_weight, has_bias (bool), running_mean, running_var (optional: ids of live buffers, ops/nn.hpp); inputs: input, weight (if has_weight), bias (if has_bias); outputs: result, mean, invstd (per channel; training: the batch's, else from the running statistics)", .backward_name = "NativeBatchNormBackward"},
    {.id = OpId::native_layer_norm, .name = "native_layer_norm", .max_inputs = 3, .saved_inputs = 0b011, .saves_outputs = true, .attributes = "normalized_shape (int list), eps, has_weight, has_bias (bool); inputs: input, weight (if has_weight), bias (if has_bias); outputs: result, mean, rstd", .backward_name = "NativeLayerNormBackward"},
    {.id = OpId::native_group_norm, .name = "native_group_norm", .max_inputs = 3, .saved_inputs = 0b011, .saves_outputs = true, .attributes = "num_groups, eps, has_weight, has_bias (bool); inputs: input, weight (if has_weight), bias (if has_bias); outputs: result, mean, rstd (N x num_groups)", .backward_name = "NativeGroupNormBackward"},
    {.id = OpId::gather, .name = "gather", .min_inputs = 2, .max_inputs = 2, .saved_inputs = 0b10, .attributes = "dim; inputs: self, index (int64)", .backward_name = "GatherBackward"},
    {.id = OpId::scatter_add, .name = "scatter_add", .min_inputs = 3, .max_inputs = 3, .saved_inputs = 0b010, .attributes = "dim; inputs: self, index (int64), src", .backward_name = "ScatterAddBackward"},
}};
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

namespace detail {
constexpr bool op_table_in_id_order() {
  for (std::size_t i = 0; i < op_schemas.size(); ++i)
    if (static_cast<std::size_t>(op_schemas[i].id) != i || op_schemas[i].name.empty()) return false;
  return true;
}
static_assert(detail::op_table_in_id_order(), "op_schemas must list every OpId once, in order");
}  // namespace detail

/// The schema of `id` (`id` must not be `OpId::unknown`).
constexpr const OpSchema& op_schema(OpId id) { return op_schemas[static_cast<std::size_t>(id)]; }

/// The id of the op named `name`, or `OpId::unknown`.
constexpr OpId op_id(std::string_view name) noexcept {
  for (const auto& s : op_schemas)
    if (s.name == name) return s.id;
  return OpId::unknown;
}

/// ATen's name of `id` ("unknown" for `OpId::unknown`).
constexpr std::string_view op_name(OpId id) noexcept {
  return id == OpId::unknown ? std::string_view("unknown") : op_schema(id).name;
}

/// The schema for `name`: the table's entry, or (for a name the table lacks) an interned
/// one with `OpId::unknown`, made on first use and kept for the process (stable address,
/// so `&schema` identifies the op). Unknown names ending in `_` (ATen's in-place ops) and
/// ATen's random ops get `side_effects`. Thread-safe.
inline const OpSchema* intern_op(std::string_view name) {
  OpId id = op_id(name);
  if (id != OpId::unknown) return &op_schema(id);
  struct Interned {
    std::mutex mutex;
    std::deque<std::string> names;
    std::deque<OpSchema> schemas;
    std::unordered_map<std::string_view, const OpSchema*> by_name;
  };
  static Interned* interned = new Interned;  // never destroyed: IR may outlive statics
  std::lock_guard<std::mutex> lock(interned->mutex);
  if (auto it = interned->by_name.find(name); it != interned->by_name.end()) return it->second;
  static constexpr std::string_view random[] = {
      "rand", "randn", "rand_like", "randn_like", "randint", "randperm", "bernoulli",
      "dropout", "normal", "multinomial", "uniform", "feature_dropout", "alpha_dropout"};
  const std::string& stored = interned->names.emplace_back(name);
  OpSchema s;
  s.name = stored;
  s.min_inputs = 0;
  s.max_inputs = -1;
  s.side_effects = !stored.empty() && stored.back() == '_';
  for (auto r : random) s.side_effects = s.side_effects || stored == r;
  const OpSchema* p = &interned->schemas.emplace_back(s);
  interned->by_name.emplace(p->name, p);
  return p;
}

}  // namespace stagejit

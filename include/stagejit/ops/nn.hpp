#pragma once
/// \file
/// Ops for models: convolution, pooling, normalisation, gather and scatter_add (docs/api.md "Ops for models"), as free functions with
/// ATen's names, argument order and semantics; each runs one entry of the op table, so it
/// is differentiable to any order and reported to the trace hook.
///
/// The table entries behind them (ops/op_schema.hpp) are ATen's lower-level ops:
/// `convolution` (also transposed), `convolution_input_backward` and
/// `convolution_weight_backward` (the input and weight gradients through ATen's
/// `convolution_backward`, libtorch's kernels; the backward of each is again a convolution
/// and the other gradient), `max_pool2d_with_indices` (values and
/// int64 indices; its backward `max_pool2d_with_indices_backward` scatters by the indices
/// and is differentiated by gathering by them),
/// `avg_pool2d` / `adaptive_avg_pool2d` and their backward ops (linear; the backward of each
/// backward is the pool again), `native_batch_norm` / `native_layer_norm` /
/// `native_group_norm` (result, mean and inverse standard deviation; the backward formulas
/// take the gradients of all three, so the saved statistics are differentiated through at
/// higher orders), `gather` and `scatter_add`. Backward formulas follow libtorch 1.13's
/// derivatives.yaml, written in stagejit ops.
///
/// Errors, naming the op: `ShapeError` for shapes ATen rejects (a weight of the wrong rank,
/// negative padding, a kernel larger than the padded input, an index out of range, ...),
/// `DtypeError` for dtypes it rejects (a non-int64 index), `Error` for other arguments.
///
/// Running statistics of `batch_norm` are plain tensors the op reads and (in training)
/// updates in place on every call, eager or compiled: the op refers to them by identity
/// (attributes `running_mean` / `running_var` hold ids of a registry of live tensors, held
/// weakly), so a compiled closure updates the caller's tensors, never a copy taken when
/// it was traced. Tracing itself does not update them (`compile` traces on a cache miss
/// and then runs the closure: each call updates once). A compiled closure whose running
/// tensors were freed throws `Error` when run.
#include <stagejit/autograd/variable.hpp>

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace stagejit {

/// 1-d convolution (ATen `conv1d`). `input` [N, C_in, L] (or unbatched [C_in, L]),
/// `weight` [C_out, C_in / groups, K], `bias` [C_out] or undefined. Result [N, C_out,
/// (L + 2 padding - dilation (K - 1) - 1) / stride + 1]. `ShapeError` for a weight that is
/// not 3-d, an input that is not 2-d or 3-d, mismatched channels or groups, negative
/// padding, a kernel larger than the padded input.
Variable conv1d(const Variable& input, const Variable& weight, const Variable& bias = {},
                std::vector<int64_t> stride = {1}, std::vector<int64_t> padding = {0},
                std::vector<int64_t> dilation = {1}, int64_t groups = 1);
/// 2-d convolution (ATen `conv2d`): `input` [N, C_in, H, W] (or unbatched [C_in, H, W],
/// any memory format, e.g. channels-last), `weight` [C_out, C_in / groups, kH, kW], `bias`
/// [C_out] or undefined. Errors as `conv1d`, for 4-d weights.
Variable conv2d(const Variable& input, const Variable& weight, const Variable& bias = {},
                std::vector<int64_t> stride = {1, 1}, std::vector<int64_t> padding = {0, 0},
                std::vector<int64_t> dilation = {1, 1}, int64_t groups = 1);
/// 2-d transposed convolution (ATen `conv_transpose2d`, the gradient of `conv2d` with
/// respect to its input): `input` [N, C_in, H, W] (or unbatched), `weight` [C_in, C_out /
/// groups, kH, kW], result [N, C_out, (H - 1) stride - 2 padding + dilation (kH - 1) +
/// output_padding + 1, ...]. `output_padding` must be smaller than the stride or the
/// dilation. Errors as `conv2d`.
Variable conv_transpose2d(const Variable& input, const Variable& weight, const Variable& bias = {},
                          std::vector<int64_t> stride = {1, 1}, std::vector<int64_t> padding = {0, 0},
                          std::vector<int64_t> output_padding = {0, 0}, int64_t groups = 1,
                          std::vector<int64_t> dilation = {1, 1});
/// 2-d max pooling (ATen `max_pool2d`) over [N, C, H, W] or [C, H, W]; `stride` empty means
/// `kernel_size`; padding (implicit -inf) at most half the kernel; `ceil_mode` rounds the
/// output size up (windows starting in the padding are dropped). The gradient goes to the
/// first maximum of each window (ATen's indices). `ShapeError` for bad sizes (an output of
/// size < 1, padding over half the kernel). On CPU, a contiguous [N, C, H, W] input of 8 or
/// more channels is pooled by ATen's channels-last kernel (vectorised over C) on a copy:
/// the same values and indices, returned contiguous as ATen's NCHW kernel returns them.
Variable max_pool2d(const Variable& input, std::vector<int64_t> kernel_size,
                    std::vector<int64_t> stride = {}, std::vector<int64_t> padding = {0, 0},
                    std::vector<int64_t> dilation = {1, 1}, bool ceil_mode = false);
/// 2-d average pooling (ATen `avg_pool2d`, ceil_mode false, padding counted in the
/// divisor); `stride` empty means `kernel_size`. Errors as `max_pool2d`.
Variable avg_pool2d(const Variable& input, std::vector<int64_t> kernel_size,
                    std::vector<int64_t> stride = {}, std::vector<int64_t> padding = {0, 0});
/// Adaptive 2-d average pooling to `output_size` ({oH, oW}) (ATen `adaptive_avg_pool2d`):
/// output cell i covers input rows [floor(i H / oH), ceil((i + 1) H / oH)).
Variable adaptive_avg_pool2d(const Variable& input, std::vector<int64_t> output_size);
/// Batch normalisation (ATen `batch_norm`) over [N, C, *]: per channel, (x - mean) /
/// sqrt(var + eps) * weight + bias, weight / bias [C] or undefined. Training: the batch's
/// mean and biased variance, and `running_mean` / `running_var` ([C], same dtype, or
/// undefined) are updated in place, `r = (1 - momentum) r + momentum s` with the unbiased
/// variance for `running_var`, on every call, eager or compiled (file comment). Eval: the
/// running statistics are used (and must be defined). `ShapeError` for a weight, bias or
/// running statistic whose size is not C.
// running_mean / running_var: plain tensors, updated in place when training (ATen's rule).
Variable batch_norm(const Variable& input, const Variable& weight, const Variable& bias,
                    at::Tensor running_mean, at::Tensor running_var, bool training,
                    double momentum = 0.1, double eps = 1e-5);
/// Layer normalisation (ATen `layer_norm`) over the trailing dimensions `normalized_shape`
/// (which must match the input's last sizes): (x - mean) / sqrt(var + eps) * weight + bias,
/// biased variance, weight / bias of shape `normalized_shape` or undefined. `ShapeError`
/// when the trailing sizes, weight or bias do not match.
Variable layer_norm(const Variable& input, std::vector<int64_t> normalized_shape,
                    const Variable& weight = {}, const Variable& bias = {}, double eps = 1e-5);
/// Group normalisation (ATen `group_norm`) of [N, C, *]: the C channels in `num_groups`
/// groups, each (sample, group) normalised over its channels and positions, then the
/// per-channel weight / bias ([C] or undefined). `ShapeError` when C is not divisible by
/// `num_groups` or weight / bias are not [C].
Variable group_norm(const Variable& input, int64_t num_groups, const Variable& weight = {},
                    const Variable& bias = {}, double eps = 1e-5);
/// out[i][j][k] = input[index[i][j][k]][j][k] for dim 0, and so on (ATen `gather`):
/// `index` int64 of the input's rank, sizes at most the input's outside `dim`; the result
/// has the index's sizes. Differentiable in `input` (the backward scatter-adds). `ShapeError`
/// for an index out of range or of another rank, `DtypeError` for a non-int64 index.
Variable gather(const Variable& input, int64_t dim, const Variable& index);
/// input with src[i][j][k] added at [index[i][j][k]][j][k] for dim 0, and so on,
/// accumulating duplicates (ATen `scatter_add`): `index` int64 with `src`'s rank, sizes at
/// most `src`'s. Differentiable in `input` and `src` (gathered gradient). Errors as `gather`.
Variable scatter_add(const Variable& input, int64_t dim, const Variable& index, const Variable& src);

}  // namespace stagejit

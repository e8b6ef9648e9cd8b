#pragma once
/// \file
/// The differentiable ops of docs/api.md (and the helpers their backward formulas use), as free
/// functions with ATen's names, argument order, broadcasting and type promotion. Each runs
/// one entry of the op table (`ops/op_def.hpp`), so it is differentiable to any order and
/// reported to the trace hook. Errors, naming the op: `ShapeError` for shapes ATen rejects,
/// `DtypeError` for dtypes (or devices) it rejects, `Error` for other ATen errors and an
/// undefined input (core/error.hpp, "ATen errors").

#include <stagejit/autograd/variable.hpp>

#include <cstdint>
#include <optional>
#include <vector>

namespace stagejit {

/// a + alpha * b (ATen `add`). Scalar forms: `add(a, s)` (attribute `other`).
Variable add(const Variable& a, const Variable& b, double alpha = 1);
Variable add(const Variable& a, double other, double alpha = 1);
/// a - alpha * b (ATen `sub`).
Variable sub(const Variable& a, const Variable& b, double alpha = 1);
Variable sub(const Variable& a, double other, double alpha = 1);
/// other - alpha * a (ATen `rsub`, the scalar-first form of `sub`).
Variable rsub(const Variable& a, double other, double alpha = 1);
/// a * b (ATen `mul`).
Variable mul(const Variable& a, const Variable& b);
Variable mul(const Variable& a, double other);
/// a / b (ATen `div`, true division).
Variable div(const Variable& a, const Variable& b);
Variable div(const Variable& a, double other);
Variable neg(const Variable& a);
Variable exp(const Variable& a);
Variable log(const Variable& a);
Variable tanh(const Variable& a);
Variable sigmoid(const Variable& a);
Variable relu(const Variable& a);
Variable sqrt(const Variable& a);
Variable rsqrt(const Variable& a);
Variable abs(const Variable& a);
Variable sin(const Variable& a);
Variable cos(const Variable& a);
Variable reciprocal(const Variable& a);
/// Sign (-1, 0, 1); not differentiable (its derivative is zero almost everywhere).
Variable sign(const Variable& a);
/// a ** exponent (ATen `pow`, attribute `exponent`).
Variable pow(const Variable& a, double exponent);
Variable pow(const Variable& a, const Variable& exponent);
/// Elementwise max / min, propagating NaN (ATen `maximum`, `minimum`).
Variable maximum(const Variable& a, const Variable& b);
Variable minimum(const Variable& a, const Variable& b);
/// Clamp to [min, max]; either bound may be absent (ATen `clamp`).
Variable clamp(const Variable& a, std::optional<double> min, std::optional<double> max);
/// condition ? a : b, broadcasting (ATen `where`); `condition` is a bool tensor.
Variable where(const Variable& condition, const Variable& a, const Variable& b);
/// a with `value` where `mask` (bool, broadcastable to a) is true (ATen `masked_fill`).
Variable masked_fill(const Variable& a, const Variable& mask, double value);
/// Comparisons (bool results, not differentiable).
Variable eq(const Variable& a, const Variable& b);
Variable eq(const Variable& a, double other);
Variable ne(const Variable& a, const Variable& b);
Variable ne(const Variable& a, double other);
Variable lt(const Variable& a, const Variable& b);
Variable lt(const Variable& a, double other);
Variable le(const Variable& a, const Variable& b);
Variable le(const Variable& a, double other);
Variable gt(const Variable& a, const Variable& b);
Variable gt(const Variable& a, double other);
Variable ge(const Variable& a, const Variable& b);
Variable ge(const Variable& a, double other);
Variable logical_and(const Variable& a, const Variable& b);
/// Matrix products (ATen `mm`, `matmul`, `addmm`: beta * c + alpha * (a @ b)).
Variable mm(const Variable& a, const Variable& b);
Variable matmul(const Variable& a, const Variable& b);
Variable addmm(const Variable& c, const Variable& a, const Variable& b, double beta = 1,
               double alpha = 1);
/// Shape ops (ATen semantics; views where ATen returns views).
Variable t(const Variable& a);
Variable transpose(const Variable& a, int64_t dim0, int64_t dim1);
Variable reshape(const Variable& a, std::vector<int64_t> shape);
Variable view(const Variable& a, std::vector<int64_t> size);
Variable expand(const Variable& a, std::vector<int64_t> size);
Variable unsqueeze(const Variable& a, int64_t dim);
Variable squeeze(const Variable& a);
Variable squeeze(const Variable& a, int64_t dim);
/// Reductions (ATen `sum`, `mean`; `dims` empty in the list form reduces nothing special:
/// use the one-argument form to reduce everything).
Variable sum(const Variable& a);
Variable sum(const Variable& a, std::vector<int64_t> dims, bool keepdim = false);
Variable mean(const Variable& a);
Variable mean(const Variable& a, std::vector<int64_t> dims, bool keepdim = false);
/// Sums broadcast dimensions away so the result has `size` (ATen `sum_to_size`).
Variable sum_to_size(const Variable& a, std::vector<int64_t> size);
/// Splits into `chunks` pieces along `dim` (ATen `chunk`).
variable_list chunk(const Variable& a, int64_t chunks, int64_t dim = 0);
/// Concatenates along `dim` (ATen `cat`).
Variable cat(const variable_list& tensors, int64_t dim = 0);
Variable narrow(const Variable& a, int64_t dim, int64_t start, int64_t length);
/// Splits into pieces of `split_size` along `dim`, the last smaller (ATen `split`).
variable_list split(const Variable& a, int64_t split_size, int64_t dim = 0);
/// Splits into pieces of the given sizes along `dim` (ATen `split_with_sizes`).
variable_list split(const Variable& a, std::vector<int64_t> split_sizes, int64_t dim = 0);
/// The slice at `index` of `dim`, that dimension removed (ATen `select`; a view).
Variable select(const Variable& a, int64_t dim, int64_t index);
/// `a <= threshold ? value : a` elementwise (ATen `threshold`; NaN stays NaN).
Variable threshold(const Variable& a, double threshold, double value);
/// Cross product of 3-vectors along `dim`, or along the first dimension of size 3 when
/// `dim` is not given (ATen `cross`; broadcasts).
Variable cross(const Variable& a, const Variable& b, std::optional<int64_t> dim = std::nullopt);
Variable softmax(const Variable& a, int64_t dim);
Variable log_softmax(const Variable& a, int64_t dim);
/// Negative log likelihood, mean reduction, `target` int64 class indices (ATen `nll_loss`).
Variable nll_loss(const Variable& log_probs, const Variable& target);
/// log_softmax over the class dim followed by nll_loss (ATen `cross_entropy_loss`).
Variable cross_entropy(const Variable& logits, const Variable& target);
/// Mean squared error, mean reduction (ATen `mse_loss`).
Variable mse_loss(const Variable& a, const Variable& b);
/// Zeros / ones shaped like `a` (not differentiable).
Variable zeros_like(const Variable& a);
Variable ones_like(const Variable& a);
/// Casts to `dtype` (ATen `to`); differentiable for floating dtypes.
Variable to(const Variable& a, at::ScalarType dtype);

Variable operator+(const Variable& a, const Variable& b);
Variable operator+(const Variable& a, double b);
Variable operator+(double a, const Variable& b);
Variable operator-(const Variable& a, const Variable& b);
Variable operator-(const Variable& a, double b);
Variable operator-(double a, const Variable& b);
Variable operator*(const Variable& a, const Variable& b);
Variable operator*(const Variable& a, double b);
Variable operator*(double a, const Variable& b);
Variable operator/(const Variable& a, const Variable& b);
Variable operator/(const Variable& a, double b);
/// s / a, recorded as `reciprocal` then `mul` by `s` (as ATen's Python binding does).
Variable operator/(double a, const Variable& b);
Variable operator-(const Variable& a);

}  // namespace stagejit

// The ops for models (docs/api.md "Ops for models").
#include <stagejit/ops/nn.hpp>
#include <stagejit/ops/tensor_ops.hpp>

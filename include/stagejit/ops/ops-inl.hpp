#pragma once
/// \file
/// Bodies of the op free functions of ops/ops.hpp (`add`, `mm`, `tanh`, ..., the
/// operators): each runs its op of the table (ops/op_table-inl.hpp) through `ops::apply`.
///
/// Function bodies (core/config.hpp): compiled once in src/compiled_bodies.cpp, or
/// inline in every translation unit of a header-only build.
#include <stagejit/core/config.hpp>
#include <stagejit/ops/detail/ops_impl.hpp>
#include <stagejit/ops/op_def.hpp>
#include <stagejit/ops/ops.hpp>

#include <optional>
#include <vector>

namespace stagejit {

// ------------------------------------------------------------------ free functions
namespace detail::ops_impl {
STAGEJIT_FUNC Variable run1(const OpDef& d, variable_list in, const Attributes& attrs) {
  return ops::apply(d, in, attrs)[0];
}
}  // namespace detail::ops_impl

STAGEJIT_FUNC Variable add(const Variable& a, const Variable& b, double alpha) {
  SJ_OP(add);
  return alpha == 1 ? detail::ops_impl::run1(d, {a, b}) : detail::ops_impl::run1(d, {a, b}, {{"alpha", alpha}});
}
STAGEJIT_FUNC Variable add(const Variable& a, double other, double alpha) {
  SJ_OP(add);
  return alpha == 1 ? detail::ops_impl::run1(d, {a}, {{"other", other}}) : detail::ops_impl::run1(d, {a}, {{"other", other}, {"alpha", alpha}});
}
STAGEJIT_FUNC Variable sub(const Variable& a, const Variable& b, double alpha) {
  SJ_OP(sub);
  return alpha == 1 ? detail::ops_impl::run1(d, {a, b}) : detail::ops_impl::run1(d, {a, b}, {{"alpha", alpha}});
}
STAGEJIT_FUNC Variable sub(const Variable& a, double other, double alpha) {
  SJ_OP(sub);
  return alpha == 1 ? detail::ops_impl::run1(d, {a}, {{"other", other}}) : detail::ops_impl::run1(d, {a}, {{"other", other}, {"alpha", alpha}});
}
STAGEJIT_FUNC Variable rsub(const Variable& a, double other, double alpha) {
  SJ_OP(rsub);
  return alpha == 1 ? detail::ops_impl::run1(d, {a}, {{"other", other}}) : detail::ops_impl::run1(d, {a}, {{"other", other}, {"alpha", alpha}});
}
STAGEJIT_FUNC Variable mul(const Variable& a, const Variable& b) { SJ_OP(mul); return detail::ops_impl::run1(d, {a, b}); }
STAGEJIT_FUNC Variable mul(const Variable& a, double other) { SJ_OP(mul); return detail::ops_impl::run1(d, {a}, {{"other", other}}); }
STAGEJIT_FUNC Variable div(const Variable& a, const Variable& b) { SJ_OP(div); return detail::ops_impl::run1(d, {a, b}); }
STAGEJIT_FUNC Variable div(const Variable& a, double other) { SJ_OP(div); return detail::ops_impl::run1(d, {a}, {{"other", other}}); }
#define SJ_UNARY_FN(NAME) \
  STAGEJIT_FUNC Variable NAME(const Variable& a) { SJ_OP(NAME); return detail::ops_impl::run1(d, {a}); }
SJ_UNARY_FN(neg)
SJ_UNARY_FN(exp)
SJ_UNARY_FN(log)
SJ_UNARY_FN(tanh)
SJ_UNARY_FN(sigmoid)
SJ_UNARY_FN(relu)
SJ_UNARY_FN(sqrt)
SJ_UNARY_FN(rsqrt)
SJ_UNARY_FN(abs)
SJ_UNARY_FN(sin)
SJ_UNARY_FN(cos)
SJ_UNARY_FN(reciprocal)
SJ_UNARY_FN(sign)
SJ_UNARY_FN(t)
SJ_UNARY_FN(zeros_like)
SJ_UNARY_FN(ones_like)
#undef SJ_UNARY_FN
STAGEJIT_FUNC Variable pow(const Variable& a, double exponent) { SJ_OP(pow); return detail::ops_impl::run1(d, {a}, {{"exponent", exponent}}); }
STAGEJIT_FUNC Variable pow(const Variable& a, const Variable& exponent) { SJ_OP(pow); return detail::ops_impl::run1(d, {a, exponent}); }
STAGEJIT_FUNC Variable maximum(const Variable& a, const Variable& b) { SJ_OP(maximum); return detail::ops_impl::run1(d, {a, b}); }
STAGEJIT_FUNC Variable minimum(const Variable& a, const Variable& b) { SJ_OP(minimum); return detail::ops_impl::run1(d, {a, b}); }
STAGEJIT_FUNC Variable clamp(const Variable& a, std::optional<double> min, std::optional<double> max) {
  SJ_OP(clamp);
  Attributes attrs;
  if (min) attrs.emplace_back("min", *min);
  if (max) attrs.emplace_back("max", *max);
  return detail::ops_impl::run1(d, {a}, attrs);
}
STAGEJIT_FUNC Variable where(const Variable& c, const Variable& a, const Variable& b) { SJ_OP(where); return detail::ops_impl::run1(d, {c, a, b}); }
STAGEJIT_FUNC Variable masked_fill(const Variable& a, const Variable& mask, double value) {
  SJ_OP(masked_fill);
  return detail::ops_impl::run1(d, {a, mask}, {{"value", value}});
}
#define SJ_CMP_FN(NAME)                                                                  \
  STAGEJIT_FUNC Variable NAME(const Variable& a, const Variable& b) { SJ_OP(NAME); return detail::ops_impl::run1(d, {a, b}); } \
  STAGEJIT_FUNC Variable NAME(const Variable& a, double other) { SJ_OP(NAME); return detail::ops_impl::run1(d, {a}, {{"other", other}}); }
SJ_CMP_FN(eq)
SJ_CMP_FN(ne)
SJ_CMP_FN(lt)
SJ_CMP_FN(le)
SJ_CMP_FN(gt)
SJ_CMP_FN(ge)
#undef SJ_CMP_FN
STAGEJIT_FUNC Variable logical_and(const Variable& a, const Variable& b) { SJ_OP(logical_and); return detail::ops_impl::run1(d, {a, b}); }
STAGEJIT_FUNC Variable mm(const Variable& a, const Variable& b) { SJ_OP(mm); return detail::ops_impl::run1(d, {a, b}); }
STAGEJIT_FUNC Variable matmul(const Variable& a, const Variable& b) { SJ_OP(matmul); return detail::ops_impl::run1(d, {a, b}); }
STAGEJIT_FUNC Variable addmm(const Variable& c, const Variable& a, const Variable& b, double beta, double alpha) {
  SJ_OP(addmm);
  Attributes attrs;
  if (beta != 1) attrs.emplace_back("beta", beta);
  if (alpha != 1) attrs.emplace_back("alpha", alpha);
  return detail::ops_impl::run1(d, {c, a, b}, attrs);
}
STAGEJIT_FUNC Variable transpose(const Variable& a, int64_t d0, int64_t d1) {
  SJ_OP(transpose);
  return detail::ops_impl::run1(d, {a}, {{"dim0", d0}, {"dim1", d1}});
}
STAGEJIT_FUNC Variable reshape(const Variable& a, std::vector<int64_t> shape) { SJ_OP(reshape); return detail::ops_impl::run1(d, {a}, {{"shape", std::move(shape)}}); }
STAGEJIT_FUNC Variable view(const Variable& a, std::vector<int64_t> size) { SJ_OP(view); return detail::ops_impl::run1(d, {a}, {{"size", std::move(size)}}); }
STAGEJIT_FUNC Variable expand(const Variable& a, std::vector<int64_t> size) { SJ_OP(expand); return detail::ops_impl::run1(d, {a}, {{"size", std::move(size)}}); }
STAGEJIT_FUNC Variable unsqueeze(const Variable& a, int64_t dim) { SJ_OP(unsqueeze); return detail::ops_impl::run1(d, {a}, {{"dim", dim}}); }
STAGEJIT_FUNC Variable squeeze(const Variable& a) { SJ_OP(squeeze); return detail::ops_impl::run1(d, {a}); }
STAGEJIT_FUNC Variable squeeze(const Variable& a, int64_t dim) { SJ_OP(squeeze); return detail::ops_impl::run1(d, {a}, {{"dim", dim}}); }
STAGEJIT_FUNC Variable sum(const Variable& a) { SJ_OP(sum); return detail::ops_impl::run1(d, {a}); }
STAGEJIT_FUNC Variable sum(const Variable& a, std::vector<int64_t> dims, bool keepdim) {
  SJ_OP(sum);
  return detail::ops_impl::run1(d, {a}, {{"dim", std::move(dims)}, {"keepdim", keepdim}});
}
STAGEJIT_FUNC Variable mean(const Variable& a) { SJ_OP(mean); return detail::ops_impl::run1(d, {a}); }
STAGEJIT_FUNC Variable mean(const Variable& a, std::vector<int64_t> dims, bool keepdim) {
  SJ_OP(mean);
  return detail::ops_impl::run1(d, {a}, {{"dim", std::move(dims)}, {"keepdim", keepdim}});
}
STAGEJIT_FUNC Variable sum_to_size(const Variable& a, std::vector<int64_t> size) {
  SJ_OP(sum_to_size);
  return detail::ops_impl::run1(d, {a}, {{"size", std::move(size)}});
}
STAGEJIT_FUNC variable_list chunk(const Variable& a, int64_t chunks, int64_t dim) {
  SJ_OP(chunk);
  return ops::apply(d, {a}, {{"chunks", chunks}, {"dim", dim}});
}
STAGEJIT_FUNC Variable cat(const variable_list& tensors, int64_t dim) { SJ_OP(cat); return detail::ops_impl::run1(d, tensors, {{"dim", dim}}); }
STAGEJIT_FUNC Variable narrow(const Variable& a, int64_t dim, int64_t start, int64_t length) {
  SJ_OP(narrow);
  return detail::ops_impl::run1(d, {a}, {{"dim", dim}, {"start", start}, {"length", length}});
}
STAGEJIT_FUNC variable_list split(const Variable& a, int64_t split_size, int64_t dim) {
  SJ_OP(split);
  return ops::apply(d, {a}, {{"split_size", split_size}, {"dim", dim}});
}
STAGEJIT_FUNC variable_list split(const Variable& a, std::vector<int64_t> split_sizes, int64_t dim) {
  SJ_OP(split);
  return ops::apply(d, {a}, {{"split_size", std::move(split_sizes)}, {"dim", dim}});
}
STAGEJIT_FUNC Variable select(const Variable& a, int64_t dim, int64_t index) {
  SJ_OP(select);
  return detail::ops_impl::run1(d, {a}, {{"dim", dim}, {"index", index}});
}
STAGEJIT_FUNC Variable threshold(const Variable& a, double threshold, double value) {
  SJ_OP(threshold);
  return detail::ops_impl::run1(d, {a}, {{"threshold", threshold}, {"value", value}});
}
STAGEJIT_FUNC Variable cross(const Variable& a, const Variable& b, std::optional<int64_t> dim) {
  SJ_OP(cross);
  if (!dim) return detail::ops_impl::run1(d, {a, b});
  return detail::ops_impl::run1(d, {a, b}, {{"dim", *dim}});
}
STAGEJIT_FUNC Variable softmax(const Variable& a, int64_t dim) { SJ_OP(softmax); return detail::ops_impl::run1(d, {a}, {{"dim", dim}}); }
STAGEJIT_FUNC Variable log_softmax(const Variable& a, int64_t dim) { SJ_OP(log_softmax); return detail::ops_impl::run1(d, {a}, {{"dim", dim}}); }
STAGEJIT_FUNC Variable nll_loss(const Variable& lp, const Variable& target) { SJ_OP(nll_loss); return detail::ops_impl::run1(d, {lp, target}); }
STAGEJIT_FUNC Variable cross_entropy(const Variable& logits, const Variable& target) {
  return nll_loss(log_softmax(logits, logits.dim() == 1 ? 0 : 1), target);
}
STAGEJIT_FUNC Variable mse_loss(const Variable& a, const Variable& b) { SJ_OP(mse_loss); return detail::ops_impl::run1(d, {a, b}); }
STAGEJIT_FUNC Variable to(const Variable& a, at::ScalarType dtype) {
  SJ_OP(to);
  return detail::ops_impl::run1(d, {a}, {{"dtype", static_cast<int64_t>(dtype)}});
}

STAGEJIT_FUNC Variable operator+(const Variable& a, const Variable& b) { return add(a, b); }
STAGEJIT_FUNC Variable operator+(const Variable& a, double b) { return add(a, b); }
STAGEJIT_FUNC Variable operator+(double a, const Variable& b) { return add(b, a); }
STAGEJIT_FUNC Variable operator-(const Variable& a, const Variable& b) { return sub(a, b); }
STAGEJIT_FUNC Variable operator-(const Variable& a, double b) { return sub(a, b); }
STAGEJIT_FUNC Variable operator-(double a, const Variable& b) { return rsub(b, a); }
STAGEJIT_FUNC Variable operator*(const Variable& a, const Variable& b) { return mul(a, b); }
STAGEJIT_FUNC Variable operator*(const Variable& a, double b) { return mul(a, b); }
STAGEJIT_FUNC Variable operator*(double a, const Variable& b) { return mul(b, a); }
STAGEJIT_FUNC Variable operator/(const Variable& a, const Variable& b) { return div(a, b); }
STAGEJIT_FUNC Variable operator/(const Variable& a, double b) { return div(a, b); }
STAGEJIT_FUNC Variable operator/(double a, const Variable& b) { return mul(reciprocal(b), a); }
STAGEJIT_FUNC Variable operator-(const Variable& a) { return neg(a); }

}  // namespace stagejit

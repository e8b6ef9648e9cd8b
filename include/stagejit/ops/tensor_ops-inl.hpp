#pragma once
/// \file
/// Bodies of ops/tensor_ops.hpp: the table entries (forward through ATen, backward formulas in
/// stagejit ops following libtorch 1.13's derivatives.yaml) and the free functions.
/// Its entries join the table in build_table (ops/op_table-inl.hpp).
///
/// Function bodies (core/config.hpp): compiled once in src/compiled_bodies.cpp, or
/// inline in every translation unit of a header-only build.
#include <stagejit/core/config.hpp>
#include <stagejit/ops/detail/ops_impl.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/ops/op_def.hpp>
#include <stagejit/ops/ops.hpp>
#include <stagejit/ops/tensor_ops.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

namespace stagejit {
namespace detail::ops_impl {

// An index tensor of indexing ops must be int64 or int32 (ATen accepts both).
STAGEJIT_FUNC void check_index_dtype(const at::Tensor& index, std::string_view op, std::string_view what) {
  const auto t = index.scalar_type();
  if (t != at::kLong && t != at::kInt)
    throw DtypeError(detail::str_cat("op '", op, "': ", what, " must be an int64 or int32 tensor, got ", c10::toString(t)));
}

// The GELU form named by attribute `approximate` (true: tanh); anything else is an Error.
STAGEJIT_FUNC bool gelu_tanh(const Attributes& a) {
  const Scalar* s = find_attr(a, "approximate");
  if (!s) return false;
  const auto* name = std::get_if<std::string>(s);
  STAGEJIT_CHECK(name && (*name == "none" || *name == "tanh"),
                 "approximate must be the string \"none\" or \"tanh\"", name ? ", got \"" + *name + "\"" : std::string());
  return *name == "tanh";
}

// `g` with the reduced `dims` of an input of rank `rank` put back as size-1 dimensions
// (nothing when `keepdim` or for a 0-d input): the gradient of a reduction, ready to broadcast.
STAGEJIT_FUNC Variable unsqueeze_reduced(Variable g, std::vector<int64_t> dims, int64_t rank, bool keepdim) {
  if (keepdim || rank == 0) return g;
  for (auto& d : dims) d = at::maybe_wrap_dim(d, rank);
  std::sort(dims.begin(), dims.end());
  for (int64_t d : dims) g = unsqueeze(g, d);
  return g;
}

// 1 / (1 - p), 0 when p == 1 (ATen's native_dropout scale).
STAGEJIT_FUNC double dropout_scale(double p) { return p == 1 ? 0.0 : 1.0 / (1.0 - p); }

STAGEJIT_FUNC void check_dropout_p(double p) {
  STAGEJIT_CHECK(p >= 0 && p <= 1, "dropout probability has to be between 0 and 1, but got ", p);
}

template <class Def>
void define_tensor_ops(Def& def) {
  // ---- activations (derivatives.yaml: gelu_backward, silu_backward, softplus_backward,
  // elu_backward, leaky_relu_backward, logsumexp_backward)
  def(OpId::gelu, [](const Tensors& in, const Attributes& a) {
         return one(at::gelu(in[0], gelu_tanh(a) ? "tanh" : "none"));
       },
       [](const BackwardArgs& a) -> variable_list {
         const Variable& x = In(a, 0);
         if (gelu_tanh(a.attrs)) {
           // d/dx 0.5 x (1 + tanh(u)), u = k (x + c x^3).
           const double k = M_SQRT2 * M_2_SQRTPI * 0.5, c = 0.044715;
           Variable x2 = mul(x, x);
           Variable th = tanh(mul(add(x, mul(mul(x2, x), c)), k));
           Variable left = mul(x, 0.5);
           Variable left_d = mul(add(th, 1.0), 0.5);
           Variable right_d = mul(mul(mul(left, rsub(mul(th, th), 1.0)), k), add(mul(x2, 3 * c), 1.0));
           return {mul(G(a), add(left_d, right_d))};
         }
         // d/dx x Phi(x) = Phi(x) + x phi(x).
         const double inv_sqrt_2pi = M_2_SQRTPI * M_SQRT1_2 * 0.5;
         Variable cdf = mul(add(erf(mul(x, M_SQRT1_2)), 1.0), 0.5);
         Variable pdf = mul(exp(mul(mul(x, x), -0.5)), inv_sqrt_2pi);
         return {mul(G(a), add(cdf, mul(x, pdf)))};
       });
  def(OpId::erf, SJ_UNARY(erf),
       [](const BackwardArgs& a) -> variable_list {
         const Variable& x = In(a, 0);
         return {mul(G(a), mul(exp(neg(mul(x, x))), M_2_SQRTPI))};
       });
  def(OpId::silu, SJ_UNARY(silu),
       [](const BackwardArgs& a) -> variable_list {
         const Variable& x = In(a, 0);
         Variable s = sigmoid(x);
         return {mul(G(a), mul(s, add(mul(x, rsub(s, 1.0)), 1.0)))};
       });
  def(OpId::softplus, [](const Tensors& in, const Attributes& a) {
         return one(at::softplus(in[0], attr_scalar(a, "beta", 1.0), attr_scalar(a, "threshold", 20.0)));
       },
       [](const BackwardArgs& a) -> variable_list {
         const double beta = attr_double(a.attrs, "beta", 1), thr = attr_double(a.attrs, "threshold", 20);
         Variable bx = mul(In(a, 0), beta);
         // sigmoid(beta x) is ATen's z / (z + 1) with z = exp(beta x), without its inf / inf
         // where z overflows (which a further derivative would read).
         return {where(gt(bx, thr), G(a), mul(G(a), sigmoid(bx)))};
       });
  def(OpId::elu, [](const Tensors& in, const Attributes& a) {
         return one(at::elu(in[0], attr_scalar(a, "alpha", 1.0)));
       },
       [](const BackwardArgs& a) -> variable_list {
         const Variable& x = In(a, 0);
         const double alpha = attr_double(a.attrs, "alpha", 1);
         return {where(le(x, 0.0), mul(mul(G(a), alpha), exp(x)), G(a))};
       });
  def(OpId::leaky_relu, [](const Tensors& in, const Attributes& a) {
         return one(at::leaky_relu(in[0], attr_scalar(a, "negative_slope", 0.01)));
       },
       [](const BackwardArgs& a) -> variable_list {
         const double slope = attr_double(a.attrs, "negative_slope", 0.01);
         return {where(gt(In(a, 0), 0.0), G(a), mul(G(a), slope))};
       });
  def(OpId::logsumexp, [](const Tensors& in, const Attributes& a) {
         auto dims = attr_ints(a, "dim");
         if (dims.empty()) throw ShapeError("op 'logsumexp': dim must name at least one dimension");
         return one(at::logsumexp(in[0], dims, attr_bool(a, "keepdim", false)));
       },
       [](const BackwardArgs& a) -> variable_list {
         const auto dims = attr_ints(a.attrs, "dim");
         const bool keepdim = attr_bool(a.attrs, "keepdim", false);
         const auto rank = static_cast<int64_t>(a.input_meta[0].sizes.size());
         Variable g = unsqueeze_reduced(G(a), dims, rank, keepdim);
         Variable r = unsqueeze_reduced(Out(a), dims, rank, keepdim);
         return {mul(g, exp(sub(In(a, 0), r)))};
       });

  // ---- embeddings and indexing (embedding_dense_backward, index_select_backward,
  // index_add's self/source formulas)
  def(OpId::embedding, [](const Tensors& in, const Attributes&) {
         check_index_dtype(in[1], "embedding", "indices");
         return one(at::embedding(in[0], in[1]));
       },
       [](const BackwardArgs& a) -> variable_list {
         auto sizes = meta_sizes(a, 0);  // [num_embeddings, dim]
         Variable rows = reshape(G(a), {-1, sizes[1]});
         return {index_add(zeros_of(sizes, a.input_meta[0].options), 0, reshape(In(a, 1), {-1}), rows),
                 Variable()};
       });
  def(OpId::index_select, [](const Tensors& in, const Attributes& a) {
         check_index_dtype(in[1], "index_select", "index");
         return one(at::index_select(in[0], attr_int(a, "dim"), in[1]));
       },
       [](const BackwardArgs& a) -> variable_list {
         return {index_add(zeros_of(meta_sizes(a, 0), a.input_meta[0].options), attr_int(a.attrs, "dim"), In(a, 1), G(a)),
                 Variable()};
       });
  def(OpId::index_add, [](const Tensors& in, const Attributes& a) {
         check_index_dtype(in[1], "index_add", "index");
         return one(at::index_add(in[0], attr_int(a, "dim"), in[1], in[2]));
       },
       [](const BackwardArgs& a) -> variable_list {
         variable_list r{a.needs(0) ? G(a) : Variable(), Variable(), Variable()};
         if (a.needs(2)) {
           Variable s = index_select(G(a), attr_int(a.attrs, "dim"), In(a, 1));
           auto source_sizes = meta_sizes(a, 2);
           if (vec(s.data().sizes()) != source_sizes) s = reshape(s, source_sizes);  // a 0-d source
           r[2] = s;
         }
         return r;
       });

  // ---- shapes and batched products
  def(OpId::permute, [](const Tensors& in, const Attributes& a) {
         return one(at::permute(in[0], attr_ints(a, "dims")));
       },
       [](const BackwardArgs& a) -> variable_list {
         auto dims = attr_ints(a.attrs, "dims");
         const auto rank = static_cast<int64_t>(dims.size());
         std::vector<int64_t> inverse(dims.size());
         for (int64_t i = 0; i < rank; ++i) inverse[at::maybe_wrap_dim(dims[i], rank)] = i;
         return {permute(G(a), inverse)};
       });
  def(OpId::flatten, [](const Tensors& in, const Attributes& a) {
         at::Tensor r = at::flatten(in[0], attr_int(a, "start_dim", 0), attr_int(a, "end_dim", -1));
         // ATen returns the input itself when nothing merges; an op's output is a new tensor.
         if (r.unsafeGetTensorImpl() == in[0].unsafeGetTensorImpl()) r = r.alias();
         return one(std::move(r));
       },
       [](const BackwardArgs& a) -> variable_list { return {reshape(G(a), meta_sizes(a, 0))}; });
  def(OpId::bmm, [](const Tensors& in, const Attributes&) { return one(at::bmm(in[0], in[1])); },
       [](const BackwardArgs& a) -> variable_list {
         return {a.needs(0) ? bmm(G(a), transpose(In(a, 1), 1, 2)) : Variable(),
                 a.needs(1) ? bmm(transpose(In(a, 0), 1, 2), G(a)) : Variable()};
       });

  // ---- reductions and losses (var_backward; binary_cross_entropy_with_logits_backward and
  // its target_backward)
  def(OpId::var, [](const Tensors& in, const Attributes& a) {
         const bool unbiased = attr_bool(a, "unbiased", true), keepdim = attr_bool(a, "keepdim", false);
         if (!find_attr(a, "dim")) return one(at::var(in[0], unbiased));
         return one(at::var(in[0], attr_ints(a, "dim"), unbiased, keepdim));
       },
       [](const BackwardArgs& a) -> variable_list {
         const Variable& x = In(a, 0);
         const double correction = attr_bool(a.attrs, "unbiased", true) ? 1 : 0;
         std::vector<int64_t> dims = find_attr(a.attrs, "dim") ? attr_ints(a.attrs, "dim") : std::vector<int64_t>{};
         const auto rank = static_cast<int64_t>(a.input_meta[0].sizes.size());
         if (dims.empty() || rank == 0) {  // every element
           const double n = static_cast<double>(x.data().numel());
           return {mul(mul(G(a), 2.0 / (n - correction)), sub(x, mean(x)))};
         }
         double n = 1;
         for (int64_t d : dims) n *= static_cast<double>(a.input_meta[0].sizes[at::maybe_wrap_dim(d, rank)]);
         Variable g = unsqueeze_reduced(G(a), dims, rank, attr_bool(a.attrs, "keepdim", false));
         return {mul(mul(g, 2.0 / (n - correction)), sub(x, mean(x, dims, true)))};
       });
  def(OpId::binary_cross_entropy_with_logits, [](const Tensors& in, const Attributes& a) {
         return one(at::binary_cross_entropy_with_logits(in[0], in[1], {}, {}, attr_int(a, "reduction", 1)));
       },
       [](const BackwardArgs& a) -> variable_list {
         const Variable &x = In(a, 0), &t = In(a, 1);
         const int64_t reduction = attr_int(a.attrs, "reduction", 1);
         const double n = static_cast<double>(x.data().numel());
         variable_list r(2);
         if (a.needs(0)) {
           r[0] = mul(sub(sigmoid(x), t), G(a));
           if (reduction == 1) r[0] = div(r[0], n);
         }
         if (a.needs(1)) {
           r[1] = mul(neg(x), G(a));
           if (reduction == 1) r[1] = div(r[1], n);
         }
         return r;
       });

  // ---- randomness: native_dropout's outputs (result, mask) and native_dropout_backward
  def(OpId::dropout, [](const Tensors& in, const Attributes& a) {
         const double p = attr_double(a, "p", 0.5);
         check_dropout_p(p);
         const at::Tensor& x = in[0];
         // No draw where ATen's dropout draws none: eval, p == 0, p == 1, empty input.
         if (!attr_bool(a, "train", true) || p == 0 || x.numel() == 0)
           return Tensors{x.clone(), at::ones_like(x, x.options().dtype(at::kBool))};
         if (p == 1)
           return Tensors{at::mul(x, at::zeros({}, x.options())), at::zeros_like(x, x.options().dtype(at::kBool))};
         auto [result, mask] = at::native_dropout(x, p, true);
         return Tensors{std::move(result), std::move(mask)};
       },
       [](const BackwardArgs& a) -> variable_list {
         if (!G(a).defined()) return {Variable()};
         const bool train = attr_bool(a.attrs, "train", true);
         const double p = attr_double(a.attrs, "p", 0.5);
         return {mul(mul(G(a), Out(a, 1)), train ? dropout_scale(p) : 1.0)};
       });
}

}  // namespace detail::ops_impl

// ------------------------------------------------------------------ free functions
STAGEJIT_FUNC Variable gelu(const Variable& input, std::string approximate) {
  SJ_OP(gelu);
  if (approximate == "none") return detail::ops_impl::run1(d, {input});
  return detail::ops_impl::run1(d, {input}, {{"approximate", std::move(approximate)}});
}
STAGEJIT_FUNC Variable erf(const Variable& input) { SJ_OP(erf); return detail::ops_impl::run1(d, {input}); }
STAGEJIT_FUNC Variable silu(const Variable& input) { SJ_OP(silu); return detail::ops_impl::run1(d, {input}); }
STAGEJIT_FUNC Variable softplus(const Variable& input, double beta, double threshold) {
  SJ_OP(softplus);
  return detail::ops_impl::run1(d, {input}, {{"beta", beta}, {"threshold", threshold}});
}
STAGEJIT_FUNC Variable elu(const Variable& input, double alpha) { SJ_OP(elu); return detail::ops_impl::run1(d, {input}, {{"alpha", alpha}}); }
STAGEJIT_FUNC Variable leaky_relu(const Variable& input, double negative_slope) {
  SJ_OP(leaky_relu);
  return detail::ops_impl::run1(d, {input}, {{"negative_slope", negative_slope}});
}
STAGEJIT_FUNC Variable logsumexp(const Variable& input, std::vector<int64_t> dims, bool keepdim) {
  SJ_OP(logsumexp);
  return detail::ops_impl::run1(d, {input}, {{"dim", std::move(dims)}, {"keepdim", keepdim}});
}
STAGEJIT_FUNC Variable embedding(const Variable& weight, const Variable& indices) {
  SJ_OP(embedding);
  return detail::ops_impl::run1(d, {weight, indices});
}
STAGEJIT_FUNC Variable index_select(const Variable& input, int64_t dim, const Variable& index) {
  SJ_OP(index_select);
  return detail::ops_impl::run1(d, {input, index}, {{"dim", dim}});
}
STAGEJIT_FUNC Variable index_add(const Variable& input, int64_t dim, const Variable& index, const Variable& source) {
  SJ_OP(index_add);
  return detail::ops_impl::run1(d, {input, index, source}, {{"dim", dim}});
}
STAGEJIT_FUNC Variable permute(const Variable& input, std::vector<int64_t> dims) {
  SJ_OP(permute);
  return detail::ops_impl::run1(d, {input}, {{"dims", std::move(dims)}});
}
STAGEJIT_FUNC Variable flatten(const Variable& input, int64_t start_dim, int64_t end_dim) {
  SJ_OP(flatten);
  return detail::ops_impl::run1(d, {input}, {{"start_dim", start_dim}, {"end_dim", end_dim}});
}
STAGEJIT_FUNC Variable bmm(const Variable& a, const Variable& b) { SJ_OP(bmm); return detail::ops_impl::run1(d, {a, b}); }
STAGEJIT_FUNC Variable var(const Variable& input, std::vector<int64_t> dims, bool unbiased, bool keepdim) {
  SJ_OP(var);
  return detail::ops_impl::run1(d, {input}, {{"dim", std::move(dims)}, {"unbiased", unbiased}, {"keepdim", keepdim}});
}
STAGEJIT_FUNC Variable binary_cross_entropy_with_logits(const Variable& input, const Variable& target) {
  SJ_OP(binary_cross_entropy_with_logits);
  return detail::ops_impl::run1(d, {input, target});
}
STAGEJIT_FUNC Variable dropout(const Variable& input, double p, bool train) {
  detail::ops_impl::check_dropout_p(p);
  STAGEJIT_CHECK(input.defined(), "op 'dropout': input 0 is undefined");
  if (!train || p == 0 || input.data().numel() == 0) return input;  // ATen's identity cases
  SJ_OP(dropout);
  return ops::apply(d, {input}, {{"p", p}, {"train", train}})[0];
}

}  // namespace stagejit

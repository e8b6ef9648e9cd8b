#pragma once
/// \file
/// The differentiable op table (include/stagejit/ops/): each op's forward and backward,
/// and the table access of ops/ops.hpp (`ops::def`, `ops::find`, `ops::apply`, ...).
/// Forwards call ATen; backward formulas are written with stagejit ops so that they are
/// differentiable again and reported to the trace hook. Formulas follow libtorch 1.13's
/// derivatives.yaml (same operations in the same order, so results agree to rounding).
/// The entries of the ops for models are in ops/nn-inl.hpp and ops/tensor_ops-inl.hpp.
///
/// Function bodies (core/config.hpp): compiled once in src/compiled_bodies.cpp, or
/// inline in every translation unit of a header-only build.
#include <stagejit/core/config.hpp>
#include <stagejit/ops/detail/ops_impl.hpp>
#include <stagejit/autograd/function.hpp>
#include <stagejit/autograd/grad_mode.hpp>
#include <stagejit/autograd/trace_hook.hpp>
#include <stagejit/autograd/variable.hpp>
#include <stagejit/core/aten_dispatch.hpp>
#include <stagejit/core/aten_error.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/core/memory/host_allocator.hpp>
#include <stagejit/core/torch_compat.hpp>
#include <stagejit/ops/op_def.hpp>
#include <stagejit/ops/ops.hpp>
#include <stagejit/ops/small_gemm.hpp>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>  // at::AutoDispatchBelowADInplaceOrView
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <unordered_map>

namespace stagejit {
namespace detail::ops_impl {

STAGEJIT_FUNC std::vector<int64_t> vec(at::IntArrayRef r) { return std::vector<int64_t>(r.begin(), r.end()); }
STAGEJIT_FUNC std::vector<int64_t> meta_sizes(const BackwardArgs& a, std::size_t i) {
  return std::vector<int64_t>(a.input_meta[i].sizes.begin(), a.input_meta[i].sizes.end());
}

// Backward of a slice of length `len` at `start` along `dim` (narrow, select): `g` padded
// with zeros to the input's sizes.
STAGEJIT_FUNC Variable pad_slice(const BackwardArgs& a, const Variable& g, int64_t dim, int64_t start, int64_t len) {
  auto sizes = meta_sizes(a, 0);
  variable_list parts;
  if (start > 0) {
    auto s = sizes;
    s[dim] = start;
    parts.push_back(zeros_of(s, a.input_meta[0].options));
  }
  parts.push_back(g);
  if (sizes[dim] - start - len > 0) {
    auto s = sizes;
    s[dim] = sizes[dim] - start - len;
    parts.push_back(zeros_of(s, a.input_meta[0].options));
  }
  return parts.size() == 1 ? g : cat(parts, dim);
}

// Backward of a split into pieces along `dim` (chunk, split): the pieces' gradients
// concatenated, zeros for pieces without one. Pieces have length `step` (the last
// smaller) or, when `lengths` is given, those lengths.
STAGEJIT_FUNC Variable cat_pieces(const BackwardArgs& a, int64_t dim, int64_t step,
                                  const std::vector<int64_t>& lengths) {
  auto sizes = meta_sizes(a, 0);
  variable_list parts;
  for (std::size_t i = 0; i < a.grads.size(); ++i) {
    if (a.grads[i].defined()) {
      parts.push_back(a.grads[i]);
    } else {
      auto s = sizes;
      s[dim] = lengths.empty() ? std::min(step, sizes[dim] - static_cast<int64_t>(i) * step) : lengths.at(i);
      parts.push_back(zeros_of(s, a.input_meta[0].options));
    }
  }
  return cat(parts, dim);
}

// The dimension `cross` works on: `dim` (wrapped to the broadcast rank), else the first
// of size 3 of the first input (ATen's deprecated default, _default_cross_dim).
STAGEJIT_FUNC int64_t cross_dim(const Attributes& a, at::IntArrayRef x, at::IntArrayRef y) {
  const int64_t rank = static_cast<int64_t>(std::max(x.size(), y.size()));
  if (find_attr(a, "dim")) return at::maybe_wrap_dim(attr_int(a, "dim"), rank);
  for (std::size_t d = 0; d < x.size(); ++d)
    if (x[d] == 3) return static_cast<int64_t>(d);
  throw ShapeError(detail::str_cat("cross: no dimension of size 3 in the first input's sizes ", x, " and no dim given"));
}

// ------------------------------------------------------------------ forwards
STAGEJIT_FUNC Tensors one(at::Tensor t) { return {std::move(t)}; }

// Note [Scalar arithmetic without TensorIterator]
// `x op s` for a scalar s (add and sub with alpha 1, rsub with alpha 1, mul, div), computed
// as ATen computes it on the CPU: s cast to x's dtype, then one IEEE operation per element
// (libtorch 1.13's add/sub/mul/div_true kernels; add with alpha 1 is a + b, and fmadd(b, 1,
// a) rounds the same). ATen wraps s in a 0-dim tensor (double, or int64 for an integer),
// casts it to x's dtype and builds a TensorIterator. Measured (one thread, float): a
// [1000, 1] times 0.5 takes 3.6 us in at::mul and 1.0 us here; a [10000, 1], 3.8-4.2 us
// and 2.2-2.6 us. The eager ops
// between compiled calls (a loss's `0.01 * g`, a mean's backward dividing by N, the
// backward of a scalar product) make dozens of these a step, on tensors of a few to a few
// thousand elements (perf of bench/higher_order's maml, staged: 0.1 ms of a 1.5 ms step).
// Taken only for float or double CPU tensors (plain values: no lazy negation, ZeroTensor
// or names) that are dense, one element broadcast (an expand of a mean's gradient) or
// strided along dimension 0, their only one of more than one element (a column of a
// matrix), with their size-1 dimensions where ATen's result is contiguous too (see
// scalar_arith), and at most 32 768 elements (ATen's grain size, about where it starts to
// split work between threads); not under -ffast-math. Anything else returns nullopt and
// goes to ATen.
enum class ScalarArith { add, sub, rsub, mul, div };
// ATen's at::internal::GRAIN_SIZE (32 768 in libtorch 1.13 and 2.x).
inline constexpr int64_t kScalarArithMaxNumel = 32768;

// 16-byte lanes (GCC and Clang vector extensions): the loops below are vectorised at -O2,
// where GCC's cheap cost model would leave them scalar.
template <class T> struct Lanes;
template <> struct Lanes<float> { typedef float V __attribute__((vector_size(16))); };
template <> struct Lanes<double> { typedef double V __attribute__((vector_size(16))); };

// out[i] = f(x[i]) for a generic `f` that takes a lane vector or a T.
template <class T, class F>
inline void map_lanes(const T* __restrict x, T* __restrict out, int64_t n, F f) {
  using V = typename Lanes<T>::V;
  constexpr int64_t L = static_cast<int64_t>(sizeof(V) / sizeof(T));
  int64_t i = 0;
  for (; i + 2 * L <= n; i += 2 * L) {
    V a, b;
    std::memcpy(&a, x + i, sizeof(V));
    std::memcpy(&b, x + i + L, sizeof(V));
    a = f(a);
    b = f(b);
    std::memcpy(out + i, &a, sizeof(V));
    std::memcpy(out + i + L, &b, sizeof(V));
  }
  for (; i < n; ++i) out[i] = f(x[i]);
}

template <class T>
inline void scalar_arith_loop(const T* x, T s, T* out, int64_t n, ScalarArith op) {
  switch (op) {
    case ScalarArith::add: map_lanes(x, out, n, [s](auto v) { return v + s; }); break;
    case ScalarArith::sub: map_lanes(x, out, n, [s](auto v) { return v - s; }); break;
    case ScalarArith::rsub: map_lanes(x, out, n, [s](auto v) { return s - v; }); break;
    case ScalarArith::mul: map_lanes(x, out, n, [s](auto v) { return v * s; }); break;
    case ScalarArith::div: map_lanes(x, out, n, [s](auto v) { return v / s; }); break;
  }
}

// True when `t` is a plain tensor whose memory `data_ptr` reads as its values: storage,
// no ZeroTensor, no lazy negation or conjugation, no names (as small_mm checks).
STAGEJIT_FUNC bool plain_cpu_values(const at::Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.layout() == at::kStrided && t.has_storage() &&
         !t._is_zerotensor() && !t.is_neg() && !t.is_conj() && !t.has_names();
}

STAGEJIT_FUNC std::optional<at::Tensor> scalar_arith(const at::Tensor& x, const at::Scalar& s, ScalarArith op,
                                                     const at::Scalar& alpha = at::Scalar(1.0)) {
#ifdef __FAST_MATH__
  // -ffast-math may turn v / s into v * (1 / s): no longer ATen's values.
  return std::nullopt;
#endif
  const at::ScalarType dt = x.scalar_type();
  if ((dt != at::kFloat && dt != at::kDouble) || !plain_cpu_values(x)) return std::nullopt;
  // An integer beyond 2^53 would round twice through double; ATen casts it once.
  constexpr int64_t kExact = int64_t{1} << 53;
  if (!(s.isFloatingPoint() || (s.isIntegral(false) && s.toLong() >= -kExact && s.toLong() <= kExact)) ||
      !(alpha.isFloatingPoint() || alpha.isIntegral(false)) || alpha.toDouble() != 1.0)
    return std::nullopt;
  const int64_t n = x.numel();
  if (n == 0 || n > kScalarArithMaxNumel) return std::nullopt;
  // Taken: dense (every dimension of more than one element at its contiguous stride); one
  // element broadcast (all of them at stride 0); or dimension 0 alone of more than one
  // element, at any stride (a column of a matrix: narrow(du, 1, 0, 1)). Every dimension of
  // size 1 must sit at stride 0 or at its contiguous stride: ATen orders its result's
  // dimensions by the input's strides, size-1 ones included (TensorIterator's
  // reorder_dimensions), and only then is its result contiguous, as this one is.
  bool ones_in_place = true, dense = true, broadcast_one = true;
  int64_t spread = 0, step = 1, line_dim = -1, expect = 1;
  for (int64_t d = x.dim() - 1; d >= 0; --d) {
    const int64_t size = x.size(d), stride = x.stride(d);
    if (size == 1) {
      ones_in_place = ones_in_place && (stride == 0 || stride == expect);
    } else {
      dense = dense && stride == expect;
      broadcast_one = broadcast_one && stride == 0;
      ++spread;
      step = stride;
      line_dim = d;
    }
    expect *= size;
  }
  const bool strided_line = !broadcast_one && spread == 1 && line_dim == 0 && step > 1;
  if (!ones_in_place || (!dense && !broadcast_one && !strided_line)) return std::nullopt;
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  auto run = [&](auto zero) {
    using T = decltype(zero);
    const T sv = static_cast<T>(s.toDouble());
    const T* xp = x.data_ptr<T>();
    T* op_ = out.data_ptr<T>();
    if (broadcast_one) {
      T v;
      scalar_arith_loop<T>(xp, sv, &v, 1, op);
      std::fill_n(op_, n, v);
    } else if (strided_line) {
      for (int64_t i = 0; i < n; ++i) scalar_arith_loop<T>(xp + i * step, sv, op_ + i, 1, op);
    } else {
      scalar_arith_loop<T>(xp, sv, op_, n, op);
    }
  };
  if (dt == at::kFloat) run(float{});
  else run(double{});
  return out;
}

// cat of contiguous float or double CPU tensors of one dtype and rank, equal sizes but
// along `dim`: each input's rows copied into place, an element at a time where a row is
// short. Narrow's backward pads a gradient column with zeros through cat (pad_slice): a
// PINN's u_t, u_x and u_xx are columns of a [N, 2] input gradient, and ATen's serial cat
// copied a [10000, 1] and a zero column in about 0.1 ms, branching on every element (perf
// of bench/higher_order's burgers, staged: 0.36 ms of a 22 ms step); this loop copies the
// same values in place. Taken where ATen itself copies serially (at most its grain size of
// elements, or one ATen thread), for plain values (see plain_cpu_values) and where ATen's
// result is contiguous too (no input suggesting channels-last); anything else returns
// nullopt and goes to at::cat.
STAGEJIT_FUNC std::optional<at::Tensor> cat_contiguous(const Tensors& in, int64_t dim_attr) {
  if (in.empty() || !in[0].defined()) return std::nullopt;
  const at::Tensor& first = in[0];
  const at::ScalarType dt = first.scalar_type();
  const int64_t rank = first.dim();
  if ((dt != at::kFloat && dt != at::kDouble) || rank == 0) return std::nullopt;
  const int64_t dim = at::maybe_wrap_dim(dim_attr, rank);
  int64_t along = 0;
  for (const at::Tensor& t : in) {
    if (!plain_cpu_values(t) || t.scalar_type() != dt || t.dim() != rank || !t.is_contiguous())
      return std::nullopt;
    // ATen's cat makes a channels-last result when every input suggests one; a 4-D or 5-D
    // tensor can be contiguous and suggest it (a size-1 channel dimension).
    if (rank >= 4 && t.suggest_memory_format() != at::MemoryFormat::Contiguous) return std::nullopt;
    for (int64_t d = 0; d < rank; ++d)
      if (d != dim && t.size(d) != first.size(d)) return std::nullopt;
    along += t.size(dim);
  }
  std::vector<int64_t> sizes(first.sizes().begin(), first.sizes().end());
  sizes[static_cast<std::size_t>(dim)] = along;
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= sizes[static_cast<std::size_t>(d)];
  for (int64_t d = dim + 1; d < rank; ++d) inner *= sizes[static_cast<std::size_t>(d)];
  const int64_t numel = outer * along * inner;
  if (numel > kScalarArithMaxNumel && at::get_num_threads() != 1) return std::nullopt;
  at::Tensor out = at::empty(sizes, first.options().memory_format(at::MemoryFormat::Contiguous));
  if (numel == 0) return out;
  auto run = [&](auto zero) {
    using T = decltype(zero);
    T* o = out.data_ptr<T>();
    const int64_t row = along * inner;
    int64_t offset = 0;
    for (const at::Tensor& t : in) {
      const int64_t w = t.size(dim) * inner;
      const T* x = t.data_ptr<T>();
      if (w == 1) {
        for (int64_t r = 0; r < outer; ++r) o[r * row + offset] = x[r];
      } else if (w > 0) {
        for (int64_t r = 0; r < outer; ++r) std::memcpy(o + r * row + offset, x + r * w, sizeof(T) * std::size_t(w));
      }
      offset += w;
    }
  };
  if (dt == at::kFloat) run(float{});
  else run(double{});
  return out;
}

// ------------------------------------------------------------------ backward helpers
STAGEJIT_FUNC const Variable& G(const BackwardArgs& a, std::size_t i) { return a.grads[i]; }
STAGEJIT_FUNC const Variable& In(const BackwardArgs& a, std::size_t i) { return a.inputs[i]; }
STAGEJIT_FUNC const Variable& Out(const BackwardArgs& a, std::size_t i) { return a.outputs[i]; }

// Gradients of mm(m1, m2) with respect to m1 and m2, as libtorch's mm_mat1_backward /
// mm_mat2_backward compute them: when the matrix was column-major (a transposed view, as
// `t(W)` in a linear layer), the gradient is computed in that layout, so the gradient of
// the parameter behind it comes out contiguous and an optimizer update reads it in order.
STAGEJIT_FUNC bool column_major(const Variable& m) {
  const at::Tensor& d = m.data();
  return d.dim() == 2 && d.stride(0) == 1 && d.stride(1) == d.size(0);
}
// `a @ b` for the mm op: thin shapes through LIBXSMM (ops/small_gemm.hpp), else ATen.
STAGEJIT_FUNC at::Tensor matrix_product(const at::Tensor& a, const at::Tensor& b) {
  if (auto p = ops::small_mm(a, b)) return *p;
  return at::mm(a, b);
}

STAGEJIT_FUNC Variable mm_mat1_grad(const Variable& g, const Variable& m1, const Variable& m2) {
  return column_major(m1) ? t(mm(m2, t(g))) : mm(g, t(m2));
}
STAGEJIT_FUNC Variable mm_mat2_grad(const Variable& g, const Variable& m1, const Variable& m2) {
  return column_major(m2) ? t(mm(t(g), m1)) : mm(t(m1), g);
}

STAGEJIT_FUNC Variable reduce_backward(const BackwardArgs& a) {
  auto sizes = meta_sizes(a, 0);
  Variable g = G(a);
  if (!find_attr(a.attrs, "dim")) return expand(g, sizes);
  auto dims = attr_ints(a.attrs, "dim");
  const int64_t nd = static_cast<int64_t>(sizes.size());
  if (!attr_bool(a.attrs, "keepdim", false)) {
    for (auto& d : dims) d = at::maybe_wrap_dim(d, nd);
    std::sort(dims.begin(), dims.end());
    for (int64_t d : dims) g = unsqueeze(g, d);
  }
  return expand(g, sizes);
}

STAGEJIT_FUNC double reduced_count(const BackwardArgs& a) {
  auto sizes = meta_sizes(a, 0);
  if (!find_attr(a.attrs, "dim")) {
    double n = 1;
    for (auto s : sizes) n *= static_cast<double>(s);
    return n;
  }
  double n = 1;
  for (auto d : attr_ints(a.attrs, "dim"))
    n *= static_cast<double>(sizes[at::maybe_wrap_dim(d, static_cast<int64_t>(sizes.size()))]);
  return n;
}

// The table, indexed by OpId: each op's schema (ops/op_schema.hpp) with its forward and
// backward formula. Every id gets exactly one entry (checked when the table is built).
// The ops for models add their entries from their own files (define_nn_ops,
// define_tensor_ops: ops/detail/ops_impl.hpp).
STAGEJIT_FUNC std::array<OpDef, num_ops> build_table() {
  std::array<OpDef, num_ops> table{};
  std::array<bool, num_ops> filled{};
  auto def = [&](OpId id, decltype(OpDef::forward) forward, decltype(OpDef::backward) backward) {
    const auto i = static_cast<std::size_t>(id);
    if (filled[i]) throw Error(detail::str_cat("op table: op '", op_name(id), "' is defined twice"));
    filled[i] = true;
    table[i] = OpDef{op_schema(id), forward, backward};
  };

  // ---- arithmetic (scalar forms: one input plus attribute `other`)
  def(OpId::add, [](const Tensors& in, const Attributes& a) {
         auto alpha = attr_scalar(a, "alpha", 1.0);
         if (in.size() == 2) return one(at::add(in[0], in[1], alpha));
         const at::Scalar other = attr_scalar(a, "other");
         if (auto r = scalar_arith(in[0], other, ScalarArith::add, alpha)) return one(std::move(*r));
         return one(at::add(in[0], other, alpha));
       },
       [](const BackwardArgs& a) -> variable_list {
         double alpha = attr_double(a.attrs, "alpha", 1);
         variable_list r{G(a)};
         if (a.grads.size() && a.input_meta.size() == 2 && a.needs(1))
           r.push_back(alpha == 1 ? G(a) : mul(G(a), alpha));
         return r;
       });
  def(OpId::sub, [](const Tensors& in, const Attributes& a) {
         auto alpha = attr_scalar(a, "alpha", 1.0);
         if (in.size() == 2) return one(at::sub(in[0], in[1], alpha));
         const at::Scalar other = attr_scalar(a, "other");
         if (auto r = scalar_arith(in[0], other, ScalarArith::sub, alpha)) return one(std::move(*r));
         return one(at::sub(in[0], other, alpha));
       },
       [](const BackwardArgs& a) -> variable_list {
         double alpha = attr_double(a.attrs, "alpha", 1);
         variable_list r{G(a)};
         if (a.input_meta.size() == 2 && a.needs(1)) r.push_back(mul(G(a), -alpha));
         return r;
       });
  def(OpId::rsub, [](const Tensors& in, const Attributes& a) {
         auto alpha = attr_scalar(a, "alpha", 1.0);
         if (in.size() == 2) return one(at::rsub(in[0], in[1], alpha));
         const at::Scalar other = attr_scalar(a, "other");
         if (auto r = scalar_arith(in[0], other, ScalarArith::rsub, alpha)) return one(std::move(*r));
         return one(at::rsub(in[0], other, alpha));
       },
       [](const BackwardArgs& a) -> variable_list {
         double alpha = attr_double(a.attrs, "alpha", 1);
         variable_list r{a.needs(0) ? mul(G(a), -alpha) : Variable()};
         if (a.input_meta.size() == 2) r.push_back(G(a));
         return r;
       });
  def(OpId::mul, [](const Tensors& in, const Attributes& a) {
         if (in.size() == 2) return one(at::mul(in[0], in[1]));
         const at::Scalar other = attr_scalar(a, "other");
         if (auto r = scalar_arith(in[0], other, ScalarArith::mul)) return one(std::move(*r));
         return one(at::mul(in[0], other));
       },
       [](const BackwardArgs& a) -> variable_list {
         if (a.input_meta.size() == 1) return {mul(G(a), attr_double(a.attrs, "other", 1))};
         return {a.needs(0) ? mul(G(a), In(a, 1)) : Variable(),
                 a.needs(1) ? mul(G(a), In(a, 0)) : Variable()};
       });
  def(OpId::div, [](const Tensors& in, const Attributes& a) {
         if (in.size() == 2) return one(at::div(in[0], in[1]));
         const at::Scalar other = attr_scalar(a, "other");
         if (auto r = scalar_arith(in[0], other, ScalarArith::div)) return one(std::move(*r));
         return one(at::div(in[0], other));
       },
       [](const BackwardArgs& a) -> variable_list {
         if (a.input_meta.size() == 1) return {div(G(a), attr_double(a.attrs, "other", 1))};
         return {a.needs(0) ? div(G(a), In(a, 1)) : Variable(),
                 a.needs(1) ? mul(neg(G(a)), div(div(In(a, 0), In(a, 1)), In(a, 1))) : Variable()};
       });

  // ---- unary elementwise
  def(OpId::neg, SJ_UNARY(neg),
       [](const BackwardArgs& a) -> variable_list { return {neg(G(a))}; });
  def(OpId::exp, SJ_UNARY(exp),
       [](const BackwardArgs& a) -> variable_list { return {mul(G(a), Out(a))}; });
  def(OpId::log, SJ_UNARY(log),
       [](const BackwardArgs& a) -> variable_list { return {div(G(a), In(a, 0))}; });
  def(OpId::tanh, SJ_UNARY(tanh),
       [](const BackwardArgs& a) -> variable_list {
         return {mul(G(a), rsub(mul(Out(a), Out(a)), 1.0))};
       });
  def(OpId::sigmoid, SJ_UNARY(sigmoid),
       [](const BackwardArgs& a) -> variable_list {
         return {mul(mul(G(a), rsub(Out(a), 1.0)), Out(a))};
       });
  def(OpId::relu, SJ_UNARY(relu),
       [](const BackwardArgs& a) -> variable_list {
         return {masked_fill(G(a), le(Out(a), 0.0), 0.0)};
       });
  def(OpId::sqrt, SJ_UNARY(sqrt),
       [](const BackwardArgs& a) -> variable_list { return {div(G(a), mul(Out(a), 2.0))}; });
  def(OpId::rsqrt, SJ_UNARY(rsqrt),
       [](const BackwardArgs& a) -> variable_list {
         return {mul(mul(G(a), -0.5), pow(Out(a), 3.0))};
       });
  def(OpId::abs, SJ_UNARY(abs),
       [](const BackwardArgs& a) -> variable_list { return {mul(G(a), sign(In(a, 0)))}; });
  def(OpId::sin, SJ_UNARY(sin),
       [](const BackwardArgs& a) -> variable_list { return {mul(G(a), cos(In(a, 0)))}; });
  def(OpId::cos, SJ_UNARY(cos),
       [](const BackwardArgs& a) -> variable_list { return {mul(G(a), neg(sin(In(a, 0))))}; });
  def(OpId::reciprocal, SJ_UNARY(reciprocal),
       [](const BackwardArgs& a) -> variable_list { return {mul(neg(G(a)), mul(Out(a), Out(a)))}; });
  def(OpId::sign, SJ_UNARY(sign), nullptr);
  def(OpId::pow, [](const Tensors& in, const Attributes& a) {
         return one(in.size() == 2 ? at::pow(in[0], in[1]) : at::pow(in[0], attr_scalar(a, "exponent")));
       },
       [](const BackwardArgs& a) -> variable_list {
         if (a.input_meta.size() == 1) {
           double e = attr_double(a.attrs, "exponent", 1);
           if (e == 0) return {zeros_like(In(a, 0))};
           return {mul(G(a), mul(pow(In(a, 0), e - 1), e))};
         }
         const Variable &x = In(a, 0), &e = In(a, 1);
         variable_list r(2);
         if (a.needs(0))
           r[0] = masked_fill(mul(G(a), mul(e, pow(x, sub(e, 1.0)))), eq(e, 0.0), 0.0);
         if (a.needs(1))
           r[1] = mul(G(a), masked_fill(mul(Out(a), log(x)), logical_and(eq(x, 0.0), ge(e, 0.0)), 0.0));
         return r;
       });
  def(OpId::maximum, [](const Tensors& in, const Attributes&) { return one(at::maximum(in[0], in[1])); },
       [](const BackwardArgs& a) -> variable_list {
         Variable tie = where(eq(In(a, 0), In(a, 1)), mul(G(a), 0.5), G(a));
         return {a.needs(0) ? masked_fill(tie, lt(In(a, 0), In(a, 1)), 0.0) : Variable(),
                 a.needs(1) ? masked_fill(tie, gt(In(a, 0), In(a, 1)), 0.0) : Variable()};
       });
  def(OpId::minimum, [](const Tensors& in, const Attributes&) { return one(at::minimum(in[0], in[1])); },
       [](const BackwardArgs& a) -> variable_list {
         Variable tie = where(eq(In(a, 0), In(a, 1)), mul(G(a), 0.5), G(a));
         return {a.needs(0) ? masked_fill(tie, gt(In(a, 0), In(a, 1)), 0.0) : Variable(),
                 a.needs(1) ? masked_fill(tie, lt(In(a, 0), In(a, 1)), 0.0) : Variable()};
       });
  def(OpId::clamp, [](const Tensors& in, const Attributes& a) {
         c10::optional<at::Scalar> lo, hi;
         if (find_attr(a, "min")) lo = attr_scalar(a, "min");
         if (find_attr(a, "max")) hi = attr_scalar(a, "max");
         return one(at::clamp(in[0], lo, hi));
       },
       [](const BackwardArgs& a) -> variable_list {
         auto lo = attr_opt_double(a.attrs, "min"), hi = attr_opt_double(a.attrs, "max");
         const Variable& x = In(a, 0);
         // The gradient passes where the input is inside the bounds. At a bound itself:
         // libtorch up to 2.13 passes it (the closed interval), from 2.14 it does not (the
         // minimum-norm subgradient, pytorch/pytorch#191142; measured: 2.13.0 gives 1 at
         // x == min and x == max, 2.14.1 and 2.15.0 give 0). stagejit follows the
         // libtorch it is built against (core/torch_compat.hpp).
#if STAGEJIT_TORCH_VERSION_AT_LEAST(2, 14)
         auto above = [](const Variable& v, double b) { return gt(v, b); };
         auto below = [](const Variable& v, double b) { return lt(v, b); };
#else
         auto above = [](const Variable& v, double b) { return ge(v, b); };
         auto below = [](const Variable& v, double b) { return le(v, b); };
#endif
         Variable cond;
         if (lo && hi) cond = logical_and(above(x, *lo), below(x, *hi));
         else if (lo) cond = above(x, *lo);
         else if (hi) cond = below(x, *hi);
         else return {G(a)};
         return {where(cond, G(a), zeros_like(G(a)))};
       });
  def(OpId::where, [](const Tensors& in, const Attributes&) { return one(at::where(in[0], in[1], in[2])); },
       [](const BackwardArgs& a) -> variable_list {
         Variable z = zeros_like(G(a));
         return {Variable(), a.needs(1) ? where(In(a, 0), G(a), z) : Variable(),
                 a.needs(2) ? where(In(a, 0), z, G(a)) : Variable()};
       });
  def(OpId::masked_fill, [](const Tensors& in, const Attributes& a) {
         return one(at::masked_fill(in[0], in[1], attr_scalar(a, "value")));
       },
       [](const BackwardArgs& a) -> variable_list {
         return {masked_fill(G(a), In(a, 1), 0.0), Variable()};
       });

  // ---- comparisons and helpers (not differentiable)
#define SJ_CMP(NAME, OPSTR)                                                                  \
  def(OpId::NAME, \
       [](const Tensors& in, const Attributes& a) {                                          \
         return one(in.size() == 2 ? at::NAME(in[0], in[1]) : at::NAME(in[0], attr_scalar(a, "other"))); \
       },                                                                                    \
       nullptr);
  SJ_CMP(eq, "==")
  SJ_CMP(ne, "!=")
  SJ_CMP(lt, "<")
  SJ_CMP(le, "<=")
  SJ_CMP(gt, ">")
  SJ_CMP(ge, ">=")
#undef SJ_CMP
  def(OpId::logical_and, [](const Tensors& in, const Attributes&) { return one(at::logical_and(in[0], in[1])); },
       nullptr);
  def(OpId::zeros_like, [](const Tensors& in, const Attributes&) { return one(at::zeros_like(in[0], at::MemoryFormat::Preserve)); },
       nullptr);
  def(OpId::ones_like, [](const Tensors& in, const Attributes&) { return one(at::ones_like(in[0], at::MemoryFormat::Preserve)); },
       nullptr);
  def(OpId::zeros, [](const Tensors&, const Attributes& a) {
         auto dtype = static_cast<at::ScalarType>(attr_int(a, "dtype"));
         at::Device dev(at::kCPU);
         if (const Scalar* s = find_attr(a, "device")) {
           auto* str = std::get_if<std::string>(s);
           STAGEJIT_CHECK(str, "attribute 'device' must be a string");
           dev = at::Device(*str);
         }
         return one(at::zeros(attr_ints(a, "size"), at::TensorOptions().dtype(dtype).device(dev)));
       },
       nullptr);
  def(OpId::to, [](const Tensors& in, const Attributes& a) {
         return one(in[0].to(static_cast<at::ScalarType>(attr_int(a, "dtype"))));
       },
       [](const BackwardArgs& a) -> variable_list { return {G(a)}; }  // cast back by the caller
      );

  // ---- linear algebra
  def(OpId::mm, [](const Tensors& in, const Attributes&) { return one(matrix_product(in[0], in[1])); },
       [](const BackwardArgs& a) -> variable_list {
         return {a.needs(0) ? mm_mat1_grad(G(a), In(a, 0), In(a, 1)) : Variable(),
                 a.needs(1) ? mm_mat2_grad(G(a), In(a, 0), In(a, 1)) : Variable()};
       });
  def(OpId::matmul, [](const Tensors& in, const Attributes&) { return one(at::matmul(in[0], in[1])); },
       [](const BackwardArgs& a) -> variable_list {
         const Variable &x = In(a, 0), &y = In(a, 1);
         Variable x2 = x.dim() == 1 ? unsqueeze(x, 0) : x;
         Variable y2 = y.dim() == 1 ? unsqueeze(y, -1) : y;
         Variable g = G(a);
         if (y.dim() == 1) g = unsqueeze(g, -1);
         if (x.dim() == 1) g = unsqueeze(g, -2);
         variable_list r(2);
         if (x2.dim() == 2 && y2.dim() == 2) {  // a plain matrix product: as mm
           if (a.needs(0)) {
             Variable gx = mm_mat1_grad(g, x2, y2);
             r[0] = x.dim() == 1 ? reshape(gx, vec(x.sizes())) : gx;
           }
           if (a.needs(1)) {
             Variable gy = mm_mat2_grad(g, x2, y2);
             r[1] = y.dim() == 1 ? reshape(gy, vec(y.sizes())) : gy;
           }
           return r;
         }
         if (a.needs(0)) {
           Variable gx = sum_to_size(matmul(g, transpose(y2, -1, -2)), vec(x2.sizes()));
           r[0] = x.dim() == 1 ? reshape(gx, vec(x.sizes())) : gx;
         }
         if (a.needs(1)) {
           Variable gy = sum_to_size(matmul(transpose(x2, -1, -2), g), vec(y2.sizes()));
           r[1] = y.dim() == 1 ? reshape(gy, vec(y.sizes())) : gy;
         }
         return r;
       });
  def(OpId::addmm, [](const Tensors& in, const Attributes& a) {
         const double beta = attr_double(a, "beta", 1), alpha = attr_double(a, "alpha", 1);
         // alpha = 0: ATen does not read the matrices (BLAS's contract): no fast path.
         if (auto p = alpha == 0 ? std::nullopt : ops::small_mm(in[1], in[2]);
             p && at::is_expandable_to(in[0].sizes(), p->sizes()) && in[0].scalar_type() == p->scalar_type()) {
           // beta * self + alpha * product, in place on the fresh product.
           if (alpha != 1) p->mul_(alpha);
           if (beta == 0) return one(*p);  // as ATen: self is ignored, NaN and all
           return one(p->add_(in[0], beta));
         }
         return one(at::addmm(in[0], in[1], in[2], attr_scalar(a, "beta", 1.0), attr_scalar(a, "alpha", 1.0)));
       },
       [](const BackwardArgs& a) -> variable_list {
         double beta = attr_double(a.attrs, "beta", 1), alpha = attr_double(a.attrs, "alpha", 1);
         variable_list r(3);
         if (a.needs(0)) r[0] = beta == 1 ? G(a) : mul(G(a), beta);
         if (a.needs(1)) {
           r[1] = mm_mat1_grad(G(a), In(a, 1), In(a, 2));
           if (alpha != 1) r[1] = mul(r[1], alpha);
         }
         if (a.needs(2)) {
           r[2] = mm_mat2_grad(G(a), In(a, 1), In(a, 2));
           if (alpha != 1) r[2] = mul(r[2], alpha);
         }
         return r;
       });

  // ---- shape ops
  def(OpId::t, [](const Tensors& in, const Attributes&) { return one(at::t(in[0])); },
       [](const BackwardArgs& a) -> variable_list { return {t(G(a))}; });
  def(OpId::transpose, [](const Tensors& in, const Attributes& a) {
         return one(at::transpose(in[0], attr_int(a, "dim0"), attr_int(a, "dim1")));
       },
       [](const BackwardArgs& a) -> variable_list {
         return {transpose(G(a), attr_int(a.attrs, "dim0"), attr_int(a.attrs, "dim1"))};
       });
  def(OpId::reshape, [](const Tensors& in, const Attributes& a) { return one(at::reshape(in[0], attr_ints(a, "shape"))); },
       [](const BackwardArgs& a) -> variable_list { return {reshape(G(a), meta_sizes(a, 0))}; });
  def(OpId::view, [](const Tensors& in, const Attributes& a) { return one(in[0].view(attr_ints(a, "size"))); },
       [](const BackwardArgs& a) -> variable_list { return {reshape(G(a), meta_sizes(a, 0))}; });
  def(OpId::expand, [](const Tensors& in, const Attributes& a) { return one(in[0].expand(attr_ints(a, "size"))); },
       [](const BackwardArgs& a) -> variable_list { return {sum_to_size(G(a), meta_sizes(a, 0))}; });
  def(OpId::unsqueeze, [](const Tensors& in, const Attributes& a) { return one(at::unsqueeze(in[0], attr_int(a, "dim"))); },
       [](const BackwardArgs& a) -> variable_list { return {squeeze(G(a), attr_int(a.attrs, "dim"))}; });
  def(OpId::squeeze, [](const Tensors& in, const Attributes& a) {
         return one(find_attr(a, "dim") ? at::squeeze(in[0], attr_int(a, "dim")) : at::squeeze(in[0]));
       },
       [](const BackwardArgs& a) -> variable_list { return {reshape(G(a), meta_sizes(a, 0))}; });

  // ---- reductions
  def(OpId::sum, [](const Tensors& in, const Attributes& a) {
         if (!find_attr(a, "dim")) return one(at::sum(in[0]));
         return one(at::sum(in[0], attr_ints(a, "dim"), attr_bool(a, "keepdim", false)));
       },
       [](const BackwardArgs& a) -> variable_list { return {reduce_backward(a)}; });
  def(OpId::mean, [](const Tensors& in, const Attributes& a) {
         if (!find_attr(a, "dim")) return one(at::mean(in[0]));
         return one(at::mean(in[0], attr_ints(a, "dim"), attr_bool(a, "keepdim", false)));
       },
       [](const BackwardArgs& a) -> variable_list { return {div(reduce_backward(a), reduced_count(a))}; });
  def(OpId::sum_to_size, [](const Tensors& in, const Attributes& a) { return one(in[0].sum_to_size(attr_ints(a, "size"))); },
       [](const BackwardArgs& a) -> variable_list { return {expand(G(a), meta_sizes(a, 0))}; });
  def(OpId::chunk, [](const Tensors& in, const Attributes& a) {
         return at::chunk(in[0], attr_int(a, "chunks"), attr_int(a, "dim", 0));
       },
       [](const BackwardArgs& a) -> variable_list {
         auto sizes = meta_sizes(a, 0);
         int64_t dim = at::maybe_wrap_dim(attr_int(a.attrs, "dim", 0), static_cast<int64_t>(sizes.size()));
         int64_t chunks = attr_int(a.attrs, "chunks");
         return {cat_pieces(a, dim, (sizes[dim] + chunks - 1) / chunks)};
       });
  def(OpId::split, [](const Tensors& in, const Attributes& a) {
         const Scalar& s = need_attr(a, "split_size");
         if (std::holds_alternative<std::vector<int64_t>>(s))
           return at::split_with_sizes(in[0], std::get<std::vector<int64_t>>(s), attr_int(a, "dim", 0));
         return at::split(in[0], attr_int(a, "split_size"), attr_int(a, "dim", 0));
       },
       [](const BackwardArgs& a) -> variable_list {
         auto sizes = meta_sizes(a, 0);
         int64_t dim = at::maybe_wrap_dim(attr_int(a.attrs, "dim", 0), static_cast<int64_t>(sizes.size()));
         const Scalar& s = need_attr(a.attrs, "split_size");
         if (auto* list = std::get_if<std::vector<int64_t>>(&s)) return {cat_pieces(a, dim, 0, *list)};
         return {cat_pieces(a, dim, attr_int(a.attrs, "split_size"))};
       });
  def(OpId::select, [](const Tensors& in, const Attributes& a) {
         return one(in[0].select(attr_int(a, "dim"), attr_int(a, "index")));
       },
       [](const BackwardArgs& a) -> variable_list {
         auto sizes = meta_sizes(a, 0);
         int64_t dim = at::maybe_wrap_dim(attr_int(a.attrs, "dim"), static_cast<int64_t>(sizes.size()));
         int64_t index = attr_int(a.attrs, "index");
         if (index < 0) index += sizes[dim];
         return {pad_slice(a, unsqueeze(G(a), dim), dim, index, 1)};
       });
  def(OpId::cat, [](const Tensors& in, const Attributes& a) {
         const int64_t dim = attr_int(a, "dim", 0);
         if (auto r = cat_contiguous(in, dim)) return one(std::move(*r));
         return one(at::cat(in, dim));
       },
       [](const BackwardArgs& a) -> variable_list {
         const Variable& g = G(a);
         int64_t dim = at::maybe_wrap_dim(attr_int(a.attrs, "dim", 0), g.dim());
         variable_list r(a.input_meta.size());
         int64_t offset = 0;
         for (std::size_t i = 0; i < a.input_meta.size(); ++i) {
           const auto& s = a.input_meta[i].sizes;
           if (s.size() == 1 && s[0] == 0 && g.dim() != 1) continue;  // legacy empty input
           int64_t len = s[dim];
           if (a.needs(i)) r[i] = narrow(g, dim, offset, len);
           offset += len;
         }
         return r;
       });
  def(OpId::narrow, [](const Tensors& in, const Attributes& a) {
         return one(in[0].narrow(attr_int(a, "dim"), attr_int(a, "start"), attr_int(a, "length")));
       },
       [](const BackwardArgs& a) -> variable_list {
         auto sizes = meta_sizes(a, 0);
         int64_t dim = at::maybe_wrap_dim(attr_int(a.attrs, "dim"), static_cast<int64_t>(sizes.size()));
         int64_t start = attr_int(a.attrs, "start");
         if (start < 0) start += sizes[dim];
         return {pad_slice(a, G(a), dim, start, attr_int(a.attrs, "length"))};
       });
  def(OpId::threshold, [](const Tensors& in, const Attributes& a) {
         return one(at::threshold(in[0], attr_scalar(a, "threshold"), attr_scalar(a, "value")));
       },
       [](const BackwardArgs& a) -> variable_list {
         return {masked_fill(G(a), le(In(a, 0), attr_double(a.attrs, "threshold", 0)), 0.0)};
       });
  def(OpId::cross, [](const Tensors& in, const Attributes& a) {
         return one(at::cross(in[0], in[1], cross_dim(a, in[0].sizes(), in[1].sizes())));
       },
       [](const BackwardArgs& a) -> variable_list {
         int64_t dim = cross_dim(a.attrs, a.input_meta[0].sizes, a.input_meta[1].sizes);
         variable_list r(2);
         if (a.needs(0)) r[0] = sum_to_size(cross(In(a, 1), G(a), dim), meta_sizes(a, 0));
         if (a.needs(1)) r[1] = sum_to_size(cross(G(a), In(a, 0), dim), meta_sizes(a, 1));
         return r;
       });

  // ---- softmax and losses
  def(OpId::softmax, [](const Tensors& in, const Attributes& a) { return one(at::softmax(in[0], attr_int(a, "dim"))); },
       [](const BackwardArgs& a) -> variable_list {
         int64_t dim = attr_int(a.attrs, "dim");
         return {mul(Out(a), sub(G(a), sum(mul(G(a), Out(a)), {dim}, true)))};
       });
  def(OpId::log_softmax, [](const Tensors& in, const Attributes& a) { return one(at::log_softmax(in[0], attr_int(a, "dim"))); },
       [](const BackwardArgs& a) -> variable_list {
         int64_t dim = attr_int(a.attrs, "dim");
         return {sub(G(a), mul(exp(Out(a)), sum(G(a), {dim}, true)))};
       });
  def(OpId::nll_loss, [](const Tensors& in, const Attributes& a) {
         return one(at::nll_loss(in[0], in[1], {}, attr_int(a, "reduction", 1),
                                 attr_int(a, "ignore_index", -100)));
       },
       [](const BackwardArgs& a) -> variable_list {
         Attributes attrs{{"reduction", attr_int(a.attrs, "reduction", 1)},
                          {"ignore_index", attr_int(a.attrs, "ignore_index", -100)}};
         return {ops::apply(ops::def(OpId::nll_loss_backward), {G(a), In(a, 0), In(a, 1)}, attrs)[0],
                 Variable()};
       });
  def(OpId::nll_loss_backward, [](const Tensors& in, const Attributes& a) {
         int64_t reduction = attr_int(a, "reduction", 1), ignore = attr_int(a, "ignore_index", -100);
         auto total_weight = std::get<1>(at::nll_loss_forward(in[1], in[2], {}, reduction, ignore));
         return one(at::nll_loss_backward(in[0], in[1], in[2], {}, reduction, ignore, total_weight));
       },
       [](const BackwardArgs& a) -> variable_list {
         // Linear in grad_output: its gradient is nll_loss of the incoming gradient.
         Attributes attrs{{"reduction", attr_int(a.attrs, "reduction", 1)},
                          {"ignore_index", attr_int(a.attrs, "ignore_index", -100)}};
         return {ops::apply(ops::def(OpId::nll_loss), {G(a), In(a, 2)}, attrs)[0], Variable(), Variable()};
       });
  def(OpId::mse_loss, [](const Tensors& in, const Attributes& a) {
         return one(at::mse_loss(in[0], in[1], attr_int(a, "reduction", 1)));
       },
       [](const BackwardArgs& a) -> variable_list {
         int64_t reduction = attr_int(a.attrs, "reduction", 1);
         double norm = reduction == 1 ? 2.0 / static_cast<double>(In(a, 0).numel()) : 2.0;
         Variable d = mul(mul(sub(In(a, 0), In(a, 1)), norm), G(a));
         return {a.needs(0) ? d : Variable(), a.needs(1) ? neg(d) : Variable()};
       });
  define_nn_ops(def);
  define_tensor_ops(def);
  for (std::size_t i = 0; i < num_ops; ++i)
    if (!filled[i])
      throw Error(detail::str_cat("op table: op '", op_schemas[i].name, "' has no forward"));
  return table;
}

struct Table {
  std::array<OpDef, num_ops> defs;
  std::vector<const OpDef*> all;
  Table() : defs(build_table()) {
    for (const auto& d : defs) all.push_back(&d);
  }
};

STAGEJIT_FUNC const Table& table() {
  static const Table t;
  return t;
}

STAGEJIT_FUNC Variable zeros_of(std::vector<int64_t> size, const at::TensorOptions& o) {
  Attributes attrs{{"size", std::move(size)},
                   {"dtype", static_cast<int64_t>(o.dtype().toScalarType())}};
  if (!o.device().is_cpu()) attrs.emplace_back("device", o.device().str());
  static const OpDef& d = ops::def(OpId::zeros);
  return ops::apply(d, {}, attrs)[0];
}

}  // namespace detail::ops_impl

// ------------------------------------------------------------------ table access
namespace ops {

STAGEJIT_FUNC const OpDef& def(OpId id) {
  STAGEJIT_CHECK(id != OpId::unknown, "ops::def: OpId::unknown names no op of the table");
  return stagejit::detail::ops_impl::table().defs[static_cast<std::size_t>(id)];
}

STAGEJIT_FUNC const OpDef& def(const OpSchema& schema) {
  STAGEJIT_CHECK(schema.id != OpId::unknown, "unknown op '", schema.name, "'");
  return def(schema.id);
}

STAGEJIT_FUNC const OpDef* find(std::string_view name) noexcept {
  const OpId id = op_id(name);
  return id == OpId::unknown ? nullptr : &stagejit::detail::ops_impl::table().defs[static_cast<std::size_t>(id)];
}

STAGEJIT_FUNC const OpDef& get(std::string_view name) {
  const OpDef* d = find(name);
  STAGEJIT_CHECK(d, "unknown op '", name, "'");
  return *d;
}

STAGEJIT_FUNC const std::vector<const OpDef*>& all() { return stagejit::detail::ops_impl::table().all; }

STAGEJIT_FUNC std::vector<at::Tensor> run_forward(const OpDef& op, const std::vector<at::Tensor>& inputs,
                                    const Attributes& attrs) {
  const int n = static_cast<int>(inputs.size());
  STAGEJIT_CHECK(n >= op.min_inputs && (op.max_inputs < 0 || n <= op.max_inputs), "op '",
                 op.name, "': expected ",
                 op.min_inputs == op.max_inputs ? std::to_string(op.min_inputs)
                 : op.max_inputs < 0 ? "at least " + std::to_string(op.min_inputs)
                                     : std::to_string(op.min_inputs) + " to " + std::to_string(op.max_inputs),
                 " inputs, got ", n);
  try {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    // Note [Eager ops allocate from the host cache]: once compile() has installed the host
    // cache (core/memory/host_allocator.hpp), the tensors of stagejit's own ops come from
    // it too, not only those of compiled stages. A staged program's loss runs eagerly
    // between compiled calls, on tensors the size of the batch: bench/higher_order's
    // forces_silu in double (F of [2000, 12], 192 KB) spent a quarter of its eager ops'
    // time zero-filling pages that glibc had just mapped or trimmed. Programs that never
    // compile keep c10's allocator (the scope changes nothing before the install), and a
    // stage compiled with `cache_host_memory` off runs in a NoHostCacheScope.
    memory::HostCacheScope host_cache(!memory::NoHostCacheScope::active());
    return op.forward(inputs, attrs);
  } catch (const c10::Error& e) {
    rethrow_aten_error(e, detail::str_cat("op '", op.name, "': "));
  } catch (const ShapeError&) {
    throw;
  } catch (const DtypeError&) {
    throw;
  } catch (const Error& e) {
    throw Error(detail::str_cat("op '", op.name, "': ", e.what()));
  }
}

STAGEJIT_FUNC variable_list apply(const OpDef& op, const variable_list& inputs, const Attributes& attrs) {
  std::vector<at::Tensor> tensors;
  tensors.reserve(inputs.size());
  bool any_requires_grad = false;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    STAGEJIT_CHECK(inputs[i].defined(), "op '", op.name, "': input ", i, " is undefined");
    tensors.push_back(inputs[i].data());
    any_requires_grad = any_requires_grad || inputs[i].requires_grad();
  }
  std::vector<at::Tensor> outs = run_forward(op, tensors, attrs);
  // A view shares its base's version counter, as ATen's ADInplaceOrView kernels (which
  // run_forward skips) make it, so a saved view sees an in-place change of its base.
  for (auto& o : outs) share_version_counter_with_base(o, tensors);
  variable_list results;
  results.reserve(outs.size());
  if (any_requires_grad && op.differentiable && op.backward && GradMode::is_enabled()) {
    OpBackward ob;
    ob.op = &op;
    ob.attrs = attrs;
    std::vector<Edge> edges;
    edges.reserve(inputs.size());
    ob.input_meta.reserve(inputs.size());
    if (op.saved_inputs) ob.saved_inputs.resize(inputs.size());
    TraceHook* hook = current_trace_hook();
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      edges.push_back(hook ? hook->gradient_edge_of(inputs[i]) : inputs[i].gradient_edge());
      ob.input_meta.push_back(InputMeta{at::DimVector(tensors[i].sizes()), tensors[i].options()});
      if (i < 64 && ((op.saved_inputs >> i) & 1U)) ob.saved_inputs[i] = SavedVariable(inputs[i], false);
    }
    auto fn = make_function(std::move(ob), std::move(edges), static_cast<uint32_t>(outs.size()));
    for (std::size_t i = 0; i < outs.size(); ++i) {
      bool floating = at::isFloatingType(outs[i].scalar_type()) || at::isComplexType(outs[i].scalar_type());
      results.emplace_back(std::move(outs[i]), floating ? Edge{fn, static_cast<uint32_t>(i)} : Edge{});
    }
    if (op.saves_outputs) {
      auto& saved = std::get<OpBackward>(fn->kind).saved_outputs;
      for (const auto& r : results) saved.emplace_back(r, true);
    }
  } else {
    for (auto& o : outs) results.emplace_back(std::move(o));
  }
  if (TraceHook* hook = current_trace_hook()) hook->record_op(op, attrs, inputs, results);
  return results;
}

}  // namespace ops

}  // namespace stagejit

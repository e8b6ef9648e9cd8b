#pragma once
/// \file
/// Internals of the fusion code generator, in two dialects. CPU: per-op C++ expressions over `sjk::Vec<T>`
/// (ATen `Vectorized<T>`), built from the op table's `fusion_template` (finalised: operands
/// and attributes substituted, numeric literals turned into `V(T(x))`, math functions
/// mapped to Vectorized members) or overridden where ATen's CPU kernels differ from the
/// template's scalar C form (fmadd for add/sub/rsub, NaN-propagating clamp/relu/maximum/
/// minimum, pow's special exponents, comparisons yielding 1/0, blends for where/masked_fill
/// and the piecewise activations softplus/elu/leaky_relu, GELU's tanh form).
/// CUDA: scalar expressions in the compute type `T`, one thread per element, following
/// ATen's CUDA kernels. The overrides of both dialects are one table (`op_forms()`: per op,
/// its CPU form and its CUDA form), read by `op_expression`.
///
/// This header declares; the bodies (the op table of forms among them) are in
/// fusion/detail/codegen_ops-inl.hpp, compiled once (core/config.hpp).

#include <stagejit/core/config.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/ops/op_schema.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <cctype>
#include <optional>
#include <cmath>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

namespace stagejit::fusion::detail {

/// Helpers emitted before each generated kernel, after the prelude, inside the kernel's own
/// namespace (`sjk_unit_<hash>`, src/fusion_cpu.cpp): its `sjf` hides any `::sjf`, so a
/// helper that must reach the prelude's functions calls them by `sjk::` (tanh, erf).
inline constexpr std::string_view kernel_helpers = R"HELPERS(#include <limits>
// Unary minus: libtorch 1.13's Vectorized has none; 2.x's (Vectorized<T>, more
// specialised) wins overload resolution over this fallback where it exists.
template <class X>
inline auto operator-(const X& a) -> decltype(a.neg()) { return a.neg(); }
namespace sjf {
template <class X> inline X exp(const X& a) { return a.exp(); }
template <class X> inline X log(const X& a) { return a.log(); }
template <class X> inline X tanh(const X& a) { return sjk::tanh(a); }
template <class X> inline X sqrt(const X& a) { return a.sqrt(); }
template <class X> inline X sin(const X& a) { return a.sin(); }
template <class X> inline X cos(const X& a) { return a.cos(); }
template <class X> inline X fabs(const X& a) { return a.abs(); }
template <class X> inline X pow(const X& a, const X& b) { return a.pow(b); }
template <class X> inline X erf(const X& a) { return sjk::erf(a); }
template <class X> inline X expm1(const X& a) { return a.expm1(); }
template <class X> inline X log1p(const X& a) { return a.log1p(); }
/// ATen's sign kernel: (0 < a) - (a < 0), 0 for NaN.
template <class X> inline X sign(const X& a) {
  const X zero(0), one(1);
  return X::blendv(zero, one, zero < a) - X::blendv(zero, one, a < zero);
}
}  // namespace sjf
)HELPERS";

/// Helpers emitted before each generated CUDA kernel (after the CUDA prelude): the math
/// functions of the op templates as `sjf_*` overloads for float and double (no fast-math
/// forms: `tanhf` is exact to a few ulp and saturates to +-1), NaN and infinity.
inline constexpr std::string_view cuda_kernel_helpers = R"HELPERS(
template <class T> __device__ __forceinline__ T sj_nan();
template <> __device__ __forceinline__ float sj_nan<float>() { return __int_as_float(0x7fc00000); }
template <> __device__ __forceinline__ double sj_nan<double>() { return __longlong_as_double(0x7ff8000000000000LL); }
template <class T> __device__ __forceinline__ T sj_inf();
template <> __device__ __forceinline__ float sj_inf<float>() { return __int_as_float(0x7f800000); }
template <> __device__ __forceinline__ double sj_inf<double>() { return __longlong_as_double(0x7ff0000000000000LL); }
#define SJ_MATH1(name, f, d) \
  __device__ __forceinline__ float sjf_##name(float a) { return f(a); } \
  __device__ __forceinline__ double sjf_##name(double a) { return d(a); }
SJ_MATH1(exp, expf, exp)
SJ_MATH1(log, logf, log)
SJ_MATH1(tanh, tanhf, tanh)
SJ_MATH1(sqrt, sqrtf, sqrt)
SJ_MATH1(rsqrt, rsqrtf, rsqrt)
SJ_MATH1(sin, sinf, sin)
SJ_MATH1(cos, cosf, cos)
SJ_MATH1(fabs, fabsf, fabs)
SJ_MATH1(erf, erff, erf)
SJ_MATH1(log1p, log1pf, log1p)
#undef SJ_MATH1
__device__ __forceinline__ float sjf_pow(float a, float b) { return powf(a, b); }
__device__ __forceinline__ double sjf_pow(double a, double b) { return pow(a, b); }
/// ATen's CUDA clamp: NaN stays NaN.
template <class T> __device__ __forceinline__ T sj_clamp_min(T a, T lo) { return a != a ? a : (a < lo ? lo : a); }
template <class T> __device__ __forceinline__ T sj_clamp_max(T a, T hi) { return a != a ? a : (a > hi ? hi : a); }
)HELPERS";

/// `V(T(x))` (CPU) or `T(x)` (CUDA) for a double, with NaN and infinities spelled
/// through numeric_limits (CPU) or `sj_nan<T>()`/`sj_inf<T>()` (CUDA).
STAGEJIT_FUNC std::string literal(double x, bool cuda = false);

/// Attribute `key` of `op` as a double (int attributes converted), if present.
STAGEJIT_FUNC std::optional<double> number_attribute(const ir::Op& op, std::string_view key);

/// Whether `op` (a gelu) uses the tanh approximation: its string attribute `approximate`
/// is "tanh" (absent or "none": the exact form); any other value is a FusionError.
STAGEJIT_FUNC bool gelu_tanh_form(const ir::Op& op);

/// GELU's tanh form, `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`, as ATen's kernels
/// compute it, with `x` an operand expression, `lit` the dialect's literal and `tanh_fn`
/// its tanh.
template <class Lit>
inline std::string gelu_tanh_expression(const std::string& x, Lit lit, const std::string& tanh_fn) {
  const double beta = M_SQRT2 * M_2_SQRTPI * 0.5, kappa = 0.044715;
  const std::string cube = "(" + x + " * " + x + " * " + x + ")";
  return "(" + lit(0.5) + " * " + x + " * (" + lit(1) + " + " + tanh_fn + "(" + lit(beta) + " * (" + x + " + " +
         lit(kappa) + " * " + cube + "))))";
}

/// Fills an op table template: `$k` -> operands[k], `$name` -> the attribute as a literal,
/// numbers -> literals, `exp(`/`log(`/... -> `sjf::` helpers (CPU) or `sjf_` overloads
/// (`cuda`). Throws FusionError for a function the dialect lacks, and on the CPU for a
/// comparison or ternary (the Vectorized form cannot express them; the CUDA dialect is
/// scalar and keeps them).
STAGEJIT_FUNC std::string finalise_template(std::string_view tpl, const ir::Op& op,
                                            const std::vector<std::string>& operands, bool cuda = false);

/// Whether the ATen in use computes ELU's negative side with expm1 (libtorch from
/// pytorch#173968, early 2026) rather than exp - 1 (1.13 and the versions before): probed
/// once on a double of -1e-20, where exp(x) - 1 is 0 and expm1(x) is not.
STAGEJIT_FUNC bool aten_elu_uses_expm1();

/// `node` as an elementwise op of the table, or a FusionError saying why it cannot be
/// fused (not an op, an unknown op, not elementwise); shared by both dialects.
STAGEJIT_FUNC const ir::Op& fusable_op(const ir::Node& node);

STAGEJIT_FUNC void check_operand_count(const std::string& name, size_t have, size_t want);

/// One op's expression being built in one dialect: the op, its operands (C++ expressions
/// of type V on the CPU, of the compute type T in CUDA; `scalar_second` may add one) and
/// whether they are boolean, and the result's booleanness to set.
struct OpExpression {
  const ir::Op& op;
  std::string name;
  std::vector<std::string> a;
  const std::vector<bool>& operand_bool;
  bool& result_bool;
  bool cuda;

  /// `x` as a literal of the dialect.
  std::string lit(double x) const { return literal(x, cuda); }
  std::optional<double> attr(std::string_view key) const { return number_attribute(op, key); }
  void need(size_t n) const { check_operand_count(name, a.size(), n); }
  /// Scalar forms: the attribute `other` (or `exponent`) is the second operand.
  void scalar_second(std::string_view key);
};

/// An op's expression in one dialect, or nullopt for the op table's template (finalised
/// on `e.a`). Throws FusionError for ops the dialect cannot express.
using OpForm = std::optional<std::string> (*)(OpExpression& e);

/// The ops whose expression is not (only) the op table's template, with their form in the
/// CPU dialect (ATen `Vectorized<T>`, as ATen's CPU kernels compute) and in the CUDA
/// dialect (scalar, as ATen's CUDA kernels compute); a null form is the template.
struct OpForms {
  std::vector<OpId> ops;
  OpForm cpu;
  OpForm cuda;
};

/// The table of op expressions, one entry per op (or per family of ops sharing a form);
/// an op not listed is its template in both dialects.
STAGEJIT_FUNC const std::vector<OpForms>& op_forms();

/// The entry of `id` in `op_forms()`, or null (the template in both dialects).
STAGEJIT_FUNC const OpForms* op_forms_of(OpId id);

/// The expression computing `node` (an elementwise Op) from `operands`, and whether its
/// result is boolean (stored as 1/0 in T). `operand_bool` tells which operands are boolean.
/// CPU dialect (`cuda` false): C++ expressions of type V (`sjk::Vec<T>`, ATen
/// `Vectorized<T>`) with ATen's CPU semantics. CUDA dialect: a scalar expression of type
/// `T` (the compute type; operands of type T, booleans held as 1/0) with ATen's CUDA
/// semantics: `a + alpha * b` for add/sub/rsub, NaN-propagating relu/clamp/maximum/
/// minimum, pow's special exponents (ATen's pow_tensor_scalar), `rsqrt`, comparisons and
/// logical_and yielding 1/0, selects for where/masked_fill/threshold; literals are `T(x)`.
/// The form is the op's entry of `op_forms()`, else the op table's template. Throws
/// FusionError for ops the dialect cannot express (`to`, non-elementwise or unknown ops).
STAGEJIT_FUNC std::string op_expression(const ir::Node& node, const std::vector<std::string>& operands,
                                        const std::vector<bool>& operand_bool, bool& result_bool, bool cuda = false);

}  // namespace stagejit::fusion::detail

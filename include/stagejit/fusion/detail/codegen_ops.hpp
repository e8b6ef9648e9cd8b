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

#include <stagejit/core/detail/bodies_begin.hpp>
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

/// Helpers emitted before each generated kernel (global namespace, after the prelude).
inline constexpr std::string_view kernel_helpers = R"HELPERS(#include <limits>
// Unary minus: libtorch 1.13's Vectorized has none; 2.x's (Vectorized<T>, more
// specialised) wins overload resolution over this fallback where it exists.
template <class X>
inline auto operator-(const X& a) -> decltype(a.neg()) { return a.neg(); }
namespace sjf {
template <class X> inline X exp(const X& a) { return a.exp(); }
template <class X> inline X log(const X& a) { return a.log(); }
template <class X> inline X tanh(const X& a) { return a.tanh(); }
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
inline std::string literal(double x, bool cuda = false) {
  if (cuda) {
    if (std::isnan(x)) return "sj_nan<T>()";
    if (std::isinf(x)) return x > 0 ? "sj_inf<T>()" : "(-sj_inf<T>())";
  } else {
    if (std::isnan(x)) return "V(std::numeric_limits<T>::quiet_NaN())";
    if (std::isinf(x)) return x > 0 ? "V(std::numeric_limits<T>::infinity())" : "V(-std::numeric_limits<T>::infinity())";
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", x);
  return cuda ? std::string("T(") + buf + ")" : std::string("V(T(") + buf + "))";
}

/// Attribute `key` of `op` as a double (int attributes converted), if present.
inline std::optional<double> number_attribute(const ir::Op& op, std::string_view key) {
  if (const ir::AttributeValue* v = op.attribute(key)) {
    if (auto d = ir::attribute_as<double>(*v)) return *d;
    throw FusionError("fusion: attribute '" + std::string(key) + "' of op '" + std::string(op.name()) +
                      "' must be a number, got kind '" + std::string(ir::attribute_kind(*v)) + "'");
  }
  return std::nullopt;
}

/// Whether `op` (a gelu) uses the tanh approximation: its string attribute `approximate`
/// is "tanh" (absent or "none": the exact form); any other value is a FusionError.
inline bool gelu_tanh_form(const ir::Op& op) {
  const ir::AttributeValue* v = op.attribute("approximate");
  if (!v) return false;
  auto s = ir::attribute_as<std::string>(*v);
  if (!s || (*s != "none" && *s != "tanh"))
    throw FusionError("fusion: attribute 'approximate' of op 'gelu' must be the string \"none\" or \"tanh\"");
  return *s == "tanh";
}

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
inline std::string finalise_template(std::string_view tpl, const ir::Op& op, const std::vector<std::string>& operands,
                                     bool cuda = false) {
  std::string out;
  size_t i = 0;
  auto fail = [&](const std::string& why) {
    throw FusionError("fusion: cannot finalise the template '" + std::string(tpl) + "' of op '" +
                      std::string(op.name()) + "': " + why);
  };
  while (i < tpl.size()) {
    const char c = tpl[i];
    if (c == '$') {
      size_t j = i + 1;
      while (j < tpl.size() && (std::isalnum(static_cast<unsigned char>(tpl[j])) || tpl[j] == '_')) ++j;
      const std::string ref(tpl.substr(i + 1, j - i - 1));
      if (!ref.empty() && std::isdigit(static_cast<unsigned char>(ref[0]))) {
        const size_t k = std::stoul(ref);
        if (k >= operands.size()) fail("operand $" + ref + " missing");
        out += operands[k];
      } else {
        auto v = number_attribute(op, ref);
        if (!v) fail("attribute '" + ref + "' missing");
        out += literal(*v, cuda);
      }
      i = j;
    } else if (std::isdigit(static_cast<unsigned char>(c)) || (c == '.' && i + 1 < tpl.size() && std::isdigit(static_cast<unsigned char>(tpl[i + 1])))) {
      size_t j = i;
      while (j < tpl.size() && (std::isalnum(static_cast<unsigned char>(tpl[j])) || tpl[j] == '.')) ++j;
      out += literal(std::stod(std::string(tpl.substr(i, j - i))), cuda);
      i = j;
    } else if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t j = i;
      while (j < tpl.size() && (std::isalnum(static_cast<unsigned char>(tpl[j])) || tpl[j] == '_')) ++j;
      const std::string name(tpl.substr(i, j - i));
      static const std::vector<std::string_view> known = {"exp", "log", "tanh", "sqrt", "sin", "cos", "fabs", "pow",
                                                               "erf", "log1p"};
      if (std::find(known.begin(), known.end(), name) == known.end()) fail("unknown function '" + name + "'");
      out += (cuda ? "sjf_" : "sjf::") + name;
      i = j;
    } else if (!cuda && (c == '?' || c == '<' || c == '>' || c == '=' || c == '!' || c == '&' || c == '|')) {
      fail("comparisons and conditionals need an override");
    } else {
      out += c;
      ++i;
    }
  }
  return out;
}

/// `node` as an elementwise op of the table, or a FusionError saying why it cannot be
/// fused (not an op, an unknown op, not elementwise); shared by both dialects.
/// Whether the ATen in use computes ELU's negative side with expm1 (libtorch from
/// pytorch#173968, early 2026) rather than exp - 1 (1.13 and the versions before): probed
/// once on a double of -1e-20, where exp(x) - 1 is 0 and expm1(x) is not.
inline bool aten_elu_uses_expm1() {
  static const bool uses = [] {
    at::NoGradGuard no_grad;
    return at::elu(at::full({1}, -1e-20, at::TensorOptions().dtype(at::kDouble))).item<double>() != 0.0;
  }();
  return uses;
}

inline const ir::Op& fusable_op(const ir::Node& node) {
  const auto* op = node.get_if<ir::Op>();
  if (!op) throw FusionError("fusion: node #" + std::to_string(node.id()) + " (" + node.describe() + ") is not an op");
  const std::string name(op->name());
  if (op->id() == OpId::unknown)
    throw FusionError("fusion: unknown op '" + name + "' (not in the op table, ops/op_schema.hpp)");
  if (!op->schema().elementwise)
    throw FusionError("fusion: op '" + name + "' is not elementwise and cannot be fused");
  return *op;
}

inline void check_operand_count(const std::string& name, size_t have, size_t want) {
  if (have != want)
    throw FusionError("fusion: op '" + name + "' expects " + std::to_string(want) + " operands here, got " +
                      std::to_string(have));
}

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
  void scalar_second(std::string_view key) {
    if (a.size() == 1) {
      auto v = number_attribute(op, key);
      if (!v) throw FusionError("fusion: op '" + name + "' with one input needs attribute '" + std::string(key) + "'");
      a.push_back(lit(*v));
    }
  }
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
inline const std::vector<OpForms>& op_forms() {
  using R = std::optional<std::string>;
  static const std::vector<OpForms> table = {
      {{OpId::add, OpId::sub, OpId::rsub},
       [](OpExpression& e) -> R {
         e.scalar_second("other");
         e.need(2);
         double alpha = e.attr("alpha").value_or(1.0);
         if (e.op.id() != OpId::add) alpha = -alpha;
         // ATen's vectorised add is fmadd(other, alpha, self); sub is add with -alpha;
         // rsub(self, other) is sub(other, self).
         if (e.op.id() == OpId::rsub) return "at::vec::fmadd(" + e.a[0] + ", " + e.lit(alpha) + ", " + e.a[1] + ")";
         return "at::vec::fmadd(" + e.a[1] + ", " + e.lit(alpha) + ", " + e.a[0] + ")";
       },
       [](OpExpression& e) -> R {
         e.scalar_second("other");
         e.need(2);
         const double alpha = e.attr("alpha").value_or(1.0);
         const std::string scaled = alpha == 1.0 ? "" : e.lit(alpha) + " * ";
         if (e.op.id() == OpId::add) return "(" + e.a[0] + " + " + scaled + e.a[1] + ")";
         if (e.op.id() == OpId::sub) return "(" + e.a[0] + " - " + scaled + e.a[1] + ")";
         return "(" + e.a[1] + " - " + scaled + e.a[0] + ")";
       }},
      {{OpId::mul, OpId::div},
       [](OpExpression& e) -> R {
         e.scalar_second("other");
         return std::nullopt;  // the template
       },
       [](OpExpression& e) -> R {
         e.scalar_second("other");
         return std::nullopt;  // the template
       }},
      {{OpId::pow},
       [](OpExpression& e) -> R {
         if (e.a.size() == 1) {
           // ATen's pow_tensor_scalar special cases.
           const double p = e.attr("exponent").value_or(1.0);
           const std::string& x = e.a[0];
           if (p == 0.5) return x + ".sqrt()";
           if (p == 2) return "(" + x + " * " + x + ")";
           if (p == 3) return "(" + x + " * " + x + " * " + x + ")";
           if (p == -0.5) return x + ".rsqrt()";
           if (p == -1) return x + ".reciprocal()";
           if (p == -2) return "(" + x + " * " + x + ").reciprocal()";
           // Known gap: ATen's scalar tail loop uses the double exponent, its vector loop T(e);
           // we use T(e) everywhere, so float results can differ by a few ulp from eager for
           // exponents not representable in float.
           return x + ".pow(" + e.lit(p) + ")";
         }
         e.need(2);
         return e.a[0] + ".pow(" + e.a[1] + ")";
       },
       [](OpExpression& e) -> R {
         if (e.a.size() == 1) {
           const double p = e.attr("exponent").value_or(1.0);
           const std::string& x = e.a[0];
           if (p == 0.5) return "sjf_sqrt(" + x + ")";
           if (p == 2) return "(" + x + " * " + x + ")";
           if (p == 3) return "(" + x + " * " + x + " * " + x + ")";
           if (p == -0.5) return "sjf_rsqrt(" + x + ")";
           if (p == -1) return "(" + e.lit(1) + " / " + x + ")";
           if (p == -2) return "(" + e.lit(1) + " / (" + x + " * " + x + "))";
           return "sjf_pow(" + x + ", " + e.lit(p) + ")";
         }
         e.need(2);
         return "sjf_pow(" + e.a[0] + ", " + e.a[1] + ")";
       }},
      {{OpId::rsqrt},
       nullptr,
       [](OpExpression& e) -> R {
         e.need(1);
         return "sjf_rsqrt(" + e.a[0] + ")";
       }},
      {{OpId::relu},
       [](OpExpression& e) -> R {
         e.need(1);
         return "at::vec::clamp_min(" + e.a[0] + ", " + e.lit(0) + ")";
       },
       [](OpExpression& e) -> R {
         e.need(1);
         return "sj_clamp_min(" + e.a[0] + ", " + e.lit(0) + ")";
       }},
      {{OpId::clamp},
       [](OpExpression& e) -> R {
         e.need(1);
         auto lo = e.attr("min"), hi = e.attr("max");
         if (lo && hi) return "at::vec::clamp(" + e.a[0] + ", " + e.lit(*lo) + ", " + e.lit(*hi) + ")";
         if (lo) return "at::vec::clamp_min(" + e.a[0] + ", " + e.lit(*lo) + ")";
         if (hi) return "at::vec::clamp_max(" + e.a[0] + ", " + e.lit(*hi) + ")";
         return e.a[0];
       },
       [](OpExpression& e) -> R {
         e.need(1);
         auto lo = e.attr("min"), hi = e.attr("max");
         std::string x = e.a[0];
         if (lo) x = "sj_clamp_min(" + x + ", " + e.lit(*lo) + ")";
         if (hi) x = "sj_clamp_max(" + x + ", " + e.lit(*hi) + ")";
         return x;
       }},
      {{OpId::maximum, OpId::minimum},
       [](OpExpression& e) -> R {
         e.need(2);
         return "at::vec::" + e.name + "(" + e.a[0] + ", " + e.a[1] + ")";
       },
       nullptr},
      {{OpId::sign},
       [](OpExpression& e) -> R {
         e.need(1);
         return "sjf::sign(" + e.a[0] + ")";
       },
       [](OpExpression& e) -> R {
         e.need(1);
         return "T((" + e.lit(0) + " < " + e.a[0] + ") - (" + e.a[0] + " < " + e.lit(0) + "))";
       }},
      {{OpId::eq, OpId::ne, OpId::lt, OpId::le, OpId::gt, OpId::ge},
       [](OpExpression& e) -> R {
         // Vectorized's comparison members of the same names yield 1/0.
         e.scalar_second("other");
         e.need(2);
         e.result_bool = true;
         return e.a[0] + "." + e.name + "(" + e.a[1] + ")";
       },
       [](OpExpression& e) -> R {
         e.scalar_second("other");
         e.need(2);
         e.result_bool = true;
         static const char* const ops[] = {"==", "!=", "<", "<=", ">", ">="};
         const OpId id = e.op.id();
         const int k = id == OpId::eq ? 0 : id == OpId::ne ? 1 : id == OpId::lt ? 2
                     : id == OpId::le ? 3 : id == OpId::gt ? 4 : 5;
         return "T(" + e.a[0] + " " + ops[k] + " " + e.a[1] + ")";
       }},
      {{OpId::logical_and},
       [](OpExpression& e) -> R {
         e.need(2);
         e.result_bool = true;
         return "(" + e.a[0] + ".ne(" + e.lit(0) + ") * " + e.a[1] + ".ne(" + e.lit(0) + "))";
       },
       [](OpExpression& e) -> R {
         e.need(2);
         e.result_bool = true;
         return "T(" + e.a[0] + " != " + e.lit(0) + " && " + e.a[1] + " != " + e.lit(0) + ")";
       }},
      {{OpId::where},
       [](OpExpression& e) -> R {
         e.need(3);
         e.result_bool = e.operand_bool[1] && e.operand_bool[2];
         return "V::blendv(" + e.a[2] + ", " + e.a[1] + ", " + e.a[0] + " != " + e.lit(0) + ")";
       },
       [](OpExpression& e) -> R {
         e.need(3);
         e.result_bool = e.operand_bool[1] && e.operand_bool[2];
         return "(" + e.a[0] + " != " + e.lit(0) + " ? " + e.a[1] + " : " + e.a[2] + ")";
       }},
      {{OpId::masked_fill},
       [](OpExpression& e) -> R {
         e.need(2);
         auto v = e.attr("value");
         if (!v) throw FusionError("fusion: op 'masked_fill' needs attribute 'value'");
         e.result_bool = e.operand_bool[0];
         return "V::blendv(" + e.a[0] + ", " + e.lit(*v) + ", " + e.a[1] + " != " + e.lit(0) + ")";
       },
       [](OpExpression& e) -> R {
         e.need(2);
         auto v = e.attr("value");
         if (!v) throw FusionError("fusion: op 'masked_fill' needs attribute 'value'");
         e.result_bool = e.operand_bool[0];
         return "(" + e.a[1] + " != " + e.lit(0) + " ? " + e.lit(*v) + " : " + e.a[0] + ")";
       }},
      {{OpId::threshold},
       [](OpExpression& e) -> R {
         e.need(1);
         auto thr = e.attr("threshold"), v = e.attr("value");
         if (!thr || !v) throw FusionError("fusion: op 'threshold' needs attributes 'threshold' and 'value'");
         // ATen's kernel: x <= threshold ? value : x (a NaN compares false and stays).
         return "V::blendv(" + e.a[0] + ", " + e.lit(*v) + ", " + e.a[0] + " <= " + e.lit(*thr) + ")";
       },
       [](OpExpression& e) -> R {
         e.need(1);
         auto thr = e.attr("threshold"), v = e.attr("value");
         if (!thr || !v) throw FusionError("fusion: op 'threshold' needs attributes 'threshold' and 'value'");
         return "(" + e.a[0] + " <= " + e.lit(*thr) + " ? " + e.lit(*v) + " : " + e.a[0] + ")";
       }},
      {{OpId::gelu},
       [](OpExpression& e) -> R {
         // Known gap: in float, both forms can differ from ATen's CPU gelu kernel by more than
         // a few ulp in the negative tail (x below about -3, where 1 + erf and 1 + tanh cancel):
         // ATen's kernel evaluates erf / tanh otherwise than Vectorized's members do. Double
         // agrees to rounding (fusion tests: activations_group in double only).
         e.need(1);
         if (gelu_tanh_form(e.op)) return gelu_tanh_expression(e.a[0], [](double x) { return literal(x); }, "sjf::tanh");
         return std::nullopt;  // the template (exact form)
       },
       [](OpExpression& e) -> R {
         e.need(1);
         if (gelu_tanh_form(e.op)) return gelu_tanh_expression(e.a[0], [](double x) { return literal(x, true); }, "sjf_tanh");
         return std::nullopt;  // the template (exact form)
       }},
      {{OpId::softplus},
       [](OpExpression& e) -> R {
         e.need(1);
         // ATen's kernel: beta x > threshold ? x : log1p(exp(beta x)) / beta.
         const std::string beta = e.lit(e.attr("beta").value_or(1.0));
         const std::string thr = e.lit(e.attr("threshold").value_or(20.0));
         const std::string bx = "(" + e.a[0] + " * " + beta + ")";
         return "V::blendv(sjf::log1p(sjf::exp(" + bx + ")) / " + beta + ", " + e.a[0] + ", " + bx + " > " + thr + ")";
       },
       nullptr},
      {{OpId::elu},
       [](OpExpression& e) -> R {
         e.need(1);
         const std::string alpha = e.lit(e.attr("alpha").value_or(1.0));
         // ATen's kernel: x <= 0 ? expm1(x) * alpha : x, or (exp(x) - 1) * alpha in the
         // libtorch versions before pytorch#173968 (1.13 among them): as the ATen in use does.
         const std::string em1 = aten_elu_uses_expm1() ? "sjf::expm1(" + e.a[0] + ")"
                                                       : "(sjf::exp(" + e.a[0] + ") - " + e.lit(1) + ")";
         return "V::blendv(" + e.a[0] + ", " + em1 + " * " + alpha + ", " + e.a[0] + " <= " + e.lit(0) + ")";
       },
       nullptr},
      {{OpId::leaky_relu},
       [](OpExpression& e) -> R {
         e.need(1);
         const std::string slope = e.lit(e.attr("negative_slope").value_or(0.01));
         return "V::blendv(" + e.a[0] + " * " + slope + ", " + e.a[0] + ", " + e.a[0] + " > " + e.lit(0) + ")";
       },
       nullptr},
      {{OpId::to},
       [](OpExpression&) -> R { throw FusionError("fusion: op 'to' (a dtype cast) is not fused"); },
       [](OpExpression&) -> R { throw FusionError("fusion: op 'to' (a dtype cast) is not fused"); }},
  };
  return table;
}

/// The entry of `id` in `op_forms()`, or null (the template in both dialects).
inline const OpForms* op_forms_of(OpId id) {
  for (const OpForms& f : op_forms())
    if (std::find(f.ops.begin(), f.ops.end(), id) != f.ops.end()) return &f;
  return nullptr;
}

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
inline std::string op_expression(const ir::Node& node, const std::vector<std::string>& operands,
                                 const std::vector<bool>& operand_bool, bool& result_bool, bool cuda = false) {
  const ir::Op* op = &fusable_op(node);
  const OpSchema& schema = op->schema();
  OpExpression e{*op, std::string(op->name()), operands, operand_bool, result_bool, cuda};
  result_bool = false;
  if (const OpForms* forms = op_forms_of(op->id())) {
    if (const OpForm form = cuda ? forms->cuda : forms->cpu) {
      if (std::optional<std::string> expr = form(e)) return *std::move(expr);
    }
  }
  if (schema.fusion_template.empty()) throw FusionError("fusion: op '" + e.name + "' has no fusion template");
  return finalise_template(schema.fusion_template, *op, e.a, cuda);
}

}  // namespace stagejit::fusion::detail
#include <stagejit/core/detail/bodies_end.hpp>

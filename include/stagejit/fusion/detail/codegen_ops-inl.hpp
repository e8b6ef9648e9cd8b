#pragma once
/// \file
/// Bodies of fusion/detail/codegen_ops.hpp (core/config.hpp): compiled once in
/// src/compiled_bodies.cpp, or inline in every translation unit of a header-only build.
/// They hold the op table of forms (`op_forms()`) and the template finaliser.
#include <stagejit/core/config.hpp>
#include <stagejit/fusion/detail/codegen_ops.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/ops/op_schema.hpp>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard (not reached through ATen.h in libtorch 2.x)

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace stagejit::fusion::detail {

STAGEJIT_FUNC std::string literal(double x, bool cuda) {
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

STAGEJIT_FUNC std::optional<double> number_attribute(const ir::Op& op, std::string_view key) {
  if (const ir::AttributeValue* v = op.attribute(key)) {
    if (auto d = ir::attribute_as<double>(*v)) return *d;
    throw FusionError("fusion: attribute '" + std::string(key) + "' of op '" + std::string(op.name()) +
                      "' must be a number, got kind '" + std::string(ir::attribute_kind(*v)) + "'");
  }
  return std::nullopt;
}

STAGEJIT_FUNC bool gelu_tanh_form(const ir::Op& op) {
  const ir::AttributeValue* v = op.attribute("approximate");
  if (!v) return false;
  auto s = ir::attribute_as<std::string>(*v);
  if (!s || (*s != "none" && *s != "tanh"))
    throw FusionError("fusion: attribute 'approximate' of op 'gelu' must be the string \"none\" or \"tanh\"");
  return *s == "tanh";
}

STAGEJIT_FUNC std::string finalise_template(std::string_view tpl, const ir::Op& op,
                                            const std::vector<std::string>& operands, bool cuda) {
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

STAGEJIT_FUNC bool aten_elu_uses_expm1() {
  static const bool uses = [] {
    at::NoGradGuard no_grad;
    return at::elu(at::full({1}, -1e-20, at::TensorOptions().dtype(at::kDouble))).item<double>() != 0.0;
  }();
  return uses;
}

STAGEJIT_FUNC const ir::Op& fusable_op(const ir::Node& node) {
  const auto* op = node.get_if<ir::Op>();
  if (!op) throw FusionError("fusion: node #" + std::to_string(node.id()) + " (" + node.describe() + ") is not an op");
  const std::string name(op->name());
  if (op->id() == OpId::unknown)
    throw FusionError("fusion: unknown op '" + name + "' (not in the op table, ops/op_schema.hpp)");
  if (!op->schema().elementwise && op->id() != OpId::zeros_like && op->id() != OpId::ones_like)
    throw FusionError("fusion: op '" + name + "' is not elementwise and cannot be fused");
  return *op;
}

STAGEJIT_FUNC void check_operand_count(const std::string& name, size_t have, size_t want) {
  if (have != want)
    throw FusionError("fusion: op '" + name + "' expects " + std::to_string(want) + " operands here, got " +
                      std::to_string(have));
}

STAGEJIT_FUNC void OpExpression::scalar_second(std::string_view key) {
  if (a.size() == 1) {
    auto v = number_attribute(op, key);
    if (!v) throw FusionError("fusion: op '" + name + "' with one input needs attribute '" + std::string(key) + "'");
    a.push_back(lit(*v));
  }
}

STAGEJIT_FUNC const std::vector<OpForms>& op_forms() {
  using R = std::optional<std::string>;
  const auto fill_literal = [](OpExpression& e) -> R {
    e.need(1);
    e.result_bool = e.operand_bool[0];
    return e.lit(e.op.id() == OpId::ones_like ? 1 : 0);
  };
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
         // Vectorized's comparison members of the same names yield 1/0. Not `ne`: its
         // AVX-512 operator!= in libtorch 1.13 is an ordered compare (_CMP_NEQ_OQ), false
         // for NaN where ATen's ne kernel and IEEE say true; 1 - eq is right everywhere.
         e.scalar_second("other");
         e.need(2);
         e.result_bool = true;
         if (e.op.id() == OpId::ne) return "(" + e.lit(1) + " - " + e.a[0] + ".eq(" + e.a[1] + "))";
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
         // NaN is true (see ne above: no .ne(), no operator!=).
         return "((" + e.lit(1) + " - " + e.a[0] + ".eq(" + e.lit(0) + ")) * (" + e.lit(1) + " - " + e.a[1] + ".eq(" +
                e.lit(0) + ")))";
       },
       [](OpExpression& e) -> R {
         e.need(2);
         e.result_bool = true;
         return "T(" + e.a[0] + " != " + e.lit(0) + " && " + e.a[1] + " != " + e.lit(0) + ")";
       }},
      // zeros_like(x), ones_like(x): x's shape and dtype filled with 0 or 1 (a where's
      // backward writes its untaken branch with zeros; an inner grad call's seed is
      // ones_like(u)); fused, a literal, neither written nor read, in both dialects.
      {{OpId::zeros_like, OpId::ones_like}, fill_literal, fill_literal},
      {{OpId::where},
       [](OpExpression& e) -> R {
         e.need(3);
         e.result_bool = e.operand_bool[1] && e.operand_bool[2];
         // The false branch where the condition equals 0 (a NaN condition is true).
         return "V::blendv(" + e.a[1] + ", " + e.a[2] + ", " + e.a[0] + " == " + e.lit(0) + ")";
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
         return "V::blendv(" + e.lit(*v) + ", " + e.a[0] + ", " + e.a[1] + " == " + e.lit(0) + ")";
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

STAGEJIT_FUNC const OpForms* op_forms_of(OpId id) {
  for (const OpForms& f : op_forms())
    if (std::find(f.ops.begin(), f.ops.end(), id) != f.ops.end()) return &f;
  return nullptr;
}

STAGEJIT_FUNC std::string op_expression(const ir::Node& node, const std::vector<std::string>& operands,
                                        const std::vector<bool>& operand_bool, bool& result_bool, bool cuda) {
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

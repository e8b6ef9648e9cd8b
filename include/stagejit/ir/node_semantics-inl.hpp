#pragma once
/// \file
/// Bodies of ir/node_semantics.hpp (core/config.hpp): compiled once in
/// src/compiled_bodies.cpp, or inline in every translation unit of a header-only build.
#include <stagejit/core/config.hpp>
#include <stagejit/ir/node_semantics.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/core/overloaded.hpp>
#include <stagejit/ir/attributes.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/ir/kinds.hpp>
#include <stagejit/ops/op_def.hpp>

#include <ATen/ATen.h>

#include <type_traits>
#include <variant>
#include <vector>

namespace stagejit::semantics {

STAGEJIT_FUNC at::Tensor transpose(const ir::Transpose& k, const at::Tensor& x) {
  if (k.perm.empty() && x.dim() > 0) {
    std::vector<int64_t> reversed(static_cast<size_t>(x.dim()));
    for (int64_t d = 0; d < x.dim(); ++d) reversed[static_cast<size_t>(d)] = x.dim() - 1 - d;
    return x.permute(reversed);
  }
  return x.permute(k.perm);
}

STAGEJIT_FUNC std::vector<at::Tensor> run_pure(const ir::Node& n, const std::vector<at::Tensor>& in) {
  auto need = [&](std::size_t k) {
    STAGEJIT_CHECK_AS(CompileError, in.size() == k, "node ", n.describe(), " expects ", k,
                      " inputs, got ", in.size());
  };
  auto aten = [&](auto&& f) -> std::vector<at::Tensor> {
    try {
      return {f()};
    } catch (const c10::Error& e) {
      throw ShapeError(detail::str_cat("node ", n.describe(), ": ", e.what_without_backtrace()));
    }
  };
  auto contextual = [&](const auto& k) -> std::vector<at::Tensor> {
    using K = std::decay_t<decltype(k)>;
    detail::throw_error<CompileError>("node ", n.describe(), " (", ir::kind_name<K>(),
                                      ") needs its evaluator's context to run");
  };
  return std::visit(
      Overloaded{
          [&](const ir::Op& op) -> std::vector<at::Tensor> {
            return ops::run_forward(ops::def(op.schema()), in, detail::to_core_attributes(op.attributes));
          },
          [&](const ir::Constant& c) -> std::vector<at::Tensor> { return {c.value}; },
          [&](const ir::Undefined&) -> std::vector<at::Tensor> { return {at::Tensor()}; },
          [&](const ir::Transpose& k) { need(1); return aten([&] { return transpose(k, in[0]); }); },
          [&](const ir::Reshape& k) { need(1); return aten([&] { return reshape(k, in[0]); }); },
          [&](const ir::Gemm& k) { need(3); return aten([&] { return gemm(k, in[0], in[1], in[2]); }); },
          [&](const ir::HostOp& k) { return contextual(k); },
          [&](const ir::Eval& k) { return contextual(k); },
          [&](const ir::FusionGroup& k) { return contextual(k); },
          [&](const ir::Param& k) { return contextual(k); },
          [&](const ir::Return& k) { return contextual(k); },
      },
      n.kind());
}

}  // namespace stagejit::semantics

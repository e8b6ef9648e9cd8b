#pragma once
/// \file
/// What each IR node kind computes: the one home of node semantics for the evaluators
/// of IR. The closure compiler (closure/stage_closure.hpp) runs Transpose / Reshape /
/// Gemm through `transpose` / `reshape` / `gemm`, the fuser's node-by-node fallback
/// (`fusion::run_unfused`) runs nodes through `run_pure`, and the reference interpreter
/// (trace/interpret.hpp) runs `Op` through the same op table with autograd (`ops::apply`)
/// and refuses the kinds without a backward formula.
///
/// - `Op`: the op table's forward (`ops::run_forward`); with autograd, `ops::apply`.
/// - `Constant`: its value. `Undefined`: an undefined tensor.
/// - `Transpose`: `permute(perm)` (a view); `Reshape`: `reshape(shape)`; `Gemm` on
///   (A, B, C): `beta * C + alpha * (A @ B)` (`at::addmm`; with beta = 0, C is ignored,
///   NaN and all). These three come from ONNX-style graphs (parsed text) and have no
///   backward formula: evaluators run them without autograd.
/// - `HostOp`, `Eval`, `FusionGroup`, `Param`, `Return` need more than their inputs (a
///   host callable, a Handle, a compiled kernel, a graph input, the graph's outputs):
///   each evaluator gives them their context; `node_kind_is_pure` says which kinds do not
///   need one.
///
/// The longer functions' bodies are in ir/node_semantics-inl.hpp (core/config.hpp).

#include <stagejit/core/config.hpp>
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

/// `Transpose`: the input's dimensions permuted (a view); an empty `perm` reverses them
/// (ONNX's default, the seed era's `Transpose(%x)`).
STAGEJIT_FUNC at::Tensor transpose(const ir::Transpose& k, const at::Tensor& x);
/// `Reshape`: the input reshaped (a view where ATen can).
inline at::Tensor reshape(const ir::Reshape& k, const at::Tensor& x) { return x.reshape(k.shape); }
/// `Gemm` on (A, B, C): `beta * C + alpha * (A @ B)`.
inline at::Tensor gemm(const ir::Gemm& k, const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
  return at::addmm(c, a, b, k.beta, k.alpha);
}

/// True for the kinds whose outputs are a function of their tensor inputs alone.
template <class K>
inline constexpr bool is_pure_kind =
    std::is_same_v<K, ir::Op> || std::is_same_v<K, ir::Constant> || std::is_same_v<K, ir::Undefined> ||
    std::is_same_v<K, ir::Transpose> || std::is_same_v<K, ir::Reshape> || std::is_same_v<K, ir::Gemm>;

/// Runs a pure node (`is_pure_kind`) on tensors, without autograd: one tensor per output.
/// Throws `CompileError` naming the node for the other kinds (which need their
/// evaluator's context), what `ops::run_forward` throws for ops, and `ShapeError` for
/// ATen errors of Transpose / Reshape / Gemm.
STAGEJIT_FUNC std::vector<at::Tensor> run_pure(const ir::Node& n, const std::vector<at::Tensor>& in);

}  // namespace stagejit::semantics

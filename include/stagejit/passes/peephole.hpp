#pragma once
/// \file
/// `passes::fold_double_transposes`: `t(t(x))` -> `x`.
///
/// The backward of a linear layer `addmm(b, x, t(W))` reads `t(t(W))` (the gradient of a
/// transpose is a transpose), and a parameter gradient computed as `t(mm(...))` is
/// transposed back when it is returned, so every traced MLP or LSTM backward holds such
/// pairs. `t` of a tensor of at most 2 dimensions is its own inverse and a view, so
/// `t(t(x))` has `x`'s sizes, strides and storage: every use of it may read `x` instead.
/// The replaced value may sit in a later stage than `x` (the later stage then reads `x`
/// across stages, as it read the inner `t`). The `t` nodes left without uses are removed
/// by `eliminate_dead_code`. Handles are never touched. PyTorch's JIT peephole pass folds
/// the same pattern.

#include <stagejit/core/detail/bodies_begin.hpp>
#include <stagejit/ir/graph.hpp>

namespace stagejit::passes {

namespace detail {
inline bool is_plain_transpose(const ir::Node& n) {
  const auto* op = n.get_if<ir::Op>();
  if (!op || op->id() != OpId::t || !op->attributes.empty() || n.inputs().size() != 1 ||
      n.outputs().size() != 1 || n.input(0)->is_handle())
    return false;
  // at::t rejects more than 2 dimensions: a (parsed) graph saying so must keep failing.
  const ir::TensorType* in = n.input(0)->tensor_type();
  return !in || in->sizes.size() <= 2;
}
}  // namespace detail

/// Redirects the uses of every `t(t(x))` to `x` (file comment). Returns how many values
/// were redirected. Nodes are not removed; run `eliminate_dead_code` after it.
inline size_t fold_double_transposes(ir::Graph& graph) {
  size_t folded = 0;
  for (ir::Node* n : graph.nodes()) {
    if (!detail::is_plain_transpose(*n)) continue;
    ir::Node* inner = n->input(0)->node();
    if (!detail::is_plain_transpose(*inner)) continue;
    ir::Value* x = inner->input(0);
    ir::Value* out = n->output();
    if (!out->has_uses()) continue;
    out->replace_all_uses_with(x);
    ++folded;
  }
  return folded;
}

}  // namespace stagejit::passes
#include <stagejit/core/detail/bodies_end.hpp>

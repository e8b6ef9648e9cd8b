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

#include <stagejit/core/config.hpp>
#include <stagejit/ir/graph.hpp>

namespace stagejit::passes {

/// Redirects the uses of every `t(t(x))` to `x` (file comment). Returns how many values
/// were redirected. Nodes are not removed; run `eliminate_dead_code` after it.
STAGEJIT_FUNC size_t fold_double_transposes(ir::Graph& graph);

}  // namespace stagejit::passes

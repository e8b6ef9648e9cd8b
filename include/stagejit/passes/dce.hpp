#pragma once
/// \file
/// `passes::eliminate_dead_code`: removes nodes none of whose outputs is used.
///
/// Stage-aware by construction: liveness flows from the graph outputs of *every* stage
/// backwards through use lists, so a stage-0 value (or Handle) used by a later stage's
/// node that is live stays live; a HostOp whose Handle feeds a live Eval is kept. Kept
/// always: nodes with side effects (`ir::has_side_effects`: in-place and random ops).
/// A multi-output node (HostOp, Eval, ...) is kept whole while any output is used.
/// Graph inputs are never removed (they are the signature). FusionGroup subgraphs are
/// cleaned too (their outputs are all kept). Follows the seed's pass of the same name (docs/seed-system.md §1.8).

#include <stagejit/core/detail/bodies_begin.hpp>
#include <stagejit/ir/graph.hpp>

namespace stagejit::passes {

/// Removes dead nodes in place (see the file comment). Returns how many were removed.
inline size_t eliminate_dead_code(ir::Graph& graph) {
  size_t removed = 0;
  auto nodes = graph.nodes();
  for (auto it = nodes.rbegin(); it != nodes.rend(); ++it) {
    ir::Node* n = *it;
    if (auto fg = n->get_if<ir::FusionGroup>(); fg && fg->subgraph) removed += eliminate_dead_code(*fg->subgraph);
    bool used = n->has_side_effects();
    for (ir::Value* v : n->outputs()) used = used || v->has_uses();
    if (used) continue;
    n->destroy();
    ++removed;
  }
  return removed;
}

}  // namespace stagejit::passes
#include <stagejit/core/detail/bodies_end.hpp>

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

#include <stagejit/core/config.hpp>
#include <stagejit/ir/graph.hpp>

namespace stagejit::passes {

/// Removes dead nodes in place (see the file comment). Returns how many were removed.
STAGEJIT_FUNC size_t eliminate_dead_code(ir::Graph& graph);

}  // namespace stagejit::passes

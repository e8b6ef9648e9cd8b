#pragma once
/// \file
/// `passes::eliminate_common_subexpressions`: merges nodes that compute the same thing.
///
/// Two nodes are the same when their kinds are equal (`ir::kind_equal`: same op name and
/// attributes; Constants of equal dtype, device, sizes and values; Transpose/Reshape/Gemm
/// with equal fields; any two Undefined), they read the very same input values in the same
/// order, and their outputs have the same types. The later node's uses are redirected to
/// the earlier node and the later node is destroyed.
///
/// Across stages: nodes are visited in list order, where stages never decrease, and the
/// node kept is always the one of the *earlier* stage. A later-stage duplicate is replaced
/// by the earlier-stage value (which then crosses stages as a captured value); an
/// earlier-stage value is never made to depend on a later-stage one. Should the list not
/// be in stage order, a candidate of a later stage than the node at hand is not used.
///
/// Never merged: HostOp and Eval (opaque, their Handles are distinct closures),
/// FusionGroup, nodes with a Handle input or output, and nodes with side effects
/// (`ir::has_side_effects`). FusionGroup subgraphs are processed too.

#include <stagejit/core/config.hpp>
#include <cstddef>
#include <functional>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <stagejit/ir/graph.hpp>
#include <stagejit/ir/kinds.hpp>

namespace stagejit::passes {

/// Merges common subexpressions in place (see the file comment). Returns how many nodes
/// were removed.
STAGEJIT_FUNC size_t eliminate_common_subexpressions(ir::Graph& graph);

}  // namespace stagejit::passes

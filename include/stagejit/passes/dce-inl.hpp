#pragma once
/// \file
/// Bodies of passes/dce.hpp (core/config.hpp): compiled once in
/// src/compiled_bodies.cpp, or inline in every translation unit of a header-only build.
#include <stagejit/core/config.hpp>
#include <stagejit/passes/dce.hpp>
#include <stagejit/ir/graph.hpp>

#include <cstddef>

namespace stagejit::passes {

STAGEJIT_FUNC size_t eliminate_dead_code(ir::Graph& graph) {
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

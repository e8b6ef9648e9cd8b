#pragma once
/// \file
/// Bodies of passes/peephole.hpp (core/config.hpp): compiled once in
/// src/compiled_bodies.cpp, or inline in every translation unit of a header-only build.
#include <stagejit/core/config.hpp>
#include <stagejit/passes/peephole.hpp>
#include <stagejit/ir/graph.hpp>

#include <cstddef>

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

STAGEJIT_FUNC size_t fold_double_transposes(ir::Graph& graph) {
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

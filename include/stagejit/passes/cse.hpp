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

#include <stagejit/core/detail/bodies_begin.hpp>
#include <cstddef>
#include <functional>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <stagejit/ir/graph.hpp>
#include <stagejit/ir/kinds.hpp>

namespace stagejit::passes {

namespace detail {

inline bool cse_candidate(const ir::Node* n) {
  if (n->has_side_effects()) return false;
  if (!(n->is<ir::Op>() || n->is<ir::Constant>() || n->is<ir::Undefined>() || n->is<ir::Transpose>() ||
        n->is<ir::Reshape>() || n->is<ir::Gemm>()))
    return false;
  for (const ir::Value* v : n->inputs())
    if (v->is_handle()) return false;
  for (const ir::Value* v : n->outputs())
    if (v->is_handle()) return false;
  return true;
}

inline size_t cse_hash(const ir::Node* n) {
  size_t h = n->kind().index();
  auto mix = [&](size_t x) { h ^= x + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2); };
  if (auto op = n->get_if<ir::Op>()) mix(std::hash<const void*>{}(&op->schema()));
  if (auto c = n->get_if<ir::Constant>()) {
    mix(static_cast<size_t>(c->value.scalar_type()));
    for (auto s : c->value.sizes()) mix(static_cast<size_t>(s));
    // Small CPU constants (the scalars a trace records) also hash their bytes, so many
    // constants of one shape do not share a bucket (that made CSE quadratic).
    const at::Tensor& t = c->value;
    if (t.defined() && t.layout() == at::kStrided && t.has_storage() && t.device().is_cpu() &&
        !t.is_quantized() && t.is_contiguous() && t.numel() <= 64) {
      const auto* bytes = static_cast<const unsigned char*>(t.data_ptr());
      mix(std::hash<std::string_view>{}(
          std::string_view(reinterpret_cast<const char*>(bytes), t.numel() * t.element_size())));
    }
  }
  for (const ir::Value* v : n->inputs()) mix(v->id());
  mix(n->outputs().size());
  return h;
}

inline bool cse_equal(const ir::Node* a, const ir::Node* b) {
  if (a->inputs() != b->inputs() || a->outputs().size() != b->outputs().size()) return false;
  for (size_t i = 0; i < a->outputs().size(); ++i)
    if (!(a->output(i)->type() == b->output(i)->type())) return false;
  return ir::kind_equal(a->kind(), b->kind());
}

}  // namespace detail

/// Merges common subexpressions in place (see the file comment). Returns how many nodes
/// were removed.
inline size_t eliminate_common_subexpressions(ir::Graph& graph) {
  size_t removed = 0;
  std::unordered_multimap<size_t, ir::Node*> seen;
  const auto nodes = graph.nodes();
  seen.reserve(nodes.size());  // no rehashing while the table grows
  for (ir::Node* n : nodes) {
    if (auto fg = n->get_if<ir::FusionGroup>(); fg && fg->subgraph)
      removed += eliminate_common_subexpressions(*fg->subgraph);
    if (!detail::cse_candidate(n)) continue;
    size_t h = detail::cse_hash(n);
    ir::Node* keep = nullptr;
    auto [b, e] = seen.equal_range(h);
    for (auto it = b; it != e; ++it)
      if (it->second->stage() <= n->stage() && detail::cse_equal(it->second, n)) {
        keep = it->second;
        break;
      }
    if (!keep) {
      seen.emplace(h, n);
      continue;
    }
    n->replace_all_uses_with(keep);
    n->destroy();
    ++removed;
  }
  return removed;
}

}  // namespace stagejit::passes
#include <stagejit/core/detail/bodies_end.hpp>

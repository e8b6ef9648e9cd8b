#pragma once
/// \file
/// Bodies of passes/cse.hpp (core/config.hpp): compiled once in
/// src/compiled_bodies.cpp, or inline in every translation unit of a header-only build.
#include <stagejit/core/config.hpp>
#include <stagejit/passes/cse.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/ir/kinds.hpp>

#include <cstddef>
#include <functional>
#include <string_view>
#include <unordered_map>
#include <vector>

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

STAGEJIT_FUNC size_t eliminate_common_subexpressions(ir::Graph& graph) {
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
      if (graph.stage_reads(n->stage(), it->second->stage()) && detail::cse_equal(it->second, n)) {
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

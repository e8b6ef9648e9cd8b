#pragma once
/// \file
/// Bodies of passes/graph_fuser.hpp (core/config.hpp): compiled once in
/// src/compiled_bodies.cpp, or inline in every translation unit of a header-only build.
#include <stagejit/core/config.hpp>
#include <stagejit/passes/graph_fuser.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/ops/op_schema.hpp>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace stagejit::passes {

namespace detail {

STAGEJIT_FUNC bool is_fusable(const ir::Node& n) {
  const auto* op = n.get_if<ir::Op>();
  if (!op || n.outputs().size() != 1 || n.has_side_effects() || op->id() == OpId::to) return false;
  if (n.output(0)->is_handle()) return false;
  // Inputs of more than one non-bool dtype (a float tensor times a 0-dim double, as
  // ATen's type promotion allows): a kernel computes in one type, so such a node runs
  // alone through ATen, which promotes as eager does.
  std::optional<at::ScalarType> dtype;
  for (const ir::Value* v : n.inputs()) {
    const ir::TensorType* t = v->tensor_type();
    if (!t || t->dtype == at::kBool) continue;
    if (dtype && *dtype != t->dtype) return false;
    dtype = t->dtype;
  }
  // zeros_like and ones_like are not elementwise in the op table (they have no
  // derivative and read only their input's shape), but a kernel writes them as literals
  // (fusion/detail/codegen_ops).
  return op->schema().elementwise || op->id() == OpId::zeros_like || op->id() == OpId::ones_like;
}

STAGEJIT_FUNC bool worth_a_kernel_alone(const ir::Node& n) {
  const auto* op = n.get_if<ir::Op>();
  if (!op || op->id() != OpId::tanh || n.inputs().size() != 1) return false;
  const ir::TensorType* in = n.input(0)->tensor_type();
  const ir::TensorType* out = n.output(0)->tensor_type();
  return in && out && in->dtype == at::kFloat && out->dtype == at::kFloat && out->device.is_cpu() &&
         in->device.is_cpu();
}

inline int64_t int_attribute(const ir::Op& op, std::string_view key, int64_t fallback) {
  if (const ir::AttributeValue* v = op.attribute(key))
    if (auto i = std::get_if<int64_t>(v)) return *i;
  return fallback;
}

STAGEJIT_FUNC bool distribute_chunk(ir::Graph& graph, ir::Node* chunk) {
  const auto* cop = chunk->get_if<ir::Op>();
  if (!cop || cop->id() != OpId::chunk || chunk->inputs().size() != 1) return false;
  ir::Value* p = chunk->input(0);
  ir::Node* producer = p->node();
  if (!is_fusable(*producer) || producer->stage() != chunk->stage() || p->uses().size() != 1) return false;
  for (ir::Value* out : chunk->outputs())
    for (const ir::Use& u : out->uses())
      if (!is_fusable(*u.user) || u.user->stage() != chunk->stage()) return false;
  const ir::TensorType* pt = p->tensor_type();
  if (!pt || pt->sizes.empty()) return false;
  const int64_t rank = static_cast<int64_t>(pt->sizes.size());
  int64_t dim = int_attribute(*cop, "dim", 0);
  if (dim < 0) dim += rank;
  if (dim < 0 || dim >= rank) return false;
  std::vector<const ir::TensorType*> chunk_types;
  for (ir::Value* out : chunk->outputs()) {
    const ir::TensorType* t = out->tensor_type();
    if (!t || static_cast<int64_t>(t->sizes.size()) != rank) return false;
    chunk_types.push_back(t);
  }
  // For each operand: the dimension to chunk it along, or -1 when it is broadcast along `dim`.
  std::vector<int64_t> operand_dim;
  for (ir::Value* x : producer->inputs()) {
    const ir::TensorType* xt = x->tensor_type();
    if (!xt) return false;
    const int64_t xd = dim - (rank - static_cast<int64_t>(xt->sizes.size()));
    if (xd < 0 || (xt->sizes[xd] == 1 && pt->sizes[dim] != 1)) operand_dim.push_back(-1);
    else if (xt->sizes[xd] == pt->sizes[dim]) operand_dim.push_back(xd);
    else return false;
  }
  const size_t saved_stage = graph.current_stage();
  graph.set_current_stage(chunk->stage());
  const size_t k_count = chunk->outputs().size();
  std::vector<std::vector<ir::Value*>> pieces(producer->inputs().size());
  for (size_t i = 0; i < producer->inputs().size(); ++i) {
    ir::Value* x = producer->input(i);
    if (operand_dim[i] < 0) {
      pieces[i].assign(k_count, x);
      continue;
    }
    const ir::TensorType* xt = x->tensor_type();
    std::vector<ir::Type> types;
    types.reserve(k_count);  // ir::Type's move may throw (c10::SmallVector): no regrowth copies
    for (size_t k = 0; k < k_count; ++k) {
      ir::TensorType t = *xt;
      t.sizes[operand_dim[i]] = chunk_types[k]->sizes[dim];
      types.emplace_back(std::move(t));
    }
    ir::Op split = *cop;
    split.attributes.clear();
    split.attributes.emplace_back("chunks", int_attribute(*cop, "chunks", 1));
    split.attributes.emplace_back("dim", operand_dim[i]);
    ir::Node* c = graph.create(std::move(split), {x}, types);
    c->insert_before(chunk);
    c->set_location(chunk->location());
    pieces[i].assign(c->outputs().begin(), c->outputs().end());
  }
  for (size_t k = 0; k < k_count; ++k) {
    std::vector<ir::Value*> args;
    for (auto& piece : pieces) args.push_back(piece[k]);
    ir::Type t = ir::TensorType::contiguous(pt->dtype, chunk_types[k]->sizes, pt->device);
    ir::Node* per_chunk = graph.create(producer->kind(), args, {t});
    per_chunk->insert_before(chunk);
    per_chunk->set_location(producer->location());
    ir::Value* old = chunk->output(k);
    std::string name = old->name();
    old->replace_all_uses_with(per_chunk->output());
    old->set_name("");
    per_chunk->output()->set_name(name);
  }
  graph.set_current_stage(saved_stage);
  chunk->destroy();
  producer->destroy();
  return true;
}

}  // namespace detail

STAGEJIT_FUNC size_t fuse(ir::Graph& graph) {
  for (bool changed = true; changed;) {
    changed = false;
    for (ir::Node* n : graph.nodes())
      if (detail::distribute_chunk(graph, n)) {
        changed = true;
        break;
      }
  }
  const std::vector<ir::Node*> nodes = graph.nodes();
  // Per-node state in dense arrays indexed by node id (hash sets made the pass slow on
  // large graphs: cache misses and an allocation per anchor).
  size_t max_id = graph.return_node()->id();
  for (const ir::Node* n : nodes) max_id = std::max(max_id, n->id());
  for (const ir::Value* v : graph.inputs()) max_id = std::max(max_id, v->node()->id());
  constexpr size_t npos = static_cast<size_t>(-1);
  std::vector<size_t> pos(max_id + 1, npos);  // listed node -> its position
  for (size_t i = 0; i < nodes.size(); ++i) pos[nodes[i]->id()] = i;
  auto listed = [&](const ir::Node* n) { return n->id() <= max_id && pos[n->id()] != npos; };
  auto position = [&](const ir::Node* n) {
    return listed(n) ? pos[n->id()] : nodes.size();  // the Return node comes last
  };
  std::vector<size_t> placed_at(max_id + 1, npos);  // member of a group -> its anchor's position
  auto taken = [&](const ir::Node* n) { return n->id() <= max_id && placed_at[n->id()] != npos; };
  // Stamps: in_group[id] == stamp / queued[id] == stamp for the current anchor.
  std::vector<uint32_t> in_group(max_id + 1, 0), queued(max_id + 1, 0);
  uint32_t stamp = 0;
  auto is_member = [&](const ir::Node* n) { return n->id() <= max_id && in_group[n->id()] == stamp; };
  std::vector<std::vector<ir::Node*>> groups;
  std::vector<ir::Node*> heap;
  for (auto it = nodes.rbegin(); it != nodes.rend(); ++it) {
    ir::Node* anchor = *it;
    if (taken(anchor) || !detail::is_fusable(*anchor)) continue;
    ++stamp;
    std::vector<ir::Node*> members{anchor};
    in_group[anchor->id()] = stamp;
    const size_t anchor_pos = position(anchor);
    // Candidate producers, latest first (a max-heap on position). A candidate rejected
    // when popped can never become acceptable later: the only way would be for one of
    // its outside users (which come after it) to join the group, but every candidate
    // after it has already been decided and later members come before it.
    auto later = [&](const ir::Node* a, const ir::Node* b) { return position(a) < position(b); };
    heap.clear();
    auto push_producers = [&](const ir::Node* m) {
      for (ir::Value* v : m->inputs()) {
        ir::Node* p = v->node();
        if (!listed(p) || queued[p->id()] == stamp) continue;
        queued[p->id()] = stamp;
        heap.push_back(p);
        std::push_heap(heap.begin(), heap.end(), later);
      }
    };
    push_producers(anchor);
    while (!heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), later);
      ir::Node* p = heap.back();
      heap.pop_back();
      if (is_member(p) || taken(p) || !detail::is_fusable(*p) || p->stage() != anchor->stage())
        continue;
      bool ok = true, outside = false;
      for (const ir::Use& u : p->output()->uses()) {
        if (is_member(u.user)) continue;
        outside = true;
        // A user already in a group runs where that group is placed (its anchor).
        ok = ok && (taken(u.user) ? placed_at[u.user->id()] : position(u.user)) > anchor_pos;
      }
      if (!ok || (outside && !detail::compatible_sizes(p->output(), anchor->output()))) continue;
      members.push_back(p);
      in_group[p->id()] = stamp;
      push_producers(p);
    }
    if (members.size() < 2 && !detail::worth_a_kernel_alone(*anchor)) continue;
    for (ir::Node* m : members) placed_at[m->id()] = anchor_pos;
    std::sort(members.begin(), members.end(),
              [&](const ir::Node* a, const ir::Node* b) { return position(a) < position(b); });
    groups.push_back(std::move(members));
  }
  // Merging (Note [Merging fusion groups]): an earlier group joins a later one of the
  // same stage and iteration shape when it feeds it or shares an input with it, and
  // nothing else reads its values before the later group's anchor.
  if (groups.size() > 1) {
    std::sort(groups.begin(), groups.end(), [&](const std::vector<ir::Node*>& a, const std::vector<ir::Node*>& b) {
      return position(a.back()) < position(b.back());
    });
    std::vector<size_t> group_at(nodes.size() + 1, npos);  // anchor position -> group index
    for (size_t k = 0; k < groups.size(); ++k) group_at[position(groups[k].back())] = k;
    auto group_of = [&](const ir::Node* n) { return taken(n) ? group_at[placed_at[n->id()]] : npos; };
    // Outer inputs of a group (values its members read that no member makes), and
    // whether it may merge at all: every escaping value and every outer input has a known
    // tensor type, one iteration shape and device, and one non-bool dtype.
    struct Info {
      bool ok = false;
      std::vector<ir::Value*> inputs;
      size_t outputs = 0;
      const ir::TensorType* shape = nullptr;  // the anchor's type
      at::ScalarType dtype = at::kBool;       // the non-bool dtype of the inputs
    };
    auto info_of = [&](size_t k) {
      Info info;
      const auto& members = groups[k];
      info.shape = members.back()->output()->tensor_type();
      if (!info.shape) return info;
      bool have_dtype = false;
      for (ir::Node* m : members) {
        for (ir::Value* v : m->inputs()) {
          if (group_of(v->node()) == k) continue;
          if (std::find(info.inputs.begin(), info.inputs.end(), v) != info.inputs.end()) continue;
          const ir::TensorType* t = v->tensor_type();
          if (!t || t->device != info.shape->device) return info;
          if (t->dtype != at::kBool) {
            if (have_dtype && t->dtype != info.dtype) return info;
            info.dtype = t->dtype;
            have_dtype = true;
          }
          info.inputs.push_back(v);
        }
        bool escapes = false;
        for (const ir::Use& u : m->output()->uses()) escapes = escapes || group_of(u.user) != k;
        if (!escapes) continue;
        ++info.outputs;
        const ir::TensorType* t = m->output()->tensor_type();
        if (!t || t->sizes != info.shape->sizes || t->device != info.shape->device) return info;
      }
      info.ok = have_dtype;
      return info;
    };
    std::vector<Info> infos;
    infos.reserve(groups.size());
    for (size_t k = 0; k < groups.size(); ++k) infos.push_back(info_of(k));
    constexpr size_t kMaxScannedUses = 64;  // per shared input: keeps the search linear
    constexpr size_t kMaxTensors = 24;      // inputs + outputs of a merged group (kept short; kMaxCudaArgs is 128)
    std::vector<size_t> candidates;
    for (size_t l = 0; l < groups.size(); ++l) {
      if (groups[l].empty() || !infos[l].ok) continue;
      const size_t pl = position(groups[l].back());
      for (bool merged = true; merged;) {
        merged = false;
        candidates.clear();
        for (ir::Value* v : infos[l].inputs) {
          if (size_t e = group_of(v->node()); e != npos && e < l) candidates.push_back(e);  // feeds l
          size_t scanned = 0;
          for (const ir::Use& u : v->uses()) {  // shares the input with l
            if (++scanned > kMaxScannedUses) break;
            if (size_t e = group_of(u.user); e != npos && e < l) candidates.push_back(e);
          }
        }
        std::sort(candidates.begin(), candidates.end());
        candidates.erase(std::unique(candidates.begin(), candidates.end()), candidates.end());
        for (auto it = candidates.rbegin(); it != candidates.rend(); ++it) {
          const size_t e = *it;
          const Info& ie = infos[e];
          const Info& il = infos[l];
          if (groups[e].empty() || !ie.ok || groups[e].back()->stage() != groups[l].back()->stage() ||
              ie.shape->sizes != il.shape->sizes || ie.shape->device != il.shape->device || ie.dtype != il.dtype)
            continue;
          if (ie.inputs.size() + ie.outputs + il.inputs.size() + il.outputs > kMaxTensors) continue;
          // Every reader of e's values outside e and l runs after l's anchor.
          bool ok = true;
          for (ir::Node* m : groups[e]) {
            for (const ir::Use& u : m->output()->uses()) {
              const size_t g = group_of(u.user);
              if (g == e || g == l) continue;
              ok = ok && (taken(u.user) ? placed_at[u.user->id()] : position(u.user)) > pl;
            }
            if (!ok) break;
          }
          if (!ok) continue;
          for (ir::Node* m : groups[e]) placed_at[m->id()] = pl;
          std::vector<ir::Node*> all;
          all.reserve(groups[e].size() + groups[l].size());
          std::merge(groups[e].begin(), groups[e].end(), groups[l].begin(), groups[l].end(), std::back_inserter(all),
                     [&](const ir::Node* a, const ir::Node* b) { return position(a) < position(b); });
          groups[l] = std::move(all);
          groups[e].clear();
          infos[e] = Info{};
          infos[l] = info_of(l);
          merged = infos[l].ok;
          break;
        }
      }
    }
    groups.erase(std::remove_if(groups.begin(), groups.end(), [](const auto& m) { return m.empty(); }),
                 groups.end());
  }
  // A node is a member of the group being made when it was placed at that group's
  // anchor (anchors have distinct positions).
  detail::GroupScratch scratch;
  for (const auto& members : groups) {
    const size_t at = placed_at[members.back()->id()];
    detail::make_group(
        graph, members,
        [&](const ir::Node* n) { return taken(n) && placed_at[n->id()] == at; }, scratch);
  }
  return groups.size();
}

}  // namespace stagejit::passes

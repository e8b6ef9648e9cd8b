#pragma once
/// \file
/// `passes::rematerialize_cross_stage`: a later stage recomputes cheap elementwise values
/// of earlier stages from values it reads anyway, instead of reading them saved.
///
/// Note [Cross-stage rematerialisation]
/// A value made in stage s and read by a node of stage t > s crosses stages: the call of
/// stage s saves it and the call of stage t reads it back (closure/plan.hpp, captures).
/// On tall tensors both are trips through memory (a PINN's [10 000, 20] values, 800 KB
/// each: bench/pinn.md), and CSE makes more of them, since it keeps the earlier stage's
/// copy of a value both stages compute (passes/cse.hpp). So, for each stage t >= 1, in
/// node order, each value v of an earlier stage that a node of stage t reads is
/// recomputed in stage t when v's node is *cheap*: an Op whose schema is elementwise,
/// without side effects (nothing random or in place), with one output of at least
/// `min_elements` elements, no Handle input or output; and each of its inputs is
/// - a value stage t reads anyway (an earlier value or graph input with a stage-t use),
///   or one recomputed in stage t before,
/// - a Constant (copied too), or
/// - the output of another cheap node whose inputs qualify in turn (up to 8 nodes deep:
///   `1 - h * h` when stage t reads h and the saved `1 - h * h` but not `h * h`).
/// Not copied: a value stage t returns (it crosses anyway) or that a stage-t node with
/// side effects reads (an in-place op must write the value later stages see). The
/// copies are placed before stage t's first node and stage t's uses of v read the copy.
/// No value is added to what stage t reads and v is removed, and when no other stage
/// reads v, its own stage stops saving it (DCE removes it when nothing reads it).
/// The cost is the recomputation, a few fused elementwise ops per element in stage t's
/// kernels, against a write and a read of v. This is a greedy form of the
/// recompute-over-save choice of AOTAutograd's min-cut partitioner (functorch's
/// `min_cut_rematerialization_partition`) that never makes a new value cross stages.
/// Measured on the Burgers PINN step (bench/pinn.md, float, N_f = 10 000): the row
/// values the staged step's stages write drop from 58 to 26 MB and those they read back
/// from 108 to 64 MB; the step goes from 1.79x to 2.03-2.12x libtorch eager.
///
/// Requires the node list in stage order (every stage's nodes after the earlier
/// stages'); a graph not in that order is left as it is (returns 0).

#include <stagejit/core/detail/bodies_begin.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/ir/kinds.hpp>
#include <stagejit/passes/dce.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <unordered_map>
#include <vector>

namespace stagejit::passes {

namespace detail {

inline bool rematerializable(const ir::Node& n, int64_t min_elements) {
  const auto* op = n.get_if<ir::Op>();
  if (!op || n.outputs().size() != 1 || n.has_side_effects() || !op->schema().elementwise) return false;
  const ir::TensorType* t = n.output(0)->tensor_type();
  if (n.output(0)->is_handle() || !t) return false;
  int64_t numel = 1;
  for (int64_t s : t->sizes) numel *= s;
  if (numel < min_elements) return false;
  for (const ir::Value* v : n.inputs())
    if (v->is_handle()) return false;
  return true;
}

}  // namespace detail

/// Copies cheap elementwise values of earlier stages into the later stages that read
/// them (Note [Cross-stage rematerialisation]), then removes dead nodes. Returns how
/// many (value, later stage) pairs now read a copy instead of the saved value. Only values of at least `min_elements` elements (by their
/// traced sizes) are copied: a small one costs less to save than an extra op per call
/// where no kernel takes it in.
inline std::size_t rematerialize_cross_stage(ir::Graph& g, int64_t min_elements = 16384) {
  constexpr int kMaxDepth = 8;
  const std::vector<ir::Node*> nodes = g.nodes();
  for (std::size_t i = 1; i < nodes.size(); ++i)
    if (nodes[i]->stage() < nodes[i - 1]->stage()) return 0;
  std::size_t copies = 0, replaced = 0;
  for (std::size_t t = 1; t < g.num_stages(); ++t) {
    ir::Node* first = nullptr;
    for (ir::Node* n : nodes)
      if (n->stage() == t) {
        first = n;
        break;
      }
    if (!first) continue;
    auto read_by_t = [&](const ir::Value* v) {
      for (const ir::Use& u : v->uses())
        if (u.user != g.return_node() && u.user->stage() == t) return true;
      return false;
    };
    // A value stage t returns keeps crossing whatever its readers do; a reader that
    // writes in place must keep writing the value the later stages see.
    auto worth_copying = [&](const ir::Value* v) {
      for (const ir::Use& u : v->uses()) {
        if (u.user == g.return_node() ? g.output_stage(u.offset) == t
                                       : u.user->stage() == t && u.user->has_side_effects())
          return false;
      }
      return true;
    };
    // What stage t can read without reading more: earlier values it reads, and copies.
    std::unordered_map<const ir::Value*, ir::Value*> available;
    for (ir::Value* v : g.inputs())
      if (v->stage() < t && read_by_t(v)) available[v] = v;
    for (ir::Node* n : nodes) {
      if (n->stage() >= t) break;
      for (ir::Value* o : n->outputs())
        if (read_by_t(o)) available[o] = o;
    }
    struct StageGuard {  // the graph's current stage back as it was, also on a throw
      ir::Graph& g;
      std::size_t saved;
      ~StageGuard() { g.set_current_stage(saved); }
    } guard{g, g.current_stage()};
    g.set_current_stage(t);
    // Values found not computable in stage t, by the depth left when they failed (a
    // failure with more depth left covers any with less).
    std::unordered_map<const ir::Value*, int> failed;
    // `v` in stage t: itself when t reads it, else a copy of its node made from copies
    // of its inputs (up to `kMaxDepth` nodes deep); null when some leaf is not available.
    std::function<ir::Value*(ir::Value*, int)> in_stage_t = [&](ir::Value* v, int depth) -> ir::Value* {
      if (auto it = available.find(v); it != available.end()) return it->second;
      ir::Node* n = v->node();
      if (n->is<ir::Constant>()) {
        ir::Node* c = g.create(n->kind(), {}, {v->type()});
        c->insert_before(first);
        ++copies;
        return available[v] = c->output();
      }
      if (depth == 0 || n->stage() >= t || !detail::rematerializable(*n, min_elements)) return nullptr;
      if (auto f = failed.find(v); f != failed.end() && f->second >= depth) return nullptr;
      std::vector<ir::Value*> args;
      for (ir::Value* in : n->inputs()) {
        ir::Value* a = in_stage_t(in, depth - 1);
        if (!a) {
          failed[v] = std::max(failed[v], depth);
          return nullptr;
        }
        args.push_back(a);
      }
      ir::Node* copy = g.create(n->kind(), args, {v->type()});
      copy->set_location(n->location());
      copy->insert_before(first);
      ++copies;
      return available[v] = copy->output();
    };
    for (ir::Node* n : nodes) {
      if (n->stage() >= t) break;
      if (!detail::rematerializable(*n, min_elements) || !read_by_t(n->output(0)) || !worth_copying(n->output(0)))
        continue;
      ir::Value* out = n->output(0);
      available.erase(out);  // read by t, so listed as itself: make the copy instead
      ir::Value* copy = in_stage_t(out, kMaxDepth);
      if (!copy) {
        available[out] = out;
        continue;
      }
      const auto uses = out->uses();
      for (const ir::Use& u : uses)
        if (u.user != g.return_node() && u.user->stage() == t) u.user->replace_input(u.offset, copy);
      ++replaced;
    }
  }
  if (copies) eliminate_dead_code(g);  // originals nothing reads now; copies a failed chain left
  return replaced;
}

}  // namespace stagejit::passes
#include <stagejit/core/detail/bodies_end.hpp>

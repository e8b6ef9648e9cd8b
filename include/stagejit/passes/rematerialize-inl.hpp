#pragma once
/// \file
/// Bodies of passes/rematerialize.hpp (core/config.hpp): compiled once in
/// src/compiled_bodies.cpp, or inline in every translation unit of a header-only build.
#include <stagejit/core/config.hpp>
#include <stagejit/passes/rematerialize.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/ir/kinds.hpp>
#include <stagejit/passes/dce.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace stagejit::passes {

namespace detail {

// Elementwise ops whose recomputation costs more than reading the saved value back:
// - a logarithm, erf or expm1 inside (SLEEF's u10 log1p, erf and expm1 run several times
//   the cost of its exp). Where such a copy lands outside a kernel it runs op by op
//   through ATen: softplus, recomputed in the force field's stage variants, took its
//   staged step from 1.48x to 1.28x libtorch (bench/higher_order.md, "Regions from 256
//   rows").
// - silu, sin and cos, whose derivatives are written in their input (silu's `s (1 + z (1 -
//   s))` with `s = sigmoid(z)`, sin's `cos(z)`), and the exp, sigmoid or tanh of a costly
//   op's input z, up to two elementwise steps from z (`rematerializable` below): what
//   those backwards build from z (silu's and softplus's sigmoid(z), elu's exp(z), gelu's
//   exp(-z*z/2)). Each later stage that recomputed them paid a SLEEF exp or sin per
//   element again, in row tiles where that exp is the cost: the joint backward of a SiLU
//   PINN recomputed ten values of each layer, two sigmoids among them, that stages 1 and
//   2 had already made (bench/higher_order.md, "Session of 2026-12-07, 10:40"); with
//   elu's and gelu's exps kept saved too, a GELU PINN's staged step trails its whole loss
//   by 5-12 points less (bench/higher_order.md, "The exp, sigmoid and tanh of a costly
//   op's input stay saved").
// Any other sigmoid, exp and tanh stay cheap: their derivatives are written in their
// outputs (`h (1 - h)`, `1 - h * h`), so a later stage rebuilds only the value itself, and
// where that happens in a memory-bound kernel it is free: bench/fusion's `tanh(a*b + c) *
// sigmoid(a)` backward recomputes sigmoid(a) from a, and keeping it saved instead took its
// fused forward + backward from 44 to 57 ms.
inline bool costly_to_recompute(OpId id) {
  switch (id) {
    case OpId::softplus:
    case OpId::log:
    case OpId::erf:
    case OpId::gelu:
    case OpId::elu:
    case OpId::silu:
    case OpId::sin:
    case OpId::cos:
      return true;
    default:
      return false;
  }
}

// The exp, sigmoid and tanh nodes a costly op's backward builds from that op's input z
// (Note above: silu's and softplus's sigmoid(z), elu's exp(z), gelu's exp(-z*z/2)): those
// whose input is read by a costly op, or is at most two elementwise Op steps from such a
// read (the distance of a value is 0 when a costly op reads it, else 1 + the least distance
// of its producer's inputs when that producer is an elementwise Op). Taken once, on the
// graph as it comes in, in node order: one pass, and independent of the copies made later.
inline std::unordered_set<const ir::Node*> kept_for_costly_backward(const ir::Graph& g) {
  constexpr int kReach = 2, kFar = kReach + 1;
  std::unordered_map<const ir::Value*, int> distance;
  auto read_by_costly = [](const ir::Value* v) {
    for (const ir::Use& u : v->uses())
      if (const auto* user = u.user->get_if<ir::Op>(); user && costly_to_recompute(user->id())) return true;
    return false;
  };
  auto distance_of = [&](const ir::Value* v) {
    auto it = distance.find(v);
    return it == distance.end() ? kFar : it->second;
  };
  for (const ir::Value* v : g.inputs())
    if (read_by_costly(v)) distance[v] = 0;
  std::unordered_set<const ir::Node*> kept;
  for (const ir::Node* n : g.nodes()) {
    const auto* op = n->get_if<ir::Op>();
    int from_inputs = kFar;
    if (op && op->schema().elementwise)
      for (const ir::Value* in : n->inputs()) from_inputs = std::min(from_inputs, distance_of(in) + 1);
    if (op && (op->id() == OpId::sigmoid || op->id() == OpId::exp || op->id() == OpId::tanh) &&
        n->inputs().size() == 1 && distance_of(n->inputs()[0]) <= kReach)
      kept.insert(n);
    for (const ir::Value* o : n->outputs()) {
      const int d = read_by_costly(o) ? 0 : from_inputs;
      if (d <= kReach) distance[o] = d;
    }
  }
  return kept;
}

/// `kept`: from `kept_for_costly_backward`.
inline bool rematerializable(const ir::Node& n, int64_t min_elements, const std::unordered_set<const ir::Node*>& kept) {
  const auto* op = n.get_if<ir::Op>();
  if (!op || n.outputs().size() != 1 || n.has_side_effects() || !op->schema().elementwise) return false;
  if (costly_to_recompute(op->id()) || kept.count(&n)) return false;
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

STAGEJIT_FUNC std::size_t rematerialize_cross_stage(ir::Graph& g, int64_t min_elements) {
  constexpr int kMaxDepth = 8;
  const std::vector<ir::Node*> nodes = g.nodes();
  for (std::size_t i = 1; i < nodes.size(); ++i)
    if (nodes[i]->stage() < nodes[i - 1]->stage()) return 0;
  std::size_t copies = 0, replaced = 0;
  const std::unordered_set<const ir::Node*> kept = detail::kept_for_costly_backward(g);
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
      if (depth == 0 || n->stage() >= t) return nullptr;
      if (auto f = failed.find(v); f != failed.end() && f->second >= depth) return nullptr;
      if (!detail::rematerializable(*n, min_elements, kept)) return nullptr;
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
      if (n->outputs().size() != 1 || !read_by_t(n->output(0)) || !detail::rematerializable(*n, min_elements, kept) ||
          !worth_copying(n->output(0)))
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

#pragma once
/// \file
/// Bodies of passes/joint_siblings.hpp (core/config.hpp): compiled once in
/// src/compiled_bodies.cpp, or inline in every translation unit of a header-only build.
#include <stagejit/core/config.hpp>
#include <stagejit/passes/joint_siblings.hpp>
#include <stagejit/ir/graph.hpp>
#include <stagejit/ir/kinds.hpp>

#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <functional>
#include <string_view>
#include <vector>

namespace stagejit::passes {

namespace detail {

// Note [Joint siblings]: whether `n` is linear in its inputs for which `grad(v)` holds
// (the gradients flowing through the joint stage) jointly, the other inputs fixed: sums of
// copies may then be taken before `n` instead of after it. Unknown ops: false.
template <class Grad>
bool linear_in_gradients(const ir::Node& n, Grad&& grad) {
  const ir::Op* op = n.get_if<ir::Op>();
  if (!op) return false;
  const std::size_t k = n.inputs().size();
  auto g = [&](std::size_t i) { return i < k && grad(n.input(i)); };
  auto scalar = [&](std::string_view key, double fallback) {
    if (const ir::AttributeValue* v = op->attribute(key))
      if (auto d = ir::attribute_as<double>(*v)) return *d;
    return fallback;
  };
  std::size_t factors = 0;  // gradient operands of a product
  switch (op->id()) {
    case OpId::add: case OpId::sub: case OpId::rsub:
      return k == 2 || scalar("other", 0) == 0;  // x + c is affine, not linear
    case OpId::neg: case OpId::sum: case OpId::mean: case OpId::sum_to_size: case OpId::expand:
    case OpId::reshape: case OpId::view: case OpId::t: case OpId::transpose: case OpId::permute:
    case OpId::flatten: case OpId::unsqueeze: case OpId::squeeze: case OpId::narrow: case OpId::select:
    case OpId::split: case OpId::chunk: case OpId::cat: case OpId::to: case OpId::zeros_like:
    case OpId::index_select: case OpId::gather: case OpId::index_add: case OpId::scatter_add:
      return true;
    case OpId::mul: case OpId::mm: case OpId::matmul: case OpId::bmm: case OpId::cross:
    case OpId::convolution: case OpId::convolution_weight_backward: case OpId::convolution_input_backward:
      for (std::size_t i = 0; i < std::min<std::size_t>(k, 2); ++i) factors += g(i);
      return factors <= 1;
    case OpId::addmm:
      return !(g(1) && g(2));
    case OpId::div:
      return !g(1);
    case OpId::where:
      return !g(0);
    case OpId::masked_fill:
      return k == 2 && !g(1) && scalar("value", 1) == 0;
    case OpId::nll_loss_backward: case OpId::avg_pool2d_backward: case OpId::adaptive_avg_pool2d_backward:
    case OpId::max_pool2d_with_indices_backward:
      for (std::size_t i = 1; i < k; ++i)
        if (g(i)) return false;
      return true;
    default:
      return false;
  }
}

}  // namespace detail

STAGEJIT_FUNC std::size_t add_joint_siblings(ir::Graph& g, std::size_t last_gradients,
                                             const std::vector<char>& seed_outputs, std::size_t copies) {
  const std::size_t J = g.joint_stage();
  if (J < 3 || copies == 0 || last_gradients == 0 || g.joint_siblings().copies != 0) return 0;
  const std::size_t sib = J - 2;  // stage k-1, whose values differ between siblings
  const std::vector<ir::Value*> inputs = g.stage_inputs(J);
  const std::vector<ir::Value*> outputs = g.stage_outputs(J);
  if (last_gradients > inputs.size() || seed_outputs.size() != outputs.size()) return 0;
  const std::size_t first_last = inputs.size() - last_gradients;

  // Per value (dense by id): depends on sibling data (S), on the other members'
  // gradients (R), on the last member's gradients (A); a stage k-1 value that depends
  // on stage k-1's inputs (Seed).
  enum : uint8_t { kS = 1, kR = 2, kA = 4, kSeed = 8 };
  const std::size_t bound = g.id_bound();
  std::vector<uint8_t> f(bound, 0);
  for (std::size_t i = 0; i < inputs.size(); ++i) f[inputs[i]->id()] = i >= first_last ? (kS | kA) : kR;
  for (ir::Value* v : g.stage_inputs(sib)) f[v->id()] |= kSeed | kS;
  const std::vector<ir::Node*> nodes = g.nodes();
  for (ir::Node* n : nodes) {
    if (n->stage() != sib) continue;
    bool seed = false;
    for (ir::Value* in : n->inputs()) seed = seed || (f[in->id()] & kSeed);
    if (seed)
      for (ir::Value* out : n->outputs()) f[out->id()] |= kSeed | kS;
  }
  // A value of T: sibling data, and no other member's gradient in it.
  auto of_t = [&](const ir::Value* v) { return (f[v->id()] & kS) && !(f[v->id()] & kR); };

  std::vector<ir::Node*> t_nodes;
  std::vector<char> in_t(bound, 0);  // by node id
  std::vector<ir::Value*> ties;      // stage k-1 values T reads, in first-use order
  std::vector<char> tied(bound, 0);  // 1: tied, 2: a transpose recomputed in the copies
  // A stage k-1 value T reads becomes a tie, but a transpose of one is recomputed in the
  // copies from its tied operand: the row-tiled regions read `mm(t(X), Y)` with X a row
  // value as a reduction over the rows, which a transposed input would hide.
  std::function<void(ir::Value*)> tie = [&](ir::Value* v) {
    if (v->stage() != sib || !(f[v->id()] & kSeed) || tied[v->id()]) return;
    const ir::Node* p = v->node();
    const ir::Op* op = p->get_if<ir::Op>();
    if (op && (op->id() == OpId::t || op->id() == OpId::transpose) && p->inputs().size() == 1 &&
        p->outputs().size() == 1) {
      tied[v->id()] = 2;
      tie(p->input(0));
      return;
    }
    tied[v->id()] = 1;
    ties.push_back(v);
  };
  for (ir::Node* n : nodes) {
    if (n->stage() != J) continue;
    uint8_t acc = 0;
    for (ir::Value* in : n->inputs()) acc |= f[in->id()] & (kS | kR | kA);
    for (ir::Value* out : n->outputs()) f[out->id()] = acc;
    if (!(acc & kS) || (acc & kR)) continue;
    // A node of T: cloned per copy.
    if (!n->is<ir::Op>() || n->has_side_effects()) return 0;
    t_nodes.push_back(n);
    in_t[n->id()] = 1;
    for (ir::Value* in : n->inputs()) tie(in);
  }
  if (t_nodes.empty()) return 0;
  // Every other read of a value of T reads a gradient contribution (linear in the last
  // member's gradients), where summing the copies in is exact.
  for (ir::Node* n : nodes) {
    if (n->stage() != J || in_t[n->id()]) continue;
    for (ir::Value* in : n->inputs())
      if (of_t(in) && !(f[in->id()] & kA)) return 0;
  }
  for (std::size_t i = 0; i < outputs.size(); ++i)
    if (!seed_outputs[i] && of_t(outputs[i]) && !(f[outputs[i]->id()] & kA)) return 0;
  // Every node on a path from the last member's gradients is linear in the gradients it
  // reads (a backward is linear in its incoming gradients; checked op by op, not assumed).
  auto is_gradient = [&](const ir::Value* v) { return (f[v->id()] & (kA | kR)) != 0; };
  for (ir::Node* n : nodes) {
    if (n->stage() != J) continue;
    bool reads_last = false;
    for (ir::Value* in : n->inputs()) reads_last = reads_last || (f[in->id()] & kA);
    if (reads_last && !detail::linear_in_gradients(*n, is_gradient)) return 0;
  }

  // The copies: new stage-J inputs (the sibling's gradients, then its values of `ties`)
  // and a clone of T reading them, placed after each original node.
  const std::size_t saved_stage = g.current_stage();
  g.set_current_stage(J);
  std::vector<std::vector<ir::Value*>> maps(copies, std::vector<ir::Value*>(bound, nullptr));
  ir::Node* first_j = nullptr;
  for (ir::Node* n : nodes)
    if (n->stage() == J) {
      first_j = n;
      break;
    }
  for (std::size_t j = 0; j < copies; ++j) {
    auto& m = maps[j];
    for (std::size_t i = first_last; i < inputs.size(); ++i) m[inputs[i]->id()] = g.add_input(inputs[i]->type(), J);
    for (ir::Value* e : ties) m[e->id()] = g.add_input(e->type(), J);
    std::function<ir::Value*(ir::Value*)> lookup = [&](ir::Value* v) -> ir::Value* {
      if (v->id() < m.size() && m[v->id()]) return m[v->id()];
      if (v->id() >= tied.size() || tied[v->id()] != 2) return v;
      // A transpose of a tie: recomputed at the start of stage J.
      ir::Node* c = g.create_clone(*v->node(), lookup);
      c->set_stage(J);
      c->insert_before(first_j);
      return m[v->id()] = c->output();
    };
    for (ir::Node* n : t_nodes) {
      ir::Node* c = g.create_clone(*n, lookup);
      c->set_location(n->location());
      c->insert_after(n);
      for (std::size_t o = 0; o < n->outputs().size(); ++o) m[n->output(o)->id()] = c->output(o);
    }
  }
  // Reads of T's values outside T read the sums.
  std::vector<ir::Value*> sums(bound, nullptr);
  auto summed = [&](ir::Value* v, ir::Node* before) {
    if (sums[v->id()]) return sums[v->id()];
    ir::Value* acc = v;
    for (std::size_t j = 0; j < copies; ++j) {
      ir::Node* a = g.create(ir::Op(OpId::add), {acc, maps[j][v->id()]}, {v->type()});
      a->insert_before(before);
      acc = a->output();
    }
    return sums[v->id()] = acc;
  };
  for (ir::Node* n : nodes) {
    if (n->stage() != J || in_t[n->id()]) continue;
    for (std::size_t i = 0; i < n->inputs().size(); ++i)
      if (of_t(n->input(i))) n->replace_input(i, summed(n->input(i), n));
  }
  const std::size_t first_output = g.outputs().size() - outputs.size();  // J is the last stage
  for (std::size_t i = 0; i < outputs.size(); ++i)
    if (!seed_outputs[i] && of_t(outputs[i]))
      g.return_node()->replace_input(first_output + i, summed(outputs[i], g.return_node()));
  // The tie outputs (see the Note), then the layout.
  for (ir::Value* e : ties) g.register_output(e, J);
  g.set_joint_siblings({copies, last_gradients, ties.size(), outputs.size()});
  g.set_current_stage(saved_stage);
  return copies;
}

}  // namespace stagejit::passes
